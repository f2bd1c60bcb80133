"""Reference programs and fused candidates for the benchmark computations, at any shapes.

Why in the package: the verification tests and benchmarks/verify_speed.py need the same pairs
(an unfused kernel graph and a block-graph rewrite of it, the kind the search emits), and the
search's tests can reuse them. Every builder returns spec-checked graphs.

Each pair builder returns (reference, candidate). Tile parameters must divide the shapes.
"""

from __future__ import annotations

from fractions import Fraction

from mlso_cli.ir import build as b
from mlso_cli.ir.graph import PARTIAL, InputMap, KernelGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import DType, Op
from mlso_cli.ir.spec import check

EPS = Fraction(1e-6)


def rmsnorm(x: Node, eps: Fraction = EPS) -> Node:
    """x * rsqrt(mean(x^2) + eps) over the last axis (kernel or block level)."""
    ms = b.reduce(Op.REDUCE_MEAN, b.unary(Op.SQUARE, x), len(x.shape) - 1)
    return b.mul(x, b.unary(Op.RSQRT, b.add(ms, b.const(eps))))


def attention(g: int, m: int, d: int, n: int, dtype: DType = DType.F32) -> KernelGraph:
    """softmax(Q K) V written as exp / sum / div (no stabiliser: IR semantics are exact)."""
    q, k, v = b.input_(0, (g, m, d), dtype), b.input_(1, (g, d, n), dtype), b.input_(2, (g, n, d), dtype)
    e = b.unary(Op.EXP, b.matmul(q, k))
    o = b.matmul(b.div(e, b.reduce(Op.REDUCE_SUM, e, 2)), v)
    return check(b.kernel_graph([q, k, v], [o], ["Q", "K", "V"], ["o"]))


