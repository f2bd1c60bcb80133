"""Field equivalence: equivalent rewrites accepted with a bound <= 2^-60, wrong ones rejected.

Why: this check gates every candidate of the search. Its two failure modes are costly in opposite
ways: rejecting a correct fusion (because two canonical forms differ in the field) loses the
optimisation; accepting a wrong one ships a wrong model. Both directions are tested on the
rewrites the search produces (split-KV attention, norm + linear, ...) and on the canonical forms
DESIGN.md lists.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from mlso_cli.ir import PARTIAL, InputMap, check
from mlso_cli.ir import build as b
from mlso_cli.ir.ops import DType, Op
from mlso_cli.verify import field as field_mod
from mlso_cli.verify.degree import analyse
from mlso_cli.verify.equivalence import Verdict, check_equivalent, trial_bound
from tests.fixtures import examples as ex

F32 = DType.F32
TARGET = 2.0**-60


def _x(i=0, shape=(4, 6)):
    return b.input_(i, shape, F32)


def _kg(inputs, outputs):
    return check(b.kernel_graph(inputs, outputs))


def _unary_pair(make_a, make_b, shape=(4, 6)):
    x = _x(0, shape)
    return _kg([x], [make_a(x)]), _kg([x], [make_b(x)])


def _sigmoid_prims(x):
    return b.div(b.const(1), b.add(b.const(1), b.unary(Op.EXP, b.unary(Op.NEG, x))))


def _abc():
    return _x(0, (4, 6)), _x(1, (4, 6)), _x(2, (6, 3))


def _distributive():
    a, c, w = _abc()
    return _kg([a, c, w], [b.matmul(b.add(a, c), w)]), _kg(
        [a, c, w], [b.add(b.matmul(a, w), b.matmul(c, w))]
    )


def _exp_sum():
    a, c, _ = _abc()
    return _kg([a, c], [b.unary(Op.EXP, b.add(a, c))]), _kg(
        [a, c], [b.mul(b.unary(Op.EXP, a), b.unary(Op.EXP, c))]
    )


def _stabilised_softmax():
    """softmax with an explicit max subtraction (what float code computes) vs without."""
    x = _x(0, (4, 6))
    e = b.unary(Op.EXP, x)
    plain = b.div(e, b.reduce(Op.REDUCE_SUM, e, 1))
    es = b.unary(Op.EXP, b.sub(x, b.reduce(Op.REDUCE_MAX, x, 1)))
    return _kg([x], [plain]), _kg([x], [b.div(es, b.reduce(Op.REDUCE_SUM, es, 1))])


def _thread_fused():
    """sigmoid(x) * (y + 2) as kernel ops vs fused in registers (a THREAD op in a block graph)."""
    x, y = _x(0, (4, 4)), _x(1, (4, 4))
    ref = _kg([x, y], [b.mul(b.unary(Op.SIGMOID, x), b.add(y, b.const(2)))])
    bx, by = b.iter_(0, (2, 4), F32, False), b.iter_(1, (2, 4), F32, False)
    body = b.mul(_sigmoid_prims(b.thread_in(0)), b.add(b.thread_in(1), b.const(2)))
    out = b.save(b.thread(body, [bx, by]), 0, (0, None, None), F32)
    bg = b.block_graph((2, 1, 1), 1, [InputMap((0, None, None)), InputMap((0, None, None))], [out])
    (o,) = b.graph_def([x, y], bg)
    return ref, _kg([x, y], [o])


EQUIVALENT = {
    "thread_fused": _thread_fused,
    "stabilised_softmax": _stabilised_softmax,
    "split_kv_attention": lambda: ex.gqa_pair(2, 8, 4, 32, 2, 2, 2),
    "split_kv_attention_fp16": lambda: ex.gqa_pair(2, 8, 4, 32, 2, 2, 2, DType.F16),
    "square": lambda: _unary_pair(lambda x: b.mul(x, x), lambda x: b.unary(Op.SQUARE, x)),
    "rsqrt": lambda: _unary_pair(
        lambda x: b.unary(Op.RSQRT, x), lambda x: b.unary(Op.RECIPROCAL, b.unary(Op.SQRT, x))
    ),
    "silu": lambda: _unary_pair(
        lambda x: b.unary(Op.SILU, x), lambda x: b.mul(x, b.unary(Op.SIGMOID, x))
    ),
    "sigmoid": lambda: _unary_pair(lambda x: b.unary(Op.SIGMOID, x), _sigmoid_prims),
    "silu_prims": lambda: _unary_pair(
        lambda x: b.unary(Op.SILU, x), lambda x: b.mul(x, _sigmoid_prims(x))
    ),
    "tanh": lambda: _unary_pair(
        lambda x: b.unary(Op.TANH, x),
        lambda x: b.sub(b.mul(b.const(2), _sigmoid_prims(b.mul(b.const(2), x))), b.const(1)),
    ),
    "relu": lambda: _unary_pair(
        lambda x: b.unary(Op.RELU, x), lambda x: b.binary(Op.MAX, b.const(0), x)
    ),
    "mean": lambda: _unary_pair(
        lambda x: b.reduce(Op.REDUCE_MEAN, x, 1),
        lambda x: b.mul(b.reduce(Op.REDUCE_SUM, x, 1), b.const(Fraction(1, 6))),
    ),
    "div_is_mul_inverse": lambda: _unary_pair(
        lambda x: b.div(x, b.const(3)), lambda x: b.mul(x, b.const(Fraction(1, 3)))
    ),
    "distributive_matmul": _distributive,
    "exp_of_sum": _exp_sum,
    "rmsnorm_linear": lambda: ex.rmsnorm_linear_pair(4, 32, 16, 2, 4),
    "gated_mlp": lambda: ex.gated_mlp_pair(4, 32, 16, 2, 4),
    "lora": lambda: ex.lora_pair(4, 32, 16, 4, 2, 4),
    "ntrans": lambda: ex.ntrans_pair(4, 32, 2),
}


@pytest.mark.parametrize("name", list(EQUIVALENT))
def test_equivalent_pairs_are_accepted_within_the_bound(name):
    a, c = EQUIVALENT[name]()
    v = check_equivalent(a, c, seed=11)
    assert v.equivalent, v.detail
    assert 0 < v.bound <= TARGET and v.trials >= 1
    assert check_equivalent(c, a, seed=12).equivalent


def _dropped_term():
    a, c, w = _abc()
    return _distributive()[0], _kg([a, c, w], [b.matmul(a, w)])


def _swapped_operands():
    a, c = _x(0, (5, 5)), _x(1, (5, 5))
    return _kg([a, c], [b.matmul(a, c)]), _kg([a, c], [b.matmul(c, a)])


def _missing_normalisation():
    q, k, v = _x(0, (2, 4, 3)), _x(1, (2, 3, 8)), _x(2, (2, 8, 3))
    e = b.unary(Op.EXP, b.matmul(q, k))
    return ex.attention(2, 4, 3, 8), _kg([q, k, v], [b.matmul(e, v)])


def _wrong_constant():
    return _unary_pair(
        lambda x: b.mul(x, b.const(Fraction(1, 3))), lambda x: b.mul(x, b.const(0.333333))
    )


def _wrong_eps():
    ref, _ = ex.rmsnorm_linear_pair(4, 32, 16, 2, 4)
    x, w = ref.inputs
    return ref, _kg([x, w], [b.matmul(ex.rmsnorm(x, Fraction(1e-5)), w)])


def _exp_not_additive():
    a, c, _ = _abc()
    return _exp_sum()[0], _kg([a, c], [b.add(b.unary(Op.EXP, a), b.unary(Op.EXP, c))])


def _wrong_imap():
    return ex.attention(2, 8, 4, 32), ex.split_kv_attention(
        2, 8, 4, 32, 2, 2, 2, imap_q=(1, 0, None)
    )


def _wrong_omap():
    return ex.attention(2, 8, 4, 32), ex.split_kv_attention(
        2, 8, 4, 32, 2, 2, 2, omap=(1, 0, PARTIAL)
    )


def _wrong_combine():
    """Split-KV with the partial numerators and denominators divided before summing."""
    ref, cand = ex.gqa_pair(2, 8, 4, 32, 2, 2, 2)
    gd_out = cand.outputs[0]
    pnum, pden = (n for n in _walk(gd_out) if n.op is Op.PROJ)
    o = b.reshape(b.reduce(Op.REDUCE_SUM, b.div(pnum, pden), 0), (2, 8, 4))
    return ref, _kg(list(cand.inputs), [o])


def _walk(n):
    from mlso_cli.ir.node import toposort

    return sorted(
        (x for x in toposort([n])),
        key=lambda x: (x.op.value, x.arg if isinstance(x.arg, int) else 0),
    )


def _silu_vs_sigmoid():
    return _unary_pair(lambda x: b.unary(Op.SILU, x), lambda x: b.unary(Op.SIGMOID, x))


def _wrong_softmax_scale():
    def attn(scale):
        q, k = _x(0, (4, 3)), _x(1, (3, 6))
        e = b.unary(Op.EXP, b.mul(b.matmul(q, k), b.const(scale)))
        return _kg([q, k], [b.div(e, b.reduce(Op.REDUCE_SUM, e, 1))])

    return attn(Fraction(1, 8)), attn(Fraction(1, 4))


def _stabiliser_with_wrong_axis():
    x = _x(0, (4, 6))
    e = b.unary(Op.EXP, x)
    es = b.unary(Op.EXP, b.sub(x, b.reduce(Op.REDUCE_MAX, x, 0)))  # max over the wrong axis
    return _stabilised_softmax()[0], _kg([x], [b.div(es, b.reduce(Op.REDUCE_SUM, e, 1))])


NOT_EQUIVALENT = {
    "wrong_softmax_scale": _wrong_softmax_scale,
    "stabiliser_with_wrong_axis": _stabiliser_with_wrong_axis,
    "dropped_term": _dropped_term,
    "swapped_matmul_operands": _swapped_operands,
    "missing_normalisation": _missing_normalisation,
    "wrong_constant": _wrong_constant,
    "wrong_eps": _wrong_eps,
    "exp_not_additive": _exp_not_additive,
    "wrong_imap": _wrong_imap,
    "wrong_omap": _wrong_omap,
    "wrong_split_combine": _wrong_combine,
    "silu_vs_sigmoid": _silu_vs_sigmoid,
}


@pytest.mark.parametrize("name", list(NOT_EQUIVALENT))
def test_non_equivalent_pairs_are_rejected(name):
    a, c = NOT_EQUIVALENT[name]()
    v = check_equivalent(a, c, seed=13)
    assert not v.equivalent and v.bound == 0.0 and "differs" in v.detail, v


def test_interface_differences_are_reported():
    x, y = _x(0, (4, 6)), _x(1, (4, 6))
    base = _kg([x, y], [b.add(x, y)])
    cases = {
        "outputs": _kg([x, y], [b.add(x, y), x]),
        "shape": _kg([x, y], [b.reduce(Op.REDUCE_SUM, b.add(x, y), 0)]),
        "dtype": _kg([x, y], [b.cast(b.add(x, y), DType.F16)]),
        "inputs": _kg([x], [b.add(x, x)]),
    }
    for word, other in cases.items():
        v = check_equivalent(base, other, seed=1)
        assert not v.equivalent and word in v.detail and v.trials == 0, (word, v)


def test_verdicts_are_deterministic_for_a_seed_and_vary_without():
    a, c = ex.gqa_pair(2, 8, 4, 32, 2, 2, 2)
    v1, v2 = check_equivalent(a, c, seed=5), check_equivalent(a, c, seed=5)
    assert v1 == v2 and isinstance(v1, Verdict)
    details = {check_equivalent(a, c).detail for _ in range(3)}
    assert all("trials agreed" in d for d in details)


def test_union_bound_over_candidates_tightens_the_target():
    a, c = ex.gqa_pair(2, 8, 4, 32, 2, 2, 2)
    first = check_equivalent(a, c, seed=2)
    later = check_equivalent(a, c, seed=2, runs_so_far=10**6)
    assert first.bound <= TARGET / 2
    assert later.bound <= TARGET / (10**6 * (10**6 + 1)) and later.trials > first.trials
    loose = check_equivalent(a, c, seed=2, target_bound=1e-3)
    assert loose.trials == 1 and loose.bound <= 5e-4


def test_degree_analysis_of_attention():
    ref, cand = ex.gqa_pair(2, 8, 4, 32, 2, 2, 2)
    pr, pc = analyse(ref), analyse(cand)
    (o_ref,), (o_cand,) = pr.outputs, pc.outputs
    assert (o_ref.n, o_ref.d) == (2, 1)  # (E V) / s with a common row denominator
    assert (o_cand.n, o_cand.d) == (2, 1)  # sum of partial numerators / sum of partial denominators
    assert pr.has_exp and pr.exp_args.degree == 2 and not o_ref.q
    assert pr.risk == 2 * 8 and pc.risk == 2 * 8  # one inverted row sum per (batch, row), degree 1
    # an output entry reads its row's 32 scores through E V and through the row sum, in each
    # program: 128 exp atoms; C has two atoms per monomial, each may meet any of the other 127
    assert (o_ref.ne, o_cand.ne, o_ref.an, o_ref.ad) == (64, 64, 1, 1)
    fld = field_mod.Field.draw(np.random.default_rng(0))
    eps = trial_bound(pr, pc, fld)
    collisions = 2 * 127 * 2 / fld.q  # scores Q.K have degree 2
    assert eps == pytest.approx((3 / fld.q + collisions) / (1 - 2 * 32 / fld.q), rel=1e-12)


def test_degree_grows_for_sums_of_different_denominators():
    x = _x(0, (4, 8))
    inv_sum = _kg([x], [b.reduce(Op.REDUCE_SUM, b.unary(Op.RECIPROCAL, x), 1)])
    row_sum = _kg([x], [b.reduce(Op.REDUCE_SUM, b.div(x, b.reduce(Op.REDUCE_SUM, x, 1)), 1)])
    (o,) = analyse(inv_sum).outputs
    assert (o.n, o.d) == (7, 8)  # sum of 8 reciprocals, cleared
    (o,) = analyse(row_sum).outputs
    assert (o.n, o.d) == (1, 1)  # x / rowsum summed along the row keeps one denominator


def test_zero_denominators_resample_the_inputs(monkeypatch):
    a, c = _unary_pair(
        lambda x: b.unary(Op.RECIPROCAL, x), lambda x: b.div(b.const(1), x), shape=(3,)
    )
    calls = {"n": 0}
    real = field_mod.Field.random

    def zeros_first(self, shape, rng):
        calls["n"] += 1
        out = real(self, shape, rng)
        if calls["n"] == 1:
            out.p[...] = 0
        return out

    monkeypatch.setattr(field_mod.Field, "random", zeros_first)
    v = check_equivalent(a, c, seed=3)
    assert v.equivalent and calls["n"] > v.trials


def test_unreachable_bound_is_not_accepted():
    x = _x(0, (1, 2))
    kg = _kg([x], [b.mul(x, x)])
    v = check_equivalent(kg, kg, seed=1, max_trials=1)
    assert not v.equivalent and "did not reach" in v.detail and v.trials == 1


def test_fp16_and_fp32_inputs_are_different_interfaces():
    ref = ex.attention(1, 2, 2, 4)
    v = check_equivalent(ref, ex.attention(1, 2, 2, 4, DType.F16), seed=0)
    assert not v.equivalent and "input 0" in v.detail


def test_wrong_fmap_is_rejected():
    """A split-K matmul whose loop walks A's rows instead of its K dim."""

    def graph(a_map):
        a, w = b.input_(0, (8, 8), F32), b.input_(1, (8, 3), F32)
        ta, tw = b.iter_(0, (4, 4), F32, True), b.iter_(1, (4, 3), F32, True)
        out = b.save(b.accumulate(Op.ACC_SUM, b.matmul(ta, tw)), 0, (0, None, None), F32)
        (o,) = b.graph_def(
            [a, w], b.block_graph((2, 1, 1), 2, [a_map, InputMap((None, None, None), 0)], [out])
        )
        return _kg([a, w], [o])

    a, w = b.input_(0, (8, 8), F32), b.input_(1, (8, 3), F32)
    ref = _kg([a, w], [b.matmul(a, w)])
    assert check_equivalent(ref, graph(InputMap((0, None, None), 1)), seed=4).equivalent
    assert not check_equivalent(ref, graph(InputMap((1, None, None), 0)), seed=4).equivalent


