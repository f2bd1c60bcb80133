"""`optimize --serve cuda-graph|plain`: the never-slower rule measured like with like, and the
whole-model check, on the CPU with injected timers.

Why fake timers: the decisions (which mode's figures are compared, when the whole model falls
back to the original) must hold whatever a GPU measures, and are tested here with fixed numbers;
tests/test_serve_gpu.py runs the real timers on a GPU.
"""

from __future__ import annotations

import json
from functools import cache

import onnx
import pytest
from click.testing import CliRunner

from mlso_cli.bench.harness import RegionTiming, Timing
from mlso_cli.bench.pair import ModelTimes
from mlso_cli.ir import check, dumps
from mlso_cli.package import META_MODEL_CHECK, META_SERVE
from mlso_cli.pipeline import CUDA_GRAPH, PLAIN, ModeTimes, PipelineOptions, optimize
from mlso_cli.pipeline.select import Timing as SelectTiming
from mlso_cli.pipeline.select import served_estimate_us
from mlso_cli.pipeline.wholemodel import check_whole_model, model_verdict
from mlso_cli.search.api import Candidate, SearchOptions, SearchResult
from mlso_cli.search.cost import H200, program_cost
from tests.fixtures.ugraphs import fixture
from tests.helpers import SMALL, run_cli

SRC = next(p for p in SMALL if p.stem == "rmsnorm_linear")


@cache
def _fused():
    return check(fixture("rmsnorm_linear", small=True))


def fake_search(target, options, progress=None) -> SearchResult:
    """The hand-written fused program first, the lifted target as the fallback."""
    fused = Candidate(_fused(), program_cost(_fused()).us, program_cost(_fused()).launches, 0.0)
    lifted = Candidate(target, program_cost(target).us, program_cost(target).launches, 0.0)
    return SearchResult((fused, lifted), 10, 2, 1, 0.01, 0.0, False, ())


fake_search.__qualname__ = "serve_fake_search"


def _mlso_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == "ai.mlso"]


def _meta(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


def _opts(tmp_path, **kw) -> PipelineOptions:
    return PipelineOptions(
        search=SearchOptions(max_states=10, seed=0),
        cache_dir=tmp_path / "search-cache",
        **kw,
    )


# Slower under ORT's CUDA graph (30 -> 35 µs), faster plain (50 -> 40 µs): the program's node
# costs more than the captured original nodes, but less than their plain per-node overhead.
SLOWER_UNDER_GRAPH = dict(
    orig_plain_us=50.0, orig_graph_us=30.0, served_plain_us=40.0, served_graph_us=35.0
)
# The old rule's trap: the faster of the two modes on each side (30 against 28) packaged it, yet
# served under a graph the region goes from 30 to 35 µs.
OLD_RULE_TRAP = dict(
    orig_plain_us=50.0, orig_graph_us=30.0, served_plain_us=28.0, served_graph_us=35.0
)


def _region_timer(figures: dict, calls: list | None = None):
    def measure(model, gpu):
        (node,) = _mlso_nodes(model)
        if calls is not None:
            calls.append(node.name)
        orig = min(figures["orig_plain_us"], figures["orig_graph_us"] or 1e9)
        served = min(figures["served_plain_us"] or 1e9, figures["served_graph_us"] or 1e9)
        return [RegionTiming(node.name, node.overload, orig, 12.0, served, **figures)]

    return measure


def _model_timer(ratio: float, calls: list | None = None, fail: dict | None = None):
    """Fixed per-round figures: the original at 100 µs, the rewritten at 100/ratio, with a
    small alternating spread; `fail` maps a mode to ModelTimes failure fields."""

    def time_models(original, rewritten, gpu, mode):
        if calls is not None:
            calls.append((mode, len(_mlso_nodes(original)), len(_mlso_nodes(rewritten))))
        if fail and mode in fail:
            return ModelTimes(mode, **fail[mode])
        orig = tuple(100.0 + (i % 3) * 0.1 for i in range(15))
        rew = tuple(t / ratio for t in orig)
        return ModelTimes(mode, orig, rew)

    return time_models


@pytest.fixture
def gpu_ok(monkeypatch):
    import mlso_cli.pipeline.gpu as gpu

    monkeypatch.setattr(gpu, "require_gpu", lambda index: None)


# ---- flags, options, metadata and JSON -------------------------------------------------------


def test_serve_flag_is_offered_and_checked():
    r = run_cli("optimize", "--help")
    assert r.returncode == 0 and b"--serve [cuda-graph|plain]" in r.stdout
    assert b"cuda-graph" in r.stdout
    r = run_cli("optimize", str(SRC), "--dry-run", "--serve", "tensorrt")
    assert r.returncode == 2 and b"tensorrt" in r.stderr and not r.stdout


def test_serve_option_defaults_to_cuda_graph_and_refuses_others():
    assert PipelineOptions().serve == CUDA_GRAPH
    with pytest.raises(ValueError, match="cuda-graph, plain"):
        PipelineOptions(serve="graph")


@pytest.mark.parametrize("serve", [CUDA_GRAPH, PLAIN])
def test_serve_is_in_the_metadata_and_the_json(tmp_path, monkeypatch, serve):
    import mlso_cli.pipeline.run as run
    from mlso_cli import knobs
    from mlso_cli.cli import main

    monkeypatch.setattr(run, "default_search", lambda: fake_search)
    monkeypatch.setenv("MLSO_CACHE_DIR", str(tmp_path / "cache"))
    knobs.cache_clear()
    out = tmp_path / "o.onnx"
    try:
        res = CliRunner().invoke(
            main,
            ["-q", "optimize", str(SRC), "-o", str(out), "--json", "--serve", serve, "--jobs", "1"],
        )
    finally:
        knobs.cache_clear()
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in res.stdout.splitlines()]
    region, summary = rows[0], rows[-1]
    assert region["serve"] == serve and summary["serve"] == serve
    assert summary["model_check"] is None  # no --gpu: no whole-model check
    assert region["measured"] is False and region["program_us"] is None and region["timed"] == {}
    assert region["onnx_estimate_us"] > 0
    assert f"for {serve}" in region["why"]
    meta = _meta(onnx.load(str(out)))
    assert meta[META_SERVE] == serve and META_MODEL_CHECK not in meta


