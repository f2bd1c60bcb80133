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
import math
import time
from fractions import Fraction
from typing import Any

from mlso_cli.ir.graph import KernelGraph
from mlso_cli.search import terms as T
from mlso_cli.search.abstract import Expr, abstract_graph

MAX_SUBSETS = 4096
"""Sub-products / sub-sums enumerated per monomial or poly. Beyond it only the whole and its
single members are stored, so a check prunes some true subexpressions of such huge targets
(none of the benchmark regions comes near: their largest monomial has 9 choices)."""

MAX_VISITS = 20_000
"""Terms visited while building one target. Chains of contractions (a region holding a whole
attention block and its projections) make the partial-contraction closure grow exponentially:
beyond the budget the target stops growing and is marked `truncated`, so a check may prune a true
subexpression there (the search then finds less, it never accepts a wrong program: acceptance is
the field check's)."""

MAX_BUILD_S = 120.0
"""Wall-clock cap on building one target (the same truncation as MAX_VISITS): a region's search
must not spend its budget before the first candidate."""


# ---- pattern keys ------------------------------------------------------------------------------

_KEY: dict[tuple[int, str], int] = {}
_FORM: dict[tuple, int] = {}
"""Interned shallow forms: a form names its children by their own form ids, so interning one is
a hash of a few small ints however deep the term (a deep tuple was hashed and compared whole)."""
_LOCAL: dict[tuple[int, frozenset[int]], tuple[int, tuple[int, ...]]] = {}
"""(term, its skipped digits) -> (form id, its free digits in first-occurrence order)."""

_NONE: frozenset[int] = frozenset()

Local = tuple[int, tuple[int, ...]]


def _form(key: tuple) -> int:
    k = _FORM.get(key)
    if k is None:
        k = _FORM[key] = len(_FORM)
    return k


_AT_START = frozenset({None})


class _Pattern:
    """One pattern key computation: a canonical form of a term in which
      - free variables are numbered by first occurrence (their names and sizes are forgotten),
      - a free digit that always follows the same free digit is dropped (the pair is one digit),
      - a free digit chain that only ever precedes bound digits is dropped (an offset: the term
        is a partial sum),
      - binders lose their ranges, and a bound digit is named by its rank of first occurrence in
        its binder's body (not by the binder's canonical id, whose order follows intern ids: a
        free block digit in a partial sum changed that order, and gn's split-K mean term, an
        alpha-variant of the target's, was refused).

    Why hash-consed: the search computes a key for every new candidate poly, and nearly all of
    such a poly's subterms were seen before. A subterm's *local* form (its free variables
    numbered from 0) is context-free, so it is interned once (`_LOCAL`, per term and the skipped
    digits it uses) as a form id plus its free variables in first-occurrence order. A parent's
    form is its children's form ids plus, per child, where the child's variables go in the
    parent: a number of the parent's own first-occurrence order, or for a binder's body, the
    bound variable's rank (negative). Two terms get the same form iff one is the other with
    variables renamed consistently, which is what serialising the whole term with first-
    occurrence numbering decided; a key costs the term's new subterms, not its size.

    Commutative children are ordered by their form id (a name-free total order; ties keep the
    term order), so the numbering cannot depend on variable names."""

    def __init__(self, p: int) -> None:
        # the offset test reads each variable's neighbour summary
        near = {v: T.neighbours(s) for v, s in T.adjacency(p).items()}
        free = T.deps(p)
        succ = dict(T.mergeable_pairs(p, free))
        tails = set(succ.values())
        skip: set[int] = set()
        for v in free:
            if v in tails or v not in near:
                continue
            chain = [v]
            while chain[-1] in succ:
                chain.append(succ[chain[-1]])
            last = near[chain[-1]][1]
            offset = near[v][0] == _AT_START and None not in last and last.isdisjoint(free)
            skip.update(chain if offset else chain[1:])
        self.skip = frozenset(skip)

    def local(self, i: int) -> Local:
        """i's form on its own and its free variables in first-occurrence order."""
        sk = T.deps(i) & self.skip if self.skip else _NONE
        key = (i, sk)
        got = _LOCAL.get(key)
        if got is None:
            got = _LOCAL[key] = self._build(i, sk)
        return got

    def _build(self, i: int, sk: frozenset[int]) -> Local:
        t = T.node(i)
        k = t[0]
        num: dict[int, int] = {}
        if k == "in":
            dims = tuple(
                tuple(num.setdefault(v, len(num)) for v in dim if v not in sk) for dim in t[2]
            )
            return _form(("in", t[1], dims)), tuple(num)
        if k == "M" or k == "P":
            return self._bag(k, t[1], num)
        if k == "exp" or k == "pw":
            f, occ = self.local(t[1])
            return _form((k, f)), occ
        if k == "fn":
            args = [self.local(a) for a in t[2]]
            if t[1] in T.SYMMETRIC:
                args.sort(key=_fid)
            return _form(("fn", t[1], tuple(_place(a, num) for a in args))), tuple(num)
        if k == "sum" or k == "red":
            bs = {v for v, _ in (t[1] if k == "sum" else t[2])}
            f, occ = self.local(t[2] if k == "sum" else t[3])
            scope: dict[int, int] = {}
            codes = tuple(
                -1 - scope.setdefault(v, len(scope)) if v in bs else num.setdefault(v, len(num))
                for v in occ
            )
            return _form((k, t[1] if k == "red" else "", len(bs), f, codes)), tuple(num)
        raise AssertionError(f"pattern of a {k} term")

    def _bag(self, k: str, items: Any, num: dict[int, int]) -> Local:
        """A product (factor, exponent) or sum (monomial, coefficient) in canonical order."""
        parts = sorted(((self.local(c), x) for c, x in items), key=_item_fid)
        return _form((k, tuple((_place(c, num), _q(x)) for c, x in parts))), tuple(num)

    def poly(self, p: int, drop: dict[int, T.Exp]) -> int:
        """Terms in canonical order with the content dropped and the first coefficient 1."""
        parts = []
        for m, c in T.terms(p):
            facs = T.factors(m)
            if drop and any(f in drop for f, _ in facs):
                kept = [(f, e - drop.get(f, 0)) for f, e in facs]
                loc = self._bag("M", [(f, e) for f, e in kept if e], {})
            else:
                loc = self.local(m)
            parts.append((loc, c))
        parts.sort(key=_item_fid)
        num: dict[int, int] = {}
        lead = parts[0][1]
        return _form(("P/", tuple((_place(m, num), _ratio(c, lead)) for m, c in parts)))