def test_an_exp_arguments_unused_p_residue_is_never_computed(monkeypatch):
    """Lazy residues: Q@K feeds only exp, which reads the q-residue, so no matmul mod p runs
    for it; E@V is exp-dependent, so no matmul mod q runs for it."""
    from mlso_cli.verify import fieldrun

    calls: list[int] = []
    real = field_mod.matmul_mod

    def counting(x, y, r):
        calls.append(r)
        return real(x, y, r)

    monkeypatch.setattr(field_mod, "matmul_mod", counting)
    ref = ex.attention(2, 8, 4, 32)
    fld = field_mod.Field.draw(np.random.default_rng(0))
    rng = np.random.default_rng(1)
    fieldrun.run_field(ref, [fld.random(n.shape, rng) for n in ref.inputs], fld)
    assert calls == [fld.q, fld.p]


def test_oracle_outputs_keep_q_residues():
    """rsqrt is an oracle atom with both residues, so a norm's output is exp-free and its p- and
    q-residue tests multiply: what is left of the per-trial bound is the chance that the two
    programs' rsqrt atoms of a row are identified although their arguments differ (degree 2 mod
    p). No bad-prime term: mean(x^2) + eps has dyadic coefficients, whose odd parts are small."""
    eps = Fraction(1, 2**20)
    x = _x(0, (4, 32))
    ref = _kg([x], [ex.rmsnorm(x, eps)])
    ss = b.reduce(Op.REDUCE_SUM, b.mul(x, x), 1)
    cand = _kg(
        [x], [b.mul(x, b.unary(Op.RSQRT, b.add(b.mul(ss, b.const(Fraction(1, 32))), b.const(eps))))]
    )
    pr, pc = analyse(ref), analyse(cand)
    assert pr.outputs[0].q and pc.outputs[0].q
    fld = field_mod.Field.draw(np.random.default_rng(0))
    eps = trial_bound(pr, pc, fld)
    assert 2 / fld.p <= eps <= 2.001 / fld.p
    v = check_equivalent(ref, cand, seed=0)
    assert v.equivalent and v.trials <= 4


