"""benchmarks/real_decoders.py on the CPU: what it keeps of `optimize --json` per region (the
library baseline's figures among them), its per-region table and records."""

from __future__ import annotations

import importlib
import json
import sys

import pytest
from click.testing import CliRunner

from tests.helpers import ROOT
from tests.test_baseline_trial import FUSED, LIFTED, SRC, Search, _timer


@pytest.fixture
def rd():
    sys.path.insert(0, str(ROOT))
    try:
        yield importlib.import_module("benchmarks.real_decoders")
    finally:
        sys.path.remove(str(ROOT))


def _optimize_json(monkeypatch, figures) -> str:
    """optimize --gpu 0 --json's stdout, with the search and the region timer faked."""
    import mlso_cli.pipeline.gpu as gpu
    import mlso_cli.pipeline.run as run
    from mlso_cli.cli import main

    monkeypatch.setattr(gpu, "require_gpu", lambda index: None)
    monkeypatch.setattr(run, "default_search", Search)
    monkeypatch.setattr(run, "_time_regions", _timer(figures, []))
    args = ["-q", "optimize", str(SRC), "--dry-run", "--json", "--no-cache", "--jobs", "1"]
    res = CliRunner().invoke(main, [*args, "--gpu", "0", "--top-k", "1"])
    assert res.exit_code == 0, res.output
    return res.stdout


def test_each_region_carries_the_baseline_from_optimize_json(rd, monkeypatch, capsys):
    out = _optimize_json(monkeypatch, {FUSED: (50.0, 40.0, 12.0), LIFTED: (40.0, 44.0, 30.0)})
    (region,) = rd._regions(rd._json_lines(out))  # the summary line is not a region
    assert region["baseline_us"] == 44.0 and region["baseline_vs_ort"] == 1.1
    assert region["baseline_orig_us"] == 40.0 and region["us_after"] == 40.0
    results = {"llama": {"regions": [region]}, "qwen2": {"error": "export: failed"}}
    ((row, figs),) = rd._region_rows(results)
    assert row == "llama region 0"
    assert figs["baseline / ORT"] == 1.1 and figs["ORT µs"] == 40.0 and figs["baseline µs"] == 44.0
    rd._region_table(results)
    table = capsys.readouterr().out
    assert "| baseline µs | baseline / ORT |" in table
    assert (
        "| llama region 0 | norm-linear | cuda-graph | 40.0 | 44.0 | 1.100 (over 1.05) |" in table
    )


def test_a_region_without_a_baseline_figure_has_no_row(rd, capsys):
    results = {"llama": {"regions": [{"region": 0, "label": "linear", "baseline_us": None}]}}
    assert rd._region_rows(results) == []
    rd._region_table(results)
    assert capsys.readouterr().out == ""


def test_records_go_to_a_table_of_their_own(rd, monkeypatch, tmp_path):
    import benchmarks.results_table as rt

    monkeypatch.setattr(rt, "RECORDS", tmp_path)
    region = {
        "region": 3,
        "label": "attention",
        "packaged": True,
        "serve": "cuda-graph",
        "us_after": 20.0,
        "baseline_us": 31.0,
        "baseline_orig_us": 30.0,
        "baseline_vs_ort": 1.033,
        "baseline_program_us": 22.0,
    }
    rd._record({"phi3": {"regions": [region], "bench": []}}, "test GPU")
    (rec,) = json.loads((tmp_path / "real_decoder_regions.json").read_text())
    assert rec["row"] == "phi3 region 3" and rec["figures"]["baseline / ORT"] == 1.033
    assert json.loads((tmp_path / "real_decoders.json").read_text())[0]["row"] == "phi3"
    text = rt.render(rt.load_records())
    assert "## Real exported decoders, per region: library baseline against ONNX Runtime" in text
    assert "| phi3 region 3 |" in text and "baseline / ORT" in text


def test_an_optimize_only_run_records_regions_but_no_whole_model_row(rd, monkeypatch, tmp_path):
    """--optimize-only times no whole model, so it must not add a real_decoders record (it would
    supersede the last full row with an empty one)."""
    import benchmarks.results_table as rt

    monkeypatch.setattr(rt, "RECORDS", tmp_path)
    region = {"region": 0, "label": "linear", "baseline_us": 10.0, "baseline_vs_ort": 0.9}
    rd._record({"llama": {"regions": [region]}}, "test GPU", whole_models=False)
    assert not (tmp_path / "real_decoders.json").exists()
    (rec,) = json.loads((tmp_path / "real_decoder_regions.json").read_text())
    assert rec["row"] == "llama region 0" and rec["figures"]["baseline / ORT"] == 0.9


def test_bench_optimize_only_skips_verify_and_bench(rd, monkeypatch, tmp_path):
    calls = []

    class Done:
        returncode, stdout, stderr = 0, "", ""

    def cli(argv, timeout):
        calls.append(argv[0])
        return Done()

    monkeypatch.setattr(rd, "_cli", cli)
    (tmp_path / "peers.json").write_text(json.dumps({"llama": {"file": "llama.onnx"}}))
    args = rd.argparse.Namespace(
        out=str(tmp_path),
        families=[],
        optimize_args=[],
        optimize_timeout=1,
        record=False,
        optimize_only=True,
    )
    assert rd.bench(args) == 0
    assert calls == ["optimize"]
    saved = json.loads((tmp_path / "real_decoders.json").read_text())
    assert saved["llama"]["optimize_rc"] == 0 and "bench" not in saved["llama"]
