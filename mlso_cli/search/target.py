"""The pruning check: is a candidate tensor's abstract expression a subexpression of a target?

Why a precomputed key set: the search asks this millions of times. The target is normalised
once and every shape a subexpression can take is turned into a *pattern key* (an interned int);
a check is then one key computation (memoised per candidate term) and one set lookup.

A pattern key forgets what a subexpression legitimately forgets about its context:
  - which free index variable is which (they are renumbered by first occurrence), and their
    sizes: a block's tile has the pattern of the full tensor;
  - digits that always occur side by side are one digit (a tile's (G, t) is the full index);
  - the range of a sum, and a free digit that only ever offsets a bound digit: a partial sum
    (split-K, a loop accumulator before the loop ends, one block's share before the combine)
    has the pattern of the full sum (the split axiom, sum_n = sum_j sum_{n/j});
  - a monomial's coefficient, and for a sum of monomials its common factor and overall scale
    (a*(b+c) has b+c as a subexpression under distributivity).
What it keeps: the structure of every factor (which input at which index pattern, the exact
constants inside exp/sqrt/erf/... arguments and inside sums of monomials, which axis each sum
binds), so a softmax over the wrong axis, exp of the wrong argument, a wrong eps or a missing
factor inside a sum do not match.

Subexpressions of a target are: every normal-form poly of every target node, anything inside
them (exp/function arguments, inverted polys, sum bodies), every sub-product of a monomial,
every sub-sum of a poly, and every partial contraction of a flattened multi-variable sum
(sum_{k,r} x a b contains sum_k x a).
"""

from __future__ import annotations

import itertools
from fractions import Fraction

from mlso_cli.ir.graph import KernelGraph
from mlso_cli.search import terms as T
from mlso_cli.search.abstract import Expr, abstract_graph

MAX_SUBSETS = 4096
"""Sub-products / sub-sums enumerated per monomial or poly. Beyond it only the whole and its
single members are stored, so a check prunes some true subexpressions of such huge targets
(none of the benchmark regions comes near: their largest monomial has 9 choices)."""


# ---- pattern keys ------------------------------------------------------------------------------

_KEY: dict[tuple[int, str], int] = {}
_ERASE: dict[int, int] = {}


def _erase(i: int) -> int:
    """Term i with every binder's range set to 0 (sums of any range share a pattern)."""
    r = _ERASE.get(i)
    if r is None:
        t = T.node(i)
        k = t[0]
        if k in ("P", "M"):
            r = T.mk((k, tuple(sorted((_erase(c), x) for c, x in t[1]))))
        elif k in ("exp", "pw"):
            r = T.mk((k, _erase(t[1])))
        elif k == "fn":
            r = T.mk((k, t[1], tuple(_erase(a) for a in t[2])))
        elif k == "sum":
            r = T.mk((k, tuple((v, 0) for v, _ in t[1]), _erase(t[2])))
        elif k == "red":
            r = T.mk((k, t[1], tuple((v, 0) for v, _ in t[2]), _erase(t[3])))
        else:
            r = i
        _ERASE[i] = r
    return r


def _canonical_vars(p: int) -> int:
    """Merge always-adjacent free digits, drop free digits that only offset bound ones, and
    renumber the free variables by first occurrence."""
    while True:
        free = set(T.deps(p))
        pairs = T.mergeable_pairs(p, free)
        if not pairs:
            break
        a, b = pairs[0]
        p = T.merge(p, a, b, T.fresh(0))
    adj = T.adjacency(p)
    free = T.deps(p)
    offsets = {f: () for f, s in adj.items()
               if all(prev is None and nxt is not None and nxt not in free for prev, nxt in s)}
    if offsets:
        p = T.subst(p, offsets)
    ren = {v: (T.bvar(0, r),) for r, v in enumerate(T.occurrences(p))}
    return T.subst(p, ren)


def mono_key(m: int) -> int:
    """Pattern of a monomial, coefficient ignored."""
    k = _KEY.get((m, "m"))
    if k is None:
        k = _KEY[(m, "m")] = _erase(_canonical_vars(T.of_mono(m)))
    return k


def poly_key(p: int) -> int:
    """Pattern of a sum of >= 2 monomials, up to a common monomial factor and a scale."""
    k = _KEY.get((p, "p"))
    if k is None:
        q = _canonical_vars(_primitive(p))
        ts = T.terms(q)
        lead = min(ts)[1] if ts else Fraction(1)
        k = _KEY[(p, "p")] = _erase(T.scale(q, 1 / lead))
    return k


def _primitive(p: int) -> int:
    """p divided by its content."""
    c = _content(p)
    if c == T.UNIT:
        return p
    return T.mul(p, T.of_mono(T.mono({g: -e for g, e in T.factors(c)})))


def _content(p: int) -> int:
    """The monomial common to all terms of p (same-sign exponents, the smaller in size)."""
    ts = T.terms(p)
    common: dict[int, T.Exp] | None = None
    for m, _ in ts:
        f = dict(T.factors(m))
        if common is None:
            common = f
            continue
        nxt: dict[int, T.Exp] = {}
        for g, e in common.items():
            e2 = f.get(g)
            if e2 is None or (e > 0) != (e2 > 0):
                continue
            if isinstance(e, int) and isinstance(e2, int):
                nxt[g] = min(e, e2) if e > 0 else max(e, e2)
            elif e == e2:
                nxt[g] = e
        common = nxt
    return T.mono(common or {})


