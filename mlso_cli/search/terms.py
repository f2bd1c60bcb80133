"""Hash-consed terms in one normal form: the algebra under the search's abstract expressions.

Why a normal form rather than an e-graph: the pruning check runs millions of times, and a
normal form turns "equal under the axioms" into "same integer id", so a check is a few dict
lookups. Every term is interned once in a module-wide table; children are ids, so hashing and
equality are shallow and a term built twice is the same int.

The normal form (what the smart constructors below guarantee):
  - a *poly* is a sum of monomials with exact rational coefficients (commutativity,
    associativity and distributivity: products of polys are expanded);
  - a *mono* is a product of factors with exponents (x / y is x * y^-1; an inverse of a
    single monomial negates its exponents, an inverse of a longer poly is the factor `pw`);
  - factors: `in` (an input element, indexed by digit tuples of index variables), `exp` of a
    monomial (exp(a + b) = exp(a) exp(b), and exp(c m) = exp(m)^c), `fn` (uninterpreted:
    sqrt, erf, phi, max, ...), `pw` (a poly with a negative exponent), `sum` and `red`
    (index-aware sums / reductions binding variables of known size).
  - sums are linear (one `sum` per monomial), factors that do not depend on the bound
    variables are moved out, a bound variable the body does not use becomes its size as a
    coefficient (sum_i c = N c), nested sums are flattened into one binder, and two bound digit
    variables that always occur side by side (a, b) merge into one variable of size |a||b|: the
    split axiom sum_n = sum_j sum_{n/j}, which is what makes split-K and loop partials combine.

Index variables are ints. Free variables are positive (sizes in `_SIZE`); bound variables get
canonical negative ids from their binder's height and rank (alpha-equivalent sums intern to the
same id). An index of one tensor dim is a tuple of digit variables, most significant first.
"""

from __future__ import annotations

import itertools
from fractions import Fraction
from typing import Any

Exp = int | Fraction

_T: list[tuple[Any, ...]] = []
_ID: dict[tuple[Any, ...], int] = {}
_SIZE: dict[int, int] = {}
_FRESH = itertools.count(1)

ONE = Fraction(1)


class ExprError(ValueError):
    """A tensor the abstract expressions cannot describe: a view whose dims do not nest as
    mixed-radix digits, or a division by an identically zero expression (prune the candidate)."""


def mk(t: tuple[Any, ...]) -> int:
    """Intern one term; structurally equal terms get the same id."""
    i = _ID.get(t)
    if i is None:
        i = len(_T)
        _T.append(t)
        _ID[t] = i
    return i


def node(i: int) -> tuple[Any, ...]:
    return _T[i]


def fresh(size: int) -> int:
    """A new free index variable of the given size."""
    v = next(_FRESH)
    _SIZE[v] = size
    return v


def free_size(v: int) -> int:
    return _SIZE[v]


def bvar(height: int, rank: int) -> int:
    """The canonical id of the rank-th variable bound by a binder of this height."""
    return -(height * 4096 + rank + 1)


# ---- structural queries (memoised per id) ----------------------------------------------------

_DEPS: dict[int, frozenset[int]] = {}
_HEIGHT: dict[int, int] = {}
_OCC: dict[int, tuple[int, ...]] = {}
_ERASED: dict[int, int] = {}


def children(i: int) -> list[int]:
    t = _T[i]
    k = t[0]
    if k == "P" or k == "M":
        return [c for c, _ in t[1]]
    if k == "exp" or k == "pw":
        return [t[1]]
    if k == "fn":
        return list(t[2])
    if k == "sum":
        return [t[2]]
    if k == "red":
        return [t[3]]
    return []


def binders(i: int) -> tuple[tuple[int, int], ...]:
    t = _T[i]
    if t[0] == "sum":
        return t[1]
    if t[0] == "red":
        return t[2]
    return ()


