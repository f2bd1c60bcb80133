"""A sum and the sum of squares about a centre derived from it, in one walk (blockanalysis
`moments`, blockpass/reduce.py `pass_moments`).

A LayerNorm's mean and variance are two dependent reductions over the same rows: r1 = sum(x),
then r2 = sum((x - r1 / N)^2). Fused, one walk folds r1, S1 = sum(x - K) and
S2 = sum((x - K)^2) with K the row's first value, and r2 = S2 - 2 (a - K) S1 + N (a - K)^2 for
the centre a. The
tests check that the rows are walked once where the pair qualifies (in each team mode: a warp
per row, the whole block, a thread), twice where it does not, and that the values stay right on
the host emulator against float64, also for rows far from zero (where the shift matters).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from mlso_cli.codegen import blockanalysis, generate, hostemu
from mlso_cli.ir import DType, Op, check
from mlso_cli.ir import build as b
from tests import graphgen
from tests.test_codegen_direct import layernorm_whole
from tests.test_codegen_graphs import _Blk
from tests.test_codegen_properties import emu_cache, mismatch

__all__ = ["emu_cache"]  # the fixture, imported for pytest

MARK = "// moments:"
"""The comment pass_moments prints."""


def _pre(source: str) -> str:
    """The PRE part of a generated kernel (before the loop over K steps)."""
    return source.split("for (int it = 0;", 1)[0]


def _analysis(kg) -> blockanalysis.BlockAnalysis:
    gd = next(n for n in kg.nodes() if n.op is Op.GRAPH_DEF)
    return blockanalysis.BlockAnalysis(gd.arg)


def norm_rows(rows: int = 8, h: int = 256, loop: int = 8, variant: str = "square"):
    """Rows normalised about their mean, times W, like layernorm_whole but with the second
    statistic's form chosen by `variant`:
    square: sum(square(x - mean)); product: sum((x - mean) * (x - mean)) (both fuse);
    other_tile: the squares of Z's rows about X's mean (another tile: no fusion);
    other_centre: x's squares about mean + max(x) / 8 (the centre reads a second reduction)."""
    dt = DType.F16
    x, gamma, w = b.input_(0, (rows, h), dt), b.input_(1, (h,), dt), b.input_(2, (h, 32), dt)
    z = b.input_(3, (rows, h), dt)
    blk = _Blk((2, 1, 1), loop)
    bx = blk.it(x, (None, None, None), 1)
    whole = blk.it(x, (None, None, None))
    bg = blk.it(gamma, (None, None, None), 0)
    bw = blk.it(w, (1, None, None), 0)
    inv = b.const(Fraction(1, h))
    mean = b.mul(b.reduce(Op.REDUCE_SUM, whole, 1), inv)
    tile, centre = whole, mean
    if variant == "other_tile":
        tile = blk.it(z, (None, None, None))
    if variant == "other_centre":
        centre = b.add(mean, b.mul(b.reduce(Op.REDUCE_MAX, whole, 1), b.const(Fraction(1, 8))))
    d = b.sub(tile, centre)
    sq = b.mul(d, d) if variant == "product" else b.unary(Op.SQUARE, d)
    var = b.mul(b.reduce(Op.REDUCE_SUM, sq, 1), inv)
    rstd = b.unary(Op.RSQRT, b.add(var, b.const(Fraction(1, 1 << 16))))
    y = b.mul(b.mul(b.sub(bx, centre), rstd), bg)
    acc = b.accumulate(Op.ACC_SUM, b.matmul(y, bw))
    (out,) = blk.launch([b.save(acc, 0, (1, None, None), dt)])
    return check(b.kernel_graph([x, gamma, w, z], [out], ["X", "gamma", "W", "Z"], ["O"]))


def _check_values(kg, prog, seed: int, offset: float = 0.0) -> None:
    ins = graphgen.inputs_for(kg, seed)
    ins[0] = (ins[0].astype(np.float32) + offset).astype(ins[0].dtype)
    got = hostemu.run(prog, ins)
    why = mismatch(kg, ins, got)
    assert why is None, why


@pytest.mark.slow
def test_layernorm_rows_are_walked_once(emu_cache):
    """layernorm_whole's rows (read in place from global memory, a warp per row): one walk
    folds the sums, with 16-byte loads, and writes both statistics in the same pass; right for
    unit-normal rows and for rows around 1000 (fp16 steps of 0.5 there: without the shift,
    sum(x^2) - N mean^2 would cancel 6 of fp32's 7 digits)."""
    kg = layernorm_whole()
    analysis = _analysis(kg)
    assert len(analysis.moments) == 1
    (r2, m), (r1,) = next(iter(analysis.moments.items())), analysis.moment_firsts
    assert m.first is r1 and r2.op is r1.op is Op.REDUCE_SUM
    prog = generate(kg)
    pre = _pre(prog.source)
    assert pre.count(MARK) == 1 and "// reduce_sum" not in pre
    assert pre.count("*reinterpret_cast<const mlso::vec<__half, 8>*>(&g1[") == 1
    assert "mom_sq = fmaf(mom_d, mom_d, mom_sq);" in pre
    for seed, offset in ((3, 0.0), (4, 0.0), (5, 1000.0)):
        _check_values(kg, prog, seed, offset)


@pytest.mark.parametrize(
    "rows, h, variant, mode",
    [
        pytest.param(  # 2 rows: the block
            2,
            4096,
            "square",
            "block_allreduce<mlso::SumOp, 256>(mom_sq, red)",
            marks=pytest.mark.slow,
        ),
        pytest.param(  # (x - a) * (x - a)
            8, 256, "product", "warp_allreduce<mlso::SumOp, 32>(mom_sq)", marks=pytest.mark.slow
        ),
        (256, 16, "square", "for (int o = threadIdx.x; o < 256; o += 256)"),  # a thread per row
    ],
)
def test_every_team_mode_walks_once(emu_cache, rows, h, variant, mode):
    kg = norm_rows(rows, h, loop=2 if h < 64 else 8, variant=variant)
    prog = generate(kg)
    pre = _pre(prog.source)
    assert pre.count(MARK) == 1 and "// reduce_sum" not in pre, pre
    assert mode in pre
    for seed, offset in ((3, 0.0), (4, 100.0)):
        _check_values(kg, prog, seed, offset)


@pytest.mark.parametrize(
    "variant", ["other_tile", pytest.param("other_centre", marks=pytest.mark.slow)]
)
def test_pairs_that_do_not_qualify_keep_two_walks(emu_cache, variant):
    """The squares of another tile, or about a centre that reads a second reduction: two
    passes, as before, and the right values. The same graph with the plain form fuses (the
    contrast: only the variant's difference stops it)."""
    assert _analysis(norm_rows()).moments
    kg = norm_rows(variant=variant)
    assert not _analysis(kg).moments
    prog = generate(kg)
    pre = _pre(prog.source)
    assert MARK not in pre and pre.count("// reduce_sum axis 1") == 2
    _check_values(kg, prog, 3)
