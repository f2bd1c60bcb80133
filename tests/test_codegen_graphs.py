"""μGraphs for the codegen tests (CPU and GPU), and a float64 reference to check them against.

Each builder exercises one construct at small, tensor-core-friendly shapes. `GRAPHS` maps a test
id to a builder; `LOGIT_SCALE` marks graphs with softmax logits, which the tests also run with
logits of about +-100. This module holds no tests; test_codegen.py and test_codegen_gpu.py use it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from functools import partial

import numpy as np

from mlso_cli.ir import PARTIAL, DType, InputMap, KernelGraph, Node, Op, ThreadGraph
from mlso_cli.ir import build as b
from mlso_cli.ir.graph import BlockGraph
from mlso_cli.ir.node import const_value
from mlso_cli.ir.spec import tile_shape

F16, BF16, F32 = DType.F16, DType.BF16, DType.F32


def _to32(x: Node) -> Node:
    return x if x.dtype is F32 else b.cast(x, F32)


def _back(x: Node, dt: DType) -> Node:
    return x if dt is F32 else b.cast(x, dt)


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


# ---- kernel-level graphs (what lifting produces) --------------------------------------------------


def plain_attention(
    dt: DType = F16, g: int = 2, m: int = 32, d: int = 16, n: int = 64
) -> KernelGraph:
    """softmax(Q K) V as lifted: matmul, fp32 exp / reduce_sum / div, matmul."""
    q, k, v = b.input_(0, (g, m, d), dt), b.input_(1, (g, d, n), dt), b.input_(2, (g, n, d), dt)
    e = b.unary(Op.EXP, _to32(b.matmul(q, k)))
    p = _back(b.div(e, b.reduce(Op.REDUCE_SUM, e, 2)), dt)
    return b.kernel_graph([q, k, v], [b.matmul(p, v)], ["Q", "K", "V"], ["O"])


def masked_softmax(dt: DType = F32, rows: int = 8, n: int = 48) -> KernelGraph:
    """exp(x) * mask / sum(exp(x) * mask): the lifted masked softmax, plus a row output."""
    x, mask = b.input_(0, (rows, n), dt), b.input_(1, (rows, n), dt)
    e = b.mul(b.unary(Op.EXP, _to32(x)), _to32(mask))
    p = b.div(e, b.reduce(Op.REDUCE_SUM, e, 1))
    return b.kernel_graph([x, mask], [_back(p, dt)], ["X", "mask"], ["P"])


def elementwise_chain(dt: DType = F32, r: int = 4, c: int = 40) -> KernelGraph:
    """Every unary op, broadcasting, constants, shared subexpressions, several outputs, an output
    that is an input, a repeated output and a transposed (view) output."""
    x, y, z = b.input_(0, (r, c), dt), b.input_(1, (c,), dt), b.input_(2, (r, 1), dt)
    x32, y32, z32 = _to32(x), _to32(y), _to32(z)
    t = b.add(b.mul(x32, y32), z32)
    u = b.mul(b.unary(Op.GELU, t), b.unary(Op.SIGMOID, x32))
    u = b.add(u, b.mul(b.unary(Op.TANH, t), b.const(Fraction(1, 3))))
    u = b.sub(u, b.unary(Op.ERF, b.unary(Op.NEG, t)))
    u = b.add(u, b.unary(Op.SQRT, b.add(b.unary(Op.SQUARE, t), b.const(1))))
    u = b.add(u, b.unary(Op.RSQRT, b.add(b.unary(Op.RELU, t), b.const(Fraction(1, 2)))))
    u = b.add(u, b.unary(Op.SILU, b.unary(Op.RECIPROCAL, b.add(b.unary(Op.EXP, z32), b.const(1)))))
    u = b.binary(Op.MAX, u, t)
    w = _back(b.div(u, b.add(b.unary(Op.SQUARE, y32), b.const(2))), dt)
    return b.kernel_graph(
        [x, y, z], [w, b.transpose(w, (1, 0)), x, w], ["x", "y", "z"], ["w", "wt", "x_copy", "w2"]
    )


def views_matmul(dt: DType = F16, m: int = 48, k: int = 32, n: int = 40) -> KernelGraph:
    """matmul(transpose(A), transpose(B)) with a batch broadcast, then a reshape output."""
    a = b.input_(0, (2, k, m), dt)  # A stored (K, M): m contiguous
    bb = b.input_(1, (n, k), dt)  # B stored (N, K): k contiguous
    out = b.matmul(b.transpose(a, (0, 2, 1)), b.broadcast_to(b.transpose(bb, (1, 0)), (2, k, n)))
    return b.kernel_graph([a, bb], [b.reshape(out, (2 * m, n))], ["A", "B"], ["C"])


def batched_matmul(dt: DType = F32) -> KernelGraph:
    """Broadcast batch dims (2, 1) x (3,) -> (2, 3), with a fused elementwise prologue."""
    a, c = b.input_(0, (2, 1, 20, 24), dt), b.input_(1, (3, 24, 36), dt)
    a2 = b.unary(Op.RELU, a)
    return b.kernel_graph([a, c], [b.matmul(a2, c)], ["A", "B"], ["C"])


def reductions(dt: DType = F32) -> KernelGraph:
    """Mean over a leading axis (thread mode), max over the last (warp mode), a long sum."""
    x = b.input_(0, (6, 5, 96), dt)
    x32 = _to32(x)
    mean0 = b.reduce(Op.REDUCE_MEAN, x32, 0)
    max2 = b.reduce(Op.REDUCE_MAX, x32, 2)
    sum1 = b.reduce(Op.REDUCE_SUM, b.reshape(x32, (30, 96)), 1)
    return b.kernel_graph(
        [x], [_back(mean0, dt), _back(max2, dt), sum1], ["x"], ["mean0", "max2", "sum1"]
    )


# ---- graph-defined kernels -----------------------------------------------------------------------


def split_kv_attention(
    dt: DType = F16,
    g: int = 2,
    m: int = 32,
    d: int = 16,
    n: int = 128,
    row_tiles: int = 2,
    splits: int = 2,
    loop: int = 2,
) -> KernelGraph:
    """Flash-decoding: partial ACC_EXP_WSUM / ACC_EXP_SUM per KV split, combined at kernel level."""
    q, k, v = b.input_(0, (g, m, d), dt), b.input_(1, (g, d, n), dt), b.input_(2, (g, n, d), dt)
    blk = _Blk((g, row_tiles, splits), loop)
    bq, bk, bv = blk.it(q, (0, 1, None)), blk.it(k, (0, None, 2), 2), blk.it(v, (0, None, 1), 1)
    s = b.mul(b.matmul(bq, bk), b.const(Fraction(1, 4)))
    num = b.save(b.accumulate(Op.ACC_EXP_WSUM, s, bv), 0, (0, 1, PARTIAL), F32)
    den = b.save(b.accumulate(Op.ACC_EXP_SUM, s), 1, (0, 1, PARTIAL), F32)
    pnum, pden = blk.launch([num, den])
    out = b.div(b.reduce(Op.REDUCE_SUM, pnum, 0), b.reduce(Op.REDUCE_SUM, pden, 0))
    return b.kernel_graph([q, k, v], [b.reshape(_back(out, dt), (g, m, d))], ["Q", "K", "V"], ["O"])


def flash_attention(
    dt: DType = F16,
    g: int = 2,
    m: int = 32,
    d: int = 16,
    n: int = 96,
    loop: int = 3,
    dv: int | None = None,
) -> KernelGraph:
    """No split: the loop walks all keys and the POST division cancels the running max in-block.
    dv: V's width when it differs from d (MLA's values are wider than one warp's register tile)."""
    q, k, v = (
        b.input_(0, (g, m, d), dt),
        b.input_(1, (g, d, n), dt),
        b.input_(2, (g, n, dv or d), dt),
    )
    blk = _Blk((g, 2, 1), loop)
    bq, bk, bv = (
        blk.it(q, (0, 1, None)),
        blk.it(k, (0, None, None), 2),
        blk.it(v, (0, None, None), 1),
    )
    s = b.matmul(bq, bk)
    o = b.div(b.accumulate(Op.ACC_EXP_WSUM, s, bv), b.accumulate(Op.ACC_EXP_SUM, s))
    (out,) = blk.launch([b.save(o, 0, (0, 1, None), dt)])
    return b.kernel_graph([q, k, v], [out], ["Q", "K", "V"], ["O"])


