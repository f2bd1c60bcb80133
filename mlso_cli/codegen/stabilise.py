"""Which EXPs are softmax numerators, and the row max that makes them safe in floats.

Why: the lifted Softmax is exp(x) -> reduce_sum -> div (often with casts, or a 0/1 mask
multiplied in), and the search writes exp(x) @ v / rowsum(exp(x)) or exp(x) @ v alone. In exact arithmetic that is the softmax; in fp32 exp(100) overflows, in fp16
exp(12) does. An EXP whose value reaches a REDUCE_SUM through ops that are linear in it
(casts, negation, multiplication or division by other values, all shape-preserving) is emitted
as exp(x - M) scaled by M = max of x over that sum's axis (scale.py). The division by the sum
then cancels the scale, and anything else materialises the exact value. M skips positions
whose mask weight is zero, so a masked-out large logit cannot underflow the kept ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mlso_cli.codegen import synthetic
from mlso_cli.ir import build as b
from mlso_cli.ir.node import Node, toposort
from mlso_cli.ir.ops import Op

LINEAR = frozenset({Op.CAST, Op.NEG, Op.MUL, Op.DIV})
"""Ops through which a value stays proportional to the EXP it came from."""

SUMS = frozenset({Op.REDUCE_SUM, Op.REDUCE_MEAN})


def consumers_of(nodes: Sequence[Node]) -> dict[Node, list[Node]]:
    out: dict[Node, list[Node]] = {n: [] for n in nodes}
    for n in nodes:
        for s in dict.fromkeys(n.src):
            out.setdefault(s, []).append(n)
    return out


def _linear_path(e: Node, consumers: Mapping[Node, list[Node]]) -> tuple[int, list[Node]] | None:
    """(axis of the first sum reached, mask factors met on the way) or None. A matmul that
    contracts the value counts as a sum over the contracted axis (the last of A, the second-last
    of B) when no sum is reached: the scale factors out of it (scale.matmul_scale)."""
    seen = {e}
    frontier: list[tuple[Node, list[Node]]] = [(e, [])]
    contracted: tuple[int, list[Node]] | None = None
    while frontier:
        nxt = []
        for x, factors in frontier:
            for c in consumers.get(x, []):
                if c.op in SUMS and c.src[0] == x:
                    if e.shape[c.arg] > 1:
                        return c.arg, factors
                    continue
                if (
                    c.op is Op.MATMUL
                    and contracted is None
                    and len(e.shape) >= 2
                    and (c.src[0] == x) != (c.src[1] == x)
                ):
                    axis = len(e.shape) - (1 if c.src[0] == x else 2)
                    if e.shape[axis] > 1:
                        contracted = axis, factors
                    continue
                if c.op not in LINEAR or c.shape != e.shape or c in seen:
                    continue
                if c.op is Op.DIV and c.src[0] != x:
                    continue
                extra = []
                if c.op is Op.MUL:
                    other = c.src[1] if c.src[0] == x else c.src[0]
                    if other in seen or e in toposort([other]):
                        continue  # exp * f(exp): not linear (and its max would depend on itself)
                    if other.op is not Op.CONST:
                        extra = [other]
                seen.add(c)
                nxt.append((c, factors + extra))
        frontier = nxt
    return contracted


def stabilised(
    nodes: Sequence[Node], consumers: Mapping[Node, list[Node]]
) -> dict[Node, tuple[int, list[Node]]]:
    """EXP node -> (axis of its row max, mask factors), for every EXP that feeds a sum linearly:
    the one decision that code generation and the interpreter's float32 mode both follow."""
    out: dict[Node, tuple[int, list[Node]]] = {}
    for e in nodes:
        if e.op is Op.EXP:
            found = _linear_path(e, consumers)
            if found is not None:
                out[e] = found
    return out


def stabilisers(nodes: Sequence[Node], consumers: Mapping[Node, list[Node]]) -> dict[Node, Node]:
    """EXP node -> its synthetic RowMax node, for every EXP that feeds a sum linearly."""
    out: dict[Node, Node] = {}
    for e, (axis, factors) in stabilised(nodes, consumers).items():
        weight = None
        for f in factors:
            weight = f if weight is None else b.mul(weight, f)
        out[e] = synthetic.row_max(e.src[0], axis, weight)
    return out
