"""μGraph IR: builders, spec checker, printer, JSON round trip, canonical hash."""

from __future__ import annotations

import pytest

from mlso_cli.codegen.budget import check as budget_check
from mlso_cli.ir import (
    PARTIAL,
    DType,
    InputMap,
    Op,
    SpecError,
    check,
    dumps,
    format_graph,
    graph_hash,
    loads,
)
from mlso_cli.ir import build as b


def plain_attention(g=2, m=16, d=8, n=64):
    Q = b.input_(0, (g, m, d), DType.F32)
    K = b.input_(1, (g, d, n), DType.F32)
    V = b.input_(2, (g, n, d), DType.F32)
    E = b.unary(Op.EXP, b.matmul(Q, K))
    O = b.matmul(b.div(E, b.reduce(Op.REDUCE_SUM, E, 2)), V)
    return b.kernel_graph([Q, K, V], [O], ["Q", "K", "V"], ["O"])


def split_kv_attention(g=2, m=16, d=8, n=64, row_tiles=2, splits=4, loop=2, dtype=DType.F32):
    """softmax(Q K) V as a graph-defined kernel writing split-KV partials, then a combining step.

    Grid (g, row_tiles, splits); each block loops over its chunk of the KV length.
    """
    Q = b.input_(0, (g, m, d), dtype)
    K = b.input_(1, (g, d, n), dtype)
    V = b.input_(2, (g, n, d), dtype)
    step = n // splits // loop
    bq = b.iter_(0, (1, m // row_tiles, d), dtype, False)
    bk = b.iter_(1, (1, d, step), dtype, True)
    bv = b.iter_(2, (1, step, d), dtype, True)
    s = b.matmul(bq, bk)
    num = b.save(b.accumulate(Op.ACC_EXP_WSUM, s, bv), 0, (0, 1, PARTIAL), DType.F32)
    den = b.save(b.accumulate(Op.ACC_EXP_SUM, s), 1, (0, 1, PARTIAL), DType.F32)
    bg = b.block_graph(
        (g, row_tiles, splits),
        loop,
        [InputMap((0, 1, None)), InputMap((0, None, 2), 2), InputMap((0, None, 1), 1)],
        [num, den],
    )
    pnum, pden = b.graph_def([Q, K, V], bg)
    out = b.div(b.reduce(Op.REDUCE_SUM, pnum, 0), b.reduce(Op.REDUCE_SUM, pden, 0))
    out = b.reshape(b.cast(out, dtype), (g, m, d))
    return b.kernel_graph([Q, K, V], [out], ["Q", "K", "V"], ["O"])


def test_builders_pass_spec_and_print():
    for kg in (plain_attention(), split_kv_attention(), split_kv_attention(dtype=DType.F16)):
        check(kg)
        text = format_graph(kg)
        assert "return O=" in text


def test_json_round_trip_and_hash():
    kg = split_kv_attention()
    again = loads(dumps(kg))
    assert again == kg
    assert graph_hash(again) == graph_hash(kg)
    assert graph_hash(plain_attention()) != graph_hash(kg)


def test_hash_ignores_order_of_independent_ops():
    x = b.input_(0, (4, 8), DType.F32)
    y = b.input_(1, (4, 8), DType.F32)
    a1, b1 = b.unary(Op.EXP, x), b.unary(Op.SQRT, y)
    b2, a2 = b.unary(Op.SQRT, y), b.unary(Op.EXP, x)  # built in the other order
    g1 = b.kernel_graph([x, y], [b.add(a1, b1)])
    g2 = b.kernel_graph([x, y], [b.add(a2, b2)])
    assert graph_hash(g1) == graph_hash(g2)
    g3 = b.kernel_graph([x, y], [b.add(b2, a2)])  # operand order is not op order
    assert graph_hash(g3) != graph_hash(g1)


def test_spec_rejects_bad_maps():
    kg = split_kv_attention()
    gd = next(n for n in kg.nodes() if n.op is Op.GRAPH_DEF)
    bad_imap = gd.arg.replace(
        inputs=(InputMap((0, 1, None)), InputMap((0, None, 2), 2), InputMap((0, None, 2), 1))
    )
    from mlso_cli.ir.spec import block_problems

    assert block_problems(bad_imap, gd.src)  # V's dim 2 is 8, not divisible by 4 / tile mismatch
    bad_grid = gd.arg.replace(grid=(2, 3, 4))
    assert any("divisible" in p for p in block_problems(bad_grid, gd.src))


def test_spec_rejects_saving_loop_values_and_fp16_partials():
    q = b.iter_(0, (1, 8, 8), DType.F32, True)
    bad = b.save(q, 0, (0, None, None), DType.F32)
    x = b.input_(0, (2, 8, 16), DType.F32)
    bg = b.block_graph((2, 1, 1), 2, [InputMap((0, None, None), 2)], [bad])
    from mlso_cli.ir.spec import block_problems

    probs = block_problems(bg, (x,))
    assert any("loop-phase" in p for p in probs)
    acc = b.accumulate(Op.ACC_SUM, q)
    bg2 = b.block_graph(
        (2, 1, 1),
        2,
        [InputMap((0, None, None), 2)],
        [b.save(acc, 0, (PARTIAL, None, None), DType.F16)],
    )
    assert any("fp32" in p for p in block_problems(bg2, (x,)))


def test_spec_rejects_wrong_shape_and_smem():
    x = b.input_(0, (4, 8), DType.F32)
    y = b.unary(Op.EXP, x).replace(shape=(4, 9))
    with pytest.raises(SpecError):
        check(b.kernel_graph([x], [y]))
    big = b.input_(0, (1, 512, 512), DType.F32)
    t = b.iter_(0, (1, 512, 512), DType.F32, False)
    s = b.matmul(t, t)
    bg = b.block_graph(
        (1, 1, 1), 1, [InputMap((None, None, None))], [b.save(s, 0, (None, None, None), DType.F32)]
    )
    (o,) = b.graph_def([big], bg)
    with pytest.raises(SpecError, match="shared memory"):
        budget_check(b.kernel_graph([big], [o]), arch="sm_80")
    check(b.kernel_graph([big], [o]))  # the IR's own rules hold: the budget is codegen's