def deps(i: int) -> frozenset[int]:
    """Index variables free in term i."""
    d = _DEPS.get(i)
    if d is None:
        t = _T[i]
        k = t[0]
        # (the kinds written out: this runs once per new term, and children() built a list)
        if k == "P" or k == "M":
            items = t[1]
            if len(items) == 1:
                d = deps(items[0][0])
            elif items:
                d = frozenset().union(*[deps(c) for c, _ in items])
            else:
                d = frozenset()
        elif k == "in":
            d = frozenset(v for dim in t[2] for v in dim)
        elif k == "exp" or k == "pw":
            d = deps(t[1])
        elif k == "sum":
            d = deps(t[2]) - {v for v, _ in t[1]}
        elif k == "red":
            d = deps(t[3]) - {v for v, _ in t[2]}
        elif k == "fn":
            cs = t[2]
            d = frozenset().union(*[deps(c) for c in cs]) if cs else frozenset()
        else:
            d = frozenset()
        _DEPS[i] = d
    return d


def height(i: int) -> int:
    """1 + the deepest binder nesting inside term i (0 without binders)."""
    h = _HEIGHT.get(i)
    if h is None:
        t = _T[i]
        k = t[0]
        if k == "in":
            h = 0
        elif k == "P" or k == "M":
            h = 0
            for c, _ in t[1]:
                hc = _HEIGHT.get(c)
                if hc is None:
                    hc = height(c)
                if hc > h:
                    h = hc
        elif k == "exp" or k == "pw":
            h = height(t[1])
        elif k == "sum":
            h = height(t[2]) + (1 if t[1] else 0)
        else:
            h = 0
            for c in children(i):
                hc = height(c)
                if hc > h:
                    h = hc
            if binders(i):
                h += 1
        _HEIGHT[i] = h
    return h


def erased(i: int) -> int:
    """The id of term i with every index variable replaced by 0: a name-free sort key, so that
    canonical variable numbering does not depend on the names being numbered."""
    e = _ERASED.get(i)
    if e is None:
        t = _T[i]
        k = t[0]
        if k == "in":
            e = mk(("~in", t[1], tuple(len(d) for d in t[2])))
        elif k in ("P", "M"):
            e = mk(("~" + k, tuple(sorted((erased(c), x) for c, x in t[1]))))
        elif k in ("exp", "pw"):
            e = mk(("~" + k, erased(t[1])))
        elif k == "fn":
            e = mk(("~fn", t[1], tuple(erased(c) for c in t[2])))
        elif k == "sum":
            e = mk(("~sum", len(t[1]), erased(t[2])))
        elif k == "red":
            e = mk(("~red", t[1], len(t[2]), erased(t[3])))
        else:
            e = i
        _ERASED[i] = e
    return e


def ordered(i: int) -> list[int]:
    """Children of i in canonical traversal order (name-free key first, id as tie-break)."""
    t = _T[i]
    if t[0] in ("P", "M"):
        keyed = []
        for c, _ in t[1]:
            e = _ERASED.get(c)
            keyed.append((erased(c) if e is None else e, c))
        keyed.sort()
        return [c for _, c in keyed]
    if t[0] == "fn" and t[1] in SYMMETRIC:
        return [c for _, c in sorted([(erased(c), c) for c in t[2]])]
    return children(i)


def occurrences(i: int) -> tuple[int, ...]:
    """Free variables of i in first-occurrence order of the canonical traversal."""
    o = _OCC.get(i)
    if o is None:
        t = _T[i]
        k = t[0]
        if k == "in":
            seen: dict[int, None] = {}
            for dim in t[2]:
                for v in dim:
                    seen[v] = None
            o = tuple(seen)
        elif (k == "P" or k == "M") and len(t[1]) == 1:
            # one child: its own order (its erased key is still made here, where `ordered`
            # made it: erased keys are interned terms, and intern order is part of the state)
            c = t[1][0][0]
            if c not in _ERASED:
                erased(c)
            o = _OCC.get(c)
            if o is None:
                o = occurrences(c)
        else:
            seen = {}
            for c in ordered(i):
                for v in occurrences(c):
                    seen[v] = None
            bs = binders(i)
            if bs:
                bound = {v for v, _ in bs}
                o = tuple(v for v in seen if v not in bound)
            else:
                o = tuple(seen)
        _OCC[i] = o
    return o


SYMMETRIC = frozenset({"max"})
"""Uninterpreted functions whose arguments commute (max(a, b) = max(b, a))."""


