"""A model optimized for one input shape, fed another: who refuses it, and with which message.

Why: `mlso optimize` specialises the whole model to the `--input-shape` it was given (folded
shape arithmetic, kernels compiled for static shapes). Feeding batch 2 to a model optimized for
batch 1 must fail before anything computes, and where mlso can speak, the message must say what
the model was optimized for and how to get one for the new shape (package/shapes.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from mlso_cli.errors import ExitCode, UsageError
from mlso_cli.package import (
    META_INPUT_SHAPES,
    check_input_shapes,
    package_model,
    recorded_input_shapes,
    standard_metadata,
)
from mlso_cli.runtime import build
from mlso_cli.runtime.ort_headers import find_ort_include
from tests.test_package_support import ROOT, attention_mlp, two_regions, use_cache
from tests.test_runtime_fakecuda import FAKE_CUDA, _compile, scale_model

META = standard_metadata(targets=["sm_90a"], seed=0, verification_bound="0")


def _props(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


@pytest.fixture
def packed() -> onnx.ModelProto:
    m = attention_mlp(ir_version=10)
    return package_model(m, two_regions(m), META)


def _inputs(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    return {
        i.name: tuple(d.dim_value for d in i.type.tensor_type.shape.dim) for i in model.graph.input
    }


def test_packaging_records_the_input_shapes(packed):
    record = json.loads(_props(packed)[META_INPUT_SHAPES])
    assert record == {k: list(v) for k, v in _inputs(packed).items()}
    assert recorded_input_shapes(packed) == _inputs(packed)
    # A dim that was not static is recorded as null and matches anything.
    dynamic = scale_model(dynamic=True)
    assert json.loads(_props(dynamic)[META_INPUT_SHAPES]) == {"x": [None, 64]}
    check_input_shapes(dynamic, {"x": (3, 64)}, "m.onnx")


def test_the_record_survives_edited_graph_inputs(packed):
    """Users make inputs dynamic to get past ONNX Runtime's refusal; the record still says what
    the kernels need."""
    name = packed.graph.input[0].name
    want = _inputs(packed)[name]
    edited = onnx.ModelProto()
    edited.CopyFrom(packed)
    edited.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    assert recorded_input_shapes(edited)[name] == want


def test_models_without_a_record(packed):
    plain = attention_mlp(ir_version=10)
    assert recorded_input_shapes(plain) is None
    check_input_shapes(plain, {plain.graph.input[0].name: (99, 99)}, "plain.onnx")
    # An MlsoKernel model written before the record: its graph inputs stand for it.
    old = onnx.ModelProto()
    old.CopyFrom(packed)
    kept = [p for p in old.metadata_props if p.key != META_INPUT_SHAPES]
    del old.metadata_props[:]
    old.metadata_props.extend(kept)
    assert recorded_input_shapes(old) == _inputs(packed)
    # A malformed record is ignored, not trusted.
    bad = onnx.ModelProto()
    bad.CopyFrom(packed)
    next(p for p in bad.metadata_props if p.key == META_INPUT_SHAPES).value = '{"x": [0, "a"]}'
    assert recorded_input_shapes(bad) == _inputs(packed)


def test_plain_onnx_runtime_refuses_other_shapes_at_the_boundary(packed):
    """What a user of stock ONNX Runtime sees: the graph inputs are static, so ORT refuses the
    feed before any node runs, in its own words; the model's metadata says what it needs."""
    name, shape = next(iter(_inputs(packed).items()))
    other = (shape[0] + 1, *shape[1:])
    sess = ort.InferenceSession(packed.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {n: np.zeros(s, np.float32) for n, s in _inputs(packed).items()}
    sess.run(None, feeds)  # the shapes it was optimized for run (the fallback bodies)
    with pytest.raises(Exception, match=f"Got invalid dimensions for input: {name}"):
        sess.run(None, {**feeds, name: np.zeros(other, np.float32)})
    meta = sess.get_modelmeta().custom_metadata_map
    assert json.loads(meta[META_INPUT_SHAPES])[name] == list(shape)


def test_mlsos_check_names_the_shapes_and_the_fix(packed):
    name, shape = next(iter(_inputs(packed).items()))
    other = (shape[0] + 1, *shape[1:])
    check_input_shapes(packed, _inputs(packed), "fast.onnx")
    with pytest.raises(UsageError) as exc:
        check_input_shapes(packed, {name: other}, "fast.onnx")
    assert exc.value.exit_code == ExitCode.USAGE
    line = exc.value.one_line()
    assert "\n" not in line
    fmt = ",".join
    assert f"fast.onnx was optimized for input shape {name}={fmt(map(str, shape))}" in line
    assert f"this run feeds {name}={fmt(map(str, other))}" in line
    assert f"re-run `mlso optimize` on the original model with --input-shape {name}=" in line
    assert fmt(map(str, other)) in line.split("re-run")[1]
    with pytest.raises(UsageError, match="optimized for input shape"):
        check_input_shapes(packed, {name: shape[:-1]}, "fast.onnx")  # another rank


# ---- the MlsoKernel op itself (fake CUDA on the CPU EP, tests/test_runtime_fakecuda.py) ---------

RUNNER = r"""
import ctypes, json, sys
import numpy as np
import onnxruntime as ort

fake = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # soname libcuda.so.1
library, folder = sys.argv[2], sys.argv[3]
results = {}

def open_session(name):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.register_custom_ops_library(library)
    return ort.InferenceSession(f"{folder}/{name}.onnx", so, providers=["CPUExecutionProvider"])

def attempt(key, fn):
    before = fake.fake_launches()
    try:
        results[key] = {"ok": True, "value": fn()}
    except Exception as e:
        results[key] = {"ok": False, "error": str(e)}
    results[key]["launches"] = fake.fake_launches() - before

x = np.ones((4, 64), np.float32)
sess = open_session("dynamic")
attempt("dynamic_ok", lambda: sess.run(None, {"x": x})[0].shape)
attempt("dynamic_batch", lambda: sess.run(None, {"x": np.ones((3, 64), np.float32)})[0].shape)
attempt("reshaped", lambda: open_session("reshaped").run(None, {"x": x[:3]})[0].shape)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def op_results(tmp_path_factory) -> dict:
    mp = pytest.MonkeyPatch()
    try:
        use_cache(mp)
        include = find_ort_include()
    finally:
        mp.undo()
    tmp = tmp_path_factory.mktemp("shape_op")
    (tmp / "fake_cuda.cc").write_text(FAKE_CUDA)
    fake = tmp / "libcuda.so.1"
    _compile(
        [
            "g++",
            "-O1",
            "-shared",
            "-fPIC",
            "-std=c++17",
            "-Wl,-soname,libcuda.so.1",
            str(tmp / "fake_cuda.cc"),
            "-o",
            str(fake),
        ]
    )
    lib = tmp / "libmlso_ort_cpu_test.so"
    _compile(
        [
            "g++",
            *build.FLAGS,
            '-DMLSO_EXECUTION_PROVIDER="CPUExecutionProvider"',
            "-DMLSO_TEST_HOST_MEMORY",
            f"-I{include}",
            str(build.CSRC / "mlso_ort.cc"),
            "-o",
            str(lib),
            *build.LIBS,
            f"-Wl,--version-script={build.CSRC / build.VERSION_SCRIPT}",
        ]
    )
    onnx.save(scale_model(dynamic=True), str(tmp / "dynamic.onnx"))
    # Optimized for x [4,64], then its graph input given another static shape (as a user fixing
    # "batch" by hand, or a tool applying --input-shape, does).
    reshaped = scale_model()
    reshaped.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 64]))
    onnx.save(reshaped, str(tmp / "reshaped.onnx"))
    runner = tmp / "runner.py"
    runner.write_text(textwrap.dedent(RUNNER))
    proc = subprocess.run(
        [sys.executable, str(runner), str(fake), str(lib), str(tmp)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_names_the_fix(msg: str) -> None:
    assert "mlso.input_shapes" in msg
    assert "re-run `mlso optimize` on the original model with --input-shape" in msg


def test_the_op_refuses_another_batch_at_run_time(op_results):
    assert op_results["dynamic_ok"]["ok"] and op_results["dynamic_ok"]["launches"] == 1
    r = op_results["dynamic_batch"]
    assert not r["ok"] and r["launches"] == 0
    msg = r["error"]
    assert "MlsoKernel node 'mlso_region_0': input 'x' (tensor input 0)" in msg
    assert (
        "has shape [3,64] dtype float32, but the plan expects shape [4,64] dtype float32. "
        "The node was optimized for that shape" in msg
    )
    assert "not launched" in msg
    _assert_names_the_fix(msg)


def test_the_op_calls_reshaped_inputs_a_shape_mismatch_not_tampering(op_results):
    r = op_results["reshaped"]
    assert not r["ok"] and r["launches"] == 0
    msg = r["error"]
    assert (
        "MlsoKernel node 'mlso_region_0' was optimized for input 'x' (tensor input 0) of shape "
        "[4,64] float32, but the graph gives it shape [3,64]" in msg
    )
    assert "session was refused" in msg
    _assert_names_the_fix(msg)
    # Tampering stays possible, and is said last, as a question.
    assert msg.rstrip().endswith("tampered?)")
