"""Outputs that are views of the computed value (attention's [batch, seq, heads * d] hand-off to
o_proj): the search looks for the value under the views and puts the views back
(search/run.py strip_output_views). Without that, no block tile is laid out like the output and
only the lifted many-kernel program was found."""

from __future__ import annotations

from fractions import Fraction

from mlso_cli.ir import build as b
from mlso_cli.ir.ops import DType, Op
from mlso_cli.ir.spec import check as check_graph
from mlso_cli.search.api import SearchOptions
from mlso_cli.search.run import search, strip_output_views, with_output_views

F = DType.F32


def _attention(heads=4, kv_heads=2, seq=16, d=16, view=True):
    """Grouped-query attention as a Llama export lifts it: K and V heads repeated by reshape,
    broadcast, reshape; softmax(Q K^T / 4) V; then (view) [1, seq, heads * d]."""
    q = b.input_(0, (1, heads, seq, d), F)
    k = b.input_(1, (1, kv_heads, seq, d), F)
    v = b.input_(2, (1, kv_heads, seq, d), F)

    def repeat(x):
        rep = heads // kv_heads
        x = b.broadcast_to(b.reshape(x, (1, kv_heads, 1, seq, d)), (1, kv_heads, rep, seq, d))
        return b.reshape(x, (1, heads, seq, d))

    s = b.mul(b.matmul(q, b.transpose(repeat(k), (0, 1, 3, 2))), b.const(Fraction(1, 4)))
    e = b.unary(Op.EXP, s)
    o = b.matmul(b.div(e, b.reduce(Op.REDUCE_SUM, e, 3)), repeat(v))
    if view:
        o = b.reshape(b.transpose(o, (0, 2, 1, 3)), (1, seq, heads * d))
    return b.kernel_graph([q, k, v], [o])


def test_strip_takes_the_views_off_and_with_output_views_puts_them_back():
    g = _attention()
    core, views = strip_output_views(g)
    check_graph(core)
    assert core.outputs[0].op is Op.MATMUL and core.outputs[0].shape == (1, 4, 16, 16)
    assert [op for op, _ in views[0]] == [Op.TRANSPOSE, Op.RESHAPE]
    back = with_output_views(core, views, g)
    check_graph(back)
    assert back.outputs == g.outputs and back.output_names == g.output_names


def test_a_view_of_an_input_or_of_another_output_stays():
    x = b.input_(0, (4, 8), F)
    t = b.transpose(x, (1, 0))
    y = b.unary(Op.EXP, x)
    g = b.kernel_graph([x], [t, y, b.reshape(y, (32,))])
    core, views = strip_output_views(g)
    assert core.outputs == g.outputs and not any(views)


def test_attention_with_a_transposed_output_is_found_fused():
    g = _attention()
    res = search(g, SearchOptions(jobs=1, seed=0, max_states=20000), None)
    lifted = res.candidates[-1] if res.candidates[-1].graph is g else None
    best = res.candidates[0]
    assert res.verified >= 1
    assert best.graph is not g and best.kernels <= 2, [c.kernels for c in res.candidates]
    assert best.graph.outputs[0].shape == g.outputs[0].shape
    assert best.graph.output_names == g.output_names
    check_graph(best.graph)
    assert lifted is not None and best.estimate_us < lifted.estimate_us
