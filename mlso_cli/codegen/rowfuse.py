"""Row fusion: which row reductions are computed in the kernel of their one row-wise reader.

Why: RMSNorm and LayerNorm lift to a reduction over the row (a kernel of its own) and the
normalisation that reads it broadcast along the row (a second kernel: an elementwise root, or the
staging of a library GEMM's operand). Under CUDA graphs the second launch costs about 2 µs, and
the reduced value makes a round trip through memory. One kernel can do both: a warp per row sums
the row, then writes that row's normalised elements with the sum in a register (rowkernel.py).

Decided from the μGraph alone, with the launch order (roots.kernel_roots holds the result). A
reduction R is paired with the kernel reading it when every rule of RULES holds (a table: rule
name -> condition on the candidate pair).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from mlso_cli.codegen.frozen import FrozenMap
from mlso_cli.codegen.libgemm import eligible, staged_value
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


def _plain(cx: Context, p: RowPair) -> bool:
    r = p.reduce
    return r.op in REDUCE and isinstance(r.arg, int) and r not in cx.stab.values()


def _innermost(cx: Context, p: RowPair) -> bool:
    x, axis = p.reduce.src[0], p.reduce.arg
    return all(d == 1 for d in x.shape[axis + 1 :]) and ROW_LEN[0] <= x.shape[axis] <= ROW_LEN[1]


def _row_layout(cx: Context, p: RowPair) -> bool:
    return p.value.shape == p.reduce.src[0].shape


def _row_wise(cx: Context, p: RowPair) -> bool:
    """Every node between the value and the reduction (computed inline) is in ROW_OPS."""
    start = list(p.value.src) if p.value is p.reader else [p.value]
    if p.value is p.reader and p.value.op not in ROW_OPS:
        return False
    reach: dict[Node, bool] = {}

    def reaches(n: Node) -> bool:
        if n is p.reduce:
            return True
        if n in cx.roots or n.op in (Op.INPUT, Op.CONST, Op.PROJ):
            return False
        if n not in reach:
            reach[n] = False  # (a DAG: no cycles; the entry is overwritten below)
            reach[n] = any([reaches(s) for s in n.src])
        return reach[n]

    hits = [n for n in start if reaches(n)]
    return bool(hits) and all(n.op in ROW_OPS for n, hit in reach.items() if hit)


def _unscaled(cx: Context, p: RowPair) -> bool:
    """Nothing the reduction or the value is computed from (through every kernel) is kept
    relative to a running max: no stabilised EXP, no graph-defined kernel's output."""
    seen: set[Node] = set()
    stack = [p.reduce.src[0], p.value]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in cx.stab or n.op in (Op.PROJ, Op.GRAPH_DEF):
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
)
"""Conditions for a reduction and its one reader's value to share a kernel (`_candidate` finds
the pair: the one kernel reading the reduction, and its value)."""


def row_pairs(schedule: tuple[Node, ...], cx: Context) -> FrozenMap[Node, RowPair]:
    """Reduction -> its row pair, for every reduction of the schedule that RULES admit."""
    readers: dict[Node, list[Node]] = {}
    for k in schedule:
        for d in dict.fromkeys(cx.deps(k)):
            readers.setdefault(d, []).append(k)
    out: dict[Node, RowPair] = {}
    for r in schedule:
        p = _candidate(cx, r, readers.get(r, []))
        if p is not None and all(rule(cx, p) for _, rule in RULES):
            out[r] = p
    return FrozenMap(out)


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