# ---- polys and monomials ---------------------------------------------------------------------


def _entries(d: dict[int, Exp]) -> tuple[tuple[int, Exp], ...]:
    """The nonzero (key, value) pairs of a poly's terms or a monomial's exponents, sorted.

    Integral values are stored as ints: equal and hash-equal to the Fraction, and hashing a
    Fraction (a modular inverse each time) was a tenth of the cost of building a term. (Keys
    are distinct, so sorting the pairs sorts by key alone; the common case, every value a
    nonzero int, is returned without a rebuild.)"""
    items = sorted(d.items())
    for _, v in items:
        if not v or type(v) is not int:
            break
    else:
        return tuple(items)
    out = []
    for k, v in items:
        if v:
            if type(v) is not int and v.denominator == 1:
                v = int(v)
            out.append((k, v))
    return tuple(out)


def poly(terms: dict[int, Fraction]) -> int:
    return mk(("P", _entries(terms)))


def mono(facs: dict[int, Exp]) -> int:
    return mk(("M", _entries(facs)))


UNIT = mono({})


def const(c: Fraction) -> int:
    return poly({UNIT: Fraction(c)})


def of_mono(m: int, c: Fraction = ONE) -> int:
    return poly({m: c})


def of_factor(f: int, e: Exp = 1) -> int:
    return poly({mono({f: e}): ONE})


def is_constant(p: int) -> bool:
    """p is a rational constant (zero included)."""
    ts = _T[p][1]
    return not ts or (len(ts) == 1 and ts[0][0] == UNIT)


def terms(p: int) -> tuple[tuple[int, Fraction], ...]:
    return _T[p][1]


def factors(m: int) -> tuple[tuple[int, Exp], ...]:
    return _T[m][1]


def add(a: int, b: int) -> int:
    acc = dict(terms(a))
    for m, c in terms(b):
        prev = acc.get(m)
        acc[m] = c if prev is None else prev + c
    return poly(acc)


def scale(a: int, c: Fraction) -> int:
    return poly({m: k * c for m, k in terms(a)})


def sub(a: int, b: int) -> int:
    return add(a, scale(b, Fraction(-1)))


_MUL: dict[tuple[int, int], int] = {}


def mul(a: int, b: int) -> int:
    """Expanded product of two polys (distributivity); positive powers of `pw` expand back."""
    key = (a, b) if a <= b else (b, a)
    r = _MUL.get(key)
    if r is None:
        acc: dict[int, Fraction] = {}
        for m1, c1 in terms(a):
            for m2, c2 in terms(b):
                f = dict(factors(m1))
                for g, e in factors(m2):
                    prev = f.get(g)
                    f[g] = e if prev is None else prev + e
                for m, c in _expand_pw(f).items():
                    x = c1 * c2 if c == 1 else c * c1 * c2
                    prev = acc.get(m)
                    acc[m] = x if prev is None else prev + x
        r = _MUL[key] = poly(acc)
    return r


def _expand_pw(f: dict[int, Exp]) -> dict[int, Exp]:
    """A factor map as poly terms: a `pw` factor left with a positive exponent is multiplied out."""
    pos = [(g, e) for g, e in f.items() if e and e > 0 and _T[g][0] == "pw"]
    if not pos:
        return {mono(f): 1}  # an int: Fraction arithmetic in mul's inner loop was its main cost
    rest = {g: e for g, e in f.items() if (g, e) not in pos}
    out = of_mono(mono(rest))
    for g, e in pos:
        for _ in range(int(e)):
            out = mul(out, _T[g][1])
    return dict(terms(out))


def inv(a: int) -> int:
    """1 / a: a single monomial inverts exactly; anything longer becomes a `pw` factor."""
    ts = terms(a)
    if not ts:
        raise ExprError(
            "division by an expression that is identically zero: the candidate is "
            "undefined everywhere, prune it"
        )
    if len(ts) == 1:
        m, c = ts[0]
        return poly({mono({f: -e for f, e in factors(m)}): ONE / c})
    return of_factor(mk(("pw", a)), -1)


