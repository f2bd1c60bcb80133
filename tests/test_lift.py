"""Lifting: canonical forms, masks, and agreement with ONNX Runtime through the interpreter."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from mlso_cli.frontend.analyse import analyse
from mlso_cli.frontend.lift import INV_SQRT2, LiftError, lift_model, lift_whole_graph
from mlso_cli.frontend.load import load_model
from mlso_cli.ir import Op, check, graph_hash
from mlso_cli.ir.node import const_value
from tests.helpers import SMALL, TRANSFORMER, save


def _lift_one_op(path) -> tuple:
    """The lifted graph of a one-op model. A lone elementwise op is no region (the partitioner
    leaves it out: nothing to fuse), so rules for one op are tested on the whole graph."""
    return (lift_whole_graph(load_model(str(path))).graph,)


interpreter = pytest.importorskip("mlso_cli.verify.interpreter")


def _model(nodes, inputs, outputs, inits=(), opset=18):
    g = helper.make_graph(nodes, "t", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    return m


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _scalar(name, v):
    return numpy_helper.from_array(np.array(v, dtype=np.float32), name)


def _ort(model, feeds):
    import onnxruntime as ort

    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("path", SMALL, ids=lambda p: p.stem)
def test_lifted_small_models_match_ort(path):
    from models.build_models import random_inputs

    model = onnx.load(str(path))
    feeds = random_inputs(model, seed=1)
    (want,) = _ort(model, feeds)
    (kg,) = lift_model(str(path))
    check(kg)
    from mlso_cli.frontend.partition import constant_values

    values = {**constant_values(model, limit=1 << 30), **feeds}
    got = interpreter.run(kg, [values[n] for n in kg.input_names], mode="float64")
    assert _rel(got[0], want.astype(np.float64)) < 1e-5


def test_lifted_transformer_regions_match_ort(tmp_path):
    """Each region of the exported transformer, lifted, equals ORT on the region's own inputs."""
    loaded = load_model(str(TRANSFORMER), {"hidden": (1, 16, 64)})
    a = analyse(loaded)
    # run the whole model once in ORT, exposing every intermediate as an output
    m = onnx.ModelProto()
    m.CopyFrom(loaded.model)
    known = {o.name for o in m.graph.output}
    produced = {o for n in m.graph.node if n.op_type != "Constant" for o in n.output}
    for vi in m.graph.value_info:
        if vi.name not in known and vi.name in produced:
            m.graph.output.append(vi)
    import onnxruntime as ort

    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((1, 16, 64)).astype(np.float32)
    names = [o.name for o in sess.get_outputs()]
    values = dict(zip(names, sess.run(None, {"hidden": x})))
    values["hidden"] = x
    from mlso_cli.frontend.partition import constant_values

    consts = constant_values(loaded.model, limit=1 << 30)
    for lr in a.lifted:
        ins = [
            values[n] if n in values else consts[n] if n in consts else lr.extra_inputs[n]
            for n in lr.graph.input_names
        ]
        outs = interpreter.run(lr.graph, ins, mode="float64")
        for name, got in zip(lr.graph.output_names, outs):
            assert _rel(got, values[name].astype(np.float64)) < 1e-5, (lr.region.id, name)


