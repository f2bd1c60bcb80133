"""Sibling projections lifted as one GEMM over concatenated weights (frontend/siblings.py): the
structural rule, on by default, fewer library GEMM launches on a real decoder export, the merged
program against the separate matmuls (host emulator and float64 interpreter), the fallback body
reading the concatenation in column Slices (no second copy of the weights; verify compares the
concatenation with A's weights, and lifts the body in its kernel's form), and optimize + verify on
a model whose gate/up projections merge, including a packaged concatenated weight that was
tampered with, alone and consistently with the body that reads it.
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
    """The merge is on by default (MLSO_MERGE_SIBLINGS); these tests say so in the environment
    too, so that a developer's MLSO_MERGE_SIBLINGS=0 does not turn them into no-ops."""
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


def test_the_merge_is_on_by_default_and_zero_turns_it_off(llama, monkeypatch):
    from mlso_cli import knobs

    def concats() -> int:
        knobs.cache_clear()
        kgs = [lr.graph for lr in analyse(llama).lifted]
        return sum(n.startswith("mlso_concat_") for kg in kgs for n in kg.input_names)

    monkeypatch.delenv("MLSO_MERGE_SIBLINGS")
    assert concats() == 4  # q/k/v and gate/up in each of the two layers
    monkeypatch.setenv("MLSO_MERGE_SIBLINGS", "0")
    assert concats() == 0


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


def _gated(path: Path, rows: tuple[int, ...] = ("n", 64)) -> Path:
    """y = silu(x @ Wg) * (x @ Wu), constant weights: the gate and up projections merge.
    rows: x's dims before its last (256)."""
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
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*rows, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*rows, 384])],
        ws,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.save(model, path)
    return path


def _packaged(
    src: Path, x: tuple[int, ...] = (1, 64, 256)
) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """A (the model at src) and B: its one region packaged with a placeholder binary (no nvcc;
    ONNX Runtime runs the fallback body, and constant_problems needs no binary), merged or not
    as MLSO_MERGE_SIBLINGS says."""
    from mlso_cli import knobs
    from mlso_cli.package import standard_metadata
    from mlso_cli.package.assemble import assemble
    from tests.fixtures.packaging import placeholder

    loaded = load_model(str(src), {"x": x})
    (lr,) = analyse(loaded).lifted
    assert set(lr.columns) == ({"g", "u"} if knobs.knobs().merge_siblings else set())
    built = placeholder(lr.graph)
    meta = standard_metadata(targets=built.plan["targets"], seed=0, verification_bound="fixture")
    return onnx.load(src), assemble(loaded.model, [(lr, built)], meta)


@pytest.mark.parametrize(
    "rows,packed,now",
    [(("n", 64), "1", "1"), ((1,), "1", "1"), ((1,), "1", "0"), ((1,), "0", "1")],
)
def test_the_fallback_body_lifts_to_the_kernels_form(tmp_path, monkeypatch, rows, packed, now):
    """Lifting the body as verify does (in its kernel's form, `merged_kernel`) gives the
    kernel's inputs, input for input: a merged body's column Slices are lifted as the sibling
    weights and merge again (the same concatenation and column selections), an unmerged body's
    MatMuls stay separate, whatever MLSO_MERGE_SIBLINGS is when verify runs (`now`) against
    when the model was packaged (`packed`). Why both shapes: lifted as selections of the
    concatenation instead, the selection constants of a (1, 256) input differ from the
    kernel's and the field check broke; and a model packaged without the merge (any model
    optimized before it was on by default) crashed the field check once the knob was on."""
    from mlso_cli import knobs
    from mlso_cli.frontend.lift import lift_whole_graph, merged_kernel
    from mlso_cli.frontend.load import loaded_from_proto
    from mlso_cli.ir import loads
    from mlso_cli.package.regionmodel import region_model

    x = (1, 64, 256) if len(rows) == 2 else (1, 256)
    monkeypatch.setenv("MLSO_MERGE_SIBLINGS", packed)
    knobs.cache_clear()
    _, b = _packaged(_gated(tmp_path / "gated.onnx", rows), x)
    (node,) = [n for n in b.graph.node if n.domain == "ai.mlso"]
    program = loads(next(a.s for a in node.attribute if a.name == "ugraph").decode())
    monkeypatch.setenv("MLSO_MERGE_SIBLINGS", now)
    knobs.cache_clear()
    body = loaded_from_proto(region_model(b, node), "body")
    lifted = lift_whole_graph(body, merged=merged_kernel(program.input_names))
    assert sorted(lifted.graph.input_names) == sorted(program.input_names)
    assert _gemms(lifted.graph) == (1 if packed == "1" else 2)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def test_the_fallback_body_reads_the_concatenated_weight_not_copies(tmp_path):
    """The body reads gate's and up's weights as column Slices of the kernel's concatenation,
    so wg and wu are gone from the file, which is about as large as A rather than twice it; and
    the body (what ONNX Runtime runs without mlso's library) computes what A computes, bit for
    bit (slicing a concatenation is exact)."""
    src = _gated(tmp_path / "gated.onnx")
    a, b = _packaged(src)
    inits = {t.name for t in b.graph.initializer}
    assert "wg" not in inits and "wu" not in inits
    (cat,) = [n for n in inits if n.startswith(siblings.PREFIX)]
    (fn,) = b.functions
    slices = [n for n in fn.node if n.op_type == "Slice"]
    assert [n.input[0] for n in slices] == [cat, cat]
    matmuls = {n.output[0]: n.input[1] for n in fn.node if n.op_type == "MatMul"}
    assert sorted(matmuls.values()) == sorted(n.output[0] for n in slices)
    assert not any(n.output[0].startswith(("wg", "wu")) for n in fn.node)
    weights = 2 * 256 * 384 * 4
    assert b.ByteSize() < a.ByteSize() + weights // 4  # not A plus the concatenation
    x = np.random.default_rng(1).standard_normal((1, 64, 256)).astype(np.float32)
    assert np.array_equal(_run(b, x), _run(a, x))


