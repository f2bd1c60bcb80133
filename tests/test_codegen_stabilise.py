"""Softmax-shaped computations that nobody wrote by hand, on the emulator against float64.

Why: the search moves divisions past matmuls, puts attention in a pre-loop block and writes
`exp(s) @ v / rowsum(exp(s))` instead of the rescaling accumulators. Code generation must keep
every exp relative to a max wherever it reaches storage (16-bit staging for the tensor cores,
fp32 scratch between kernels, accumulators across loop steps), and the interpreter's float32
mode ("as codegen computes") must make the same choices. Each case runs at unit scale, with
logits x20 and with logits of about +-100; limits are the norm-wise relative errors fp16 2e-3,
bf16 1e-2, fp32 1e-4.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

import numpy as np
import pytest

from mlso_cli.codegen import generate, hostemu
from mlso_cli.ir import DType, InputMap, KernelGraph, Node, Op
from mlso_cli.ir import build as b
from mlso_cli.ir.spec import check, tile_shape
from mlso_cli.verify import interpreter
from tests import test_codegen_graphs as T
from tests.helpers import fresh_cache

F16, BF16, F32 = DType.F16, DType.BF16, DType.F32
LIMITS = {F16: 2e-3, BF16: 1e-2, F32: 1e-4}
SCALES = ("unit", "x20", "pm100")
FP32_NOISE = 64 * 2.0**-24
"""Below this relative error an fp32 program's figure is summation-order noise (the library GEMM
and numpy's matmul sum in different orders), so its model is not held to within 2x there."""


class _Blk:
    def __init__(self, grid: tuple[int, int, int], loop: int) -> None:
        self.grid, self.loop, self.srcs, self.maps = grid, loop, [], []

    def it(self, src: Node, imap: tuple, fmap: int | None = None) -> Node:
        im = InputMap(imap, fmap)
        self.srcs.append(src)
        self.maps.append(im)
        return b.iter_(
            len(self.srcs) - 1,
            tile_shape(src.shape, im, self.grid, self.loop),
            src.dtype,
            fmap is not None,
        )

    def launch(self, saves: list[Node]) -> list[Node]:
        return b.graph_def(self.srcs, b.block_graph(self.grid, self.loop, self.maps, saves))


def _qkv(dt: DType, g: int, m: int, d: int, n: int) -> tuple[Node, Node, Node]:
    return b.input_(0, (g, m, d), dt), b.input_(1, (g, d, n), dt), b.input_(2, (g, n, d), dt)


def pre_block(dt: DType, g: int = 2, m: int = 32, d: int = 16, n: int = 32) -> KernelGraph:
    """e = exp(q @ k); out = (e @ v) / rowsum(e), all in the PRE phase of one block."""
    q, k, v = _qkv(dt, g, m, d, n)
    blk = _Blk((g, 2, 1), 1)
    bq, bk, bv = blk.it(q, (0, 1, None)), blk.it(k, (0, None, None)), blk.it(v, (0, None, None))
    e = b.unary(Op.EXP, b.matmul(bq, bk))
    o = b.div(b.matmul(e, bv), b.reduce(Op.REDUCE_SUM, e, 2))
    (out,) = blk.launch([b.save(o, 0, (0, 1, None), dt)])
    return b.kernel_graph([q, k, v], [out], ["Q", "K", "V"], ["O"])


def kernel_level(dt: DType, g: int = 2, m: int = 32, d: int = 16, n: int = 32) -> KernelGraph:
    """The same at kernel level: exp in fp32, cast to the storage dtype for the second matmul."""
    q, k, v = _qkv(dt, g, m, d, n)
    e = b.unary(Op.EXP, T._to32(b.matmul(q, k)))
    o = b.div(T._to32(b.matmul(T._back(e, dt), v)), b.reduce(Op.REDUCE_SUM, e, 2))
    return b.kernel_graph([q, k, v], [T._back(o, dt)], ["Q", "K", "V"], ["O"])


def loop_sums(
    dt: DType, g: int = 2, m: int = 32, d: int = 16, n: int = 64, loop: int = 2
) -> KernelGraph:
    """LOOP phase, written with plain sums: ACC_SUM(exp(s) @ v) / ACC_SUM(rowsum(exp(s)))."""
    q, k, v = _qkv(dt, g, m, d, n)
    blk = _Blk((g, 2, 1), loop)
    bq, bk, bv = blk.it(q, (0, 1, None)), blk.it(k, (0, None, 2), 2), blk.it(v, (0, None, 1), 1)
    e = b.unary(Op.EXP, b.matmul(bq, bk))
    num = b.accumulate(Op.ACC_SUM, b.matmul(e, bv))
    den = b.accumulate(Op.ACC_SUM, b.reduce(Op.REDUCE_SUM, e, 2))
    (out,) = blk.launch([b.save(b.div(num, den), 0, (0, 1, None), dt)])
    return b.kernel_graph([q, k, v], [out], ["Q", "K", "V"], ["O"])