def flash_relaid(dt: DType = F16, g: int = 2, m: int = 32, d: int = 16) -> KernelGraph:
    """flash attention over g heads handed on as [m, g * d], as a decoder hands P·V to o_proj:
    the kernel saves through the transpose and reshape (roots.through_views)."""
    core = flash_attention(dt, g=g, m=m, d=d)
    (o,) = core.outputs
    viewed = b.reshape(b.transpose(o, (1, 0, 2)), (m, g * d))
    return b.kernel_graph(list(core.inputs), [viewed], list(core.input_names), ["O2"])


def flash_v_factor(
    dt: DType = F16, g: int = 2, m: int = 32, d: int = 16, n: int = 96, loop: int = 3
) -> KernelGraph:
    """qknorm-style flash attention: V is RMS-normalised per key inside the loop, a per-key factor
    that code generation may fold into the exp terms instead of rewriting V."""
    q, k, v = b.input_(0, (g, m, d), dt), b.input_(1, (g, d, n), dt), b.input_(2, (g, n, d), dt)
    blk = _Blk((g, 2, 1), loop)
    bq, bk, bv = (
        blk.it(q, (0, 1, None)),
        blk.it(k, (0, None, None), 2),
        blk.it(v, (0, None, None), 1),
    )
    ms = b.mul(b.reduce(Op.REDUCE_SUM, b.unary(Op.SQUARE, bv), 2), b.const(Fraction(1, d)))
    vn = b.mul(bv, b.unary(Op.RSQRT, b.add(ms, b.const(Fraction(1, 1 << 20)))))
    s = b.matmul(bq, bk)
    o = b.div(b.accumulate(Op.ACC_EXP_WSUM, s, vn), b.accumulate(Op.ACC_EXP_SUM, s))
    (out,) = blk.launch([b.save(o, 0, (0, 1, None), dt)])
    return b.kernel_graph([q, k, v], [out], ["Q", "K", "V"], ["O"])


