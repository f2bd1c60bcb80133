"""A cached rerun of optimize on a large model (issue 31) skips the copies of the weights, not
any outcome: shape inference on a weight-less view answers as on the whole model, the model
digest covers every weight byte, a rerun whose verdict is cached reads the model once, and
packaging leaves the loaded model as it was."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from mlso_cli.frontend import load as load_mod
from mlso_cli.frontend.inference import STRIP_MIN_ELEMENTS, infer_in_place, weightless_view
from mlso_cli.pipeline import optimize
from mlso_cli.pipeline import verifying as verifying_mod
from mlso_cli.pipeline.verdicts import model_digest, original_id
from tests.test_pipeline import SRC, FakeSearch
from tests.test_verdict_cache import _opts

ZOO = Path(__file__).resolve().parents[1] / "models" / "zoo_small"


def _model() -> onnx.ModelProto:
    """x @ W (a weight over the strip floor), reshaped by a small constant, its shape taken
    again by Shape -> Gather -> Concat (data propagation), plus a 1-D bias over the floor."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 128)).astype(np.float32)
    bias = rng.standard_normal(8 * 1024).astype(np.float32)
    inits = [
        numpy_helper.from_array(w, "W"),
        numpy_helper.from_array(bias, "bias"),
        numpy_helper.from_array(np.array([1, 64, 2, 64], np.int64), "shape4"),
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["y"]),
        helper.make_node("Reshape", ["y", "shape4"], ["r"]),
        helper.make_node("Shape", ["r"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["s0"]),
        helper.make_node("Unsqueeze", ["s0", "zero1"], ["s0v"]),
        helper.make_node("Concat", ["s0v", "minus1"], ["flat_shape"], axis=0),
        helper.make_node("Reshape", ["r", "flat_shape"], ["flat"]),
        helper.make_node("Add", ["flat", "bias"], ["out"]),
    ]
    inits.append(numpy_helper.from_array(np.array([0], np.int64), "zero1"))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 64])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_inference_on_the_weightless_view_matches_the_whole_model():
    m = _model()
    want = onnx.shape_inference.infer_shapes(m, strict_mode=False, data_prop=True)
    view = weightless_view(m)
    assert view is not None
    by_name = {t.name: t for t in view.graph.initializer}
    assert not by_name["W"].raw_data and list(by_name["W"].dims) == [64, 128]
    assert by_name["bias"].raw_data  # rank 1: inference may read a vector, so it keeps its bytes
    assert by_name["shape4"].raw_data
    # the weight's bytes did not go to the C++ pass
    assert view.ByteSize() <= m.ByteSize() - 64 * 128 * 4
    got = infer_in_place(m)
    assert got is m
    assert m.SerializeToString() == want.SerializeToString()
    shapes = {
        vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in m.graph.value_info
    }
    assert shapes["r"] == [1, 64, 2, 64] and shapes["flat_shape"] == [2]
    outs = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in m.graph.output}
    assert outs["out"] == [1, 8 * 1024]  # the data-propagated shape reached the output


def test_a_model_with_no_large_weight_has_no_view_and_infers_the_same():
    m = _model()
    small = [t for t in m.graph.initializer if np.prod(t.dims) <= STRIP_MIN_ELEMENTS]
    del m.graph.initializer[:]
    m.graph.initializer.extend(small)
    m.graph.input.extend([helper.make_tensor_value_info("W", TensorProto.FLOAT, [64, 128])])
    assert weightless_view(m) is None
    want = onnx.shape_inference.infer_shapes(m, strict_mode=False, data_prop=True)
    assert infer_in_place(m).SerializeToString() == want.SerializeToString()


def test_the_model_digest_covers_every_weight_byte_and_the_rest():
    m = _model()
    d = model_digest(m)
    same = onnx.ModelProto()
    same.CopyFrom(m)
    assert model_digest(same) == d
    w = next(t for t in same.graph.initializer if t.name == "W")
    data = bytearray(w.raw_data)
    data[-1] ^= 1
    w.raw_data = bytes(data)
    assert model_digest(same) != d
    other = onnx.ModelProto()
    other.CopyFrom(m)
    other.metadata_props.add(key="k", value="v")
    assert model_digest(other) != d


