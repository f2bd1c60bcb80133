"""Dimensions for a recipe: the grid and loop sizes the cost model likes best.

Why a separate step: docs/architecture.md's "structure before dimensions". The enumerator proves a
structure once, at reduced shapes; the sizes only change how fast it runs, so they are chosen
afterwards from divisors of each index, by the cost model, subject to the spec checker (which
holds every block to the arch's shared-memory budget) and CUDA's grid limits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import product

from mlso_cli.codegen.budget import problems
from mlso_cli.ir.graph import KernelGraph
from mlso_cli.search.cost import Cost, graph_def_floor, program_cost
from mlso_cli.search.dims import DimClasses
from mlso_cli.search.space import Dims, Recipe, RecipeError, Signature, instantiate, iters

MAX_BLOCKS = 8 * 132 * 8
"""More blocks than eight waves of eight blocks per SM never pays: each re-reads its tiles."""
GRID_Y_Z_LIMIT = 65535


def divisors(n: int, limit: int = 1 << 30) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _counts(size: int) -> list[int]:
    """Candidate split counts of an index: its divisors, thinned to powers of two and the
    divisors near them, so a 6144-wide index offers 1, 2, 3, 4, 6, 8, 12, 16, ... not 48 values."""
    ds = divisors(size)
    if len(ds) <= 24:
        return ds
    keep = {d for d in ds if d & (d - 1) == 0} | {
        d for d in ds if (d // 3) & (d // 3 - 1) == 0 and d % 3 == 0
    }
    return sorted(keep)


@dataclass(frozen=True)
class Sized:
    dims: Dims
    graph: KernelGraph
    cost: Cost


def sizes(dc: DimClasses, recipe: Recipe) -> Iterator[Dims]:
    return signature_sizes(dc, recipe.signature)


def signature_sizes(dc: DimClasses, sig: Signature) -> Iterator[Dims]:
    """Every grid and loop size `choose_dims` considers for a recipe of signature `sig`."""
    size = {c.id: c.size for c in dc.classes}
    grids = [_counts(size[a.cls]) for a in sig.grid]
    for grid in product(*grids):
        blocks = 1
        for g in grid:
            blocks *= g
        if blocks > MAX_BLOCKS:
            continue
        if sig.loop is None:
            yield Dims(tuple(grid), 1)
            continue
        split = next((g for a, g in zip(sig.grid, grid) if a.cls == sig.loop), 1)
        for loop in _counts(size[sig.loop] // split):
            yield Dims(tuple(grid), loop)


def floor(target: KernelGraph, dc: DimClasses, recipe: Recipe, dims: Dims) -> float:
    """A lower bound on the cost of `recipe` at `dims` in seconds (cost.graph_def_floor), from
    its input tiles alone: nothing is built or laid out. RecipeError where the sizes do not fit
    (as `instantiate` would raise)."""
    tiles, maps, grid = iters(target, dc, recipe.signature, dims, recipe.feeds)
    blocks = grid[0] * grid[1] * grid[2]
    read = 0
    for tile, im in zip(tiles, maps):
        read += tile.numel * tile.dtype.itemsize * (dims.loop if im.fmap is not None else 1)
    return graph_def_floor(read * blocks, blocks, dims.loop)


FLOOR_MARGIN = 1e-9
"""A floor must exceed the cheapest cost by this fraction to rule an instance out: the floor
and the cost are sums of different floating-point terms."""


def choose_dims(
    target: KernelGraph,
    dc: DimClasses,
    recipe: Recipe,
    save_slots: tuple[int, ...],
    arch: str = "sm_90",
    keep: int = 3,
) -> list[Sized]:
    """The `keep` cheapest spec-valid instances of `recipe` on `target`'s full shapes.

    A size is priced before the spec check, and one that cannot enter the `keep` cheapest found
    so far is dropped unchecked: whether it is valid cannot change the answer, and the check
    (the IR's rules and the shared-memory layout of every block) was a fifth of sizing, while
    nearly every instance is valid (6,377 of 6,441 in llama_tiny's final norm + lm_head). A size
    the cost model cannot price is checked first, as before, so an error stays the same error.

    Sizes are visited in the order of their cost floor (`floor`: the tiles' bytes and the loop's
    steps, without building anything), and the visit stops at the first floor above the `keep`
    cheapest found: no later size can enter. Which sizes are kept does not depend on the order
    (the rank is total), so the answer is the one visiting every size gives; building and laying
    out each instance was most of sizing, and the floor rules out about half of them
    (deepseek_v3_tiny's attention and first norm + linear regions: 6,535 of 13,441 built)."""
    order: list[tuple[float, int, Dims]] = []
    for i, dims in enumerate(sizes(dc, recipe)):
        grid = tuple(dims.grid) + (1,) * (3 - len(dims.grid))
        if grid[1] > GRID_Y_Z_LIMIT or grid[2] > GRID_Y_Z_LIMIT:
            continue
        try:
            order.append((floor(target, dc, recipe, dims), i, dims))
        except RecipeError:
            continue  # instantiate would refuse it too
    order.sort(key=lambda t: (t[0], t[1]))
    found: list[Sized] = []  # the `keep` cheapest valid ones so far, in rank order
    for low, _, dims in order:
        if len(found) >= keep > 0 and low * (1 - FLOOR_MARGIN) > found[-1].cost.seconds:
            break  # this floor, and every later one, is above the keep-th cheapest
        try:
            kg = instantiate(target, dc, recipe, dims, save_slots)
        except RecipeError:
            continue
        try:
            cost: Cost | None = program_cost(kg)
        except Exception:  # noqa: BLE001 - priced again after the check, which decides first
            cost = None
        if (
            cost is not None
            and len(found) >= keep > 0
            and _rank(cost, dims) > _rank(found[-1].cost, found[-1].dims)
        ):
            continue
        if problems(kg, arch):
            continue
        found.append(Sized(dims, kg, cost if cost is not None else program_cost(kg)))
        found.sort(key=lambda s: _rank(s.cost, s.dims))
        del found[max(keep, 0) :]
    return found


def _rank(cost: Cost, dims: Dims) -> tuple:
    """Cheapest first; ties by grid, then loop (sizes are distinct, so the order is total)."""
    return (cost.seconds, dims.grid, dims.loop)
