"""One kernel for a row reduction and its row-wise reader (rowfuse.py decides which): planned,
then printed. A chain of reductions over the same rows (a softmax's row max then its sum) is a
pass over the row each, every result kept in a register for the passes after it.

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
from mlso_cli.codegen.cfmt import (
    CTYPE,
    Code,
    Coords,
    Names,
    c_float,
    canon,
    decompose,
)
from mlso_cli.codegen.emitter import Emitter, Flat
from mlso_cli.codegen.kernels import GRID_CAP, stored_value
from mlso_cli.codegen.program import Buffer, Kernel
from mlso_cli.codegen.reducekernel import keeps_scale, masked_max
from mlso_cli.codegen.scale import BufferScale, Scale, Storage, Val, structural
from mlso_cli.codegen.site import KernelSite, site
from mlso_cli.codegen.synthetic import RowMax, Staged
from mlso_cli.codegen.teams import LOOP_VAR, Pass, emit_passes
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import DType, Op

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
    reduces: tuple[Node, ...]
    """The reductions, computed in this order (rowfuse.RowPair.reductions): a pass over the row
    each, the earlier results in registers."""
    value: Node
    """The node the kernel writes after the reductions (an elementwise root or a staged operand)."""
    ops: tuple[str, ...]
    """Per reduction, "sum" or "max" (a mean divides the sum by the length)."""
    length: int
    rows: int
    threads: int
    """The block's threads."""
    team: int
    """Threads per row: 32 (a warp) or `threads` (the block)."""
    grid: tuple[int, int, int]
    row: Coords
    """The reductions' coordinates at row `o` (they share one shape)."""
    inner: Coords
    """The reductions' inputs' coordinates along row `o` at teams.LOOP_VAR."""
    element: Coords
    """The value's coordinates at element `j` of row `o`."""
    what: str

    @property
    def reduce(self) -> Node:
        """The last reduction (the one the value reads; the only one of a plain pair)."""
        return self.reduces[-1]


