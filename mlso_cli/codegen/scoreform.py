"""Scores the register-resident online softmax can compute: s = c * (A B [+ A2 B2]) * f[key].

Why: a search writes the score of an attention in many equivalent ways: scaled after the matmul
instead of on Q, a per-key factor (qknorm's K normalisation moved onto the scores), the sum of
two matmuls (MLA's latent and rope terms). mlso::FlashRows computes each of these in registers
(the C fragments of the matmuls are summed, multiplied by the constant and the key factor, then
the row max is taken), so none of them needs the shared-memory score path. Anything else that is
elementwise in s is not a form and keeps that path.

Rules are a table: op -> function(node, recurse) -> ScoreForm | None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction

from mlso_cli.ir.node import Node, const_value, toposort
from mlso_cli.ir.ops import Op, Phase

MAX_TERMS = 2


@dataclass(frozen=True)
class ScoreForm:
    terms: tuple[Node, ...]
    """The loop-phase matmuls whose sum is the score, before the factors."""
    scale: Fraction
    key_factor: Node | None
    """A value of shape (.., 1, keys): one factor per key (column of s), or None."""
    nodes: frozenset[Node]
    """Every node of the form (terms, the adds and muls, s), factors excluded."""


def _key_shaped(f: Node, s: Node) -> bool:
    return (
        len(f.shape) == len(s.shape)
        and f.shape[-2] == 1
        and f.shape[-1] == s.shape[-1]
        and all(d == 1 for d in f.shape[:-2])
    )


def _matmul(n: Node, form: Callable[[Node], ScoreForm | None]) -> ScoreForm | None:
    if n.phase is not Phase.LOOP:
        return None
    return ScoreForm((n,), Fraction(1), None, frozenset({n}))


def _mul(n: Node, form: Callable[[Node], ScoreForm | None]) -> ScoreForm | None:
    for x, f in (n.src, n.src[::-1]):
        if x.shape != n.shape:
            continue
        inner = form(x)
        if inner is None:
            continue
        if f.op is Op.CONST:
            return replace(inner, scale=inner.scale * const_value(f), nodes=inner.nodes | {n})
        if inner.key_factor is None and _key_shaped(f, n):
            return replace(inner, key_factor=f, nodes=inner.nodes | {n})
    return None


def _add(n: Node, form: Callable[[Node], ScoreForm | None]) -> ScoreForm | None:
    a, b = (form(x) if x.shape == n.shape else None for x in n.src)
    if (
        a is None
        or b is None
        or a.key_factor is not None
        or b.key_factor is not None
        or a.scale != b.scale
    ):
        return None
    return ScoreForm(a.terms + b.terms, a.scale, None, a.nodes | b.nodes | {n})


RULES: dict[Op, Callable[[Node, Callable[[Node], ScoreForm | None]], ScoreForm | None]] = {
    Op.MATMUL: _matmul,
    Op.MUL: _mul,
    Op.ADD: _add,
}


def score_form(s: Node, consumers: dict[Node, list[Node]]) -> ScoreForm | None:
    """s as a ScoreForm, when its inner nodes are used only inside the form (so nothing else
    needs them in memory) and the key factor does not depend on the score itself."""

    def form(n: Node) -> ScoreForm | None:
        rule = RULES.get(n.op)
        return rule(n, form) if rule is not None else None

    found = form(s)
    if found is None or len(found.terms) > MAX_TERMS:
        return None
    if any(c not in found.nodes for n in found.nodes - {s} for c in consumers.get(n, [])):
        return None
    if found.key_factor is not None and found.nodes & set(toposort([found.key_factor])):
        return None
    return found