def test_gelu_spellings_lift_to_the_same_graph(tmp_path):
    x = _vi("x", [4, 8])
    common = [
        helper.make_node("Erf", ["u"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["f"]),
        helper.make_node("Mul", ["x", "f"], ["g"]),
        helper.make_node("Mul", ["g", "half"], ["y"]),
    ]
    inits = [_scalar("one", 1.0), _scalar("half", 0.5)]
    by_mul = _model(
        [helper.make_node("Mul", ["x", "c"], ["u"]), *common],
        [x],
        [_vi("y", [4, 8])],
        inits + [_scalar("c", 0.70710677)],
    )
    by_div = _model(
        [helper.make_node("Div", ["x", "c"], ["u"]), *common],
        [x],
        [_vi("y", [4, 8])],
        inits + [_scalar("c", 1.4142135)],
    )
    g1 = lift_model(str(save(by_mul, tmp_path / "a.onnx")))[0]
    g2 = lift_model(str(save(by_div, tmp_path / "b.onnx")))[0]
    assert graph_hash(g1) == graph_hash(g2)
    erf = next(n for n in g1.nodes() if n.op is Op.ERF)
    c = next(s for s in erf.src[0].src if s.op is Op.CONST)
    assert const_value(c) == INV_SQRT2


def test_the_gelu_scale_is_the_checkers_constant_even_from_an_fp16_spelling(tmp_path):
    """fp16 rounds 1/sqrt(2) to 181/256: the lifter snaps it (as the checker does) to exactly
    verify/semantics.py's INV_SQRT2, so the search's fingerprints, which use constants as
    written, meet the target's (held-out LayerNorm + GELU regions found nothing before)."""
    from mlso_cli.verify import semantics

    x = _vi("x", [4, 8])
    m = _model(
        [
            helper.make_node("Mul", ["x", "c"], ["u"]),
            helper.make_node("Erf", ["u"], ["y"]),
        ],
        [x],
        [_vi("y", [4, 8])],
        [_scalar("c", float(np.float16(0.70710677)))],
    )
    (g,) = lift_model(str(save(m, tmp_path / "a.onnx")))
    erf = next(n for n in g.nodes() if n.op is Op.ERF)
    c = next(s for s in erf.src[0].src if s.op is Op.CONST)
    assert const_value(c) == semantics.INV_SQRT2 == INV_SQRT2


def test_a_division_by_a_constant_lifts_as_a_product_by_its_exact_reciprocal(tmp_path):
    from fractions import Fraction

    x = _vi("x", [4, 8])
    m = _model(
        [helper.make_node("Div", ["x", "c"], ["y"])],
        [x],
        [_vi("y", [4, 8])],
        [_scalar("c", 8.0)],
    )
    (g,) = _lift_one_op(save(m, tmp_path / "a.onnx"))
    assert not any(n.op is Op.DIV for n in g.nodes())
    mul = next(n for n in g.nodes() if n.op is Op.MUL)
    assert [const_value(s) for s in mul.src if s.op is Op.CONST] == [Fraction(1, 8)]
    # a divisor that is a tensor stays a division
    m2 = _model(
        [helper.make_node("Div", ["x", "d"], ["y"])],
        [x, _vi("d", [4, 8])],
        [_vi("y", [4, 8])],
        [],
    )
    (g2,) = _lift_one_op(save(m2, tmp_path / "b.onnx"))
    assert any(n.op is Op.DIV for n in g2.nodes())


def test_pow_canonical_forms(tmp_path):
    x = _vi("x", [4, 8])
    for exp, op in ((2.0, Op.SQUARE), (0.5, Op.SQRT), (-0.5, Op.RSQRT), (-1.0, Op.RECIPROCAL)):
        m = _model(
            [helper.make_node("Pow", ["x", "e"], ["y"])],
            [x],
            [_vi("y", [4, 8])],
            [_scalar("e", exp)],
        )
        (kg,) = _lift_one_op(save(m, tmp_path / f"p{exp}.onnx"))
        assert kg.outputs[0].op is op


def test_where_mask_becomes_multiplicative(tmp_path):
    mask = numpy_helper.from_array(np.tril(np.ones((8, 8), bool)), "keep")
    m = _model(
        [
            helper.make_node("Where", ["keep", "x", "ninf"], ["w"]),
            helper.make_node("Softmax", ["w"], ["y"], axis=-1),
        ],
        [_vi("x", [2, 8, 8])],
        [_vi("y", [2, 8, 8])],
        [mask, _scalar("ninf", -np.inf)],
    )
    path = save(m, tmp_path / "mask.onnx")
    loaded = load_model(str(path))
    (lr,) = analyse(loaded).lifted
    assert any(n.op is Op.EXP for n in lr.graph.nodes()) and lr.extra_inputs
    x = np.random.default_rng(0).standard_normal((2, 8, 8)).astype(np.float32)
    (want,) = _ort(m, {"x": x})
    ins = [x if n == "x" else lr.extra_inputs[n] for n in lr.graph.input_names]
    (got,) = interpreter.run(lr.graph, ins, mode="float64")
    assert _rel(got, want.astype(np.float64)) < 1e-6


def test_masked_value_used_elsewhere_is_not_lifted(tmp_path):
    mask = numpy_helper.from_array(np.tril(np.ones((8, 8), bool)), "keep")
    m = _model(
        [
            helper.make_node("Where", ["keep", "x", "ninf"], ["w"]),
            helper.make_node("Relu", ["w"], ["y"]),
        ],
        [_vi("x", [8, 8])],
        [_vi("y", [8, 8])],
        [mask, _scalar("ninf", -np.inf)],
    )
    loaded = load_model(str(save(m, tmp_path / "m.onnx")))
    a = analyse(loaded)
    assert not a.lifted and any("could not be lifted" in e.reason for e in a.partition.excluded)
    assert LiftError  # the failure is reported, not raised


# ---- random small regions: lifted + interpreted == ONNX Runtime --------------------------------

UNARY = {
    "Exp": lambda: [("Tanh", {}), ("Exp", {})],
    "Sigmoid": lambda: [("Sigmoid", {})],
    "Relu": lambda: [("Relu", {})],
    "Neg": lambda: [("Neg", {})],
    "Tanh": lambda: [("Tanh", {})],
    "Erf": lambda: [("Erf", {})],
}


@st.composite
def random_region(draw):
    rows, cols = draw(st.sampled_from([(4, 8), (8, 4), (2, 16)]))
    nodes, inits = [], []
    cur, shape, k = "x", [rows, cols], 0

    def fresh():
        nonlocal k
        k += 1
        return f"t{k}"

    for _ in range(draw(st.integers(1, 6))):
        kind = draw(
            st.sampled_from(
                ["unary", "binary", "matmul", "softmax", "reduce", "norm", "sqrt", "transpose"]
            )
        )
        out = fresh()
        if kind == "unary":
            for op, attrs in UNARY[draw(st.sampled_from(sorted(UNARY)))]():
                nodes.append(helper.make_node(op, [cur], [out], **attrs))
                cur, out = out, fresh()
            continue
        if kind == "binary":
            op = draw(st.sampled_from(["Add", "Sub", "Mul", "Div"]))
            c = f"c{k}"
            vals = np.random.default_rng(k).uniform(0.5, 1.5, shape[-1:]).astype(np.float32)
            inits.append(numpy_helper.from_array(vals, c))
            nodes.append(helper.make_node(op, [cur, c], [out]))
        elif kind == "matmul":
            w = f"w{k}"
            n = draw(st.sampled_from([4, 8]))
            inits.append(
                numpy_helper.from_array(
                    np.random.default_rng(k).standard_normal((shape[-1], n)).astype(np.float32) / 3,
                    w,
                )
            )
            nodes.append(helper.make_node("MatMul", [cur, w], [out]))
            shape = [shape[0], n]
        elif kind == "softmax":
            nodes.append(
                helper.make_node("Softmax", [cur], [out], axis=draw(st.sampled_from([-1, 0])))
            )
        elif kind == "reduce":
            axes = f"a{k}"
            inits.append(numpy_helper.from_array(np.array([-1], np.int64), axes))
            nodes.append(
                helper.make_node(
                    draw(st.sampled_from(["ReduceMean", "ReduceSum"])),
                    [cur, axes],
                    [out],
                    keepdims=1,
                )
            )
            shape = [shape[0], 1]
        elif kind == "norm" and shape[-1] > 1:
            g = f"g{k}"
            inits.append(
                numpy_helper.from_array(np.linspace(0.5, 1.5, shape[-1]).astype(np.float32), g)
            )
            nodes.append(
                helper.make_node("LayerNormalization", [cur, g], [out], axis=-1, epsilon=1e-5)
            )
        elif kind == "sqrt":
            sq, one = fresh(), f"one{k}"
            inits.append(_scalar(one, 1.0))
            nodes += [
                helper.make_node("Mul", [cur, cur], [sq]),
                helper.make_node("Add", [sq, one], [out + "p"]),
                helper.make_node("Sqrt", [out + "p"], [out]),
            ]
        else:
            nodes.append(helper.make_node("Transpose", [cur], [out], perm=[1, 0]))
            shape = shape[::-1]
        cur = out
    return _model(nodes, [_vi("x", [rows, cols])], [_vi(cur, shape)], inits), (rows, cols)


@settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(random_region(), st.integers(0, 2**31 - 1))
def test_random_regions_lifted_agree_with_ort(tmp_path_factory, case, seed):
    model, (rows, cols) = case
    path = save(model, tmp_path_factory.mktemp("r") / "r.onnx")
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    (want,) = _ort(model, {"x": x})
    loaded = load_model(str(path))
    a = analyse(loaded)
    if a.lifted:
        (lr,) = a.lifted
    else:  # views only, or one elementwise op among views: no region, nothing to fuse
        assert sum(n.op_type != "Transpose" for n in model.graph.node) <= 1
        assert {e.category for e in a.partition.excluded} <= {"layout_only", "single_op"}
        if all(n.op_type == "Transpose" for n in model.graph.node):
            return
        lr = lift_whole_graph(loaded)  # the lone op's lifting rule is still checked
    check(lr.graph)
    ins = [
        x
        if n == "x"
        else numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == n))
        for n in lr.graph.input_names
    ]
    (got,) = interpreter.run(lr.graph, ins, mode="float64")
    assert got.shape == want.shape
    # ORT computes in fp32: its own error against exact arithmetic grows along random chains, and
    # where a chain cancels (x - mean(x), then a sum) the result is near zero: an absolute floor
    # of fp32 rounding at the inputs' scale keeps the check about the lift, not about ORT
    err = float(np.linalg.norm(got - want.astype(np.float64)))
    assert err < 1e-4 * max(float(np.linalg.norm(want)), 1e-2 * float(np.linalg.norm(x)))