def exp(a: int) -> int:
    """exp(sum c_i m_i) = prod exp(m_i)^c_i."""
    f: dict[int, Exp] = {}
    for m, c in terms(a):
        g = mk(("exp", m))
        prev = f.get(g)
        f[g] = c if prev is None else prev + c
    return of_mono(mono(f))


def fn(name: str, *args: int) -> int:
    """An uninterpreted function (an oracle in the field check) of polys."""
    if name in SYMMETRIC:
        args = tuple(sorted(args))
    return of_factor(mk(("fn", name, tuple(args))))


# ---- binders -----------------------------------------------------------------------------------


def sum_over(bound: list[tuple[int, int]], p: int) -> int:
    """sum over the free variables `bound` (var, size) of poly p, in normal form."""
    acc: dict[int, Fraction] = {}
    for m, c in terms(p):
        k, m2 = _sum_mono(bound, m)
        x = c * k
        prev = acc.get(m2)
        acc[m2] = x if prev is None else prev + x
    return poly(acc)


def _sum_mono(bound: list[tuple[int, int]], m: int) -> tuple[int, int]:
    names = {v for v, _ in bound}
    used = deps(m) & names
    k = 1
    for v, n in bound:
        if v not in used:
            k *= n  # sum_i c = N c
    if not used:
        return k, m
    inner: dict[int, Exp] = {}
    outer: dict[int, Exp] = {}
    live = [(v, n) for v, n in bound if v in used]
    todo = list(factors(m))
    while todo:
        f, e = todo.pop()
        if deps(f).isdisjoint(names):
            prev = outer.get(f)
            outer[f] = e if prev is None else prev + e
        elif _T[f][0] == "sum" and e == 1:
            # flatten: sum_V (a * sum_W b) = sum_{V+W} a b  (a does not use W)
            # (the inner binder's canonical ids become fresh variables: two flattened sums of
            # one height would otherwise share names)
            ren = {v: (fresh(n),) for v, n in _T[f][1]}
            live.extend((ren[v][0], n) for v, n in _T[f][1])
            names |= {r[0] for r in ren.values()}
            todo.extend(factors(subst(_T[f][2], ren)))
        else:
            prev = inner.get(f)
            inner[f] = e if prev is None else prev + e
    body = mono(inner)
    live, body = _merge_bound(live, body)
    s = binder("sum", tuple(live), body)
    prev = outer.get(s)
    outer[s] = 1 if prev is None else prev + 1
    return k, mono(outer)


def binder(kind: str, bound: tuple[tuple[int, int], ...], body: int, name: str = "") -> int:
    """A `sum` (body: mono) or `red` (body: poly) with canonically renamed bound variables."""
    h = _HEIGHT.get(body)
    if h is None:
        h = height(body)
    h += 1
    occ = _OCC.get(body)
    if occ is None:
        occ = occurrences(body)
    if len(bound) == 1:
        order = [bound[0][0]] if bound[0][0] in occ else []
    else:
        names = {b for b, _ in bound}
        order = [v for v in occ if v in names]
    size = dict(bound)
    # a variable already named canonically is left out of the renaming (a sum rebuilt by a
    # substitution of its free variables keeps its bound names): renaming a term to itself
    # rebuilt all of it only to intern tuples that exist, the same ids in the same order
    ren = {}
    bs = []
    for r, v in enumerate(order):
        c = bvar(h, r)
        if c != v:
            ren[v] = (c,)
        bs.append((c, size[v]))
    new = subst(body, ren) if ren else body
    return mk(("sum", tuple(bs), new)) if kind == "sum" else mk(("red", name, tuple(bs), new))


def reduce_fn(name: str, bound: list[tuple[int, int]], p: int) -> int:
    """An uninterpreted reduction (reduce_max) over bound variables; unused ones are dropped."""
    live = tuple((v, n) for v, n in bound if v in deps(p))
    if not live:
        return fn(name, p) if name not in SYMMETRIC else p
    return of_factor(binder("red", live, p, name))


# ---- adjacency of digit variables (the split axiom) ------------------------------------------

_ADJ: dict[int, dict[int, frozenset[tuple[int | None, int | None]]]] = {}


