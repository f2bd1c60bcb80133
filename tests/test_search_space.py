"""Index classes, reduced shapes, recipes and dimension choice: the search's scaffolding.

Why: the enumerator proves a structure at reduced shapes and sizes it afterwards, so these parts
must be right on their own: classes must tile every input consistently, the reduced target must
be the same computation, and a recipe replayed at any sizes must stay equivalent to the target.
The recipes here are written by hand in recipe form (test data, as the fixtures are); the
enumerator's job is to find such recipes.
"""

from __future__ import annotations

import onnx
import pytest

from mlso_cli.frontend.lift import lift_model
from mlso_cli.ir.ops import Op
from mlso_cli.ir.spec import check
from mlso_cli.search.cost import program_cost
from mlso_cli.search.dims import dim_classes
from mlso_cli.search.select import choose_dims, divisors
from mlso_cli.search.shrink import shrink
from mlso_cli.search.space import (
    Axis,
    Dims,
    Recipe,
    RecipeError,
    Signature,
    Step,
    instantiate,
    signatures,
)
from mlso_cli.verify.equivalence import check_equivalent
from models.build_models import SPECS
from tests.fixtures.ugraphs import FIXTURES, fixture


def _target(tmp_path, name: str, bs: int = 1):
    path = tmp_path / f"{name}.onnx"
    onnx.save(SPECS[name].build(bs, "float16", small=False), str(path))
    (kg,) = lift_model(str(path))
    return kg


def _cls(dc, inp: int, dim: int) -> int:
    return dc.input_class[inp][dim]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_classes_tile_every_input_consistently_and_shrink_keeps_the_computation(tmp_path, name):
    kg = _target(tmp_path, name)
    dc = dim_classes(kg)
    for c in dc.classes:
        for i, d in c.inputs:
            assert kg.inputs[i].shape[d] % c.size == 0
    small, _ = shrink(kg)
    check(small)
    assert all(n.numel <= m.numel for n, m in zip(small.inputs, kg.inputs))
    # the reduced graph has the same index structure: class for class, size for size
    dcs = dim_classes(small)
    assert dcs.input_class == dc.input_class and dcs.output_class == dc.output_class


def test_attention_classes_split_keys_as_a_summed_index(tmp_path):
    kg = _target(tmp_path, "gqa", 8)
    dc = dim_classes(kg)
    keys = dc.classes[_cls(dc, 1, 2)]  # K (g, d, kv): kv
    assert keys.reduced and not keys.spatial and keys.inputs == ((1, 2), (2, 1))
    group = dc.classes[_cls(dc, 0, 0)]
    assert group.spatial and set(group.inputs) == {(0, 0), (1, 0), (2, 0)}
    sigs = signatures(dc)
    assert any(
        s.partial() is not None and s.partial().cls == keys.id and s.loop == keys.id for s in sigs
    )
    assert len(set(sigs)) == len(sigs)


def _gated_recipe(dc) -> Recipe:
    cols, k = _cls(dc, 1, 1), _cls(dc, 0, 1)
    return Recipe(
        Signature((Axis(cols, False),), k),
        (0, 1, 2),
        (
            Step(Op.MATMUL, (0, 1)),
            Step(Op.ACC_SUM, (3,)),
            Step(Op.MATMUL, (0, 2)),
            Step(Op.ACC_SUM, (5,)),
            Step(Op.SILU, (4,)),
            Step(Op.MUL, (7, 6)),
        ),
        (8,),
        (),
        (3,),
    )


def test_recipe_replays_equivalent_at_reduced_and_chosen_full_sizes(tmp_path):
    target = _target(tmp_path, "gated_mlp")
    small, _ = shrink(target)
    dcs, dcf = dim_classes(small), dim_classes(target)
    recipe = _gated_recipe(dcs)
    for dims in (Dims((2,), 2), Dims((4,), 1), Dims((1,), 8)):
        kg = instantiate(small, dcs, recipe, dims, (0,))
        check(kg)
        assert check_equivalent(small, kg, seed=3).equivalent
    sized = choose_dims(target, dcf, recipe, (0,))
    assert sized and all(not s.graph.kernels()[0].arg.loop < 1 for s in sized)
    assert [s.cost.seconds for s in sized] == sorted(s.cost.seconds for s in sized)
    fixture_us = program_cost(fixture("gated_mlp", False, 1)).us
    assert sized[0].cost.us <= fixture_us * 1.1
    assert sized[0].cost.launches <= program_cost(fixture("gated_mlp", False, 1)).launches


