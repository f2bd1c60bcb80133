"""Folding shape-only subgraphs (causal masks, RoPE tables) and lifting Slice/Concat/Split/Neg.

Why: real decoder exports compute the causal mask and the RoPE cos/sin tables from the input
shape at run time, and rotate RoPE's halves with Slice/Neg/Concat. With fixed input shapes the
first two are constants of seq x seq and seq x d elements (folded now whatever their size, as long
as no weight is read); the rotation lifts as a signed block selection
(`frontend/selection.py`). Each lifted graph is checked by the spec checker and against onnx's
reference evaluator through the IR interpreter.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from mlso_cli import knobs
from mlso_cli.frontend.analyse import analyse
from mlso_cli.frontend.fold import TABLE_ELEMENTS
from mlso_cli.frontend.lift import lift_constants
from mlso_cli.frontend.load import load_model
from mlso_cli.frontend.partition import partition
from mlso_cli.frontend.report import inspect_report
from mlso_cli.ir import Op, check
from mlso_cli.verify import interpreter
from tests.helpers import save

INT_MAX = np.iinfo(np.int64).max
ZOO_SMALL = ["llama_tiny_fp32", "gemma3_tiny_fp32", "gpt2_tiny_fp32", "deepseek_v3_tiny_fp32"]
MASK_OPS = {"Cos", "Sin", "Range", "LessOrEqual", "Less", "Equal", "And", "Not", "Where", "CumSum"}


def _i64(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _f(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.array(value, dtype), name)


def _model(nodes, inputs, outputs, inits=(), opset=18):
    g = helper.make_graph(nodes, "t", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    m = onnx.shape_inference.infer_shapes(m)  # fills the shapes of outputs declared without one
    onnx.checker.check_model(m)
    return m


def _decoder(d: int = 16, fp16: bool = False) -> onnx.ModelProto:
    """One attention head over x (1, seq, d): the causal mask from Range/LessOrEqual/Where, the
    RoPE tables from Range x inv_freq -> Concat -> Cos/Sin, rotate_half by Slice/Neg/Concat.
    With fp16 the tables and the mask are computed in fp32 and cast, as fp16 exports do."""
    ft = TensorProto.FLOAT16 if fp16 else TensorProto.FLOAT
    cast_nodes = [helper.make_node("Cast", ["mask32"], ["mask"], to=ft)] if fp16 else []
    cast_nodes += (
        [
            helper.make_node("Cast", ["cos32"], ["cos"], to=ft),
            helper.make_node("Cast", ["sin32"], ["sin"], to=ft),
        ]
        if fp16
        else []
    )
    tail = "32" if fp16 else ""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], start=1, end=2),
        helper.make_node("Squeeze", ["s", "ax0"], ["s0"]),
        helper.make_node("Range", ["zero", "s0", "one"], ["pos"]),
        helper.make_node("Unsqueeze", ["pos", "ax0"], ["row"]),
        helper.make_node("Unsqueeze", ["pos", "ax1"], ["col"]),
        helper.make_node("LessOrEqual", ["row", "col"], ["keep"]),
        helper.make_node("Where", ["keep", "fzero", "neginf"], ["mask" + tail]),
        helper.make_node("Cast", ["pos"], ["posf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["posf", "ax1"], ["posc"]),
        helper.make_node("Mul", ["posc", "inv_freq"], ["freqs"]),
        helper.make_node("Concat", ["freqs", "freqs"], ["emb"], axis=-1),
        helper.make_node("Cos", ["emb"], ["cos" + tail]),
        helper.make_node("Sin", ["emb"], ["sin" + tail]),
        *cast_nodes,
        helper.make_node("Slice", ["x", "st0", "half", "axl"], ["x1"]),
        helper.make_node("Slice", ["x", "half", "big", "axl"], ["x2"]),
        helper.make_node("Neg", ["x2"], ["nx2"]),
        helper.make_node("Concat", ["nx2", "x1"], ["rot"], axis=-1),
        helper.make_node("Mul", ["x", "cos"], ["xc"]),
        helper.make_node("Mul", ["rot", "sin"], ["rs"]),
        helper.make_node("Add", ["xc", "rs"], ["q"]),
        helper.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "qt"], ["scores"]),
        helper.make_node("Add", ["scores", "mask"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "x"], ["y"]),
    ]
    inv_freq = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).reshape(1, d // 2)
    inits = [
        _i64("zero", 0),
        _i64("one", 1),
        _i64("ax0", [0]),
        _i64("ax1", [1]),
        _i64("axl", [-1]),
        _i64("st0", [0]),
        _i64("half", [d // 2]),
        _i64("big", [INT_MAX]),
        _f("fzero", 0.0),
        _f("neginf", -np.inf),
        _f("inv_freq", inv_freq),
    ]
    vi = helper.make_tensor_value_info
    return _model(nodes, [vi("x", ft, [1, "seq", d])], [vi("y", ft, [1, "seq", d])], inits)


def _intermediates(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """Every tensor of `model` on `feeds`, by onnx's reference evaluator."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    produced = [o for n in m.graph.node for o in n.output]
    have = {o.name for o in m.graph.output}
    for name in produced:
        if name not in have:
            m.graph.output.append(helper.make_empty_tensor_value_info(name))
    names = [o.name for o in m.graph.output]
    return {**dict(zip(names, ReferenceEvaluator(m).run(None, feeds))), **feeds}