def loop_scaled_score(
    dt: DType, g: int = 2, m: int = 32, d: int = 16, n: int = 64, loop: int = 2
) -> KernelGraph:
    """LOOP phase with the rescaling accumulators and a score scaled after the matmul."""
    q, k, v = _qkv(dt, g, m, d, n)
    blk = _Blk((g, 2, 1), loop)
    bq, bk, bv = blk.it(q, (0, 1, None)), blk.it(k, (0, None, 2), 2), blk.it(v, (0, None, 1), 1)
    s = b.mul(b.matmul(bq, bk), b.const(Fraction(1, 4)))
    o = b.div(b.accumulate(Op.ACC_EXP_WSUM, s, bv), b.accumulate(Op.ACC_EXP_SUM, s))
    (out,) = blk.launch([b.save(o, 0, (0, 1, None), dt)])
    return b.kernel_graph([q, k, v], [out], ["Q", "K", "V"], ["O"])


def loop_two_terms(
    dt: DType, g: int = 2, m: int = 32, d: int = 16, n: int = 64, loop: int = 2
) -> KernelGraph:
    """MLA-shaped: s = (q @ k + q2 @ transpose(k2)) / 4 with the value tile shared with no term."""
    q, k, v = _qkv(dt, g, m, d, n)
    q2, k2 = b.input_(3, (g, m, 16), dt), b.input_(4, (g, n, 16), dt)
    blk = _Blk((g, 2, 1), loop)
    bq, bk, bv = (
        blk.it(q, (0, 1, None)),
        blk.it(k, (0, None, None), 2),
        blk.it(v, (0, None, None), 1),
    )
    bq2, bk2 = blk.it(q2, (0, 1, None)), blk.it(k2, (0, None, None), 1)
    s = b.mul(
        b.add(b.matmul(bq, bk), b.matmul(bq2, b.transpose(bk2, (0, 2, 1)))), b.const(Fraction(1, 4))
    )
    o = b.div(b.accumulate(Op.ACC_EXP_WSUM, s, bv), b.accumulate(Op.ACC_EXP_SUM, s))
    (out,) = blk.launch([b.save(o, 0, (0, 1, None), dt)])
    return b.kernel_graph([q, k, v, q2, k2], [out], ["Q", "K", "V", "Q2", "K2"], ["O"])


def loop_key_factor(
    dt: DType, g: int = 2, m: int = 32, d: int = 16, n: int = 64, loop: int = 2
) -> KernelGraph:
    """qknorm-shaped: s = (q @ k) * rsqrt(mean over d of k^2 + eps), one factor per key."""
    q, k, v = _qkv(dt, g, m, d, n)
    blk = _Blk((g, 2, 1), loop)
    bq, bk, bv = (
        blk.it(q, (0, 1, None)),
        blk.it(k, (0, None, None), 2),
        blk.it(v, (0, None, None), 1),
    )
    ms = b.mul(b.reduce(Op.REDUCE_SUM, b.unary(Op.SQUARE, bk), 1), b.const(Fraction(1, d)))
    s = b.mul(b.matmul(bq, bk), b.unary(Op.RSQRT, b.add(ms, b.const(Fraction(1, 1 << 20)))))
    o = b.div(b.accumulate(Op.ACC_EXP_WSUM, s, bv), b.accumulate(Op.ACC_EXP_SUM, s))
    (out,) = blk.launch([b.save(o, 0, (0, 1, None), dt)])
    return b.kernel_graph([q, k, v], [out], ["Q", "K", "V"], ["O"])


BUILDERS: dict[str, Callable[[DType], KernelGraph]] = {
    "pre": pre_block,
    "kernel": kernel_level,
    "loop_sums": loop_sums,
    "loop_scaled": loop_scaled_score,
    "loop_two_terms": loop_two_terms,
    "loop_key_factor": loop_key_factor,
}
CASES = {f"{k}_{dt.value}": (f, dt) for k, f in BUILDERS.items() for dt in (F16, BF16, F32)}


def _inputs(kg: KernelGraph, scale: str, seed: int = 0) -> list[np.ndarray]:
    """Normal Q, K, V; Q multiplied by 20, or by whatever makes the largest |q @ k| about 100
    (the scores of loop_scaled are q @ k / 4, hence 400 there)."""
    rng = np.random.default_rng(seed)
    x = [rng.standard_normal(n.shape) for n in kg.inputs]
    if scale == "x20":
        x[0] = x[0] * 20
        if len(x) > 3:
            x[3] = x[3] * 20
    elif scale == "pm100":
        x[0] = x[0] * (100 / np.abs(np.matmul(x[0], x[1])).max())
        if len(x) > 3:  # the second score term at the same scale
            x[3] = x[3] * (100 / np.abs(np.matmul(x[3], np.swapaxes(x[4], 1, 2))).max())
    return [a.astype(T.np_dtype(n.dtype)) for a, n in zip(x, kg.inputs)]


@pytest.fixture(scope="module")
def graphs() -> dict[str, KernelGraph]:
    out = {}
    for name, (f, dt) in CASES.items():
        kg = f(dt)
        check(kg)
        out[name] = kg
    return out