def _q(x: Fraction | int) -> int | tuple[int, int]:
    """A rational as a form entry: an int, or (numerator, denominator) in lowest terms. Equal
    values give equal entries, as Fractions did, but hashing a Fraction computes a modular
    inverse every time, and forms are hashed on every lookup."""
    if type(x) is int:
        return x
    return x.numerator if x.denominator == 1 else (x.numerator, x.denominator)


def _ratio(c: Fraction | int, lead: Fraction | int) -> int | tuple[int, int]:
    """c / lead as a form entry (`_q`), without building the Fraction."""
    if lead == 1:
        return _q(c)
    n = c.numerator * lead.denominator
    d = c.denominator * lead.numerator
    if d < 0:
        n, d = -n, -d
    g = math.gcd(n, d)
    return n // g if d == g else (n // g, d // g)


def _fid(loc: Local) -> int:
    return loc[0]


def _item_fid(item: tuple[Local, Any]) -> int:
    return item[0][0]


def _place(loc: Local, num: dict[int, int]) -> tuple[int, tuple[int, ...]]:
    """A child's form and where its free variables go in the parent's first-occurrence order."""
    f, occ = loc
    if not num:
        num.update(zip(occ, range(len(occ))))
        return f, _identity(len(occ))
    codes = []
    for v in occ:
        n = num.get(v)
        if n is None:
            n = num[v] = len(num)
        codes.append(n)
    return f, tuple(codes)


_IDENTITY: list[tuple[int, ...]] = []


def _identity(n: int) -> tuple[int, ...]:
    """(0, ..., n-1), shared: the first child's variables are numbered in their own order."""
    while len(_IDENTITY) <= n:
        _IDENTITY.append(tuple(range(len(_IDENTITY))))
    return _IDENTITY[n]


def mono_key(m: int) -> int:
    """Pattern of a monomial, coefficient ignored."""
    k = _KEY.get((m, "m"))
    if k is None:
        k = _KEY[(m, "m")] = _Pattern(m).local(m)[0]
    return k