# ---- without a GPU: the cost model, plain pays one ORT node ----------------------------------


def test_plain_estimate_charges_the_program_one_ort_node(tmp_path):
    graph = optimize(str(SRC), None, _opts(tmp_path), search=fake_search, dry_run=True)
    plain = optimize(str(SRC), None, _opts(tmp_path, serve=PLAIN), search=fake_search, dry_run=True)
    g, p = graph.regions[0].choice, plain.regions[0].choice
    assert g.before_us == p.before_us  # onnx_region_cost: plain ORT, per-node cost included
    assert g.after_us == pytest.approx(program_cost(_fused()).us)  # as before this change
    assert p.after_us == pytest.approx(g.after_us + H200.ort_node_s * 1e6)
    assert served_estimate_us(program_cost(_fused()), PLAIN) == pytest.approx(p.after_us)


# ---- with a GPU (faked): the named mode only ----------------------------------------------------


def test_slower_under_graph_but_faster_plain(tmp_path, gpu_ok):
    """--serve plain packages it (50 -> 40 µs plain); --serve cuda-graph keeps the original
    (30 -> 35 µs under the graph), and then there is nothing for the whole-model check."""
    seen = []
    out = optimize(
        str(SRC),
        None,
        _opts(tmp_path, gpu=0, top_k=1, serve=PLAIN),
        search=fake_search,
        measure=_region_timer(SLOWER_UNDER_GRAPH),
        time_models=_model_timer(1.2, seen),
    )
    c = out.regions[0].choice
    assert c.packaged and c.serve == PLAIN and (c.before_us, c.after_us) == (50.0, 40.0)
    assert c.why == "measured 1.25x under plain" and c.program_us == 12.0
    assert {m.mode: (m.orig_us, m.served_us) for m in c.modes} == {
        PLAIN: (50.0, 40.0),
        CUDA_GRAPH: (30.0, 35.0),
    }
    assert len(_mlso_nodes(out.model)) == 1 and seen == [(PLAIN, 0, 1)]
    assert out.check.rewritten_kept and _meta(out.model)[META_SERVE] == PLAIN

    seen = []
    out = optimize(
        str(SRC),
        None,
        _opts(tmp_path, gpu=0, top_k=1),
        search=fake_search,
        measure=_region_timer(SLOWER_UNDER_GRAPH),
        time_models=_model_timer(1.2, seen),
    )
    c = out.regions[0].choice
    assert not c.packaged and (c.before_us, c.after_us) == (30.0, 35.0)
    assert c.why == "kept original: measured 0.86x under cuda-graph < 1x"
    assert _mlso_nodes(out.model) == [] and seen == [] and out.check is None
    assert _meta(out.model)[META_SERVE] == CUDA_GRAPH


def test_the_faster_of_two_modes_no_longer_decides(tmp_path, gpu_ok):
    out = optimize(
        str(SRC),
        None,
        _opts(tmp_path, gpu=0, top_k=1),
        search=fake_search,
        measure=_region_timer(OLD_RULE_TRAP),
        time_models=_model_timer(1.2),
    )
    c = out.regions[0].choice
    assert not c.packaged and "0.86x under cuda-graph" in c.why


