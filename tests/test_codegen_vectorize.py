"""Vector elementwise passes (codegen/vectorize.py, block.py `_elementwise(vector=True)`).

The rewrite must only remove work: a read the same for every lane moves out of the lane loop, a
contiguous aligned read becomes one wide load, anything else is left alone. Checked on the
index expressions themselves, and end to end on the host emulator against float64 with a
group-norm + linear graph large enough to take the vector path (per-group statistics hoisted,
tile rows read and the staged operand written 8 halves at a time).
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from mlso_cli.codegen import generate, hostemu
from mlso_cli.codegen.vectorize import classify, plan_lane, wide_store
from mlso_cli.ir import DType, Op, check
from mlso_cli.ir import build as b
from tests import graphgen
from tests.test_codegen_graphs import _Blk
from tests.test_codegen_properties import emu_cache, mismatch

__all__ = ["emu_cache"]  # the fixture, imported for pytest

ROW = "((ev / 64)) * 520 + (((ev % 64)) * 8 + vj)"
GROUP = "(((ev / 64)) * 512 + (((ev % 64)) * 8 + vj)) / 128"


@pytest.mark.parametrize(
    ("index", "kind"),
    [
        (ROW, "contiguous"),
        (GROUP, "invariant"),
        ("ev", "invariant"),
        ("(ev * 8 + vj) * 2", "other"),  # stride 2: neighbours are not adjacent
        ("ev * 4 + vj", "other"),  # adjacent, but vector 1 starts at element 4: unaligned
        ("(ev * 8 + vj) / 2", "other"),  # pairs of lanes share an element
        ("it * 8 + vj", "other"),  # a name the evaluator does not know
    ],
)
def test_classify(index, kind):
    assert classify(index, 1024, 8) == kind


def test_plan_hoists_invariants_and_widens_contiguous_reads():
    lines = [
        f"const float t1 = mlso::to_f32(x[{ROW}]);",
        f"const float t2 = mlso::to_f32(mean[{GROUP}]);",
        "const float t3 = mlso::ew::rsqrt(t2);",
        "const float t4 = mlso::ew::mul(mlso::ew::sub(t1, t2), t3);",
        "const float t5 = mlso::to_f32(odd[(ev * 8 + vj) * 2]);",
    ]
    ctypes = {"x": "__half", "mean": "float", "odd": "__half"}
    plan = plan_lane(lines, 1024, 8, ctypes)
    pre = "\n".join(plan.pre)
    lane = "\n".join(plan.lane)
    # the group's statistics: once per vector, with the lane fixed at 0
    assert "const float t2 = mlso::to_f32(mean[" in pre and "+ 0)) / 128" in pre
    assert "const float t3 = mlso::ew::rsqrt(t2);" in pre
    # the tile row: one 16-byte load before the lanes, a register per lane
    assert (
        "const mlso::vec<__half, 8> vt1 = *reinterpret_cast<const mlso::vec<__half, 8>*>(&x[" in pre
    )
    assert "const float t1 = mlso::to_f32(vt1.v[vj]);" in lane
    # what depends on the lane stays in the lane loop; the strided read stays as it was
    assert "const float t4 =" in lane and "t4" not in pre
    assert lines[4] in plan.lane


def test_plan_leaves_unknown_statements_alone():
    lines = ["float acc = 0.0f;", f"const float t1 = mlso::to_f32(x[{ROW}]);"]
    plan = plan_lane(lines, 1024, 8, {"x": "__half"})
    assert plan.pre == [] and plan.lane == lines


def test_wide_store_needs_a_known_buffer_and_a_whole_aligned_vector():
    assert wide_store(f"stg[{ROW}]", 1024, 8, {"stg": "__half"}) == (
        "__half",
        "stg[((ev / 64)) * 520 + (((ev % 64)) * 8 + 0)]",
    )
    assert wide_store(f"stg[{ROW}]", 1024, 8, {}) is None  # not a known aligned buffer
    assert wide_store(f"stg[{ROW}]", 1024, 8, {"stg": "float"}) is None  # 32 bytes: two accesses
    assert wide_store(f"stg[{GROUP}]", 1024, 8, {"stg": "__half"}) is None


def groupnorm_linear(rows: int = 4, h: int = 1024, n: int = 32, loop: int = 2, blocks: int = 1):
    """GroupNorm (groups of 128) on each K step's X tile, then X̂ W accumulated: the staging pass
    is rows x 512 halves, wide enough for 8-lane vectors, with per-group mean and rsqrt. `blocks`
    blocks split W's columns (grid x)."""
    dt = DType.F16
    x, gamma, w = b.input_(0, (rows, h), dt), b.input_(1, (h,), dt), b.input_(2, (h, n), dt)
    blk = _Blk((blocks, 1, 1), loop)
    bx = blk.it(x, (None, None, None), 1)
    bg = blk.it(gamma, (None, None, None), 0)
    bw = blk.it(w, (1, None, None), 0)
    step = h // loop
    gs = 128
    xg = b.reshape(bx, (rows, step // gs, gs))
    inv = b.const(Fraction(1, gs))
    cen = b.sub(xg, b.mul(b.reduce(Op.REDUCE_SUM, xg, 2), inv))
    var = b.mul(b.reduce(Op.REDUCE_SUM, b.unary(Op.SQUARE, cen), 2), inv)
    y = b.mul(cen, b.unary(Op.RSQRT, b.add(var, b.const(Fraction(1, 1 << 16)))))
    y = b.mul(b.reshape(y, (rows, step)), bg)
    (out,) = blk.launch([b.save(b.accumulate(Op.ACC_SUM, b.matmul(y, bw)), 0, (1, None, None), dt)])
    return check(b.kernel_graph([x, gamma, w], [out], ["X", "gamma", "W"], ["O"]))


def test_groupnorm_linear_vector_pass_matches_float64(emu_cache):
    kg = groupnorm_linear()
    gp = generate(kg)
    stage = gp.source[gp.source.index("// stage") :]
    stage = stage[: stage.index("__syncthreads();")]
    # the pass this test is about: vectors, a hoisted rsqrt, wide loads and one wide store
    assert "for (int vj = 0; vj < 8; ++vj)" in stage
    assert stage.index("mlso::ew::rsqrt") < stage.index("for (int vj")
    assert "mlso::vec<__half, 8>" in stage and "= pv;" in stage
    for seed in (0, 1):
        ins = graphgen.inputs_for(kg, seed)
        why = mismatch(kg, ins, hostemu.run(gp, ins))
        assert why is None, why


def test_a_statement_on_the_flat_index_stays_in_the_lane_loop():
    lines = ["const float t1 = mlso::to_f32(buf[e]);", "const float t2 = (float)(e) * 2.0f;"]
    plan = plan_lane(lines, 1024, 8, {"buf": "float"})
    assert plan.pre == [] and plan.lane == lines


def test_team_reductions_read_whole_vectors_and_hoist_the_row_statistic(emu_cache):
    """Both group reductions of groupnorm_linear walk their rows 8 halves per load; the second
    (the sum of squared deviations) reads the group's mean once per vector, not once per lane."""
    kg = groupnorm_linear()
    gp = generate(kg)
    passes = gp.source.split("// reduce_sum")[1:]
    assert len(passes) == 2
    for p in passes:
        p = p[: p.index("warp_allreduce")]
        assert "const int rv = " in p and "for (int vj = 0; vj < 8; ++vj)" in p
        assert "*reinterpret_cast<const mlso::vec<__half, 8>*>" in p
    second = passes[1][: passes[1].index("warp_allreduce")]
    lanes = second[second.index("for (int vj") :]
    assert "to_f32(sm" not in lanes  # the mean: read before the lane loop
    assert "to_f32(sm" in second[: second.index("for (int vj")]
    for seed in (2, 3):
        ins = graphgen.inputs_for(kg, seed)
        why = mismatch(kg, ins, hostemu.run(gp, ins))
        assert why is None, why


def test_plan_lane_over_named_index_variables():
    """A row reduction's vectors are (row o, vector rv): a read of row o is the same for every
    lane, a read of o's row at rv * 8 + vj is contiguous."""
    space = {"o": 16, "rv": 32}
    assert classify("o * 264 + (rv * 8 + vj)", space, 8) == "contiguous"
    assert classify("o", space, 8) == "invariant"
    assert classify("o * 264 + (rv * 8 + vj) * 2", space, 8) == "other"
    assert classify("o * 260 + (rv * 8 + vj)", space, 8) == "other"  # rows of 260: unaligned
