"""`mlso inspect --json` is complete: one row per region, per cut between regions, per node left
out (with its reason), and per MlsoKernel node, each with a "type".

Why: a tool reading the JSON must be able to tell, for every node of the file it handed mlso,
whether it is fused and, if not, why; and why two neighbouring regions are not one. The account is
against the model *file*, so nodes the loader folded into constants or dropped are rows too.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from mlso_cli.cli import main
from mlso_cli.package import package_model, standard_metadata
from models import build_models
from tests.helpers import SMALL, TRANSFORMER, TRANSFORMER_SHAPE, attention_model, run_cli, save
from tests.test_package_support import attention_mlp, two_regions

REGION_KEYS = {
    "region",
    "label",
    "ops",
    "inputs",
    "outputs",
    "dtype",
    "flops",
    "dram_bytes_unfused",
    "dram_bytes_fused_min",
}
CATEGORIES = {
    "constant",
    "unsupported",
    "layout_only",
    "single_op",
    "not_lifted",
    "folded",
    "removed",
}
BOUNDS = {"max_ops", "max_contractions"}
STRUCTURE = {"residual", "projection", "side_input", "branch"}


def _inspect(*args: str, stdin: bytes | None = None) -> list[dict]:
    res = CliRunner().invoke(main, ["-q", "inspect", *args, "--json"], input=stdin)
    assert res.exit_code == 0, (res.stderr, res.exception)
    return [json.loads(line) for line in res.stdout.splitlines()]


def _assert_accounted(rows: list[dict], path: Path) -> None:
    """Every node of the file's main graph is in exactly one region or one left_out row."""
    nodes = list(onnx.load(str(path), load_external_data=False).graph.node)
    assert all(r["type"] in {"region", "split", "left_out", "mlso_kernel"} for r in rows)
    seen: list[int] = []
    for r in rows:
        if r["type"] == "region":
            assert set(r) >= REGION_KEYS
            assert len(r["nodes"]) == len(r["node_indices"]) > 0
            pairs = list(zip(r["node_indices"], r["nodes"]))
            seen.extend(r["node_indices"])
        elif r["type"] == "left_out":
            assert r["reason"] and r["category"] in CATEGORIES, r
            assert r["reason"].startswith(r["op_type"] + ":") or r["category"] == "not_lifted", r
            pairs = [(r["index"], r["node"])]
            seen.append(r["index"])
            assert nodes[r["index"]].op_type == r["op_type"]
        else:
            continue
        for i, name in pairs:
            assert name == (nodes[i].name or f"#{i}")
    assert sorted(seen) == list(range(len(nodes))), "a node is missing or counted twice"


def _assert_splits_name_both_sides(rows: list[dict], path: Path) -> None:
    nodes = list(onnx.load(str(path), load_external_data=False).graph.node)
    for s in (r for r in rows if r["type"] == "split"):
        assert s["cause"] in BOUNDS | STRUCTURE | {"convexity"} and s["reason"]
        for side in ("before", "after"):
            ref = s[side]
            assert nodes[ref["index"]].op_type == ref["op_type"]
            assert ref["node"] == (nodes[ref["index"]].name or f"#{ref['index']}")
        assert s["before"]["index"] < s["after"]["index"]  # topological order of the file
        if s["cause"] in BOUNDS:
            assert s["count"] > s["limit"]
            assert f"split before {s['after']['op_type']} '{s['after']['node']}'" in s["reason"]


def test_transformer_every_node_once_with_folded_nodes_and_splits():
    rows = _inspect(str(TRANSFORMER), *TRANSFORMER_SHAPE)
    _assert_accounted(rows, TRANSFORMER)
    _assert_splits_name_both_sides(rows, TRANSFORMER)
    left = [r for r in rows if r["type"] == "left_out"]
    cats = {r["category"] for r in left}
    # The export computes view shapes at run time: fixing the input shape folds them away.
    assert {"folded", "removed"} <= cats
    assert any(r["op_type"] == "Shape" and r["category"] == "removed" for r in left)
    # rotate_half's Slice/Neg/Concat lift as block selections: RoPE is inside the regions
    assert not any(
        r["op_type"] in ("Slice", "Concat") and r["category"] == "unsupported" for r in left
    )
    assert sum(r["ops"].get("Slice", 0) for r in rows if r["type"] == "region") >= 4
    splits = [r for r in rows if r["type"] == "split"]
    by_cause = {s["cause"] for s in splits}
    # Two pre-norm layers: cut along the residual stream and between each projection and the
    # contraction it feeds; RoPE (cos/sin folded, rotate_half lifted) is inside the regions, so
    # no path leaves a group and comes back, and every region fits the bounds.
    assert by_cause <= {"residual", "projection", "side_input"} and "residual" in by_cause
    for s in splits:
        if s["cause"] in STRUCTURE:
            assert s["limit"] is None and s["count"] is None
            assert s["region_before"] is not None and s["region_after"] is not None
            assert s["region_before"] != s["region_after"]
        if s["cause"] == "residual":  # the residual add writes the stream, the next branch reads
            assert s["before"]["op_type"] == "Add"