def adjacency(i: int) -> dict[int, frozenset[tuple[int | None, int | None]]]:
    """For each free variable of i: the set of (previous, next) digit neighbours over all
    occurrences (None at a dim boundary)."""
    a = _ADJ.get(i)
    if a is None:
        t = _T[i]
        acc: dict[int, set[tuple[int | None, int | None]]] = {}
        if t[0] == "in":
            for dim in t[2]:
                for j, v in enumerate(dim):
                    acc.setdefault(v, set()).add(
                        (dim[j - 1] if j else None, dim[j + 1] if j + 1 < len(dim) else None)
                    )
            a = {v: frozenset(s) for v, s in acc.items()}
        else:
            # children's sets are shared where one child alone has the variable (most of them)
            if t[0] == "P" or t[0] == "M":
                bound: set[int] = set()
                cs = [c for c, _ in t[1]]
            else:
                bound = {v for v, _ in binders(i)}
                cs = children(i)
            if len(cs) == 1 and not bound:
                a = _ADJ[i] = adjacency(cs[0])
                return a
            a = {}
            for c in cs:
                for v, s in adjacency(c).items():
                    if v in bound:
                        continue
                    cur = a.get(v)
                    if cur is None:
                        a[v] = s
                    elif cur is not s and not s <= cur:
                        a[v] = cur | s
        _ADJ[i] = a
    return a


_NEAR: dict[frozenset, tuple[frozenset, frozenset]] = {}


def neighbours(s: frozenset) -> tuple[frozenset, frozenset]:
    """A variable's (previous digits, next digits) over its occurrences, from its adjacency set;
    memoised on the set's value (children share adjacency sets, so most are seen before)."""
    got = _NEAR.get(s)
    if got is None:
        got = _NEAR[s] = (frozenset(p for p, _ in s), frozenset(n for _, n in s))
    return got


def mergeable_pairs(i: int, among: set[int] | frozenset[int]) -> list[tuple[int, int]]:
    """Pairs (a, b) of variables in `among` where b always follows a and a always precedes b."""
    adj = adjacency(i)
    out = []
    for a in among:
        s = adj.get(a)
        if s is None:
            continue
        nxt = neighbours(s)[1]
        if len(nxt) != 1:
            continue
        (b,) = nxt
        if b is None or b == a or b not in among:
            continue
        if neighbours(adj[b])[0] == {a}:
            out.append((a, b))
    return out


def _merge_bound(live: list[tuple[int, int]], body: int) -> tuple[list[tuple[int, int]], int]:
    size = dict(live)
    if len(size) < 2:
        return list(size.items()), body  # a merge needs two bound variables (most bind one)
    while True:
        pairs = mergeable_pairs(body, set(size))
        if not pairs:
            return list(size.items()), body
        a, b = pairs[0]
        v = fresh(size[a] * size[b])
        body = merge(body, a, b, v)
        size[v] = size.pop(a) * size.pop(b)


# ---- substitution ------------------------------------------------------------------------------

_SUBST: dict[tuple[Any, ...], int] = {}
"""(term, renaming) -> the substituted term. A renaming of one variable is keyed (term, var,
digits), of several (term, frozenset of items): most renamings name one variable, and building
a frozenset per lookup was a tenth of a substitution's cost."""


def subst(i: int, ren: dict[int, tuple[int, ...]]) -> int:
    """Replace each free variable v of term i by the digit sequence ren[v] (a split, or a
    rename when the sequence has one digit), rebuilding the normal form."""
    d = _DEPS.get(i)
    if d is None:
        d = deps(i)
    if d.isdisjoint(ren):
        return i
    t = _T[i]
    if t[0] == "in":
        return _subst_input(t, ren)
    if len(ren) == 1:
        ((v, r),) = ren.items()
        key: tuple[Any, ...] = (i, v, r)
    else:
        if not d.issuperset(ren):
            ren = {v: r for v, r in ren.items() if v in d}
        if len(ren) == 1:
            ((v, r),) = ren.items()
            key = (i, v, r)
        else:
            key = (i, frozenset(ren.items()))
    r = _SUBST.get(key)
    if r is None:
        r = _SUBST[key] = _subst_node(i, ren)
    return r


