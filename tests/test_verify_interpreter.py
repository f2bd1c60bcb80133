"""The numpy interpreter: every op against plain numpy, block graphs executed literally, modes.

Why: the interpreter is the CPU oracle for every mapping a μGraph can express. If it agreed with
numpy only on friendly layouts, a wrong imap/fmap/omap could pass until a GPU run; so the tests
exercise partial outputs, an fmap on a grid-split dim, and mutations that must change the answer.
"""

from __future__ import annotations

import math
import time
from fractions import Fraction

import numpy as np
import pytest

from mlso_cli.ir import PARTIAL, InputMap, check
from mlso_cli.ir import build as b
from mlso_cli.ir.ops import DType, Op
from mlso_cli.verify.interpreter import run
from mlso_cli.verify.storage import round_bf16, round_to
from tests.fixtures import examples as ex

RNG = np.random.default_rng(1234)


def _kg(inputs, outputs):
    return check(b.kernel_graph(inputs, outputs))


def _softmax_v(q, k, v):
    s = q @ k
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


_erf = np.vectorize(math.erf)

UNARY_REF = {
    Op.EXP: np.exp,
    Op.SQUARE: np.square,
    Op.SQRT: np.sqrt,
    Op.RSQRT: lambda x: 1 / np.sqrt(x),
    Op.RECIPROCAL: lambda x: 1 / x,
    Op.NEG: np.negative,
    Op.SILU: lambda x: x / (1 + np.exp(-x)),
    Op.SIGMOID: lambda x: 1 / (1 + np.exp(-x)),
    Op.TANH: np.tanh,
    Op.ERF: _erf,
    Op.GELU: lambda x: 0.5 * x * (1 + _erf(x / np.sqrt(2))),
    Op.RELU: lambda x: np.maximum(x, 0),
}
BINARY_REF = {
    Op.ADD: np.add,
    Op.SUB: np.subtract,
    Op.MUL: np.multiply,
    Op.DIV: np.divide,
    Op.MAX: np.maximum,
}


@pytest.mark.parametrize("op", list(UNARY_REF), ids=lambda o: o.value)
def test_unary_ops_match_numpy(op):
    x = b.input_(0, (3, 5), DType.F32)
    kg = _kg([x], [b.unary(op, x)])
    xv = RNG.uniform(0.1, 2.0, (3, 5)) * (
        1 if op in (Op.SQRT, Op.RSQRT) else RNG.choice([-1, 1], (3, 5))
    )
    np.testing.assert_allclose(run(kg, [xv])[0], UNARY_REF[op](xv), rtol=1e-12)


@pytest.mark.parametrize("op", list(BINARY_REF), ids=lambda o: o.value)
def test_binary_ops_broadcast_like_numpy(op):
    x, y = b.input_(0, (2, 3, 4), DType.F32), b.input_(1, (3, 1), DType.F32)
    kg = _kg([x, y], [b.binary(op, x, y)])
    xv, yv = RNG.standard_normal((2, 3, 4)), RNG.uniform(0.5, 1.5, (3, 1))
    np.testing.assert_allclose(run(kg, [xv, yv])[0], BINARY_REF[op](xv, yv), rtol=1e-12)


def test_matmul_reductions_views_and_consts():
    a, w = b.input_(0, (2, 3, 4), DType.F32), b.input_(1, (4, 5), DType.F32)
    mm = b.matmul(a, w)
    outs = [
        mm,
        b.reduce(Op.REDUCE_SUM, mm, 2),
        b.reduce(Op.REDUCE_MEAN, mm, 1),
        b.reduce(Op.REDUCE_MAX, mm, 0),
        b.transpose(mm, (2, 0, 1)),
        b.reshape(mm, (6, 5)),
        b.broadcast_to(b.reduce(Op.REDUCE_SUM, mm, 2), (2, 3, 5)),
        b.mul(mm, b.const(Fraction(1, 3))),
        b.cast(mm, DType.F16),
    ]
    kg = _kg([a, w], outs)
    av, wv = RNG.standard_normal((2, 3, 4)), RNG.standard_normal((4, 5))
    m = av @ wv
    want = [
        m,
        m.sum(2, keepdims=True),
        m.mean(1, keepdims=True),
        m.max(0, keepdims=True),
        m.transpose(2, 0, 1),
        m.reshape(6, 5),
        np.broadcast_to(m.sum(2, keepdims=True), (2, 3, 5)),
        m / 3,
        m,
    ]
    for got, exp in zip(run(kg, [av, wv]), want):
        np.testing.assert_allclose(got, exp, rtol=1e-12)


