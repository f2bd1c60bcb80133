"""Reduced shapes: the same computation with every index cut down, for fast verification.

Why: the finite-field check executes every block and loop step literally, so at Mirage's shapes
one check of attention takes up to 27 s, while the structure of a candidate does not depend on
the sizes. docs/architecture.md: verify structures at reduced shapes with the primes, inputs and target
fingerprints fixed once per run, and re-verify the chosen program at full shapes. A class of
size n becomes gcd(n, REDUCED) (powers of two stay tensor-core friendly, divisibility by the
grid and loop splits the search uses at reduced shapes is kept), and every node is rebuilt
through the IR builders, so the reduced target is spec-checked like any graph.
"""

from __future__ import annotations

from math import gcd

from mlso_cli.ir import build as b
from mlso_cli.ir.graph import KernelGraph
from mlso_cli.ir.node import Node, toposort
from mlso_cli.ir.ops import BINARY, REDUCE, UNARY, Op
from mlso_cli.search.dims import DimClasses, dim_classes

REDUCED = 64
"""The largest size a reduced index keeps (a power of two)."""


SPATIAL_REDUCED = 8
"""The largest size a reduced index that nothing sums over keeps: two blocks of a grid split
times a two-step loop over tiles of two (run.provisional's smallest sizes)."""


BATCH_REDUCED = 2
"""The largest size a reduced batch index keeps: one that nothing sums over and that no
contraction holds as a row or column (batch, heads, a GQA model's KV heads). Two blocks side by
side show its structure."""


def _matrix_classes(kg: KernelGraph, dc: DimClasses) -> set[int]:
    """Classes some matmul holds as a row or column of an operand or of its result."""
    out: set[int] = set()
    for n in dc.node_class:
        if n.op is not Op.MATMUL:
            continue
        for x in (n, *n.src):
            out.update(c for c in dc.node_class.get(x, ())[-2:] if c is not None)
    return out


def reduced_sizes(
    dc: DimClasses, limit: int = REDUCED, matrix: set[int] | None = None
) -> dict[int, int]:
    """Class id -> reduced size. Unsplittable classes (inner dims of a reshape) keep theirs: the
    reshape ties them to the product of the others. An index nothing sums over (batch, heads,
    rows) is cut further: it only lays independent outputs side by side, and at batch 16 the
    attention's 32-wide batch-head index made every reduced check 16 times the work of batch 1."""

    def cap(c) -> int:
        if c.reduced:
            return limit
        if matrix is not None and c.id not in matrix:
            return min(limit, BATCH_REDUCED)
        return min(limit, SPATIAL_REDUCED)

    return {c.id: gcd(c.size, cap(c)) if c.splittable else c.size for c in dc.classes}


def shrink(kg: KernelGraph, limit: int = REDUCED) -> tuple[KernelGraph, DimClasses]:
    """`kg` at reduced sizes, and the dimension classes of the original (class ids carry over:
    the reduced graph's class sizes are `reduced_sizes`)."""
    dc = dim_classes(kg)
    size = {c.id: c.size for c in dc.classes}
    new = reduced_sizes(dc, limit, _matrix_classes(kg, dc))
    memo: dict[Node, Node] = {}

    def shape_of(n: Node) -> tuple[int, ...]:
        out = []
        for d, c in zip(n.shape, dc.node_class.get(n, (None,) * len(n.shape))):
            out.append(d if c is None else d * new[c] // size[c])
        return tuple(out)

    for n in toposort(list(kg.inputs) + list(kg.outputs)):
        srcs = [memo[s] for s in n.src]
        if n.op is Op.INPUT:
            memo[n] = b.input_(n.arg, shape_of(n), n.dtype)
        elif n.op is Op.CONST:
            memo[n] = n
        elif n.op is Op.CAST:
            memo[n] = b.cast(srcs[0], n.arg)
        elif n.op in UNARY:
            memo[n] = b.unary(n.op, srcs[0])
        elif n.op in BINARY:
            memo[n] = b.binary(n.op, srcs[0], srcs[1])
        elif n.op is Op.MATMUL:
            memo[n] = b.matmul(srcs[0], srcs[1])
        elif n.op in REDUCE:
            memo[n] = b.reduce(n.op, srcs[0], n.arg)
        elif n.op is Op.TRANSPOSE:
            memo[n] = b.transpose(srcs[0], n.arg)
        elif n.op is Op.RESHAPE:
            memo[n] = b.reshape(srcs[0], shape_of(n))
        elif n.op is Op.BROADCAST:
            memo[n] = b.broadcast_to(srcs[0], shape_of(n))
        else:
            raise ValueError(
                f"cannot reduce a graph holding {n.op.value} (targets are lifted regions)"
            )
    small = kg.replace(
        inputs=tuple(memo[n] for n in kg.inputs), outputs=tuple(memo[n] for n in kg.outputs)
    )
    return small, dc
