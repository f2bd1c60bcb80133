"""`mlso inspect` on models that carry MlsoKernel nodes: always says so, checks every node's
plan and binary hash (subgraphs included) and exits 1 when one is bad.

Why: inspect is what a user runs on a model they were handed. It must never show a tampered
model as clean, and kernels hidden in an If branch run as readily as those of the main graph.
"""

from __future__ import annotations

import json

import onnx
import pytest
from onnx import TensorProto, helper

from mlso_cli.package import package_model, standard_metadata
from mlso_cli.runtime.plan import plan_json
from tests.helpers import run_cli, save
from tests.test_package_support import attention_mlp, two_regions

META = standard_metadata(targets=["sm_90a"], seed=0, verification_bound="1e-3")


@pytest.fixture
def packaged() -> onnx.ModelProto:
    m = attention_mlp(ir_version=10)
    return package_model(m, two_regions(m), META)


def _edit_plan(node: onnx.NodeProto, **launch0) -> None:
    attr = next(a for a in node.attribute if a.name == "plan")
    plan = json.loads(attr.s)
    plan["launches"][0].update(launch0)
    attr.s = plan_json(plan).encode()


def _in_if_branch(model: onnx.ModelProto) -> onnx.ModelProto:
    """The packaged graph moved into both branches of an If; binaries stay in the outer graph."""
    body = onnx.GraphProto()
    body.CopyFrom(model.graph)
    del body.input[:], body.initializer[:]
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    del g.node[:], g.value_info[:]
    g.input.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    g.node.append(
        helper.make_node(
            "If",
            ["cond"],
            [o.name for o in g.output],
            name="gate",
            then_branch=body,
            else_branch=body,
        )
    )
    return out


def test_a_good_packaged_model_is_flagged_as_code_and_passes(packaged, tmp_path):
    r = run_cli("inspect", str(save(packaged, tmp_path / "m.onnx")), "--json")
    assert r.returncode == 0, r.stderr
    err = r.stderr.decode()
    assert "carries executable GPU code: 2 mlso kernel node(s)" in err
    rows = [json.loads(s) for s in r.stdout.decode().splitlines()]
    kernels = [x for x in rows if x["type"] == "mlso_kernel"]
    assert [k["node"] for k in kernels] == ["mlso_region_0", "mlso_region_1"]
    assert all(
        k["valid"] and k["executable_code"] and len(k["binary_sha256"]) == 64 for k in kernels
    )


def test_a_bad_plan_or_hash_is_reported_and_exits_1(packaged, tmp_path):
    _edit_plan(packaged.graph.node[0], grid=[2**31, 1, 1])
    binary = next(
        t for t in packaged.graph.initializer if t.name == packaged.graph.node[1].input[0]
    )
    binary.raw_data = b"binary-X"
    r = run_cli("inspect", str(save(packaged, tmp_path / "m.onnx")), "--json")
    assert r.returncode == 1
    err = r.stderr.decode()
    assert "carries executable GPU code" in err
    assert (
        "mlso_region_0" in err
        and "launches[0].grid[0] must be an integer in [1, 2147483647]" in err
    )
    assert "does not match attribute binary_sha256" in err
    assert "2 of 2 MlsoKernel node(s)" in err and "failed their plan or hash check" in err
    kernels = [json.loads(s) for s in r.stdout.decode().splitlines()]
    assert [k["valid"] for k in kernels if k["type"] == "mlso_kernel"] == [False, False]


def test_kernels_inside_if_branches_are_found_and_checked(packaged, tmp_path):
    model = _in_if_branch(packaged)
    path = save(model, tmp_path / "if.onnx")
    r = run_cli("inspect", str(path), "--json")
    err = r.stderr.decode()
    assert "4 mlso kernel node(s) (ai.mlso::MlsoKernel), 4 of them inside subgraphs" in err
    kernels = [json.loads(s) for s in r.stdout.decode().splitlines() if '"mlso_kernel"' in s]
    assert {k["graph"] for k in kernels} == {"If 'gate' then_branch", "If 'gate' else_branch"}
    assert r.returncode == 0, err

    then = next(a.g for a in model.graph.node[0].attribute if a.name == "then_branch")
    _edit_plan(then.node[0], smem=300_000)
    r = run_cli("inspect", str(save(model, tmp_path / "if_bad.onnx")))
    err = r.stderr.decode()
    assert r.returncode == 1 and "carries executable GPU code" in err
    assert "(node 0 of If 'gate' then_branch)" in err and "launches[0].smem must be" in err