def _check_lifted(loaded, feeds, tol=1e-6):
    """Lift every region, run each through the interpreter on the reference's own tensors, and
    compare with the reference; returns the lifted regions."""
    a = analyse(loaded)
    values = _intermediates(loaded.model, feeds)
    consts = lift_constants(loaded)
    for lr in a.lifted:
        check(lr.graph)
        ins = []
        for n in lr.graph.input_names:
            v = values[n] if n in values else consts[n] if n in consts else lr.extra_inputs[n]
            ins.append(np.asarray(v))
        outs = interpreter.run(lr.graph, ins, mode="float64")
        for name, got in zip(lr.graph.output_names, outs):
            want = np.asarray(values[name], np.float64)
            rel = np.linalg.norm(np.asarray(got, np.float64) - want) / max(
                np.linalg.norm(want), 1e-30
            )
            assert rel < tol, (lr.region.id, name, rel)
    return a


def _ops(loaded) -> set[str]:
    return {n.op_type for n in loaded.graph.node if n.op_type != "Constant"}


# ---- folding -------------------------------------------------------------------------------


def test_causal_mask_and_rope_tables_fold_at_any_size(tmp_path):
    """At seq 128 the mask (16384 elements) and the tables (2048) are constants after load: the
    old 4096-element cap left the mask to be computed at run time outside every region."""
    path = save(_decoder(), tmp_path / "m.onnx")
    loaded = load_model(str(path), {"x": (1, 128, 16)})
    assert not (_ops(loaded) & MASK_OPS)
    folded = {
        tuple(loaded.shapes[n.output[0]]) for n in loaded.graph.node if n.op_type == "Constant"
    }
    assert (128, 128) in folded and (128, 16) in folded


def test_a_weight_feeding_a_transpose_is_not_folded(tmp_path):
    """Transpose(W) reads only a constant, but W is a weight (over TABLE_ELEMENTS): folding it
    would copy the weight, so the Transpose stays and inspect says why."""
    rows, cols = 640, 512
    assert rows * cols > TABLE_ELEMENTS
    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    vi = helper.make_tensor_value_info
    m = _model(
        [
            helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
            helper.make_node("MatMul", ["x", "Wt"], ["y"]),
        ],
        [vi("x", TensorProto.FLOAT, [4, cols])],
        [vi("y", TensorProto.FLOAT, [4, rows])],
        [numpy_helper.from_array(w, "W")],
    )
    loaded = load_model(str(save(m, tmp_path / "w.onnx")))
    assert "Transpose" in _ops(loaded)
    assert f"'W' ({rows}x{cols})" in loaded.fold_notes["Wt"]
    assert not any(n.op_type == "Constant" and n.output[0] == "Wt" for n in loaded.graph.node)


