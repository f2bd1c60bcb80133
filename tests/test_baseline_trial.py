"""`optimize --gpu`'s baseline trial: each region's baseline program (its lifted program, library
GEMMs plus generated kernels for everything else) is timed beside the searched picks, reported
against ONNX Runtime's time for the region, and chosen when it beats every pick.

Fixed figures stand in for the GPU (an injected MeasureFn); the programs are still generated and
compiled for the trials, as on the device. The fused candidate is the hand-written fixture of
tests/fixtures, used as test data only.
"""

from __future__ import annotations

import json
from functools import cache

import onnx
import pytest
from click.testing import CliRunner

from mlso_cli.bench.harness import RegionTiming
from mlso_cli.ir import check, dumps
from mlso_cli.pipeline import CUDA_GRAPH, PLAIN, PipelineOptions, optimize
from mlso_cli.search.api import Candidate, SearchOptions, SearchResult
from mlso_cli.search.cost import program_cost
from tests.fixtures.ugraphs import fixture
from tests.helpers import SMALL

SRC = next(p for p in SMALL if p.stem == "rmsnorm_linear")
FUSED, LIFTED = "fused", "lifted"


@cache
def _fused():
    return check(fixture("rmsnorm_linear", small=True))


def _candidate(graph, bound: float) -> Candidate:
    cost = program_cost(graph)
    return Candidate(graph, cost.us, cost.launches, bound)


class Search:
    """The fused fixture (verified) and the lifted target (the fallback, as the search returns
    it); remembers the target it was given."""

    def __init__(self) -> None:
        self.targets: list = []
        self.__qualname__ = "baseline_trial_search"

    def __call__(self, target, options, progress=None) -> SearchResult:
        self.targets.append(target)
        fused, lifted = _candidate(_fused(), 2.0**-62), _candidate(target, 0.0)
        return SearchResult((fused, lifted), 10, 2, 1, 0.01, 2.0**-62, False, ())


def _mlso_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == "ai.mlso"]


def _ugraph(node: onnx.NodeProto) -> str:
    return next(a.s.decode() for a in node.attribute if a.name == "ugraph")


def _timer(figures: dict[str, tuple[float, float, float]], seen: list[str]):
    """figures: FUSED or LIFTED -> (original nodes µs, MlsoKernel node µs, program alone µs),
    the same in both modes. Records which program each trial held."""

    def measure(model, gpu):
        (node,) = _mlso_nodes(model)
        which = FUSED if _ugraph(node) == dumps(_fused()) else LIFTED
        seen.append(which)
        orig, served, program = figures[which]
        return [
            RegionTiming(
                node.name,
                node.overload,
                orig,
                program,
                served,
                orig_plain_us=orig,
                orig_graph_us=orig,
                served_plain_us=served,
                served_graph_us=served,
            )
        ]

    return measure


def _opts(tmp_path, **kw) -> PipelineOptions:
    return PipelineOptions(
        search=SearchOptions(max_states=10, seed=0), cache_dir=tmp_path / "search-cache", **kw
    )


@pytest.fixture
def gpu_ok(monkeypatch):
    import mlso_cli.pipeline.gpu as gpu

    monkeypatch.setattr(gpu, "require_gpu", lambda index: None)


def test_the_baseline_trial_is_built_timed_and_reported(tmp_path, gpu_ok):
    """--top-k 1 times the fused pick; one more trial holds the lifted program, and its figures,
    against the original nodes of its own trial, are the region's baseline."""
    seen: list[str] = []
    search = Search()
    out = optimize(
        str(SRC),
        None,
        _opts(tmp_path, gpu=0, top_k=1),
        search=search,
        measure=_timer({FUSED: (50.0, 40.0, 12.0), LIFTED: (48.0, 50.4, 30.0)}, seen),
        dry_run=True,
    )
    assert seen == [FUSED, LIFTED]
    c = out.regions[0].choice
    assert c.candidate.graph == _fused() and (c.before_us, c.after_us) == (50.0, 40.0)
    assert (c.baseline_us, c.baseline_orig_us, c.baseline_program_us) == (50.4, 48.0, 30.0)
    assert c.baseline_vs_ort == pytest.approx(1.05)
    assert c.why == "measured 1.25x under cuda-graph"


def test_the_baseline_trial_holds_the_lifted_program(tmp_path, gpu_ok):
    """The program of the extra trial is the region's lifted target itself (the search's
    fallback candidate), compiled with library GEMMs by codegen."""
    trials: list[onnx.ModelProto] = []
    search = Search()

    def measure(model, gpu):
        trials.append(model)
        (node,) = _mlso_nodes(model)
        return [RegionTiming(node.name, node.overload, 50.0, 10.0, 40.0)]

    optimize(
        str(SRC),
        None,
        _opts(tmp_path, gpu=0, top_k=1),
        search=search,
        measure=measure,
        dry_run=True,
    )
    (target,) = search.targets
    assert [_ugraph(_mlso_nodes(t)[0]) for t in trials] == [dumps(_fused()), dumps(target)]
    plan = json.loads(
        next(a.s.decode() for a in _mlso_nodes(trials[1])[0].attribute if a.name == "plan")
    )
    # rmsnorm_linear's matmul is a cuBLASLt call in the baseline, not a generated kernel
    assert [k for k in plan["launches"] if k.get("kind") == "gemm"]


