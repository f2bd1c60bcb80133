"""The verdict cache of the check before writing (pipeline/verdicts.py): a rerun of the same
bytes under the same code reuses the check's outcome, and nothing else does."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlso_cli.pipeline import PipelineOptions, optimize
from mlso_cli.pipeline import verifying as verifying_mod
from mlso_cli.pipeline.verdicts import RegionVerdict, Verdict, VerdictCache
from mlso_cli.search.api import SearchOptions
from tests.test_pipeline import SRC, FakeSearch


@pytest.fixture
def counted(monkeypatch):
    """Counts the calls of the verification library's entry point from the check."""
    calls = []
    real = verifying_mod.verify_models

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(verifying_mod, "verify_models", counting)
    return calls


def _opts(tmp_path, **kw) -> PipelineOptions:
    return PipelineOptions(
        search=SearchOptions(max_states=10, seed=0),
        min_speedup=0.0,
        cache_dir=tmp_path / "search-cache",
        **kw,
    )


def _entries(tmp_path):
    return sorted((tmp_path / "verdicts").rglob("*.json"))


def _decided(out):
    return [(r.choice.packaged, r.choice.why, r.choice.bound, r.choice.checks) for r in out.regions]


def test_a_rerun_reuses_the_verdict_and_writes_the_same_bytes(tmp_path, counted):
    first = optimize(str(SRC), None, _opts(tmp_path), search=FakeSearch())
    assert len(counted) == 1 and len(_entries(tmp_path)) == 1
    assert any(r.choice.packaged for r in first.regions)
    second = optimize(str(SRC), None, _opts(tmp_path), search=FakeSearch())
    assert len(counted) == 1  # not checked again
    assert second.model.SerializeToString() == first.model.SerializeToString()
    assert _decided(second) == _decided(first) and second.bound == first.bound > 0
    assert second.verify_seed == first.verify_seed
    assert second.verdict_cached and not first.verdict_cached


def test_no_cache_checks_every_time_and_stores_nothing(tmp_path, counted):
    for _ in range(2):
        optimize(str(SRC), None, _opts(tmp_path, use_cache=False), search=FakeSearch())
    assert len(counted) == 2 and not _entries(tmp_path)


def test_a_corrupt_or_mismatched_verdict_is_a_miss(tmp_path, counted):
    optimize(str(SRC), None, _opts(tmp_path), search=FakeSearch())
    (entry,) = _entries(tmp_path)
    entry.write_bytes(entry.read_bytes()[:-30])  # truncated: its sha256 line no longer matches
    optimize(str(SRC), None, _opts(tmp_path), search=FakeSearch())
    assert len(counted) == 2
    # a well-formed entry whose model digest is not the model packaged now is not trusted
    cache = VerdictCache(tmp_path / "verdicts")
    key = entry.stem
    stored = cache.get(key)
    assert stored is not None
    cache.put(key, replace(stored, model_sha256="0" * 64))
    optimize(str(SRC), None, _opts(tmp_path), search=FakeSearch())
    assert len(counted) == 3


def test_a_fixed_seed_is_part_of_the_key_and_a_fresh_one_is_not(tmp_path, counted):
    optimize(str(SRC), None, _opts(tmp_path, verify_seed=11), search=FakeSearch())
    optimize(str(SRC), None, _opts(tmp_path, verify_seed=12), search=FakeSearch())
    assert len(counted) == 2  # two fixed seeds: two checks
    a = optimize(
        str(SRC), None, _opts(tmp_path, verify_seed=21, verify_seed_fresh=True), search=FakeSearch()
    )
    b = optimize(
        str(SRC), None, _opts(tmp_path, verify_seed=22, verify_seed_fresh=True), search=FakeSearch()
    )
    assert len(counted) == 3  # the second fresh seed reuses the first's check
    assert a.verify_seed == b.verify_seed == 21  # the seed reported is the one that ran


def test_a_verdict_applies_only_to_the_choices_it_was_for(tmp_path):
    out = optimize(str(SRC), None, _opts(tmp_path, use_cache=False), search=FakeSearch())
    choices = [r.choice for r in out.regions]
    assert choices[0].packaged
    kept = Verdict((RegionVerdict(False, "kept original: refused", None, ""),), 0.0, "x", 1)
    (applied,) = kept.applied(choices)
    assert not applied.packaged and applied.why == "kept original: refused"
    packed = Verdict((RegionVerdict(True, "ok", 1e-20, "field"),), 1e-20, "x", 1)
    assert packed.applied([replace(choices[0], packaged=False)]) is None  # not packaged now
    assert packed.applied(choices * 2) is None  # another region count
    assert Verdict.from_dict(packed.to_dict()) == packed