@pytest.mark.parametrize("seq, dim", [(128, 96), (2048, 128)])
def test_a_stored_rope_table_folds(tmp_path, seq, dim):
    """The Phi-3 and Qwen3 exports store positions x inv_freq as a float initializer; Cos, Sin,
    their Casts and Unsqueezes fold to the two tables the attention reads, up to 2,048 x 128."""
    rng = np.random.default_rng(1)
    table = (np.arange(seq, dtype=np.float32)[:, None] * rng.random(dim, dtype=np.float32))[None]
    vi = helper.make_tensor_value_info
    m = _model(
        [
            helper.make_node("Cos", ["freqs"], ["c32"]),
            helper.make_node("Sin", ["freqs"], ["s32"]),
            helper.make_node("Cast", ["c32"], ["c16"], to=TensorProto.FLOAT16),
            helper.make_node("Cast", ["s32"], ["s16"], to=TensorProto.FLOAT16),
            helper.make_node("Unsqueeze", ["c16", "one"], ["cos"]),
            helper.make_node("Unsqueeze", ["s16", "one"], ["sin"]),
            helper.make_node("Mul", ["q", "cos"], ["qc"]),
            helper.make_node("Mul", ["q", "sin"], ["qs"]),
            helper.make_node("Add", ["qc", "qs"], ["y"]),
        ],
        [vi("q", TensorProto.FLOAT16, [1, 2, seq, dim])],
        [vi("y", TensorProto.FLOAT16, [1, 2, seq, dim])],
        [
            numpy_helper.from_array(table, "freqs"),
            numpy_helper.from_array(np.array([1], np.int64), "one"),
        ],
    )
    loaded = load_model(str(save(m, tmp_path / "rope.onnx")))
    assert not (_ops(loaded) & {"Cos", "Sin", "Cast", "Unsqueeze"})
    consts = {n.output[0]: n for n in loaded.graph.node if n.op_type == "Constant"}
    assert set(consts) >= {"cos", "sin"}
    cos = numpy_helper.to_array(consts["cos"].attribute[0].t)
    assert cos.dtype == np.float16 and cos.shape == (1, 1, seq, dim)
    np.testing.assert_array_equal(cos, np.cos(table).astype(np.float16)[:, None])
    assert not loaded.fold_notes


def _stored_mask_model(fill_dtype=np.float16, seq: int = 128):
    """Scores plus the additive causal mask as torch.onnx's dynamo exporter writes it for static
    shapes (a Qwen2 export): two stored seq x seq booleans And-ed, then Where(mask, 0, min)."""
    le = np.tril(np.ones((1, 1, seq, seq), bool))
    vi = helper.make_tensor_value_info
    dt = helper.np_dtype_to_tensor_dtype(np.dtype(fill_dtype))
    return _model(
        [
            helper.make_node("And", ["le", "eq"], ["both"]),
            helper.make_node("Where", ["both", "zero", "low"], ["mask"]),
            helper.make_node("Add", ["s", "mask"], ["y"]),
        ],
        [vi("s", dt, [1, 1, seq, seq])],
        [vi("y", dt, [1, 1, seq, seq])],
        [
            numpy_helper.from_array(le, "le"),
            numpy_helper.from_array(np.ones((1, 1, seq, seq), bool), "eq"),
            numpy_helper.from_array(np.array(0, fill_dtype), "zero"),
            numpy_helper.from_array(np.array(-65504, fill_dtype), "low"),
        ],
    )


def test_a_stored_boolean_mask_folds_whatever_its_size(tmp_path):
    """Booleans are masks, not weights: the And and Where over two stored 128 x 128 booleans fold
    (they ran as three ONNX Runtime kernels per call in an optimized Qwen2 export)."""
    loaded = load_model(str(save(_stored_mask_model(), tmp_path / "m.onnx")))
    assert not (_ops(loaded) & {"And", "Where"})
    mask = next(
        numpy_helper.to_array(n.attribute[0].t)
        for n in loaded.graph.node
        if n.op_type == "Constant" and n.output[0] == "mask"
    )
    expect = np.where(np.tril(np.ones((128, 128), bool)), 0, -65504).astype(np.float16)
    np.testing.assert_array_equal(mask.reshape(128, 128), expect)