def test_in_mode_figures():
    both = (ModeTimes(CUDA_GRAPH, 30.0, 35.0), ModeTimes(PLAIN, 50.0, 40.0))
    t = SelectTiming(0, 30.0, 35.0, 12.0, both)
    assert (t.in_mode(CUDA_GRAPH).orig_us, t.in_mode(CUDA_GRAPH).served_us) == (30.0, 35.0)
    assert (t.in_mode(PLAIN).orig_us, t.in_mode(PLAIN).served_us) == (50.0, 40.0)
    # original nodes that cannot be captured: the model cannot be served under a graph at all
    t = SelectTiming(0, 50.0, 35.0, 12.0, (ModeTimes(CUDA_GRAPH, None, 35.0), both[1]))
    f = t.in_mode(CUDA_GRAPH)
    assert (f.orig_us, f.served_us, f.mode) == (50.0, 40.0, PLAIN) and "cannot run" in f.note
    # a timer without per-mode figures (older fakes): its figures are the named mode's
    f = SelectTiming(0, 50.0, 20.0).in_mode(CUDA_GRAPH)
    assert (f.orig_us, f.served_us, f.mode) == (50.0, 20.0, CUDA_GRAPH)


def test_a_program_not_timed_in_the_mode_is_not_packaged(tmp_path, gpu_ok):
    figures = dict(
        orig_plain_us=50.0, orig_graph_us=30.0, served_plain_us=10.0, served_graph_us=None
    )
    out = optimize(
        str(SRC),
        None,
        _opts(tmp_path, gpu=0, top_k=1),
        search=fake_search,
        measure=_region_timer(figures),
        time_models=_model_timer(1.2),
        dry_run=True,
    )
    c = out.regions[0].choice
    assert not c.packaged and c.why.startswith("kept original: no candidate's MlsoKernel node")


def test_harness_keeps_each_mode(monkeypatch):
    """_time_modes times both modes and keys them by name; a graph that cannot be captured is
    None, and _time_in_ort still returns the faster (its behaviour before --serve)."""
    import mlso_cli.bench.harness as harness
    import mlso_cli.runtime as runtime

    class Sess:
        def __init__(self, graph):
            self.graph = graph

    def session(data, providers):
        ((_, opts),) = providers
        return Sess(opts["enable_cuda_graph"] == "1")

    def time_session(sess, feeds, gpu, repeats, iters):
        return Timing(20.0 if sess.graph else 50.0, [])

    monkeypatch.setattr(runtime, "session", session)
    monkeypatch.setattr(harness, "time_session", time_session)
    monkeypatch.setattr(harness, "random_feeds", lambda sub: {})
    got = harness._time_modes(onnx.ModelProto(), 0, 1, 1)
    assert {k: v.median_us for k, v in got.items()} == {"plain": 50.0, "cuda-graph": 20.0}
    assert harness._time_in_ort(onnx.ModelProto(), 0, 1, 1).median_us == 20.0

    def no_graph(data, providers):
        ((_, opts),) = providers
        if opts["enable_cuda_graph"] == "1":
            raise RuntimeError("cannot capture")
        return Sess(False)

    monkeypatch.setattr(runtime, "session", no_graph)
    got = harness._time_modes(onnx.ModelProto(), 0, 1, 1)
    assert got["cuda-graph"] is None and got["plain"].median_us == 50.0


# ---- the whole-model check ----------------------------------------------------------------------


def _times(ratios: list[float], mode: str = CUDA_GRAPH) -> ModelTimes:
    return ModelTimes(mode, tuple(100.0 for _ in ratios), tuple(100.0 / r for r in ratios))


def test_model_verdict_rule():
    v = model_verdict(_times([1.2] * 15), CUDA_GRAPH, 1.0)
    assert v.ran and v.rewritten_kept and v.why.startswith("whole model measured 1.20x")
    assert v.speedup == pytest.approx(1.2) and v.rounds == 15 and v.orig_us == 100.0
    v = model_verdict(_times([100 / 103.1] * 15), CUDA_GRAPH, 1.0)
    assert not v.rewritten_kept
    assert v.why.startswith("kept original: whole model measured 0.97x under cuda-graph")
    # a median above 1 with a quarter of the rounds or more at or below 1 is not a gain
    v = model_verdict(_times([0.95] * 5 + [1.05] * 10), CUDA_GRAPH, 1.0)
    assert not v.rewritten_kept and v.speedup == pytest.approx(1.05)
    assert v.speedup_iqr[0] <= 1.0
    # --min-speedup 0 packages every region: written anyway, and said
    v = model_verdict(_times([0.9] * 15), CUDA_GRAPH, 0.0)
    assert v.rewritten_kept and "written anyway" in v.why
    # a rewritten model that cannot run in the mode is never written
    v = model_verdict(ModelTimes(CUDA_GRAPH, rewritten_failed="capture failed"), CUDA_GRAPH, 1.0)
    assert not v.ran and not v.rewritten_kept and "capture failed" in v.why
    # nothing to compare with: the region measurements stand
    v = model_verdict(ModelTimes(PLAIN, original_failed="no CUDA EP"), PLAIN, 1.0)
    assert not v.ran and v.rewritten_kept and v.why.startswith("whole-model check not run")


