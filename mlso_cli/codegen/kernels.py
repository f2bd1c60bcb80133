"""Kernel emitters for predefined kernel-level ops: elementwise chains, reductions, matmuls.

Each emitter takes the Lowering and a root node and returns a Kernel whose source computes the
root into its storage. Each is decided, then printed from a frozen plan: matmuls
(matmulkernel.py), reductions (reducekernel.py) and elementwise chains (here). The printers get a
site.KernelSite, not the Lowering; an elementwise printer hands back the scale its value is
stored with (only the chain's evaluation knows it), which emit_elementwise records. Operands are evaluated by the Emitter, so fused elementwise prologues,
views and scaled (running-max) values work for every kernel kind the same way.
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
    decompose,
)
from mlso_cli.codegen.emitter import TEAM_LANE, Emitter, Flat
from mlso_cli.codegen.matmulkernel import plan_matmul, print_matmul
from mlso_cli.codegen.program import Buffer, Kernel
from mlso_cli.codegen.reducekernel import plan_reduce, print_reduce
from mlso_cli.codegen.scale import BufferScale, Storage, Val, structural
from mlso_cli.codegen.selection import selects
from mlso_cli.codegen.site import KernelSite, site
from mlso_cli.codegen.synthetic import Combined, Copy, RowMax, Staged
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import REDUCE, DType, Op

if TYPE_CHECKING:
    from mlso_cli.codegen.lower import Lowering

ELEMENTWISE_THREADS = 256
REDUCE_THREADS = 256
GRID_CAP = 1 << 20


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _what(n: Node) -> str:
    if isinstance(n.arg, Staged):
        return f"stage a library GEMM operand -> {n.dtype.value}{list(n.shape)}"
    if isinstance(n.arg, Copy):
        return f"copy to output {n.arg.slot} {list(n.shape)}"
    if isinstance(n.arg, RowMax):
        return f"softmax stabiliser: row max over axis {n.arg.axis} -> {list(n.shape)}"
    return f"{n.op.value} -> {n.dtype.value}{list(n.shape)}"


# ---- elementwise ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ElementwiseKernelPlan:
    """An elementwise kernel's decisions: lanes per element, block size, grid."""

    root: Node
    team: int
    """Lanes per output element (team_size): 1, or a power of two when the chain folds in place."""
    threads: int
    grid: tuple[int, int, int]
    what: str


def plan_elementwise(storage: Mapping[Node, Storage], root: Node) -> ElementwiseKernelPlan:
    """The decisions of root's elementwise kernel, from where kernel tensors are stored."""
    n, nt = root.numel, ELEMENTWISE_THREADS
    team = team_size(n, inplace_reductions(root, storage))
    grid = (min(_ceil(n * team, nt), GRID_CAP), 1, 1)
    what = _what(root) + (f" ({team} lanes per element)" if team > 1 else "")
    return ElementwiseKernelPlan(root, team, nt, grid, what)


def emit_elementwise(lw: Lowering, root: Node) -> Kernel:
    """One thread per element (grid-stride), the fused chain evaluated in registers; a team of
    lanes per element when the chain folds partials in place (`team_size`). Decided
    (plan_elementwise), printed (print_elementwise); the scale the printed value is stored with
    is handed back and recorded in the root's storage."""
    plan = plan_elementwise(lw.storage, root)
    kernel, scale = print_elementwise(plan, site(lw))
    if scale is not None:
        lw.storage[root].scale = scale
    return kernel


@dataclass(frozen=True)
class Blocks:
    """The blocks an elementwise loop runs on: an expression for a block's index among them, and
    their count. The whole grid for a kernel of its own; a range of it for a part of a sibling
    launch (siblingkernel.py)."""

    index: str = "blockIdx.x"
    count: str = "gridDim.x"


WHOLE_GRID = Blocks()


def print_elementwise(
    plan: ElementwiseKernelPlan, site: KernelSite
) -> tuple[Kernel, BufferScale | None]:
    """The kernel, and the scale its stored value keeps (None: exact values); see
    `elementwise_body`."""
    body, scale = elementwise_body(plan, site, WHOLE_GRID)
    code = Code()
    with code.block(site.uses.signature(site.name, plan.threads)):
        code.extend(body)
    kernel = Kernel(
        site.name, code.text(), plan.grid, (plan.threads, 1, 1), 0, site.uses.params(), plan.what
    )
    return kernel, scale