def test_a_large_numeric_initializer_beside_the_mask_still_does_not_fold(tmp_path):
    """The boolean rule is about the dtype: the same chain whose 'eq' is a float seq x seq
    tensor over TABLE_ELEMENTS (a weight by size) stays as nodes, with the reason."""
    seq = 513
    assert seq * seq > TABLE_ELEMENTS
    m = _stored_mask_model(seq=seq)
    eq = next(t for t in m.graph.initializer if t.name == "eq")
    eq.CopyFrom(numpy_helper.from_array(np.ones((1, 1, seq, seq), np.float32), "eq"))
    m.graph.node[0].op_type = "Greater"  # le > eq: a float comparison, still constant-only
    m.graph.node[0].input[0] = "f"
    m.graph.initializer.append(numpy_helper.from_array(np.zeros((1, 1, seq, seq), np.float32), "f"))
    loaded = load_model(str(save(m, tmp_path / "m.onnx")))
    assert "Greater" in _ops(loaded) and "Where" in _ops(loaded)
    assert f"the weight 'f' (1x1x{seq}x{seq})" in loaded.fold_notes["both"]


def test_the_fold_budget_keeps_a_large_mask_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("MLSO_MAX_FOLD_BYTES", "8192")
    knobs.cache_clear()
    try:
        loaded = load_model(str(save(_decoder(), tmp_path / "m.onnx")), {"x": (1, 128, 16)})
    finally:
        monkeypatch.delenv("MLSO_MAX_FOLD_BYTES")
        knobs.cache_clear()
    assert "LessOrEqual" in _ops(loaded)  # 16384 bools, over 8192 bytes
    assert "Cos" not in _ops(loaded)  # 128 x 16 floats, 8192 bytes: within the budget
    report = inspect_report(loaded, partition(loaded))
    why = next(r.reason for r in report.left_out if r.node.op_type == "LessOrEqual")
    assert "fold budget" in why and "MLSO_MAX_FOLD_BYTES" in why


def test_a_bad_fold_budget_is_a_usage_error(monkeypatch):
    from mlso_cli.errors import UsageError

    monkeypatch.setenv("MLSO_MAX_FOLD_BYTES", "lots")
    knobs.cache_clear()
    try:
        with pytest.raises(UsageError, match="MLSO_MAX_FOLD_BYTES"):
            knobs.knobs()
    finally:
        monkeypatch.delenv("MLSO_MAX_FOLD_BYTES")
        knobs.cache_clear()


@pytest.mark.parametrize("name", ZOO_SMALL)
def test_zoo_small_masks_and_tables_fold_and_lift(name):
    """The exported decoders' masks and RoPE tables fold at seq 128; the attention mask lifts as
    a 0/1 mask (no -inf reaches a kernel) and rotate_half as a block selection."""
    from tests.test_zoo import SMALL_DIR

    loaded = load_model(str(SMALL_DIR / f"{name}.onnx"), {"input_ids": (1, 128)})
    assert not (_ops(loaded) & MASK_OPS)
    a = analyse(loaded)
    inputs = {n for lr in a.lifted for n in lr.graph.input_names}
    assert any(n.startswith("mlso_mask_") for n in inputs)
    if name != "gpt2_tiny_fp32":  # GPT-2 has learned positions, no RoPE
        assert any(n.startswith("mlso_select_") for n in inputs)
    for lr in a.lifted:
        check(lr.graph)
        for n, v in lr.extra_inputs.items():
            assert np.isfinite(v).all(), n
    # none of them is unsupported; a Concat may still stand alone between ops that are (DeepSeek's
    # ScatterND writes), and then it is left out as one op with nothing to fuse
    unsupported = {e.op_type for e in a.partition.excluded if e.category == "unsupported"}
    assert not (unsupported & {"Slice", "Concat", "Neg", "Cos", "Sin", "Where", "LessOrEqual"})