def partial_outputs(
    dt: DType = F32, g: int = 2, m: int = 16, d: int = 16, n: int = 64
) -> KernelGraph:
    """Split-KV partials that are graph outputs themselves (saved exact), beside the combine."""
    q, k, v = b.input_(0, (g, m, d), dt), b.input_(1, (g, d, n), dt), b.input_(2, (g, n, d), dt)
    blk = _Blk((g, 1, 2), 2)
    bq, bk, bv = blk.it(q, (0, None, None)), blk.it(k, (0, None, 2), 2), blk.it(v, (0, None, 1), 1)
    s = b.matmul(bq, bk)
    pnum, pden = blk.launch(
        [
            b.save(b.accumulate(Op.ACC_EXP_WSUM, s, bv), 0, (0, None, PARTIAL), F32),
            b.save(b.accumulate(Op.ACC_EXP_SUM, s), 1, (0, None, PARTIAL), F32),
        ]
    )
    out = b.div(b.reduce(Op.REDUCE_SUM, pnum, 0), b.reduce(Op.REDUCE_SUM, pden, 0))
    return b.kernel_graph([q, k, v], [out, pden], ["Q", "K", "V"], ["O", "den_partials"])


def rmsnorm_matmul(
    dt: DType = F16, rows: int = 16, h: int = 64, n: int = 32, grid: int = 2, loop: int = 2
) -> KernelGraph:
    """RMSNorm(X) * gamma @ W in one kernel: the loop walks K with two accumulators."""
    x, gamma, w = b.input_(0, (rows, h), dt), b.input_(1, (h,), dt), b.input_(2, (h, n), dt)
    blk = _Blk((grid, 1, 1), loop)
    bx, bg, bw = (
        blk.it(x, (None, None, None), 1),
        blk.it(gamma, (None, None, None), 0),
        blk.it(w, (1, None, None), 0),
    )
    acc = b.accumulate(Op.ACC_SUM, b.matmul(b.mul(bx, bg), bw))
    ss = b.accumulate(Op.ACC_SUM, b.reduce(Op.REDUCE_SUM, b.unary(Op.SQUARE, bx), 1))
    r = b.unary(Op.RSQRT, b.add(b.mul(ss, b.const(Fraction(1, h))), b.const(Fraction(1, 1 << 20))))
    (out,) = blk.launch([b.save(b.mul(acc, r), 0, (1, None, None), dt)])
    return b.kernel_graph([x, gamma, w], [out], ["X", "gamma", "W"], ["O"])