def test_thread_graph_body_is_evaluated_elementwise():
    x, y = b.input_(0, (4, 4), DType.F32), b.input_(1, (4, 4), DType.F32)
    bx, by = b.iter_(0, (2, 4), DType.F32, False), b.iter_(1, (2, 4), DType.F32, False)
    t0, t1 = b.thread_in(0), b.thread_in(1)
    body = b.mul(b.unary(Op.SIGMOID, t0), b.add(t1, b.const(2)))
    out = b.save(b.thread(body, [bx, by]), 0, (0, None, None), DType.F32)
    bg = b.block_graph((2, 1, 1), 1, [InputMap((0, None, None)), InputMap((0, None, None))], [out])
    (o,) = b.graph_def([x, y], bg)
    kg = _kg([x, y], [o])
    xv, yv = RNG.standard_normal((4, 4)), RNG.standard_normal((4, 4))
    np.testing.assert_allclose(run(kg, [xv, yv])[0], (yv + 2) / (1 + np.exp(-xv)), rtol=1e-12)


# ---- block graphs -------------------------------------------------------------------------------


def test_fmap_on_a_grid_split_dim_walks_the_blocks_chunk():
    """X (8, 4): grid x splits rows in 2; the loop walks each block's 4 rows in 2 steps of 2."""
    x = b.input_(0, (8, 4), DType.F32)
    t = b.iter_(0, (2, 4), DType.F32, True)
    out = b.save(b.accumulate(Op.ACC_SUM, b.mul(t, t)), 0, (0, None, None), DType.F32)
    (o,) = b.graph_def([x], b.block_graph((2, 1, 1), 2, [InputMap((0, None, None), 0)], [out]))
    kg = _kg([x], [o])
    xv = RNG.standard_normal((8, 4))
    sq = xv * xv
    want = np.concatenate([sq[0:2] + sq[2:4], sq[4:6] + sq[6:8]])
    np.testing.assert_allclose(run(kg, [xv])[0], want, rtol=1e-12)


def test_partial_outputs_are_leading_dims_in_grid_order():
    """Split-K matmul: grid (row tiles, -, K splits); partial dim z, combined by a reduce."""
    x, w = b.input_(0, (4, 12), DType.F32), b.input_(1, (12, 3), DType.F32)
    tx, tw = b.iter_(0, (2, 2), DType.F32, True), b.iter_(1, (2, 3), DType.F32, True)
    acc = b.save(b.accumulate(Op.ACC_SUM, b.matmul(tx, tw)), 0, (0, None, PARTIAL), DType.F32)
    bg = b.block_graph(
        (2, 1, 3), 2, [InputMap((0, None, 1), 1), InputMap((None, None, 0), 0)], [acc]
    )
    (part,) = b.graph_def([x, w], bg)
    kg = _kg([x, w], [part, b.reduce(Op.REDUCE_SUM, part, 0)])
    xv, wv = RNG.standard_normal((4, 12)), RNG.standard_normal((12, 3))
    got_part, got = run(kg, [xv, wv])
    assert got_part.shape == (3, 4, 3)
    for z in range(3):
        np.testing.assert_allclose(
            got_part[z], xv[:, 4 * z : 4 * z + 4] @ wv[4 * z : 4 * z + 4], rtol=1e-12
        )
    np.testing.assert_allclose(got[0], xv @ wv, rtol=1e-12)