# ---- lifting selections --------------------------------------------------------------------


def _one_op(op, inputs, outputs, inits=(), opset=18, **attrs):
    """The selection op on -x: a lone selection is left out (nothing to fuse), so an exact
    elementwise op before it makes the region."""
    vi = helper.make_tensor_value_info
    first = inputs[0][0]
    square = helper.make_node("Neg", [first], [f"{first}_sq"])
    names = [f"{first}_sq"] + [i[0] for i in inputs[1:]]
    node = helper.make_node(op, names + [t.name for t in inits], outputs, **attrs)
    out_vi = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
    m = _model(
        [square, node], [vi(n, TensorProto.FLOAT, s) for n, s in inputs], out_vi, inits, opset=opset
    )
    return onnx.shape_inference.infer_shapes(m)


def _slice(starts, ends, axes, steps=None):
    inits = [_i64("st", starts), _i64("en", ends), _i64("ax", axes)]
    if steps is not None:
        inits.append(_i64("sp", steps))
    return _one_op("Slice", [("x", [2, 6, 32])], ["y"], inits)


SELECTIONS = {
    "slice_last": lambda: _slice([8], [24], [2]),
    "slice_step2": lambda: _slice([1], [32], [2], [2]),
    "slice_negative": lambda: _slice([-24], [-8], [-1]),
    "slice_clamped": lambda: _slice([-100], [INT_MAX], [2]),
    "slice_middle_axis": lambda: _slice([2], [5], [1]),
    "slice_two_axes": lambda: _slice([0, 16], [3, 32], [1, 2]),
    "slice_reverse_small_axis": lambda: _slice([-1], [-INT_MAX], [1], [-1]),
    "slice_negative_step2": lambda: _slice([5], [-INT_MAX], [1], [-2]),
    "slice_leading_axis": lambda: _slice([1], [2], [0]),
    "concat_three": lambda: _one_op(
        "Concat", [("a", [2, 6, 8]), ("b", [2, 6, 8]), ("c", [2, 6, 16])], ["y"], axis=2
    ),
    "concat_axis0": lambda: _one_op("Concat", [("a", [2, 6, 8]), ("b", [3, 6, 8])], ["y"], axis=0),
    "split_even_num_outputs": lambda: _one_op(
        "Split", [("x", [2, 6, 32])], ["y0", "y1"], axis=2, num_outputs=2
    ),
    "split_uneven": lambda: _one_op(
        "Split", [("x", [2, 6, 32])], ["y0", "y1"], [_i64("sizes", [8, 24])], axis=2
    ),
    "split_middle_axis": lambda: _one_op(
        "Split", [("x", [2, 6, 32])], ["y0", "y1", "y2"], [_i64("sizes", [1, 2, 3])], axis=1
    ),
    # DeepSeek's slice assignment: rows 0..3 of a (6, 2, 8) tensor replaced, then rows 4, 1
    "scatter_nd_leading_rows": lambda: _scatter([[0], [1], [2], [3]], [4, 2, 8]),
    "scatter_nd_scattered_rows": lambda: _scatter([[4], [-5]], [2, 2, 8]),
}


def _scatter(indices, upd_shape):
    """ScatterND(-x, idx, u): x (6, 2, 8), constant row indices (as _one_op, a Neg first)."""
    vi = helper.make_tensor_value_info
    rows = len(indices[0])
    idx = helper.make_tensor("idx", TensorProto.INT64, [len(indices), rows], sum(indices, []))
    m = _model(
        [
            helper.make_node("Neg", ["x"], ["x_sq"]),
            helper.make_node("ScatterND", ["x_sq", "idx", "u"], ["y"]),
        ],
        [vi("x", TensorProto.FLOAT, [6, 2, 8]), vi("u", TensorProto.FLOAT, upd_shape)],
        [vi("y", TensorProto.FLOAT, None)],
        [idx],
    )
    return onnx.shape_inference.infer_shapes(m)


