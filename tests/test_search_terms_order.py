"""The hot-path rewrites of search/terms.py intern what the plain versions did, in the same order.

Why: term ids are intern order, and intern order is part of the search's state (search/state.py:
a pattern key breaks ties between alpha-equivalent children by it, so in rare ties the pruning
itself follows it). A faster `subst`, `binder`, `deps`, `height`, `occurrences`, `_entries` or
`_merge_bound` must therefore not only answer the same term: it must leave the same term table,
the same fresh-variable counter and the same pattern forms behind. The plain versions (as they
were before the rewrite) are kept below as the reference; the same workload (every small
fixture's lifted target normalised, and every tensor of the fixture abstracted and checked) runs
once with them and once with the module's own, from the same saved state.
"""

from __future__ import annotations

import itertools
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from mlso_cli.frontend.lift import lift_model
from mlso_cli.search import state
from mlso_cli.search import target as TG
from mlso_cli.search import terms as T
from mlso_cli.search.abstract import abstract_graph
from tests.fixtures.ugraphs import SMALL_FIXTURES

SMALL = Path(__file__).resolve().parent.parent / "models" / "small"


# ---- the plain versions (the reference) ---------------------------------------------------------


def ref_deps(i: int) -> frozenset[int]:
    d = T._DEPS.get(i)
    if d is None:
        t = T._T[i]
        if t[0] == "in":
            d = frozenset(v for dim in t[2] for v in dim)
        else:
            cs = T.children(i)
            if len(cs) == 1:
                d = T.deps(cs[0])
            elif cs:
                d = frozenset().union(*[T.deps(c) for c in cs])
            else:
                d = frozenset()
            bs = T.binders(i)
            if bs:
                d = d - {v for v, _ in bs}
        T._DEPS[i] = d
    return d


def ref_height(i: int) -> int:
    h = T._HEIGHT.get(i)
    if h is None:
        h = 0
        for c in T.children(i):
            hc = T.height(c)
            if hc > h:
                h = hc
        if T.binders(i):
            h += 1
        T._HEIGHT[i] = h
    return h


def ref_occurrences(i: int) -> tuple[int, ...]:
    o = T._OCC.get(i)
    if o is None:
        t = T._T[i]
        seen: dict[int, None] = {}
        if t[0] == "in":
            for dim in t[2]:
                for v in dim:
                    seen[v] = None
            o = tuple(seen)
        else:
            for c in T.ordered(i):
                for v in T.occurrences(c):
                    seen[v] = None
            bound = {v for v, _ in T.binders(i)}
            o = tuple(v for v in seen if v not in bound)
        T._OCC[i] = o
    return o


def ref_entries(d: dict[int, Any]) -> tuple[tuple[int, Any], ...]:
    out = []
    for k, v in d.items():
        if v:
            if type(v) is not int and v.denominator == 1:
                v = int(v)
            out.append((k, v))
    out.sort()
    return tuple(out)


def ref_binder(kind: str, bound: tuple[tuple[int, int], ...], body: int, name: str = "") -> int:
    h = T.height(body) + 1
    names = {b for b, _ in bound}
    order = [v for v in T.occurrences(body) if v in names]
    size = dict(bound)
    ren = {v: (T.bvar(h, r),) for r, v in enumerate(order)}
    new = T.subst(body, ren)
    bs = tuple((T.bvar(h, r), size[v]) for r, v in enumerate(order))
    return T.mk(("sum", bs, new)) if kind == "sum" else T.mk(("red", name, bs, new))


def ref_merge_bound(live: list[tuple[int, int]], body: int) -> tuple[list[tuple[int, int]], int]:
    size = dict(live)
    while True:
        pairs = T.mergeable_pairs(body, set(size))
        if not pairs:
            return list(size.items()), body
        a, b = pairs[0]
        v = T.fresh(size[a] * size[b])
        body = T.merge(body, a, b, v)
        size[v] = size.pop(a) * size.pop(b)


def ref_subst(i: int, ren: dict[int, tuple[int, ...]]) -> int:
    d = T.deps(i)
    if d.isdisjoint(ren):
        return i
    if not d.issuperset(ren):
        ren = {v: r for v, r in ren.items() if v in d}
    key = ("ref", i, frozenset(ren.items()))
    r = T._SUBST.get(key)
    if r is None:
        r = T._SUBST[key] = ref_subst_node(i, ren)
    return r


def ref_subst_node(i: int, ren: dict[int, tuple[int, ...]]) -> int:
    t = T._T[i]
    if t[0] == "in":
        return T.mk(
            (
                "in",
                t[1],
                tuple(
                    dim if ren.keys().isdisjoint(dim) else T._split_digits(dim, ren) for dim in t[2]
                ),
            )
        )
    return T._rebuild(i, lambda c: T.subst(c, ren), None, set(ren))


REFERENCE = {
    "deps": ref_deps,
    "height": ref_height,
    "occurrences": ref_occurrences,
    "_entries": ref_entries,
    "binder": ref_binder,
    "_merge_bound": ref_merge_bound,
    "subst": ref_subst,
}


# ---- the workload ---------------------------------------------------------------------------------


def _workload(name: str) -> list[bool]:
    (kg,) = lift_model(str(SMALL / f"{name}.onnx"))
    target = TG.Target.from_graph(kg)
    seen: list[Any] = []
    abstract_graph(SMALL_FIXTURES[name](), observe=lambda n, e: seen.append(e))
    verdicts = [target.admits(e) for e in seen if not isinstance(e, tuple)]
    # substitutions the workload may not have made: splits and renames of every free variable
    # of every tensor (the shapes the abstract ops hand to subst)
    for e in seen:
        if isinstance(e, tuple):
            continue
        for v in sorted(T.deps(e.poly)):
            n = T.free_size(v)
            T.subst(e.poly, {v: (T.fresh(n),)})
            if n % 2 == 0:
                T.subst(e.poly, {v: (T.fresh(2), T.fresh(n // 2))})
    return verdicts


def _snapshot() -> tuple:
    fresh = next(T._FRESH)
    T._FRESH = itertools.count(fresh)
    return list(T._T), fresh, dict(T._SIZE), list(TG._FORM.items())


@pytest.mark.parametrize("name", sorted(SMALL_FIXTURES))
def test_fast_terms_intern_what_the_plain_versions_did(name, monkeypatch):
    start = state.save()
    try:
        with monkeypatch.context() as m:
            for attr, f in REFERENCE.items():
                m.setattr(T, attr, f)
            want_verdicts = _workload(name)
            want = _snapshot()
        state.restore(start)
        got_verdicts = _workload(name)
        got = _snapshot()
    finally:
        state.restore(start)
    assert got_verdicts == want_verdicts
    assert got[1] == want[1]  # fresh counter
    assert got[2] == want[2]  # variable sizes
    assert got[0] == want[0]  # the term table, id for id
    assert got[3] == want[3]  # pattern forms
    assert len(want[0]) > len(T._T)  # the workload built terms


def test_entries_keeps_fractions_and_drops_zeros():
    d = {5: 1, 3: Fraction(2, 1), 9: 0, 1: Fraction(1, 3)}
    assert T._entries(d) == ref_entries(d) == ((1, Fraction(1, 3)), (3, 2), (5, 1))
    assert type(T._entries(d)[1][1]) is int
    assert T._entries({4: 2, 2: 1}) == ((2, 1), (4, 2))