SMALL = dict(g=2, m=8, d=4, n=32, rows=2, splits=2, loop=2)


def _qkv(g=2, m=8, d=4, n=32, scale=1.0):
    return [
        RNG.standard_normal((g, m, d)) * scale,
        RNG.standard_normal((g, d, n)) * scale,
        RNG.standard_normal((g, n, d)),
    ]


@pytest.mark.parametrize("mode,tol", [("float64", 1e-13), ("simulate", 1e-13), ("float32", 1e-5)])
def test_split_kv_attention_equals_softmax(mode, tol):
    kg = ex.split_kv_attention(**SMALL)
    xs = _qkv()
    out = run(kg, xs, mode)[0]
    ref = _softmax_v(*xs)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < tol


def test_float32_running_max_survives_logits_of_100():
    kg, plain = ex.split_kv_attention(**SMALL), ex.attention(2, 8, 4, 32)
    q, k, v = _qkv()
    s = np.abs(q @ k).max()
    q, k = q * np.sqrt(100 / s), k * np.sqrt(100 / s)
    assert 99 < np.abs(q @ k).max() < 101
    ref = _softmax_v(q, k, v)
    out = run(kg, [q, k, v], "float32")[0]
    assert np.all(np.isfinite(out))
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5
    # exact semantics in float64 agree; the lifted kernel graph's exp(q @ k) overflows fp32, yet
    # float32 mode keeps it relative to its row max, as codegen does (stabilise.stabilised)
    np.testing.assert_allclose(run(kg, [q, k, v], "float64")[0], ref, rtol=1e-9)
    with np.errstate(over="ignore"):
        assert not np.all(np.isfinite(np.exp((q @ k).astype(np.float32))))
    out = run(plain, [q, k, v], "float32")[0]
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


def test_simulate_rounds_fp16_and_bf16_storage_only():
    xs = _qkv()
    for dt, lo, hi in [(DType.F16, 1e-5, 2e-3), (DType.BF16, 1e-4, 1e-2)]:
        kg = ex.split_kv_attention(**SMALL, dtype=dt)
        stored = [round_to(x, dt) for x in xs]
        ref = _softmax_v(*stored)
        out = run(kg, xs, "simulate")[0]
        err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        assert lo < err < hi, (dt, err)
        np.testing.assert_array_equal(round_to(out, dt), out)  # outputs are stored values
        # float64 mode is the exact semantics: no rounding at all
        np.testing.assert_allclose(run(kg, xs, "float64")[0], _softmax_v(*xs), rtol=1e-12)


def test_bf16_rounds_to_nearest_even_on_the_top_16_bits():
    one = 1.0
    vals = np.array([one + 2**-8, one + 3 * 2**-8, one + 2**-8 + 2**-20, -2.0 - 2**-7, 3.0e38])
    want = np.array([one, one + 2**-6, one + 2**-7, -2.0, 2.9914e38], dtype=np.float32)
    got = round_bf16(vals)
    np.testing.assert_allclose(got[:4], want[:4], rtol=0)
    assert abs(got[4] / 3.0e38 - 1) < 2**-8


def _mutated_differs(**kw):
    xs = _qkv()
    good = run(ex.split_kv_attention(**SMALL), xs)[0]
    bad = run(ex.split_kv_attention(**SMALL, **kw), xs)[0]
    np.testing.assert_allclose(good, _softmax_v(*xs), rtol=1e-12)
    return not np.allclose(good, bad)


def test_wrong_imap_gives_a_wrong_answer():
    # grid x (batch) and y (row tiles) both have size 2: swapping them keeps every tile shape
    assert _mutated_differs(imap_q=(1, 0, None))


def test_wrong_omap_gives_a_wrong_answer():
    assert _mutated_differs(omap=(1, 0, PARTIAL))