@pytest.mark.parametrize("case", sorted(SELECTIONS))
def test_selections_lift_and_match_the_reference(case, tmp_path):
    model = SELECTIONS[case]()
    loaded = load_model(str(save(model, tmp_path / "s.onnx")))
    rng = np.random.default_rng(3)
    feeds = {
        i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(
            np.float32
        )
        for i in model.graph.input
    }
    a = _check_lifted(loaded, feeds, tol=1e-12)
    assert len(a.lifted) == 1, a.partition.excluded
    graph = a.lifted[0].graph
    assert {n.op for n in graph.nodes()} <= {
        Op.INPUT,
        Op.NEG,  # the op before the selection
        Op.RESHAPE,
        Op.MUL,
        Op.REDUCE_SUM,
        Op.ADD,
        Op.CAST,
    }


@pytest.mark.parametrize(
    "indices, shape, why",
    [
        ([[1], [1]], [2, 2, 8], "repeated indices"),
        ([[6]], [1, 2, 8], "out of range"),
        ([[0, 1]], [1, 8], "whole rows of the first axis"),
    ],
)
def test_a_scatter_nd_that_is_no_row_selection_stays_out(indices, shape, why, tmp_path):
    m = _scatter(indices, shape)
    a = analyse(load_model(str(save(m, tmp_path / "s.onnx"))))
    (out,) = [e for e in a.partition.excluded if e.op_type == "ScatterND"]
    assert out.category == "unsupported" and why in out.reason


def test_rotate_half_composes_into_one_signed_selection(tmp_path):
    """concat(-x[..., d/2:], x[..., :d/2]) is one multiply by [[0, -1], [1, 0]] and one sum over
    two blocks: the Neg is a -1 in P, not an op."""
    path = save(_decoder(), tmp_path / "m.onnx")
    loaded = load_model(str(path), {"x": (1, 32, 16)})
    x = np.random.default_rng(0).standard_normal((1, 32, 16)).astype(np.float32)
    a = _check_lifted(loaded, {"x": x}, tol=1e-6)
    assert len(a.lifted) == 1
    lr = a.lifted[0]
    ops = [n.op for n in lr.graph.nodes()]
    assert Op.NEG not in ops
    (p,) = [v for k, v in lr.extra_inputs.items() if k.startswith("mlso_select_")]
    assert np.array_equal(p.reshape(2, 2), [[0, -1], [1, 0]])
    (mask,) = [v for k, v in lr.extra_inputs.items() if k.startswith("mlso_mask_")]
    assert np.array_equal(mask.reshape(32, 32), np.tril(np.ones((32, 32))))


def test_interleaved_rotation_falls_back_to_one_selection_per_op(tmp_path):
    """concat(-x[..., 1::2], x[..., ::2]) (GPT-J style) composes into a map no factoring within
    16 blocks expresses; each op then lifts on its own and the result is still exact."""
    vi = helper.make_tensor_value_info
    m = _model(
        [
            helper.make_node("Slice", ["x", "s0", "big", "axl", "two"], ["ev"]),
            helper.make_node("Slice", ["x", "s1", "big", "axl", "two"], ["od"]),
            helper.make_node("Neg", ["od"], ["nod"]),
            helper.make_node("Concat", ["nod", "ev"], ["rot"], axis=-1),
            helper.make_node("Mul", ["rot", "x"], ["y"]),
        ],
        [vi("x", TensorProto.FLOAT, [2, 4, 64])],
        [vi("y", TensorProto.FLOAT, [2, 4, 64])],
        [
            _i64("s0", [0]),
            _i64("s1", [1]),
            _i64("big", [INT_MAX]),
            _i64("axl", [-1]),
            _i64("two", [2]),
        ],
    )
    loaded = load_model(str(save(m, tmp_path / "i.onnx")))
    x = np.random.default_rng(1).standard_normal((2, 4, 64)).astype(np.float32)
    a = _check_lifted(loaded, {"x": x}, tol=1e-6)  # the Mul rounds in fp32 in the reference
    assert len(a.lifted) == 1 and not [e for e in a.partition.excluded if e.op_type != "Constant"]


