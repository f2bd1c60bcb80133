"""optimize --gpu, verify --gpu and bench on a real GPU (skipped cleanly without one)."""

from __future__ import annotations

import json

import onnx
import pytest

from tests.helpers import SMALL, run_cli


def _small(name):
    return next(p for p in SMALL if p.stem == name)


def test_gpu_flags_without_a_gpu_are_environment_problems(tmp_path):
    from mlso_cli.runtime import gpu_info

    if gpu_info(0) is not None:
        pytest.skip("this machine has a GPU")
    out = tmp_path / "o.onnx"
    r = run_cli("optimize", str(_small("gqa")), "-o", str(out), "--gpu", "0")
    assert r.returncode == 4 and not out.exists()
    r = run_cli("bench", str(_small("gqa")), str(_small("gqa")), "--gpu", "0")
    assert r.returncode == 4 and b"GPU" in r.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ntrans", "gqa"])
def test_optimize_measures_then_verify_and_bench_on_gpu(tmp_path, name):
    out = tmp_path / "fast.onnx"
    r = run_cli("optimize", str(_small(name)), "-o", str(out), "--gpu", "0", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    region = rows[0]
    assert "measured" in region["why"] and region["us_before"] > 0 and region["us_after"] > 0
    # never slower: a region is packaged only if its measured program is faster (and the whole
    # model measured faster too: a region that won alone may still be given back)
    assert not region["packaged"] or region["speedup"] > 1.0
    if region["speedup"] > 1.0 and not region["packaged"]:
        assert "whole model" in region["why"]
    onnx.checker.check_model(onnx.load(str(out)))
    r = run_cli("verify", str(_small(name)), str(out), "--gpu", "0", "--samples", "1")
    assert r.returncode == 0, r.stderr
    forced = tmp_path / "forced.onnx"
    assert (
        run_cli("optimize", str(_small(name)), "-o", str(forced), "--min-speedup", "0").returncode
        == 0
    )
    r = run_cli(
        "bench",
        str(_small(name)),
        str(forced),
        "--gpu",
        "0",
        "--json",
        "--repeats",
        "3",
        "--iters",
        "20",
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    assert {x["type"] for x in rows} == {"model", "region"}
    assert all(x["orig_us"] > 0 and (x.get("fast_us") or x.get("kernel_us")) > 0 for x in rows)


def test_gpu_flags_with_the_cpu_onnxruntime_are_environment_problems(tmp_path, monkeypatch):
    """A GPU is there but onnxruntime is the CPU package: every --gpu path stops before any
    work with exit 4 and says to install onnxruntime-gpu (it used to fail after the search,
    deep in ORT, with exit 1)."""
    import onnxruntime as ort

    import mlso_cli.runtime as runtime
    from mlso_cli.errors import EnvironmentProblem
    from mlso_cli.pipeline import gpu
    from mlso_cli.runtime import GpuInfo

    fake = GpuInfo(0, "Fake GPU", (9, 0), 227 * 1024)
    monkeypatch.setattr(runtime, "gpu_info", lambda index=0: fake)
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(EnvironmentProblem) as e:
        gpu.require_gpu(0)
    assert e.value.exit_code == 4
    assert "CUDAExecutionProvider" in str(e.value) and "onnxruntime-gpu" in e.value.fix
    monkeypatch.setattr(
        ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    assert gpu.require_gpu(0) is fake
