"""Random spec-valid μGraphs, grown through codegen.blockbuilder.BlockBuilder, for property tests.

Why: hand-written test graphs cover the spellings someone thought of; the search writes others.
Each family below draws one program shape at random and spells it one of several ways a search
may: division after the matmul (by a constant, a row statistic of the result or of the input);
scores scaled after the matmul (a constant, a softcap, a per-key factor, a row max, two score
terms); attention (exp of a score, row sums, a weighted sum) in the PRE phase and in the LOOP
phase (rescaling accumulators, ACC_SUM of exp terms, mixed, or a linear-attention weighting);
split-K and split-KV partials (a grid dim saving PARTIAL fp32 partials, combined by a
kernel-level REDUCE_SUM over that dim); LayerNorm with the mean subtracted (PRE) or expanded
into loop accumulators; two chained kernels; random op walks (`random_dag`); several outputs;
fp16, bf16 and fp32 inputs. Across families, grid dims are laid on x, y and z in every order
(`Layout`) and a share of draws use tile sizes that are not multiples of 16.

The split-KV combine is the IR's: the partials are exact sums of exp terms (ACC_EXP_* and PRE
row sums), so the kernel level sums them and divides. Keeping them relative to a running max
and rescaling in the combine is code generation's job (block.py, kernels.py), which is part of
what the property tests check.

Every graph is built through BlockBuilder (sm_90 budget) and passes `mlso_cli.codegen.budget.check`
before it is returned. Outputs stay finite, in their dtype, on unit-normal inputs by
construction: denominators are row sums of exp terms or squares plus a positive constant, raw
exp sums are not saved when an exp prologue widened the scores, and random walks end in an RMS
normalisation. `small=True` (the default) keeps tiles small enough for the CPU emulator;
`small=False` draws tiles up to full kernel sizes, some of which the builder refuses for shared
memory (the draw is then repeated).

Two front ends share the families: `graphs()` is a hypothesis strategy, `seeded(seed, n)` a
plain seeded list that visits the families in turn.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, TypeVar

import numpy as np
from hypothesis import strategies as st

from mlso_cli.codegen.blockbuilder import BlockBuilder, BuildError
from mlso_cli.codegen.budget import check
from mlso_cli.ir import PARTIAL, DType, InputMap, KernelGraph, Node, Op, Phase
from mlso_cli.ir import build as b

F16, BF16, F32 = DType.F16, DType.BF16, DType.F32
DTYPES = (F16, BF16, F32)
PROLOGUE = (Op.EXP, Op.RELU, Op.SQUARE, Op.NEG, Op.SILU, Op.TANH, Op.SIGMOID, Op.GELU)
"""Unary ops that keep unit-normal inputs finite and moderate (rsqrt/sqrt/reciprocal only ever
see positive arguments built for them)."""
EPILOGUE = (Op.RELU, Op.SILU, Op.TANH, Op.SIGMOID, Op.GELU, Op.NEG)
EPS = Fraction(1, 64)
ODD_SIZES: dict[str, tuple[int, ...]] = {
    "m": (12, 24, 40),
    "k": (24, 40, 48),
    "n": (12, 24, 40),
    "d": (12, 20, 24),
    "dv": (12, 24),
    "keys": (24, 40, 48),
    "h": (24, 40, 48),
    "p": (12, 24),
}
"""Tile sizes by label for draws with odd sizes (all divisible by the loop counts drawn)."""
T = TypeVar("T")


class Draw:
    """The random choices of one graph, recorded as label=value for its name."""

    def __init__(self, rng: random.Random, small: bool) -> None:
        self.rng = rng
        self.small = small
        self.tags: list[str] = []
        self.odd = small and rng.random() < 0.3
        if self.odd:
            self.tags.append("odd_sizes")
        self.flash = False
        """Keep to choices the register-resident online softmax takes (attention only)."""
        self.wide = False
        """An exp prologue made scores so wide that raw sums of exp(score) may overflow fp32:
        such sums are then not saved as outputs (normalised results are fine)."""

    def pick(self, label: str, options: Sequence[T]) -> T:
        value = options[self.rng.randrange(len(options))]
        self.tags.append(f"{label}={getattr(value, 'name', value)}")
        return value

    def size(self, label: str, small: Sequence[int], big: Sequence[int]) -> int:
        """A tile size: small or big options, or (in a draw with odd sizes) sizes that are not
        multiples of 16, which tensor-core paths must pad or leave to the scalar path."""
        if self.odd and not self.flash and label in ODD_SIZES:
            return self.pick(label, ODD_SIZES[label])
        return self.pick(label, small if self.small else big)

    def chance(self, label: str, p: float) -> bool:
        hit = self.rng.random() < p
        if hit:
            self.tags.append(label)
        return hit


@dataclass(frozen=True)
class Generated:
    name: str
    """family[choices]: enough to recognise the program shape in a failure message."""
    kg: KernelGraph


# ---- block-level helpers ------------------------------------------------------------------------


def _prologue(d: Draw, bb: BlockBuilder, x: Node) -> Node:
    kind = d.pick("prologue", ["none", "none", "unary", "scale", "rms"])
    if kind == "unary":
        op = d.pick("pro_op", PROLOGUE)
        d.wide |= op is Op.EXP
        return bb.unary(op, x)
    if kind == "scale":
        return bb.binary(Op.MUL, x, bb.const(d.pick("pro_c", [Fraction(1, 2), Fraction(3, 2), 2])))
    if kind == "rms":  # x * rsqrt(mean(x^2) + eps) over the last axis
        ms = bb.reduce(Op.REDUCE_MEAN, bb.unary(Op.SQUARE, x), -1)
        return bb.binary(Op.MUL, x, bb.unary(Op.RSQRT, bb.binary(Op.ADD, ms, bb.const(EPS))))
    return x


def _epilogue(d: Draw, bb: BlockBuilder, x: Node) -> Node:
    if d.chance("epilogue", 0.4):
        return bb.unary(d.pick("epi_op", EPILOGUE), x)
    return x


def _acc_if(bb: BlockBuilder, x: Node, looped: bool) -> Node:
    return bb.accumulate(Op.ACC_SUM, x) if looped else x


def _pos(bb: BlockBuilder, x: Node) -> Node:
    """x + 1 for x >= 0: a denominator that cannot vanish."""
    return bb.binary(Op.ADD, x, bb.const(1))


PERMS = ((0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0))


class Layout:
    """A family's grid dims in its own (logical) order, placed on CUDA's x, y, z in a drawn
    order, so that every grid dim plays every role (batch, rows, columns, partial splits)."""

    def __init__(self, d: Draw) -> None:
        self.order = PERMS[0] if d.rng.random() < 0.5 else d.pick("grid_order", PERMS[1:])

    def __call__(self, logical: Sequence[Any]) -> tuple[Any, Any, Any]:
        out: list[Any] = [None] * 3
        for i, where in enumerate(self.order):
            out[where] = logical[i]
        return tuple(out)  # type: ignore[return-value]


def _block(
    d: Draw,
    grid: tuple[int, int, int],
    loop: int,
    maps: Sequence[tuple[tuple[int | None, ...], int | None]],
    srcs: Sequence[Node],
) -> tuple[BlockBuilder, Layout]:
    """A builder over srcs whose grid and input maps (given in logical order) are laid out by a
    drawn Layout; saves give their omaps through the returned Layout too."""
    lay = Layout(d)
    inputs = [InputMap(lay(imap), fmap) for imap, fmap in maps]
    return BlockBuilder(
        tuple(g if g is not None else 1 for g in lay(grid)), loop, inputs, srcs
    ), lay


# ---- families -------------------------------------------------------------------------------------


def matmul_div(d: Draw) -> KernelGraph:
    """prologue(X) @ W (accumulated over K steps or not), then divided by something, then an
    optional epilogue; sometimes the undivided product or the divisor is a second output."""
    dt = d.pick("dtype", DTYPES)
    m, k, n = (
        d.size("m", [8, 16, 32], [32, 64, 128]),
        d.size("k", [16, 32], [64, 128, 256]),
        d.size("n", [8, 16, 32], [32, 64, 128]),
    )
    gr, gc, loop = d.pick("gr", [1, 2]), d.pick("gc", [1, 2]), d.pick("loop", [1, 2, 3])
    looped = loop > 1 or d.chance("loop1", 0.3)
    x_in, w_in = b.input_(0, (m * gr, k * loop), dt), b.input_(1, (k * loop, n * gc), dt)
    maps = [((0, None, None), 1 if looped else None), ((None, 1, None), 0 if looped else None)]
    bb, lay = _block(d, (gr, gc, 1), loop, maps, [x_in, w_in])
    x, w = bb.iter(0), bb.iter(1)
    c = _acc_if(bb, bb.matmul(_prologue(d, bb, x), w), looped)
    how = d.pick("div", ["const", "out_sumsq", "in_sumsq", "out_rms", "exp_den"])
    if how == "const":
        den = bb.const(d.pick("c", [3, Fraction(7, 2), Fraction(1, 3), 16]))
    elif how == "out_sumsq":
        den = _pos(bb, bb.reduce(Op.REDUCE_SUM, bb.unary(Op.SQUARE, c), 1))
    elif how == "in_sumsq":
        den = _pos(bb, _acc_if(bb, bb.reduce(Op.REDUCE_SUM, bb.unary(Op.SQUARE, x), 1), looped))
    elif how == "out_rms":
        den = bb.unary(
            Op.SQRT,
            bb.binary(Op.ADD, bb.reduce(Op.REDUCE_MEAN, bb.unary(Op.SQUARE, c), 1), bb.const(EPS)),
        )
    else:  # c / (1 + exp(-relu(c))): an elementwise denominator
        den = _pos(bb, bb.unary(Op.EXP, bb.unary(Op.NEG, bb.unary(Op.RELU, c))))
    o = _epilogue(d, bb, bb.binary(Op.DIV, c, den))
    out_dt = d.pick("out", [dt, F32])
    bb.save(o, lay((1, 0, None) if d.chance("tiles_swapped", 0.15) else (0, 1, None)), out_dt)
    names = ["O"]
    extra = d.pick("extra", [None, None, "product", "divisor"])
    if extra == "product":
        bb.save(c, lay((0, 1, None)), dt)
        names.append("C")
    elif extra == "divisor" and den.shape:
        bb.save(den, lay((0, 1, None)), F32)
        names.append("D")
    return b.kernel_graph([x_in, w_in], bb.launch(), ["X", "W"], names)


def _scores(d: Draw, bb: BlockBuilder, terms: list[tuple[Node, Node]]) -> Node:
    """The sum of q @ k over the terms (each term maybe scaled on its own), then one or two of
    the score transforms a search may spell after the matmul."""
    s = None
    for i, (q, k) in enumerate(terms):
        t = bb.matmul(q, k)
        if len(terms) > 1 and d.chance(f"term{i}_scaled", 0.3):
            t = bb.binary(
                Op.MUL, t, bb.const(d.pick(f"term{i}_c", [Fraction(1, 4), Fraction(1, 2)]))
            )
        s = t if s is None else bb.binary(Op.ADD, s, t)
    k = terms[0][1]
    for i in range(d.pick("transforms", [1, 1, 2])):
        s = _transform(d, bb, s, k, i)
    return s


def _transform(d: Draw, bb: BlockBuilder, s: Node, k: Node, i: int) -> Node:
    forms = ["plain", "scaled", "key_factor"]
    how = d.pick(f"score{i}", forms if d.flash else forms + ["divided", "softcap", "row_max"])
    if how == "scaled":
        return bb.binary(
            Op.MUL,
            s,
            bb.const(d.pick(f"scale{i}", [Fraction(1, 4), Fraction(1, 8), Fraction(3, 10)])),
        )
    if how == "divided":
        return bb.binary(Op.DIV, s, bb.const(d.pick(f"div{i}", [4, 8, Fraction(5, 2)])))
    if how == "softcap":  # c * tanh(s / c)
        c = d.pick(f"cap{i}", [5, 8])
        return bb.binary(
            Op.MUL, bb.unary(Op.TANH, bb.binary(Op.MUL, s, bb.const(Fraction(1, c)))), bb.const(c)
        )
    if how == "key_factor":  # s * rsqrt(mean over d of k^2 + eps): one factor per key, either side
        ms = bb.reduce(Op.REDUCE_MEAN, bb.unary(Op.SQUARE, k), len(k.shape) - 2)
        f = bb.unary(Op.RSQRT, bb.binary(Op.ADD, ms, bb.const(EPS)))
        a, c = (f, s) if d.chance(f"factor_first{i}", 0.5) else (s, f)
        return bb.binary(Op.MUL, a, c)
    if how == "row_max":
        return bb.binary(Op.SUB, s, bb.reduce(Op.REDUCE_MAX, s, -1))
    return s


def attention(d: Draw) -> KernelGraph:
    """softmax-weighted sums of V over Q K scores, in PRE or LOOP phase, whole or split over the
    keys (PARTIAL numerators and denominators, combined at kernel level); K stored either way
    round, maybe doubling as V (MLA's latent cache), maybe a second score term (MLA's rope).
    About a third of the draws keep to what the register-resident online softmax takes (16-bit
    tiles, a loop, rescaling accumulators, score forms), which random draws rarely all meet."""
    fl = d.chance("flash_friendly", 0.35)
    d.flash = fl
    dt = d.pick("dtype", (F16, BF16) if fl else DTYPES)
    looped = fl or d.pick("phase", ["pre", "loop"]) == "loop"
    split = d.pick("split", [1, 1, 2])
    g, rs = d.pick("g", [1, 2]), d.pick("row_tiles", [1, 2])
    gx = g if fl or d.pick("batch", ["split", "split", "split", "in_block"]) == "split" else 1
    m = d.size("m", [16, 32] if fl else [8, 16, 16, 32], [32, 64, 128])
    dk, dv = (
        d.size("d", [16, 32] if fl else [8, 16, 32], [64, 128]),
        d.size("dv", [8, 16, 32], [64, 128]),
    )
    n = d.size("keys", [16, 32, 64], [64, 128])
    loop = d.pick("loop", [1, 2, 3]) if looped else 1
    keys = n * loop * split
    k_rows = (
        d.pick("k_layout", ["d_keys", "keys_d"]) == "keys_d"
    )  # K stored (g, keys, d): transposed in the block
    shared = k_rows and d.chance("kv_shared", 0.3)
    dv = dk if shared else dv
    kdim = 1 if k_rows else 2
    ins = [
        b.input_(0, (g, m * rs, dk), dt),
        b.input_(1, (g, keys, dk) if k_rows else (g, dk, keys), dt),
    ]
    in_names = ["Q", "K"]
    maps = [((0, 1, None), None), ((0, None, kdim), kdim if looped else None)]
    if not shared:
        ins.append(b.input_(2, (g, keys, dv), dt if fl else d.pick("v_dtype", [dt, dt, F32])))
        in_names.append("V")
        maps.append(((0, None, 1), 1 if looped else None))
    if d.chance("two_term", 0.25):
        dp = d.pick("d_rope", [8, 16])
        ins += [b.input_(len(ins), (g, m * rs, dp), dt), b.input_(len(ins) + 1, (g, dp, keys), dt)]
        in_names += ["Q2", "K2"]
        maps += [((0, 1, None), None), ((0, None, 2), 2 if looped else None)]
    bb, lay = _block(d, (gx, rs, split), loop, maps, ins)
    tiles = [bb.iter(i) for i in range(len(ins))]
    q, k = tiles[0], tiles[1]
    v = k if shared else tiles[2]
    if k_rows:
        k = bb.transpose(k, (0, 2, 1))
    terms = [(_prologue(d, bb, q), k)] + ([(tiles[-2], tiles[-1])] if "Q2" in in_names else [])
    s = _scores(d, bb, terms)
    num, den, probs = _weighting(d, bb, s, v, looped, split)
    out_dt = d.pick("out", [dt, dt, F32])
    if probs is not None:  # the normalised scores themselves
        bb.save(probs, lay((0, 1, 2)), out_dt)
        return b.kernel_graph(ins, bb.launch(), in_names, ["P"])
    q_stat = d.chance("q_stat_out", 0.2)  # a PRE value saved beside the loop's results
    if split == 1:
        o = num if den is None else bb.binary(Op.DIV, num, den)
        bb.save(_epilogue(d, bb, o), lay((0, 1, None)), out_dt)
        names = ["O"]
        if den is not None and not d.wide and d.chance("den_out", 0.3):
            bb.save(den, lay((0, 1, None)), F32)
            names.append("L")
        if q_stat:
            bb.save(bb.reduce(Op.REDUCE_MAX, q, -1), lay((0, 1, None)), dt)
            names.append("Qmax")
        return b.kernel_graph(ins, bb.launch(), in_names, names)
    bb.save(num, lay((0, 1, PARTIAL)), F32)
    if den is not None:
        bb.save(den, lay((0, 1, PARTIAL)), F32)
    if q_stat:
        bb.save(bb.reduce(Op.REDUCE_MAX, q, -1), lay((0, 1, PARTIAL)), F32)
    parts = bb.launch()
    out = b.reduce(Op.REDUCE_SUM, parts[0], 0)
    if den is not None:
        out = b.div(out, b.reduce(Op.REDUCE_SUM, parts[1], 0))
    out = b.reshape(out if out_dt is F32 else b.cast(out, out_dt), (g, m * rs, dv))
    outs, names = [out], ["O"]
    if den is not None and not d.wide and d.chance("partials_out", 0.3):
        outs.append(parts[1])
        names.append("den_partials")
    if q_stat:  # every split holds the same row max: their max is it
        outs.append(b.reduce(Op.REDUCE_MAX, parts[-1], 0))
        names.append("Qmax")
    return b.kernel_graph(ins, outs, in_names, names)


def _weighting(
    d: Draw, bb: BlockBuilder, s: Node, v: Node, looped: bool, split: int
) -> tuple[Node, Node | None, Node | None]:
    """(numerator, denominator or None, normalised scores or None) of one spelling."""
    if looped:
        form = d.pick(
            "acc",
            ["exp_acc", "acc_sum"]
            if d.flash
            else ["exp_acc", "exp_acc", "acc_sum", "mixed", "linear"],
        )
        if form == "exp_acc":
            return bb.accumulate(Op.ACC_EXP_WSUM, s, v), bb.accumulate(Op.ACC_EXP_SUM, s), None
        if form == "linear":  # a non-exp weighting: sums of sigmoid or relu weights
            a = bb.unary(d.pick("weight", [Op.SIGMOID, Op.RELU]), s)
            den = _pos(bb, bb.accumulate(Op.ACC_SUM, bb.reduce(Op.REDUCE_SUM, a, -1)))
            return bb.accumulate(Op.ACC_SUM, bb.matmul(a, v)), den, None
        e = bb.unary(Op.EXP, s)
        den = bb.accumulate(Op.ACC_SUM, bb.reduce(Op.REDUCE_SUM, e, -1))
        if form == "mixed":
            return bb.accumulate(Op.ACC_EXP_WSUM, s, v), den, None
        return bb.accumulate(Op.ACC_SUM, bb.matmul(e, v)), den, None
    e = bb.unary(Op.EXP, s)
    r = bb.reduce(Op.REDUCE_SUM, e, -1)
    form = d.pick("pre", ["wsum_div", "wsum_div", "probs_matmul", "probs_out"])
    if form == "probs_out" and split == 1:
        return e, None, bb.binary(Op.DIV, e, r)
    if form == "probs_matmul" and split == 1:
        return bb.matmul(bb.binary(Op.DIV, e, r), v), None, None
    return bb.matmul(e, v), r, None


def split_k(d: Draw) -> KernelGraph:
    """X @ W with K split over a grid dim (PARTIAL fp32 partials), summed at kernel level;
    optionally an RMS factor whose sum of squares is split the same way."""
    dt = d.pick("dtype", DTYPES)
    m, k, n = (
        d.size("m", [8, 16, 32], [32, 64, 128]),
        d.size("k", [16, 32], [64, 128, 256]),
        d.size("n", [16, 32], [64, 128]),
    )
    gc, split, loop = d.pick("gc", [1, 2]), d.pick("split", [2, 3, 4]), d.pick("loop", [1, 2])
    looped = loop > 1 or d.chance("loop1", 0.3)
    kk = k * loop * split
    x_in, w_in = b.input_(0, (m, kk), dt), b.input_(1, (kk, n * gc), dt)
    maps = [((None, None, 1), 1 if looped else None), ((1, None, 0), 0 if looped else None)]
    bb, lay = _block(d, (gc, 1, split), loop, maps, [x_in, w_in])
    x, w = bb.iter(0), bb.iter(1)
    xp = _prologue(d, bb, x)
    bb.save(_acc_if(bb, bb.matmul(xp, w), looped), lay((1, None, PARTIAL)), F32)
    rms = d.chance("rms", 0.4)
    if rms:
        bb.save(
            _acc_if(bb, bb.reduce(Op.REDUCE_SUM, bb.unary(Op.SQUARE, x), 1), looped),
            lay((1, None, PARTIAL)),
            F32,
        )
    parts = bb.launch()
    y = b.reshape(b.reduce(Op.REDUCE_SUM, parts[0], 0), (m, n * gc))
    if rms:  # every column block holds the same sum of squares: take one
        ss = b.reduce(Op.REDUCE_SUM, parts[1], 0)
        if gc > 1:
            ss = b.reduce(Op.REDUCE_MAX, ss, 2)
        ms = b.mul(b.reshape(ss, (m, 1)), b.const(Fraction(1, kk)))
        y = b.mul(y, b.unary(Op.RSQRT, b.add(ms, b.const(EPS))))
    if d.chance("kernel_epilogue", 0.3):
        y = b.unary(d.pick("k_epi", EPILOGUE), y)
    out_dt = d.pick("out", [dt, F32])
    outs, names = [y if out_dt is F32 else b.cast(y, out_dt)], ["O"]
    if d.chance("partials_out", 0.25):
        outs.append(parts[0])
        names.append("partials")
    return b.kernel_graph([x_in, w_in], outs, ["X", "W"], names)


def layernorm(d: Draw) -> KernelGraph:
    """LayerNorm with the mean subtracted: alone, followed by a matmul in the same block (PRE),
    or expanded into accumulators of a loop over H that also computes the matmul."""
    dt = d.pick("dtype", DTYPES)
    pdt = d.pick("param_dtype", [dt, F32])
    variant = d.pick("variant", ["norm", "norm_linear", "loop_linear"])
    gr = d.pick("gr", [1, 2])
    m, h = d.size("m", [8, 16, 32], [32, 64]), d.size("h", [16, 32, 64], [128, 256, 512])
    x_in, g_in, be_in = b.input_(0, (m * gr, h), dt), b.input_(1, (h,), pdt), b.input_(2, (h,), pdt)
    ins, in_names = [x_in, g_in, be_in], ["X", "gamma", "beta"]
    out_dt = d.pick("out", [dt, F32])
    if variant == "loop_linear":
        return _layernorm_loop(d, ins, in_names, gr, m, h, dt, out_dt)
    gc = d.pick("gc", [1, 2]) if variant == "norm_linear" else 1
    maps: list[tuple[tuple[int | None, ...], int | None]] = [
        ((0, None, None), None),
        ((None, None, None), None),
        ((None, None, None), None),
    ]
    srcs = list(ins)
    if variant == "norm_linear":
        n = d.size("n", [8, 16, 32], [64, 128])
        srcs.append(b.input_(3, (h, n * gc), dt))
        maps.append(((None, 1, None), None))
    bb, lay = _block(d, (gr, gc, 1), 1, maps, srcs)
    x, gamma, beta = bb.iter(0), bb.iter(1), bb.iter(2)
    if d.pick("mean", ["reduce_mean", "sum_times"]) == "reduce_mean":
        mu = bb.reduce(Op.REDUCE_MEAN, x, 1)
    else:
        mu = bb.binary(Op.MUL, bb.reduce(Op.REDUCE_SUM, x, 1), bb.const(Fraction(1, h)))
    xc = bb.binary(Op.SUB, x, mu)
    var = bb.reduce(Op.REDUCE_MEAN, bb.unary(Op.SQUARE, xc), 1)
    r = bb.unary(Op.RSQRT, bb.binary(Op.ADD, var, bb.const(EPS)))
    y = bb.binary(Op.ADD, bb.binary(Op.MUL, bb.binary(Op.MUL, xc, r), gamma), beta)
    names = []
    if variant == "norm_linear":
        bb.save(_epilogue(d, bb, bb.matmul(y, bb.iter(3))), lay((0, 1, None)), out_dt)
        names.append("O")
        in_names = in_names + ["W"]
    if variant == "norm" or (gc == 1 and d.chance("y_out", 0.3)):
        bb.save(y, lay((0, 1, None)), out_dt)
        names.append("Y")
    if d.chance("stats_out", 0.3):
        bb.save(mu, lay((0, 1, None)), F32)
        bb.save(r, lay((0, 1, None)), F32)
        names += ["mean", "rstd"]
    return b.kernel_graph(srcs, bb.launch(), in_names, names)


def _layernorm_loop(
    d: Draw, ins: list[Node], in_names: list[str], gr: int, m: int, h: int, dt: DType, out_dt: DType
) -> KernelGraph:
    """((x - mu) r gamma + beta) @ W in one pass over H: every statistic an accumulator,
    var = E[x^2] - mu^2, and the mean subtracted after the loop: r (x.(gamma W) - mu (gamma.W))."""
    loop = d.pick("loop", [2, 4])
    gc = d.pick("gc", [1, 2])
    n = d.size("n", [8, 16, 32], [64, 128])
    w_in = b.input_(3, (h, n * gc), dt)
    maps = [
        ((0, None, None), 1),
        ((None, None, None), 0),
        ((None, None, None), 0),
        ((None, 1, None), 0),
    ]
    bb, lay = _block(d, (gr, gc, 1), loop, maps, [*ins, w_in])
    x, gamma, beta, w = (bb.iter(i) for i in range(4))
    step = h // loop
    acc = lambda v: bb.accumulate(Op.ACC_SUM, v)  # noqa: E731
    xw = acc(bb.matmul(bb.binary(Op.MUL, x, gamma), w))
    gw = acc(bb.matmul(bb.reshape(gamma, (1, step)), w))
    bw = acc(bb.matmul(bb.reshape(beta, (1, step)), w))
    inv_h = bb.const(Fraction(1, h))
    mu = bb.binary(Op.MUL, acc(bb.reduce(Op.REDUCE_SUM, x, 1)), inv_h)
    ex2 = bb.binary(Op.MUL, acc(bb.reduce(Op.REDUCE_SUM, bb.unary(Op.SQUARE, x), 1)), inv_h)
    r = bb.unary(
        Op.RSQRT, bb.binary(Op.ADD, bb.binary(Op.SUB, ex2, bb.unary(Op.SQUARE, mu)), bb.const(EPS))
    )
    o = bb.binary(
        Op.ADD, bb.binary(Op.MUL, bb.binary(Op.SUB, xw, bb.binary(Op.MUL, mu, gw)), r), bw
    )
    bb.save(_epilogue(d, bb, o), lay((0, 1, None)), out_dt)
    names = ["O"]
    if d.chance("stats_out", 0.3):
        bb.save(mu, lay((0, 1, None)), F32)
        names.append("mean")
    return b.kernel_graph([*ins, w_in], bb.launch(), [*in_names, "W"], names)


def chained(d: Draw) -> KernelGraph:
    """Two graph-defined kernels: the second loops over the first's output (a kernel tensor),
    its weight maybe read through a kernel-level transpose; outputs maybe viewed or doubled."""
    dt = d.pick("dtype", DTYPES)
    m, h = d.size("m", [8, 16, 32], [64, 128]), d.size("h", [16, 32], [64, 128, 256])
    n, p = d.size("n", [16, 32], [64, 128]), d.size("p", [8, 16, 32], [64, 128])
    gr, gc = d.pick("gr", [1, 2]), d.pick("gc", [1, 2])
    x_in, w1_in = b.input_(0, (m * gr, h), dt), b.input_(1, (h, n * gc), dt)
    w_t = d.chance("w2_transposed", 0.5)
    w2_in = b.input_(2, (p, n * gc) if w_t else (n * gc, p), dt)
    bb1, lay1 = _block(
        d, (gr, gc, 1), 1, [((0, None, None), None), ((None, 1, None), None)], [x_in, w1_in]
    )
    y1 = _epilogue(d, bb1, bb1.matmul(_prologue(d, bb1, bb1.iter(0)), bb1.iter(1)))
    bb1.save(y1, lay1((0, 1, None)), d.pick("y_dtype", [dt, F32]))
    (y,) = bb1.launch()
    loop, g2 = d.pick("loop", [1, 2, 4]), d.pick("gc2", [1, 2])
    w2 = b.transpose(w2_in, (1, 0)) if w_t else w2_in
    maps = [((None, None, None), 1), ((1, None, None), 0)]
    bb2, lay2 = _block(d, (g2, 1, 1), loop, maps, [y, w2])
    z = bb2.accumulate(Op.ACC_SUM, bb2.matmul(bb2.iter(0), bb2.iter(1)))
    if d.chance("normalised", 0.4):
        z = bb2.binary(Op.DIV, z, _pos(bb2, bb2.reduce(Op.REDUCE_SUM, bb2.unary(Op.SQUARE, z), 1)))
    bb2.save(z, lay2((1, None, None)), dt)
    (out,) = bb2.launch()
    outs, names = [out], ["Z"]
    if d.chance("z_transposed", 0.3):
        outs.append(b.transpose(out, (1, 0)))
        names.append("Zt")
    if d.chance("y_out", 0.4):
        outs.append(y)
        names.append("Y")
    return b.kernel_graph([x_in, w1_in, w2_in], outs, ["X", "W1", "W2"], names)


def random_dag(d: Draw) -> KernelGraph:
    """Ops drawn at random over the tiles of X (M, K), W (K, N) and B (M, N): elementwise ops
    with broadcasting, reductions over either axis, transposes, matmuls wherever shapes meet,
    loop sums; the spellings no family above writes. An op the builder refuses (one mixing loop
    and post-loop values, say) is simply redrawn: its on-the-spot checks steer the walk.
    Outputs are RMS-normalised rows, so magnitudes stay where every dtype holds them."""
    dt = d.pick("dtype", DTYPES)
    m, k, n = (
        d.size("m", [8, 16, 32], [32, 64]),
        d.size("k", [16, 32], [64, 128]),
        d.size("n", [8, 16, 32], [32, 64]),
    )
    gr, loop = d.pick("gr", [1, 2]), d.pick("loop", [1, 2])
    looped = loop > 1 or d.chance("loop1", 0.3)
    srcs = [
        b.input_(0, (m * gr, k * loop), dt),
        b.input_(1, (k * loop, n), dt),
        b.input_(2, (m * gr, n), d.pick("b_dtype", [dt, F32])),
    ]
    maps = [
        ((0, None, None), 1 if looped else None),
        ((None, None, None), 0 if looped else None),
        ((0, None, None), None),
    ]
    bb, lay = _block(d, (gr, 1, 1), loop, maps, srcs)
    pool = [bb.iter(i) for i in range(3)]
    want, tries = d.pick("n_ops", [3, 5, 8]), 0
    ops: list[str] = []
    while len(ops) < want and tries < 20 * want:
        tries += 1
        kind = d.rng.choice(_DAG_STEPS)
        a = d.rng.choice(pool)
        try:
            v = kind(d, bb, a, pool)
        except BuildError:
            continue
        if v is not None:
            pool.append(v)
            ops.append(kind.__name__.removeprefix("_dag_"))
    d.tags.append("ops=" + "/".join(ops))
    picks = [pool[-1]] + (
        [d.rng.choice(pool[3:-1])] if len(pool) > 4 and d.chance("two_outputs", 0.4) else []
    )
    for v in picks:
        if v.phase is Phase.LOOP:
            v = bb.accumulate(Op.ACC_SUM, v)
        if len(v.shape) == 2 and v.shape != (1, 1):
            ms = bb.reduce(Op.REDUCE_MEAN, bb.unary(Op.SQUARE, v), 1)
            v = bb.binary(Op.MUL, v, bb.unary(Op.RSQRT, _pos(bb, ms)))
        bb.save(v, lay((0, None, None)), d.pick("out", [dt, F32]))
    return b.kernel_graph(srcs, bb.launch(), ["X", "W", "B"], [f"O{i}" for i in range(len(picks))])


def _dag_unary(d: Draw, bb: BlockBuilder, a: Node, pool: list[Node]) -> Node:
    return bb.unary(d.rng.choice(DAG_UNARY), a)


def _dag_binary(d: Draw, bb: BlockBuilder, a: Node, pool: list[Node]) -> Node | None:
    fits = [x for x in pool if all(p == q or 1 in (p, q) for p, q in zip(a.shape, x.shape))]
    other = d.rng.choice(fits)
    op = d.rng.choice((Op.ADD, Op.SUB, Op.MUL, Op.MAX, Op.DIV))
    if op is Op.DIV:  # a denominator >= 1
        return bb.binary(op, a, _pos(bb, bb.unary(Op.SQUARE, other)))
    return bb.binary(op, a, other)


def _dag_reduce(d: Draw, bb: BlockBuilder, a: Node, pool: list[Node]) -> Node:
    return bb.reduce(d.rng.choice(tuple(REDUCE_OPS)), a, d.rng.randrange(len(a.shape)))


def _dag_transpose(d: Draw, bb: BlockBuilder, a: Node, pool: list[Node]) -> Node:
    return bb.transpose(a, (1, 0))


def _dag_matmul(d: Draw, bb: BlockBuilder, a: Node, pool: list[Node]) -> Node | None:
    fits = [x for x in pool if x.shape[0] == a.shape[1]]
    if not fits or a.shape[1] == 1:
        return None
    c = bb.matmul(a, d.rng.choice(fits))  # scaled by 1/inner so chains of matmuls stay moderate
    return bb.binary(Op.MUL, c, bb.const(Fraction(1, a.shape[1])))


def _dag_accumulate(d: Draw, bb: BlockBuilder, a: Node, pool: list[Node]) -> Node | None:
    return bb.accumulate(Op.ACC_SUM, a) if a.phase is Phase.LOOP else None


DAG_UNARY = (Op.TANH, Op.SIGMOID, Op.RELU, Op.NEG, Op.SILU, Op.GELU, Op.ERF, Op.SQUARE)
REDUCE_OPS = (Op.REDUCE_SUM, Op.REDUCE_MEAN, Op.REDUCE_MAX)
_DAG_STEPS: tuple[Callable[[Draw, BlockBuilder, Node, list[Node]], Node | None], ...] = (
    _dag_unary,
    _dag_binary,
    _dag_binary,
    _dag_reduce,
    _dag_transpose,
    _dag_matmul,
    _dag_matmul,
    _dag_accumulate,
)
"""One random op each (None: nothing fits); binary ops and matmuls drawn twice as often."""


FAMILIES: dict[str, Callable[[Draw], KernelGraph]] = {
    "chained": chained,
    "matmul_div": matmul_div,
    "attention": attention,
    "random_dag": random_dag,
    "split_k": split_k,
    "layernorm": layernorm,
}
ATTEMPTS = 50
"""Draws per graph before giving up: only the shared-memory budget of big tiles refuses some."""


def generate(family: str, rng: random.Random, small: bool = True) -> Generated:
    """One spec-valid graph of `family` (redrawn while the builder refuses it for shared memory)."""
    for _ in range(ATTEMPTS):
        d = Draw(rng, small)
        try:
            kg = FAMILIES[family](d)
        except BuildError as exc:
            if "shared memory" in str(exc):
                continue
            raise AssertionError(
                f"{family}[{', '.join(d.tags)}]: the generator built a bad op: {exc}"
            ) from exc
        check(kg)
        return Generated(f"{family}[{', '.join(d.tags)}]", kg)
    raise AssertionError(f"{family}: no draw fits the shared-memory budget in {ATTEMPTS} attempts")


def seeded(seed: int, count: int, small: bool = True) -> list[Generated]:
    """`count` graphs from one seed, visiting the families in turn."""
    rng = random.Random(seed)
    names = sorted(FAMILIES)
    return [generate(names[i % len(names)], rng, small) for i in range(count)]


def graphs(small: bool = True) -> st.SearchStrategy[Generated]:
    """Hypothesis strategy over the same families (a family, then a seeded draw within it)."""
    return st.builds(
        lambda fam, rng: generate(fam, rng, small),
        st.sampled_from(sorted(FAMILIES)),
        st.randoms(use_true_random=False),
    )


def inputs_for(kg: KernelGraph, seed: int) -> list[np.ndarray]:
    """Unit-normal inputs stored in each input's dtype."""
    from tests.test_codegen_graphs import np_dtype

    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n.shape).astype(np_dtype(n.dtype)) for n in kg.inputs]


def least_precise(kg: KernelGraph) -> DType:
    """The least precise storage dtype among inputs and outputs: it sets the error scale."""
    dts = {n.dtype for n in list(kg.inputs) + list(kg.outputs)}
    return BF16 if BF16 in dts else F16 if F16 in dts else F32


def describe(g: Generated) -> dict[str, Any]:
    """A JSON-ready record of a generated graph (for repro files)."""
    from mlso_cli.ir import serialize

    return {"name": g.name, "graph": serialize.to_dict(g.kg)}