def test_a_selection_over_too_many_blocks_stays_out_with_a_reason(tmp_path):
    """Reversing a 64-long axis needs 64 blocks of one element: the node stays as it is."""
    m = _slice([-1], [-INT_MAX], [2], [-1])
    loaded = load_model(str(save(m, tmp_path / "r.onnx")))
    (e,) = [e for e in partition(loaded).excluded if e.op_type == "Slice"]
    assert "more than 16 separate blocks" in e.reason


def test_slice_with_run_time_bounds_says_so(tmp_path):
    vi = helper.make_tensor_value_info
    m = _model(
        [helper.make_node("Slice", ["x", "st", "en"], ["y"])],
        [vi("x", TensorProto.FLOAT, [4, 8]), vi("st", TensorProto.INT64, [2])],
        [vi("y", TensorProto.FLOAT, [2, 8])],  # declared, so only the bounds are unknown
        [_i64("en", [4, 8])],
    )
    loaded = load_model(str(save(m, tmp_path / "d.onnx")))
    reasons = [e.reason for e in partition(loaded).excluded if e.op_type == "Slice"]
    assert reasons and "computed at run time" in reasons[0]


# ---- masks ---------------------------------------------------------------------------------


def test_additive_mask_with_a_bias_lifts_to_a_0_1_mask_and_a_finite_bias(tmp_path):
    """scores + M, M = an ALiBi-like bias where keys are visible and -inf elsewhere: exp(scores +
    bias) times the 0/1 mask; no kernel input holds -inf."""
    s = 8
    i, j = np.meshgrid(np.arange(s), np.arange(s), indexing="ij")
    bias = np.where(j <= i, -0.5 * (i - j), -np.inf).astype(np.float32).reshape(1, 1, s, s)
    vi = helper.make_tensor_value_info
    m = _model(
        [
            helper.make_node("MatMul", ["q", "k"], ["sc"]),
            helper.make_node("Add", ["sc", "M"], ["sm"]),
            helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
            helper.make_node("MatMul", ["p", "v"], ["y"]),
        ],
        [
            vi("q", TensorProto.FLOAT, [1, 2, s, 16]),
            vi("k", TensorProto.FLOAT, [1, 2, 16, s]),
            vi("v", TensorProto.FLOAT, [1, 2, s, 16]),
        ],
        [vi("y", TensorProto.FLOAT, [1, 2, s, 16])],
        [numpy_helper.from_array(bias, "M")],
    )
    loaded = load_model(str(save(m, tmp_path / "a.onnx")))
    rng = np.random.default_rng(2)
    feeds = {
        "q": rng.standard_normal((1, 2, s, 16)).astype(np.float32),
        "k": rng.standard_normal((1, 2, 16, s)).astype(np.float32),
        "v": rng.standard_normal((1, 2, s, 16)).astype(np.float32),
    }
    a = _check_lifted(loaded, feeds, tol=1e-6)
    (lr,) = a.lifted
    assert "M" not in lr.graph.input_names
    names = set(lr.extra_inputs)
    assert any(n.startswith("mlso_mask_") for n in names)
    assert any(n.startswith("mlso_bias_") for n in names)
    for v in lr.extra_inputs.values():
        assert np.isfinite(v).all()


def test_fp16_export_mask_and_tables_cast_to_fp16(tmp_path):
    """An fp16 export computes the mask and the tables in fp32 and casts them: they fold through
    the Cast, the mask lifts as a 0/1 mask, and the region matches the reference."""
    path = save(_decoder(fp16=True), tmp_path / "h.onnx")
    loaded = load_model(str(path), {"x": (1, 96, 16)})
    assert not (_ops(loaded) & (MASK_OPS | {"Cast"}))
    x = np.random.default_rng(0).standard_normal((1, 96, 16)).astype(np.float16)
    a = _check_lifted(loaded, {"x": x}, tol=2e-3)
    (lr,) = a.lifted
    assert any(n.startswith("mlso_mask_") for n in lr.extra_inputs)
    assert Op.NEG not in {n.op for n in lr.graph.nodes()}


