"""A constant causal mask becomes an index predicate in generated code (codegen/indexmask.py).

Why: the mask's values are a function of the element's row and column, so reading them from
global memory in every block is waste; the decision is an exact comparison of the whole
constant, so anything else (one flipped entry, a random or a padding mask) keeps the load.
"""

from __future__ import annotations

import re
from fractions import Fraction

import numpy as np
import pytest
from onnx import numpy_helper

from mlso_cli.codegen import generate, hostemu
from mlso_cli.codegen.indexmask import computed_inputs, recognise
from mlso_cli.ir import KernelGraph, Op
from mlso_cli.ir import build as b
from tests.test_codegen_graphs import (
    F16,
    F32,
    _Blk,
    assert_emulated_matches,
    causal_gqa,
    constants,
    make_inputs,
    masked_softmax,
)

S = 16
TRIL = np.tril(np.ones((S, S)))


# ---- the predicate table ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arr,form,k",
    [
        (TRIL.astype(np.float32), "lower", 0),
        (TRIL.astype(np.float16), "lower", 0),
        (TRIL.astype(bool), "lower", 0),
        (np.where(TRIL == 1, 0.0, -np.inf).astype(np.float32), "lower", 0),
        # a KV offset: 4 cached keys before the 16 queries
        (np.tril(np.ones((S, S + 4)), k=4).astype(np.float32), "lower", 4),
        (np.tril(np.ones((S, S)), k=-2).astype(np.float32), "lower", -2),
        (np.triu(np.ones((S, S))).astype(np.float32), "upper", 0),
        (np.triu(np.ones((S, S)), k=3).astype(bool), "upper", 3),
        # broadcast over batch and heads
        (np.broadcast_to(TRIL, (2, 3, S, S)).astype(np.float32), "lower", 0),
        (TRIL[None, None].astype(np.float16), "lower", 0),
        # one decode row over 8 cached keys and itself
        (np.ones((1, 1, 1, 9), np.float32) * (np.arange(9) <= 8), None, None),
    ],
)
def test_index_masks_are_recognised(arr, form, k):
    got = recognise(arr)
    if form is None:  # a row of all ones pins no diagonal: left to the load path
        assert got is None
        return
    assert got is not None and (got.predicate, got.k) == (form, k)
    # the C expression, evaluated as numpy would, reproduces every element
    rows, cols = np.indices(arr.shape[-2:])
    want = np.where(
        cols <= rows + got.k if form == "lower" else cols >= rows + got.k, got.kept, got.hidden
    )
    assert np.array_equal(np.broadcast_to(want, arr.shape), arr.astype(np.float64))


def _flipped() -> np.ndarray:
    m = TRIL.astype(np.float32).copy()
    m[5, 9] = 1.0  # one future key let in
    return m


def _padding() -> np.ndarray:
    m = np.ones((S, S), np.float32)
    m[:, 12:] = 0.0  # the last four keys are padding
    return m


def _batch_differs() -> np.ndarray:
    m = np.stack([TRIL, np.tril(np.ones((S, S)), k=1)]).astype(np.float32)
    return m[:, None]


@pytest.mark.parametrize(
    "arr",
    [
        _flipped(),
        (np.random.default_rng(0).random((S, S)) > 0.5).astype(np.float32),
        _padding(),
        _batch_differs(),
        (TRIL * 2).astype(np.float32),  # 0/2 is not a value pair of the table
        np.where(TRIL == 1, 0.0, -1e4).astype(np.float32),
        np.ones((S, S), np.float32),
        TRIL[0].astype(np.float32),  # one axis: no rows
    ],
    ids=[
        "one_flipped",
        "random",
        "padding",
        "batch_differs",
        "zero_two",
        "minus_1e4",
        "ones",
        "1d",
    ],
)
def test_other_masks_are_not_recognised(arr):
    assert recognise(arr) is None


# ---- the attention core --------------------------------------------------------------------------


def _kernel_params(source: str) -> list[list[str]]:
    """Each kernel's pointer parameters (in0, out0, scratch1, ...), from its signature."""
    return [
        re.findall(r"\b(in\d+|out\d+|scratch\d+)\b", m.group(1))
        for m in re.finditer(
            r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?\w+\(([^)]*)\)', source
        )
    ]


@pytest.mark.slow
def test_qwen_width_causal_core_reads_no_mask_and_matches_the_reference():
    """The 128-token causal GQA core (32 query heads over 8 KV heads of 64, the exported
    region's form): the mask (input 3) is no kernel's parameter and no load names it, and
    the emulated program (which runs that very source) matches the float64 interpreter."""
    kg = causal_gqa()
    consts = constants(kg)
    assert computed_inputs(kg, consts).keys() == {3}
    gp = generate(kg, constants=consts)
    assert all("in3" not in p for p in _kernel_params(gp.source))
    assert "in3" not in gp.source
    assert "is computed, not read: col <= row ? 1 : 0" in gp.source
    # the load path, without the constants, did read it: the test sees the difference
    assert any("in3" in p for p in _kernel_params(generate(kg).source))
    assert gp.plan["inputs"][3] == {"dtype": "float16", "shape": [1, 1, 128, 128]}
    assert_emulated_matches("causal_gqa_f16", kg, consts)


