"""Small ONNX models built in tests, and a runner for the CLI as a subprocess."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
SMALL = sorted((MODELS / "small").glob("*.onnx"))
TRANSFORMER = MODELS / "transformer_tiny.onnx"
TRANSFORMER_SHAPE = ["--input-shape", "hidden=1,16,64"]


def run_cli(
    *args: str, stdin: bytes | None = None, env: dict | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "mlso_cli", *args],
        input=stdin,
        capture_output=True,
        cwd=ROOT,
        env=full_env,
        timeout=timeout,
    )


def save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


def attention_model(dynamic: bool = False, extra_unknown: bool = False) -> onnx.ModelProto:
    b = "b" if dynamic else 2
    nodes = [
        helper.make_node("MatMul", ["Q", "K"], ["s"], name="qk"),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1, name="softmax"),
        helper.make_node("MatMul", ["p", "V"], ["o"], name="pv"),
    ]
    out = "o"
    domains = [helper.make_opsetid("", 18)]
    if extra_unknown:
        nodes.append(helper.make_node("FancyOp", ["o"], ["f"], domain="com.example", name="fancy"))
        nodes.append(helper.make_node("Relu", ["f"], ["r"], name="relu_after"))
        out = "r"
        domains.append(helper.make_opsetid("com.example", 1))
    graph = helper.make_graph(
        nodes,
        "attn",
        [
            helper.make_tensor_value_info("Q", TensorProto.FLOAT, [b, 16, 8]),
            helper.make_tensor_value_info("K", TensorProto.FLOAT, [b, 8, 32]),
            helper.make_tensor_value_info("V", TensorProto.FLOAT, [b, 32, 8]),
        ],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, [b, 16, 8])],
    )
    model = helper.make_model(graph, opset_imports=domains)
    model.ir_version = 10
    return model


@contextlib.contextmanager
def fresh_cache(tmp_path_factory) -> Iterator[None]:
    """A fresh MLSO_CACHE_DIR for a module's or session's fixtures (compiles and emulator
    builds land there), unless the environment names one; knobs re-read on entry and exit."""
    import pytest

    from mlso_cli import knobs

    mp = pytest.MonkeyPatch()
    if not os.environ.get("MLSO_CACHE_DIR"):
        mp.setenv("MLSO_CACHE_DIR", str(tmp_path_factory.mktemp("mlso-cache")))
    knobs.cache_clear()
    try:
        yield
    finally:
        mp.undo()
        knobs.cache_clear()
