"""The fp64 reference and the value infos that verify's checks use, at weights of real size.

Why: both used to re-serialize every weight (promoted to float64 inside the proto, or handed to
shape inference with the model), once per sample or per kernel; a 2-layer Llama-1B-width export's
checks before writing took 109 s, 55 s without. These tests pin that the faster forms compute
the same thing."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from mlso_cli.package.regionmodel import value_infos
from mlso_cli.verify.reference64 import Reference, reference_outputs


def _model(declare_weight_as_input: bool = False) -> onnx.ModelProto:
    """y = Reshape(x @ W + b, (2, 2, 600)), fp16 weights over the 4096-element line."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((8, 600)) / 8).astype(np.float16)
    b = rng.standard_normal(600).astype(np.float16)
    vi = helper.make_tensor_value_info
    inputs = [vi("x", TensorProto.FLOAT16, [4, 8])]
    if declare_weight_as_input:  # the pre-IR-4 style: initializers listed as graph inputs too
        inputs.append(vi("W", TensorProto.FLOAT16, [8, 600]))
    g = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["h"]),
            helper.make_node("Reshape", ["h", "shape"], ["y"]),
        ],
        "m",
        inputs,
        [vi("y", TensorProto.FLOAT16, None)],
        [
            numpy_helper.from_array(w, "W"),
            numpy_helper.from_array(b, "b"),
            numpy_helper.from_array(np.array([2, 2, 600], np.int64), "shape"),
        ],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    return m


def _expected(m: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    inits = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in m.graph.initializer}
    return (x.astype(np.float64) @ inits["W"] + inits["b"]).reshape(2, 2, 600)


def test_the_reference_feeds_weights_in_float64_and_serves_many_samples():
    for declared in (False, True):
        m = _model(declared)
        ref = Reference(m)
        assert set(ref._weights) == {"W", "b"}  # fed as arrays, not re-serialized as doubles
        assert all(v.dtype == np.float64 for v in ref._weights.values())
        for seed in (1, 2):
            x = np.random.default_rng(seed).standard_normal((4, 8)).astype(np.float16)
            got = ref({"x": x})["y"]
            assert got.dtype == np.float64
            np.testing.assert_allclose(got, _expected(m, x), rtol=1e-12, atol=1e-12)
            np.testing.assert_array_equal(got, reference_outputs(m, {"x": x})["y"])
    # the caller's model is left as it was
    assert {t.name for t in m.graph.initializer} == {"W", "b", "shape"}


def test_value_infos_without_the_weights_match_full_shape_inference():
    m = _model()
    full = onnx.shape_inference.infer_shapes(m).graph
    want = {vi.name: vi for vi in list(full.input) + list(full.value_info) + list(full.output)}
    got = value_infos(m)
    for name in ("x", "xw", "h", "y"):
        assert got[name] == want[name], name
    assert [d.dim_value for d in got["y"].type.tensor_type.shape.dim] == [2, 2, 600]
    assert len(m.graph.initializer) == 3 and len(m.graph.input) == 1  # not modified