def test_verify_compares_the_concatenation_with_the_original_weights(tmp_path):
    """Lifting a body that reads the concatenation would derive it back from itself, so the
    constant check compares its columns with A's MatMul weights instead: a concatenation tampered
    with (the body reads it, so body and kernel still agree), Slice bounds moved to other
    columns, and columns no Slice reads are each refused, naming the columns."""
    from mlso_cli.verify import liftcheck

    src = _gated(tmp_path / "gated.onnx")
    a, b = _packaged(src)
    (node,) = [n for n in b.graph.node if n.domain == "ai.mlso"]
    assert liftcheck.constant_problems(a, b, node) == []

    bad = onnx.ModelProto()
    bad.CopyFrom(b)
    init = next(t for t in bad.graph.initializer if t.name.startswith(siblings.PREFIX))
    w = numpy_helper.to_array(init).copy()
    w[:, 5] *= -1  # one of gate's columns
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    (problem,) = liftcheck.constant_problems(a, bad, node)
    assert f"constant '{init.name}': columns 0:384 (the weight of 'g'): 256 of 98304" in problem

    def with_bounds(output: str, start: int, end: int) -> onnx.ModelProto:
        m = onnx.ModelProto()
        m.CopyFrom(b)
        for n in m.functions[0].node:
            for what, v in (("starts", start), ("ends", end)):
                if n.output[0] == f"{output}__mlso_{what}_r0":
                    n.attribute[0].t.CopyFrom(numpy_helper.from_array(np.array([v], np.int64)))
        return m

    moved = liftcheck.constant_problems(a, with_bounds("g", 384, 768), node)
    assert any("columns 384:768 (the weight of 'g'): 98304 of 98304" in p for p in moved)
    assert any("384 of its 768 columns (from column 0) are read by no MatMul" in p for p in moved)
    short = liftcheck.constant_problems(a, with_bounds("u", 384, 700), node)
    assert any("the weight of 'u'): shape (256, 316)" in p for p in short)


