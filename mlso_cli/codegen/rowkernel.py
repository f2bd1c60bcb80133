"""One kernel for a row reduction and its row-wise reader (rowfuse.py decides which): planned,
then printed.

A team owns a row at a time (grid-stride over the rows): its threads stride the row folding the
reduction's input, an all-reduce leaves the result in every thread, and the threads then stride
the same row again writing the reader's value, the reduced value read from a register
(Emitter.known), the row's inputs re-read from memory (they were just read: cached). One thread
also stores the reduced value in its buffer, then the team synchronises, so a read the register
does not serve still finds the value in memory.

The team is a warp (a shuffle all-reduce; no shared memory, no block barrier) when the rows alone
give the GPU enough warps in flight. With few long rows it is the whole block, one row per block
(a block all-reduce through NT/32 floats of shared memory). Why: a norm before a projection at
128 tokens has 128 rows of 2048-3072; a warp per row left one warp per SM walking 64-96
dependent loads, and the kernel took 10.7 us (Llama-1B width) and 20 us (Phi-3) on an H100,
where the DRAM floor is under 1 us (benchmarks/kernel_profile.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlso_cli.codegen.blocklayout import SM_COUNT_HINT
from mlso_cli.codegen.cfmt import CTYPE, Code, Coords, Names, c_float, canon, decompose
from mlso_cli.codegen.emitter import Flat
from mlso_cli.codegen.kernels import GRID_CAP, stored_value
from mlso_cli.codegen.program import Kernel
from mlso_cli.codegen.scale import BufferScale, Storage, Val
from mlso_cli.codegen.site import KernelSite, site
from mlso_cli.codegen.synthetic import Staged
from mlso_cli.codegen.teams import LOOP_VAR, Pass, emit_passes
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import Op

if TYPE_CHECKING:
    from mlso_cli.codegen.lower import Lowering

ROW_WARPS = 8
"""Most warps (rows in flight) per block; fewer when the rows would not fill the SMs."""
MIN_PER_THREAD = 2
"""Fewest elements of a row per thread when a block shares the row."""
BLOCK_THREADS_MAX = 512
BLOCK_ROW_THREADS = 256
"""Threads per row when a block shares it (BLOCK_THREADS_MAX for FEW_ROWS rows or fewer)."""
FEW_ROWS = 16
WARP_ROW_LENGTH_MAX = 511
"""Rows this short keep a warp each (at most 16 elements a lane): no measurement says a block
would do better there, and a warp needs no barrier."""


@dataclass(frozen=True)
class RowKernelPlan:
    reduce: Node
    value: Node
    """The node the kernel writes after the reduction (an elementwise root or a staged operand)."""
    op: str
    """"sum" or "max" (a mean divides the sum by the length)."""
    length: int
    rows: int
    threads: int
    """The block's threads."""
    team: int
    """Threads per row: 32 (a warp) or `threads` (the block)."""
    grid: tuple[int, int, int]
    row: Coords
    """The reduction's coordinates at row `o`."""
    inner: Coords
    """The reduction input's coordinates along row `o` at teams.LOOP_VAR."""
    element: Coords
    """The value's coordinates at element `j` of row `o`."""
    what: str


