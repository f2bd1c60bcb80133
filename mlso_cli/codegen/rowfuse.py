"""Row fusion: which row reductions are computed in the kernel of their one row-wise reader.

Why: RMSNorm and LayerNorm lift to a reduction over the row (a kernel of its own) and the
normalisation that reads it broadcast along the row (a second kernel: an elementwise root, or the
staging of a library GEMM's operand). Under CUDA graphs the second launch costs about 2 µs, and
the reduced value makes a round trip through memory. One kernel can do both: a warp per row sums
the row, then writes that row's normalised elements with the sum in a register (rowkernel.py).

Decided from the μGraph alone, with the launch order (roots.kernel_roots holds the result). A
reduction R is paired with the kernel reading it when every rule of RULES holds (a table: rule
name -> condition on the candidate pair).

A pair grows into a chain when the row's earlier reductions, and the elementwise values between
them, are read by nothing but the pair (`_grown`). Why: a softmax lowers to a scaled-score
kernel, the stabiliser's row max, the exp (relative to that max) times the mask, the row sum,
and the division that stages the probabilities for the P @ V GEMM: five launches, each a round
trip of the scores through memory, where ONNX Runtime runs one Softmax kernel. The chain makes
them one kernel: a pass over the row per reduction (each earlier result in a register), then the
value; the elementwise values are recomputed in each pass instead of stored (they lose their
kernels: `RowPair.inlined`). A LayerNorm's mean and variance chain the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from mlso_cli.codegen.frozen import FrozenMap
from mlso_cli.codegen.libgemm import eligible, staged_value
from mlso_cli.codegen.synthetic import RowMax
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import BINARY, REDUCE, UNARY, Op

ROW_LEN = (32, 8192)
"""Row lengths fused (inclusive): at least a warp's lanes have an element each, and at most 256
elements per lane for each of the two passes over the row."""
ROW_OPS = UNARY | BINARY | {Op.BROADCAST}
"""Ops allowed between the reader's value and the reduction: each maps an element's coordinates
to the same row's (broadcasting right-aligned), so the reduced value is read at the row the
kernel is on, and never at another warp's."""


@dataclass(frozen=True)
class RowPair:
    """A reduction and the kernel that computes it before its reader's value, row by row."""

    reduce: Node
    reader: Node
    """The one kernel reading the reduction: an elementwise root, or a matmul whose operand
    `operand` (a library GEMM's staged operand) reads it."""
    value: Node
    """What the kernel writes per row after the reduction: the reader itself, or the operand."""
    operand: int | None = None
    chain: tuple[Node, ...] = ()
    """Reductions over the same rows that the kernel computes first, in launch order, each pass
    reading the earlier results from registers (a softmax's row max before its row sum)."""
    inlined: frozenset[Node] = frozenset()
    """Elementwise kernels that only this kernel reads: recomputed in its passes, no kernel of
    their own (the scaled scores, the masked exp)."""

    @property
    def reductions(self) -> tuple[Node, ...]:
        """Every reduction the kernel computes, in order: the chain, then `reduce`."""
        return (*self.chain, self.reduce)

    def holds(self, library: bool) -> bool:
        """Whether the pair shares a kernel in a lowering with library GEMMs on or off: always
        for an elementwise reader; for a matmul's operand only when the matmul is a library
        GEMM, whose staging kernel computes the reduction (a generated matmul stages nothing,
        and the reduction is then a kernel of its own)."""
        return self.operand is None or (library and eligible(self.reader))


@dataclass(frozen=True)
class Context:
    """What the rules read about the program's kernels."""

    roots: frozenset[Node]
    outputs: frozenset[Node]
    stab: Mapping[Node, Node]
    deps: Callable[[Node], list[Node]]
    """The kernels a kernel reads (roots._deps)."""
    elementwise: Callable[[Node], bool]
    """A kernel kernels.emit_elementwise prints (not a GEMM epilogue's ADD)."""
    reads: Callable[[Sequence[Node]], list[Node]]
    """The kernels computing these values inline reads (roots.kernels_read)."""
    readers: Mapping[Node, tuple[Node, ...]] = FrozenMap(())
    """Kernel -> the kernels reading it (row_pairs fills it from the schedule)."""


def _plain(cx: Context, p: RowPair) -> bool:
    r = p.reduce
    return r.op in REDUCE and isinstance(r.arg, int) and r not in cx.stab.values()


def axis_of(r: Node) -> int | None:
    """The axis a row reduction folds: a plain one's, or a stabiliser's (synthetic.RowMax); None
    for any other (a split combine, a running max)."""
    if r.op not in REDUCE:
        return None
    if isinstance(r.arg, int):
        return r.arg
    return r.arg.axis if isinstance(r.arg, RowMax) else None


def _innermost(cx: Context, p: RowPair) -> bool:
    x, axis = p.reduce.src[0], p.reduce.arg
    return all(d == 1 for d in x.shape[axis + 1 :]) and ROW_LEN[0] <= x.shape[axis] <= ROW_LEN[1]


