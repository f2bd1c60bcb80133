"""The search-result cache: exact round trips, keys that change with every input, and entries that
are refused when partial, corrupt, truncated or filed under another key."""

from __future__ import annotations

import dataclasses
from functools import cache

import pytest

from mlso_cli.ir import check
from mlso_cli.ir.hashing import graph_hash
from mlso_cli.ir.serialize import dumps
from mlso_cli.search.api import Candidate, SearchOptions, SearchResult
from mlso_cli.search.cache import (
    SearchCache,
    code_digest,
    make_key,
    result_from_dict,
    result_to_dict,
)
from tests.fixtures import examples as ex


@cache
def _pair():
    return ex.rmsnorm_linear_pair(rows=4, h=32, n=16, cols=2, loop=2)


def _result(partial: bool = False, bound: float = 3.5e-19) -> SearchResult:
    ref, fused = _pair()
    return SearchResult(
        (Candidate(fused, 1.25, 1, bound), Candidate(ref, 4.5, 2, 0.0)),
        states=321,
        pruned=12,
        verified=7,
        seconds=0.75,
        bound=bound,
        partial=partial,
        notes=("a note",),
    )


def _fake_search(target, options, progress=None):  # only its name matters for a key
    raise AssertionError("not called")


def _key(**changes):
    ref, _ = _pair()
    opts = SearchOptions(max_states=100, seed=0)
    args = {
        "region_hash": graph_hash(ref),
        "cache_fields": opts.cache_fields(),
        "targets": ("sm_80", "sm_90a"),
        "search_fn": _fake_search,
    }
    args.update(changes)
    return make_key(**args)


def test_result_round_trips_exactly():
    r = _result()
    back = result_from_dict(result_to_dict(r))
    assert back == r
    assert [dumps(c.graph) for c in back.candidates] == [dumps(c.graph) for c in r.candidates]
    for c in back.candidates:
        check(c.graph)


def test_get_returns_what_put_stored(tmp_path):
    store = SearchCache(tmp_path)
    k = _key()
    assert store.get(k) is None
    assert store.put(k, _result())
    assert store.get(k) == _result()
    assert not list(tmp_path.rglob("*.tmp")), (
        "the temporary file of an atomic write was left behind"
    )


def test_every_key_part_changes_the_digest():
    base = _key()
    ref, fused = _pair()
    variants = [
        _key(region_hash=graph_hash(fused)),
        _key(cache_fields=SearchOptions(max_states=101, seed=0).cache_fields()),
        _key(cache_fields=SearchOptions(max_states=100, seed=1).cache_fields()),
        _key(cache_fields=SearchOptions(max_states=100, seed=0, arch="sm_80").cache_fields()),
        _key(targets=("sm_90a",)),
        _key(search_fn=_result),
        dataclasses.replace(base, code="0" * 64),
        dataclasses.replace(base, version="999.0"),
    ]
    digests = {v.digest for v in variants}
    assert base.digest not in digests and len(digests) == len(variants)
    assert base.code == code_digest() and len(base.code) == 64


def test_jobs_and_budget_do_not_change_the_key():
    a = _key(cache_fields=SearchOptions(max_states=100, seed=0, jobs=1).cache_fields())
    b = _key(
        cache_fields=SearchOptions(max_states=100, seed=0, jobs=8, budget_s=5.0).cache_fields()
    )
    assert a.digest == b.digest


def test_partial_results_are_never_stored(tmp_path):
    store = SearchCache(tmp_path)
    assert store.put(_key(), _result(partial=True)) is False
    assert store.get(_key()) is None and not list(tmp_path.rglob("*.json"))


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_damaged_entries_are_misses(tmp_path, damage):
    store = SearchCache(tmp_path)
    k = _key()
    store.put(k, _result())
    path = store.path(k)
    data = path.read_bytes()
    mangled = {
        "truncate": data[: len(data) // 2],
        "empty": b"",
        "flip": data[:-10] + bytes([data[-10] ^ 0x01]) + data[-9:],
        "garbage": b"not a cache entry\n{}",
    }[damage]
    path.write_bytes(mangled)
    assert store.get(k) is None
    store.put(k, _result())  # a new final result replaces the damaged entry
    assert store.get(k) == _result()


def test_an_entry_filed_under_another_key_is_a_miss(tmp_path):
    store = SearchCache(tmp_path)
    k1, k2 = _key(), _key(targets=("sm_80",))
    store.put(k1, _result())
    store.path(k2).parent.mkdir(parents=True, exist_ok=True)
    store.path(k2).write_bytes(store.path(k1).read_bytes())  # self-consistent, but for k1
    assert store.get(k2) is None and store.get(k1) == _result()