def test_small_causal_core_reads_no_mask_and_matches_the_reference():
    kg = causal_gqa(F16, heads=4, kv=2, s=32, d=16)
    consts = constants(kg)
    gp = generate(kg, constants=consts)
    params = _kernel_params(gp.source)
    assert params and all("in3" not in p and "in0" in p for p in params)
    # the lowering plan (no constants: the cost model's and the budget's) is what generate did
    from mlso_cli.codegen.plan import plan

    lp = plan(kg)
    assert [(k.layout.smem, k.layout.threads) for k in lp.kernels] == [
        (k.smem, k.block[0]) for k in gp.kernels
    ]
    assert_emulated_matches("causal_gqa_f16", kg, consts)


def test_a_non_causal_constant_mask_is_still_loaded_and_matches():
    kg = causal_gqa(F16, heads=4, kv=2, s=32, d=16, mask="mlso_mask_random")
    consts = constants(kg)
    assert computed_inputs(kg, consts) == {}
    gp = generate(kg, constants=consts)
    assert gp.source == generate(kg).source
    assert any("in3" in p for p in _kernel_params(gp.source))
    assert_emulated_matches("causal_gqa_f16", kg, consts)


def test_only_lifted_masks_are_candidates():
    """An input named otherwise (a model weight that happens to be triangular) is read."""
    kg = masked_softmax(rows=S, n=S)  # input "mask"
    tril = {"mask": TRIL.astype(np.float32)}
    assert computed_inputs(kg, tril) == {}
    assert generate(kg, constants=tril).source == generate(kg).source


def test_a_kernel_level_elementwise_read_is_computed_too():
    """masked_softmax's mask, renamed as lifting names it, read by kernel-level elementwise
    kernels (no block kernel): computed there as well, and still exact."""
    kg = masked_softmax(rows=S, n=S)
    kg = kg.replace(input_names=(kg.input_names[0], "mlso_mask_causal"))
    consts = constants(kg)
    gp = generate(kg, constants=consts)
    assert all("in1" not in p for p in _kernel_params(gp.source))
    assert_emulated_matches("masked_softmax_f32", kg, consts)


def looped_masked(dt, g: int = 1, s: int = 32, d: int = 16, rows: int = 8, loop: int = 2):
    """Keys walked in `loop` steps: the [1, s, s] mask is a loop tile, so each step's tile is
    computed at that step's key offset (`(it + 1) * 16` in the source)."""
    q, k, v = b.input_(0, (g, s, d), dt), b.input_(1, (g, d, s), dt), b.input_(2, (g, s, d), dt)
    m = b.input_(3, (1, s, s), dt)
    blk = _Blk((g, s // rows, 1), loop)
    bq, bk = blk.it(q, (0, 1, None)), blk.it(k, (0, None, None), 2)
    bv, bm = blk.it(v, (0, None, None), 1), blk.it(m, (None, 1, None), 2)
    e = b.mul(b.unary(Op.EXP, b.mul(b.matmul(bq, bk), b.const(Fraction(1, 4)))), bm)
    num = b.accumulate(Op.ACC_SUM, b.matmul(e, bv))
    den = b.accumulate(Op.ACC_SUM, b.reduce(Op.REDUCE_SUM, e, 2))
    (out,) = blk.launch([b.save(b.div(num, den), 0, (0, 1, None), dt)])
    return b.kernel_graph([q, k, v, m], [out], ["Q", "K", "V", "mlso_mask_causal"], ["O"])


@pytest.mark.parametrize("dt,g", [(F16, 2), (F32, 2)])
def test_a_loop_tile_of_the_mask_is_computed_per_step(dt, g):
    kg: KernelGraph = looped_masked(dt, g)
    consts = constants(kg)
    gp = generate(kg, constants=consts)
    assert all("in3" not in p for p in _kernel_params(gp.source))
    assert "(it + 1) * 16) <= (" in gp.source
    assert_emulated_matches("looped_masked", kg, consts)
    ins = make_inputs(kg, "looped_masked")
    loaded = hostemu.run(generate(kg), ins)[0]
    assert np.array_equal(hostemu.run(gp, ins)[0], loaded)


# ---- verify reaches the same decision ----------------------------------------------------------


def test_verify_regenerates_the_computed_form_and_a_changed_mask_fails(tmp_path):
    """A causal Where/Softmax packaged as optimize would: its kernel computes the mask; verify's
    chain check, regenerating from the packaged μGraph and the packaged mask, reaches the same
    source (exit 0). A packaged mask moved by one diagonal is still an index predicate, but
    another one, and all ones is none: either way the regenerated source differs from the
    recorded hash (exit 3)."""
    from tests.test_attacks_more import _masked_softmax, _ok, _packaged, _save, _verify

    a = _masked_softmax(tmp_path / "a.onnx")
    b = _packaged(a)
    init = next(t for t in b.graph.initializer if t.name.startswith("mlso_mask_"))
    mask = numpy_helper.to_array(init)
    assert recognise(mask) is not None
    _ok(_verify(a, _save(b, tmp_path / "b.onnx")))

    moved = np.broadcast_to(np.tril(np.ones(mask.shape[-2:]), k=1), mask.shape)
    for k, changed in enumerate((moved, np.ones_like(mask))):
        init.CopyFrom(numpy_helper.from_array(changed.astype(mask.dtype), init.name))
        r = _verify(a, _save(b, tmp_path / f"b{k}.onnx"), "--no-emulate")
        assert r.returncode == 3, r.stderr.decode()[-3000:]
        assert "source_sha256" in r.stderr.decode(), r.stderr.decode()[-3000:]