def test_the_original_is_named_by_its_bytes_shapes_onnx_and_source():
    a = original_id("ab" * 32, {"x": (1, 2)}, False)
    assert a == original_id("ab" * 32, {"x": (1, 2)}, False)
    assert a != original_id("cd" * 32, {"x": (1, 2)}, False)
    assert a != original_id("ab" * 32, {"x": (1, 3)}, False)
    assert a != original_id("ab" * 32, {"x": (1, 2)}, True)


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_a_cached_rerun_reads_the_model_once(tmp_path, monkeypatch):
    reads = _counting(monkeypatch, load_mod, "_read_model")
    checks = _counting(monkeypatch, verifying_mod, "verify_models")
    first = optimize(str(SRC), None, _opts(tmp_path), search=FakeSearch())
    assert len(reads) == 2 and len(checks) == 1  # the check loaded A, as `mlso verify` does
    second = optimize(str(SRC), None, _opts(tmp_path), search=FakeSearch())
    assert second.verdict_cached and len(checks) == 1
    assert len(reads) == 3  # the rerun read the file once: A was named, not loaded
    assert second.model.SerializeToString() == first.model.SerializeToString()


def test_other_bytes_of_the_same_graph_are_a_verdict_miss(tmp_path, monkeypatch):
    checks = _counting(monkeypatch, verifying_mod, "verify_models")
    optimize(str(SRC), None, _opts(tmp_path), search=FakeSearch())
    m = onnx.load(SRC)
    m.doc_string = "another export of the same graph"
    other = tmp_path / SRC.name
    onnx.save(m, other)
    optimize(str(other), None, _opts(tmp_path), search=FakeSearch())
    assert len(checks) == 2


def test_packaging_leaves_the_loaded_model_as_it_was():
    from mlso_cli.frontend.analyse import analyse
    from mlso_cli.package import standard_metadata
    from mlso_cli.package.assemble import assemble
    from tests.fixtures.packaging import placeholder

    loaded = load_mod.load_model(str(SRC))
    before = loaded.model.SerializeToString()
    (lr,) = analyse(loaded).lifted
    built = placeholder(lr.graph, lr.extra_inputs)
    meta = standard_metadata(targets=built.plan["targets"], seed=0, verification_bound="0")
    out = assemble(loaded.model, [(lr, built)], meta)
    assert loaded.model.SerializeToString() == before
    assert any(n.domain == "ai.mlso" for n in out.graph.node)
    again = assemble(loaded.model, [(lr, built)], meta)
    assert again.SerializeToString() == out.SerializeToString()


def _serialised_both_ways(m: onnx.ModelProto) -> tuple[bytes, bytes]:
    from mlso_cli.package.chunks import serialized_chunks, serialized_sha256

    pieces = serialized_chunks(m)
    whole = m.SerializeToString()
    assert serialized_sha256(m) == hashlib.sha256(whole).hexdigest()
    return b"".join(pieces), whole


def test_the_pieces_of_a_model_join_into_its_serialisation():
    m = _model()
    w = next(t for t in m.graph.initializer if t.name == "W")
    w.doc_string = "a field after raw_data"  # fields on both sides of the split
    w.metadata_props.add(key="k", value="v")
    m.graph.doc_string = "after the initializers"
    m.metadata_props.add(key="after", value="the graph")
    m.doc_string = "before the graph"
    joined, whole = _serialised_both_ways(m)
    assert joined == whole


def test_the_pieces_of_the_zoo_models_join_into_their_serialisation():
    for path in sorted(ZOO.glob("*.onnx")):
        joined, whole = _serialised_both_ways(onnx.load(path))
        assert joined == whole, path.name


def test_a_model_with_unknown_fields_is_serialised_whole():
    from mlso_cli.package.chunks import serialized_chunks

    m = _model()
    data = m.SerializeToString() + bytes([0xF8, 0x7F, 1])  # field 2047, a varint: unknown
    parsed = onnx.ModelProto()
    parsed.ParseFromString(data)
    assert serialized_chunks(parsed) == [parsed.SerializeToString()]
    joined, whole = _serialised_both_ways(parsed)
    assert joined == whole and whole.endswith(bytes([0xF8, 0x7F, 1]))


def test_the_file_written_holds_the_model_serialised(tmp_path):
    from mlso_cli.package import write_model_atomic

    m = _model()
    m.metadata_props.add(key="after", value="the graph")
    out = write_model_atomic(m, tmp_path / "m.onnx")
    assert out.read_bytes() == m.SerializeToString()
    assert not [p for p in tmp_path.iterdir() if p.name != "m.onnx"]  # no temp file left
