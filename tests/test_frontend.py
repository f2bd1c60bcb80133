"""Frontend: loading, shape fixing, folding, partitioning and lifting, on every bundled model."""

from __future__ import annotations

from collections import Counter

import pytest

from mlso_cli.errors import InputError, UsageError
from mlso_cli.frontend.analyse import analyse
from mlso_cli.frontend.load import load_model, parse_input_shapes
from mlso_cli.frontend.partition import PartitionBounds, partition
from tests.helpers import SMALL, TRANSFORMER, attention_model, save

COVERED = {
    "MatMul",
    "Gemm",
    "Softmax",
    "LayerNormalization",
    "RMSNormalization",
    "InstanceNormalization",
    "GroupNormalization",
    "BatchNormalization",
    "Sigmoid",
    "Tanh",
    "Erf",
    "Relu",
    "Gelu",
    "ReduceMean",
    "Sqrt",
    "Reciprocal",
    "Pow",
}


def test_small_models_exist():
    names = {p.stem for p in SMALL}
    for want in (
        "gqa",
        "qknorm_gqa",
        "qknorm_real",
        "rmsnorm_linear",
        "lora",
        "gated_mlp",
        "ntrans",
        "mla",
        "layernorm_linear",
    ):
        assert want in names


@pytest.mark.parametrize("path", SMALL, ids=lambda p: p.stem)
def test_each_benchmark_model_is_exactly_one_region(path):
    loaded = load_model(str(path))
    a = analyse(loaded)
    assert len(a.partition.regions) == 1, a.partition.excluded
    region = a.partition.regions[0]
    compute = [i for i, n in enumerate(loaded.graph.node) if n.op_type != "Constant"]
    assert sorted(region.nodes) == compute  # every non-constant node is inside it
    assert all(e.op_type == "Constant" for e in a.partition.excluded)
    assert len(a.lifted) == 1


def test_transformer_needs_input_shape():
    with pytest.raises(UsageError) as exc:
        load_model(str(TRANSFORMER))
    assert "hidden" in exc.value.one_line() and "--input-shape" in exc.value.one_line()


def test_transformer_partition_covers_every_matmul_softmax_norm_activation():
    loaded = load_model(str(TRANSFORMER), {"hidden": (1, 16, 64)})
    a = analyse(loaded)
    inside = {i for r in a.partition.regions for i in r.nodes}
    nodes = loaded.graph.node
    for i, n in enumerate(nodes):
        if n.op_type in COVERED:
            assert i in inside, f"{n.op_type} {n.name} is outside every region"
    # every excluded node has a reason a user can read, naming its op
    for e in a.partition.excluded:
        assert e.reason and e.reason.split(":")[0] in (e.op_type, "region could not be lifted")
    assert {e.index for e in a.partition.excluded} | inside == set(range(len(nodes)))
    # cut along its residual stream (each branch, and projections apart from the contractions
    # they feed), every region fits the bounds; tighter bounds still split at reported points
    causes = {c.cause for c in a.partition.cuts}
    assert {"residual", "projection"} <= causes and not a.partition.splits
    tight = partition(loaded, PartitionBounds(max_ops=8))
    assert tight.splits and all("split before" in s for s in tight.splits)
    for r in a.partition.regions:
        mm = sum(1 for i in r.nodes if nodes[i].op_type in ("MatMul", "Gemm"))
        assert mm <= PartitionBounds().max_contractions
    counts = Counter(n.op_type for n in nodes)
    assert counts["MatMul"] == 18 and counts["Softmax"] == 2


