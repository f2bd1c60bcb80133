"""Float check: limits, the norm-wise metric, adversarial inputs that reach logits of +-100.

Why: exact-semantics equivalence says nothing about overflow or rounding. These tests make sure
the float check would catch a program that drops the softmax stabiliser or stores in too narrow a
type, and that the adversarial inputs really are adversarial (logits near +-100, norms x1e3).
"""

from __future__ import annotations

import numpy as np
import pytest

from mlso_cli.ir import PARTIAL
from mlso_cli.ir.ops import DType, Op
from mlso_cli.verify import LIMITS, adversarial_inputs, float_check, relative_error
from mlso_cli.verify.floatcheck import ADVERSARIAL, _peak, stored_inputs
from tests.fixtures import examples as ex


def test_limits_are_the_design_table():
    assert LIMITS == {DType.F32: 1e-5, DType.F16: 2e-3, DType.BF16: 1e-2}


def test_relative_error_is_normwise():
    ref = np.array([3.0, 4.0])
    assert relative_error(ref + [0.5, 0], ref) == pytest.approx(0.1)
    assert relative_error(np.array([np.inf, 0]), ref) == float("inf")
    assert relative_error(np.zeros(2) + 1e-3, np.zeros(2)) == pytest.approx(np.sqrt(2) * 1e-3)


@pytest.mark.parametrize("graph", ["plain", "split"])
def test_logit_inputs_reach_about_100(graph):
    kg = (
        ex.attention(2, 8, 4, 32)
        if graph == "plain"
        else ex.split_kv_attention(2, 8, 4, 32, 2, 2, 2)
    )
    xs = adversarial_inputs(kg, 0, "logits")
    peak = np.abs(xs[0] @ xs[1]).max()
    assert 90 < peak < 110
    unit = adversarial_inputs(kg, 0, "unit")
    np.testing.assert_array_equal(xs[2], unit[2])  # V does not feed the first matmul


def test_peak_observes_block_level_matmuls():
    kg = ex.split_kv_attention(2, 8, 4, 32, 2, 2, 2)
    xs = adversarial_inputs(kg, 1, "unit")
    gd = next(n for n in kg.nodes() if n.op is Op.GRAPH_DEF)
    first = next(n for n in gd.arg.nodes() if n.op is Op.MATMUL)
    assert _peak(kg, xs, first) == pytest.approx(np.abs(xs[0] @ xs[1]).max())


@pytest.mark.parametrize("dtype", [DType.F32, DType.F16, DType.BF16])
@pytest.mark.parametrize("kind", ["unit", "logits"])
def test_split_kv_attention_passes_at_every_scale(dtype, kind):
    ref = ex.attention(2, 8, 4, 32, dtype)
    cand = ex.split_kv_attention(2, 8, 4, 32, 2, 2, 2, dtype)
    rep = float_check(ref, cand, adversarial_inputs(ref, 3, kind), dtype)
    assert rep.ok, rep.detail
    assert rep.errors[0] < LIMITS[dtype] and rep.dtype is dtype


def _unstabilisable_attention(g: int, m: int, d: int, n: int) -> object:
    """softmax(Q K) V with exp(s) written as exp(s / 2) ** 2: exactly the same function, but the
    exp reaches the sum through a square, so codegen (and float32 mode) cannot keep it relative
    to a row max, and exp(100) overflows fp32."""
    from mlso_cli.ir import build as b
    from mlso_cli.ir.spec import check

    q, k, v = (
        b.input_(0, (g, m, d), DType.F32),
        b.input_(1, (g, d, n), DType.F32),
        b.input_(2, (g, n, d), DType.F32),
    )
    e = b.unary(Op.SQUARE, b.unary(Op.EXP, b.mul(b.matmul(q, k), b.const(0.5))))
    o = b.matmul(b.div(e, b.reduce(Op.REDUCE_SUM, e, 2)), v)
    return check(b.kernel_graph([q, k, v], [o], ["Q", "K", "V"], ["o"]))