def poly_key(p: int) -> int:
    """Pattern of a sum of >= 2 monomials, up to a common monomial factor and a scale."""
    k = _KEY.get((p, "p"))
    if k is None:
        k = _KEY[(p, "p")] = _Pattern(p).poly(p, dict(T.factors(_content(p))))
    return k


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
        self._factors: set[int] = set()
        self._monos: set[int] = set()
        self._contracted: set[int] = set()
        """Sums built as partial contractions: theirs are among their parent's, not enumerated again."""
        self._renamings: dict[int, dict[int, tuple[int]]] = {}
        self.truncated = False
        self.timed_out = False
        self._memo: dict[int, bool] = {}
        self._deadline = time.monotonic() + MAX_BUILD_S
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
        if len(self._seen) >= MAX_VISITS:
            self.truncated = True
            return
        if len(self._seen) % 64 == 0 and time.monotonic() > self._deadline:
            self.truncated = self.timed_out = True  # not reproducible: the search reports partial
            return
        self._seen.add(p)
        ts = T.terms(p)
        for m, _ in ts:
            self._visit_mono(m)
        if len(ts) >= 2:
            self._sub_sums(ts)
            # a*(b+c): the common factor a is a subexpression even where its monomials are too
            # large to enumerate their sub-products (MAX_SUBSETS)
            self.monos.add(mono_key(_content(p)))

    def _sub_sums(self, ts: tuple[tuple[int, Fraction], ...]) -> None:
        n = len(ts)
        if 2**n > MAX_SUBSETS:
            self.polys.add(poly_key(T.poly(dict(ts))))
            return
        for r in range(2, n + 1):
            for sub in itertools.combinations(ts, r):
                self.polys.add(poly_key(T.poly(dict(sub))))

    def _renaming(self, f: int) -> dict[int, tuple[int]]:
        """Free variables for the bound ones of sum factor f: one set per factor, so a sum reached
        again builds the same terms (fresh ones every time made each visit new, exponentially)."""
        ren = self._renamings.get(f)
        if ren is None:
            ren = self._renamings[f] = {v: (T.fresh(n),) for v, n in T.node(f)[1]}
        return ren

    def _visit_mono(self, m: int) -> None:
        if m in self._monos:
            return
        self._monos.add(m)
        facs = T.factors(m)
        options = [[0, *_exponent_options(e)] for _, e in facs]
        count = 1
        for o in options:
            count *= len(o)
        if count <= MAX_SUBSETS:
            for choice in itertools.product(*options):
                self.monos.add(
                    mono_key(T.mono({f: e for (f, _), e in zip(facs, choice) if e != 0}))
                )
        else:
            self.monos.add(mono_key(m))
            for f, e in facs:
                for x in _exponent_options(e):
                    self.monos.add(mono_key(T.mono({f: x})))
        for f, e in facs:
            self._visit_factor(f)
            if e == 1 and T.node(f)[0] == "sum":
                # c * sum_i b = sum_i (c b): the outside factors times the body, index free
                body = T.subst(T.node(f)[2], self._renaming(f))
                rest = T.mono({g: x for g, x in facs if g != f})
                self._visit(T.mul(T.of_mono(rest), T.of_mono(body)))

    def _visit_factor(self, f: int) -> None:
        if f in self._factors:
            return  # its closure is built (renamed copies would only repeat the same patterns)
        self._factors.add(f)
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
            if len(bound) >= 2 and f not in self._contracted:
                self._partial_contractions(f, bound, t[2])

    def _partial_contractions(self, f: int, bound: tuple[tuple[int, int], ...], body: int) -> None:
        """sum_{V} b contains sum_W (the factors of b that use W) for every W inside V."""
        ren = self._renaming(f)
        b = T.subst(body, ren)
        for r in range(1, len(bound)):
            for w in itertools.combinations(bound, r):
                ws = [(ren[v][0], n) for v, n in w]
                names = {x for x, _ in ws}
                inner = T.mono({g: e for g, e in T.factors(b) if T.deps(g) & names})
                q = T.sum_over(ws, T.of_mono(inner))
                # a contraction over W' inside W of this sum is the parent's contraction over W'
                self._contracted.update(
                    g for m, _ in T.terms(q) for g, _ in T.factors(m) if T.node(g)[0] == "sum"
                )
                self._visit(q)

    # -- checking --
    def admits(self, expr: Expr | int) -> bool:
        """True when the candidate's expression is a subexpression of some target tensor."""
        p = expr if isinstance(expr, int) else expr.poly
        got = self._memo.get(p)
        if got is None:
            ts = T.terms(p)
            if T.is_constant(p):
                got = True
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
