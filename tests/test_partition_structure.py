"""Regions follow the model's structure: the residual stream, its branches, and the contraction
boundaries inside a branch (frontend/partition.py, docs/architecture.md "partition").

Why: cutting a decoder by op counts in topological order gave regions that crossed layer lines
(the attention tail, o_proj, the residual add, the next norm and gate/up in one region) and
regions of one Neg; no fused program exists for those. Layer membership below comes from the
exporter's node metadata (the `namespace` torch writes) and is used by the tests only: the
partitioner never reads names, labels or metadata.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mlso_cli.frontend import partition as partition_mod
from mlso_cli.frontend import support
from mlso_cli.frontend.analyse import analyse
from mlso_cli.frontend.load import load_model
from mlso_cli.frontend.partition import ALONE_WORTH_A_REGION, Partition, partition
from mlso_cli.frontend.support import OpKind
from mlso_cli.ir.hashing import graph_hash
from tests.helpers import ROOT, SMALL, TRANSFORMER, run_cli, save

ZOO = sorted((ROOT / "models" / "zoo_small").glob("*_tiny_fp32.onnx"))
ZOO_SHAPE = {"input_ids": (1, 128)}
STRUCTURE_CAUSES = {"residual", "projection", "side_input", "branch"}
_LAYER = re.compile(r"\.(?:layers|h)\.(\d+):")


def _layer(node: onnx.NodeProto) -> int | None:
    """The decoder layer a node was exported from (test-side knowledge only)."""
    ns = " ".join(p.value for p in node.metadata_props if p.key == "namespace")
    m = _LAYER.search(ns)
    return int(m.group(1)) if m else None


def _compute_ops(nodes, region) -> list[str]:
    return [
        nodes[i].op_type
        for i in region.nodes
        if support.SUPPORT[nodes[i].op_type][0] is not OpKind.LAYOUT
    ]


def _assert_convex(nodes: list[onnx.NodeProto], part: Partition) -> None:
    consumers: dict[int, list[int]] = defaultdict(list)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    for i, n in enumerate(nodes):
        for x in n.input:
            if x in producer:
                consumers[producer[x]].append(i)
    for r in part.regions:
        members = set(r.nodes)
        frontier = [c for i in members for c in consumers[i] if c not in members]
        seen: set[int] = set()
        while frontier:
            j = frontier.pop()
            if j in seen:
                continue
            seen.add(j)
            assert j not in members, f"region {r.id} is not convex at node {j}"
            frontier.extend(consumers[j])


def _assert_no_cheap_single_op(nodes, part: Partition) -> None:
    for r in part.regions:
        ops = _compute_ops(nodes, r)
        assert len(ops) > 1 or (
            support.SUPPORT[ops[0]][0] is OpKind.CONTRACTION or ops[0] in ALONE_WORTH_A_REGION
        ), (r.id, r.ops)


# ---- the four decoders in models/zoo_small ------------------------------------------------------


@pytest.mark.parametrize("path", ZOO, ids=lambda p: p.name.split("_tiny")[0])
def test_zoo_regions_follow_the_layers(path: Path):
    loaded = load_model(str(path), ZOO_SHAPE)
    nodes = list(loaded.graph.node)
    a = analyse(loaded)
    part = a.partition
    layers = sorted({_layer(n) for n in nodes} - {None})
    assert len(layers) >= 2, "the test needs a model of several layers"

    per_layer: dict[int | None, list] = defaultdict(list)
    for lr in a.lifted:
        found = {_layer(nodes[i]) for i in lr.region.nodes} - {None}
        assert len(found) <= 1, f"region {lr.region.id} {lr.region.ops} spans layers {found}"
        per_layer[found.pop() if found else None].append(lr)

    # Every layer yields the same regions, structurally equal (so the search meets each once).
    shapes = {k: sorted(graph_hash(lr.graph) for lr in per_layer[k]) for k in layers}
    assert all(shapes[k] == shapes[layers[0]] for k in layers), {
        k: len(v) for k, v in shapes.items()
    }
    assert len(shapes[layers[0]]) >= 4
    for k in layers:
        # the attention core carries its softmax, both attention contractions and the views
        # that re-lay P·V out for o_proj; o_proj starts the next region (a fused core saves
        # P·V through those views, and the projection's library GEMM reads a plain matrix)
        attn = [lr.region for lr in per_layer[k] if "Softmax" in lr.region.ops]
        assert len(attn) == 1
        mm = [op for op in attn[0].ops if support.SUPPORT[op][0] is OpKind.CONTRACTION]
        assert len(mm) == 2, attn[0].ops
        last_mm = max(i for i in attn[0].nodes if nodes[i].op_type in ("MatMul", "Gemm"))
        tail = [nodes[i].op_type for i in attn[0].nodes if i > last_mm]
        assert tail and set(tail) <= {"Transpose", "Reshape"}, attn[0].ops
        # the projection that reads the norm is not in the attention core's region
        assert not any(op in attn[0].ops for op in ("LayerNormalization", "ReduceMean")) or (
            # Gemma normalises o_proj's output inside the branch before the residual add
            attn[0].ops.index("Softmax")
            < min(
                attn[0].ops.index(op)
                for op in ("LayerNormalization", "ReduceMean")
                if op in attn[0].ops
            )
        )
    # final norm + lm_head: one region outside every layer
    tail = [lr.region for lr in per_layer[None]]
    assert len(tail) == 1 and any(op in ("MatMul", "Gemm") for op in tail[0].ops)

    _assert_convex(nodes, part)
    _assert_no_cheap_single_op(nodes, part)
    causes = Counter(c.cause for c in part.cuts)
    assert causes["residual"] and causes["projection"]
    assert any("contraction of two computed values" in c.reason for c in part.cuts)


def _region_ops(rows: list[dict]) -> set[str]:
    return {op for x in rows if x["type"] == "region" for op in x["ops"]}


def test_inspect_json_names_the_structure_cuts():
    path = ROOT / "models" / "zoo_small" / "llama_tiny_fp32.onnx"
    r = run_cli("-q", "inspect", str(path), "--input-shape", "input_ids=1,128", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    nodes = list(onnx.load(str(path), load_external_data=False).graph.node)
    splits = [x for x in rows if x["type"] == "split"]
    by_cause = defaultdict(list)
    for s in splits:
        by_cause[s["cause"]].append(s)
    # the causal mask and the RoPE tables fold at a fixed shape, so nothing joins the stream from
    # the side here: the cuts are the residual stream and the projections
    assert {"residual", "projection"} <= set(by_cause)
    for s in by_cause["residual"]:
        assert s["reason"].startswith("cut at the residual stream: ")
        assert s["before"]["op_type"] == "Add" and nodes[s["before"]["index"]].op_type == "Add"
        assert s["region_before"] != s["region_after"]
        assert s["limit"] is None and s["count"] is None
    for s in by_cause["projection"]:
        assert s["reason"].startswith("cut at a contraction boundary: ")
        assert s["region_before"] != s["region_after"]
    for s in by_cause["side_input"]:
        assert s["reason"].startswith("cut beside the residual stream: ")
    # every op that does not fold is in a region, except the embedding lookup
    unfused = {
        x["op_type"]
        for x in rows
        if x["type"] == "left_out" and x["category"] not in ("removed", "folded", "constant")
    }
    assert unfused == {"Gather"}, unfused
    assert {"Neg", "Slice", "Concat"} <= _region_ops(rows)  # rotate_half is inside a region
    # no region is one cheap op
    for x in rows:
        if x["type"] == "region":
            assert sum(x["ops"].values()) > 1, x["ops"]


def test_rope_joins_the_projection_region_once_slice_and_concat_are_supported(monkeypatch):
    """When Slice/Concat become ordinary supported ops, RoPE lands with the QKV projections and
    each layer is norm->QKV->RoPE | attention core | o_proj + residual | norm->gate/up | down
    (+ the final region)."""
    for op in ("Slice", "Concat", "Split"):
        monkeypatch.setitem(support.SUPPORT, op, (OpKind.LAYOUT, support._always))
    for op in ("Cos", "Sin"):
        monkeypatch.setitem(support.SUPPORT, op, (OpKind.COMPUTE, support._always))
    path = ROOT / "models" / "zoo_small" / "llama_tiny_fp32.onnx"
    loaded = load_model(str(path), ZOO_SHAPE)
    nodes = list(loaded.graph.node)
    part = partition(loaded)
    region_of = {i: r for r in part.regions for i in r.nodes}
    negs = [i for i, n in enumerate(nodes) if n.op_type == "Neg"]
    assert negs
    for i in negs:
        r = region_of[i]  # rotate-half lands in a region ...
        # ... with the projections that read the normalised stream, not with QK^T
        assert r.ops.count("MatMul") == 3 and "Softmax" not in r.ops and "ReduceMean" in r.ops
    counts = Counter(_layer(nodes[r.nodes[-1]]) for r in part.regions)
    layers = sorted(k for k in counts if k is not None)
    assert [counts[k] for k in layers] == [5] * len(layers) and counts[None] == 1
    _assert_convex(nodes, part)
    _assert_no_cheap_single_op(nodes, part)


# ---- the rule on hand-built graphs ---------------------------------------------------------


def _block(nodes, inits, x: str, k: int, pre_norm: bool) -> str:
    """x + W2 relu(W1 norm(x)) (pre-norm) or norm(x + W2 relu(W1 x)) (post-norm)."""
    rng = np.random.default_rng(k)
    for name, shape in ((f"w1_{k}", (16, 32)), (f"w2_{k}", (32, 16))):
        inits.append(numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name))
    h = x
    if pre_norm:
        nodes.append(helper.make_node("LayerNormalization", [x, "g", "b"], [f"n{k}"], axis=-1))
        h = f"n{k}"
    nodes += [
        helper.make_node("MatMul", [h, f"w1_{k}"], [f"u{k}"]),
        helper.make_node("Relu", [f"u{k}"], [f"r{k}"]),
        helper.make_node("MatMul", [f"r{k}", f"w2_{k}"], [f"d{k}"]),
        helper.make_node("Add", [x, f"d{k}"], [f"s{k}"]),
    ]
    if pre_norm:
        return f"s{k}"
    nodes.append(helper.make_node("LayerNormalization", [f"s{k}", "g", "b"], [f"p{k}"], axis=-1))
    return f"p{k}"


def _stack(tmp_path: Path, pre_norm: bool, layers: int = 2) -> onnx.ModelProto:
    nodes: list[onnx.NodeProto] = []
    inits = [
        numpy_helper.from_array(np.ones(16, np.float32), "g"),
        numpy_helper.from_array(np.zeros(16, np.float32), "b"),
    ]
    x = "x"
    for k in range(layers):
        x = _block(nodes, inits, x, k, pre_norm)
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    g = helper.make_graph(
        nodes,
        "stack",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 16])],
        initializer=inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    return load_model(str(save(m, tmp_path / "m.onnx")))


def test_pre_norm_stack_is_cut_per_branch_and_at_the_down_projection(tmp_path):
    loaded = _stack(tmp_path, pre_norm=True)
    nodes = list(loaded.graph.node)
    part = partition(loaded)
    got = [tuple(nodes[i].op_type for i in r.nodes) for r in part.regions]
    up = ("LayerNormalization", "MatMul", "Relu")
    down = ("MatMul", "Add")
    assert got == [up, down, up, down]
    causes = Counter(c.cause for c in part.cuts)
    # stream: s0 -> next norm, s0 -> next residual add, s1 -> the Identity after the stack
    # (left out: layout only); projection: relu -> W2, once per layer
    assert causes == {"residual": 3, "projection": 2}
    for c in part.cuts:
        if c.cause == "residual":
            assert nodes[c.before].op_type == "Add"
        else:
            assert (nodes[c.before].op_type, nodes[c.after].op_type) == ("Relu", "MatMul")


def test_post_norm_stack_has_no_residual_stream_and_partitions_as_before(tmp_path, monkeypatch):
    """Without a normalisation opening each branch there is no stream: the plain partition."""
    loaded = _stack(tmp_path, pre_norm=False)
    part = partition(loaded)
    assert not {c.cause for c in part.cuts} & STRUCTURE_CAUSES
    monkeypatch.setattr(partition_mod, "_find_structure", lambda *a, **k: None)
    plain = partition(loaded)
    assert [r.nodes for r in part.regions] == [r.nodes for r in plain.regions]


@pytest.mark.parametrize("path", SMALL, ids=lambda p: p.stem)
def test_seed_benchmarks_partition_as_before(path: Path, monkeypatch):
    loaded = load_model(str(path))
    part = partition(loaded)
    assert not {c.cause for c in part.cuts} & STRUCTURE_CAUSES
    monkeypatch.setattr(partition_mod, "_find_structure", lambda *a, **k: None)
    plain = partition(loaded)
    assert [r.nodes for r in part.regions] == [r.nodes for r in plain.regions]
    assert part.excluded == plain.excluded and part.cuts == plain.cuts


def test_transformer_tiny_is_two_equal_layers():
    loaded = load_model(str(TRANSFORMER), {"hidden": (1, 16, 64)})
    a = analyse(loaded)
    hashes = Counter(graph_hash(lr.graph) for lr in a.lifted)
    # each structural region of layer 0 has its twin in layer 1; only the final norm is alone
    assert sorted(hashes.values()).count(2) >= 4 and list(hashes.values()).count(1) == 1


def test_a_lone_elementwise_op_is_left_out(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])
    nodes = [
        helper.make_node("Neg", ["x"], ["n"], name="neg"),
        helper.make_node("Reshape", ["n", "shape"], ["r"], name="view"),
        helper.make_node("Softmax", ["r"], ["y"], name="softmax", axis=-1),
    ]
    shape = numpy_helper.from_array(np.array([4, 8], np.int64), "shape")
    g = helper.make_graph(nodes, "g", [x], [y], initializer=[shape])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    loaded = load_model(str(save(m, tmp_path / "m.onnx")))
    part = partition(loaded)
    assert [r.ops for r in part.regions] == [("Neg", "Reshape", "Softmax")]  # fused together
    # alone, Neg is left out; Softmax (a row reduction) is still worth a region
    for op, kept in (("Neg", False), ("Softmax", True)):
        nodes = [
            helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1),
            helper.make_node(op, ["v"], ["y"], name="lone"),
        ]
        k = numpy_helper.from_array(np.array([8], np.int64), "k")
        g = helper.make_graph(nodes, "g", [x], [y], initializer=[k])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
        loaded = load_model(str(save(m, tmp_path / f"{op}.onnx")))
        part = partition(loaded)
        assert bool(part.regions) is kept
        if not kept:
            e = next(e for e in part.excluded if e.op_type == op)
            assert e.category == "single_op"
            assert e.reason == f"{op}: one elementwise op: nothing to fuse"