def test_a_selection_along_a_huge_axis_is_refused_before_any_map_is_built(tmp_path):
    """An axis over MAX_SELECT_AXIS elements is refused by its length alone (the element maps
    would cost memory at load), with its own reason."""
    m = _one_op(
        "Slice", [("x", [1, 1 << 21])], ["y"], [_i64("st", [0]), _i64("en", [8]), _i64("ax", [1])]
    )
    loaded = load_model(str(save(m, tmp_path / "h.onnx")))
    (e,) = [e for e in partition(loaded).excluded if e.op_type == "Slice"]
    assert "too long to lift" in e.reason


def test_a_trilu_mask_from_constant_of_shape_folds(tmp_path):
    """ConstantOfShape(seq, seq) -> Trilu -> Where: another common causal-mask spelling."""
    vi = helper.make_tensor_value_info
    m = _model(
        [
            helper.make_node("Shape", ["x"], ["s"], start=1, end=2),
            helper.make_node("Concat", ["s", "s"], ["ss"], axis=0),
            helper.make_node(
                "ConstantOfShape",
                ["ss"],
                ["ones"],
                value=numpy_helper.from_array(np.array([1], np.int64)),
            ),
            helper.make_node("Trilu", ["ones"], ["tri"], upper=0),
            helper.make_node("Cast", ["tri"], ["keep"], to=TensorProto.BOOL),
            helper.make_node("Where", ["keep", "fzero", "neginf"], ["mask"]),
            helper.make_node("Add", ["x", "mask"], ["y"]),
        ],
        [vi("x", TensorProto.FLOAT, [1, "seq", "seq"])],
        [vi("y", TensorProto.FLOAT, [1, "seq", "seq"])],
        [_f("fzero", 0.0), _f("neginf", -np.inf)],
    )
    loaded = load_model(str(save(m, tmp_path / "t.onnx")), {"x": (1, 128, 128)})
    assert _ops(loaded) == {"Add"}
    mask = next(
        numpy_helper.to_array(n.attribute[0].t)
        for n in loaded.graph.node
        if n.op_type == "Constant" and n.output[0] == "mask"
    )
    assert np.array_equal(np.isfinite(mask), np.tril(np.ones((128, 128), bool)))


def test_two_softmaxes_under_one_additive_mask_share_one_mask_input(tmp_path):
    """One causal mask added before two Softmaxes of a region is one kernel input, not two
    inputs of the same name."""
    s = 8
    mask = np.where(np.tril(np.ones((s, s), bool)), 0.0, -np.inf).astype(np.float32)
    vi = helper.make_tensor_value_info
    m = _model(
        [
            helper.make_node("MatMul", ["q", "k"], ["sc"]),
            helper.make_node("Add", ["sc", "M"], ["s1"]),
            helper.make_node("Softmax", ["s1"], ["p1"], axis=-1),
            helper.make_node("Mul", ["sc", "two"], ["sc2"]),
            helper.make_node("Add", ["sc2", "M"], ["s2"]),
            helper.make_node("Softmax", ["s2"], ["p2"], axis=-1),
            helper.make_node("Add", ["p1", "p2"], ["y"]),
        ],
        [vi("q", TensorProto.FLOAT, [2, s, 16]), vi("k", TensorProto.FLOAT, [2, 16, s])],
        [vi("y", TensorProto.FLOAT, [2, s, s])],
        [numpy_helper.from_array(mask, "M"), _f("two", 2.0)],
    )
    loaded = load_model(str(save(m, tmp_path / "two.onnx")))
    rng = np.random.default_rng(5)
    feeds = {
        "q": rng.standard_normal((2, s, 16)).astype(np.float32),
        "k": rng.standard_normal((2, 16, s)).astype(np.float32),
    }
    (lr,) = _check_lifted(loaded, feeds).lifted
    names = list(lr.graph.input_names)
    assert len(names) == len(set(names))
    assert sum(n.startswith("mlso_mask_") for n in names) == 1
