"""Sibling projections lifted as one GEMM over concatenated weights (frontend/siblings.py): the
structural rule, fewer library GEMM launches on a real decoder export, the merged program against
the separate matmuls (host emulator and float64 interpreter), and optimize + verify on a model
whose gate/up projections merge, including a packaged concatenated weight that was tampered with.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mlso_cli.codegen import generate, hostemu
from mlso_cli.codegen.plan import plan as lowering_plan
from mlso_cli.frontend import siblings
from mlso_cli.frontend.analyse import analyse
from mlso_cli.frontend.lift import lift_constants
from mlso_cli.frontend.load import load_model
from mlso_cli.verify import interpreter
from tests.helpers import MODELS, run_cli
from tests.test_package_support import use_cache

LLAMA = MODELS / "zoo_small" / "llama_tiny_fp32.onnx"


@pytest.fixture(autouse=True)
def merge_on(monkeypatch):
    """The merge is off by default (MLSO_MERGE_SIBLINGS); these tests turn it on, in the
    environment so that the CLI runs they start see it too."""
    from mlso_cli import knobs

    monkeypatch.setenv("MLSO_MERGE_SIBLINGS", "1")
    knobs.cache_clear()
    yield
    knobs.cache_clear()


@pytest.fixture(scope="module")
def llama():
    return load_model(str(LLAMA), {"input_ids": (1, 16)})


def _gemms(kg) -> int:
    return sum(k.kind == "gemm" for k in lowering_plan(kg).kernels)


# ---- the rule ------------------------------------------------------------------------------------


def test_the_rule_groups_projections_of_one_input_with_constant_weights(llama):
    g = llama.graph
    weights = siblings.weight_types(llama.model, lift_constants(llama))
    found = siblings.groups(g.node, range(len(g.node)), llama.shapes, weights)
    sizes = sorted({(grp.a, tuple(n for _, _, n in grp.members)) for grp in found.values()})
    # per layer: q, k, v (256, 128, 128: GQA) from the attention norm, gate and up (384 each)
    assert [s for _, s in sizes] == [(256, 128, 128), (384, 384)] * 2
    assert len({a for a, _ in sizes}) == 4


def test_the_merge_is_off_by_default(llama, monkeypatch):
    from mlso_cli import knobs

    monkeypatch.delenv("MLSO_MERGE_SIBLINGS")
    knobs.cache_clear()
    kgs = [lr.graph for lr in analyse(llama).lifted]
    assert not any(n.startswith("mlso_concat_") for kg in kgs for n in kg.input_names)


def test_weights_that_are_graph_inputs_are_not_siblings():
    """models/small/gated_mlp.onnx feeds W1 and W2 as graph inputs: nothing to concatenate
    once, so the two matmuls stay separate."""
    loaded = load_model(str(MODELS / "small" / "gated_mlp.onnx"))
    weights = siblings.weight_types(loaded.model, lift_constants(loaded))
    nodes = loaded.graph.node
    assert siblings.groups(nodes, range(len(nodes)), loaded.shapes, weights) == {}


# ---- fewer GEMM launches on the llama export -------------------------------------------------------


def test_llama_regions_launch_fewer_library_gemms_after_the_merge(llama):
    before = analyse(llama, merge=False).lifted
    after = analyse(llama, merge=True).lifted
    assert [lr.region.nodes for lr in before] == [lr.region.nodes for lr in after]
    counts = [(_gemms(x.graph), _gemms(y.graph)) for x, y in zip(before, after)]
    assert sum(y for _, y in counts) < sum(x for x, _ in counts)
    assert (3, 1) in counts and (2, 1) in counts  # norm -> q/k/v, and gate/up
    for x, y in zip(before, after):
        gp_x, gp_y = generate(x.graph), generate(y.graph)
        assert len(gp_y.plan["launches"]) <= len(gp_x.plan["launches"])
        cat = [n for n in y.extra_inputs if n.startswith(siblings.PREFIX)]
        assert bool(cat) == (_gemms(y.graph) < _gemms(x.graph))


# ---- the merged program computes the separate matmuls ------------------------------------------------


def _feeds(lr, rng, shared: dict[str, np.ndarray], loaded) -> list[np.ndarray]:
    """Inputs of a lifted graph by name: lifting's constants and the model's weights as they
    are, activations drawn once per name so both forms read the same values."""
    inits = {t.name: t for t in loaded.graph.initializer}
    out = []
    for name, node in zip(lr.graph.input_names, lr.graph.inputs):
        if name in lr.extra_inputs:
            v = lr.extra_inputs[name]
        elif name in inits:
            v = numpy_helper.to_array(inits[name])
        else:
            v = shared.setdefault(name, rng.standard_normal(node.shape).astype(np.float32))
        out.append(np.asarray(v, np.float32))
    return out


def test_merged_siblings_emulate_like_the_separate_matmuls(llama):
    before = analyse(llama, merge=False).lifted
    after = analyse(llama, merge=True).lifted
    pairs = [
        (x, y)
        for x, y in zip(before, after)
        if any(n.startswith(siblings.PREFIX) for n in y.extra_inputs)
    ][:2]  # layer 0's q/k/v and gate/up regions
    assert len(pairs) == 2
    programs = {f"r{i}": generate(y.graph) for i, (_, y) in enumerate(pairs)}
    bundle = hostemu.Bundle(programs, binaries=1)
    rng = np.random.default_rng(5)
    for i, (x, y) in enumerate(pairs):
        shared: dict[str, np.ndarray] = {}
        ins_y = _feeds(y, rng, shared, llama)
        ins_x = _feeds(x, rng, shared, llama)
        separate = interpreter.run(x.graph, ins_x, "float64")
        merged = interpreter.run(y.graph, ins_y, "float64")
        got = bundle.run(f"r{i}", ins_y)
        assert x.graph.output_names == y.graph.output_names
        for s, m, g in zip(separate, merged, got):
            scale = np.abs(s).max()
            assert np.abs(m - s).max() <= 1e-12 * scale  # the same dot products, exactly
            g = np.asarray(g, np.float64)
            assert not np.isnan(g).any()
            assert np.abs(g - s).max() <= 1e-5 * scale


# ---- optimize and verify ----------------------------------------------------------------------------


def _gated(path: Path) -> Path:
    """y = silu(x @ Wg) * (x @ Wu), constant weights: the gate and up projections merge."""
    rng = np.random.default_rng(0)
    ws = [
        numpy_helper.from_array((rng.standard_normal((256, 384)) * 0.05).astype(np.float32), n)
        for n in ("wg", "wu")
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "wg"], ["g"]),
        helper.make_node("MatMul", ["x", "wu"], ["u"]),
        helper.make_node("Sigmoid", ["g"], ["s"]),
        helper.make_node("Mul", ["g", "s"], ["a"]),
        helper.make_node("Mul", ["a", "u"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "gated",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 64, 384])],
        ws,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.save(model, path)
    return path


SHAPE = ("--input-shape", "x=1,64,256")
ARGS = (*SHAPE, "--max-states", "200", "--min-speedup", "0", "--json")


def _verify(src: Path, out: Path):
    return run_cli(
        "verify", str(src), str(out), *SHAPE, "--samples", "1", "--trust-binary", "--json"
    )


@pytest.mark.slow  # 9 s: optimize and verify of a model whose gate/up merge; CI runs it in test-slow
def test_optimize_merges_gate_and_up_and_verify_accepts_it(tmp_path, monkeypatch):
    use_cache(monkeypatch)
    src = _gated(tmp_path / "gated.onnx")
    r = run_cli("optimize", str(src), "--dry-run", *ARGS)
    assert r.returncode == 0, r.stderr.decode()
    (row,) = [x for x in map(json.loads, r.stdout.splitlines()) if x["type"] == "region"]
    assert row["packaged"]
    out = tmp_path / "out.onnx"
    r = run_cli("optimize", str(src), "-o", str(out), *ARGS, timeout=600)
    if r.returncode != 0 and b"nvcc" in r.stderr:
        pytest.skip(f"no CUDA compiler: {r.stderr.decode()[-300:]}")
    assert r.returncode == 0, r.stderr.decode()
    model = onnx.load(out)
    (node,) = [n for n in model.graph.node if n.domain == "ai.mlso"]
    cat = [x for x in node.input if x.startswith(siblings.PREFIX)]
    assert len(cat) == 1 and "wg" not in node.input and "wu" not in node.input
    plan = json.loads(next(a.s for a in node.attribute if a.name == "plan"))
    assert [launch.get("kind", "kernel") for launch in plan["launches"]].count("gemm") == 1
    r = _verify(src, out)
    assert r.returncode == 0, r.stderr.decode()
    summary = json.loads(r.stdout.splitlines()[-1])
    assert summary["pass"] and summary["algebraic"] == "ok" and summary["emulated"] == 1

    # the concatenated weight with gate's first two columns swapped: verify refuses the model
    init = next(t for t in model.graph.initializer if t.name == cat[0])
    w = numpy_helper.to_array(init).copy()
    w[:, [0, 1]] = w[:, [1, 0]]
    init.CopyFrom(numpy_helper.from_array(w, cat[0]))
    bad = tmp_path / "bad.onnx"
    onnx.save(model, bad)
    r = _verify(src, bad)
    assert r.returncode != 0
    assert cat[0] in (r.stdout + r.stderr).decode()
