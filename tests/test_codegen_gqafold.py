"""Grouped heads as GEMM rows (codegen/gqafold.py): a matmul whose B repeats each KV group's
matrix over its query heads runs as one GEMM per group with the heads' rows stacked, B read in
place instead of a staged, repeated copy.

Checked here: which matmuls fold (a GQA score product) and which do not (a product read only
through views, by an ADD, or a program output; an ungrouped B), the lowering plan and the
launch plan (no staging, m = R * M, batch G), the cost model agrees on launches, and the folded
program matches the interpreter on the host emulator and equals the unfolded graph exactly.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from mlso_cli.codegen import generate
from mlso_cli.codegen.gqafold import fold_grouped_heads
from mlso_cli.codegen.plan import plan
from mlso_cli.ir import DType, Op, check
from mlso_cli.ir import build as b
from mlso_cli.search.cost import program_cost
from mlso_cli.verify import interpreter
from tests import test_codegen_graphs as T
from tests.helpers import fresh_cache

F16, F32 = DType.F16, DType.F32


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    with fresh_cache(tmp_path_factory):
        yield


def repeated(x, r: int):
    """[1, G, s, d] -> [1, G * R, s, d] as exporters write repeat_kv: reshape, broadcast, merge."""
    _, g, s, d = x.shape
    five = b.broadcast_to(b.reshape(x, (1, g, 1, s, d)), (1, g, r, s, d))
    return b.reshape(five, (1, g * r, s, d))


def gqa_scores(dt=F16, heads=4, kv=2, s=32, d=16, reader="softmax"):
    """Q K^T over repeated K, then a row softmax (or `reader`): the score product of a lifted
    grouped-query attention core."""
    q, k = b.input_(0, (1, heads, s, d), dt), b.input_(1, (1, kv, s, d), dt)
    sc = b.matmul(q, b.transpose(repeated(k, heads // kv), (0, 1, 3, 2)))
    if reader == "softmax":
        e = b.unary(Op.EXP, b.mul(b.cast(sc, F32), b.const(Fraction(1, 4))))
        out = b.cast(b.div(e, b.reduce(Op.REDUCE_SUM, e, 3)), dt)
    elif reader == "add":
        out = b.add(sc, b.input_(2, sc.shape, dt))
    elif reader == "views":
        out = b.reshape(b.transpose(sc, (0, 2, 1, 3)), (1, s, heads * s))
    else:
        out = sc
    ins = [q, k] + ([b.input_(2, sc.shape, dt)] if reader == "add" else [])
    return check(b.kernel_graph(ins, [out], ["Q", "K", "X"][: len(ins)], ["P"]))


def _gemms(kg):
    return [x for x in generate(kg).plan["launches"] if x.get("kind") == "gemm"]


def test_the_score_product_is_one_gemm_per_group_with_stacked_heads():
    kg = gqa_scores()
    assert fold_grouped_heads(kg) is not kg
    kinds = [k.kind for k in plan(kg).kernels]
    assert kinds[0] == "gemm" and "stage" not in kinds
    (g,) = _gemms(kg)
    assert (g["m"], g["n"], g["k"], g["batch"]) == (2 * 32, 32, 16, 2)
    assert g["b"]["buf"] == {"kind": "input", "index": 1}  # K read in place, no repeated copy
    assert program_cost(kg).launches == len(generate(kg).plan["launches"])


@pytest.mark.parametrize("reader", ["add", "views", "output"])
def test_no_fold_where_the_product_is_added_viewed_or_an_output(reader):
    kg = gqa_scores(reader=reader)
    assert fold_grouped_heads(kg) is kg


def test_an_ungrouped_b_does_not_fold():
    q, k = b.input_(0, (1, 4, 32, 16), F16), b.input_(1, (1, 4, 32, 16), F16)
    sc = b.matmul(q, b.transpose(k, (0, 1, 3, 2)))
    kg = check(b.kernel_graph([q, k], [b.mul(sc, b.const(2))], ["Q", "K"], ["P"]))
    assert fold_grouped_heads(kg) is kg


def test_the_folded_graph_computes_the_same_values_exactly():
    kg = gqa_scores(F32)
    folded = check(fold_grouped_heads(kg))  # the rewritten graph passes the spec checker too
    rng = np.random.default_rng(1)
    ins = [rng.standard_normal(n.shape).astype(np.float32) for n in kg.inputs]
    (want,) = interpreter.run(kg, ins, "float64")
    (got,) = interpreter.run(folded, ins, "float64")
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "name, build",
    [
        ("gqa_scores_f16", gqa_scores),
        ("gqa_scores_f32_r4", lambda: gqa_scores(F32, heads=8, kv=2, s=40, d=12)),
    ],
)
def test_emulated_folded_program_matches_the_interpreter(name, build):
    T.assert_emulated_matches(name, build())