def gated_mlp(
    dt: DType = F16, rows: int = 8, h: int = 64, f: int = 64, grid: int = 2, loop: int = 2
) -> KernelGraph:
    """SiLU(X W1) * (X W2): two ACC_SUM accumulators over the same X tile (rows < 16: M padding)."""
    x, w1, w2 = b.input_(0, (rows, h), dt), b.input_(1, (h, f), dt), b.input_(2, (h, f), dt)
    blk = _Blk((grid, 1, 1), loop)
    bx, b1, b2 = (
        blk.it(x, (None, None, None), 1),
        blk.it(w1, (1, None, None), 0),
        blk.it(w2, (1, None, None), 0),
    )
    a1 = b.accumulate(Op.ACC_SUM, b.matmul(bx, b1))
    a2 = b.accumulate(Op.ACC_SUM, b.matmul(bx, b2))
    (out,) = blk.launch([b.save(b.mul(b.unary(Op.SILU, a1), a2), 0, (1, None, None), dt)])
    return b.kernel_graph([x, w1, w2], [out], ["X", "W1", "W2"], ["O"])


def block_softmax(
    dt: DType = F16, g: int = 2, m: int = 32, d: int = 16, n: int = 32
) -> KernelGraph:
    """A PRE-phase softmax inside a block (no loop): the block-level EXP is stabilised by a row max,
    then P @ V; also a THREAD node (fused elementwise body) on the output."""
    q, k, v = b.input_(0, (g, m, d), dt), b.input_(1, (g, d, n), dt), b.input_(2, (g, n, d), dt)
    blk = _Blk((g, 2, 1), 1)
    bq, bk, bv = blk.it(q, (0, 1, None)), blk.it(k, (0, None, None)), blk.it(v, (0, None, None))
    e = b.unary(Op.EXP, b.matmul(bq, bk))
    p = b.div(e, b.reduce(Op.REDUCE_SUM, e, 2))
    o = b.matmul(p, bv)
    body = b.add(b.mul(b.thread_in(0), b.const(2)), b.const(Fraction(1, 2)))
    o2 = b.thread(body, [o])
    (out,) = blk.launch([b.save(o2, 0, (0, 1, None), dt)])
    return b.kernel_graph([q, k, v], [out], ["Q", "K", "V"], ["O"])


def chained(dt: DType = BF16, rows: int = 16, h: int = 32, n: int = 32) -> KernelGraph:
    """Two graph-defined kernels: the second reads the first's output (fp32 scratch) and a view."""
    x, w1, w2 = b.input_(0, (rows, h), dt), b.input_(1, (h, n), dt), b.input_(2, (n, n), dt)
    blk1 = _Blk((2, 1, 1), 1)
    bx, bw1 = blk1.it(x, (None, None, None)), blk1.it(w1, (1, None, None))
    (y,) = blk1.launch([b.save(b.unary(Op.RELU, b.matmul(bx, bw1)), 0, (1, None, None), dt)])
    blk2 = _Blk((1, 2, 1), 2)
    by, bw2 = (
        blk2.it(y, (None, 0, None), 1),
        blk2.it(b.transpose(w2, (1, 0)), (None, None, None), 0),
    )
    acc = b.accumulate(Op.ACC_SUM, b.matmul(by, bw2))
    (z,) = blk2.launch([b.save(acc, 0, (None, 0, None), dt)])
    return b.kernel_graph([x, w1, w2], [z, y], ["X", "W1", "W2"], ["Z", "Y"])


