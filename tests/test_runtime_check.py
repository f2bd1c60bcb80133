"""check.py refuses tampered MlsoKernel nodes with the node and the field in the message."""

from __future__ import annotations

import json

import onnx
import pytest

from mlso_cli.errors import InputError
from mlso_cli.package import package_model, standard_metadata
from mlso_cli.runtime import check_model
from mlso_cli.runtime.plan import plan_json
from tests.test_package_support import attention_mlp, sha, two_regions

META = standard_metadata(targets=["sm_90a"], seed=0, verification_bound="1e-3")


@pytest.fixture
def model() -> onnx.ModelProto:
    m = attention_mlp()
    return package_model(m, two_regions(m), META)


def set_attr(node: onnx.NodeProto, name: str, value: str) -> None:
    for a in node.attribute:
        if a.name == name:
            a.s = value.encode()
            return
    raise KeyError(name)


def get_plan(node: onnx.NodeProto) -> dict:
    return json.loads(next(a.s for a in node.attribute if a.name == "plan"))


def test_a_packaged_model_passes(model):
    nodes = check_model(model)
    assert [n.name for n in nodes] == ["mlso_region_0", "mlso_region_1"]
    assert nodes[0].binary == b"binary-A" and nodes[0].binary_sha256 == sha(b"binary-A")
    assert nodes[0].node is model.graph.node[nodes[0].node_index]
    assert nodes[1].plan["inputs"][1] == {"dtype": "float32", "shape": [16]}


def refused(model, *patterns: str) -> str:
    with pytest.raises(InputError) as info:
        check_model(model)
    text = info.value.one_line()
    for p in ("MlsoKernel node 'mlso_region_0'", "tampered", "Re-run `mlso optimize`", *patterns):
        assert p in text, text
    return text


def test_plan_that_is_not_json(model):
    set_attr(model.graph.node[0], "plan", '{"version": 1,')
    refused(model, "attribute 'plan' is not valid JSON")


def test_plan_with_the_wrong_input_count(model):
    plan = get_plan(model.graph.node[0])
    plan["inputs"].pop()
    set_attr(model.graph.node[0], "plan", plan_json(plan))
    refused(model, "attribute 'plan' lists 2 inputs but the node has 3 tensor inputs")


def test_plan_with_an_out_of_range_arg(model):
    plan = get_plan(model.graph.node[0])
    plan["launches"][0]["args"][0] = {"kind": "input", "index": 3}
    set_attr(model.graph.node[0], "plan", plan_json(plan))
    refused(model, "launches[0].args[0].index must be an integer in [0, 3) for kind input")


def test_plan_with_a_scratch_arg_but_no_scratch(model):
    plan = get_plan(model.graph.node[0])
    plan["launches"][0]["args"].append({"kind": "scratch", "index": 0})
    set_attr(model.graph.node[0], "plan", plan_json(plan))
    refused(model, "for kind scratch")


def test_binary_whose_hash_does_not_match(model):
    binary = next(t for t in model.graph.initializer if t.name == model.graph.node[0].input[0])
    binary.raw_data = b"binary-X"  # same length, other bytes
    refused(model, "does not match attribute binary_sha256", sha(b"binary-X")[:16])


def test_recorded_hash_changed(model):
    set_attr(model.graph.node[0], "binary_sha256", sha(b"something else"))
    refused(model, "does not match attribute binary_sha256")


def test_missing_attribute_and_missing_binary(model):
    node = model.graph.node[0]
    kept = [a for a in node.attribute if a.name != "source_sha256"]
    del node.attribute[:]
    node.attribute.extend(kept)
    refused(model, "attribute 'source_sha256' is missing")


def test_binary_not_an_initializer(model):
    model.graph.node[0].input[0] = "x"
    refused(model, "is not an initializer")


def test_ugraph_that_is_not_json(model):
    set_attr(model.graph.node[0], "ugraph", "<graph>")
    refused(model, "attribute 'ugraph' is not valid JSON")


def test_plan_output_dtype_must_equal_the_declared_type(model):
    plan = get_plan(model.graph.node[0])
    plan["outputs"][0]["dtype"] = "float64"
    set_attr(model.graph.node[0], "plan", plan_json(plan))
    refused(model, "outputs[0] is float64", "but the node declares float32")


def test_plan_output_shape_must_equal_the_declared_shape(model):
    plan = get_plan(model.graph.node[0])
    plan["outputs"][0]["shape"] = [1]
    set_attr(model.graph.node[0], "plan", plan_json(plan))
    refused(model, "outputs[0] is float32 [1] in the plan, but the node declares float32 [")


def test_an_output_without_a_declared_type_is_refused(model):
    out = model.graph.node[0].output[0]
    kept = [v for v in model.graph.value_info if v.name != out]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)
    assert out not in {o.name for o in model.graph.output}
    refused(model, f"output '{out}' has no declared type")


def test_kernels_inside_subgraphs_are_found_and_checked(model):
    from onnx import TensorProto, helper

    inner = onnx.GraphProto()
    inner.CopyFrom(model.graph)
    inner.name = "then_body"
    del inner.input[:]
    cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
    wrapper = onnx.ModelProto()
    wrapper.CopyFrom(model)
    g = wrapper.graph
    del g.node[:], g.initializer[:], g.value_info[:]
    g.input.append(cond)
    else_body = onnx.GraphProto()
    else_body.CopyFrom(inner)
    g.node.append(
        helper.make_node(
            "If", ["cond"], [o.name for o in g.output], then_branch=inner, else_branch=else_body
        )
    )
    then = next(a.g for a in g.node[0].attribute if a.name == "then_branch")
    g.initializer.extend(then.initializer)  # the binaries come from the outer scope
    del then.initializer[:]
    assert check_model(wrapper) == []  # the main graph holds none
    nodes = check_model(wrapper, subgraphs=True)
    assert len(nodes) == 4 and {n.graph_path.split(" ")[-1] for n in nodes} == {
        "then_branch",
        "else_branch",
    }
    plan = get_plan(nodes[0].node)
    plan["launches"][0]["grid"] = [2**31, 1, 1]
    set_attr(then.node[0], "plan", plan_json(plan))
    with pytest.raises(InputError, match=r"of If '0' then_branch\).*grid\[0\]"):
        check_model(wrapper, subgraphs=True)