@pytest.mark.parametrize("opset, axis", [(11, None), (11, 1), (11, 2), (13, 1), (13, None)])
def test_softmax_axis_semantics_follow_the_opset(tmp_path, opset, axis):
    """Before opset 13, Softmax flattens its input at `axis` (default 1) and normalises over all
    the trailing dims; from 13 on it normalises one axis (default -1). Lifting used the new rule
    for every opset, and a 3-D opset-11 Softmax came out with error 0.87."""
    from mlso_cli.verify.reference64 import reference_outputs

    attrs = {} if axis is None else {"axis": axis}
    m = _model(
        [helper.make_node("Softmax", ["x"], ["y"], **attrs)],
        [_vi("x", [2, 3, 5])],
        [_vi("y", [2, 3, 5])],
        opset=opset,
    )
    m.ir_version = 8
    (kg,) = lift_model(str(save(m, tmp_path / "s.onnx")))
    check(kg)
    x = np.random.default_rng(0).standard_normal((2, 3, 5)).astype(np.float32)
    (want,) = _ort(m, {"x": x})  # ONNX Runtime keeps the old semantics; onnx's evaluator does not
    (got,) = interpreter.run(kg, [x], mode="float64")
    assert _rel(np.asarray(got), want) < 1e-6
    # verify's fp64 reference (onnx's evaluator underneath) must agree with ONNX Runtime too
    assert _rel(reference_outputs(m, {"x": x})["y"], want) < 1e-6


