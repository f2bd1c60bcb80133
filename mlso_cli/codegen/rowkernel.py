"""One kernel for a row reduction and its row-wise reader (rowfuse.py decides which): planned,
then printed.

A warp owns a row at a time (grid-stride over the rows): its 32 lanes stride the row folding the
reduction's input, a shuffle all-reduce leaves the result in every lane, and the lanes then
stride the same row again writing the reader's value, the reduced value read from a register
(Emitter.known), the row's inputs re-read from memory (they were just read: cached). No shared
memory and no block barrier. Lane 0 also stores the reduced value in its buffer, then the warp
synchronises, so a read the register does not serve still finds the value in memory.
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
    warps = max(1, min(ROW_WARPS, rows // SM_COUNT_HINT))
    row = canon(reduce.shape, decompose("o", reduce.shape))
    inner, element = list(row), list(row)
    inner[axis], element[axis] = LOOP_VAR, "j"
    grid = (min(-(-rows // warps), GRID_CAP), 1, 1)
    op = "max" if reduce.op is Op.REDUCE_MAX else "sum"
    kind = (
        "stage a library GEMM operand" if isinstance(value.arg, Staged) else value.op.value
    ) + f" -> {value.dtype.value}{list(value.shape)}"
    what = f"{reduce.op.value} over rows of {length}, then {kind} (a warp per row)"
    return RowKernelPlan(
        reduce, value, op, length, rows, 32 * warps, grid,
        row, canon(x.shape, inner), canon(value.shape, element), what,
    )  # fmt: skip


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
    code = Code()
    with code.block(uses.signature(site.name, nt)):
        code("const int lane = threadIdx.x & 31;")
        with code.block(
            f"for (int o = (blockIdx.x * {nt} + threadIdx.x) >> 5; o < {plan.rows}; "
            f"o += (gridDim.x * {nt}) >> 5)"
        ):
            emit_passes(code, passes, length, "warp", nt)
            code.extend(fin.lines)
            with code.block("if (lane == 0)"):
                code(f"{r_out.ptr}[o] = mlso::from_f32<{CTYPE[r_out.dtype]}>({result});")
            code("__syncwarp();  // the row's reduced value, stored, is visible to every lane")
            with code.block(f"for (int j = lane; j < {length}; j += 32)"):
                code(f"const int i = o * {length} + j;")
                code.extend(body.lines)
                code(f"{v_out.ptr}[i] = mlso::from_f32<{CTYPE[v_out.dtype]}>({val});")
    kernel = Kernel(site.name, code.text(), plan.grid, (nt, 1, 1), 0, uses.params(), plan.what)
    return kernel, scale


def emit_row(lw: Lowering, reduce: Node, value: Node) -> Kernel:
    """The row kernel of `reduce` and `value` (both already stored); the value's stored scale is
    recorded in its storage, as kernels.emit_elementwise does."""
    kernel, scale = print_row(plan_row(lw.storage, reduce, value), site(lw))
    if scale is not None:
        lw.storage[value].scale = scale
    return kernel
