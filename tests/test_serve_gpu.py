"""`optimize --gpu 0 --serve cuda-graph|plain` on a real GPU (skipped cleanly without one).

Cheap on purpose: one small model, a small deterministic search budget (the second mode is
served from the first's search cache), one candidate timed per region. What is asserted is the
rule's bookkeeping on real measurements, not a speedup: each region is decided by the named
mode's figures only, and the file written is never a model the whole-model check measured
slower.
"""

from __future__ import annotations

import json

import onnx
import pytest

from tests.helpers import SMALL, run_cli

NAME = "ntrans"
SRC = next(p for p in SMALL if p.stem == NAME)


@pytest.mark.gpu
@pytest.mark.parametrize("serve", ["cuda-graph", "plain"])
def test_optimize_decides_by_the_named_mode(tmp_path, serve):
    out = tmp_path / f"{serve}.onnx"
    r = run_cli(
        "optimize", str(SRC), "-o", str(out), "--gpu", "0", "--serve", serve, "--json",
        "--top-k", "1", "--max-states", "2000",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    regions, summary = rows[:-1], rows[-1]
    assert summary["serve"] == serve
    model = onnx.load(str(out))
    onnx.checker.check_model(model)
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["mlso.serve"] == serve
    for region in regions:
        assert region["serve"] == serve and region["measured"] and region["program_us"] > 0
        assert set(region["timed"]) == {"cuda-graph", "plain"}
        assert region["timed"]["plain"]["orig_us"] > 0
        mode = serve if region["timed"][serve]["orig_us"] is not None else "plain"
        figures = region["timed"][mode]
        if figures["served_us"] is None:
            assert not region["packaged"]
            continue
        # the rule compared the named mode's figures, nothing else
        assert region["us_before"] == figures["orig_us"]
        assert region["us_after"] == figures["served_us"]
        if region["packaged"]:
            assert region["speedup"] > 1.0
    check = summary["model_check"]
    kernels = [n for n in model.graph.node if n.domain == "ai.mlso"]
    if check is None:  # nothing was packaged: nothing to check
        assert summary["packaged"] == 0 and not kernels
    elif check["ran"] and check["rewritten_kept"]:
        assert check["speedup_iqr"][0] > 1.0 and len(kernels) == summary["packaged"] > 0
        assert meta["mlso.model_check"] == check["why"]
    elif not check["rewritten_kept"]:
        assert not kernels and summary["packaged"] == 0
        assert all("kept original" in x["why"] for x in regions)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["cuda-graph", "plain"])
def test_time_pair_times_a_model_against_itself(mode):
    from mlso_cli.bench.pair import time_pair

    model = onnx.load(str(SRC))
    times = time_pair(model, model, 0, mode, rounds=3, iters=5, warmup=2)
    assert times.original_failed is None and times.rewritten_failed is None
    assert len(times.original) == len(times.rewritten) == 3
    assert all(t > 0 for t in times.original + times.rewritten)