def _same_rows(cx: Context, p: RowPair) -> bool:
    """Every chained reduction folds the same rows as `reduce` (input shape, axis, result shape)."""
    x, axis = p.reduce.src[0], p.reduce.arg
    return all(
        axis_of(r) == axis and r.src[0].shape == x.shape and r.shape == p.reduce.shape
        for r in p.chain
    )


def _inlined_row_shaped(cx: Context, p: RowPair) -> bool:
    """An inlined value is elementwise, one element per row element, and no program output."""
    x = p.reduce.src[0]
    return all(
        cx.elementwise(e) and e.op in ROW_OPS and e.shape == x.shape and e not in cx.outputs
        for e in p.inlined
    )


def _read_inside(cx: Context, p: RowPair) -> bool:
    """The chain's reductions and inlined values are read by the pair's kernel only: by the
    reductions, the inlined values and the value itself (for a matmul, by its paired operand
    and never by the other one)."""
    inside = set(p.inlined) | set(p.chain)
    if not inside:
        return True
    members = inside | {p.reduce, p.reader}
    for m in inside:
        if m in cx.outputs or any(k not in members for k in cx.readers.get(m, ())):
            return False
    if p.operand is not None:
        others = [s for i, s in enumerate(p.reader.src) if i != p.operand]
        if any(_uses(cx, s, m) for s in others for m in inside):
            return False
    return True


def _rows_of(r: Node) -> tuple[int, int]:
    """(row length, rows) of a row reduction."""
    return r.src[0].shape[axis_of(r)], r.numel


def _row_major(shape: tuple[int, ...], length: int) -> bool:
    """A tensor of `shape` holds element j of row o at flat index o * length + j: its innermost
    dim, trailing 1s aside, is the row."""
    dims = list(shape)
    while dims and dims[-1] == 1:
        dims.pop()
    return bool(dims) and dims[-1] == length


def keeps_rows(n: Node, length: int, rows: int) -> bool:
    """A RESHAPE that maps row o to row o: of a row-shaped tensor to another row-shaped one, or
    of one value per row to one value per row. A reshape is a row-major reinterpretation, so the
    flat index, hence the row (flat // length), is unchanged. Why: GPT-2's exporter flattens the
    LayerNorm's (1, 128, 1024) to (128, 1024) for its Gemm, and the norm's reductions then took
    three launches instead of one row kernel."""
    if n.op is not Op.RESHAPE:
        return False
    src = n.src[0]
    if n.numel == rows == src.numel:
        return True
    return _row_major(n.shape, length) and _row_major(src.shape, length)


def _row_layout(cx: Context, p: RowPair) -> bool:
    """The value is row-shaped like the reduction's input: the same shape, or the same rows
    under another row-major shape (a view that flattens the batch)."""
    x = p.reduce.src[0]
    if p.value.shape == x.shape:
        return True
    length, _ = _rows_of(p.reduce)
    return p.value.numel == x.numel and p.value.shape[-1] == length and x.shape[-1] == length


def _row_wise(cx: Context, p: RowPair) -> bool:
    """Every node between the value and the reduction (computed inline) is in ROW_OPS, and so is
    every node between a chained reduction's or inlined value's readers in the kernel and it."""
    start = list(p.value.src) if p.value is p.reader else [p.value]
    rows = _rows_of(p.reduce)
    if p.value is p.reader and p.value.op not in ROW_OPS:
        return False
    if not _row_paths(cx, start, {p.reduce}, p.inlined, rows):
        return False
    inside = set(p.chain) | set(p.inlined)
    starts = [s for r in p.reductions for s in r.src] + [s for e in p.inlined for s in e.src]
    return not inside or _row_paths(cx, start + starts, inside, p.inlined, rows, need=False)


def _row_paths(
    cx: Context,
    start: list[Node],
    targets: set[Node],
    inlined: frozenset[Node],
    rows: tuple[int, int],
    need: bool = True,
) -> bool:
    """Every node on a path from `start` to `targets` computed inline (inlined kernels count as
    inline) is in ROW_OPS or a reshape that keeps rows (`keeps_rows`); with `need`, at least one
    start reaches a target."""
    reach: dict[Node, bool] = {}

    def reaches(n: Node) -> bool:
        if n in targets:
            return True
        if (n in cx.roots and n not in inlined) or n.op in (Op.INPUT, Op.CONST, Op.PROJ):
            return False
        if n not in reach:
            reach[n] = False  # (a DAG: no cycles; the entry is overwritten below)
            reach[n] = any([reaches(s) for s in n.src])
        return reach[n]

    hits = [n for n in start if reaches(n)]
    return (bool(hits) or not need) and all(
        n.op in ROW_OPS or keeps_rows(n, *rows)
        for n, hit in reach.items()
        if hit and n not in targets
    )


def _unscaled(cx: Context, p: RowPair) -> bool:
    """Nothing the reductions or the value are computed from (through every kernel) is kept
    relative to a running max, except a stabilised EXP whose row max the chain computes (a
    register of the same row): no other stabilised EXP, no graph-defined kernel's output."""
    seen: set[Node] = set()
    stack = [s for r in p.reductions for s in r.src] + [p.value]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if (n in cx.stab and cx.stab[n] not in p.chain) or n.op in (Op.PROJ, Op.GRAPH_DEF):
            return False
        stack.extend(n.src)
    return True


