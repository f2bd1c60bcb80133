"""Grouped-query attention with 4 or more KV heads: reduced shapes cut the KV heads to 2, and the
search finds the one-kernel program.

Why tested: with batch-like indices cut to 8 at reduced shapes, a core with 8 KV heads (Llama-1B,
Mistral) kept them, the provisional grid of two blocks gave each block 4 KV heads and their query
groups, and no block program can broadcast K and V over such a tile: the search explored 6,264
states and kept the 9-kernel lifted program, while the same core with 2 KV heads (Qwen2-0.5B)
found a single kernel."""

from __future__ import annotations

from fractions import Fraction

import pytest

from mlso_cli.ir import build as b
from mlso_cli.ir.graph import KernelGraph
from mlso_cli.ir.ops import DType, Op
from mlso_cli.ir.spec import check
from mlso_cli.search.api import SearchOptions
from mlso_cli.search.run import search
from mlso_cli.search.shrink import BATCH_REDUCED, SPATIAL_REDUCED, shrink

F16 = DType.F16


def gqa_core(hq: int, hk: int, s: int = 64, d: int = 32) -> KernelGraph:
    """softmax(q k^T / 8, masked) v as a decoder export lifts it: K broadcast over each KV
    head's query group, V still [1, s, hk * d] before its head split, a 0/1 mask input."""
    rep = hq // hk
    q = b.input_(2, (1, hq, s, d), F16)
    k = b.input_(1, (1, hk, s, d), F16)
    kk = b.reshape(
        b.broadcast_to(b.reshape(k, (1, hk, 1, s, d)), (1, hk, rep, s, d)), (1, hq, s, d)
    )
    scores = b.mul(b.matmul(q, b.transpose(kk, (0, 1, 3, 2))), b.const(Fraction(1, 8), F16))
    e = b.unary(Op.EXP, b.cast(scores, DType.F32))
    mask = b.input_(3, (1, 1, s, s), F16)
    em = b.mul(e, b.cast(mask, DType.F32))
    p = b.cast(b.div(em, b.reduce(Op.REDUCE_SUM, em, 3)), F16)
    v = b.input_(0, (1, s, hk * d), F16)
    vv = b.reshape(b.transpose(b.reshape(v, (1, s, hk, d)), (0, 2, 1, 3)), (1, hk, 1, s, d))
    vv = b.reshape(b.broadcast_to(vv, (1, hk, rep, s, d)), (1, hq, s, d))
    kg = b.kernel_graph([v, k, q, mask], [b.matmul(p, vv)], ["v", "k", "q", "m"], ["o"])
    check(kg)
    return kg


@pytest.mark.parametrize("hq, hk", [(8, 4), (32, 8), (14, 2)])
def test_kv_heads_are_cut_to_two_and_query_rows_keep_eight(hq, hk):
    small, _ = shrink(gqa_core(hq, hk))
    check(small)
    v, k, q, mask = small.inputs
    assert k.shape[1] == min(hk, BATCH_REDUCED)  # no matmul holds KV heads as a row or column
    assert q.shape[2] == SPATIAL_REDUCED  # query rows are a matmul's rows: they keep 8
    assert mask.shape == (1, 1, SPATIAL_REDUCED, 64)  # kv positions are summed over: 64
    assert q.shape[1] == k.shape[1] * (hq // hk)  # the query groups stay whole


@pytest.mark.slow
def test_a_core_with_eight_kv_heads_is_found_as_one_kernel():
    kg = gqa_core(32, 8)
    res = search(kg, SearchOptions(jobs=2, seed=0), None)
    assert res.verified >= 1
    best = res.candidates[0]
    assert best.kernels == 1
    lifted = [c for c in res.candidates if c.bound == 0.0]
    assert lifted and best.estimate_us < lifted[0].estimate_us