def plan_row(
    storage: Mapping[Node, Storage], reduces: tuple[Node, ...] | Node, value: Node
) -> RowKernelPlan:
    """The kernel computing `reduces` and then `value` row by row (rowfuse.RowPair; `value` the
    reader itself or the staged node of its operand)."""
    reduces = reduces if isinstance(reduces, tuple) else (reduces,)
    reduce = reduces[-1]
    x, axis = reduce.src[0], reduce.arg
    length, rows = x.shape[axis], reduce.numel
    team = row_team(rows, length)
    row = canon(reduce.shape, decompose("o", reduce.shape))
    inner, element = list(row), list(row)
    inner[axis], element[axis] = LOOP_VAR, "j"
    if value.shape != x.shape:  # the same rows under another row-major shape (rowfuse._row_layout)
        element = [*decompose("o", value.shape[:-1]), "j"]
    if team == 32:
        warps = max(1, min(ROW_WARPS, rows // SM_COUNT_HINT))
        threads, grid, who = 32 * warps, (min(-(-rows // warps), GRID_CAP), 1, 1), "a warp"
    else:
        threads, grid, who = team, (min(rows, GRID_CAP), 1, 1), f"a block of {team}"
    ops = tuple("max" if r.op is Op.REDUCE_MAX else "sum" for r in reduces)
    kind = (
        "stage a library GEMM operand" if isinstance(value.arg, Staged) else value.op.value
    ) + f" -> {value.dtype.value}{list(value.shape)}"
    folds = ", ".join(_name(r) for r in reduces)
    what = f"{folds} over rows of {length}, then {kind} ({who} per row)"
    return RowKernelPlan(
        reduces, value, ops, length, rows, threads, team, grid,
        row, canon(x.shape, inner), canon(value.shape, element), what,
    )  # fmt: skip


def _name(r: Node) -> str:
    if isinstance(r.arg, RowMax):
        return "softmax row max" + (" (masked)" if r.arg.weighted else "")
    return r.op.value


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


def fold_of(em: Emitter, reduce: Node, inner: Coords) -> tuple[str, Scale | None]:
    """(what one pass folds at `inner`, the scale its result keeps), in reducekernel.py's forms:
    a stabiliser's row max skips zero-weight entries; values whose scale the fold may keep
    (`keeps_scale`) are folded as stored; anything else as exact values."""
    if isinstance(reduce.arg, RowMax) and reduce.arg.weighted:
        return masked_max(em, reduce, inner), None
    v = em.value(reduce.src[0], inner)
    if keeps_scale(v.scale, "max" if reduce.op is Op.REDUCE_MAX else "sum"):
        return v.code, v.scale
    return em.materialise(v), None


def row_scale(em: Emitter, storage: Storage, reduce: Node) -> BufferScale | None:
    """The scale a chained reduction's fp32 scratch keeps (None: exact values), decided before
    its kernel is printed so that the launches planned before it (a library GEMM's check of its
    operands) read it: `fold_of`'s scale, laid out over the reduction's shape."""
    if not (isinstance(storage.buffer, Buffer) and storage.buffer.kind == "scratch"):
        return None
    if storage.dtype is not DType.F32:
        return None
    row = canon(reduce.shape, decompose("o", reduce.shape))
    axis = reduce.arg.axis if isinstance(reduce.arg, RowMax) else reduce.arg
    inner = list(row)
    inner[axis] = LOOP_VAR
    _, sc = fold_of(em, reduce, canon(reduce.src[0].shape, inner))
    return None if sc is None else structural(sc, row)


def print_row(plan: RowKernelPlan, site: KernelSite) -> tuple[Kernel, BufferScale | None]:
    """The kernel, and the scale the value's stored numbers keep (kernels.stored_value)."""
    names, uses = Names(), site.uses
    outs = [site.storage[r] for r in plan.reduces]
    v_out = site.storage[plan.value]
    for st in outs:
        uses.write(st.buffer)
    uses.write(v_out.buffer)
    nt, length = plan.threads, plan.length
    warp = plan.team == 32
    mode = "warp" if warp else "block"
    single = len(plan.reduces) == 1
    known: list[tuple[Node, Val]] = []
    folds: list[tuple[Pass, list[str]]] = []
    for i, (r, op) in enumerate(zip(plan.reduces, plan.ops)):
        fold = site.emitter(uses, names)
        for n, v in known:
            fold.known(n, plan.row, v)
        expr, sc = fold_of(fold, r, plan.inner)
        acc = "acc" if single else f"acc{i}"
        fin = site.emitter(uses, names)
        result = acc
        if r.op is Op.REDUCE_MEAN:
            result = fin.var(f"{acc} / {c_float(plan.length)}")
        folds.append((Pass(acc, op, fold.lines, expr), fin.lines))
        known.append((r, Val(result, sc)))
    tail = site.emitter(uses, names)
    for n, v in known:
        tail.known(n, plan.row, v)
    stores = []
    for (_r, v), st in zip(known, outs):
        stored = v.code if st.scale is not None else tail.materialise(v)
        stores.append(f"{st.ptr}[o] = mlso::from_f32<{CTYPE[st.dtype]}>({stored});")
    body = site.emitter(
        uses, names, Flat(plan.element, plan.value.shape, "i", ("o", "j", plan.length))
    )
    for n, v in known:
        body.known(n, plan.row, v)
    v = body.compute(plan.value, plan.element)
    val, scale = stored_value(body, v_out, v, plan.element)
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
            for p, fin_lines in folds:
                emit_passes(code, [p], length, mode, nt)
                code.extend(fin_lines)
            code.extend(tail.lines)
            with code.block(f"if ({first} == 0)"):
                for line in stores:
                    code(line)
            what = "value, stored, is" if single else "values, stored, are"
            if warp:
                code(f"__syncwarp();  // the row's reduced {what} visible to every lane")
            else:
                code(f"__syncthreads();  // the row's reduced {what} visible to all")
            with code.block(f"for (int j = {first}; j < {length}; j += {step})"):
                code(f"const int i = o * {length} + j;")
                code.extend(body.lines)
                code(f"{v_out.ptr}[i] = mlso::from_f32<{CTYPE[v_out.dtype]}>({val});")
    smem = 0 if warp else nt // 32 * 4
    kernel = Kernel(site.name, code.text(), plan.grid, (nt, 1, 1), smem, uses.params(), plan.what)
    return kernel, scale


def emit_row(lw: Lowering, reduces: tuple[Node, ...] | Node, value: Node) -> Kernel:
    """The row kernel of `reduces` and `value` (all already stored); the value's stored scale is
    recorded in its storage, as kernels.emit_elementwise does."""
    kernel, scale = print_row(plan_row(lw.storage, reduces, value), site(lw))
    if scale is not None:
        lw.storage[value].scale = scale
    return kernel