def split_kv_attention(g: int, m: int, d: int, n: int, rows: int, splits: int, loop: int,
                       dtype: DType = DType.F32, imap_q: tuple = (0, 1, None), omap: tuple = (0, 1, PARTIAL),
                       k_map: InputMap | None = None, v_map: InputMap | None = None) -> KernelGraph:
    """Flash-decoding: grid (g, row tiles, kv splits), a loop over kv steps with the rescaling
    accumulators, fp32 partials saved along a PARTIAL dim, and a combining kernel."""
    q, k, v = b.input_(0, (g, m, d), dtype), b.input_(1, (g, d, n), dtype), b.input_(2, (g, n, d), dtype)
    step = n // splits // loop
    bq = b.iter_(0, (1, m // rows, d), dtype, False)
    bk = b.iter_(1, (1, d, step), dtype, True)
    bv = b.iter_(2, (1, step, d), dtype, True)
    s = b.matmul(bq, bk)
    num = b.save(b.accumulate(Op.ACC_EXP_WSUM, s, bv), 0, omap, DType.F32)
    den = b.save(b.accumulate(Op.ACC_EXP_SUM, s), 1, omap, DType.F32)
    maps = [InputMap(imap_q, None), k_map or InputMap((0, None, 2), 2), v_map or InputMap((0, None, 1), 1)]
    bg = b.block_graph((g, rows, splits), loop, maps, [num, den])
    pnum, pden = b.graph_def([q, k, v], bg)
    o = b.div(b.reduce(Op.REDUCE_SUM, pnum, 0), b.reduce(Op.REDUCE_SUM, pden, 0))
    o = b.reshape(b.cast(o, dtype), (g, m, d))
    return check(b.kernel_graph([q, k, v], [o], ["Q", "K", "V"], ["o"]))


def gqa_pair(g: int, m: int, d: int, n: int, rows: int, splits: int, loop: int,
             dtype: DType = DType.F32) -> tuple[KernelGraph, KernelGraph]:
    return attention(g, m, d, n, dtype), split_kv_attention(g, m, d, n, rows, splits, loop, dtype)


def rmsnorm_linear_pair(rows: int, h: int, n: int, cols: int, loop: int,
                        dtype: DType = DType.F32) -> tuple[KernelGraph, KernelGraph]:
    """RMSNorm(X) @ W vs one kernel: per column tile, loop over H accumulating X@W and sum(X^2),
    then scale by rsqrt(sum * (1/H) + eps) after the loop."""
    x, w = b.input_(0, (rows, h), dtype), b.input_(1, (h, n), dtype)
    ref = check(b.kernel_graph([x, w], [b.matmul(rmsnorm(x), w)], ["X", "W"], ["y"]))
    bx = b.iter_(0, (rows, h // loop), dtype, True)
    bw = b.iter_(1, (h // loop, n // cols), dtype, True)
    mm = b.accumulate(Op.ACC_SUM, b.matmul(bx, bw))
    ss = b.accumulate(Op.ACC_SUM, b.reduce(Op.REDUCE_SUM, b.unary(Op.SQUARE, bx), 1))
    scale = b.unary(Op.RSQRT, b.add(b.mul(ss, b.const(Fraction(1, h))), b.const(EPS)))
    out = b.save(b.mul(mm, scale), 0, (1, None, None), dtype)
    bg = b.block_graph((cols, 1, 1), loop, [InputMap((None, None, None), 1), InputMap((1, None, None), 0)], [out])
    (y,) = b.graph_def([x, w], bg)
    return ref, check(b.kernel_graph([x, w], [y], ["X", "W"], ["y"]))


def gated_mlp_pair(rows: int, h: int, n: int, cols: int, loop: int,
                   dtype: DType = DType.F32) -> tuple[KernelGraph, KernelGraph]:
    """SiLU(X@W1) * (X@W2) vs one kernel accumulating both products per column tile."""
    x, w1, w2 = b.input_(0, (rows, h), dtype), b.input_(1, (h, n), dtype), b.input_(2, (h, n), dtype)
    ref = b.mul(b.unary(Op.SILU, b.matmul(x, w1)), b.matmul(x, w2))
    ref_kg = check(b.kernel_graph([x, w1, w2], [ref], ["X", "W1", "W2"], ["y"]))
    bx = b.iter_(0, (rows, h // loop), dtype, True)
    b1 = b.iter_(1, (h // loop, n // cols), dtype, True)
    b2 = b.iter_(2, (h // loop, n // cols), dtype, True)
    a1 = b.accumulate(Op.ACC_SUM, b.matmul(bx, b1))
    a2 = b.accumulate(Op.ACC_SUM, b.matmul(bx, b2))
    out = b.save(b.mul(b.unary(Op.SILU, a1), a2), 0, (1, None, None), dtype)
    wmap = InputMap((1, None, None), 0)
    bg = b.block_graph((cols, 1, 1), loop, [InputMap((None, None, None), 1), wmap, wmap], [out])
    (y,) = b.graph_def([x, w1, w2], bg)
    return ref_kg, check(b.kernel_graph([x, w1, w2], [y], ["X", "W1", "W2"], ["y"]))


def lora_pair(rows: int, h: int, n: int, r: int, cols: int, loop: int,
              dtype: DType = DType.F32) -> tuple[KernelGraph, KernelGraph]:
    """X@W + (X@A)@B vs one kernel: loop over H accumulating X@W and X@A, then + (X@A)@B_tile."""
    x, w = b.input_(0, (rows, h), dtype), b.input_(1, (h, n), dtype)
    a, bb = b.input_(2, (h, r), dtype), b.input_(3, (r, n), dtype)
    ref = b.add(b.matmul(x, w), b.matmul(b.matmul(x, a), bb))
    ref_kg = check(b.kernel_graph([x, w, a, bb], [ref], ["X", "W", "A", "B"], ["y"]))
    bx = b.iter_(0, (rows, h // loop), dtype, True)
    bw = b.iter_(1, (h // loop, n // cols), dtype, True)
    ba = b.iter_(2, (h // loop, r), dtype, True)
    bb_t = b.iter_(3, (r, n // cols), dtype, False)
    xw = b.accumulate(Op.ACC_SUM, b.matmul(bx, bw))
    xa = b.accumulate(Op.ACC_SUM, b.matmul(bx, ba))
    out = b.save(b.add(xw, b.matmul(xa, bb_t)), 0, (1, None, None), dtype)
    maps = [InputMap((None, None, None), 1), InputMap((1, None, None), 0), InputMap((None, None, None), 0),
            InputMap((1, None, None), None)]
    bg = b.block_graph((cols, 1, 1), loop, maps, [out])
    (y,) = b.graph_def([x, w, a, bb], bg)
    return ref_kg, check(b.kernel_graph([x, w, a, bb], [y], ["X", "W", "A", "B"], ["y"]))


def ntrans_pair(rows: int, h: int, row_tiles: int, dtype: DType = DType.F32) -> tuple[KernelGraph, KernelGraph]:
    """RMSNorm(RMSNorm(H) + X*alpha + X) vs one kernel per row tile doing it all in the block."""
    hh, x, al = b.input_(0, (rows, h), dtype), b.input_(1, (rows, h), dtype), b.input_(2, (rows, h), dtype)
    ref = rmsnorm(b.add(b.add(rmsnorm(hh), b.mul(x, al)), x))
    ref_kg = check(b.kernel_graph([hh, x, al], [ref], ["H", "X", "alpha"], ["y"]))
    t = (rows // row_tiles, h)
    bh, bx, ba = (b.iter_(i, t, dtype, False) for i in range(3))
    v = b.add(rmsnorm(bh), b.mul(b.add(ba, b.const(1)), bx))  # X*alpha + X = X*(alpha + 1)
    out = b.save(rmsnorm(v), 0, (0, None, None), dtype)
    rmap = InputMap((0, None, None), None)
    bg = b.block_graph((row_tiles, 1, 1), 1, [rmap, rmap, rmap], [out])
    (y,) = b.graph_def([hh, x, al], bg)
    return ref_kg, check(b.kernel_graph([hh, x, al], [y], ["H", "X", "alpha"], ["y"]))
