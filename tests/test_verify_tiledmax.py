"""A tiled max is the plain max in the finite field; a max over a different set is not.

Why: max is an oracle in the field check, and an oracle keyed by its argument never equates a
max of partial maxima (a grid split of REDUCE_MAX combined at kernel level, an elementwise MAX of
two partial maxima, any nesting) with the single REDUCE_MAX it computes, so correct rewrites were
rejected. max is now a set oracle (verify/field.py): its value is a function of the set of the
values it ranges over, flattened through nesting. These tests hold both directions: every tiling
of one set is accepted, and a set that differs (a missing or foreign tile, the wrong axis, a sum,
a shifted argument) is rejected with a witness. Every graph here is also run in float64, so a
pair is only called equivalent (or not) when the real programs are.

The IR has no running-max accumulator (ACC_SUM, ACC_EXP_SUM and ACC_EXP_WSUM are sums; the online
softmax's max lives only in the float32 interpreter, verify/scaled.py), so a for-loop split of a
max cannot be written; the grid splits below are the forms that exist.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlso_cli.ir import PARTIAL, InputMap, KernelGraph, Node, check
from mlso_cli.ir import build as b
from mlso_cli.ir.ops import DType, Op
from mlso_cli.verify import check_equivalent, run
from mlso_cli.verify.field import Field, FieldArray
from mlso_cli.verify.fieldrun import FieldBackend, _FieldBuffer, run_field

F32 = DType.F32
R, C = 8, 8


def _x(i: int = 0, shape: tuple[int, ...] = (R, C)) -> Node:
    return b.input_(i, shape, F32)


def _kg(inputs: list[Node], outputs: list[Node]) -> KernelGraph:
    return check(b.kernel_graph(inputs, outputs))


def _rmax(x: Node, axis: int) -> Node:
    return b.reduce(Op.REDUCE_MAX, x, axis)


def _row_max() -> KernelGraph:
    """The target: the max of each row of x, (R, 1)."""
    x = _x()
    return _kg([x], [_rmax(x, 1)])


def _grid_split(
    gx: int = 2,
    gy: int = 2,
    *,
    combine: Op = Op.REDUCE_MAX,
    block_op: Op = Op.REDUCE_MAX,
    shift: bool = False,
    wrong_axis: bool = False,
    replicate: bool = False,
) -> KernelGraph:
    """Blocks (rows chunk, columns chunk): each takes its tile's row max, saved as a PARTIAL
    output; a kernel-level `combine` over the partials. The keyword arguments make mutants:
    a sum in the block, a max of x + 1, a tile reduced over its rows (then transposed), or
    every block reading whole rows (replicated: still correct, max is idempotent)."""
    x = _x()
    tile = (R // gx, C if replicate else C // gy)
    t = b.iter_(0, tile, F32, False)
    if shift:
        t = b.add(t, b.const(1))
    m = b.reduce(block_op, t, 0 if wrong_axis else 1)
    if wrong_axis:
        m = b.transpose(m, (1, 0))
    s = b.save(m, 0, (0, PARTIAL, None), F32)
    imap = (0, None if replicate else 1, None)
    bg = b.block_graph((gx, gy, 1), 1, [InputMap(imap)], [s])
    (parts,) = b.graph_def([x], bg)
    return _kg([x], [b.reshape(b.reduce(combine, parts, 0), (R, 1))])


def _laid_out_split() -> KernelGraph:
    """Tile maxima laid along a column dim (omap, not PARTIAL), cast, then reduced."""
    x = _x()
    t = b.iter_(0, (R // 2, C // 4), F32, False)
    s = b.save(_rmax(t, 1), 0, (0, 1, None), F32)
    bg = b.block_graph((2, 4, 1), 1, [InputMap((0, 1, None))], [s])
    (tiles,) = b.graph_def([x], bg)  # (R, 4): one max per column tile
    return _kg([x], [b.cast(_rmax(b.cast(tiles, DType.F16), 1), F32)])


def _nested_split() -> KernelGraph:
    """Tiles of tiles: 2-column maxima (block graph 1, laid out), maxima of pairs of those
    (block graph 2, PARTIAL over its two column blocks), a kernel-level max over the partials."""
    x = _x()
    t1 = b.iter_(0, (R // 2, 2), F32, False)
    s1 = b.save(_rmax(t1, 1), 0, (0, 1, None), F32)
    (quarters,) = b.graph_def([x], b.block_graph((2, 4, 1), 1, [InputMap((0, 1, None))], [s1]))
    t2 = b.iter_(0, (R, 2), F32, False)
    s2 = b.save(_rmax(t2, 1), 0, (None, PARTIAL, None), F32)
    (halves,) = b.graph_def(
        [quarters], b.block_graph((1, 2, 1), 1, [InputMap((None, 1, None))], [s2])
    )
    return _kg([x], [b.reshape(_rmax(halves, 0), (R, 1))])


def _kernel_level_nested() -> KernelGraph:
    """The same partition without block graphs: reshape to (R, 2, 2, 2), max the axes inside out."""
    x = _x()
    y = b.reshape(x, (R, 2, 2, 2))
    return _kg([x], [b.reshape(_rmax(_rmax(_rmax(y, 3), 2), 1), (R, 1))])


def _transposed_order() -> KernelGraph:
    """Column tiles maxed across first (an elementwise max of the two halves' columns, as a
    reduction over a tile axis), then along the row: a different order and grouping."""
    x = _x()
    y = b.reshape(x, (R, 2, C // 2))
    return _kg([x], [b.reshape(_rmax(_rmax(y, 1), 2), (R, 1))])


def _two_input_target() -> KernelGraph:
    x, y = _x(0), _x(1)
    return _kg([x, y], [_rmax(b.binary(Op.MAX, x, y), 1)])


def _two_input_partials() -> KernelGraph:
    """max over a row of MAX(x, y) as an elementwise MAX of the two partial maxima."""
    x, y = _x(0), _x(1)
    return _kg([x, y], [b.binary(Op.MAX, _rmax(y, 1), _rmax(x, 1))])


def _two_input_blocks() -> KernelGraph:
    """Each block maxes its tiles of x and y, combines them in a THREAD (registers), saves the
    partial; the kernel combines the partials."""
    x, y = _x(0), _x(1)
    tx, ty = b.iter_(0, (R, C // 2), F32, False), b.iter_(1, (R, C // 2), F32, False)
    body = b.binary(Op.MAX, b.thread_in(0), b.thread_in(1))
    m = b.thread(body, [_rmax(tx, 1), _rmax(ty, 1)])
    s = b.save(m, 0, (None, PARTIAL, None), F32)
    imaps = [InputMap((None, 1, None)), InputMap((None, 1, None))]
    (parts,) = b.graph_def([x, y], b.block_graph((1, 2, 1), 1, imaps, [s]))
    return _kg([x, y], [b.reshape(_rmax(parts, 0), (R, 1))])


def _foreign_tile() -> KernelGraph:
    """Mutant: the column-tile maxima regrouped by the wrong reshape, so each row combines one
    of its own tiles with a tile of another row (one tile missing, one foreign)."""
    x = _x()
    halves = _rmax(b.reshape(x, (R, 2, C // 2)), 2)  # (R, 2, 1)
    mixed = b.reshape(b.transpose(b.reshape(halves, (R, 2)), (1, 0)), (R, 2))
    return _kg([x], [_rmax(mixed, 1)])


def _two_input_partials_missing() -> KernelGraph:
    """Mutant: y's partial max replaced by x's again (max(x, x) is x's max: y is missing)."""
    x, y = _x(0), _x(1)
    return _kg([x, y], [b.binary(Op.MAX, _rmax(x, 1), _rmax(x, 1))])


def _stable_softmax(max_of: KernelGraph) -> KernelGraph:
    """softmax(x) with exp(x - m), m the (tiled) row max of `max_of`, m also an output."""
    (x,) = max_of.inputs
    (m,) = max_of.outputs
    e = b.unary(Op.EXP, b.sub(x, m))
    return _kg([x], [b.div(e, b.reduce(Op.REDUCE_SUM, e, 1)), m])


def _plain_softmax() -> KernelGraph:
    x = _x()
    e = b.unary(Op.EXP, x)
    return _kg([x], [b.div(e, b.reduce(Op.REDUCE_SUM, e, 1)), _rmax(x, 1)])


EQUIVALENT = {
    "grid_split_partial": lambda: (_row_max(), _grid_split()),
    "grid_split_columns_only": lambda: (_row_max(), _grid_split(1, 4)),
    "grid_split_laid_out": lambda: (_row_max(), _laid_out_split()),
    "nested_block_graphs": lambda: (_row_max(), _nested_split()),
    "nested_kernel_level": lambda: (_row_max(), _kernel_level_nested()),
    "other_grouping": lambda: (_nested_split(), _transposed_order()),
    "replicated_partials": lambda: (_row_max(), _grid_split(replicate=True)),
    "max_of_partial_maxima": lambda: (_two_input_target(), _two_input_partials()),
    "max_of_partials_in_blocks": lambda: (_two_input_target(), _two_input_blocks()),
    "stabiliser_is_a_tiled_max": lambda: (_plain_softmax(), _stable_softmax(_grid_split())),
}

NOT_EQUIVALENT = {
    "foreign_tile": lambda: (_row_max(), _foreign_tile()),
    "wrong_axis": lambda: (_row_max(), _grid_split(wrong_axis=True)),
    "sum_combine": lambda: (_row_max(), _grid_split(combine=Op.REDUCE_SUM)),
    "sum_in_block": lambda: (_row_max(), _grid_split(block_op=Op.REDUCE_SUM)),
    "max_of_x_plus_1": lambda: (_row_max(), _grid_split(shift=True)),
    "one_input_only": lambda: (_two_input_target(), _two_input_partials_missing()),
    "tiled_stabiliser_wrong_axis": lambda: (
        _plain_softmax(),
        _stable_softmax(_grid_split(wrong_axis=True)),
    ),
}


def _float64_agree(a: KernelGraph, c: KernelGraph) -> bool:
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(n.shape) for n in a.inputs]
    return all(np.allclose(u, v) for u, v in zip(run(a, xs), run(c, xs)))