def test_regions_are_convex():
    """No path may leave a region and come back: the fused node would depend on itself."""
    loaded = load_model(str(TRANSFORMER), {"hidden": (1, 16, 64)})
    part = partition(loaded, PartitionBounds(max_ops=8, max_contractions=1))
    nodes = list(loaded.graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output}
    for r in part.regions:
        members = set(r.nodes)
        # nodes reachable from the region through at least one outside node must not be in it
        frontier = [
            j
            for j, n in enumerate(nodes)
            if j not in members and any(producer.get(x) in members for x in n.input)
        ]
        seen = set()
        while frontier:
            j = frontier.pop()
            if j in seen:
                continue
            seen.add(j)
            assert j not in members
            frontier.extend(
                k for k, n in enumerate(nodes) if any(producer.get(x) == j for x in n.input)
            )


def test_unknown_op_is_reported_not_failed(tmp_path):
    loaded = load_model(str(save(attention_model(extra_unknown=True), tmp_path / "m.onnx")))
    part = analyse(loaded).partition
    reasons = {e.op_type: e.reason for e in part.excluded}
    assert "FancyOp" in reasons and "com.example" in reasons["FancyOp"]
    assert len(part.regions) == 1  # the attention before it
    assert "shape of 'f' is unknown" in reasons["Relu"]  # after it, shapes are unknown


def test_dynamic_dims_need_flag(tmp_path):
    path = str(save(attention_model(dynamic=True), tmp_path / "d.onnx"))
    with pytest.raises(UsageError, match="Q"):
        load_model(path)
    loaded = load_model(path, parse_input_shapes(["Q=2,16,8", "K=2,8,32", "V=2,32,8"]))
    assert loaded.shapes["o"] == (2, 16, 8)


def test_bad_input_shape_flags(tmp_path):
    path = str(save(attention_model(dynamic=True), tmp_path / "d.onnx"))
    with pytest.raises(UsageError, match="not a graph input"):
        load_model(path, parse_input_shapes(["nope=1,2"]))
    with pytest.raises(UsageError, match="rank"):
        load_model(path, parse_input_shapes(["Q=2,16"]))
    for bad in ("Q", "Q=a,b", "Q=0,1,2"):
        with pytest.raises(UsageError):
            parse_input_shapes([bad])


@pytest.mark.parametrize(
    "content", [b"", b"\x00\x01garbage" * 50, None], ids=["empty", "random", "truncated"]
)
def test_bad_files(tmp_path, content):
    if content is None:
        good = tmp_path / "good.onnx"
        save(attention_model(), good)
        content = good.read_bytes()[: len(good.read_bytes()) // 2]
    p = tmp_path / "bad.onnx"
    p.write_bytes(content)
    with pytest.raises(InputError):
        load_model(str(p))


def test_missing_file():
    with pytest.raises(InputError, match="no such file"):
        load_model("/nonexistent/model.onnx")


def test_external_data_model(tmp_path):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "W")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"]), helper.make_node("Relu", ["Y"], ["Z"])],
        "ext",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [4, 64])],
        [helper.make_tensor_value_info("Z", TensorProto.FLOAT, [4, 64])],
        [w],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    path = tmp_path / "ext.onnx"
    onnx.save(
        m,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="ext.data",
        size_threshold=0,
    )
    loaded = load_model(str(path))
    assert len(analyse(loaded).partition.regions) == 1
    (tmp_path / "ext.data").unlink()
    with pytest.raises(InputError, match="external data"):
        load_model(str(path))


def test_full_size_fp16_benchmark_models_are_one_region_each(tmp_path):
    """The benchmark models of docs/benchmarks.md at their real shapes (built in memory, not committed)."""
    import onnx

    from models.build_models import SPECS

    for name, spec in SPECS.items():
        for bs in spec.batch_sizes:
            path = tmp_path / f"{name}_bs{bs}.onnx"
            onnx.save(spec.build(bs, "float16", small=False), str(path))
            loaded = load_model(str(path))
            a = analyse(loaded)
            assert len(a.partition.regions) == 1 and len(a.lifted) == 1, (name, bs)
            region = a.partition.regions[0]
            assert sorted(region.nodes) == [
                i for i, n in enumerate(loaded.graph.node) if n.op_type != "Constant"
            ]