def _subst_input(t: tuple[Any, ...], ren: dict[int, tuple[int, ...]]) -> int:
    """An input element with its digits substituted, interned without `_SUBST`'s memo: building
    the memo key cost more than the leaf, and a repeated substitution interns the same tuple
    again, which `mk` answers with the id it had (no new term: the same intern order)."""
    dims = []
    for dim in t[2]:
        for v in dim:
            if v in ren:
                dims.append(_split_digits(dim, ren))
                break
        else:
            dims.append(dim)
    return mk(("in", t[1], tuple(dims)))


def _subst_node(i: int, ren: dict[int, tuple[int, ...]]) -> int:
    """`_rebuild` for a substitution, with the hot kinds (polys, monomials, exp, sums) inlined:
    the same constructors in the same order (intern order is part of the state), fewer calls."""
    t = _T[i]
    k = t[0]
    if k == "P" or k == "M":
        # a child none of whose variables is renamed stays as it is: tested here, without a
        # call (most children of a poly or monomial are untouched)
        out: dict[int, Any] = {}
        get = _DEPS.get
        for c, x in t[1]:
            d = get(c)
            if d is None:
                d = deps(c)
            if not d.isdisjoint(ren):
                c = subst(c, ren)
                prev = out.get(c)
                out[c] = x if prev is None else prev + x
            elif c in out:
                out[c] += x
            else:
                out[c] = x
        return mk((k, _entries(out)))
    if k == "exp" or k == "pw":
        return mk((k, subst(t[1], ren)))
    if k == "sum":
        for v, _ in t[1]:
            if v in ren:
                raise AssertionError("substitution would capture a bound variable")
        return binder("sum", t[1], subst(t[2], ren))
    return _rebuild(i, lambda c: subst(c, ren), None, set(ren))


def _split_digits(dim: tuple[int, ...], ren: dict[int, tuple[int, ...]]) -> tuple[int, ...]:
    out: list[int] = []
    for v in dim:
        r = ren.get(v)
        if r is None:
            out.append(v)
        else:
            out.extend(r)
    return tuple(out)


_MERGE: dict[tuple[int, int, int, int], int] = {}


def merge(i: int, a: int, b: int, v: int) -> int:
    """Replace every adjacent digit pair (a, b) in term i by the single digit v."""
    if a not in deps(i):
        return i
    key = (i, a, b, v)
    r = _MERGE.get(key)
    if r is None:

        def dims_fn(dims: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
            out = []
            for dim in dims:
                d: list[int] = []
                for x in dim:
                    if x == b and d and d[-1] == a:
                        d[-1] = v
                    else:
                        d.append(x)
                out.append(tuple(d))
            return tuple(out)

        r = _MERGE[key] = _rebuild(i, lambda c: merge(c, a, b, v), dims_fn, {a, b})
    return r


def _rebuild(i: int, rec: Any, dims_fn: Any, touched: set[int]) -> int:
    """Rebuild term i with `rec` applied to children (smart constructors restore the normal
    form: factors that became equal merge, binders are renamed canonically again)."""
    t = _T[i]
    k = t[0]
    if k == "in":
        return mk(("in", t[1], dims_fn(t[2])))
    if k == "P":
        acc: dict[int, Fraction] = {}
        for m, c in t[1]:
            m2 = rec(m)
            prev = acc.get(m2)
            acc[m2] = c if prev is None else prev + c
        return poly(acc)
    if k == "M":
        f: dict[int, Exp] = {}
        for g, e in t[1]:
            g2 = rec(g)
            prev = f.get(g2)
            f[g2] = e if prev is None else prev + e
        return mono(f)
    if k == "exp":
        return mk(("exp", rec(t[1])))
    if k == "pw":
        return mk(("pw", rec(t[1])))
    if k == "fn":
        args = tuple(rec(a) for a in t[2])
        return mk(("fn", t[1], tuple(sorted(args)) if t[1] in SYMMETRIC else args))
    if k == "sum":
        if touched & {v for v, _ in t[1]}:
            raise AssertionError("substitution would capture a bound variable")
        return binder("sum", t[1], rec(t[2]))
    if k == "red":
        return binder("red", t[2], rec(t[3]), t[1])
    raise AssertionError(f"unknown term kind {k}")