@pytest.mark.parametrize("name", list(EQUIVALENT))
def test_tiled_max_is_accepted(name):
    a, c = EQUIVALENT[name]()
    assert _float64_agree(a, c), "the test pair itself is wrong"
    v = check_equivalent(a, c, seed=3)
    assert v.equivalent, v


@pytest.mark.parametrize("name", list(NOT_EQUIVALENT))
def test_max_over_a_different_set_is_rejected(name):
    a, c = NOT_EQUIVALENT[name]()
    assert not _float64_agree(a, c), "the mutant is not wrong"
    for seed in range(3):
        v = check_equivalent(a, c, seed=seed)
        assert not v.equivalent and v.bound == 0.0 and "differs" in v.detail, v


# ---- the canonical form in the field algebra itself -------------------------------------------


@pytest.fixture(scope="module")
def fld() -> Field:
    return Field.draw(np.random.default_rng(11))


def _rand(fld: Field, shape: tuple[int, ...], seed: int) -> FieldArray:
    return fld.random(shape, np.random.default_rng(seed))


def _max_tree(fld: Field, x: FieldArray, lo: int, hi: int, rng: np.random.Generator) -> FieldArray:
    """max over columns [lo, hi) of x (shape (rows, n)) as a random tree: a random partition,
    each part maxed recursively, the parts combined by a REDUCE_MAX over a stack (PARTIAL-like)
    or by a chain of elementwise maxes."""
    if hi - lo == 1 or rng.random() < 0.25:
        return fld.oracle_reduce("max", x[:, lo:hi], 1)
    n_cuts = rng.integers(1, min(3, hi - lo - 1) + 1)
    cuts = sorted(rng.choice(np.arange(lo + 1, hi), size=n_cuts, replace=False))
    bounds = [lo, *cuts, hi]
    parts = [_max_tree(fld, x, s, e, rng) for s, e in zip(bounds, bounds[1:])]
    if rng.random() < 0.5:
        out = parts[0]
        for p in parts[1:]:
            out = fld.oracle("max", p, out)
        return out
    # a PARTIAL-like stack: the parts written into one saved buffer (leaf sets of different
    # sizes are padded there), then a REDUCE_MAX over the stacking axis
    be = FieldBackend(fld)
    buf = _FieldBuffer((len(parts),) + parts[0].shape)
    for i, part in enumerate(parts):
        be.put(buf, (i,), part, None)
    return fld.reshape(fld.oracle_reduce("max", be.finish(buf), 0), parts[0].shape)


