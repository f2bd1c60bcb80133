"""Hoisted chunk offsets of loop tiles (blockpass/loading.py `hoist_offsets`, `mlso::copy_offsets`).

A loop tile copied in 16-byte chunks reads the same chunks every step, one step further along
the loop axis, so codegen computes each thread's offsets once, before the prologue. The rewrite
must change no value: checked on the host emulator, bit for bit against the per-chunk form and
against float64, with a loop of several steps (step 0 in the prologue, step it + 1 inside the
two-stage loop) and tiles of one and of several chunks per thread.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlso_cli.codegen import generate, hostemu
from mlso_cli.codegen.blockpass import loading
from tests import graphgen
from tests.test_codegen_properties import emu_cache, mismatch
from tests.test_codegen_vectorize import groupnorm_linear

__all__ = ["emu_cache"]  # the fixture, imported for pytest


def _graph(blocks: int = 1):
    # X tile 8 x 256 halves: 256 chunks, one per thread; W tile 256 x 32: 1,024 chunks, four per
    # thread; gamma's 32 chunks do not divide over 256 threads and keep the per-chunk copy
    return groupnorm_linear(rows=8, h=1024, n=32 * blocks, loop=4, blocks=blocks)


def test_loop_tiles_take_hoisted_offsets():
    src = generate(_graph()).source
    assert "mlso::copy_offsets<true, 1>(" in src and "mlso::copy_offsets<true, 4>(" in src
    assert src.count("mlso::copy_chunks<") == 2  # gamma: prologue step 0, and the loop
    head, loop = src.split("for (int it = 0;", 1)
    assert "int go0[1], so0[1];" in head and "int go2[4], so2[4];" in head
    # a 2-stage pipeline: step 0 before the loop, step it + 1 inside, into the other buffer; one
    # step is 256 columns of X and 256 rows of W (256 x 32 halves)
    assert "copy_offsets<true, 4>(in2 + (0) * 8192, s2_0, go2, so2);" in head
    assert "copy_offsets<true, 1>(in0 + (it + 1) * 256, ((it + 1) & 1 ? s0_1 : s0_0), " in loop
    assert "copy_offsets<true, 4>(in2 + (it + 1) * 8192, ((it + 1) & 1 ? s2_1 : s2_0), " in loop


@pytest.mark.parametrize("blocks", [1, 2])
def test_hoisted_offsets_change_no_value(emu_cache, monkeypatch, blocks):
    kg = _graph(blocks)
    hoisted = generate(kg)
    monkeypatch.setattr(loading, "HOIST_REGS", 0)
    plain = generate(kg)
    assert "copy_offsets" not in plain.source and "copy_offsets" in hoisted.source
    for seed in (blocks,):
        ins = graphgen.inputs_for(kg, seed)
        got = hostemu.run(hoisted, ins)
        want = hostemu.run(plain, ins)
        for g, w in zip(got, want):
            assert np.array_equal(g.view(np.uint16), w.view(np.uint16))
        why = mismatch(kg, ins, got)
        assert why is None, why
    if blocks > 1:  # each block's W columns: its offset along grid x is in the hoisted offsets
        assert "go2[u] = ((c / 4)) * 64 + (c % 4) * 8 + (int)blockIdx.x * 32;" in hoisted.source


@pytest.mark.parametrize("regs", [2, 8])
def test_the_register_budget_limits_what_is_hoisted(regs, monkeypatch):
    monkeypatch.setattr(loading, "HOIST_REGS", regs)
    src = generate(_graph()).source
    # the larger tile (W, 4 chunks a thread) first, if it fits the budget; then the smaller
    assert ("mlso::copy_offsets<true, 4>(" in src) == (regs >= 8)
    assert ("mlso::copy_offsets<true, 1>(" in src) == (regs - (8 if regs >= 8 else 0) >= 2)