def _exponent_options(e: T.Exp) -> list[T.Exp]:
    if isinstance(e, int):
        return list(range(1, e + 1)) if e > 0 else list(range(-1, e - 1, -1))
    return [e]


# ---- the target --------------------------------------------------------------------------------


class Target:
    """All subexpression patterns of a set of target tensors, computed once."""

    def __init__(self, polys: list[int]) -> None:
        self.monos: set[int] = set()
        self.polys: set[int] = set()
        self._seen: set[int] = set()
        self._memo: dict[int, bool] = {}
        self.outputs: tuple[Expr, ...] = ()
        """The target graph's output expressions (for expr_equal on a finished candidate)."""
        for p in polys:
            self._visit(p)

    @classmethod
    def from_graph(cls, kg: KernelGraph) -> Target:
        """Normalise every node of a (lifted) kernel graph: each is a subexpression of an output."""
        env = abstract_graph(kg)
        polys = [e.poly for n in kg.nodes() for e in _exprs(env[n])]
        t = cls(polys)
        t.outputs = tuple(env[o] for o in kg.outputs)
        return t

    # -- building --
    def _visit(self, p: int) -> None:
        if p in self._seen:
            return
        self._seen.add(p)
        ts = T.terms(p)
        for m, _ in ts:
            self._visit_mono(m)
        if len(ts) >= 2:
            self._sub_sums(ts)

    def _sub_sums(self, ts: tuple[tuple[int, Fraction], ...]) -> None:
        n = len(ts)
        if 2 ** n > MAX_SUBSETS:
            self.polys.add(poly_key(T.poly(dict(ts))))
            return
        for r in range(2, n + 1):
            for sub in itertools.combinations(ts, r):
                self.polys.add(poly_key(T.poly(dict(sub))))

    def _visit_mono(self, m: int) -> None:
        facs = T.factors(m)
        options = [[0, *_exponent_options(e)] for _, e in facs]
        count = 1
        for o in options:
            count *= len(o)
        if count <= MAX_SUBSETS:
            for choice in itertools.product(*options):
                self.monos.add(mono_key(T.mono({f: e for (f, _), e in zip(facs, choice) if e != 0})))
        else:
            self.monos.add(mono_key(m))
            for f, e in facs:
                for x in _exponent_options(e):
                    self.monos.add(mono_key(T.mono({f: x})))
        for f, e in facs:
            self._visit_factor(f)
            if e == 1 and T.node(f)[0] == "sum":
                # c * sum_i b = sum_i (c b): the outside factors times the body, index free
                body = T.subst(T.node(f)[2], {v: (T.fresh(n),) for v, n in T.node(f)[1]})
                rest = T.mono({g: x for g, x in facs if g != f})
                self._visit(T.mul(T.of_mono(rest), T.of_mono(body)))

    def _visit_factor(self, f: int) -> None:
        t = T.node(f)
        k = t[0]
        if k == "exp":
            self._visit(T.of_mono(t[1]))
        elif k == "fn":
            for a in t[2]:
                self._visit(a)
        elif k == "pw":
            self._visit(t[1])
        elif k == "red":
            self._visit(t[3])
        elif k == "sum":
            self._visit(T.of_mono(t[2]))
            bound = t[1]
            if len(bound) >= 2:
                self._partial_contractions(bound, t[2])

    def _partial_contractions(self, bound: tuple[tuple[int, int], ...], body: int) -> None:
        """sum_{V} b contains sum_W (the factors of b that use W) for every W inside V."""
        ren = {v: (T.fresh(n),) for v, n in bound}
        b = T.subst(body, ren)
        for r in range(1, len(bound)):
            for w in itertools.combinations(bound, r):
                ws = [(ren[v][0], n) for v, n in w]
                names = {x for x, _ in ws}
                inner = T.mono({f: e for f, e in T.factors(b) if T.deps(f) & names})
                self._visit(T.sum_over(ws, T.of_mono(inner)))

    # -- checking --
    def admits(self, expr: Expr | int) -> bool:
        """True when the candidate's expression is a subexpression of some target tensor."""
        p = expr if isinstance(expr, int) else expr.poly
        got = self._memo.get(p)
        if got is None:
            ts = T.terms(p)
            if not ts or (len(ts) == 1 and ts[0][0] == T.UNIT):
                got = True  # a constant
            elif len(ts) == 1:
                got = mono_key(ts[0][0]) in self.monos
            else:
                got = poly_key(p) in self.polys and self._content_admitted(p)
            self._memo[p] = got
        return got

    def _content_admitted(self, p: int) -> bool:
        """The factor common to all terms must itself be a subexpression (a*(b+c) needs a)."""
        c = _content(p)
        return c == T.UNIT or mono_key(c) in self.monos

    def size(self) -> int:
        """Number of stored patterns (memory and build-time indicator)."""
        return len(self.monos) + len(self.polys)


def _exprs(v: Expr | tuple[Expr, ...]) -> tuple[Expr, ...]:
    return v if isinstance(v, tuple) else (v,)