def test_every_random_tiling_of_a_row_is_the_row_max(fld):
    x = _rand(fld, (5, 24), 1)
    want = fld.oracle_reduce("max", x, 1)
    rng = np.random.default_rng(2)
    for _ in range(30):
        got = _max_tree(fld, x, 0, 24, rng)
        assert got.equal(want)


def test_a_missing_or_repeated_tile_changes_the_value(fld):
    x = _rand(fld, (5, 24), 3)
    tiles = [fld.oracle_reduce("max", x[:, i : i + 6], 1) for i in range(0, 24, 6)]
    want = fld.oracle_reduce("max", x, 1)

    def combine(ts: list[FieldArray]) -> FieldArray:
        out = ts[0]
        for t in ts[1:]:
            out = fld.oracle("max", out, t)
        return out

    assert combine(tiles).equal(want)
    assert combine(tiles[::-1]).equal(want)
    assert combine(tiles + [tiles[1]]).equal(want)  # idempotent: a tile twice is the same set
    missing = combine(tiles[:3])
    repeated = combine(tiles[:3] + [tiles[0]])
    off_by_one = fld.oracle("max", combine(tiles[:3]), fld.oracle_reduce("max", x[:, 19:24], 1))
    for bad in (missing, repeated, off_by_one):
        assert not np.any(bad.p == want.p)


