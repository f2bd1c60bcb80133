"""The search end to end on small held-out targets built here (not the benchmark models).

Why: each case is a shape of region the benchmarks do not spell the same way, so the search must
find its fused program from the operators alone: a normalised row multiplied by a transposed
weight (ONNX Gemm with transB, BatchNorm folded before a linear layer), and a scaled row sum.
Budgets are small and fixed (deterministic); results are checked by the search's own full-shape
verification and again here against the float64 interpreter.
"""

from __future__ import annotations

import numpy as np

from mlso_cli.ir import DType, Op, check
from mlso_cli.ir import build as b
from mlso_cli.search.api import SearchOptions
from mlso_cli.search.run import search
from mlso_cli.verify import interpreter


def _fused(result):
    """The candidates that are one graph-defined kernel (the lifted target has several)."""
    return [c for c in result.candidates
            if c.kernels == 1 and any(n.op is Op.GRAPH_DEF for n in c.graph.nodes())]


def _agrees(target, cand, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    ins = [rng.uniform(0.5, 1.5, n.shape).astype(np.float32) for n in target.inputs]
    (want,) = interpreter.run(target, ins, mode="float64")
    (got,) = interpreter.run(cand.graph, ins, mode="float64")
    np.testing.assert_allclose(got, want, rtol=1e-9)


def test_scaled_rows_times_a_transposed_weight_fuse_into_one_kernel():
    """(x * s + t) @ W^T: the transposed weight tile is a view made in the first round; the
    normalised rows are made rounds later and must still meet it as a matmul operand."""
    x = b.input_(0, (8, 32), DType.F32)
    s = b.input_(1, (32,), DType.F32)
    t = b.input_(2, (32,), DType.F32)
    w = b.input_(3, (16, 32), DType.F32)
    y = b.matmul(b.add(b.mul(x, s), t), b.transpose(w, (1, 0)))
    target = check(b.kernel_graph([x, s, t, w], [y]))
    res = search(target, SearchOptions(max_states=40_000, seed=0, jobs=1))
    fused = _fused(res)
    assert fused and res.verified >= 1 and all(c.bound <= 2.0**-60 for c in fused)
    _agrees(target, fused[0])


def test_search_is_deterministic_for_a_seed_and_budget():
    x = b.input_(0, (8, 32), DType.F32)
    w = b.input_(1, (32, 16), DType.F32)
    y = b.matmul(b.unary(Op.RELU, x), w)
    target = check(b.kernel_graph([x, w], [y]))
    from mlso_cli.ir.serialize import dumps

    runs = [search(target, SearchOptions(max_states=5_000, seed=3, jobs=j)) for j in (1, 2)]
    assert [dumps(c.graph) for c in runs[0].candidates] == [dumps(c.graph) for c in runs[1].candidates]
    assert runs[0].states == runs[1].states and _fused(runs[0])