def test_a_baseline_that_beats_every_pick_is_chosen(tmp_path, gpu_ok):
    seen: list[str] = []
    search = Search()
    out = optimize(
        str(SRC),
        None,
        _opts(tmp_path, gpu=0, top_k=1, serve=PLAIN),
        search=search,
        measure=_timer({FUSED: (50.0, 40.0, 12.0), LIFTED: (50.0, 25.0, 20.0)}, seen),
    )
    c = out.regions[0].choice
    (target,) = search.targets
    assert c.packaged and c.candidate.graph == target and c.after_us == 25.0
    assert c.why == "measured 2.00x under plain (the baseline program)"
    assert c.baseline_us == 25.0 and c.baseline_vs_ort == pytest.approx(0.5)
    assert [_ugraph(n) for n in _mlso_nodes(out.model)] == [dumps(target)]


def test_a_baseline_that_loses_or_ties_changes_no_byte_of_the_output(tmp_path, gpu_ok, monkeypatch):
    """With the baseline slower than the pick, or as fast, the model written is byte for byte the
    one written with no baseline trial at all (the run before this change); a tie goes to the
    pick."""
    import mlso_cli.pipeline.select as select

    def run(lifted: tuple[float, float, float], seen: list[str]) -> onnx.ModelProto:
        out = optimize(
            str(SRC),
            None,
            _opts(tmp_path, gpu=0, top_k=1, seed=7),
            search=Search(),
            measure=_timer({FUSED: (50.0, 40.0, 12.0), LIFTED: lifted}, seen),
        )
        assert out.regions[0].choice.candidate.graph == _fused()
        return out.model

    with monkeypatch.context() as m:
        m.setattr(select, "baseline_index", lambda ranked, lr: None)
        before: list[str] = []
        today = run((50.0, 1.0, 1.0), before).SerializeToString()
    assert before == [FUSED]  # no baseline trial: what ran before
    for lifted in ((50.0, 45.0, 30.0), (50.0, 40.0, 30.0)):
        seen: list[str] = []
        assert run(lifted, seen).SerializeToString() == today
        assert seen == [FUSED, LIFTED]


def test_a_baseline_already_picked_adds_no_trial(tmp_path, gpu_ok):
    """Where the lifted program is a pick (--top-k 2 times both candidates), that pick's figures
    are the baseline's, no trial is added, and it wins as the pick it is (today's rule)."""
    seen: list[str] = []
    search = Search()
    out = optimize(
        str(SRC),
        None,
        _opts(tmp_path, gpu=0, top_k=2),
        search=search,
        measure=_timer({FUSED: (50.0, 48.0, 5.0), LIFTED: (50.0, 45.0, 30.0)}, seen),
        dry_run=True,
    )
    c = out.regions[0].choice
    assert seen == [FUSED, LIFTED]
    assert c.candidate.graph == search.targets[0] and c.after_us == 45.0
    assert c.baseline_us == 45.0 and c.baseline_vs_ort == pytest.approx(0.9)
    assert c.why == "measured 1.11x under cuda-graph"


def test_an_unbounded_baseline_is_reported_but_never_chosen(tmp_path, gpu_ok, monkeypatch):
    """A lifted program the field check cannot bound is left out of the choice (choose_bounded);
    it is still timed and reported."""
    import mlso_cli.verify.equivalence as equivalence

    monkeypatch.setattr(equivalence, "unbounded", lambda a, b: "per-trial bound 1")
    seen: list[str] = []
    out = optimize(
        str(SRC),
        None,
        _opts(tmp_path, gpu=0, top_k=1),
        search=Search(),
        measure=_timer({FUSED: (50.0, 40.0, 12.0), LIFTED: (50.0, 20.0, 10.0)}, seen),
        dry_run=True,
    )
    c = out.regions[0].choice
    assert seen == [FUSED, LIFTED]
    assert c.candidate.graph == _fused() and c.after_us == 40.0
    assert c.baseline_us == 20.0 and c.baseline_vs_ort == pytest.approx(0.4)


def test_without_a_gpu_nothing_is_timed_and_the_fields_are_null(tmp_path):
    out = optimize(str(SRC), None, _opts(tmp_path), search=Search(), dry_run=True)
    c = out.regions[0].choice
    assert not c.measured and c.baseline_us is None and c.baseline_vs_ort is None


