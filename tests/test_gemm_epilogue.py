"""A library GEMM's bias and residual epilogues end to end on the CPU: a model with a Linear's
bias (ONNX MatMul + Add of a vector), or with a residual (MatMul + Add of a full matrix that is a
graph input, as a decoder's o_proj or down projection + the residual stream), goes through
`mlso optimize --dry-run --json`, then `optimize -o` writes a version 3 (bias) or 4 (residual)
plan whose one launch is a cuBLASLt GEMM with the epilogue, and `mlso verify` (field check,
lifting, host emulator, algebraic check) accepts it. The lowering rules themselves are in
test_libgemm.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.helpers import run_cli
from tests.test_package_support import use_cache


def _linear_bias(path: Path) -> Path:
    """y = x @ W + b at a width where the library GEMM beats every generated program, so the
    lifted program (the GEMM with its epilogue) is what optimize packages."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((256, 512)) * 0.05).astype(np.float32), "w")
    b = numpy_helper.from_array((rng.standard_normal(512) * 0.05).astype(np.float32), "b")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "linear_bias",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 64, 512])],
        [w, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.save(model, path)
    return path


def _linear_residual(path: Path, dtype: int = TensorProto.FLOAT) -> Path:
    """y = x @ W + r, r a graph input of y's shape (the residual stream), at the width above:
    one GEMM whose C is r (beta 1) and whose D is y."""
    rng = np.random.default_rng(0)
    np_dtype = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
    w = numpy_helper.from_array((rng.standard_normal((256, 512)) * 0.05).astype(np_dtype), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "r"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "linear_residual",
        [
            helper.make_tensor_value_info("x", dtype, ["n", 64, 256]),
            helper.make_tensor_value_info("r", dtype, ["n", 64, 512]),
        ],
        [helper.make_tensor_value_info("y", dtype, ["n", 64, 512])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.save(model, path)
    return path


ARGS = ("--input-shape", "x=1,64,256", "--max-states", "200", "--min-speedup", "0", "--json")
RESIDUAL_SHAPES = ("--input-shape", "x=2,64,256", "--input-shape", "r=2,64,512")
RESIDUAL_ARGS = (*RESIDUAL_SHAPES, "--max-states", "200", "--min-speedup", "0", "--json")


def test_dry_run_reports_the_linear_as_one_launch(tmp_path, monkeypatch):
    use_cache(monkeypatch)
    src = _linear_bias(tmp_path / "linear_bias.onnx")
    r = run_cli("optimize", str(src), "--dry-run", *ARGS)
    assert r.returncode == 0, r.stderr.decode()
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    (region,) = [x for x in rows if x["type"] == "region"]
    assert region["packaged"] and region["kernels"] == 1  # MatMul + Add: one GEMM, no add pass
    assert rows[-1]["type"] == "summary" and rows[-1]["packaged"] == 1


@pytest.mark.slow  # a whole optimize -o + verify: `make test` stays under 10 minutes
def test_optimize_writes_a_bias_epilogue_and_verify_accepts_it(tmp_path, monkeypatch):
    use_cache(monkeypatch)
    src = _linear_bias(tmp_path / "linear_bias.onnx")
    out = tmp_path / "out.onnx"
    r = run_cli("optimize", str(src), "-o", str(out), *ARGS, timeout=600)
    if r.returncode != 0 and b"nvcc" in r.stderr:
        pytest.skip(f"no CUDA compiler: {r.stderr.decode()[-300:]}")
    assert r.returncode == 0, r.stderr.decode()
    (node,) = [n for n in onnx.load(out).graph.node if n.domain == "ai.mlso"]
    plan = json.loads(next(a.s for a in node.attribute if a.name == "plan"))
    (launch,) = plan["launches"]
    assert plan["version"] == 3 and launch["kind"] == "gemm"
    assert launch["bias"]["offset"] == 0 and launch["bias"]["buf"]["kind"] == "input"
    r = run_cli(
        "verify",
        str(src),
        str(out),
        "--input-shape",
        "x=1,64,256",
        "--samples",
        "1",
        "--trust-binary",
        "--json",
    )
    assert r.returncode == 0, r.stderr.decode()
    summary = json.loads(r.stdout.splitlines()[-1])
    assert summary["pass"] and summary["kernels_equivalent"] == 1 and summary["emulated"] == 1


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["f32", "f16"])
def test_dry_run_reports_matmul_plus_residual_as_one_launch(tmp_path, monkeypatch, dtype):
    use_cache(monkeypatch)
    src = _linear_residual(tmp_path / "linear_residual.onnx", dtype)
    r = run_cli("optimize", str(src), "--dry-run", *RESIDUAL_ARGS)
    assert r.returncode == 0, r.stderr.decode()
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    (region,) = [x for x in rows if x["type"] == "region"]
    assert region["packaged"] and region["kernels"] == 1  # MatMul + Add: one GEMM, no add pass
    assert rows[-1]["type"] == "summary" and rows[-1]["packaged"] == 1


@pytest.mark.slow  # a whole optimize -o + verify: `make test` stays under 10 minutes
def test_optimize_writes_a_residual_epilogue_and_verify_accepts_it(tmp_path, monkeypatch):
    use_cache(monkeypatch)
    src = _linear_residual(tmp_path / "linear_residual.onnx", TensorProto.FLOAT16)
    out = tmp_path / "out.onnx"
    r = run_cli("optimize", str(src), "-o", str(out), *RESIDUAL_ARGS, timeout=600)
    if r.returncode != 0 and b"nvcc" in r.stderr:
        pytest.skip(f"no CUDA compiler: {r.stderr.decode()[-300:]}")
    assert r.returncode == 0, r.stderr.decode()
    (node,) = [n for n in onnx.load(out).graph.node if n.domain == "ai.mlso"]
    plan = json.loads(next(a.s for a in node.attribute if a.name == "plan"))
    (launch,) = plan["launches"]
    assert plan["version"] == 4 and launch["kind"] == "gemm" and "bias" not in launch
    assert launch["beta"] == 1.0 and launch["dtype_c"] == "float16"
    res = launch["residual"]
    assert res["buf"]["kind"] == "input" and (res["ld"], res["stride"]) == (512, 64 * 512)
    assert launch["c"]["buf"]["kind"] == "output"
    r = run_cli(
        "verify",
        str(src),
        str(out),
        *RESIDUAL_SHAPES,
        "--samples",
        "1",
        "--trust-binary",
        "--json",
    )
    assert r.returncode == 0, r.stderr.decode()
    summary = json.loads(r.stdout.splitlines()[-1])
    assert summary["pass"] and summary["kernels_equivalent"] == 1 and summary["emulated"] == 1