def elementwise_body(
    plan: ElementwiseKernelPlan, site: KernelSite, blocks: Blocks
) -> tuple[list[str], BufferScale | None]:
    """The statements of root's grid-stride loop over `blocks` (buffers recorded in site.uses),
    and the scale its stored value keeps. The value is stored as its scaled numbers when the root
    is fp32 scratch and its scale has a simple layout (scale.structural); only the chain's
    evaluation knows that scale, so it is found here."""
    root, names, uses = plan.root, Names(), site.uses
    out = site.storage[root]
    uses.write(out.buffer)
    n, nt, team = root.numel, plan.threads, plan.team
    tokens = decompose("i", root.shape)
    em = site.emitter(uses, names, Flat(tokens, root.shape, "i"))
    em.team = team
    v = em.compute(root, tokens)
    val, scale = stored_value(em, out, v, tokens)
    store = f"{out.ptr}[i] = mlso::from_f32<{CTYPE[out.dtype]}>({val});"
    code = Code()
    first, stride = f"{blocks.index} * {nt} + threadIdx.x", f"{blocks.count} * {nt}"
    if team > 1:
        first, stride = f"({first}) / {team}", f"{blocks.count} * {nt // team}"
        store = f"if ({TEAM_LANE} == 0) {store}"
    if team > 1:
        code(f"const int {TEAM_LANE} = threadIdx.x & {team - 1};")
    with code.block(f"for (int i = {first}; i < {n}; i += {stride})"):
        code.extend(em.lines)
        code(store)
    return code.lines, scale


def stored_value(
    em: Emitter, st: Storage, v: Val, tokens: Coords
) -> tuple[str, BufferScale | None]:
    """(what to store, its scale): the scaled number when the buffer is fp32 scratch and v's
    scale has a simple layout (the buffer's scale), else the exact value."""
    if (
        v.scale is not None
        and isinstance(st.buffer, Buffer)
        and st.buffer.kind == "scratch"
        and st.dtype is DType.F32
    ):
        bs = structural(v.scale, tokens)
        if bs is not None:
            return v.code, bs
    return em.materialise(v), None


TEAM_ITEMS = 8
"""Partials each lane of a team folds: the in-place loops are unrolled 8 times, so 8 is one
round of loads in flight per lane."""
TEAM_THREADS = SM_COUNT_HINT * 2048
"""Threads one wave of the H200 holds (2048 per SM): a team is worth its redundant element work only while
the grid is short of a wave."""


def team_size(outputs: int, lengths: list[int]) -> int:
    """Lanes per output element of an elementwise kernel whose chain folds `lengths` values in
    place at its top level: a power of two up to 32, so each lane keeps about TEAM_ITEMS of the
    shortest fold, the grid stays within one wave, and every warp's lanes leave the grid-stride
    loop together (outputs a multiple of the elements a warp holds), as the shuffles need."""
    if not lengths:
        return 1
    fits = [
        t
        for t in (2, 4, 8, 16, 32)
        if t * TEAM_ITEMS <= min(lengths)
        and outputs * t <= TEAM_THREADS
        and outputs % (32 // t) == 0
    ]
    return max(fits, default=1)


def inplace_reductions(root: Node, storage) -> list[int]:
    """Lengths of the reductions `root`'s chain evaluates in place at its top level (not nested
    in another one): what the emitter turns into loops (emitter._reduce and _combined)."""
    lengths: list[int] = []
    seen: set[Node] = set()
    stack = [root]
    while stack:
        n = stack.pop()
        if n in seen or (n in storage and n is not root):
            continue
        seen.add(n)
        if n.op in REDUCE:
            if isinstance(n.arg, Combined):
                lengths.append(n.src[0].shape[n.arg.dims[0]])
            elif isinstance(n.arg, int):
                lengths.append(n.src[0].shape[n.arg])
            continue  # what it folds is evaluated inside its loop (serial per lane)
        stack.extend(n.src)
        if n.op is Op.THREAD:
            stack.append(n.arg.body)
    return lengths


# ---- reductions ---------------------------------------------------------------------------------


def emit_reduce(lw: Lowering, root: Node) -> Kernel:
    """A reduction kernel: decided (reducekernel.plan_reduce), then printed from the plan; the
    scale the plan stores the result with is recorded in its storage first."""
    if selects(lw.storage, root):  # a constant selection: a read per element (selection.py)
        return emit_elementwise(lw, root)
    plan = plan_reduce(lw, root)
    if plan.out_scale is not None:
        lw.storage[root].scale = plan.out_scale
    return print_reduce(plan, site(lw), _what(root))


# ---- matmul -----------------------------------------------------------------------------------


def emit_matmul(lw: Lowering, root: Node) -> Kernel:
    """A generated matmul kernel: decided (matmulkernel.plan_matmul), then printed from the plan
    (matmulkernel.print_matmul); the scale the plan leaves C with is recorded in its storage."""
    plan = plan_matmul(lw, root)
    if plan.c_scale is not None:
        lw.storage[root].scale = plan.c_scale
    return print_matmul(plan, site(lw))