MASKS: dict[str, Callable[[tuple[int, ...]], np.ndarray]] = {
    # a masked graph's mask input (an `mlso_mask_*` name, as lifting makes) -> its value: what
    # make_inputs feeds and `constants` hands code generation (codegen/indexmask.py)
    "mlso_mask_causal": lambda shape: np.broadcast_to(np.tril(np.ones(shape[-2:])), shape).copy(),
    "mlso_mask_random": lambda shape: np.broadcast_to(
        np.where(np.arange(shape[-1]) == 0, 1.0, np.random.default_rng(7).random(shape[-2:]) > 0.3),
        shape,
    ).copy(),
}


def constants(kg: KernelGraph) -> dict[str, np.ndarray]:
    """The constant mask inputs of kg (MASKS), in their dtypes, by input name: what the packager
    hands code generation for a region (LiftedRegion.extra_inputs)."""
    return {
        nm: MASKS[nm](n.shape).astype(np_dtype(n.dtype))
        for n, nm in zip(kg.inputs, kg.input_names)
        if nm in MASKS
    }


def causal_gqa(
    dt: DType = F16,
    heads: int = 32,
    kv: int = 8,
    s: int = 128,
    d: int = 64,
    rows: int = 8,
    mask: str = "mlso_mask_causal",
) -> KernelGraph:
    """A decoder's masked GQA attention core as the search writes it for the exported region
    (Qwen2 width at the defaults: 32 query heads over 8 KV heads of 64, 128 tokens): one block
    per (KV head, `rows` query rows) holds its query heads' scores, exp(scores / sqrt(d)) times
    the [1, 1, s, s] constant mask lifting invents, P V over V's head columns, and the row sum;
    the result is handed on as [1, s, heads * d]. `mask` names the mask input (MASKS)."""
    v = b.input_(0, (1, s, kv * d), dt)
    k = b.input_(1, (1, kv, s, d), dt)
    q = b.input_(2, (1, heads, s, d), dt)
    m = b.input_(3, (1, 1, s, s), dt)
    blk = _Blk((kv, s // rows, 1), 1)
    bv = blk.it(v, (2, None, None))
    bk = blk.it(k, (1, None, None))
    bq = blk.it(q, (1, 2, None))
    bm = blk.it(m, (None, 2, None))
    scores = b.matmul(bq, b.transpose(bk, (0, 1, 3, 2)))
    e = b.mul(b.unary(Op.EXP, b.mul(scores, b.const(Fraction(1, math.isqrt(d))))), bm)
    vh = b.transpose(b.reshape(bv, (1, s, 1, d)), (0, 2, 1, 3))
    o = b.div(b.matmul(e, vh), b.reduce(Op.REDUCE_SUM, e, 3))
    (out,) = blk.launch([b.save(o, 0, (1, 2, None), dt)])
    flat = b.reshape(b.transpose(out, (0, 2, 1, 3)), (1, s, heads * d))
    return b.kernel_graph([v, k, q, m], [flat], ["V", "K", "Q", mask], ["O"])


GRAPHS: dict[str, Callable[[], KernelGraph]] = {
    "plain_attention_f16": partial(plain_attention, F16),
    "plain_attention_f32": partial(plain_attention, F32, m=24, d=12, n=40),
    "masked_softmax_f32": masked_softmax,
    "elementwise_f32": elementwise_chain,
    "elementwise_bf16": partial(elementwise_chain, BF16),
    "views_matmul_f16": views_matmul,
    "views_matmul_bf16": partial(views_matmul, BF16),
    "batched_matmul_f32": batched_matmul,
    "reductions_f16": partial(reductions, F16),
    "split_kv_f16": split_kv_attention,
    "split_kv_bf16": partial(split_kv_attention, BF16),
    "split_kv_f32": partial(split_kv_attention, F32, n=64, d=8, m=16),
    # 64 partials: the combine folds them with a team of lanes per output (kernels.team_size)
    "split_kv_wide_f16": partial(
        split_kv_attention, g=1, m=16, d=16, n=1024, row_tiles=1, splits=64, loop=1
    ),
    "flash_f16": flash_attention,
    "flash_bf16": partial(flash_attention, BF16),
    "flash_v_factor_f16": flash_v_factor,
    "flash_relaid_f16": flash_relaid,
    # the causal mask is an index predicate: computed in the kernel when `constants` are given
    "causal_gqa_f16": partial(causal_gqa, heads=4, kv=2, s=32, d=16),
    "flash_wide_v_f16": partial(flash_attention, d=64, dv=256),
    "flash_wide_v_bf16": partial(flash_attention, BF16, dv=264),
    "partial_outputs_f32": partial_outputs,
    "rmsnorm_matmul_f16": rmsnorm_matmul,
    "rmsnorm_matmul_f32": partial(rmsnorm_matmul, F32),
    "gated_mlp_f16": gated_mlp,
    "gated_mlp_bf16": partial(gated_mlp, BF16, rows=16),
    "block_softmax_f16": block_softmax,
    "chained_bf16": chained,
}

LOGIT_SCALE: dict[str, tuple[int, float]] = {
    # graph id -> (input to scale, factor making logits reach roughly +-100)
    "plain_attention_f16": (0, 25.0),
    "plain_attention_f32": (0, 28.0),
    "masked_softmax_f32": (0, 60.0),
    "split_kv_f16": (0, 100.0),
    "split_kv_bf16": (0, 100.0),
    "split_kv_f32": (0, 35.0),
    "split_kv_wide_f16": (0, 100.0),
    "flash_f16": (0, 25.0),
    "flash_relaid_f16": (0, 25.0),
    "causal_gqa_f16": (2, 25.0),
    "flash_bf16": (0, 25.0),
    "flash_v_factor_f16": (0, 25.0),
    "flash_wide_v_f16": (0, 12.5),  # d = 64: logits of about +-100 as for d = 16 at 25
    "flash_wide_v_bf16": (0, 25.0),
    "partial_outputs_f32": (0, 25.0),
    "block_softmax_f16": (0, 25.0),
}

TOLERANCE = {F32: 1e-5, F16: 2e-3, BF16: 1e-2}


def out_dtype(kg: KernelGraph) -> DType:
    """The least precise storage dtype in the graph: it sets the error limit."""
    dts = {n.dtype for n in list(kg.inputs) + list(kg.outputs)}
    return BF16 if BF16 in dts else F16 if F16 in dts else F32


def np_dtype(dt: DType) -> np.dtype:
    if dt is BF16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dt.value)


def make_inputs(kg: KernelGraph, name: str, seed: int = 0, large: bool = False) -> list[np.ndarray]:
    """Unit-scale normal inputs (masks are 0/1 with a few huge masked logits; norms get positive
    values), stored in the inputs' dtypes; large=True scales the logits input to reach ~+-100."""
    rng = np.random.default_rng(seed)
    out = []
    for i, (n, nm) in enumerate(zip(kg.inputs, kg.input_names)):
        x = rng.standard_normal(n.shape)
        if nm == "mask":
            x = (rng.random(n.shape) > 0.3).astype(np.float64)
            x[:, 0] = 1.0
        if nm in MASKS:
            x = MASKS[nm](n.shape)
        if large and name in LOGIT_SCALE and LOGIT_SCALE[name][0] == i:
            x = x * LOGIT_SCALE[name][1]
        out.append(x.astype(np_dtype(n.dtype)))
    if name.startswith("masked_softmax") and large:
        # masked-out positions get larger logits than every kept one: the stabiliser must skip them
        x, mask = out[0].astype(np.float64), out[1].astype(np.float64)
        out[0] = np.where(mask == 0, 150.0, x).astype(out[0].dtype)
    return out


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    denom = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / (denom if denom > 0 else 1.0))