def test_a_program_without_stabiliser_fails_at_logits_of_100():
    ref = ex.attention(2, 8, 4, 32)
    cand = _unstabilisable_attention(2, 8, 4, 32)
    xs = adversarial_inputs(ref, 3, "logits")
    rep = float_check(ref, cand, xs, "fp32")  # exp(s / 2) ** 2 at s = 100 overflows fp32
    assert not rep.ok and rep.errors[0] == float("inf")
    assert float_check(ref, cand, adversarial_inputs(ref, 3, "unit"), "fp32").ok
    # the lifted form itself is stabilised, as codegen computes it
    assert float_check(ref, ref, xs, "fp32").ok


def test_a_wrong_mapping_fails_the_float_check():
    ref = ex.attention(2, 8, 4, 32)
    bad = ex.split_kv_attention(2, 8, 4, 32, 2, 2, 2, omap=(1, 0, PARTIAL))
    rep = float_check(ref, bad, adversarial_inputs(ref, 0, "unit"), DType.F32)
    assert not rep.ok and "FAIL" in rep.detail


def test_norms_pass_at_scale_1e3_and_references_can_be_arrays():
    ref, cand = ex.rmsnorm_linear_pair(4, 32, 16, 2, 4, DType.F16)
    xs = adversarial_inputs(ref, 0, "scale")
    assert np.abs(xs[0]).max() > 100
    rep = float_check(ref, cand, xs, "fp16")
    assert rep.ok, rep.detail
    from mlso_cli.verify import run

    arrays = run(ref, stored_inputs(ref, xs), "float64")
    assert float_check(arrays, cand, xs, "fp16").errors == rep.errors


def test_ntrans_and_gated_mlp_within_bf16_limits():
    for ref, cand in (
        ex.ntrans_pair(4, 32, 2, DType.BF16),
        ex.gated_mlp_pair(4, 32, 16, 2, 4, DType.BF16),
    ):
        for kind in ("unit", "scale"):
            rep = float_check(ref, cand, adversarial_inputs(ref, 5, kind), DType.BF16)
            assert rep.ok, (kind, rep.detail)


def test_unknown_kind_is_an_error():
    with pytest.raises(ValueError, match="logits"):
        adversarial_inputs(ex.attention(1, 2, 2, 2), 0, "huge")
    assert set(ADVERSARIAL) >= {"unit", "scale", "logits"}


def test_an_output_the_dtype_cannot_hold_is_not_compared():
    """verify skips a sample whose float64 reference overflows the output dtype (fp16 above
    65504): any fp16 program must answer inf there, whatever the original model answers."""
    import numpy as np

    from mlso_cli.commands.verify import representable

    assert not representable(np.array([6.4e7, 1.0]), np.dtype(np.float16))
    assert representable(np.array([6.4e7, 1.0]), np.dtype(np.float32))
    assert representable(np.array([6.0e4, -6.0e4]), np.dtype(np.float16))
    assert representable(np.array([3, 7]), np.dtype(np.int64))


def test_float32_mode_runs_a_block_graph_whose_exp_is_masked_downstream():
    """exp(x) * mask inside a block graph: the mask tile is a source of the MUL only, so the
    topological order of the block's outputs could reach the EXP before it. The float32 mode's
    rewrite (codegen/ascomputed.py) raised KeyError there, and verify skipped its float check on
    every optimized masked softmax."""
    from mlso_cli.ir import build as b
    from mlso_cli.verify.interpreter import run
    from tests.fixtures.ugraphs import _Block

    x, mask = b.input_(0, (2, 8, 16), DType.F32), b.input_(1, (2, 8, 16), DType.F32)

    g = _Block((2, 1, 1), 1)
    xt = g.it(x, (0, None, None))
    mt = g.it(mask, (0, None, None))
    e = b.mul(b.unary(Op.EXP, xt), mt)
    p = b.div(e, b.reduce(Op.REDUCE_SUM, e, 2))
    (o,) = g.launch([b.save(p, 0, (0, None, None), DType.F32)])
    kg = b.kernel_graph([x, mask], [o], ["x", "mask"], ["y"])
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((2, 8, 16)).astype(np.float32) * 30
    ms = np.tril(np.ones((8, 16), np.float32))[None].repeat(2, 0)
    (got,) = run(kg, [xs, ms], "float32")
    want = np.exp(xs.astype(np.float64) - xs.max(-1, keepdims=True)) * ms
    want /= want.sum(-1, keepdims=True)
    assert relative_error(got, want) < 1e-5
