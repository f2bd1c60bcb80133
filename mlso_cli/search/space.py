"""The search space: mapping signatures, and program recipes that replay at any dimensions.

Why recipes: DESIGN.md asks for structure before dimensions. Abstract expressions depend on a
block graph's grid, loop and maps only through *which* index each splits, not by how much, so
the enumerator explores op structure once per `Signature` (which index class each grid dim and
the loop split) at one provisional size, and records what it built as a `Recipe`: ops that refer
to earlier values by number. `instantiate` replays a recipe at the grid and loop sizes the cost
model picks, through the IR builders, so every instance is shape-checked the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from mlso_cli.ir import build as b
from mlso_cli.ir.builder import BlockBuilder, BuildError
from mlso_cli.ir.graph import PARTIAL, InputMap, KernelGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import ACCUMULATORS, BINARY, REDUCE, UNARY, DType, Op
from mlso_cli.ir.spec import tile_shape
from mlso_cli.search.dims import DimClasses

ROW = "row"
"""RESHAPE arg of a recipe step that views a 1-D tile as one row (1, n) for a matmul."""


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
    classes = dc.input_class[feed]
    imap: list[int | None] = []
    for ax in sig.grid:
        imap.append(next((d for d, c in enumerate(classes) if c == ax.cls), None))
    imap += [None] * (3 - len(imap))
    fmap = (
        next((d for d, c in enumerate(classes) if c == sig.loop), None)
        if sig.loop is not None
        else None
    )
    return InputMap(tuple(imap), fmap)


def _shape_arg(arg: Any, srcs: list[Node]) -> Any:
    """A RESHAPE step's target shape: ROW views a 1-D tile as one row."""
    return (1, srcs[0].shape[0]) if arg == ROW else arg


def _apply(op: Op, srcs: list[Node], arg: Any) -> Node:
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
        return b.reshape(srcs[0], _shape_arg(arg, srcs))
    raise RecipeError(f"recipe step {op.value} has no builder")


def _block_step(bb: BlockBuilder, step: Step, values: list[Node]) -> Node:
    """One block step through the builder (a recipe's ROW reshape spelled as its shape)."""
    try:
        srcs = [values[i] for i in step.srcs]
        arg = _shape_arg(step.arg, srcs) if step.op is Op.RESHAPE else step.arg
    except IndexError as exc:
        raise RecipeError(f"{step.op.value}: {exc}") from exc
    return bb.apply(step.op, srcs, arg)


def apply_step(step: Step, values: list[Node]) -> Node:
    """Build one step's node from earlier values (ShapeError becomes RecipeError)."""
    from mlso_cli.ir.shapes import ShapeError

    try:
        return _apply(step.op, [values[i] for i in step.srcs], step.arg)
    except (ShapeError, AssertionError, IndexError) as exc:
        raise RecipeError(f"{step.op.value}: {exc}") from exc


def iters(
    target: KernelGraph, dc: DimClasses, sig: Signature, dims: Dims, feeds: tuple[int, ...]
) -> tuple[list[Node], list[InputMap], tuple[int, int, int]]:
    grid = tuple(dims.grid) + (1,) * (3 - len(dims.grid))
    tiles, maps = [], []
    for i, f in enumerate(feeds):
        src = target.inputs[f]
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
            grid, dims.loop, maps, [target.inputs[f] for f in recipe.feeds], budget=False
        )
        values = [bb.iter(i) for i in range(len(recipe.feeds))]
        for st in recipe.block_steps:
            values.append(_block_step(bb, st, values))
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
