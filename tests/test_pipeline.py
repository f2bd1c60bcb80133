"""The optimize pipeline as a library, with injected fake searches (and a fake GPU timer).

Why fakes: the enumerator is not here yet, and the pipeline's own promises (what is packaged, what
is cached, what is reported) must hold whatever the search returns. The fused candidates are the
hand-written fixtures of tests/fixtures, used as test data only.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from mlso_cli.errors import MlsoError
from mlso_cli.ir import check, dumps
from mlso_cli.package import META_BOUND, write_model_atomic
from mlso_cli.pipeline import PipelineOptions, no_search, optimize
from mlso_cli.pipeline.select import rank
from mlso_cli.search.api import Candidate, SearchOptions, SearchProgress, SearchResult
from mlso_cli.search.cost import program_cost
from tests.fixtures.ugraphs import fixture
from tests.helpers import SMALL

NAME = "rmsnorm_linear"
SRC = next(p for p in SMALL if p.stem == NAME)


@cache
def _fused():
    return check(fixture(NAME, small=True))


class FakeSearch:
    """Returns the hand-written fused program and the target; counts its calls."""

    def __init__(
        self, partial: bool = False, bound: float = 2.0**-62, fused_first: bool = True
    ) -> None:
        self.calls = 0
        self.partial, self.bound, self.fused_first = partial, bound, fused_first
        self.__qualname__ = "FakeSearch"

    def __call__(self, target, options: SearchOptions, progress=None) -> SearchResult:
        self.calls += 1
        if progress:
            progress(SearchProgress("r", 10, 2, 1, 1.0, 0.01))
        fused = Candidate(
            _fused(), program_cost(_fused()).us, program_cost(_fused()).launches, self.bound
        )
        lifted = Candidate(target, program_cost(target).us, program_cost(target).launches, 0.0)
        cands = (fused, lifted) if self.fused_first else (lifted, fused)
        return SearchResult(
            cands,
            states=10,
            pruned=2,
            verified=1,
            seconds=0.01,
            bound=self.bound,
            partial=self.partial,
            notes=(),
        )


def _opts(tmp_path: Path, **kw) -> PipelineOptions:
    return PipelineOptions(
        search=SearchOptions(max_states=10, seed=0),
        min_speedup=0.0,
        cache_dir=tmp_path / "search-cache",
        **kw,
    )


def _ugraphs(model: onnx.ModelProto) -> list[str]:
    return [
        a.s.decode()
        for n in model.graph.node
        if n.domain == "ai.mlso"
        for a in n.attribute
        if a.name == "ugraph"
    ]


def test_the_chosen_candidate_is_the_one_packaged(tmp_path):
    # The fused program is cheaper by the cost model whichever order the search lists it in.
    for fused_first in (True, False):
        fake = FakeSearch(fused_first=fused_first)
        out = optimize(str(SRC), None, _opts(tmp_path, use_cache=False), search=fake)
        (rep,) = out.regions
        best = rank(rep.searched.result.candidates)[0].candidate
        assert rep.choice.candidate == best and rep.choice.packaged
        assert _ugraphs(out.model) == [dumps(best.graph)]
        assert dumps(best.graph) == dumps(_fused())  # the fixture is the cheaper program here
        assert rep.choice.kernels == program_cost(_fused()).launches


def test_never_slower_rule_keeps_the_original(tmp_path):
    out = optimize(
        str(SRC), None, PipelineOptions(min_speedup=1e6, use_cache=False), search=FakeSearch()
    )
    (rep,) = out.regions
    assert not rep.choice.packaged and "kept original" in rep.choice.why
    assert _ugraphs(out.model) == []


def test_dry_run_compiles_and_packages_nothing(tmp_path, monkeypatch):
    import mlso_cli.pipeline.build as build

    def boom(*a, **k):
        raise AssertionError("a dry run must not compile")

    monkeypatch.setattr(build.Builder, "build", boom)
    out = optimize(str(SRC), None, _opts(tmp_path), search=FakeSearch(), dry_run=True)
    assert out.model is None and out.regions[0].choice.packaged


def test_cli_dry_run_writes_nothing(tmp_path):
    from tests.helpers import run_cli

    cache_dir = tmp_path / "cache"
    out = tmp_path / "o.onnx"
    for extra in ([], ["-o", str(out)]):
        r = run_cli(
            "optimize",
            str(SRC),
            "--dry-run",
            "--json",
            "--max-states",
            "20000",  # what is written is the point here, not the search (a full one takes 80 s)
            *extra,
            env={"MLSO_CACHE_DIR": str(cache_dir)},
        )
        assert r.returncode == 0, r.stderr
        rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
        assert rows[-1]["output"] is None and rows[-1]["regions"] == 1
    assert not out.exists() and set(tmp_path.iterdir()) <= {cache_dir}
    assert not (cache_dir / "kernels").exists(), "a dry run compiled kernels"


def test_second_run_is_a_cache_hit(tmp_path):
    fake = FakeSearch()
    first = optimize(str(SRC), None, _opts(tmp_path), search=fake)
    second = optimize(str(SRC), None, _opts(tmp_path), search=fake)
    assert fake.calls == 1
    assert not first.regions[0].searched.cached and second.regions[0].searched.cached
    assert second.regions[0].searched.result == first.regions[0].searched.result
    assert first.model.SerializeToString() == second.model.SerializeToString()


def test_options_that_change_the_result_miss_the_cache(tmp_path):
    fake = FakeSearch()
    optimize(str(SRC), None, _opts(tmp_path), search=fake, dry_run=True)
    other = PipelineOptions(
        search=SearchOptions(max_states=11, seed=0),
        min_speedup=0.0,
        cache_dir=tmp_path / "search-cache",
    )
    optimize(str(SRC), None, other, search=fake, dry_run=True)
    assert fake.calls == 2


def test_a_partial_result_is_not_served(tmp_path):
    fake = FakeSearch(partial=True)
    optimize(str(SRC), None, _opts(tmp_path), search=fake, dry_run=True)
    again = optimize(str(SRC), None, _opts(tmp_path), search=fake, dry_run=True)
    assert fake.calls == 2 and not again.regions[0].searched.cached
    assert again.regions[0].searched.result.partial
    assert not list((tmp_path / "search-cache").rglob("*.json"))


def test_a_corrupt_cache_entry_is_a_miss(tmp_path):
    fake = FakeSearch()
    optimize(str(SRC), None, _opts(tmp_path), search=fake, dry_run=True)
    (entry,) = (tmp_path / "search-cache").rglob("*.json")
    entry.write_bytes(entry.read_bytes()[:-40])  # truncated
    again = optimize(str(SRC), None, _opts(tmp_path), search=fake, dry_run=True)
    assert fake.calls == 2 and not again.regions[0].searched.cached
    third = optimize(str(SRC), None, _opts(tmp_path), search=fake, dry_run=True)
    assert fake.calls == 2 and third.regions[0].searched.cached


def test_output_models_are_byte_identical(tmp_path):
    paths = []
    for i in range(2):
        out = optimize(str(SRC), None, _opts(tmp_path, use_cache=False), search=FakeSearch())
        paths.append(tmp_path / f"o{i}.onnx")
        write_model_atomic(out.model, str(paths[-1]), input_path=str(SRC))
    assert paths[0].read_bytes() == paths[1].read_bytes()


def test_the_bound_written_is_the_one_the_check_before_writing_obtained(tmp_path):
    """Not the search's claim (3e-19 here, from a fake search): the union of the field bounds
    that the check before writing obtained for the packaged kernels (once per distinct one)."""
    fake = FakeSearch(bound=3.0e-19)
    out = optimize(str(SRC), None, _opts(tmp_path), search=fake)
    meta = {p.key: p.value for p in out.model.metadata_props}
    packaged = [r.choice for r in out.regions if r.choice.packaged]
    assert packaged and all(c.bound is not None and 0 < c.bound <= 2.0**-60 for c in packaged)
    assert float(meta[META_BOUND]) == out.bound == sum(c.bound for c in packaged)
    assert out.bound != 3.0e-19 and out.verify_seed is not None


def test_a_candidate_with_another_signature_is_refused(tmp_path):
    def wrong(target, options, progress=None):
        other = check(fixture("lora", small=True))
        return SearchResult((Candidate(other, 1.0, 1, 0.0),), 1, 0, 1, 0.0, 0.0, False)

    with pytest.raises(MlsoError, match="signature|inputs/outputs"):
        optimize(str(SRC), None, _opts(tmp_path), search=wrong, dry_run=True)


def test_without_an_enumerator_the_report_says_no_search_ran(tmp_path):
    out = optimize(str(SRC), None, _opts(tmp_path), search=no_search, dry_run=True)
    (rep,) = out.regions
    assert not rep.searched.searched and rep.searched.result.states == 0
    assert any("no search" in n for n in rep.searched.result.notes)
    assert rep.choice.candidate.graph == out.regions[0].searched.result.candidates[0].graph


def test_gpu_path_keeps_the_fastest_measured_candidate(tmp_path, monkeypatch):
    """With --gpu the top K are timed; here a fake timer says the lifted program (rank 1 by
    estimate) is faster, so it, not the best estimate, is packaged."""
    import mlso_cli.pipeline.gpu as gpu
    from mlso_cli.bench.harness import RegionTiming

    monkeypatch.setattr(gpu, "require_gpu", lambda index: None)
    seen = []

    def fake_measure(model, index):
        (node,) = [n for n in model.graph.node if n.domain == "ai.mlso"]
        seen.append(_ugraphs(model)[0])
        fused = _ugraphs(model)[0] == dumps(_fused())
        return [RegionTiming(node.name, node.overload, 50.0, 40.0 if fused else 20.0)]

    out = optimize(
        str(SRC), None, _opts(tmp_path, gpu=0, top_k=2), search=FakeSearch(), measure=fake_measure
    )
    (rep,) = out.regions
    assert len(seen) == 2 and seen[0] == dumps(_fused())
    assert rep.choice.measured and rep.choice.after_us == 20.0 and rep.choice.before_us == 50.0
    assert _ugraphs(out.model) == [seen[1]] and seen[1] != dumps(_fused())
    assert "measured" in rep.choice.why


def test_cli_json_lines_carry_the_search_fields(tmp_path, monkeypatch):
    import mlso_cli.pipeline.run as run
    from mlso_cli import knobs
    from mlso_cli.cli import main

    fake = FakeSearch()
    monkeypatch.setattr(run, "default_search", lambda: fake)
    monkeypatch.setenv("MLSO_CACHE_DIR", str(tmp_path / "cache"))
    knobs.cache_clear()
    try:
        out = tmp_path / "o.onnx"
        rows = []
        for _ in range(2):
            res = CliRunner().invoke(
                main,
                [
                    "-q",
                    "optimize",
                    str(SRC),
                    "-o",
                    str(out),
                    "--force",
                    "--json",
                    "--min-speedup",
                    "0",
                    "--max-states",
                    "10",
                    "--jobs",
                    "1",
                ],
            )
            assert res.exit_code == 0, res.output
            rows.append([json.loads(x) for x in res.stdout.splitlines()])
    finally:
        knobs.cache_clear()
    first, second = rows[0][0], rows[1][0]
    for key in (
        "kernels",
        "states",
        "verified",
        "search_s",
        "bound",
        "estimate_us",
        "us_before",
        "us_after",
        "packaged",
        "why",
        "searched",
        "cached",
        "partial",
        "pruned",
    ):
        assert key in first, key
    assert (
        first["searched"]
        and first["states"] == 10
        and first["verified"] == 1
        and first["bound"] == 2.0**-62
    )
    assert first["kernels"] == program_cost(_fused()).launches and not first["cached"]
    # the lifted candidate (bound 0) is no verified program
    assert first["verified_programs"] == [
        {
            "kernels": program_cost(_fused()).launches,
            "estimate_us": round(program_cost(_fused()).us, 3),
            "bound": 2.0**-62,
        }
    ]
    assert second["cached"] and fake.calls == 1
    # the bound written is what the check before writing obtained, not the search's
    assert rows[1][-1]["packaged"] == 1 and rows[1][0]["node"] == "mlso_region_0"
    assert (
        rows[1][-1]["bound"] == rows[1][0]["verified_bound"]
        and 0 < rows[1][-1]["bound"] <= 2.0**-60
    )


def test_nothing_in_the_package_imports_tests():
    root = Path(__file__).resolve().parent.parent / "mlso_cli"
    offenders = [
        str(p)
        for p in root.rglob("*.py")
        if any(s in p.read_text() for s in ("from tests", "import tests", "examples import"))
    ]
    assert offenders == []
    assert not (root / "verify" / "examples.py").exists()


@pytest.mark.slow
def test_cli_outputs_are_byte_identical_across_processes(tmp_path):
    """Two processes with different hash seeds (Python salts hash() per process), each searching
    afresh (own cache) with the same --seed and --max-states, write the same bytes, and the search
    found and packaged a fused program; a third run on the first's cache is served from it and
    writes the same bytes too."""
    from tests.helpers import run_cli

    outs = []
    for seed, cache_dir in (("1", "c1"), ("2", "c2"), ("3", "c1")):
        out = tmp_path / f"t{seed}" / "t.onnx"
        out.parent.mkdir()
        r = run_cli(
            "optimize",
            str(SRC),
            "-o",
            str(out),
            "--min-speedup",
            "0",
            "--json",
            "--seed",
            "5",
            "--max-states",
            "20000",
            env={"PYTHONHASHSEED": seed, "MLSO_CACHE_DIR": str(tmp_path / cache_dir)},
        )
        assert r.returncode == 0, r.stderr
        rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
        outs.append((out.read_bytes(), rows[0]))
    assert outs[0][0] == outs[1][0] == outs[2][0]
    first = outs[0][1]
    assert (
        first["verified"] >= 1
        and first["kernels"] == 1
        and not first["cached"]
        and not outs[1][1]["cached"]
    )
    assert outs[2][1]["cached"]


def test_equal_regions_are_searched_once_and_bound_once(tmp_path):
    """A model that repeats a region: each distinct region is searched once per run, even with
    the disk cache off, and its bound enters the run's union bound once. (transformer_tiny's
    regions stopped repeating once RoPE lifted into them: its two layers are now cut at different
    places; DeepSeek-V3 tiny repeats one region at seq 16.)"""
    from tests.helpers import ROOT

    calls = []

    def fake(target, options, progress=None):
        calls.append(target)
        c = program_cost(target)
        return SearchResult(
            (Candidate(target, c.us, c.launches, 1e-20),), 1, 0, 1, 0.0, 1e-20, False
        )

    out = optimize(
        str(ROOT / "models" / "zoo_small" / "deepseek_v3_tiny_fp32.onnx"),
        {"input_ids": (1, 16)},
        _opts(tmp_path, use_cache=False),
        search=fake,
        dry_run=True,
    )
    hashes = [r.searched.region_hash for r in out.regions]
    assert len(calls) == len(set(hashes)) < len(hashes)
    assert out.bound == pytest.approx(1e-20 * len(set(hashes)))
    assert sum(r.searched.cached for r in out.regions) == len(hashes) - len(set(hashes))


def test_progress_and_table_on_stderr_with_verbose(tmp_path, monkeypatch):
    import mlso_cli.pipeline.run as run
    from mlso_cli.cli import main

    monkeypatch.setattr(run, "default_search", lambda: FakeSearch())
    res = CliRunner().invoke(main, ["-v", "optimize", str(SRC), "--dry-run", "--no-cache"])
    assert res.exit_code == 0, res.output
    assert res.stdout == ""  # stdout carries data only
    for text in ("region 0", "states 10", "pruned 2", "verified 1", "dry run: nothing written"):
        assert text in res.stderr, text


def test_the_fewest_launch_verified_candidate_is_timed_beside_the_top_k():
    """--gpu times the top K by estimate and, when none of them has as few launches, the verified
    candidate with the fewest: the GPU, not the launch price of the cost model, decides."""
    from mlso_cli.pipeline.select import Ranked, _picks

    g = _fused()

    def r(kernels: int, bound: float) -> Ranked:
        return Ranked(Candidate(g, 1.0, kernels, bound), program_cost(g))

    ranked = [r(2, 1e-20), r(3, 1e-20), r(1, 1e-20), r(1, 0.0)]
    assert _picks(ranked, 1) == [0, 2]
    assert _picks(ranked, 3) == [0, 1, 2]  # already among the top 3
    assert _picks(ranked[:2], 1) == [0]  # nothing with fewer launches was verified
    assert _picks([r(2, 1e-20), r(1, 0.0)], 1) == [0]  # the lifted program (bound 0) is not one


def test_the_search_verifies_the_fewest_launch_structure_too():
    from types import SimpleNamespace

    from mlso_cli.search.run import _to_verify

    def f(us: float, launches: int, program: str):
        return SimpleNamespace(estimate_us=us, launches=launches, program=program)

    g = _fused()
    graphs = {"a": g, "b": check(fixture("gqa", True)), "c": check(fixture("lora", True))}
    graph_of = lambda x: graphs[x.program]  # noqa: E731
    found = [f(10, 2, "a"), f(11, 2, "b"), f(12, 1, "c"), f(13, 1, "c")]
    chosen = lambda *a: [x for x, _ in _to_verify(*a, graph_of)]  # noqa: E731
    assert chosen(found, 1, 100.0) == [found[0], found[2]]
    assert chosen(found, 3, 100.0) == found[:3]  # the fourth is the third's program again
    assert chosen(found, 1, 11.5) == [found[0]]  # the 1-launch one is slower than lifted
    assert chosen(found, 1, 9.0) == []
    far = [f(5, 2, "a"), f(10.5, 1, "c")]
    assert chosen(far, 1, 100.0) == [far[0]]  # more than ALT_SLACK times the best estimate
    assert [k for _, k in _to_verify(found, 1, 100.0, graph_of)] == [g, graphs["c"]]