@pytest.fixture(scope="module")
def emulator(graphs, tmp_path_factory):
    with fresh_cache(tmp_path_factory):
        yield hostemu.Bundle({k: generate(kg) for k, kg in graphs.items()}, binaries=2)


def _error(got: np.ndarray, want: np.ndarray) -> float:
    assert np.isfinite(want).all(), "the float64 reference itself overflowed: choose smaller logits"
    g = np.asarray(got, dtype=np.float64)
    return float("inf") if not np.isfinite(g).all() else T.rel_error(g, want)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", list(CASES))
def test_emulated_within_limits(name, scale, graphs, emulator):
    kg = graphs[name]
    ins = _inputs(kg, scale)
    (want,) = interpreter.run(kg, ins, mode="float64")
    (got,) = emulator.run(name, ins)
    err = _error(got, want)
    assert err <= LIMITS[CASES[name][1]], f"{name} at {scale}: relative error {err:.2e}"


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", list(CASES))
def test_float32_interpreter_within_limits(name, scale, graphs):
    """The interpreter's "as codegen computes" mode keeps the same values scaled."""
    kg = graphs[name]
    ins = _inputs(kg, scale)
    (want,) = interpreter.run(kg, ins, mode="float64")
    (got,) = interpreter.run(kg, ins, mode="float32")
    err = _error(got, want)
    assert err <= LIMITS[CASES[name][1]], f"{name} at {scale}: relative error {err:.2e}"


@pytest.mark.parametrize("dt", [F16, BF16])
@pytest.mark.parametrize("kind", ["loop_sums", "loop_scaled", "loop_two_terms", "loop_key_factor"])
def test_score_forms_take_the_register_path(kind, dt, graphs):
    """A scaled score, a per-key factor, two score terms and the plain-sum spelling all run as
    mlso::FlashRows (scores in registers), not through the shared-memory score path."""
    source = generate(graphs[f"{kind}_{dt.value}"]).source
    assert "mlso::FlashRows<" in source and "flash.step" in source
    two = kind == "loop_two_terms"
    assert (source.count("FlashRows<") == 1) and (", 16, true, true>" in source) == two


@pytest.mark.parametrize("name", list(CASES))
def test_float32_mode_reports_the_error_codegen_makes(name, graphs, emulator):
    """One model of the computation: the interpreter's float32 mode (codegen's stabilised exps,
    rewrites and 16-bit tensor-core operands) has the emulated program's error, within 2x."""
    kg = graphs[name]
    for scale in SCALES:
        ins = _inputs(kg, scale)
        (want,) = interpreter.run(kg, ins, mode="float64")
        emu = _error(emulator.run(name, ins)[0], want)
        model = _error(interpreter.run(kg, ins, mode="float32")[0], want)
        if max(emu, model) <= FP32_NOISE and CASES[name][1] is F32:
            continue  # both are fp32 rounding noise, where the summation order decides the figure
        assert model / 2 <= emu <= 2 * model, (
            f"{name} at {scale}: emulator {emu:.2e}, float32 mode {model:.2e}"
        )


def test_matmul_scale_rule():
    """A per-row scale of A is a per-row scale of C; a scale varying along K is not carried; a
    per-column scale of B is a per-column scale of C; with both, A's is carried and B's materialised."""
    from mlso_cli.codegen.scale import BufferScale, matmul_scale

    m = b.input_(0, (2, 8, 1), F32)
    row = BufferScale(m, 1, (None, (1, 1), None))  # M[0, i, 0] for A (.., i, k)
    along_k = BufferScale(m, 1, (None, (2, 1), None))  # M depends on k
    col = BufferScale(m, 1, (None, None, (2, 1)))  # M[0, 0, j] for B (.., k, j)
    assert matmul_scale(row, None, 3, 3, 3) == (
        BufferScale(m, 1, (None, (1, 1), None)),
        True,
        False,
    )
    assert matmul_scale(along_k, None, 3, 3, 3) == (None, False, False)
    assert matmul_scale(None, col, 3, 3, 3) == (
        BufferScale(m, 1, (None, None, (2, 1))),
        False,
        True,
    )
    assert matmul_scale(row, col, 3, 3, 3)[1:] == (True, False)
    # a batch-free B against a batched A: C's dims are A's
    assert matmul_scale(row, None, 3, 2, 3)[0] == row


@pytest.mark.slow
def test_repro_programs_compile_with_nvcc(graphs, emulator):
    """nvcc (not only the host emulator) accepts every repro program, FlashRows' two-term and
    scaled-score forms included, for sm_80 and sm_90a (the emulator fixture sets the cache)."""
    import re

    from mlso_cli.codegen import nvcc

    sources = [
        re.sub(r"\bmlso_k(\d+)\b", rf"r{i}_k\1", generate(kg).source)
        for i, kg in enumerate(graphs.values())
    ]
    fatbin = nvcc.compile_source("\n".join(sources), ("sm_80", "sm_90a"))
    assert fatbin[:4] == (0xBA55ED50).to_bytes(4, "little")
