"""The search end to end on small held-out targets built here (not the benchmark models).

Why: each case is a shape of region the benchmarks do not spell the same way, so the search must
find its fused program from the operators alone: a normalised row multiplied by a transposed
weight (ONNX Gemm with transB, BatchNorm folded before a linear layer), and a scaled row sum.
Budgets are small and fixed (deterministic); results are checked by the search's own full-shape
verification and again here against the float64 interpreter.
"""

from __future__ import annotations

from contextlib import contextmanager
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest

from mlso_cli.ir import DType, Op, Phase, check
from mlso_cli.ir import build as b
from mlso_cli.ir.node import toposort
from mlso_cli.search.api import SearchOptions
from mlso_cli.search.run import search
from mlso_cli.verify import interpreter


def _fused(result):
    """The candidates that are one graph-defined kernel (the lifted target has several)."""
    return [
        c
        for c in result.candidates
        if c.kernels == 1 and any(n.op is Op.GRAPH_DEF for n in c.graph.nodes())
    ]


def _agrees(target, cand, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    ins = [rng.uniform(0.5, 1.5, n.shape).astype(np.float32) for n in target.inputs]
    (want,) = interpreter.run(target, ins, mode="float64")
    (got,) = interpreter.run(cand.graph, ins, mode="float64")
    np.testing.assert_allclose(got, want, rtol=1e-9)


@pytest.mark.slow
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
    assert [dumps(c.graph) for c in runs[0].candidates] == [
        dumps(c.graph) for c in runs[1].candidates
    ]
    assert runs[0].states == runs[1].states and _fused(runs[0])


@pytest.mark.slow
def test_a_signature_explores_the_same_whatever_ran_before_in_the_process(tmp_path):
    """Pattern keys break ties by term intern order, so exploring a signature after others must
    start from the same term tables as exploring it first (search/state.py): otherwise state
    counts, and in rare ties the pruning, depend on how a pool handed out the signatures (lora's
    state count once varied between identical runs with --jobs 2)."""
    import onnx

    from mlso_cli.frontend.lift import lift_model
    from mlso_cli.ir import serialize
    from mlso_cli.search import run as R
    from mlso_cli.search.dims import dim_classes
    from mlso_cli.search.shrink import shrink
    from mlso_cli.search.space import signatures
    from models.build_models import SPECS

    path = tmp_path / "lora.onnx"  # the region whose state counts once varied from run to run
    onnx.save(SPECS["lora"].build(1, "float16", small=False), str(path))
    (target,) = lift_model(str(path))
    small, _ = shrink(target)
    dcs = dim_classes(small)
    sigs = [g for g in signatures(dcs) if R.provisional(dcs, g) is not None]
    text = serialize.dumps(target)

    def run(i: int):
        return R.explore(R.Task(text, sigs[i], 3000, i, "sm_90", 11, None, True))

    R._REGIONS.clear()
    first = [run(i) for i in range(len(sigs))]
    again = [run(i) for i in reversed(range(len(sigs)))][::-1]
    assert [(e.states, e.pruned, e.duplicates, e.found) for e in again] == [
        (e.states, e.pruned, e.duplicates, e.found) for e in first
    ]


def test_a_spatial_index_of_two_can_be_a_grid_dim():
    """Two KV heads (gqa at batch 1) side by side on the grid: a spatial class of size 2 gets a
    signature (tiles of one at reduced shapes), a summed class of size 2 cannot be a partial."""
    from mlso_cli.search.dims import dim_classes
    from mlso_cli.search.run import provisional
    from mlso_cli.search.space import Axis, Signature

    q = b.input_(0, (2, 16, 2), DType.F32)
    k = b.input_(1, (2, 2, 16), DType.F32)
    target = check(b.kernel_graph([q, k], [b.matmul(q, k)]))
    dc = dim_classes(target)
    heads = next(c for c in dc.classes if c.size == 2 and c.spatial)
    depth = next(c for c in dc.classes if c.size == 2 and c.reduced)
    assert provisional(dc, Signature((Axis(heads.id, False),), None)) is not None
    assert provisional(dc, Signature((Axis(depth.id, True),), None)) is None


@pytest.mark.slow
def test_gqa_at_batch_one_finds_a_register_path_split_kv_program(tmp_path):
    """The gqa benchmark at batch 1 (two KV heads): the search reaches the structure with the
    heads on the grid, row tiles of at most 128 and KV splits, which takes the register path."""
    import onnx

    from mlso_cli.codegen.plan import plan
    from mlso_cli.pipeline.run import lift
    from models.build_models import SPECS

    path = tmp_path / "gqa1.onnx"
    onnx.save(SPECS["gqa"].build(1, "float16", small=False), str(path))
    region = lift(str(path), None).regions[0]
    res = search(region.graph, SearchOptions(seed=0, jobs=1))
    best = min(res.candidates, key=lambda c: c.estimate_us)
    layouts = [k.layout for k in plan(best.graph, "sm_90").kernels if k.layout is not None]
    assert res.verified >= 1 and layouts and layouts[0].register_path
    # the per-row exp sum is saved as it is ([.., rows, 1]: no grid dim lays out its last axis),
    # not broadcast to the weighted sum's tile first (64x the partial bytes)
    (gd,) = [n for n in best.graph.nodes() if n.op is Op.GRAPH_DEF]
    body = gd.arg.nodes()
    assert not any(n.op is Op.BROADCAST for n in body)
    assert any(n.op is Op.SAVE and n.shape[-1] == 1 for n in body)


@pytest.mark.slow
def test_a_deep_chain_of_row_statistics_fuses_into_one_kernel():
    """Two row normalisations with a gated residual between them: 18 elementwise and reduction
    ops deep, twice the enumeration's rounds. The target's tile-local values seed round 0, so
    a one-kernel program is found, verified, and ranked above the lifted program."""
    x = b.input_(0, (8, 64), DType.F32)
    y = b.input_(1, (8, 64), DType.F32)
    g = b.input_(2, (64,), DType.F32)

    def norm(t):
        mean = b.mul(b.reduce(Op.REDUCE_SUM, t, 1), b.const(Fraction(1, 64)))
        centred = b.sub(t, mean)
        var = b.mul(
            b.reduce(Op.REDUCE_SUM, b.unary(Op.SQUARE, centred), 1), b.const(Fraction(1, 64))
        )
        return b.mul(centred, b.unary(Op.RSQRT, b.add(var, b.const(Fraction(1, 1000)))))

    h = b.add(b.mul(norm(x), g), b.mul(y, b.unary(Op.SIGMOID, x)))
    out = b.mul(norm(h), g)
    target = check(b.kernel_graph([x, y, g], [out]))
    res = search(target, SearchOptions(max_states=3_000, seed=0, jobs=1))
    fused = _fused(res)
    assert fused and res.verified >= 1
    assert fused[0].estimate_us < res.candidates[-1].estimate_us
    _agrees(target, fused[0])


def test_a_row_times_its_own_statistic_is_not_a_constant_multiple_of_the_row():
    """At batch 1 a tile holds one row, and x * rsqrt(mean(x^2)) is proportional to x at any
    single evaluation point. The search must still keep it (it is the normalised row)."""
    from mlso_cli.search.dims import dim_classes
    from mlso_cli.search.enumerate import BlockSearch, Limits, SearchAlgebra, Stats, Vocabulary
    from mlso_cli.search.fingerprint import Fingerprints
    from mlso_cli.search.prune import ExprPruner
    from mlso_cli.search.space import Dims, Signature, Step, iters

    x = b.input_(0, (1, 16), DType.F32)
    w = b.input_(1, (16, 8), DType.F32)
    r = b.unary(
        Op.RSQRT, b.mul(b.reduce(Op.REDUCE_SUM, b.unary(Op.SQUARE, x), 1), b.const(Fraction(1, 16)))
    )
    target = check(b.kernel_graph([x, w], [b.matmul(b.mul(x, r), w)]))
    dc = dim_classes(target)
    sig, dims = Signature((), None), Dims((), 1)
    _, maps, grid = iters(target, dc, sig, dims, (0, 1))
    alg = SearchAlgebra(
        Fingerprints(target, dc, sig, dims, 0), ExprPruner(target, dc).bind(grid, 1, maps)
    )
    bs = BlockSearch(
        target, dc, sig, dims, alg, Vocabulary.of(target), Limits(max_states=100), Stats()
    )
    sq = bs._add(Step(Op.SQUARE, (0,)), [0], 1)
    s = bs._add(Step(Op.REDUCE_SUM, (0,), 1), [sq], 1)
    mean = bs._add(
        Step(Op.MUL, (0, 1)), [s, next(c for c in bs.consts if c.step.arg == Fraction(1, 16))], 1
    )
    rs = bs._add(Step(Op.RSQRT, (0,)), [mean], 1)
    assert None not in (sq, s, mean, rs)
    assert bs._add(Step(Op.MUL, (0, 1)), [0, rs], 2) is not None
    # a true constant multiple of the row is still represented by the row alone
    assert bs._add(Step(Op.ADD, (0, 1)), [0, 0], 2) is None


@pytest.mark.slow
def test_qknorm_real_at_batch_one_normalises_inside_the_split_kv_program(tmp_path):
    """qknorm_real (RMSNorm on q and on k, then attention): the normalised tiles come from the
    target replayed on the tiles (round 0), the accumulators and the split combine from the
    enumeration and its completion. A fused program with no more launches than the hand-written
    fixture and an estimate within 10% of it is verified at full shapes."""
    import onnx

    from mlso_cli.pipeline.run import lift
    from mlso_cli.search.cost import program_cost
    from models.build_models import SPECS
    from tests.fixtures.ugraphs import fixture

    path = tmp_path / "qkr1.onnx"
    onnx.save(SPECS["qknorm_real"].build(1, "float16", small=False), str(path))
    region = lift(str(path), None).regions[0]
    res = search(region.graph, SearchOptions(seed=0, jobs=2))
    fx = program_cost(fixture("qknorm_real", False, 1))
    best = min(res.candidates, key=lambda c: c.estimate_us)
    assert res.verified >= 1 and best.bound > 0
    assert best.kernels <= fx.launches and best.estimate_us <= 1.10 * fx.us


def _explored_at_loops(target, loops: tuple[int, ...], want_whole: bool):
    """The loop-over-the-contraction signature explored alone; its structures instantiated at
    each loop count in `loops`, checked equal to the target (field check and float64)."""
    from mlso_cli.ir import serialize
    from mlso_cli.search import run as R
    from mlso_cli.search.dims import dim_classes
    from mlso_cli.search.shrink import shrink
    from mlso_cli.search.space import Dims, Signature, instantiate, is_whole
    from mlso_cli.verify.equivalence import check_equivalent

    small, _ = shrink(target)
    dcs, dcf = dim_classes(small), dim_classes(target)
    k = dcs.input_class[0][1]
    R._REGIONS.clear()
    ex = R.explore(
        R.Task(
            serialize.dumps(target),
            Signature((), k, whole=want_whole),
            20_000,
            0,
            "sm_90",
            11,
            None,
            True,
        )
    )
    recipes = [f.recipe for f in ex.found if any(is_whole(x) for x in f.recipe.feeds) == want_whole]
    assert recipes, ex
    gds = []
    for loop in loops:
        kg = instantiate(target, dcf, recipes[0], Dims((), loop), R.save_slots(recipes[0]))
        check(kg)
        gd = next(n for n in kg.nodes() if n.op is Op.GRAPH_DEF)
        assert gd.arg.loop == loop
        assert check_equivalent(target, kg, seed=loop).equivalent
        _agrees(target, SimpleNamespace(graph=kg))
        gds.append(gd)
    return recipes[0], gds


def _layernorm_linear_target(rows: int = 4, h: int = 64, n: int = 32):
    """LayerNorm over the contraction index, then a linear layer: held out (not a benchmark
    model's spelling: mean by REDUCE_SUM * 1/h, variance of the centred row)."""
    x = b.input_(0, (rows, h), DType.F32)
    g = b.input_(1, (h,), DType.F32)
    be = b.input_(2, (h,), DType.F32)
    w = b.input_(3, (h, n), DType.F32)
    inv = b.const(Fraction(1, h))
    c = b.sub(x, b.mul(b.reduce(Op.REDUCE_SUM, x, 1), inv))
    var = b.mul(b.reduce(Op.REDUCE_SUM, b.unary(Op.SQUARE, c), 1), inv)
    y = b.mul(c, b.unary(Op.RSQRT, b.add(var, b.const(Fraction(1, 100000)))))
    out = b.matmul(b.add(b.mul(y, g), be), w)
    return check(b.kernel_graph([x, g, be, w], [out]))


@pytest.mark.slow
def test_a_statistic_over_the_loop_index_is_taken_once_from_a_whole_feed():
    """LayerNorm(x) @ W with the loop walking the normalised index: the mean and variance need the
    whole row before the first step, so the row is fed a second time, whole, and the statistics
    are computed once in the PRE phase (search/space.py WHOLE). Without it the only fused
    programs were loop-free (layernorm_linear: 64 µs on the H200 against 31 for the fixture)."""
    from mlso_cli.ir.graph import InputMap
    from mlso_cli.search.dims import dim_classes
    from mlso_cli.search.space import (
        WHOLE,
        Axis,
        Signature,
        feeds_of,
        input_map,
        whole_feeds,
        with_whole_variants,
    )

    target = _layernorm_linear_target()
    dc = dim_classes(target)
    k = dc.input_class[0][1]
    # only the row is fed whole: the weight reaches the loop index through the contraction, and
    # gamma/beta only elementwise after the statistics
    assert whole_feeds(target, dc, Signature((), k)) == (WHOLE + 0,)
    # no loop: no whole feed
    assert whole_feeds(target, dc, Signature((), None)) == ()
    # split-K (a partial grid dim over the index): still the whole row, not the block's chunk
    split = Signature((Axis(k, True),), k, whole=True)
    assert whole_feeds(target, dc, split) == (WHOLE + 0,)
    assert input_map(dc, split, WHOLE + 0) == InputMap((None, None, None), None)
    assert input_map(dc, split, 0).imap[0] == 1
    # only the signature's whole variant is fed them: the plain one explores as before
    assert feeds_of(target, dc, Signature((), k)) == (0, 1, 2, 3)
    assert feeds_of(target, dc, Signature((), k, whole=True)) == (0, 1, 2, 3, WHOLE)
    sigs = with_whole_variants(target, dc, [Signature((), k), Signature((), None)])
    assert sigs == [Signature((), k), Signature((), None), Signature((), k, whole=True)]
    _, (_, gd) = _explored_at_loops(target, (2, 4), want_whole=True)
    # the row is read twice: sliced by the loop, and whole (no fmap)
    xs = [im for im, s in zip(gd.arg.inputs, gd.src) if s is target.inputs[0]]
    assert len(xs) == 2 and {im.fmap for im in xs} == {1, None}
    # the statistics are computed before the loop, once
    pre = [n for n in gd.arg.nodes() if n.op is Op.REDUCE_SUM]
    assert pre and all(n.phase is Phase.PRE for n in pre)


@contextmanager
def _completion_defaults(**values):
    """KernelCompletion's field defaults replaced by name while the block runs (`explore` builds
    its completion with the defaults)."""
    from dataclasses import MISSING, fields

    from mlso_cli.search.enumerate import KernelCompletion

    orig = KernelCompletion.__init__.__defaults__
    names = [f.name for f in fields(KernelCompletion) if f.default is not MISSING]
    assert len(names) == len(orig) and set(values) <= set(names)
    KernelCompletion.__init__.__defaults__ = tuple(values.get(n, d) for n, d in zip(names, orig))
    try:
        yield
    finally:
        KernelCompletion.__init__.__defaults__ = orig


def _split_k_explored(target, sig, max_partials: int | None = None):
    """One split-K signature explored alone (optionally with the completion's pool of partials
    cut to `max_partials`); its cheapest structure sized, checked and run in float64."""
    from mlso_cli.ir import serialize
    from mlso_cli.search import run as R
    from mlso_cli.search.dims import dim_classes
    from mlso_cli.search.select import choose_dims
    from mlso_cli.verify.equivalence import check_equivalent

    R._REGIONS.clear()
    fields = {} if max_partials is None else {"max_partials": max_partials}
    with _completion_defaults(**fields):
        ex = R.explore(R.Task(serialize.dumps(target), sig, 3_000, 0, "sm_90", 11, None, True))
    assert ex.found, ex
    best = min(ex.found, key=lambda f: f.estimate_us)
    dc = dim_classes(target)
    (sized, *_) = choose_dims(target, dc, best.recipe, R.save_slots(best.recipe), keep=1)
    kg = check(sized.graph)
    assert check_equivalent(target, kg, seed=1).equivalent
    _agrees(target, SimpleNamespace(graph=kg))
    return kg


def test_a_layernorm_split_over_its_contraction_takes_its_statistics_from_a_whole_feed():
    """LayerNorm(x) @ W with a grid dim splitting the normalised index: every block reads its
    rows whole before the loop (mean, variance), normalises its own chunk step by step, and
    saves a partial product; the kernel-level combine is one sum. The normalised chunk is a deep
    block value, so its partial ranks low among the partials: the completion must still take a
    partial whose combine is the output, whatever its rank (here with a pool of none)."""
    from mlso_cli.ir.graph import PARTIAL
    from mlso_cli.search.dims import dim_classes
    from mlso_cli.search.space import Axis, Signature

    target = _layernorm_linear_target(rows=8)
    dc = dim_classes(target)
    k, cols = dc.input_class[0][1], dc.input_class[3][1]
    kg = _split_k_explored(target, Signature((Axis(cols, False), Axis(k, True)), k, whole=True), 0)
    (gd,) = [nd for nd in kg.nodes() if nd.op is Op.GRAPH_DEF]
    assert all(PARTIAL in s.arg.omap for s in gd.arg.outputs)
    # the combine is one sum over the partials (casts and views aside)
    kernel_ops = [nd.op for nd in kg.nodes() if nd.op not in (Op.INPUT, Op.GRAPH_DEF, Op.PROJ)]
    assert [o for o in kernel_ops if o not in (Op.CAST, Op.RESHAPE)] == [Op.REDUCE_SUM], kernel_ops
    # the row is read whole (no grid or loop split) and sliced (split by the grid, walked by
    # the loop); its statistics are computed before the loop
    xs = [im for im, s in zip(gd.arg.inputs, gd.src) if s is target.inputs[0]]
    assert len(xs) == 2
    whole = [im for im in xs if im.fmap is None]
    assert whole and whole[0].imap == (None, None, None)
    stats = [n for n in gd.arg.nodes() if n.op is Op.REDUCE_SUM]
    assert stats and all(n.phase is Phase.PRE for n in stats)


@pytest.mark.slow
def test_a_split_layernorm_adds_beta_before_its_one_product():
    """At 16 x 1024 x 1024, split over the contraction: beta joins the normalised chunk before W,
    ((x̂ γ + β) @ W, one product), not as a 1-row β @ W of its own, which tensor cores run as 16
    rows (enumerate.construction_cost; priced by its one row, the two-product spelling was kept)."""
    from mlso_cli.ir import serialize
    from mlso_cli.search import run as R
    from mlso_cli.search.dims import dim_classes
    from mlso_cli.search.select import choose_dims
    from mlso_cli.search.space import Axis, Signature

    target = _layernorm_linear_target(rows=16, h=1024, n=1024)
    dc = dim_classes(target)
    k, cols = dc.input_class[0][1], dc.input_class[3][1]
    R._REGIONS.clear()
    sig = Signature((Axis(cols, False), Axis(k, True)), k, whole=True)
    ex = R.explore(R.Task(serialize.dumps(target), sig, 6_000, 0, "sm_90", 11, None, True))
    assert ex.found
    for f in ex.found:
        (sized, *_) = choose_dims(target, dc, f.recipe, R.save_slots(f.recipe), keep=1)
        (gd,) = [nd for nd in check(sized.graph).nodes() if nd.op is Op.GRAPH_DEF]
        assert [n.op for n in gd.arg.nodes()].count(Op.MATMUL) == 1


def test_a_one_row_product_costs_a_whole_tensor_core_tile():
    from mlso_cli.search.enumerate import MMA_ROWS, construction_cost

    def product(rows: int) -> float:
        node = b.matmul(b.input_(0, (rows, 64), DType.F16), b.input_(1, (64, 32), DType.F16))
        return construction_cost(Op.MATMUL, node, 1)

    assert product(1) == product(MMA_ROWS)
    assert product(MMA_ROWS + 1) == 2 * product(MMA_ROWS)
    # other ops are priced by their own elements
    x = b.input_(0, (1, 64), DType.F16)
    assert construction_cost(Op.ADD, b.add(x, x), 1) == 64


def test_a_groupnorm_split_over_its_channels_is_admitted():
    """GroupNorm then a linear layer with a grid dim splitting the channels (whole groups per
    step): the accumulated product holds a mean term whose sums are an alpha-variant of the
    target's (a free block digit reordered the binders' canonical names). Pattern keys name a
    bound digit by its binder and its first occurrence, so the term is admitted and the
    signature completes with one kernel-level sum."""
    from mlso_cli.search.dims import dim_classes
    from mlso_cli.search.space import Axis, Signature

    rows, groups, gs, n = 2, 8, 16, 32
    h = groups * gs
    x = b.input_(0, (rows, h), DType.F32)
    gg = b.input_(1, (groups,), DType.F32)
    scale = b.input_(2, (h,), DType.F32)
    w = b.input_(3, (h, n), DType.F32)
    xg = b.reshape(x, (rows, groups, gs))
    inv = b.const(Fraction(1, gs))
    c = b.sub(xg, b.mul(b.reduce(Op.REDUCE_SUM, xg, 2), inv))
    var = b.mul(b.reduce(Op.REDUCE_SUM, b.unary(Op.SQUARE, c), 2), inv)
    y = b.mul(c, b.unary(Op.RSQRT, b.add(var, b.const(Fraction(1, 100000)))))
    y = b.reshape(b.mul(y, b.reshape(gg, (groups, 1))), (rows, h))
    target = check(b.kernel_graph([x, gg, scale, w], [b.matmul(b.mul(y, scale), w)]))
    dc = dim_classes(target)
    k, cols = dc.input_class[0][1], dc.input_class[3][1]
    kg = _split_k_explored(target, Signature((Axis(cols, False), Axis(k, True)), k))
    assert sum(nd.op is Op.GRAPH_DEF for nd in kg.nodes()) == 1
    assert any(nd.op is Op.REDUCE_SUM for nd in kg.nodes())


@pytest.mark.slow
def test_groups_regroup_on_a_tile_that_holds_whole_groups():
    """GroupNorm then a linear layer: the loop walks the channels in steps of whole groups, so
    each step's tile is regrouped (rows, groups per step, group size) and normalised on its own;
    the reshape is replayed at each instance's sizes (search/space.py Regroup), not at the
    provisional ones it was found at."""
    rows, groups, gs, n = 2, 8, 16, 32
    h = groups * gs
    x = b.input_(0, (rows, h), DType.F32)
    w = b.input_(1, (h, n), DType.F32)
    xg = b.reshape(x, (rows, groups, gs))
    inv = b.const(Fraction(1, gs))
    c = b.sub(xg, b.mul(b.reduce(Op.REDUCE_SUM, xg, 2), inv))
    var = b.mul(b.reduce(Op.REDUCE_SUM, b.unary(Op.SQUARE, c), 2), inv)
    y = b.reshape(b.mul(c, b.unary(Op.RSQRT, b.add(var, b.const(Fraction(1, 100000))))), (rows, h))
    target = check(b.kernel_graph([x, w], [b.matmul(y, w)]))
    _, gds = _explored_at_loops(target, (2, 8), want_whole=False)
    for loop, gd in zip((2, 8), gds):
        shapes = [m.shape for m in gd.arg.nodes() if m.op is Op.RESHAPE and len(m.shape) == 3]
        assert shapes == [(rows, groups // loop, gs)]


def test_a_split_statistic_completes_through_unary_ops_after_the_combine():
    """(x @ W) / sqrt((x * x) @ V / h + eps) with a grid dim splitting the contraction index:
    each block saves partial products, and the kernel-level completion must build
    1 / sqrt(A / h + eps) * B from the completed sums: a constant scale, a constant shift and a
    unary op after the combine, before the pair (split-K with an output-shaped statistic).
    Without those rounds (chain=0) the split signature completes nothing."""
    from mlso_cli.ir import serialize
    from mlso_cli.ir.graph import PARTIAL
    from mlso_cli.search import run as R
    from mlso_cli.search.dims import dim_classes
    from mlso_cli.search.select import choose_dims
    from mlso_cli.search.space import Axis, Signature
    from mlso_cli.verify.equivalence import check_equivalent

    rows, h, n = 8, 64, 32
    x = b.input_(0, (rows, h), DType.F32)
    w = b.input_(1, (h, n), DType.F32)
    v = b.input_(2, (h, n), DType.F32)
    ms = b.mul(b.matmul(b.unary(Op.SQUARE, x), v), b.const(Fraction(1, h)))
    y = b.div(b.matmul(x, w), b.unary(Op.SQRT, b.add(ms, b.const(Fraction(1, 1000)))))
    target = check(b.kernel_graph([x, w, v], [y]))
    dc = dim_classes(target)
    k, cols = dc.input_class[0][1], dc.input_class[1][1]
    sig = Signature((Axis(cols, False), Axis(k, True)), k)
    task = R.Task(serialize.dumps(target), sig, 20_000, 0, "sm_90", 11, None, True)

    def explored(chain: int):
        R._REGIONS.clear()
        with _completion_defaults(chain=chain):
            return R.explore(task)

    assert not explored(0).found
    ex = explored(3)
    assert ex.found, ex
    recipe = ex.found[0].recipe
    (sized, *_) = choose_dims(target, dc, recipe, R.save_slots(recipe), keep=1)
    kg = check(sized.graph)
    gds = [nd for nd in kg.nodes() if nd.op is Op.GRAPH_DEF]
    assert len(gds) == 1 and sized.cost.launches == 2
    # the block kernel's saves are partial sums over the split index
    assert all(PARTIAL in s.arg.omap for s in gds[0].arg.outputs)
    assert check_equivalent(target, kg, seed=1).equivalent
    _agrees(target, SimpleNamespace(graph=kg))


def test_a_division_by_a_value_the_target_never_divides_by_is_pruned():
    """x * s / s is x again, and its abstract expression says so; the enumeration had used it
    to broadcast a per-row statistic to a whole tile (a division by zero wherever s is 0). A
    division survives only if the reciprocal of its divisor is in the target's forms."""
    from mlso_cli.search.dims import dim_classes
    from mlso_cli.search.enumerate import SearchAlgebra
    from mlso_cli.search.prune import BoundPruner, make_pruner

    x = b.input_(0, (8, 32), DType.F32)
    s = b.input_(1, (8, 32), DType.F32)
    d = b.input_(2, (8, 32), DType.F32)
    target = check(b.kernel_graph([x, s, d], [b.div(b.mul(x, s), d)]))
    pruner = make_pruner(target, dim_classes(target))
    kernel = BoundPruner(pruner, None).kernel_op
    ex = [SimpleNamespace(abstract=e) for e in pruner.inputs]
    xs = b.mul(x, s)
    xs_e = SimpleNamespace(abstract=kernel(xs, [ex[0].abstract, ex[1].abstract]))
    assert xs_e.abstract is not None
    # x * s / s: the quotient is x, a subexpression, but 1 / s is not in the target
    assert kernel(b.div(xs, s), [xs_e.abstract, ex[1].abstract]) is not None
    assert not SearchAlgebra._denominator(b.div(xs, s), [xs_e, ex[1]], kernel)
    # x * s / d is the target; a constant divisor is always allowed
    assert SearchAlgebra._denominator(b.div(xs, d), [xs_e, ex[2]], kernel)
    assert SearchAlgebra._denominator(b.div(x, b.const(3)), [ex[0], None], kernel)


def test_a_norm_split_over_its_contraction_saves_its_statistic_broadcast():
    """RMSNorm(x) * g @ W with a grid dim splitting the normalised (contraction) index: each
    block saves partial products P and its rows' partial sums of squares S, broadcast to the
    output tile (a per-row value saved as it is would be laid out one column per block), and
    the completion builds rsqrt-like(S / h + eps) * P after the combine. Nothing divides by a
    value the target never divides by (the enumeration had spelt the broadcast S * P / P).
    Held-out spelling: the norm divides by sqrt, gamma comes after the norm."""
    from mlso_cli.ir import serialize
    from mlso_cli.ir.graph import PARTIAL
    from mlso_cli.search import run as R
    from mlso_cli.search.dims import dim_classes
    from mlso_cli.search.select import choose_dims
    from mlso_cli.search.space import Axis, Signature
    from mlso_cli.verify.equivalence import check_equivalent

    rows, h, n = 8, 64, 32
    x = b.input_(0, (rows, h), DType.F32)
    g = b.input_(1, (h,), DType.F32)
    w = b.input_(2, (h, n), DType.F32)
    ms = b.mul(b.reduce(Op.REDUCE_SUM, b.unary(Op.SQUARE, x), 1), b.const(Fraction(1, h)))
    y = b.div(x, b.unary(Op.SQRT, b.add(ms, b.const(Fraction(1, 1000)))))
    target = check(b.kernel_graph([x, g, w], [b.matmul(b.mul(y, g), w)]))
    dc = dim_classes(target)
    k, cols = dc.input_class[0][1], dc.input_class[2][1]
    R._REGIONS.clear()
    sig = Signature((Axis(cols, False), Axis(k, True)), k)
    ex = R.explore(R.Task(serialize.dumps(target), sig, 20_000, 0, "sm_90", 11, None, True))
    assert ex.found, ex
    recipe = ex.found[0].recipe
    (sized, *_) = choose_dims(target, dc, recipe, R.save_slots(recipe), keep=1)
    kg = check(sized.graph)
    (gd,) = [nd for nd in kg.nodes() if nd.op is Op.GRAPH_DEF]
    assert sized.cost.launches == 2
    saves = gd.arg.outputs
    assert len(saves) == 2 and all(PARTIAL in s.arg.omap for s in saves)
    assert any(nd.op is Op.BROADCAST for s in saves for nd in toposort([s])), [
        [(nd.op, nd.shape) for nd in toposort([s])] for s in saves
    ]
    for nd in list(gd.arg.nodes()) + list(kg.nodes()):
        if nd.op is Op.DIV:
            assert nd.src[1].op is Op.CONST or nd.src[1].op in (Op.SQRT, Op.ADD), nd
    assert check_equivalent(target, kg, seed=1).equivalent
    _agrees(target, SimpleNamespace(graph=kg))


@pytest.mark.slow
def test_timed_searches_keep_two_sizings_of_each_structure():
    """With programs to time (--gpu: full_checks > 1) each structure goes on with its two best
    sizings, so the timing can pick between them; a search the cost model decides alone keeps
    one. Same structures either way, and the first sizing is the one a model-only search keeps."""
    from mlso_cli.ir import serialize
    from mlso_cli.search import run as R

    assert R.sizings_for(1) == 1 and R.sizings_for(3) == R.TIMED_SIZINGS == 2
    x = b.input_(0, (8, 32), DType.F32)
    s = b.input_(1, (32,), DType.F32)
    w = b.input_(2, (32, 64), DType.F32)
    target = check(b.kernel_graph([x, s, w], [b.matmul(b.mul(x, s), w)]))
    _, _, sigs = R.explorable(target)
    text = serialize.dumps(target)
    two_sizings = 0
    for i, sig in enumerate(sigs):
        one = R.explore(R.Task(text, sig, 3000, i, "sm_90", 11, None, True, 1))
        two = R.explore(R.Task(text, sig, 3000, i, "sm_90", 11, None, True, 2))
        firsts = {}
        for f in two.found:
            firsts.setdefault(f.recipe, []).append(f)
        assert [f.recipe for f in one.found] == list(firsts)
        for f, sized in zip(one.found, firsts.values()):
            assert sized[0] == f and len(sized) <= 2
            assert [g.estimate_us for g in sized] == sorted(g.estimate_us for g in sized)
            if len(sized) == 2:
                assert sized[0].dims != sized[1].dims
                two_sizings += 1
    assert two_sizings >= 1


def test_a_value_over_the_print_cap_is_refused(monkeypatch):
    """A value with more entries (blocks x steps x tile) than MAX_PRINT_ELEMENTS gets no
    fingerprint: the enumeration refuses it, as it refuses a zero denominator, instead of
    allocating it (a Phi-3-width search worker died of the 800 MB ones)."""
    from mlso_cli.search import fingerprint
    from mlso_cli.search.dims import dim_classes
    from mlso_cli.search.enumerate import BlockSearch, Limits, SearchAlgebra, Stats, Vocabulary
    from mlso_cli.search.fingerprint import Fingerprints
    from mlso_cli.search.space import Dims, Signature, Step

    x = b.input_(0, (1, 16), DType.F32)
    target = check(b.kernel_graph([x], [b.unary(Op.SQUARE, x)]))
    dc = dim_classes(target)
    sig, dims = Signature((), None), Dims((), 1)

    def square_of_x():
        alg = SearchAlgebra(Fingerprints(target, dc, sig, dims, 0), None)
        bs = BlockSearch(
            target, dc, sig, dims, alg, Vocabulary.of(target), Limits(max_states=10), Stats()
        )
        return bs._add(Step(Op.SQUARE, (0,)), [0], 1)

    monkeypatch.setattr(fingerprint, "MAX_PRINT_ELEMENTS", 16)
    assert square_of_x() is not None  # 16 entries: at the cap
    monkeypatch.setattr(fingerprint, "MAX_PRINT_ELEMENTS", 15)
    assert square_of_x() is None