@pytest.mark.parametrize("layout", ["two_softmaxes", "nested"])
def test_two_masks_on_one_tensor_are_both_kept(tmp_path, layout):
    """Two Where(mask, x, -inf) on one tensor (two softmaxes, or one mask inside another): their
    placeholders were equal nodes (x * 1), so one mask was lost and the kernel's error was ~1."""
    rng = np.random.default_rng(1)
    m1 = numpy_helper.from_array(np.tril(np.ones((8, 8), bool)), "m1")
    m2 = numpy_helper.from_array(rng.random((8, 8)) < 0.7, "m2")
    ninf = _scalar("ninf", -np.inf)
    if layout == "two_softmaxes":
        nodes = [
            helper.make_node("Where", ["m1", "x", "ninf"], ["w1"]),
            helper.make_node("Where", ["m2", "x", "ninf"], ["w2"]),
            helper.make_node("Softmax", ["w1"], ["s1"], axis=-1),
            helper.make_node("Softmax", ["w2"], ["s2"], axis=-1),
            helper.make_node("Add", ["s1", "s2"], ["y"]),
        ]
    else:
        nodes = [
            helper.make_node("Where", ["m1", "x", "ninf"], ["w1"]),
            helper.make_node("Where", ["m2", "w1", "ninf"], ["w2"]),
            helper.make_node("Softmax", ["w2"], ["y"], axis=-1),
        ]
    m = _model(nodes, [_vi("x", [2, 8, 8])], [_vi("y", [2, 8, 8])], [m1, m2, ninf])
    m.ir_version = 8
    loaded = load_model(str(save(m, tmp_path / "masks.onnx")))
    (lr,) = analyse(loaded).lifted
    x = rng.standard_normal((2, 8, 8)).astype(np.float32)
    (want,) = _ort(m, {"x": x})
    ins = [x if n == "x" else lr.extra_inputs[n] for n in lr.graph.input_names]
    (got,) = interpreter.run(lr.graph, ins, mode="float64")
    w = want.astype(np.float64)
    ok = np.isfinite(w)  # rows that both masks empty are NaN in ONNX Runtime too
    assert np.isfinite(np.asarray(got)[ok]).all() and _rel(np.asarray(got)[ok], w[ok]) < 1e-6


def test_causal_attention_mask_is_top_left_when_lengths_differ(tmp_path):
    """ONNX Attention's is_causal aligns the mask top-left (query i sees keys 0..i), also when
    the query is shorter than the keys; lifting used a bottom-right mask (error ~1)."""
    from onnx.reference import ReferenceEvaluator

    sq, skv, d = 4, 8, 16
    q, k, v = _vi("q", [1, 2, sq, d]), _vi("k", [1, 2, skv, d]), _vi("v", [1, 2, skv, d])
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=1)
    m = _model([node], [q, k, v], [_vi("y", [1, 2, sq, d])], opset=23)
    m.ir_version = 10
    loaded = load_model(str(save(m, tmp_path / "attn.onnx")))
    (lr,) = analyse(loaded).lifted
    rng = np.random.default_rng(2)
    feeds = {
        n: rng.standard_normal(s).astype(np.float32)
        for n, s in (("q", (1, 2, sq, d)), ("k", (1, 2, skv, d)), ("v", (1, 2, skv, d)))
    }
    (want,) = ReferenceEvaluator(m).run(None, feeds)
    ins = [feeds[n] if n in feeds else lr.extra_inputs[n] for n in lr.graph.input_names]
    (got,) = interpreter.run(lr.graph, ins, mode="float64")
    assert _rel(np.asarray(got), want.astype(np.float64)) < 1e-5
