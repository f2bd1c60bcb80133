"""PRE tiles read in place from global memory (blockanalysis `direct`, block.py `_point`).

A whole feed that only PRE reductions read (a LayerNorm's rows, read whole by every block of a
split-K program for its mean and variance) is not copied into shared memory: the kernel points
at the block's first element and the reductions read global memory. The layout must then give
that memory back (the spec checker's figure is the layout's), and the values must not change:
checked on the host emulator, against the copied form (to an fp16 rounding) and float64, for a
plain pointer and for the indexed accessor a cast view takes.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from mlso_cli.codegen import blockanalysis, generate, hostemu
from mlso_cli.codegen.blocklayout import smem_layout
from mlso_cli.ir import DType, Op, check
from mlso_cli.ir import build as b
from tests import graphgen
from tests.test_codegen_graphs import _Blk
from tests.test_codegen_properties import emu_cache, mismatch

__all__ = ["emu_cache"]  # the fixture, imported for pytest


def layernorm_whole(rows: int = 8, h: int = 4096, n: int = 32, cast: bool = False, matmul=False):
    """LayerNorm(X) @ W over 2 column blocks and an 8-step K loop: every block reads X's rows
    whole before the loop (mean, variance), then its K steps of X and W. `cast`: the whole
    rows come through a kernel-level cast to fp32 (not a plain pointer). `matmul`: a PRE matmul
    also reads the whole rows (then they must stay in shared memory)."""
    dt = DType.F16
    x, gamma, w = b.input_(0, (rows, h), dt), b.input_(1, (h,), dt), b.input_(2, (h, n), dt)
    blk = _Blk((2, 1, 1), 8)
    bx = blk.it(x, (None, None, None), 1)
    whole = blk.it(b.cast(x, DType.F32) if cast else x, (None, None, None))
    bg = blk.it(gamma, (None, None, None), 0)
    bw = blk.it(w, (1, None, None), 0)
    inv = b.const(Fraction(1, h))
    mean = b.mul(b.reduce(Op.REDUCE_SUM, whole, 1), inv)
    var = b.mul(b.reduce(Op.REDUCE_SUM, b.unary(Op.SQUARE, b.sub(whole, mean)), 1), inv)
    rstd = b.unary(Op.RSQRT, b.add(var, b.const(Fraction(1, 1 << 16))))
    y = b.mul(b.mul(b.sub(bx, mean), rstd), bg)
    acc = b.accumulate(Op.ACC_SUM, b.matmul(y, bw))
    if matmul:
        gram = b.reduce(Op.REDUCE_SUM, b.matmul(whole, b.transpose(whole, (1, 0))), 1)
        acc = b.add(acc, b.mul(gram, b.const(Fraction(0))))
    (out,) = blk.launch([b.save(acc, 0, (1, None, None), dt)])
    return check(b.kernel_graph([x, gamma, w], [out], ["X", "gamma", "W"], ["O"]))


def _copied(kg, monkeypatch):
    """kg generated with every PRE tile copied into shared memory (the form before `direct`)."""
    with monkeypatch.context() as m:
        m.setattr(blockanalysis, "DIRECT_PRE_BYTES", 1 << 40)
        smem_layout.cache_clear()
        try:
            return generate(kg)
        finally:
            smem_layout.cache_clear()


def _graph_def(kg):
    return next(n for n in kg.nodes() if n.op is Op.GRAPH_DEF)


@pytest.mark.slow
@pytest.mark.parametrize("cast", [False, True])
def test_whole_rows_read_only_by_reductions_are_read_in_place(emu_cache, monkeypatch, cast):
    kg = layernorm_whole(cast=cast)
    direct = generate(kg)
    copied = _copied(kg, monkeypatch)
    head = direct.source.split("for (int it = 0;", 1)[0]
    if cast:  # a cast view: element e computed and rounded as the copy would store it
        assert "const auto g1 = mlso::indexed([&](int e) -> float {" in head
    else:  # 16-byte loads straight from X's rows
        assert "const __half* const g1 = in0 + 0;" in head
        assert "*reinterpret_cast<const mlso::vec<__half, 8>*>(&g1[" in head
    assert "s1 = " not in head and "s1 = " in copied.source
    # the memory the copy held (64 or 128 KB) is given back, and no buffer is laid out for the
    # rows; the spec checker's figure is the kernel's
    (k_direct,) = [k for k in direct.plan["launches"] if k["smem"]]
    (k_copied,) = [k for k in copied.plan["launches"] if k["smem"]]
    assert k_direct["smem"] < k_copied["smem"]
    lay = smem_layout(_graph_def(kg).arg)
    assert lay.smem == k_direct["smem"]
    assert not any(name == "s1" for _, name, _ in lay.buffers)
    ins = graphgen.inputs_for(kg, 3)
    got = hostemu.run(direct, ins)
    # the same values as the copied form, to an fp16 rounding (the walks may visit the row in
    # another order, and a LayerNorm rounds (x - mean) * rstd to 16 bits)
    for g, w in zip(got, hostemu.run(copied, ins)):
        g, w = g.astype(np.float32), w.astype(np.float32)
        assert (np.abs(g - w) <= np.abs(w) * 2.0**-10 + 2.0**-24).all()
    why = mismatch(kg, ins, got)
    assert why is None, why


def test_whole_rows_a_matmul_reads_stay_in_shared_memory():
    bg = _graph_def(layernorm_whole(h=1024, rows=16, matmul=True)).arg
    analysis = blockanalysis.BlockAnalysis(bg)
    whole = [it for it in analysis.iters if it.arg == 1]
    assert whole and not analysis.direct
    src = generate(layernorm_whole(h=1024, rows=16, matmul=True)).source
    assert "const __half* const g1" not in src


def test_small_whole_rows_are_still_copied():
    bg = _graph_def(layernorm_whole(rows=2, h=1024)).arg  # 4 KB: under DIRECT_PRE_BYTES
    assert not blockanalysis.BlockAnalysis(bg).direct
    big = _graph_def(layernorm_whole()).arg
    assert [it.arg for it in blockanalysis.BlockAnalysis(big).direct] == [1]