def test_tighter_bounds_report_op_splits():
    rows = _inspect(str(TRANSFORMER), *TRANSFORMER_SHAPE, "--max-ops", "8")
    _assert_accounted(rows, TRANSFORMER)
    _assert_splits_name_both_sides(rows, TRANSFORMER)
    ops = [r for r in rows if r["type"] == "split" and r["cause"] == "max_ops"]
    assert ops and all((r["limit"], r["count"]) == (8, 9) for r in ops)
    regions = {r["region"]: r for r in rows if r["type"] == "region"}
    for s in ops:  # the nodes on either side are in the regions the row names
        if s["region_before"] is not None:
            assert s["before"]["index"] in regions[s["region_before"]]["node_indices"]
        if s["region_after"] is not None:
            assert s["after"]["index"] in regions[s["region_after"]]["node_indices"]


@pytest.mark.parametrize("path", SMALL, ids=lambda p: p.stem)
def test_small_models_every_node_once(path):
    rows = _inspect(str(path))
    _assert_accounted(rows, path)
    assert [r["type"] for r in rows].count("region") == 1
    assert all(r["category"] == "constant" for r in rows if r["type"] == "left_out")


def test_benchmark_models_every_node_once(tmp_path):
    """The fp16 benchmark set as `python -m models.build_models` writes it under models/bench."""
    paths = [p for p in build_models.build_all(tmp_path) if p.parent.name == "bench"]
    assert len(paths) >= len(build_models.SPECS)
    for path in paths:
        rows = _inspect(str(path))
        _assert_accounted(rows, path)
        _assert_splits_name_both_sides(rows, path)
        assert any(r["type"] == "region" for r in rows), path


def test_stdin_gives_the_same_rows_as_the_path():
    data = TRANSFORMER.read_bytes()
    assert _inspect("-", *TRANSFORMER_SHAPE, stdin=data) == _inspect(
        str(TRANSFORMER), *TRANSFORMER_SHAPE
    )


def test_layout_only_and_unnamed_nodes(tmp_path):
    """A Transpose between two unsupported ops is fusable but has nothing to fuse with; unnamed
    nodes are named by their index in the file."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 4])
    nodes = [
        helper.make_node("Tanh", ["x"], ["t"], name="tanh"),
        helper.make_node("TopK", ["t", "k"], ["v", "idx"], axis=1),
        helper.make_node("Transpose", ["v"], ["vt"], perm=[1, 0]),
        helper.make_node("Cos", ["vt"], ["y"], name="cos"),
        helper.make_node("Cos", ["x"], ["unused"]),
    ]
    k = helper.make_tensor("k", TensorProto.INT64, [1], [8])
    g = helper.make_graph(nodes, "g", [x], [y], initializer=[k])
    path = save(
        helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "m.onnx"
    )
    rows = _inspect(str(path))
    _assert_accounted(rows, path)
    left = {r["index"]: r for r in rows if r["type"] == "left_out"}
    assert left[0]["category"] == "single_op" and "nothing to fuse" in left[0]["reason"]
    assert left[1]["node"] == "#1" and left[1]["category"] == "unsupported"
    assert "TopK" in left[1]["reason"]
    assert left[2]["node"] == "#2" and left[2]["category"] == "layout_only"
    assert left[3]["node"] == "cos" and "no lifting rule" in left[3]["reason"]
    assert left[4]["category"] == "removed" and left[4]["node"] == "#4"


def test_a_region_that_cannot_be_lifted_is_left_out_with_the_error(monkeypatch):
    import mlso_cli.frontend.analyse as analyse_mod

    def fail_all(loaded, regions, *rest):
        return [], [(r, "no rule for this test") for r in regions]

    monkeypatch.setattr(analyse_mod, "lift_all", fail_all)
    path = next(p for p in SMALL if p.stem == "gqa")
    rows = _inspect(str(path))
    _assert_accounted(rows, path)
    assert not [r for r in rows if r["type"] == "region"]
    lifted = [r for r in rows if r["type"] == "left_out" and r["category"] == "not_lifted"]
    assert lifted and all("no rule for this test" in r["reason"] for r in lifted)


def test_packaged_model_accounts_for_its_kernel_nodes(tmp_path):
    m = attention_mlp(ir_version=10)
    packed = package_model(
        m, two_regions(m), standard_metadata(targets=["sm_90a"], seed=0, verification_bound="0")
    )
    path = save(packed, tmp_path / "p.onnx")
    rows = _inspect(str(path))
    _assert_accounted(rows, path)
    kernels = [r for r in rows if r["type"] == "mlso_kernel"]
    left = [r for r in rows if r["type"] == "left_out" and r["op_type"] == "MlsoKernel"]
    assert (
        {r["node"] for r in kernels}
        == {r["node"] for r in left}
        == {
            "mlso_region_0",
            "mlso_region_1",
        }
    )
    assert all("already an mlso kernel" in r["reason"] for r in left)


def test_cli_subprocess_rows_each_have_a_type():
    r = run_cli("inspect", "-", "--json", stdin=attention_model().SerializeToString())
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    assert rows and all("type" in x for x in rows)
    assert [x["type"] for x in rows].count("region") == 1