def test_a_wrong_recipe_is_rejected_and_a_misfit_size_raises(tmp_path):
    target = _target(tmp_path, "gated_mlp")
    small, _ = shrink(target)
    dcs = dim_classes(small)
    good = _gated_recipe(dcs)
    wrong = good.__class__(
        good.signature,
        good.feeds,
        good.block_steps[:4] + (Step(Op.SIGMOID, (4,)), Step(Op.MUL, (7, 6))),
        good.saves,
        good.kernel_steps,
        good.outputs,
    )
    kg = instantiate(small, dcs, wrong, Dims((2,), 2), (0,))
    assert not check_equivalent(small, kg, seed=3).equivalent
    with pytest.raises(RecipeError):
        instantiate(small, dcs, good, Dims((3,), 2), (0,))


def test_divisors():
    assert divisors(12) == [1, 2, 3, 4, 6, 12]


def test_a_reshape_replays_on_a_tile_only_where_the_regrouped_dims_are_whole():
    from mlso_cli.search.space import tile_reshape as _tile_reshape

    # rows split by the grid, the regrouped (4096 -> 32 x 128) dim whole: rows keep their tile size
    assert _tile_reshape((8, 4096), (8, 32, 128), (2, 4096)) == (2, 32, 128)
    assert _tile_reshape((8, 32, 128), (8, 4096), (2, 32, 128)) == (2, 4096)
    # the regrouped dim itself is split in whole groups: a block holds 8 of the 32 groups
    assert _tile_reshape((8, 4096), (8, 32, 128), (8, 1024)) == (8, 8, 128)
    assert _tile_reshape((8, 32, 128), (8, 4096), (8, 8, 128)) == (8, 1024)
    # ... or in part of a group, which a block cannot regroup
    assert _tile_reshape((8, 4096), (8, 32, 128), (8, 64)) is None
    assert _tile_reshape((8, 32, 128), (8, 4096), (8, 32, 64)) is None
    assert _tile_reshape((32,), (32, 1), (32,)) == (32, 1)


@pytest.mark.parametrize("keep", [1, 3, 1000])
def test_choose_dims_answers_what_checking_every_size_answers(tmp_path, keep):
    """choose_dims prices a size before its spec check and drops, unchecked, one that cannot
    enter the `keep` cheapest so far, and stops at the first size whose cost floor is above
    them: the answer must be the brute force's (every size instantiated, checked, priced,
    sorted), and no size's floor may exceed its cost."""
    from mlso_cli.codegen.budget import problems
    from mlso_cli.search.select import GRID_Y_Z_LIMIT, floor, sizes

    target = _target(tmp_path, "gated_mlp")
    small, _ = shrink(target)
    recipe = _gated_recipe(dim_classes(small))
    dcf = dim_classes(target)
    want = []
    for dims in sizes(dcf, recipe):
        grid = tuple(dims.grid) + (1,) * (3 - len(dims.grid))
        if grid[1] > GRID_Y_Z_LIMIT or grid[2] > GRID_Y_Z_LIMIT:
            continue
        try:
            kg = instantiate(target, dcf, recipe, dims, (0,))
        except RecipeError:
            continue
        assert floor(target, dcf, recipe, dims) <= program_cost(kg).seconds
        if not problems(kg):
            want.append((program_cost(kg).seconds, dims.grid, dims.loop, kg))
    want.sort(key=lambda w: w[:3])
    got = choose_dims(target, dcf, recipe, (0,), keep=keep)
    assert [(s.cost.seconds, s.dims.grid, s.dims.loop, s.graph) for s in got] == want[:keep]
    assert len(want) > 3  # the case has sizes to drop


@pytest.mark.parametrize("key", sorted(FIXTURES))
def test_the_cost_floor_is_below_every_fixtures_cost(key):
    """cost.graph_def_floor, from a graph-defined kernel's tile reads, grid and loop alone, must
    never exceed the cost of a program with that kernel: sizing stops at the first size whose
    floor is above the cheapest it has (select.choose_dims)."""
    from mlso_cli.search.cost import _input_reads, graph_def_floor

    kg = FIXTURES[key]()
    cost = program_cost(kg).seconds
    kernels = [n for n in kg.nodes() if n.op is Op.GRAPH_DEF]
    assert kernels
    for gd in kernels:
        read = sum(nbytes for _, _, nbytes in _input_reads(gd))
        assert graph_def_floor(read, gd.arg.block_count(), gd.arg.loop) <= cost