def test_a_weight_read_outside_the_region_stays():
    """Only the region's reads move to the concatenation: wg, read also by a node outside the
    region, is kept for it; wu, read by the region alone, is dropped."""
    from mlso_cli.package.absorb import absorb_constants, prune_unused

    rng = np.random.default_rng(2)
    wg, wu = (rng.standard_normal((8, 4)).astype(np.float32) for _ in range(2))
    cat = np.concatenate([wg, wu], axis=1)
    nodes = [
        helper.make_node("MatMul", ["x", "wg"], ["g"]),
        helper.make_node("MatMul", ["x", "wu"], ["u"]),
        helper.make_node("Mul", ["g", "u"], ["y"]),
        helper.make_node("ReduceSum", ["wg"], ["s"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
        ],
        [numpy_helper.from_array(v, n) for v, n in ((wg, "wg"), (wu, "wu"), (cat, "cat"))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    columns = {"g": ("cat", 0, 4), "u": ("cat", 4, 8)}
    consts = {"wg": wg, "wu": wu, "cat": cat}
    m, (idx,) = absorb_constants(model, [([0, 1, 2], ["x", "cat"])], consts, [columns])
    m = prune_unused(m)
    assert {t.name for t in m.graph.initializer} == {"wg", "cat"}
    body = [m.graph.node[i] for i in idx]
    assert [n.input[1] for n in body if n.op_type == "MatMul"] == [
        n.output[0] for n in body if n.op_type == "Slice"
    ]
    assert "wg" in next(n for n in m.graph.node if n.op_type == "ReduceSum").input
    # below opset 10 Slice has no inputs for its bounds: the body keeps copies as before
    old = onnx.ModelProto()
    old.CopyFrom(model)
    old.opset_import[0].version = 9
    m9, _ = absorb_constants(old, [([0, 1, 2], ["x", "cat"])], consts, [columns])
    assert not any(n.op_type == "Slice" for n in m9.graph.node)


SHAPE = ("--input-shape", "x=1,64,256")
ARGS = (*SHAPE, "--max-states", "200", "--min-speedup", "0", "--json")


def _verify(src: Path, out: Path, env: dict | None = None):
    return run_cli(
        "verify", str(src), str(out), *SHAPE, "--samples", "1", "--trust-binary", "--json", env=env
    )


@pytest.mark.slow  # 8 s: optimize without the merge, verify with it on (the default)
def test_a_model_optimized_without_the_merge_verifies_with_it_on(tmp_path, monkeypatch):
    """Models optimized while the merge was off by default (or with MLSO_MERGE_SIBLINGS=0) have
    separate GEMMs whose bodies read copies of the weights; verify, merging by default now,
    must still lift those bodies unmerged, as their kernels are."""
    use_cache(monkeypatch)
    src = _gated(tmp_path / "gated.onnx")
    out = tmp_path / "out.onnx"
    off = {"MLSO_MERGE_SIBLINGS": "0"}
    r = run_cli("optimize", str(src), "-o", str(out), *ARGS, env=off, timeout=600)
    if r.returncode != 0 and b"nvcc" in r.stderr:
        pytest.skip(f"no CUDA compiler: {r.stderr.decode()[-300:]}")
    assert r.returncode == 0, r.stderr.decode()
    (node,) = [n for n in onnx.load(out).graph.node if n.domain == "ai.mlso"]
    assert "wg" in node.input and not any(x.startswith(siblings.PREFIX) for x in node.input)
    r = _verify(src, out, {"MLSO_MERGE_SIBLINGS": "1"})
    assert r.returncode == 0, r.stderr.decode()[-2000:]


@pytest.mark.slow  # 12 s: optimize and verify of a model whose gate/up merge; CI runs it in test-slow
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
    # verify checks the kernel in its own form, whatever MLSO_MERGE_SIBLINGS says when it runs
    r = _verify(src, out, {"MLSO_MERGE_SIBLINGS": "0"})
    assert r.returncode == 0, r.stderr.decode()

    # the concatenated weight with gate's first two columns swapped: verify refuses the model
    init = next(t for t in model.graph.initializer if t.name == cat[0])
    w = numpy_helper.to_array(init).copy()
    w[:, [0, 1]] = w[:, [1, 0]]
    init.CopyFrom(numpy_helper.from_array(w, cat[0]))
    bad = tmp_path / "bad.onnx"
    onnx.save(model, bad)
    r = _verify(src, bad)
    assert r.returncode == 3
    assert cat[0] in (r.stdout + r.stderr).decode()

    # tampered consistently: gate's columns negated in the concatenation, which the fallback
    # body reads too, so the kernel and its body agree; only A's weights tell them apart
    sign = np.where(np.arange(w.shape[1]) < 384, -1, 1).astype(np.float32)
    init.CopyFrom(numpy_helper.from_array(w * sign, cat[0]))
    onnx.save(model, bad)
    r = _verify(src, bad)
    assert r.returncode == 3, (r.stdout + r.stderr).decode()[-2000:]
    assert f"constant '{cat[0]}': columns 0:384 (the weight of 'g')" in r.stderr.decode()
