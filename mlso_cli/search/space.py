"""The search space: mapping signatures, and program recipes that replay at any dimensions.

Why recipes: DESIGN.md asks for structure before dimensions. Abstract expressions depend on a
block graph's grid, loop and maps only through *which* index each splits, not by how much, so
the enumerator explores op structure once per `Signature` (which index class each grid dim and
the loop split) at one provisional size, and records what it built as a `Recipe`: ops that refer
to earlier values by number. `instantiate` replays a recipe at the grid and loop sizes the cost
model picks, through the IR builders, so every instance is shape-checked the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from mlso_cli.codegen.blockbuilder import BlockBuilder, BuildError
from mlso_cli.ir import build as b
from mlso_cli.ir.graph import PARTIAL, InputMap, KernelGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import ACCUMULATORS, BINARY, ELEMENTWISE, REDUCE, UNARY, DType, Op
from mlso_cli.ir.shapes import ShapeError
from mlso_cli.ir.spec import tile_shape
from mlso_cli.search.dims import DimClasses, reshape_groups

ROW = "row"
"""RESHAPE arg of a recipe step that views a 1-D tile as one row (1, n) for a matmul."""

WHOLE = 1 << 16
"""Added to a kernel input's number in `Recipe.feeds`: a second ITER of that input, read whole
along the index the loop walks (once per block, in the PRE phase) rather than a slice per step.

