"""Dimension classes of a target kernel graph: which tensor dims carry the same index.

Why: a grid dim or the for-loop of a block graph splits one *index* of the computation, not one
tensor's dim. Every input that carries that index must be tiled the same way (its imap or fmap),
and every output that carries it is laid out along it (omap); a summed index that no output
carries becomes a PARTIAL dim of per-block partial results instead. So the search enumerates
mappings per class, and each input's InputMap follows from its dims' classes: one choice per
index instead of one per tensor dim, and never an inconsistent pair of maps.

Classes come from a union-find over (node, dim) pairs, driven by one rule per op (`RULES`).
A reshape that splits one dim into several (or merges several into one) keeps the outermost of
the several in the single dim's class: tiling it in whole units of the inner dims is the same
tiling of the single dim. The inner dims become unsplittable (a tile of them would be strided,
which the IR has no map for); so do both sides of a many-to-many reshape. A class's size is its
smallest member's: the number of index units a grid or loop may divide.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mlso_cli.ir.graph import KernelGraph
from mlso_cli.ir.node import Node, toposort
from mlso_cli.ir.ops import BINARY, REDUCE, UNARY, Op

Slot = tuple[Node, int]


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[Slot, Slot] = {}
        self.reduced: set[Slot] = set()
        self.frozen: set[Slot] = set()

    def find(self, x: Slot) -> Slot:
        self.parent.setdefault(x, x)
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: Slot, b: Slot) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


def _aligned(uf: _UnionFind, n: Node, src: Node) -> None:
    """Numpy broadcasting: trailing dims line up; a size-1 source dim is not the same index."""
    off = len(n.shape) - len(src.shape)
    for d, size in enumerate(src.shape):
        if size == n.shape[off + d] and size > 1:
            uf.union((n, off + d), (src, d))


def _elementwise(uf: _UnionFind, n: Node) -> None:
    for s in n.src:
        _aligned(uf, n, s)


def _matmul(uf: _UnionFind, n: Node) -> None:
    a, b = n.src
    r = len(n.shape)
    for src in (a, b):
        off = r - len(src.shape)
        for d in range(len(src.shape) - 2):
            if src.shape[d] == n.shape[off + d] and src.shape[d] > 1:
                uf.union((n, off + d), (src, d))
    uf.union((n, r - 2), (a, len(a.shape) - 2))
    uf.union((n, r - 1), (b, len(b.shape) - 1))
    k = (a, len(a.shape) - 1)
    uf.union(k, (b, len(b.shape) - 2))
    uf.reduced.add(k)


def _reduce(uf: _UnionFind, n: Node) -> None:
    (x,) = n.src
    for d in range(len(x.shape)):
        if d == n.arg:
            uf.reduced.add((x, d))
        else:
            uf.union((n, d), (x, d))


def _transpose(uf: _UnionFind, n: Node) -> None:
    for d, p in enumerate(n.arg):
        uf.union((n, d), (n.src[0], p))


def reshape_groups(
    a: tuple[int, ...], b: tuple[int, ...]
) -> list[tuple[list[int], list[int], bool]]:
    """A reshape's dims paired by running products: (dims of a, dims of b, whether the products
    met) per group; a group whose products never meet ends the shapes."""
    out = []
    i = j = 0
    while i < len(a) or j < len(b):
        gi, gj = [i] if i < len(a) else [], [j] if j < len(b) else []
        pa = a[i] if i < len(a) else 1
        pb = b[j] if j < len(b) else 1
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                gi.append(i)
                pa *= a[i]
                i += 1
            elif j < len(b):
                gj.append(j)
                pb *= b[j]
                j += 1
            else:
                break
        out.append((gi, gj, pa == pb))
    return out


def _reshape(uf: _UnionFind, n: Node) -> None:
    """Pair dims by running products; one-to-one groups keep their index, others freeze."""
    src = n.src[0]
    a, b = src.shape, n.shape
    for gi, gj, _ in reshape_groups(a, b):
        big_i = [d for d in gi if a[d] > 1]
        big_j = [d for d in gj if b[d] > 1]
        if len(big_i) == 1 and big_j or len(big_j) == 1 and big_i:
            # one dim <-> several: tiling the outermost of the several in whole units of the
            # inner ones is the same tiling of the single dim, so those two are one index
            uf.union((src, big_i[0]), (n, big_j[0]))
            uf.frozen.update((src, d) for d in big_i[1:])
            uf.frozen.update((n, d) for d in big_j[1:])
        else:
            uf.frozen.update((src, d) for d in big_i)
            uf.frozen.update((n, d) for d in big_j)


RULES: dict[Op, Callable[[_UnionFind, Node], None]] = {
    **{op: _elementwise for op in UNARY | BINARY},
    **{op: _reduce for op in REDUCE},
    Op.MATMUL: _matmul,
    Op.TRANSPOSE: _transpose,
    Op.RESHAPE: _reshape,
    Op.BROADCAST: _elementwise,
}
"""Op -> how its dims relate to its sources' dims."""


