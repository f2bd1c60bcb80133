"""Every benchmark seed model and zoo model, optimized and then verified: exit 0.

Why: optimize runs the verification library on what it writes (pipeline/verifying.py), so
`mlso verify` must accept every model optimize writes, with its own fresh seed. The 2-layer
Llama and GPT-2 exports were packaged with `verified 0` and a bound of 0, then refused by
verify. Slow: each model is searched (small --max-states) and fully verified.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import MODELS, run_cli

SMALL_MODELS = sorted((MODELS / "small").glob("*.onnx"))
ZOO_MODELS = sorted((MODELS / "zoo_small").glob("*.onnx"))


def _roundtrip(tmp_path, src, *shape: str) -> None:
    out = tmp_path / "o.onnx"
    env = {**os.environ, "MLSO_CACHE_DIR": str(tmp_path / "cache")}
    r = run_cli(
        "optimize",
        str(src),
        "-o",
        str(out),
        *shape,
        "--max-states",
        "2000",
        "--json",
        env=env,
        timeout=1200,  # a zoo model on a loaded 2-core machine: deepseek took over 300 s
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    summary = rows[-1]
    for row in rows[:-1]:
        if row["packaged"]:  # a packaged region carries the bound its check obtained
            assert row["verified_bound"] is not None and 0 < row["verified_bound"] < 1
    r = run_cli(
        "verify", str(src), str(out), *shape, "--samples", "1", "--json", env=env, timeout=1200
    )
    assert r.returncode == 0, r.stderr
    vsum = json.loads(r.stdout.splitlines()[-1])
    assert vsum["pass"] and vsum["kernels"] == summary["packaged"]
    if summary["packaged"]:
        assert 0 < summary["bound"] < 1 and 0 < vsum["false_accept_bound"] < 1


@pytest.mark.slow
@pytest.mark.parametrize("src", SMALL_MODELS, ids=[p.stem for p in SMALL_MODELS])
def test_a_benchmark_model_optimized_then_verified(tmp_path, src):
    _roundtrip(tmp_path, src)


@pytest.mark.slow
@pytest.mark.parametrize("src", ZOO_MODELS, ids=[p.stem for p in ZOO_MODELS])
def test_a_zoo_model_optimized_then_verified(tmp_path, src):
    _roundtrip(tmp_path, src, "--input-shape", "input_ids=1,32")