Why: a statistic of a small input over the loop's index (LayerNorm's mean and variance of the
row the loop walks) can then be computed once before the loop and applied to every step's slice,
instead of being expanded into accumulators of its own. Which inputs get one: `whole_feeds`."""

WHOLE_CLASS = 1 << 20
"""Added to the loop's index class on the dims of a whole feed: the same index, read whole, so
index typing keeps it apart from the loop's slices (they never meet elementwise or in a
contraction) and a sum over it is a sum within the block, not over a split index."""


def feed_input(feed: int) -> int:
    """The kernel input a feed reads."""
    return feed % WHOLE


def is_whole(feed: int) -> bool:
    return feed >= WHOLE


@dataclass(frozen=True)
class Regroup:
    """RESHAPE arg of a recipe step: the target's reshape number `index` (`reshape_nodes`),
    applied to whatever tile its source has at the sizes being instantiated (`tile_reshape`).
    Why not a shape: a recipe is enumerated at provisional sizes and replayed at others, where
    the regrouped tile has another size (GroupNorm's 16 groups per step become 2)."""

    index: int


def reshape_nodes(target: KernelGraph) -> list[Node]:
    """The target's RESHAPE nodes in the replay's (topological) order: what Regroup numbers."""
    from mlso_cli.ir.node import toposort

    return [n for n in toposort(list(target.outputs)) if n.op is Op.RESHAPE]


@dataclass(frozen=True)
class Axis:
    """One grid dim: the index class it splits, and whether blocks hold partial sums of it."""

    cls: int
    partial: bool


@dataclass(frozen=True)
class Signature:
    """Which index each grid dim splits, and which index the for-loop walks (None: no loop)."""

    grid: tuple[Axis, ...]
    loop: int | None
    whole: bool = False
    """Also feed whole the inputs `whole_feeds` names. A variant of its own, with its own share
    of states, so that the plain signature explores exactly as it would without whole feeds (on
    rmsnorm_linear at batch 8 the extra tiles in one pool spent the share that had found a 12%
    cheaper program)."""

    def partial(self) -> Axis | None:
        return next((a for a in self.grid if a.partial), None)


def signatures(dc: DimClasses, max_grid: int = 3) -> list[Signature]:
    """Every signature worth enumerating, simplest first.

    Grid dims split spatial indices (blocks side by side in the outputs) or one summed index no
    output carries (partial results, combined by a later kernel). The loop walks a summed index,
    possibly the partial one too (each block then loops over its chunk)."""
    split = [c for c in dc.splittable() if c.inputs]
    spatial = [c.id for c in split if c.spatial]
    summed = [c.id for c in split if c.reduced and not c.spatial]
    loops: list[int | None] = [None] + summed
    out: list[Signature] = []
    from itertools import combinations

    for k in range(0, max_grid + 1):
        for sp in combinations(spatial, k):
            for loop in loops:
                out.append(Signature(tuple(Axis(c, False) for c in sp), loop))
                if k < max_grid:
                    for p in summed:
                        out.append(
                            Signature(tuple(Axis(c, False) for c in sp) + (Axis(p, True),), loop)
                        )
    out.sort(key=lambda s: (s.partial() is not None, len(s.grid), s.loop is None))
    return out


@dataclass(frozen=True)
class Step:
    """One op of a recipe: `srcs` are value numbers (block: ITERs first; kernel: inputs first)."""

    op: Op
    srcs: tuple[int, ...]
    arg: Any = None


@dataclass(frozen=True)
class Recipe:
    """A candidate program: one graph-defined kernel plus kernel-level steps after it.

    Block values 0..len(feeds)-1 are the ITER tiles of kernel inputs `feeds`; `saves` name the
    block values written out (in order; each becomes a PROJ). Kernel values are the graph inputs,
    then the PROJs, then `kernel_steps`; `outputs` name the kernel values returned."""

    signature: Signature
    feeds: tuple[int, ...]
    block_steps: tuple[Step, ...]
    saves: tuple[int, ...]
    kernel_steps: tuple[Step, ...]
    outputs: tuple[int, ...]


@dataclass(frozen=True)
class Dims:
    """Sizes for a signature: blocks per grid dim (aligned with signature.grid) and loop steps."""

    grid: tuple[int, ...]
    loop: int


class RecipeError(ValueError):
    """A recipe does not instantiate at these dimensions (a shape or divisibility conflict)."""


def input_map(dc: DimClasses, sig: Signature, feed: int) -> InputMap:
    classes = dc.input_class[feed_input(feed)]
    imap: list[int | None] = []
    for ax in sig.grid:
        if is_whole(feed) and ax.cls == sig.loop:
            # a whole feed is the whole index, not the chunk a partial grid dim gives a block
            imap.append(None)
            continue
        imap.append(next((d for d, c in enumerate(classes) if c == ax.cls), None))
    imap += [None] * (3 - len(imap))
    fmap = (
        next((d for d, c in enumerate(classes) if c == sig.loop), None)
        if sig.loop is not None and not is_whole(feed)
        else None
    )
    return InputMap(tuple(imap), fmap)


def feed_classes(dc: DimClasses, sig: Signature, feed: int) -> tuple[int | None, ...]:
    """Index class per dim of a feed's tile (a whole feed's loop index marked WHOLE_CLASS)."""
    cs = dc.input_class[feed_input(feed)]
    if not is_whole(feed):
        return cs
    return tuple(c + WHOLE_CLASS if c is not None and c == sig.loop else c for c in cs)


_PASS_THROUGH = frozenset(ELEMENTWISE) | {Op.RESHAPE, Op.TRANSPOSE, Op.BROADCAST}


def whole_feeds(target: KernelGraph, dc: DimClasses, sig: Signature) -> tuple[int, ...]:
    """The whole feeds worth offering for this signature: inputs that the target reduces over
    the loop's index (a REDUCE, not a contraction) through elementwise ops and views only.

    Why so narrow: a whole feed costs the enumeration a tile of its own, and only such a
    reduction can use one (a statistic computed once per block, then applied to each step's
    slice). An input that reaches the loop's index only through a matmul (attention's keys) is
    streamed, never held whole. Under split-K (a partial grid dim over the loop's index) the
    whole feed is still the whole index (`input_map` gives it no block chunk): every block then
    computes the row's statistics itself, and its partial sum is over normalised values."""
    loop = sig.loop
    if loop is None or any(ax.cls == loop and not ax.partial for ax in sig.grid):
        return ()
    index = {n: i for i, n in enumerate(target.inputs)}
    found: set[int] = set()
    for n in target.nodes():
        if n.op not in REDUCE:
            continue
        cs = dc.node_class.get(n.src[0])
        if cs is None or cs[n.arg] != loop:
            continue
        stack, seen = [n.src[0]], set()
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            if x in index:
                found.add(index[x])
            elif x.op in _PASS_THROUGH:
                stack.extend(x.src)
    return tuple(sorted(f + WHOLE for f in found if loop in dc.input_class[f]))


def feeds_of(target: KernelGraph, dc: DimClasses, sig: Signature) -> tuple[int, ...]:
    """Every feed a signature's enumeration starts from: each input's tile, then (for a `whole`
    variant) the whole feeds."""
    extra = whole_feeds(target, dc, sig) if sig.whole else ()
    return tuple(range(len(target.inputs))) + extra


def with_whole_variants(
    target: KernelGraph, dc: DimClasses, sigs: list[Signature]
) -> list[Signature]:
    """`sigs`, then a whole-feed variant of each that has whole feeds to offer."""
    return sigs + [
        replace(s, whole=True) for s in sigs if not s.whole and whole_feeds(target, dc, s)
    ]


def _shape_arg(arg: Any, srcs: list[Node], target: KernelGraph | None = None) -> Any:
    """A RESHAPE step's target shape: ROW views a 1-D tile as one row; a Regroup is the target's
    reshape applied to this tile."""
    if arg == ROW:
        return (1, srcs[0].shape[0])
    if isinstance(arg, Regroup):
        if target is None:
            raise RecipeError("a regrouping reshape needs its target")
        n = reshape_nodes(target)[arg.index]
        shape = tile_reshape(n.src[0].shape, n.shape, srcs[0].shape)
        if shape is None:
            raise RecipeError(
                f"reshape {n.src[0].shape} -> {n.shape} does not fit tile {srcs[0].shape}"
            )
        return shape
    return arg


def tile_reshape(
    full_src: tuple[int, ...], full_dst: tuple[int, ...], tile_src: tuple[int, ...]
) -> tuple[int, ...] | None:
    """The target's reshape applied to one tile, or None where a block cannot regroup what it
    holds.

    Dims are paired by running products, as search/dims.py pairs them. A dim the reshape keeps
    keeps its tile size. A dim split into several (4096 -> 32 x 128) may be tiled in whole units
    of the inner ones: a tile of 1024 becomes 8 x 128 (GroupNorm's groups, when a loop step
    covers whole groups). Dims merged into one must be whole in the tile except the outermost,
    and a many-to-many regrouping must be whole."""
    out: list[int] = []
    a, b = full_src, full_dst
    for gi, gj, met in reshape_groups(a, b):
        if not met:
            return None
        tiles = [tile_src[d] for d in gi]
        whole = [a[d] for d in gi]
        big_i = [k for k, d in enumerate(gi) if a[d] > 1]
        big_j = [k for k, d in enumerate(gj) if b[d] > 1]
        if tiles == whole:
            out.extend(b[d] for d in gj)
        elif len(big_i) == 1 and big_j:
            # one dim -> several: whole units of the inner ones
            inner = math.prod(b[d] for d in gj[big_j[0] + 1 :])
            t = tiles[big_i[0]]
            if t % inner:
                return None
            out.extend(
                1 if k < big_j[0] else (t // inner if k == big_j[0] else b[d])
                for k, d in enumerate(gj)
            )
        elif len(big_j) == 1 and big_i:
            # several dims -> one: all but the outermost whole
            if any(tiles[k] != whole[k] for k in big_i[1:]):
                return None
            out.extend(math.prod(tiles) if k == big_j[0] else 1 for k in range(len(gj)))
        else:
            return None
    return tuple(out)


def _apply(op: Op, srcs: list[Node], arg: Any, target: KernelGraph | None = None) -> Node:
    if op is Op.CONST:
        return b.const(arg)
    if op in UNARY:
        return b.cast(srcs[0], arg) if op is Op.CAST else b.unary(op, srcs[0])
    if op in BINARY:
        return b.binary(op, srcs[0], srcs[1])
    if op is Op.MATMUL:
        return b.matmul(srcs[0], srcs[1])
    if op in REDUCE:
        return b.reduce(op, srcs[0], arg)
    if op in ACCUMULATORS:
        return b.accumulate(op, *srcs)
    if op is Op.TRANSPOSE:
        return b.transpose(srcs[0], arg)
    if op is Op.RESHAPE:
        return b.reshape(srcs[0], _shape_arg(arg, srcs, target))
    if op is Op.BROADCAST:
        return b.broadcast_to(srcs[0], srcs[1].shape)
    raise RecipeError(f"recipe step {op.value} has no builder")


def _block_step(
    bb: BlockBuilder, step: Step, values: list[Node], target: KernelGraph | None = None
) -> Node:
    """One block step through the builder (a recipe's ROW or Regroup reshape as its shape)."""
    try:
        srcs = [values[i] for i in step.srcs]
        arg = _shape_arg(step.arg, srcs, target) if step.op is Op.RESHAPE else step.arg
        if step.op is Op.BROADCAST:  # (value, shape donor): the donor's shape at these dims
            srcs, arg = srcs[:1], srcs[1].shape
    except IndexError as exc:
        raise RecipeError(f"{step.op.value}: {exc}") from exc
    return bb.apply(step.op, srcs, arg)


def apply_step(step: Step, values: list[Node], target: KernelGraph | None = None) -> Node:
    """Build one step's node from earlier values (ShapeError becomes RecipeError); `target`
    resolves Regroup reshapes."""
    try:
        return _apply(step.op, [values[i] for i in step.srcs], step.arg, target)
    except (ShapeError, AssertionError, IndexError) as exc:
        raise RecipeError(f"{step.op.value}: {exc}") from exc


def iters(
    target: KernelGraph, dc: DimClasses, sig: Signature, dims: Dims, feeds: tuple[int, ...]
) -> tuple[list[Node], list[InputMap], tuple[int, int, int]]:
    grid = tuple(dims.grid) + (1,) * (3 - len(dims.grid))
    tiles, maps = [], []
    for i, f in enumerate(feeds):
        src = target.inputs[feed_input(f)]
        im = input_map(dc, sig, f)
        for g, d in zip(grid, im.imap):
            if d is not None and src.shape[d] % g:
                raise RecipeError(f"input {f} dim {d} ({src.shape[d]}) not divisible by {g}")
        if im.fmap is not None:
            per = src.shape[im.fmap] // next((g for g, d in zip(grid, im.imap) if d == im.fmap), 1)
            if per % dims.loop:
                raise RecipeError(
                    f"input {f} dim {im.fmap} chunk {per} not divisible by loop {dims.loop}"
                )
        tile = tile_shape(src.shape, im, grid, dims.loop)
        tiles.append(b.iter_(i, tile, src.dtype, im.fmap is not None))
        maps.append(im)
    return tiles, maps, grid  # type: ignore[return-value]


def save_omap(dc: DimClasses, sig: Signature, out: int) -> tuple[int | None, ...]:
    classes = dc.output_class[out]
    omap: list[int | None] = []
    for ax in sig.grid:
        omap.append(
            PARTIAL if ax.partial else next((d for d, c in enumerate(classes) if c == ax.cls), None)
        )
    return tuple(omap) + (None,) * (3 - len(omap))


def instantiate(
    target: KernelGraph, dc: DimClasses, recipe: Recipe, dims: Dims, save_slots: tuple[int, ...]
) -> KernelGraph:
    """Replay `recipe` at `dims`. `save_slots[i]` is the target output whose layout save i
    takes (its omap); partial saves are fp32, others take that output's dtype. The block graph
    is grown by ir.builder.BlockBuilder, which checks every step against the spec's rules as it
    is added; a step it refuses, or a finished block graph the spec rejects, is a RecipeError."""
    sig = recipe.signature
    _, maps, grid = iters(target, dc, sig, dims, recipe.feeds)  # RecipeError on a misfit size
    try:
        bb = BlockBuilder(
            grid,
            dims.loop,
            maps,
            [target.inputs[feed_input(f)] for f in recipe.feeds],
            budget=False,
        )
        values = [bb.iter(i) for i in range(len(recipe.feeds))]
        for st in recipe.block_steps:
            values.append(_block_step(bb, st, values, target))
        for v, slot in zip(recipe.saves, save_slots):
            dt = DType.F32 if sig.partial() is not None else target.outputs[slot].dtype
            bb.save(values[v], save_omap(dc, sig, slot), dt)
        projs = bb.launch()
    except BuildError as exc:
        raise RecipeError(str(exc)) from exc
    kv: list[Node] = list(target.inputs) + projs
    for st in recipe.kernel_steps:
        kv.append(apply_step(st, kv))
    outs = []
    for j, v in enumerate(recipe.outputs):
        node = kv[v]
        want = target.outputs[j]
        if node.dtype != want.dtype:  # cast before the view: the cast fuses into its producer
            node = b.cast(node, want.dtype)
        if node.shape != want.shape:
            try:
                node = b.reshape(node, want.shape)
            except Exception as exc:
                raise RecipeError(f"output {j}: {node.shape} vs {want.shape}") from exc
        outs.append(node)
    return b.kernel_graph(
        list(target.inputs), outs, list(target.input_names), list(target.output_names)
    )


def const_step(value: Fraction) -> Step:
    return Step(Op.CONST, (), value)
