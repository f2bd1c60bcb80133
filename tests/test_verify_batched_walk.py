"""The batched block walk of the field check gives the literal walk's residues, exactly.

Why: the field backend runs every block graph over stacked blocks (walk.py `_run_batched`), for
speed; the literal block-by-block walk is the definition. Any difference (a tile taken from the
wrong place, an axis not shifted past the block dims, an operand aligned differently, a saved
tile in the wrong place, an oracle or exp hashed differently, a max's leaf set lost) would make
the check test a program other than the one written. So every hand-written fixture, the tiled
max graphs, and random graphs of every generator family are evaluated both ways on the same
field and inputs, and must agree on every p- and q-residue (and on which q-residues are known,
and on a saved max's leaves), or raise the same exception. Each graph is also run with boxes of
a few blocks (BATCH_ENTRIES tiny), the memory-bounded path of large grids.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlso_cli.ir import PARTIAL, InputMap, KernelGraph, check
from mlso_cli.ir import build as b
from mlso_cli.ir.ops import DType, Op
from mlso_cli.verify import walk
from mlso_cli.verify.field import BadPrime, Field, FieldArray, ZeroDenominator
from mlso_cli.verify.fieldrun import FieldBackend
from tests import graphgen
from tests.fixtures import examples as ex
from tests.fixtures.ugraphs import MODELS, fixture
from tests.test_verify_tiledmax import _grid_split, _laid_out_split, _nested_split

RANDOM_GRAPHS = 50
F32 = DType.F32


def _run(kg: KernelGraph, inputs: list[FieldArray], fld: Field, batched: bool) -> object:
    """The outputs' residues and saved leaves, or the exception the walk raised."""
    fld._last_exp = None  # the exp cache is an identity memo: start both walks alike
    try:
        outs = walk.evaluate(kg, inputs, FieldBackend(fld, batched))
    except (ZeroDenominator, BadPrime) as exc:
        return type(exc)
    res = []
    for o in outs:
        o.force()
        leaves = o.leaves
        res.append(
            (
                o.shape,
                o.p.copy(),
                None if o.q is None else o.q.copy(),
                None
                if leaves is None
                else (leaves.name, leaves.k, leaves.p, None if leaves.q is None else leaves.q),
            )
        )
    return res


def _same(a: object, b: object) -> bool:
    if not isinstance(a, list) or not isinstance(b, list):
        return a == b
    if len(a) != len(b):
        return False
    for (sa, pa, qa, la), (sb, pb, qb, lb) in zip(a, b):
        if sa != sb or not np.array_equal(pa, pb) or (qa is None) != (qb is None):
            return False
        if qa is not None and not np.array_equal(qa, qb):
            return False
        if (la is None) != (lb is None):
            return False
        if la is not None:
            if la[:2] != lb[:2] or not np.array_equal(la[2], lb[2]):
                return False
            if (la[3] is None) != (lb[3] is None) or (
                la[3] is not None and not np.array_equal(la[3], lb[3])
            ):
                return False
    return True


def _check(kg: KernelGraph, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(seed)
    fld = Field.draw(rng)
    inputs = [fld.random(n.shape, rng) for n in kg.inputs]
    batched_runs = []
    run_batched = walk._run_batched

    def counting(*args: object) -> object:
        batched_runs.append(1)
        return run_batched(*args)

    monkeypatch.setattr(walk, "_run_batched", counting)
    literal = _run(kg, inputs, fld, False)
    assert not batched_runs
    kernels = sum(1 for n in kg.nodes() if n.op is Op.GRAPH_DEF)
    batched = _run(kg, inputs, fld, True)
    assert len(batched_runs) == kernels, "a block graph fell back to the literal walk"
    assert _same(literal, batched), "batched walk differs from the literal walk"
    for limit in (1, 50_000):  # boxes of one block; boxes of a few rows of the grid
        monkeypatch.setattr(walk, "BATCH_ENTRIES", limit)
        assert _same(literal, _run(kg, inputs, fld, True)), f"boxes (limit {limit}) differ"
    monkeypatch.undo()


@pytest.mark.parametrize("name", MODELS)
def test_fixtures(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _check(fixture(name, True), 1, monkeypatch)


def _aligned_operands(partial: bool) -> KernelGraph:
    """Operands of different ranks whose tiles differ from block to block (numpy aligns them by
    their trailing dims, so the stacked walk pads them past the block dims): a batched (2, m, k)
    tile times a (k, n) weight tile walked by the loop, a bias row (n,) split by grid y added in a
    thread body and broadcast, a grid x that splits a middle dim and a grid y that splits the
    last, a transposed save; `partial` splits k over grid z into PARTIAL sums instead."""
    x = b.input_(0, (2, 8, 24), F32)
    w = b.input_(1, (24, 16), F32)
    bias = b.input_(2, (16,), F32)
    kz = 2 if partial else 1
    tx = b.iter_(0, (2, 4, 24 // kz // 3), F32, True)
    tw = b.iter_(1, (24 // kz // 3, 8), F32, True)
    tb = b.iter_(2, (8,), F32, False)
    acc = b.accumulate(Op.ACC_SUM, b.matmul(tx, tw))
    body = b.mul(b.add(b.thread_in(0, (2, 4, 8)), b.thread_in(1, (8,))), b.thread_in(1, (8,)))
    y = b.thread(body, [acc, tb])
    y = b.add(y, b.broadcast_to(b.reduce(Op.REDUCE_SUM, tb, 0), (4, 8)))
    y = b.transpose(y, (0, 2, 1))
    omap = (2, 1, PARTIAL if partial else None)
    s = b.save(y, 0, omap, F32)
    maps = [
        InputMap((1, None, 2 if partial else None), 2),
        InputMap((None, 1, 0 if partial else None), 0),
        InputMap((None, 0, None)),
    ]
    bg = b.block_graph((2, 2, kz), 3, maps, [s])
    (out,) = b.graph_def([x, w, bias], bg)
    if partial:
        out = b.reshape(b.reduce(Op.REDUCE_SUM, out, 0), (2, 16, 8))
    return check(b.kernel_graph([x, w, bias], [out]))


@pytest.mark.parametrize(
    "build",
    [
        lambda: _grid_split(),
        lambda: _grid_split(4, 1),
        lambda: _grid_split(replicate=True),
        lambda: _grid_split(combine=Op.REDUCE_SUM, block_op=Op.REDUCE_SUM),
        _laid_out_split,
        _nested_split,
        # K and V replicated across the row blocks; a split-KV partial over the grid
        lambda: ex.gqa_pair(2, 16, 8, 32, rows=2, splits=2, loop=2)[1],
        lambda: ex.split_kv_attention(2, 8, 8, 64, rows=1, splits=4, loop=4),
        lambda: _aligned_operands(False),
        lambda: _aligned_operands(True),
    ],
)
def test_tiled_max_replicated_inputs_aligned_operands(
    build, monkeypatch: pytest.MonkeyPatch
) -> None:
    _check(build(), 2, monkeypatch)


_GENERATED = graphgen.seeded(20240611, RANDOM_GRAPHS)


@pytest.mark.parametrize("i", range(RANDOM_GRAPHS), ids=[g.name for g in _GENERATED])
def test_random_graphs(i: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _check(_GENERATED[i].kg, 100 + i, monkeypatch)