def _row_block_matmul(a_map: InputMap) -> object:
    """acc_sum over the loop of A_tile @ B_tile, saved along rows: A (8, 8) @ B (8, 3)."""
    a, w = b.input_(0, (8, 8), DType.F32), b.input_(1, (8, 3), DType.F32)
    ta, tw = b.iter_(0, (4, 4), DType.F32, True), b.iter_(1, (4, 3), DType.F32, True)
    out = b.save(b.accumulate(Op.ACC_SUM, b.matmul(ta, tw)), 0, (0, None, None), DType.F32)
    bg = b.block_graph((2, 1, 1), 2, [a_map, InputMap((None, None, None), 0)], [out])
    (o,) = b.graph_def([a, w], bg)
    return _kg([a, w], [o])


def test_wrong_fmap_gives_a_wrong_answer():
    """Moving A's fmap from its K dim to its row dim (and the grid split the other way, the only
    way a tile keeps its shape when the fmap moves) must change the answer."""
    av, wv = RNG.standard_normal((8, 8)), RNG.standard_normal((8, 3))
    right = run(_row_block_matmul(InputMap((0, None, None), 1)), [av, wv])[0]
    wrong = run(_row_block_matmul(InputMap((1, None, None), 0)), [av, wv])[0]
    np.testing.assert_allclose(right, av @ wv, rtol=1e-12)
    assert not np.allclose(right, wrong)


def test_interpreter_is_fast_at_test_size():
    kg = ex.split_kv_attention(g=2, m=64, d=16, n=256, rows=2, splits=4, loop=4)
    xs = _qkv(2, 64, 16, 256)
    t = time.perf_counter()
    for mode in ("float64", "simulate", "float32"):
        run(kg, xs, mode)
    assert time.perf_counter() - t < 0.5


def test_bad_mode_and_bad_inputs_are_rejected():
    kg = ex.attention(1, 2, 2, 2)
    with pytest.raises(ValueError, match="mode"):
        run(kg, _qkv(1, 2, 2, 2), "float16")
    with pytest.raises(ValueError, match="shape"):
        run(kg, _qkv(1, 2, 2, 4))
    with pytest.raises(ValueError, match="inputs"):
        run(kg, _qkv(1, 2, 2, 2)[:2])


def test_in_block_normalisation_at_logits_of_100():
    """One kernel: the POST phase divides the two rescaling accumulators (FlashAttention form)."""
    g, m, d, n, loop = 2, 8, 4, 32, 4
    q, k, v = (
        b.input_(0, (g, m, d), DType.F16),
        b.input_(1, (g, d, n), DType.F16),
        b.input_(2, (g, n, d), DType.F16),
    )
    bq = b.iter_(0, (1, m // 2, d), DType.F16, False)
    bk, bv = (
        b.iter_(1, (1, d, n // loop), DType.F16, True),
        b.iter_(2, (1, n // loop, d), DType.F16, True),
    )
    s = b.matmul(bq, bk)
    o = b.div(b.accumulate(Op.ACC_EXP_WSUM, s, bv), b.accumulate(Op.ACC_EXP_SUM, s))
    maps = [InputMap((0, 1, None)), InputMap((0, None, None), 2), InputMap((0, None, None), 1)]
    (out,) = b.graph_def(
        [q, k, v], b.block_graph((g, 2, 1), loop, maps, [b.save(o, 0, (0, 1, None), DType.F16)])
    )
    kg = _kg([q, k, v], [out])
    xs = _qkv()
    s_max = np.abs(xs[0] @ xs[1]).max()
    xs = [xs[0] * np.sqrt(100 / s_max), xs[1] * np.sqrt(100 / s_max), xs[2]]
    ref = _softmax_v(*[round_to(x, DType.F16) for x in xs])
    for mode in ("float32", "simulate"):
        got = run(kg, xs, mode)[0]
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-3, mode