@pytest.mark.parametrize("spelling", ["div_sqrt2_fp32", "mul_inv_sqrt2_fp32", "mul_inv_sqrt2_fp16"])
def test_fused_gelu_meets_its_erf_spelling(spelling):
    """Exporters write GELU as x * 0.5 * (1 + erf(x / 1.4142135)); the fused Op.GELU must be
    accepted against it (its oracle used to be a separate Phi that never met erf), while an erf
    argument scaled by another constant is still told apart."""
    x = b.input_(0, (4, 16), DType.F32)
    fused = check(b.kernel_graph([x], [b.unary(Op.GELU, x)]))

    def erf_form(scale_op: Op, k: float) -> object:
        arg = (b.div if scale_op is Op.DIV else b.mul)(x, b.const(Fraction(k)))
        one_plus = b.add(b.unary(Op.ERF, arg), b.const(Fraction(1)))
        return check(b.kernel_graph([x], [b.mul(b.mul(x, b.const(Fraction(1, 2))), one_plus)]))

    k = {
        "div_sqrt2_fp32": (Op.DIV, float(np.float32(2**0.5))),
        "mul_inv_sqrt2_fp32": (Op.MUL, float(np.float32(0.5**0.5))),
        "mul_inv_sqrt2_fp16": (Op.MUL, float(np.float16(0.5**0.5))),
    }[spelling]
    assert check_equivalent(fused, erf_form(*k), seed=3).equivalent
    assert not check_equivalent(fused, erf_form(Op.MUL, 0.75), seed=3).equivalent
