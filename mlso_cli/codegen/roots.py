"""Which kernel-level nodes become kernels, what each output slot holds, and the launch order:
decided from the μGraph alone, before anything is stored or printed.

Why its own module: generate (lower.Lowering, which stores and prints) and the lowering plan
(plan.plan, which prints nothing) must make the same decisions; both call `kernel_roots` and
read the frozen result, where the plan used to reach into the Lowering's private methods.

Rules (thread graphs are built by rules, not search):
  - A matmul whose B repeats each head group's matrix is one GEMM per group, its query heads
    stacked as rows (gqafold.py), before anything below is decided.
  - MATMUL, REDUCE_*, GRAPH_DEF and the row maxima of stabilised EXPs are kernels ("roots").
  - Views never launch: consumers index through them.
  - An elementwise op is inlined into the one kernel that uses it; it becomes a kernel of its own
    when several kernels need it or when it is a graph output. A CAST of a program input (through
    views) is recomputed in every kernel that needs it instead (`_recomputed`).
  - A reduction over a short strided axis (the split-KV combine) is evaluated inside its one
    elementwise consumer (INLINE_REDUCE_MAX_LEN).
  - An output that is an input, repeats another output slot, or is read by other kernels goes
    out through a copy (synthetic.copy).
  - An output that is a chain of transposes and reshapes over a graph-defined kernel's output or
    a matmul, read by nothing else, is no kernel: that kernel saves straight into the output
    buffer, with the strides the views give its dims (`through_views`).
  - A reduction over the innermost axis whose one reader reads it along its own row is
    computed in the reader's kernel (rowfuse.row_pairs): an elementwise root, or the staging of
    a library GEMM's operand. Earlier reductions of the same rows, and the elementwise values
    between them, that nothing else reads join that kernel (a softmax, a LayerNorm): the
    values are then no roots, recomputed in each of its passes.
  - Consecutive elementwise kernels of the schedule that read none of each other share one
    launch (siblings.launch_groups: horizontal fusion); a row pair's reader is not one of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mlso_cli.codegen import synthetic
from mlso_cli.codegen.cfmt import contiguous
from mlso_cli.codegen.errors import CodegenError
from mlso_cli.codegen.frozen import FrozenMap
from mlso_cli.codegen.gqafold import fold_grouped_heads
from mlso_cli.codegen.libgemm import eligible, epilogue_add
from mlso_cli.codegen.rowfuse import Context as RowContext
from mlso_cli.codegen.rowfuse import RowPair, row_pairs
from mlso_cli.codegen.schedule import schedule
from mlso_cli.codegen.siblings import Context, launch_groups
from mlso_cli.codegen.stabilise import consumers_of, stabilisers
from mlso_cli.codegen.views import view_strides
from mlso_cli.ir.graph import PARTIAL, KernelGraph
from mlso_cli.ir.node import Node, toposort
from mlso_cli.ir.ops import REDUCE, VIEW, Op

ROOT_OPS = frozenset({Op.MATMUL, Op.GRAPH_DEF}) | REDUCE
KIND: dict[Op, str] = {
    Op.MATMUL: "matmul",
    Op.GRAPH_DEF: "graph_def",
    **{op: "reduce" for op in REDUCE},
}
"""Root op -> kernel kind (the lowering plan's names, lower.KERNEL_EMITTERS' keys); every other
root is an elementwise kernel."""
INT_LIMIT = 2**31 - 1
INLINE_REDUCE_MAX_LEN = 64
"""Reductions over a strided axis up to this long are evaluated inside their one elementwise
consumer (a loop per element) instead of as a kernel of their own: the split-KV combine."""


@dataclass(frozen=True)
class KernelRoots:
    """The kernel-level decisions of one μGraph."""

    order: tuple[Node, ...]
    """Every node the program computes (outputs and stabilisers' maxima), sources first."""
    consumers: FrozenMap[Node, tuple[Node, ...]]
    stab: FrozenMap[Node, Node]
    """Stabilised EXP -> the row max it is kept relative to (stabilise.stabilisers)."""
    roots: frozenset[Node]
    """The nodes that get kernels (output copies included)."""
    targets: tuple[Node, ...]
    """What output slot k holds: the output node, or its copy."""
    schedule: tuple[Node, ...]
    """The roots in launch order (dependencies first)."""
    launches: tuple[tuple[Node, ...], ...]
    """The schedule cut into launches: one root each, or several independent elementwise roots
    that one kernel computes (siblings.launch_groups)."""
    rows: FrozenMap[Node, RowPair]
    """Reduction -> the reader whose kernel computes it first, row by row (rowfuse.row_pairs).
    A pair whose reader is a matmul holds only when that matmul is a library GEMM (its operand
    is then staged by a kernel, which computes the reduction); else the reduction is a kernel of
    its own, launched just before the matmul."""
    target_strides: FrozenMap[Node, tuple[int, ...]] = FrozenMap(())
    """Targets stored into their output buffer through views: node -> its dims' strides there
    (a graph-defined kernel's output whose region output is its transpose/reshape)."""


def kernel_roots(kg: KernelGraph) -> KernelRoots:
    """The roots, output targets and launch order of kg (CodegenError past 32-bit indexing).
    Grouped heads are first folded into GEMM rows (gqafold.py): the decisions are the folded
    graph's, whose inputs and outputs equal kg's."""
    kg = fold_grouped_heads(kg)
    nodes = kg.nodes()
    stab = stabilisers(nodes, consumers_of(nodes))
    order = toposort(list(kg.outputs) + list(stab.values()))
    consumers = consumers_of(order)
    for n in order:
        if n.numel > INT_LIMIT:
            raise CodegenError(
                f"{n.op.value}{list(n.shape)} has more than 2^31-1 elements",
                "Split the region: kernels index with 32-bit integers.",
            )
    roots, targets, strides = _roots(kg, order, consumers, stab)
    outs = frozenset(kg.outputs)
    epilogues = _epilogue_candidates(order, consumers, outs)

    def deps(n: Node) -> list[Node]:
        return _deps(n, roots, stab)

    def elementwise(n: Node) -> bool:
        return n.op not in KIND and n not in epilogues

    launch = schedule(targets, deps, keep=lambda n: n in roots)
    fixed = frozenset(roots)
    cx = RowContext(fixed, outs, stab, deps, elementwise, lambda ns: kernels_read(ns, fixed, stab))
    rows = row_pairs(tuple(launch), cx)
    readers = {p.reader for p in rows.values()}
    inlined = {e for p in rows.values() for e in p.inlined}
    if inlined:  # recomputed by their row kernel's passes: no kernels, no storage
        roots -= inlined
        launch = [n for n in launch if n not in inlined]

    def fusable(n: Node) -> bool:
        return elementwise(n) and n not in readers

    return KernelRoots(
        tuple(order),
        FrozenMap((n, tuple(cs)) for n, cs in consumers.items()),
        FrozenMap(stab),
        frozenset(roots),
        tuple(targets),
        tuple(launch),
        launch_groups(tuple(launch), Context(fusable, deps)),
        rows,
        FrozenMap(strides.items()),
    )


def _epilogue_candidates(
    order: list[Node], consumers: Mapping[Node, list[Node]], outputs: frozenset[Node]
) -> frozenset[Node]:
    """The ADDs a library GEMM might compute as its bias or residual epilogue: libgemm's
    structural condition (the matmul's one reader), whatever storage and the library knob later
    decide. Such an ADD may get no kernel at all, so it never shares a launch."""
    return frozenset(
        ep[0]
        for n in order
        if n.op is Op.MATMUL and eligible(n) and (ep := epilogue_add(n, consumers, outputs))
    )


def _roots(
    kg: KernelGraph,
    order: list[Node],
    consumers: Mapping[Node, list[Node]],
    stab: Mapping[Node, Node],
) -> tuple[set[Node], list[Node], dict[Node, tuple[int, ...]]]:
    """(root set, output targets, strides of targets saved through views): which nodes get
    kernels, and what each output slot holds."""
    roots: set[Node] = {n for n in order if n.op in (Op.MATMUL, Op.GRAPH_DEF)} | set(stab.values())
    outs = set(kg.outputs)
    strides: dict[Node, tuple[int, ...]] = {}
    aliased: dict[Node, Node] = {}  # output view -> the graph-defined output saved through it
    for n in kg.outputs:
        got = through_views(n, consumers, outs)
        if got is not None and got[0] not in strides and kg.outputs.count(n) == 1:
            strides[got[0]] = got[1]
            aliased[n] = got[0]
    users: dict[Node, set[Node]] = {}
    for n in reversed(order):
        if n.op in (Op.INPUT, Op.CONST, Op.PROJ) or n in roots:
            continue
        if n in aliased:
            continue  # the graph-defined kernel saves through these views: no kernel
        u: set[Node] = set()
        for c in consumers.get(n, []):
            u |= {c} if c in roots else users.get(c, set())
        if n.op in REDUCE:
            if n in outs or not _inline_reduce(n, u):
                roots.add(n)
            else:
                users[n] = u
        elif n in outs or (n.op not in VIEW and len(u) > 1 and not _recomputed(n)):
            roots.add(n)
        else:
            users[n] = u
    targets: list[Node] = []
    taken: set[Node] = set()
    taken_proj: set[tuple[Node, int]] = set()
    for k, n in enumerate(kg.outputs):
        if n in aliased:
            targets.append(aliased[n])
            taken.add(aliased[n])
            continue
        key = (n.src[0], n.arg) if n.op is Op.PROJ else None
        # An output that other kernels also read goes out through a copy: the node keeps fp32
        # scratch that may stay scaled (a split-KV partial, a softmax numerator), and only the
        # copy materialises the exact value, which may overflow where the result does not.
        used = any(c is not n for c in consumers.get(n, []))
        if n.op is Op.INPUT or n in taken or (key is not None and key in taken_proj) or used:
            n = synthetic.copy(n, k)
            roots.add(n)
        taken.add(n)
        if key is not None:
            taken_proj.add(key)
        targets.append(n)
    return roots, targets, strides


def through_views(
    out: Node, consumers: Mapping[Node, list[Node]], outs: set[Node]
) -> tuple[Node, tuple[int, ...]] | None:
    """(x, strides) when `out` is transposes and reshapes of a graph-defined kernel's output x,
    or of a matmul x, that nothing else reads: x's dims' strides in out's (contiguous) buffer.
    Else None.

    Why: a fused attention core hands on [batch, seq, heads * d] while its blocks compute
    [batch, heads, seq, d] tiles; saved through the views' strides, the layout change costs a
    strided store instead of a copy kernel (one launch and a round trip through memory). The
    unfused core's P @ V is the same: a library GEMM writes C with the views' row and batch
    strides (libgemm._c_layout), a generated matmul stores each element through them."""
    if out.op not in (Op.TRANSPOSE, Op.RESHAPE):
        return None
    st: tuple[int, ...] | None = contiguous(out.shape)
    n = out
    while n.op in (Op.TRANSPOSE, Op.RESHAPE):
        src = n.src[0]
        if isinstance(n.arg, synthetic.Copy) or src.dtype is not n.dtype:
            return None
        if n is not out and (n in outs or len(consumers.get(n, [])) != 1):
            return None
        if n.op is Op.TRANSPOSE:
            back = [0] * len(st)
            for i, p in enumerate(n.arg):
                back[p] = st[i]
            st = tuple(back)
        else:
            st = view_strides(n.shape, st, src.shape)
            if st is None:
                return None
        n = src
    saves = (
        n.op is Op.PROJ
        and n.src[0].op is Op.GRAPH_DEF
        # an exact save: a partial (split) output is fp32 scratch for its combine
        and PARTIAL not in n.src[0].arg.outputs[n.arg].arg.omap
    ) or n.op is Op.MATMUL
    ok = saves and n not in outs and len(consumers.get(n, [])) == 1 and n.dtype is out.dtype
    return (n, st) if ok else None


def _recomputed(n: Node) -> bool:
    """A CAST of a program input or constant (through views), which each kernel that needs it
    computes again rather than reading from a kernel of its own.

    Why: an exported RMSNorm casts its fp16 input to fp32 once and reads the result twice (the sum
    of squares, then the scaling); as a shared value the cast was a kernel writing an fp32 copy of
    the activations, which the reduction and the scaling then read back: one launch and three
    passes over the rows, where each reader can convert the fp16 values it loads. The values are
    the same: the cast is exact into fp32 scratch and computed in fp32 inline."""
    if n.op is not Op.CAST:  # (never a stabilised EXP nor a row max)
        return False
    x = n.src[0]
    while x.op in VIEW:
        x = x.src[0]
    return x.op in (Op.INPUT, Op.CONST)


def _inline_reduce(n: Node, users: set[Node]) -> bool:
    """A reduction over a short strided axis with one elementwise kernel using it."""
    x = n.src[0]
    strided_axis = any(d > 1 for d in x.shape[n.arg + 1 :])
    if not strided_axis or x.shape[n.arg] > INLINE_REDUCE_MAX_LEN or len(users) != 1:
        return False
    (user,) = users
    return user.op not in ROOT_OPS


def _deps(root: Node, roots: set[Node], stab: Mapping[Node, Node]) -> list[Node]:
    """The kernels `root`'s kernel reads (through inlined elementwise ops and views)."""
    if root.op is Op.PROJ:
        return [root.src[0]]
    out = [stab[root]] if root in stab else []
    return out + kernels_read(root.src, roots, stab)


def kernels_read(
    nodes: Sequence[Node], roots: set[Node] | frozenset[Node], stab: Mapping[Node, Node]
) -> list[Node]:
    """The kernels that computing `nodes` inline reads: roots met, a projection's graph-defined
    kernel, a stabilised EXP's row max, looking through everything else (sources first, in
    order)."""
    out: list[Node] = []
    seen: set[Node] = set()

    def walk(s: Node) -> None:
        if s.op in (Op.INPUT, Op.CONST) or s in seen:
            return
        seen.add(s)
        if s in roots:
            out.append(s)
        elif s.op is Op.PROJ:
            out.append(s.src[0])
        else:
            if s in stab:
                out.append(stab[s])
            for t in s.src:
                walk(t)

    for n in nodes:
        walk(n)
    return out
