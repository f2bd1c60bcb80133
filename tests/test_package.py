"""Packaging: regions become ai.mlso::MlsoKernel nodes whose function bodies stock ORT runs."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mlso_cli.errors import InputError
from mlso_cli.package import (
    META_EXECUTABLE,
    META_SEED,
    META_VERSION,
    max_ir_for_ort,
    output_ir_version,
    package_model,
    regions_in,
    standard_metadata,
)
from mlso_cli.runtime.plan import plan_json
from tests.test_package_support import attention_mlp, dummy_plan, region, run_cpu, sha, two_regions

META = standard_metadata(targets=["sm_80", "sm_90a"], seed=7, verification_bound="2^-40")
X = np.random.default_rng(1).standard_normal((2, 8, 16)).astype(np.float32)


def mlso_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == "ai.mlso" and n.op_type == "MlsoKernel"]


def test_one_region_runs_through_the_fallback_and_matches_exactly():
    model = attention_mlp()
    f32, shape = "float32", [2, 8, 16]
    plan = dummy_plan([(f32, shape), (f32, [16, 16]), (f32, [16, 16])], [(f32, shape)])
    out = package_model(model, [region([0, 1, 2], ["x", "Wq", "Wv"], ["o"], plan)], META)
    onnx.checker.check_model(out, full_check=True)
    assert 10 <= out.ir_version <= 13
    (node,) = mlso_nodes(out)
    assert list(node.input) == ["mlso_bin_" + sha(b"\x7fFATBIN-dummy")[:16], "x", "Wq", "Wv"]
    assert [n.op_type for n in out.graph.node] == ["MlsoKernel", "Add", "Relu"]
    (fn,) = out.functions
    assert (fn.domain, fn.name, fn.overload) == ("ai.mlso", "MlsoKernel", node.overload)
    assert [n.op_type for n in fn.node] == ["MatMul", "Softmax", "MatMul"]
    assert {(o.domain, o.version) for o in fn.opset_import} == {("", 18), ("ai.mlso", 1)}
    # the MlsoKernel output carries its dtype and shape (needed when the library is registered)
    (vi,) = [v for v in out.graph.value_info if v.name == "o"]
    assert vi.type.tensor_type.elem_type == TensorProto.FLOAT
    assert [d.dim_value for d in vi.type.tensor_type.shape.dim] == [2, 8, 16]
    assert not {v.name for v in out.graph.value_info} & {"s", "p"}  # internal: moved to the body
    assert np.array_equal(run_cpu(out, {"x": X})[0], run_cpu(model, {"x": X})[0])


def test_two_regions_use_overloads_and_ort_runs_both_bodies():
    model = attention_mlp()
    out = package_model(model, two_regions(model), META)
    onnx.checker.check_model(out, full_check=True)
    nodes = mlso_nodes(out)
    assert len(nodes) == 2 and len(out.graph.node) == 2
    assert [n.overload for n in nodes] == ["r0", "r1"]
    assert sorted(f.overload for f in out.functions) == ["r0", "r1"]
    bodies = {f.overload: [n.op_type for n in f.node] for f in out.functions}
    assert bodies == {"r0": ["MatMul", "Softmax", "MatMul"], "r1": ["Add", "Relu"]}
    assert out.ir_version == 13
    got = run_cpu(out, {"x": X})[0]
    assert np.array_equal(got, run_cpu(model, {"x": X})[0])
    assert not np.array_equal(got, np.zeros_like(got))


def test_input_model_is_not_modified():
    model = attention_mlp()
    before = model.SerializeToString()
    package_model(model, two_regions(model), META)
    assert model.SerializeToString() == before


def test_identical_binaries_are_stored_once():
    model = attention_mlp()
    shared = package_model(model, two_regions(model, same_binary=True), META)
    bins = [t for t in shared.graph.initializer if t.name.startswith("mlso_bin_")]
    assert len(bins) == 1
    assert bins[0].name == "mlso_bin_" + sha(b"binary-A")[:16]
    assert bins[0].data_type == TensorProto.UINT8 and bins[0].raw_data == b"binary-A"
    assert {n.input[0] for n in mlso_nodes(shared)} == {bins[0].name}
    separate = package_model(model, two_regions(model), META)
    assert len([t for t in separate.graph.initializer if t.name.startswith("mlso_bin_")]) == 2


def test_metadata_and_attributes():
    model = attention_mlp()
    out = package_model(model, two_regions(model), META)
    props = {p.key: p.value for p in out.metadata_props}
    assert props[META_EXECUTABLE] == "true"
    assert props[META_SEED] == "7" and props["mlso.targets"] == "sm_80,sm_90a"
    assert props["mlso.verification_bound"] == "2^-40" and props[META_VERSION]
    node = mlso_nodes(out)[0]
    attrs = {a.name: a.s.decode() for a in node.attribute}
    assert set(attrs) == {"plan", "binary_sha256", "ugraph", "source_sha256"}
    assert attrs["binary_sha256"] == sha(b"binary-A")
    assert attrs["plan"] == plan_json(two_regions(model)[0].plan)
    assert json.loads(attrs["ugraph"]) == {"region": "A"}
    with pytest.raises(TypeError):
        package_model(model, two_regions(model), {"mlso.seed": 7})  # type: ignore[dict-item]


def test_plan_json_is_canonical():
    plan = dummy_plan([("float16", [2, 4])], [("float16", [2, 4])])
    shuffled = dict(reversed(list(plan.items())))
    assert plan_json(plan) == plan_json(shuffled)
    assert plan_json(plan).startswith(
        '{"version":1,"targets":["sm_80","sm_90a"],"smem_max":0,"inputs"'
    )


@pytest.mark.parametrize(("ir_in", "ir_out"), [(14, 13), (13, 13), (11, 11), (10, 10), (8, 10)])
def test_ir_version_is_kept_clamped_and_set_explicitly(ir_in, ir_out):
    model = attention_mlp(ir_version=ir_in)
    out = package_model(model, two_regions(model), META)
    assert out.ir_version == ir_out
    assert onnx.load_from_string(out.SerializeToString()).ir_version == ir_out


def test_max_ir_for_ort_table():
    assert max_ir_for_ort("1.31.1") == 13
    assert max_ir_for_ort("1.32.0") == 13
    assert max_ir_for_ort("1.20.0") == 10
    assert max_ir_for_ort("1.17.3") == 9
    assert output_ir_version(14, "1.31.1") == 13
    assert output_ir_version(7, "1.31.1") == 10


def test_constant_nodes_inside_a_region_move_into_the_body():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])
    nodes = [
        helper.make_node(
            "Constant", [], ["two"], value=numpy_helper.from_array(np.array(2.0, np.float32))
        ),
        helper.make_node("Mul", ["x", "two"], ["y"]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)]
    )
    plan = dummy_plan([("float32", [4, 64])], [("float32", [4, 64])])
    out = package_model(model, [region([0, 1], ["x"], ["y"], plan)], META)
    onnx.checker.check_model(out, full_check=True)
    assert [n.op_type for n in out.functions[0].node] == ["Constant", "Mul"]
    feed = np.arange(256, dtype=np.float32).reshape(4, 64)
    assert np.array_equal(run_cpu(out, {"x": feed})[0], feed * 2)


def test_regions_in_lists_plan_binary_ugraph_and_body():
    model = attention_mlp()
    out = package_model(model, two_regions(model), META)
    views = regions_in(out)
    assert [v.overload for v in views] == ["r0", "r1"]
    assert views[0].binary == b"binary-A" and views[1].binary == b"binary-B"
    assert views[0].inputs == ("x", "Wq", "Wv") and views[0].outputs == ("o",)
    assert views[0].plan["launches"][0]["kernel"] == "mlso_k0"
    assert json.loads(views[1].ugraph_json) == {"region": "B"}
    assert [n.op_type for n in views[1].function.node] == ["Add", "Relu"]


def test_regions_in_without_verification_describes_a_tampered_model():
    model = attention_mlp()
    out = package_model(model, two_regions(model), META)
    for a in out.graph.node[0].attribute:
        if a.name == "plan":
            a.s = b"{not json"
    with pytest.raises(InputError, match="tampered"):
        regions_in(out)
    views = regions_in(out, verify=False)
    assert views[0].plan is None and views[1].plan is not None


# ---- regions the packager must refuse ---------------------------------------------------------


def _f32(shape):
    return ("float32", shape)


def test_refuses_a_region_reading_an_unlisted_tensor():
    model = attention_mlp()
    bad = region(
        [0, 1, 2],
        ["x", "Wq"],
        ["o"],
        dummy_plan([_f32([2, 8, 16]), _f32([16, 16])], [_f32([2, 8, 16])]),
    )
    with pytest.raises(InputError, match="reads 'Wv' which is not one of the region's inputs"):
        package_model(model, [bad], META)


def test_refuses_unsorted_nodes():
    model = attention_mlp()
    plan = dummy_plan([_f32([2, 8, 16]), _f32([16, 16]), _f32([16, 16])], [_f32([2, 8, 16])])
    with pytest.raises(InputError, match="not topologically sorted"):
        package_model(model, [region([1, 0, 2], ["x", "Wq", "Wv"], ["o"], plan)], META)


def test_refuses_an_internal_tensor_used_outside():
    model = attention_mlp()
    plan = dummy_plan([_f32([2, 8, 16]), _f32([16, 16])], [_f32([2, 8, 16])])
    # nodes 0,1 produce s and p; node 2 (outside) reads p, so p must be an output
    with pytest.raises(InputError, match=r"\['p'\] are used outside"):
        package_model(model, [region([0, 1], ["x", "Wq"], ["s"], plan)], META)


def test_refuses_overlapping_regions_and_bad_plans():
    model = attention_mlp()
    a, b = two_regions(model)
    overlap = region(
        [2, 3, 4],
        ["p", "Wv", "b"],
        ["y"],
        dummy_plan([_f32([2, 8, 16]), _f32([16, 16]), _f32([16])], [_f32([2, 8, 16])]),
    )
    with pytest.raises(InputError, match="also in region r0"):
        package_model(model, [a, overlap], META)
    wrong_count = region(
        [3, 4], ["o", "b"], ["y"], dummy_plan([_f32([2, 8, 16])], [_f32([2, 8, 16])])
    )
    with pytest.raises(InputError, match="lists 1 inputs but the node has 2"):
        package_model(model, [a, wrong_count], META)
    wrong_dtype = region(
        [3, 4],
        ["o", "b"],
        ["y"],
        dummy_plan([("float16", [2, 8, 16]), _f32([16])], [_f32([2, 8, 16])]),
    )
    with pytest.raises(InputError, match="'o' has dtype float32 in the model, float16 in the plan"):
        package_model(model, [a, wrong_dtype], META)
    wrong_shape = region(
        [3, 4], ["o", "b"], ["y"], dummy_plan([_f32([2, 8, 16]), _f32([16])], [_f32([2, 8, 32])])
    )
    with pytest.raises(InputError, match="'y' has shape"):
        package_model(model, [a, wrong_shape], META)


def test_refuses_a_non_convex_region():
    # x -> A -> t1 -> B(outside) -> t2 -> C ; a region {A, C} would need B inside it
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    nodes = [
        helper.make_node("Relu", ["x"], ["t1"], name="A"),
        helper.make_node("Neg", ["t1"], ["t2"], name="B"),
        helper.make_node("Add", ["t1", "t2"], ["y"], name="C"),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)]
    )
    plan = dummy_plan([_f32([4]), _f32([4])], [_f32([4]), _f32([4])])
    bad = region([0, 2], ["x", "t2"], ["t1", "y"], plan)
    with pytest.raises(InputError, match="cycle"):
        package_model(model, [bad], META)


def test_refuses_bad_source_hash_and_ugraph():
    model = attention_mlp()
    a, _ = two_regions(model)
    with pytest.raises(InputError, match="source_sha256"):
        package_model(model, [replace(a, source_sha256="abc")], META)
    with pytest.raises(InputError, match="ugraph_json is not valid JSON"):
        package_model(model, [replace(a, ugraph_json="{")], META)