# ---- float64 reference ---------------------------------------------------------------------------


def reference(kg: KernelGraph, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """mlso_cli.verify.interpreter.run(mode="float64") when present, else `numpy_reference`."""
    try:
        from mlso_cli.verify.interpreter import run
    except ImportError:
        return numpy_reference(kg, inputs)
    return [
        np.asarray(o, dtype=np.float64)
        for o in run(kg, [np.asarray(x) for x in inputs], mode="float64")
    ]


_UNARY = {
    Op.EXP: np.exp,
    Op.SQUARE: np.square,
    Op.SQRT: np.sqrt,
    Op.RSQRT: lambda x: 1 / np.sqrt(x),
    Op.RECIPROCAL: lambda x: 1 / x,
    Op.NEG: np.negative,
    Op.SIGMOID: lambda x: 1 / (1 + np.exp(-x)),
    Op.SILU: lambda x: x / (1 + np.exp(-x)),
    Op.TANH: np.tanh,
    Op.RELU: lambda x: np.maximum(x, 0),
    Op.ERF: lambda x: _erf(x),
    Op.GELU: lambda x: 0.5 * x * (1 + _erf(x / np.sqrt(2))),
    Op.CAST: lambda x: x,
}
_BINARY = {
    Op.ADD: np.add,
    Op.SUB: np.subtract,
    Op.MUL: np.multiply,
    Op.DIV: np.divide,
    Op.MAX: np.maximum,
}
_REDUCE = {Op.REDUCE_SUM: np.sum, Op.REDUCE_MEAN: np.mean, Op.REDUCE_MAX: np.max}


def _erf(x: np.ndarray) -> np.ndarray:
    from math import erf

    return np.vectorize(erf)(x)


def _eval(n: Node, env: dict[Node, object]) -> object:
    if n in env:
        return env[n]
    a = [_eval(s, env) for s in n.src] if n.op not in (Op.GRAPH_DEF, Op.THREAD) else None
    if n.op is Op.CONST:
        v = np.float64(const_value(n))
    elif n.op in _UNARY:
        v = _UNARY[n.op](a[0])
    elif n.op in _BINARY:
        v = _BINARY[n.op](a[0], a[1])
    elif n.op is Op.MATMUL:
        v = np.matmul(a[0], a[1])
    elif n.op in _REDUCE:
        v = _REDUCE[n.op](a[0], axis=n.arg, keepdims=True)
    elif n.op is Op.RESHAPE:
        v = np.reshape(a[0], n.arg)
    elif n.op is Op.TRANSPOSE:
        v = np.transpose(a[0], n.arg)
    elif n.op is Op.BROADCAST:
        v = np.broadcast_to(a[0], n.arg)
    elif n.op is Op.GRAPH_DEF:
        v = _run_block(n.arg, [np.asarray(_eval(s, env)) for s in n.src])
    elif n.op is Op.PROJ:
        v = a[0][n.arg]
    elif n.op is Op.THREAD:
        tg: ThreadGraph = n.arg
        ins = [_eval(s, env) for s in n.src]
        v = _eval(tg.body, {**{m: ins[m.arg] for m in _thread_ins(tg.body)}})
    else:
        raise NotImplementedError(n.op)
    env[n] = v
    return v


def _thread_ins(body: Node) -> list[Node]:
    from mlso_cli.ir.node import toposort

    return [m for m in toposort([body]) if m.op is Op.THREAD_IN]


def _run_block(bg: BlockGraph, srcs: list[np.ndarray]) -> list[np.ndarray]:
    """Execute every block of the grid and every loop step literally."""
    outs = [np.full(bg.output_shape(s), np.nan) for s in bg.outputs]
    for bx in range(bg.grid[0]):
        for by in range(bg.grid[1]):
            for bz in range(bg.grid[2]):
                idx = (bx, by, bz)
                accs: dict[Node, np.ndarray] = {}
                for step in range(bg.loop):
                    env: dict[Node, object] = {}
                    for it in (n for n in bg.nodes() if n.op is Op.ITER):
                        env[it] = _tile(srcs[it.arg], bg.inputs[it.arg], bg, idx, step)
                    for acc in (
                        n
                        for n in bg.nodes()
                        if n.op in (Op.ACC_SUM, Op.ACC_EXP_SUM, Op.ACC_EXP_WSUM)
                    ):
                        x = [np.asarray(_eval(s, env)) for s in acc.src]
                        inc = {
                            Op.ACC_SUM: lambda x: x[0],
                            Op.ACC_EXP_SUM: lambda x: np.exp(x[0]).sum(-1, keepdims=True),
                            Op.ACC_EXP_WSUM: lambda x: np.matmul(np.exp(x[0]), x[1]),
                        }[acc.op](x)
                        accs[acc] = accs.get(acc, 0) + inc
                env = dict(accs)
                for it in (n for n in bg.nodes() if n.op is Op.ITER and n.phase.value == "pre"):
                    env[it] = _tile(srcs[it.arg], bg.inputs[it.arg], bg, idx, 0)
                for k, save in enumerate(bg.outputs):
                    val = np.broadcast_to(np.asarray(_eval(save.src[0], env)), save.shape)
                    sl = []
                    for g, d in zip(range(3), save.arg.omap):
                        if d == PARTIAL:
                            sl.append(idx[g])
                    region = [slice(None)] * len(save.shape)
                    for g, d in enumerate(save.arg.omap):
                        if d is not None and d != PARTIAL:
                            region[d] = slice(idx[g] * save.shape[d], (idx[g] + 1) * save.shape[d])
                    outs[k][tuple(sl) + tuple(region)] = val
    return outs


def _tile(
    x: np.ndarray, im: InputMap, bg: BlockGraph, idx: tuple[int, int, int], step: int
) -> np.ndarray:
    region = [slice(None)] * x.ndim
    starts = [0] * x.ndim
    sizes = list(x.shape)
    for g, d in enumerate(im.imap):
        if d is not None:
            sizes[d] = x.shape[d] // bg.grid[g]
            starts[d] = idx[g] * sizes[d]
    if im.fmap is not None:
        f = im.fmap
        sizes[f] //= bg.loop
        starts[f] += step * sizes[f]
    for d in range(x.ndim):
        region[d] = slice(starts[d], starts[d] + sizes[d])
    return x[tuple(region)]


def numpy_reference(kg: KernelGraph, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    env: dict[Node, object] = {
        n: np.asarray(x, dtype=np.float64) for n, x in zip(kg.inputs, inputs)
    }
    with np.errstate(all="ignore"):
        return [np.asarray(_eval(o, env), dtype=np.float64) for o in kg.outputs]


def transformer_region0() -> KernelGraph:
    """transformer_tiny's first lifted region: RMSNorm, the q/k/v GEMM, then v and the q and k
    rotaries (a row reduction feeding a staged GEMM operand, and three sibling elementwise
    kernels reading the GEMM's result)."""
    from pathlib import Path

    from mlso_cli.frontend.lift import lift_model
    from mlso_cli.ir import check

    model = Path(__file__).resolve().parent.parent / "models" / "transformer_tiny.onnx"
    return check(lift_model(str(model), {"hidden": (1, 16, 64)})[0])


def assert_emulated_matches(
    name: str, kg: KernelGraph, consts: dict[str, np.ndarray] | None = None
) -> None:
    """kg's generated program, run on the host emulator, agrees with the float64 reference:
    every output element written (no NaN left) and within its dtype's tolerance. `consts`:
    constant inputs handed to code generation (`constants`)."""
    from mlso_cli.codegen import generate, hostemu

    ins = make_inputs(kg, name)
    want = reference(kg, ins)
    got = hostemu.run(generate(kg, constants=consts), ins)
    tol = TOLERANCE[out_dtype(kg)]
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        g = np.asarray(g, dtype=np.float64)
        assert not np.isnan(g).any(), f"{name} output {k}: NaN (unwritten)"
        err = rel_error(g, w)
        assert err <= tol, f"{name} output {k}: relative error {err:.2e} > {tol:.0e}"