def test_one_element_sets_are_the_element(fld):
    """max{a} = a: max(x, x), a max over a size-1 axis and over a broadcast axis are x, in both
    residues (the search's abstract expressions drop such reductions too)."""
    x = _rand(fld, (4, 6), 4)
    assert fld.oracle("max", x, x).equal(x) and fld.oracle("max", x, x).q_known()
    np.testing.assert_array_equal(fld.oracle("max", x, x).q, x.q)
    col = fld.reshape(x, (4, 6, 1))
    assert fld.reshape(fld.oracle_reduce("max", col, 2), (4, 6)).equal(x)
    wide = fld.broadcast(fld.reshape(x, (4, 1, 6)), (4, 3, 6))
    assert fld.reshape(fld.oracle_reduce("max", wide, 1), (4, 6)).equal(x)
    relu = fld.oracle("max", x, fld.broadcast(fld.const(0), x.shape))
    assert fld.oracle("max", relu, fld.broadcast(fld.const(0), x.shape)).equal(relu)


def test_max_sets_are_keyed_and_only_p_residues_matter(fld):
    a, c = _rand(fld, (50,), 5), _rand(fld, (50,), 6)
    m = fld.oracle("max", a, c)
    assert not np.any(m.p == a.p) and not np.any(m.p == c.p)
    other = Field(fld.p, fld.q, fld.g, fld.salt + 1)
    assert not np.any(other.oracle("max", a, c).p == m.p)
    assert fld.oracle("max", FieldArray(a.p, (a.q + 1) % fld.q), c).equal(m)
    # a max value fed to another oracle is an ordinary argument: sqrt(max(a, c)) is not flattened
    s = fld.oracle("sqrt", m)
    assert s.leaves is None and fld.oracle("max", s, a).leaves.k == 2


def test_leaves_survive_views_tiles_and_saved_buffers():
    """The tiled forms above rely on a max value keeping its set through kernel-level views,
    CAST, block tiles and the partial buffers blocks save into."""
    fld = Field.draw(np.random.default_rng(12))
    for kg in (_grid_split(), _laid_out_split(), _nested_split()):
        xs = [fld.random(n.shape, np.random.default_rng(13)) for n in kg.inputs]
        (got,) = run_field(kg, xs, fld)
        (want,) = run_field(_row_max(), xs, fld)
        assert got.equal(want) and got.leaves is not None and got.leaves.k == C