def test_cli_json_and_table_carry_the_baseline(tmp_path, monkeypatch):
    import mlso_cli.pipeline.gpu as gpu
    import mlso_cli.pipeline.run as run
    from mlso_cli.cli import main

    search = Search()
    seen: list[str] = []
    monkeypatch.setattr(gpu, "require_gpu", lambda index: None)
    monkeypatch.setattr(run, "default_search", lambda: search)
    monkeypatch.setattr(
        run, "_time_regions", _timer({FUSED: (50.0, 40.0, 12.0), LIFTED: (40.0, 44.0, 30.0)}, seen)
    )
    args = ["-v", "optimize", str(SRC), "--dry-run", "--json", "--no-cache", "--jobs", "1"]
    res = CliRunner().invoke(main, [*args, "--gpu", "0", "--top-k", "1"])
    assert res.exit_code == 0, res.output
    region = json.loads(res.stdout.splitlines()[0])
    assert region["type"] == "region" and seen == [FUSED, LIFTED]
    assert region["baseline_us"] == 44.0 and region["baseline_orig_us"] == 40.0
    assert region["baseline_vs_ort"] == 1.1 and region["baseline_program_us"] == 30.0
    assert "baseline µs" in res.stderr
    assert (
        "library baseline within 1.05x of ONNX Runtime in 0 of 1 timed region(s) "
        "(worst 1.10x, region 0)"
    ) in res.stderr

    res = CliRunner().invoke(main, args)  # no --gpu: the fields are there, and null
    assert res.exit_code == 0, res.output
    region = json.loads(res.stdout.splitlines()[0])
    for key in ("baseline_us", "baseline_orig_us", "baseline_vs_ort", "baseline_program_us"):
        assert key in region and region[key] is None, key
    assert "baseline µs" not in res.stderr and "library baseline" not in res.stderr
    assert seen == [FUSED, LIFTED]  # nothing more was timed


def test_the_serving_mode_decides_which_figures_are_the_baseline(tmp_path, gpu_ok):
    """The baseline's figures are those of the mode the rule compares (--serve)."""

    def measure(model, gpu):
        (node,) = _mlso_nodes(model)
        lifted = _ugraph(node) != dumps(_fused())
        served = (60.0, 33.0) if lifted else (40.0, 35.0)  # plain, graph
        return [
            RegionTiming(
                node.name,
                node.overload,
                30.0,
                20.0,
                min(served),
                orig_plain_us=50.0,
                orig_graph_us=30.0,
                served_plain_us=served[0],
                served_graph_us=served[1],
            )
        ]

    for serve, want in ((PLAIN, (60.0, 50.0)), (CUDA_GRAPH, (33.0, 30.0))):
        out = optimize(
            str(SRC),
            None,
            _opts(tmp_path, gpu=0, top_k=1, serve=serve, min_speedup=0.0),
            search=Search(),
            measure=measure,
            dry_run=True,
        )
        c = out.regions[0].choice
        assert (c.baseline_us, c.baseline_orig_us) == want, serve
        # under the graph the baseline (33 µs) beats the pick (35 µs): it is chosen
        assert (c.candidate.graph == _fused()) == (serve == PLAIN), serve


def test_a_tie_with_a_later_pick_still_goes_to_the_pick(monkeypatch):
    """The baseline wins only when strictly faster than every pick, even where its estimate
    ranks it before a pick (the fewest-launch pick, timed after the top K)."""
    import mlso_cli.pipeline.select as select
    from mlso_cli.ir.hashing import graph_hash
    from mlso_cli.pipeline import Searched
    from mlso_cli.pipeline.frontend import lift

    lifted = lift(str(SRC), None)
    lr = lifted.regions[0]
    first, later = _candidate(_fused(), 2.0**-62), _candidate(_fused(), 2.0**-62)
    base = _candidate(lr.graph, 0.0)
    result = SearchResult((first, base, later), 10, 2, 2, 0.01, 2.0**-61, False, ())
    searched = Searched(lr.region.id, graph_hash(lr.graph), result, False, 0.0)
    # the search's order as the ranking: first (pick), base (rank 1), later (pick, rank 2)
    monkeypatch.setattr(
        select, "rank", lambda cs: [select.Ranked(c, program_cost(c.graph)) for c in cs]
    )
    timings = [
        select.Timing(0, 50.0, 45.0, 10.0),
        select.Timing(2, 50.0, 40.0, 10.0),
        select.Timing(1, 50.0, 40.0, 10.0, baseline=True, beside=True),
    ]
    c = select.choose(lifted.loaded, lr, searched, 1.0, timings)
    assert c.candidate is later and c.why == "measured 1.25x under cuda-graph"
    assert c.baseline_us == 40.0 and c.baseline_vs_ort == pytest.approx(0.8)
    faster = [*timings[:2], select.Timing(1, 50.0, 39.0, 10.0, baseline=True, beside=True)]
    c = select.choose(lifted.loaded, lr, searched, 1.0, faster)
    assert c.candidate is base and c.why.endswith("(the baseline program)")
