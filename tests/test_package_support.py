"""Shared helpers for the runtime and packaging tests (no tests here).

Small ONNX models, dummy kernel plans, and one library build per test session: the library is
built into a private cache (the ORT headers are fetched there once, as the runtime would).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import shutil
import tempfile
from functools import cache
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from mlso_cli import knobs as knobs_mod
from mlso_cli.package import PackagedRegion
from mlso_cli.runtime import build

ROOT = Path(__file__).resolve().parent.parent
STAGED_HEADERS = ROOT / ".device-stage" / "onnxruntime"
STAGED_CUBLAS = ROOT / ".device-stage" / "cublas_include"


@cache
def shared_cache() -> Path:
    path = Path(tempfile.mkdtemp(prefix="mlso-test-cache-"))
    atexit.register(shutil.rmtree, path, True)
    return path


def use_cache(monkeypatch, path: Path | None = None) -> Path:
    """Point MLSO_CACHE_DIR at `path` (default: the session's shared cache) for one test."""
    path = path or shared_cache()
    monkeypatch.setenv("MLSO_CACHE_DIR", str(path))
    if STAGED_HEADERS.joinpath("onnxruntime_c_api.h").is_file():  # the GPU machine has no network
        monkeypatch.setenv("MLSO_ORT_INCLUDE", str(STAGED_HEADERS))
    if STAGED_CUBLAS.joinpath("cublasLt.h").is_file():  # likewise the cuBLASLt headers
        monkeypatch.setenv("MLSO_CUBLAS_INCLUDE", str(STAGED_CUBLAS))
    knobs_mod.cache_clear()
    build._library_path.cache_clear()
    return path


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def dummy_plan(inputs: list[tuple[str, list[int]]], outputs: list[tuple[str, list[int]]]) -> dict:
    """A well-formed plan: one launch reading every input and writing every output."""
    args = [{"kind": "input", "index": i} for i in range(len(inputs))]
    args += [{"kind": "output", "index": j} for j in range(len(outputs))]
    return {
        "version": 1,
        "targets": ["sm_80", "sm_90a"],
        "smem_max": 0,
        "inputs": [{"dtype": d, "shape": s} for d, s in inputs],
        "outputs": [{"dtype": d, "shape": s} for d, s in outputs],
        "scratch": [],
        "zero": [],
        "launches": [
            {"kernel": "mlso_k0", "grid": [1, 1, 1], "block": [128, 1, 1], "smem": 0, "args": args}
        ],
    }


def region(
    node_indices, inputs, outputs, plan, binary=b"\x7fFATBIN-dummy", tag="r"
) -> PackagedRegion:
    return PackagedRegion(
        node_indices=node_indices,
        inputs=inputs,
        outputs=outputs,
        binary=binary,
        plan=plan,
        ugraph_json=json.dumps({"region": tag}),
        source_sha256=sha(tag.encode()),
    )


def attention_mlp(ir_version: int = 14) -> onnx.ModelProto:
    """x[2,8,16] -> MatMul(Wq) -> Softmax -> MatMul(Wv) -> Add(b) -> Relu -> y, fp32.

    Region A is nodes 0..2 (matmul+softmax+matmul, reading x, Wq, Wv), region B nodes 3..4.
    """
    rng = np.random.default_rng(0)
    wq = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "Wq")
    wv = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "Wv")
    b = numpy_helper.from_array(rng.standard_normal((16,)).astype(np.float32), "b")
    nodes = [
        helper.make_node("MatMul", ["x", "Wq"], ["s"], name="qk"),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1, name="softmax"),
        helper.make_node("MatMul", ["p", "Wv"], ["o"], name="pv"),
        helper.make_node("Add", ["o", "b"], ["t"], name="bias"),
        helper.make_node("Relu", ["t"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "attention_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 16])],
        [wq, wv, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = ir_version
    return onnx.shape_inference.infer_shapes(model)


def two_regions(model: onnx.ModelProto, same_binary: bool = False) -> list[PackagedRegion]:
    f32 = "float32"
    shape = [2, 8, 16]
    a = region(
        [0, 1, 2],
        ["x", "Wq", "Wv"],
        ["o"],
        dummy_plan([(f32, shape), (f32, [16, 16]), (f32, [16, 16])], [(f32, shape)]),
        binary=b"binary-A",
        tag="A",
    )
    b = region(
        [3, 4],
        ["o", "b"],
        ["y"],
        dummy_plan([(f32, shape), (f32, [16])], [(f32, shape)]),
        binary=b"binary-A" if same_binary else b"binary-B",
        tag="B",
    )
    return [a, b]


def run_cpu(model: onnx.ModelProto | bytes, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    if isinstance(model, onnx.ModelProto) and model.ir_version > 13:  # the original, for reference
        model = onnx.ModelProto.FromString(model.SerializeToString())
        model.ir_version = 13
    data = model if isinstance(model, bytes) else model.SerializeToString()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(None, feeds)
