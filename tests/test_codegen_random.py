"""Random attention-shaped block graphs: whatever the spec accepts, codegen generates, and the
generated program matches float64 on the emulator.

Why: the search emits programs nobody wrote: exp prologues on Q, row maxima multiplied in,
scores scaled after the matmul, softmax sums spelled as ACC_SUM, PRE-phase attention, split-KV
partials. Each of these once hung the spec check (exponential dependency walks, a stabiliser
whose max depended on itself) or broke codegen; this keeps the whole family covered.
"""

from __future__ import annotations

import os
import random
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlso_cli import knobs as knobs_mod
from mlso_cli.codegen import generate, hostemu
from mlso_cli.codegen.budget import problems
from mlso_cli.ir import PARTIAL, DType, InputMap, KernelGraph, Op
from mlso_cli.ir import build as b
from mlso_cli.ir.spec import tile_shape
from mlso_cli.verify.interpreter import run
from tests import test_codegen_graphs as T

F16, BF16, F32 = DType.F16, DType.BF16, DType.F32
LIMITS = {F16: 2e-3, BF16: 1e-2, F32: 1e-4}
PROLOGUE = (Op.EXP, Op.RELU, Op.SQUARE, Op.NEG, Op.SILU, Op.RSQRT, Op.TANH)


def attention_like(rng: random.Random) -> KernelGraph:
    """softmax-weighted sums of V over Q K scores, in one of the spellings a search may write."""
    dt = rng.choice([F16, BF16, F32])
    g, m, d, n = (
        rng.choice([1, 2]),
        rng.choice([8, 16, 32]),
        rng.choice([8, 16, 32]),
        rng.choice([16, 32, 64]),
    )
    loop, split = rng.choice([1, 2]), rng.choice([1, 2])
    keys = n * loop * split
    q, k, v = (
        b.input_(0, (g, m, d), dt),
        b.input_(1, (g, d, keys), dt),
        b.input_(2, (g, keys, d), dt),
    )
    grid = (g, 1, split)
    looped = loop > 1 or rng.random() < 0.5
    steps = loop if looped else 1
    maps = [
        InputMap((0, None, None)),
        InputMap((0, None, 2), 2 if looped else None),
        InputMap((0, None, 1), 1 if looped else None),
    ]
    bq = b.iter_(0, tile_shape(q.shape, maps[0], grid, steps), dt, False)
    bk = b.iter_(1, tile_shape(k.shape, maps[1], grid, steps), dt, looped)
    bv = b.iter_(2, tile_shape(v.shape, maps[2], grid, steps), dt, looped)
    x = bq
    if rng.random() < 0.5:
        x = b.unary(rng.choice(PROLOGUE), x)
    if rng.random() < 0.3:
        x = b.mul(x, b.reduce(rng.choice([Op.REDUCE_SUM, Op.REDUCE_MAX, Op.REDUCE_MEAN]), x, 2))
    s = b.matmul(x, bk)
    r = rng.random()
    if r < 0.3:
        s = b.mul(s, b.const(Fraction(1, 4)))
    elif r < 0.5:
        s = b.add(s, b.reduce(Op.REDUCE_MAX, s, rng.choice([1, 2])))
    c = rng.random()
    if looped and c < 0.5:
        o = b.div(b.accumulate(Op.ACC_EXP_WSUM, s, bv), b.accumulate(Op.ACC_EXP_SUM, s))
    elif looped and c < 0.8:
        e = b.unary(Op.EXP, s)
        o = b.div(
            b.accumulate(Op.ACC_SUM, b.matmul(e, bv)),
            b.accumulate(Op.ACC_SUM, b.reduce(Op.REDUCE_SUM, e, 2)),
        )
    elif looped:
        o = b.accumulate(Op.ACC_SUM, b.matmul(b.unary(Op.RELU, s), bv))
    elif c < 0.5:
        e = b.unary(Op.EXP, s)
        o = b.div(b.matmul(e, bv), b.reduce(Op.REDUCE_SUM, e, 2))
    elif c < 0.8:
        e = b.unary(Op.EXP, s)
        o = b.matmul(b.div(e, b.reduce(Op.REDUCE_SUM, e, 2)), bv)
    else:
        o = b.matmul(b.unary(Op.SILU, s), bv)
    if split > 1:
        (p,) = b.graph_def(
            [q, k, v], b.block_graph(grid, steps, maps, [b.save(o, 0, (0, None, PARTIAL), F32)])
        )
        return b.kernel_graph([q, k, v], [b.reduce(Op.REDUCE_SUM, p, 0)])
    (out,) = b.graph_def(
        [q, k, v], b.block_graph(grid, steps, maps, [b.save(o, 0, (0, None, None), dt)])
    )
    return b.kernel_graph([q, k, v], [out])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False))
def test_spec_valid_attention_shapes_generate(rng):
    kg = attention_like(rng)
    if problems(kg):  # only shared memory can make these invalid
        assert all("shared memory" in p for p in problems(kg))
        return
    gp = generate(kg)
    assert gp.kernel_names and "graph-defined kernel" in gp.source


@pytest.mark.slow
def test_random_attention_shapes_on_the_emulator(tmp_path_factory):
    """24 seeded spec-valid graphs whose float64 value is finite on their inputs (a prologue such
    as rsqrt of a normal input has none), within the dtype's limit on the emulator."""
    rng, data = random.Random(7), np.random.default_rng(0)
    cases: dict[str, tuple[KernelGraph, list[np.ndarray], np.ndarray]] = {}
    while len(cases) < 24:
        kg = attention_like(rng)
        if problems(kg):
            continue
        ins = [data.standard_normal(n.shape).astype(T.np_dtype(n.dtype)) for n in kg.inputs]
        (want,) = run(kg, ins, "float64")
        if np.isfinite(want).all():
            cases[f"g{len(cases)}"] = (kg, ins, want)
    mp = pytest.MonkeyPatch()
    if not os.environ.get("MLSO_CACHE_DIR"):
        mp.setenv("MLSO_CACHE_DIR", str(tmp_path_factory.mktemp("mlso-cache")))
    knobs_mod.cache_clear()
    try:
        emu = hostemu.Bundle({k: generate(kg) for k, (kg, _, _) in cases.items()}, binaries=2)
        for name, (kg, ins, want) in cases.items():
            (got,) = emu.run(name, ins)
            err = T.rel_error(got, want)
            assert err <= LIMITS[kg.inputs[0].dtype], f"{name}: relative error {err:.2e}"
    finally:
        mp.undo()
        knobs_mod.cache_clear()