@dataclass(frozen=True)
class DimClass:
    """One index of the computation."""

    id: int
    size: int
    reduced: bool
    """Summed over somewhere (a matmul's k, a reduction axis)."""
    splittable: bool
    """May be tiled by a grid dim or the loop (no reshape merges or splits it)."""
    inputs: tuple[tuple[int, int], ...]
    """(input position, dim) pairs carrying this index."""
    outputs: tuple[tuple[int, int], ...]
    """(output position, dim) pairs carrying this index."""

    @property
    def spatial(self) -> bool:
        """An output carries it: blocks can be laid side by side along it."""
        return bool(self.outputs)


@dataclass(frozen=True)
class DimClasses:
    classes: tuple[DimClass, ...]
    input_class: tuple[tuple[int | None, ...], ...]
    """Per input, per dim: its class id (None for size-1 dims)."""
    output_class: tuple[tuple[int | None, ...], ...]
    node_class: dict[Node, tuple[int | None, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )
    """Every node of the graph: per dim, its class (None for size-1 dims)."""

    def splittable(self) -> tuple[DimClass, ...]:
        return tuple(c for c in self.classes if c.splittable and c.size > 1)


def dim_classes(kg: KernelGraph) -> DimClasses:
    """The index classes of `kg`: those of its inputs and outputs first, then inner ones."""
    uf = _UnionFind()
    for n in toposort(list(kg.inputs) + list(kg.outputs)):
        rule = RULES.get(n.op)
        if rule is not None:
            rule(uf, n)
    roots: dict[Slot, int] = {}
    ins: list[tuple[int | None, ...]] = []
    outs: list[tuple[int | None, ...]] = []

    def cls(n: Node, d: int) -> int | None:
        if n.shape[d] == 1:
            return None
        return roots.setdefault(uf.find((n, d)), len(roots))

    for n in kg.inputs:
        ins.append(tuple(cls(n, d) for d in range(len(n.shape))))
    for n in kg.outputs:
        outs.append(tuple(cls(n, d) for d in range(len(n.shape))))
    nodes = toposort(list(kg.inputs) + list(kg.outputs))
    for n in nodes:  # inner indices (a softmax's keys seen only by reductions) get classes too
        for d in range(len(n.shape)):
            cls(n, d)
    node_class = {n: tuple(cls(n, d) for d in range(len(n.shape))) for n in nodes}
    reduced = {uf.find(s) for s in uf.reduced}
    frozen = {uf.find(s) for s in uf.frozen}
    sizes: dict[int, int] = {}
    for slot in uf.parent:
        if slot[0].shape[slot[1]] > 1 and uf.find(slot) in roots:
            cid = roots[uf.find(slot)]
            sizes[cid] = min(sizes.get(cid, slot[0].shape[slot[1]]), slot[0].shape[slot[1]])
    classes = []
    for root, cid in sorted(roots.items(), key=lambda kv: kv[1]):
        node, d = root
        classes.append(
            DimClass(
                cid,
                sizes.get(cid, node.shape[d]),
                root in reduced,
                root not in frozen,
                tuple((i, d) for i, cs in enumerate(ins) for d, c in enumerate(cs) if c == cid),
                tuple((o, d) for o, cs in enumerate(outs) for d, c in enumerate(cs) if c == cid),
            )
        )
    return DimClasses(tuple(classes), tuple(ins), tuple(outs), node_class)


# ---- index typing of candidate values ------------------------------------------------------------

Classes = tuple[int | None, ...]
"""Per dim of a value: its index class, None for a size-1 dim."""


def _no_repeats(cs: Classes) -> Classes | None:
    real = [c for c in cs if c is not None]
    return cs if len(set(real)) == len(real) else None


def _t_elementwise(arg, srcs: list[Classes], out_rank: int) -> Classes | None:
    out: list[int | None] = [None] * out_rank
    for cs in srcs:
        off = out_rank - len(cs)
        for d, c in enumerate(cs):
            if c is None:
                continue
            if out[off + d] is None:
                out[off + d] = c
            elif out[off + d] != c:
                return None  # two different indices meet elementwise
    return _no_repeats(tuple(out))


def _t_matmul(arg, srcs: list[Classes], out_rank: int) -> Classes | None:
    a, b = srcs
    if len(a) < 2 or len(b) < 2 or a[-1] != b[-2]:
        return None  # a contraction pairs two different indices
    batch = _t_elementwise(None, [a[:-2], b[:-2]], out_rank - 2)
    if batch is None:
        return None
    return _no_repeats(batch + (a[-2], b[-1]))


def _t_reduce(arg, srcs: list[Classes], out_rank: int) -> Classes | None:
    (x,) = srcs
    return x[:arg] + (None,) + x[arg + 1 :]


def _t_transpose(arg, srcs: list[Classes], out_rank: int) -> Classes | None:
    return tuple(srcs[0][p] for p in arg)


def _t_row(arg, srcs: list[Classes], out_rank: int) -> Classes | None:
    (x,) = srcs
    return (None,) + x if out_rank == len(x) + 1 else None


def _t_acc_exp_sum(arg, srcs: list[Classes], out_rank: int) -> Classes | None:
    return srcs[0][:-1] + (None,)


def _t_acc_exp_wsum(arg, srcs: list[Classes], out_rank: int) -> Classes | None:
    return _t_matmul(arg, srcs, out_rank)


TYPING = {
    **{op: _t_elementwise for op in UNARY | BINARY},
    **{op: _t_reduce for op in REDUCE},
    Op.MATMUL: _t_matmul,
    Op.TRANSPOSE: _t_transpose,
    Op.RESHAPE: _t_row,
    Op.ACC_SUM: lambda arg, srcs, r: srcs[0],
    Op.ACC_EXP_SUM: _t_acc_exp_sum,
    Op.ACC_EXP_WSUM: _t_acc_exp_wsum,
    Op.CONST: lambda arg, srcs, r: (),
    # a recipe's broadcast step (value, shape donor): the donor's indices where the value has 1
    Op.BROADCAST: _t_elementwise,
}
"""Op -> the index classes of its result from its sources', or None when the op would pair two
different indices (elementwise, or in a contraction) or give one value an index twice. The
target's own values never do either, so neither can a subexpression of it: a sound, cheap
filter that runs before the abstract-expression check."""


def value_classes(op: Op, arg, srcs: list[Classes], out_rank: int) -> Classes | None:
    """TYPING's answer, memoised: the enumeration asks it for every pair it tries (a million
    times in a large region), about a few hundred distinct (op, arg, classes) combinations."""
    try:
        key = (op, arg, tuple(srcs), out_rank)
        got = _TYPED.get(key, _UNTYPED)
    except TypeError:  # an unhashable arg: answer without the memo
        return _value_classes(op, arg, srcs, out_rank)
    if got is _UNTYPED:
        got = _TYPED[key] = _value_classes(op, arg, srcs, out_rank)
    return got


_TYPED: dict[tuple, Classes | None] = {}
_UNTYPED = object()


def _value_classes(op: Op, arg, srcs: list[Classes], out_rank: int) -> Classes | None:
    rule = TYPING.get(op)
    try:
        return None if rule is None else rule(arg, srcs, out_rank)
    except (IndexError, TypeError):
        return None  # ranks that do not fit the op: shape inference rejects it too


def typing_is_sound(dc: DimClasses) -> bool:
    """The filter's premise on this target: no value carries an index twice."""
    return all(_no_repeats(cs) is not None for cs in dc.node_class.values())