def plan_row(storage: Mapping[Node, Storage], reduce: Node, value: Node) -> RowKernelPlan:
    """The kernel computing `reduce` and then `value` row by row (rowfuse.RowPair; `value` the
    reader itself or the staged node of its operand)."""
    x, axis = reduce.src[0], reduce.arg
    length, rows = x.shape[axis], reduce.numel
    team = row_team(rows, length)
    row = canon(reduce.shape, decompose("o", reduce.shape))
    inner, element = list(row), list(row)
    inner[axis], element[axis] = LOOP_VAR, "j"
    if team == 32:
        warps = max(1, min(ROW_WARPS, rows // SM_COUNT_HINT))
        threads, grid, who = 32 * warps, (min(-(-rows // warps), GRID_CAP), 1, 1), "a warp"
    else:
        threads, grid, who = team, (min(rows, GRID_CAP), 1, 1), f"a block of {team}"
    op = "max" if reduce.op is Op.REDUCE_MAX else "sum"
    kind = (
        "stage a library GEMM operand" if isinstance(value.arg, Staged) else value.op.value
    ) + f" -> {value.dtype.value}{list(value.shape)}"
    what = f"{reduce.op.value} over rows of {length}, then {kind} ({who} per row)"
    return RowKernelPlan(
        reduce, value, op, length, rows, threads, team, grid,
        row, canon(x.shape, inner), canon(value.shape, element), what,
    )  # fmt: skip


def row_team(rows: int, length: int) -> int:
    """Threads per row: a warp for rows of at most WARP_ROW_LENGTH_MAX, else a block of
    BLOCK_ROW_THREADS (BLOCK_THREADS_MAX when the rows are FEW_ROWS or fewer), halved while a
    thread would get fewer than MIN_PER_THREAD elements.

    Why, measured on an H100 (benchmarks/row_kernels.py, fp16 RMSNorm, 2026-12-07; µs by team
    32/64/128/256/512 threads per row): 128x896 3.2/3.0/2.4/2.0/2.2, 128x2048 5.4/3.7/2.6/2.3/2.2,
    128x3072 11.2/6.9/4.5/3.4/3.6, 8x4096 8.7/5.6/3.4/2.4/2.2, 4096x4096 42.4/39.5/28.8/27.7/27.7.
    The rule before it kept a warp per row while the rows alone filled the GPU (4096x4096: 42.4 µs,
    1.5x the 256-thread block) and gave 128x896 64 threads (eight elements each at least)."""
    if length <= WARP_ROW_LENGTH_MAX:
        return 32
    team = BLOCK_THREADS_MAX if rows <= FEW_ROWS else BLOCK_ROW_THREADS
    while team > 64 and length < team * MIN_PER_THREAD:
        team //= 2
    return team


def print_row(plan: RowKernelPlan, site: KernelSite) -> tuple[Kernel, BufferScale | None]:
    """The kernel, and the scale the value's stored numbers keep (kernels.stored_value)."""
    names, uses = Names(), site.uses
    r_out, v_out = site.storage[plan.reduce], site.storage[plan.value]
    uses.write(r_out.buffer)
    uses.write(v_out.buffer)
    fold = site.emitter(uses, names)
    x = fold.plain(plan.reduce.src[0], plan.inner)
    passes = [Pass("acc", plan.op, fold.lines, x)]
    fin = site.emitter(uses, names)
    result = "acc"
    if plan.reduce.op is Op.REDUCE_MEAN:
        result = fin.var(f"acc / {c_float(plan.length)}")
    body = site.emitter(uses, names, Flat(plan.element, plan.value.shape, "i"))
    body.known(plan.reduce, plan.row, Val(result))
    v = body.compute(plan.value, plan.element)
    val, scale = stored_value(body, v_out, v, plan.element)
    nt, length = plan.threads, plan.length
    warp = plan.team == 32
    first, step = ("lane", "32") if warp else ("threadIdx.x", str(nt))
    code = Code()
    with code.block(uses.signature(site.name, nt)):
        if warp:
            code("const int lane = threadIdx.x & 31;")
            rows_loop = (
                f"for (int o = (blockIdx.x * {nt} + threadIdx.x) >> 5; o < {plan.rows}; "
                f"o += (gridDim.x * {nt}) >> 5)"
            )
        else:
            code("MLSO_DYNAMIC_SMEM(smem);")
            code("float* const red = reinterpret_cast<float*>(smem);  // all-reduce partials")
            rows_loop = f"for (int o = blockIdx.x; o < {plan.rows}; o += gridDim.x)"
        with code.block(rows_loop):
            emit_passes(code, passes, length, "warp" if warp else "block", nt)
            code.extend(fin.lines)
            with code.block(f"if ({first} == 0)"):
                code(f"{r_out.ptr}[o] = mlso::from_f32<{CTYPE[r_out.dtype]}>({result});")
            if warp:
                code("__syncwarp();  // the row's reduced value, stored, is visible to every lane")
            else:
                code("__syncthreads();  // the row's reduced value, stored, is visible to all")
            with code.block(f"for (int j = {first}; j < {length}; j += {step})"):
                code(f"const int i = o * {length} + j;")
                code.extend(body.lines)
                code(f"{v_out.ptr}[i] = mlso::from_f32<{CTYPE[v_out.dtype]}>({val});")
    smem = 0 if warp else nt // 32 * 4
    kernel = Kernel(site.name, code.text(), plan.grid, (nt, 1, 1), smem, uses.params(), plan.what)
    return kernel, scale


def emit_row(lw: Lowering, reduce: Node, value: Node) -> Kernel:
    """The row kernel of `reduce` and `value` (both already stored); the value's stored scale is
    recorded in its storage, as kernels.emit_elementwise does."""
    kernel, scale = print_row(plan_row(lw.storage, reduce, value), site(lw))
    if scale is not None:
        lw.storage[value].scale = scale
    return kernel