RULES: tuple[tuple[str, Callable[[Context, RowPair], bool]], ...] = (
    ("a plain reduction (not a stabiliser's row max nor a split combine)", _plain),
    ("over the innermost axis, of a length in ROW_LEN", _innermost),
    ("not a program output", lambda cx, p: p.reduce not in cx.outputs),
    ("the value has the reduction input's shape (a row per reduced value)", _row_layout),
    ("the value reads the reduction along its own row only (ROW_OPS)", _row_wise),
    ("no value kept relative to a running max", _unscaled),
    ("chained reductions fold the same rows", _same_rows),
    ("inlined values are elementwise, row-shaped and no outputs", _inlined_row_shaped),
    ("chained and inlined kernels are read by this kernel only", _read_inside),
)
"""Conditions for a reduction and its one reader's value to share a kernel (`_candidate` finds
the pair: the one kernel reading the reduction, and its value)."""


def row_pairs(schedule: tuple[Node, ...], cx: Context) -> FrozenMap[Node, RowPair]:
    """Reduction -> its row pair, for every reduction of the schedule that RULES admit; each
    reduction of a chain maps to its pair. The latest reductions are paired first, each grown
    into the longest chain RULES admit (else kept alone), so an earlier reduction joins the
    chain of the pair that reads it rather than pairing with an inlined value."""
    readers: dict[Node, list[Node]] = {}
    for k in schedule:
        for d in dict.fromkeys(cx.deps(k)):
            readers.setdefault(d, []).append(k)
    cx = replace(cx, readers=FrozenMap((k, tuple(v)) for k, v in readers.items()))
    out: dict[Node, RowPair] = {}
    taken: set[Node] = set()
    rank = {n: i for i, n in enumerate(schedule)}
    for r in reversed(schedule):
        if r in taken:
            continue
        p = _candidate(cx, r, readers.get(r, []))
        if p is None:
            continue
        for q in (_grown(cx, p, taken, rank), p):
            if q is not None and all(rule(cx, q) for _, rule in RULES):
                for m in (*q.reductions, *q.inlined, q.reader):
                    taken.add(m)
                out.update((red, q) for red in q.reductions)
                break
    return FrozenMap(out)


def _grown(cx: Context, p: RowPair, taken: set[Node], rank: Mapping[Node, int]) -> RowPair | None:
    """p with the kernels its reduction and value read, transitively, that could join it: row
    reductions over the same rows (`chain`) and row-shaped elementwise kernels (`inlined`). None
    when nothing joins (p alone is then tried as it is). Whether the result may be one kernel
    is RULES' call. The chain is in launch order (`rank`: each pass reads the earlier results)."""
    x = p.reduce.src[0]
    chain: set[Node] = set()
    inlined: set[Node] = set()
    start = [p.value] if p.value is not p.reader else list(p.value.src)
    frontier = cx.reads([*p.reduce.src, *start])
    while frontier:
        d = frontier.pop()
        if d in chain or d in inlined or d is p.reduce or d in taken or d in cx.outputs:
            continue
        if axis_of(d) is not None and d.src[0].shape == x.shape and d.shape == p.reduce.shape:
            chain.add(d)
        elif cx.elementwise(d) and d.shape == x.shape and d.op in ROW_OPS:
            inlined.add(d)
        else:
            continue
        frontier.extend(cx.reads(d.src))
        if d in cx.stab:  # a stabilised EXP kernel reads its row max too
            frontier.append(cx.stab[d])
    if not chain and not inlined:
        return None
    return replace(p, chain=tuple(sorted(chain, key=rank.__getitem__)), inlined=frozenset(inlined))


def _candidate(cx: Context, r: Node, readers: list[Node]) -> RowPair | None:
    """The pair r would form with its one reader: an elementwise root, or a library-eligible
    matmul with one operand (staged whole, no batch broadcast) computed from r."""
    if r.op not in REDUCE or len(readers) != 1:
        return None
    (k,) = readers
    if cx.elementwise(k):
        return RowPair(r, k, k)
    if k.op is not Op.MATMUL or not eligible(k):
        return None
    using = [i for i, s in enumerate(k.src) if _uses(cx, s, r)]
    if len(using) != 1:
        return None
    (i,) = using
    x = k.src[i]
    if staged_value(x, k.shape[:-2]) is not x:
        return None
    return RowPair(r, k, x, i)


def _uses(cx: Context, n: Node, r: Node) -> bool:
    """n is r, or computed from r inline (not through another kernel)."""
    seen: set[Node] = set()
    stack = [n]
    while stack:
        m = stack.pop()
        if m is r:
            return True
        if m in seen or m in cx.roots or m.op in (Op.INPUT, Op.CONST):
            continue
        seen.add(m)
        stack.extend(m.src)
    return False