def test_original_not_capturable_is_compared_plain():
    calls = []
    timer = _model_timer(1.3, calls, fail={CUDA_GRAPH: {"original_failed": "node on CPU"}})
    v = check_whole_model(onnx.ModelProto(), onnx.ModelProto(), 0, CUDA_GRAPH, 1.0, timer)
    assert [c[0] for c in calls] == [CUDA_GRAPH, PLAIN]
    assert v.serve == CUDA_GRAPH and v.mode == PLAIN and v.rewritten_kept
    assert "under plain" in v.why and "node on CPU" in v.why


def test_a_slower_whole_model_writes_the_original(tmp_path, gpu_ok):
    """The region measured 1.25x alone; the whole model 0.97x: the output is the original model,
    every region says why, and the metadata records the verdict."""
    out = optimize(
        str(SRC),
        None,
        _opts(tmp_path, gpu=0, top_k=1, serve=PLAIN),
        search=fake_search,
        measure=_region_timer(SLOWER_UNDER_GRAPH),
        time_models=_model_timer(100 / 103.1),
    )
    c = out.regions[0].choice
    assert _mlso_nodes(out.model) == [] and out.packaged == 0 and not c.packaged
    assert c.why.startswith("kept original: whole model measured 0.97x under plain")
    assert c.why.endswith("the region alone: measured 1.25x under plain")
    assert not out.check.rewritten_kept and out.check.speedup == pytest.approx(0.97, abs=0.005)
    meta = _meta(out.model)
    assert meta[META_SERVE] == PLAIN and meta[META_MODEL_CHECK] == out.check.why
    onnx.checker.check_model(out.model)


def test_cli_writes_the_original_when_the_whole_model_is_slower(tmp_path, monkeypatch):
    """Through `mlso optimize --gpu 0 --serve plain --json` with both timers faked: exit 0, the
    file on disk holds no MlsoKernel node, and the JSON says why."""
    import mlso_cli.pipeline.gpu as gpu
    import mlso_cli.pipeline.run as run
    from mlso_cli import knobs
    from mlso_cli.cli import main

    monkeypatch.setattr(gpu, "require_gpu", lambda index: None)
    monkeypatch.setattr(run, "default_search", lambda: fake_search)
    monkeypatch.setattr(run, "_time_regions", _region_timer(SLOWER_UNDER_GRAPH))
    monkeypatch.setattr(run, "_pair_timer", lambda rounds, iters: _model_timer(100 / 103.1))
    monkeypatch.setenv("MLSO_CACHE_DIR", str(tmp_path / "cache"))
    knobs.cache_clear()
    out = tmp_path / "o.onnx"
    try:
        res = CliRunner().invoke(
            main,
            ["-q", "optimize", str(SRC), "-o", str(out), "--json", "--gpu", "0", "--serve",
             "plain", "--top-k", "1", "--jobs", "1"],
        )  # fmt: skip
    finally:
        knobs.cache_clear()
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in res.stdout.splitlines()]
    region, summary = rows[0], rows[-1]
    assert not region["packaged"] and "whole model measured 0.97x under plain" in region["why"]
    assert region["measured"] and region["program_us"] == 12.0
    assert region["timed"]["plain"] == {"orig_us": 50.0, "served_us": 40.0}
    assert summary["packaged"] == 0 and summary["serve"] == "plain"
    mc = summary["model_check"]
    assert mc["ran"] and not mc["rewritten_kept"] and mc["rounds"] == 15 and mc["speedup"] < 1
    model = onnx.load(str(out))
    assert _mlso_nodes(model) == [] and _meta(model)[META_SERVE] == "plain"
    assert [p.name for p in tmp_path.iterdir() if p.name != "cache"] == ["o.onnx"]


def test_injected_region_timer_alone_skips_the_whole_model_check(tmp_path, gpu_ok):
    """Fixed region figures and a real model timing measure different things: a caller that
    injects `measure` only gets the region decisions (and no GPU is touched)."""
    out = optimize(
        str(SRC),
        None,
        _opts(tmp_path, gpu=0, top_k=1, serve=PLAIN),
        search=fake_search,
        measure=_region_timer(SLOWER_UNDER_GRAPH),
    )
    assert out.check is None and len(_mlso_nodes(out.model)) == 1
    assert dumps(_fused()) in [
        a.s.decode() for n in _mlso_nodes(out.model) for a in n.attribute if a.name == "ugraph"
    ]
