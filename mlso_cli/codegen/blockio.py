"""How a block kernel reads its tiles and writes its outputs: `plan_io`, decided from where the
kernel-level tensors live, before the kernel is printed.

Why apart from blockplan.plan_block: the block plan is a function of the block graph alone (the
spec checker, the block builder and the cost model read it with no lowering at hand). How a
tile is copied (16-byte chunks from a strided view of a stored tensor of its type, or element
by element through the kernel-level emitter), whether a loop tile's chunk offsets are hoisted
out of the loop, whether an in-place PRE tile is a pointer or an indexed accessor, and whether a
PARTIAL save stays scaled with its running maxima beside it depend on the storage of the
GRAPH_DEF's sources and outputs, which the lowering knows when the kernel's turn comes.
`plan_io` reads that storage and returns a frozen `IoPlan`; block.BlockKernel prints both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from mlso_cli.codegen import synthetic
from mlso_cli.codegen.blockplan import BlockPlan
from mlso_cli.codegen.blockstorage import SmemStorage
from mlso_cli.codegen.cfmt import Coords, Names, decompose, numel
from mlso_cli.codegen.emitter import Emitter
from mlso_cli.codegen.frozen import FrozenMap
from mlso_cli.codegen.scale import BufferScale, Scale, Storage, structural
from mlso_cli.codegen.views import Strided, strided
from mlso_cli.ir.graph import PARTIAL
from mlso_cli.ir.node import Node

HOIST_REGS = 48
"""Registers per thread the hoisted chunk offsets of the loop tiles may take (two per chunk)."""


@dataclass(frozen=True)
class InPlaceTile:
    """A PRE tile read in place from global memory (blockanalysis `direct`) as `g<arg>`."""

    pointer: Strided | None
    """The stored tensor's view the pointer walks, or None: an indexed accessor that computes
    each element as a copy would store it (a cast, a computed view)."""
    storage: SmemStorage
    """How passes index the tile: the view's strides (pointer) or contiguous (accessor)."""
    aligned: bool
    """Every block's first element is 16-byte aligned (wide loads from the pointer)."""


@dataclass(frozen=True)
class PartialSave:
    """A PARTIAL output saved as its scaled numbers, with the maxima they are relative to in an
    fp32 side buffer (the combining kernel-level REDUCE_SUM reads both, kernels.emit_reduce)."""

    m_node: Node
    """The block's running maxima (the scale's key)."""
    mbuf: Node
    """The kernel-level side buffer of every block's maxima (synthetic.partial_max)."""
    write_max: bool
    """The first save with this side buffer writes it."""
    scale: BufferScale
    """The scale the output's storage records (the lowering's PROJ storage takes it)."""


@dataclass(frozen=True)
class IoPlan:
    chunked: FrozenMap[Node, Strided]
    """Tiles copied in 16-byte chunks -> the global view copied from (others: element by
    element; in-place tiles: pointers with wide loads)."""
    hoisted: FrozenMap[Node, tuple[int, int]]
    """Loop tiles whose chunk offsets are computed once -> (chunks per thread, elements per
    step), in the order their offsets are printed."""
    in_place: FrozenMap[Node, InPlaceTile]
    partial: FrozenMap[Node, PartialSave]
    """SAVE -> its scaled partial, where one is kept (others are saved exact)."""


def plan_io(
    plan: BlockPlan,
    gd: Node,
    storage: Mapping[Node, Storage],
    outputs: tuple[Storage, ...],
    scratch: Callable[[Node], Storage],
    hoist_regs: int = HOIST_REGS,
) -> IoPlan:
    """The loads and saves of `plan`'s kernel for GRAPH_DEF `gd`, kernel tensors stored as in
    `storage` (read-only) and output i in outputs[i]; `scratch` allocates the side buffers of
    scaled partials (once per buffer); hoisted offsets take at most `hoist_regs` registers."""
    chunked: dict[Node, Strided] = {}
    in_place: dict[Node, InPlaceTile] = {}
    for it in plan.iters:
        st = plan.storage[it]
        if it in plan.direct:
            in_place[it] = _in_place(plan, gd, storage, it)
            st = in_place[it].storage
            if in_place[it].pointer is None:
                continue
        view = _chunked(gd, storage, it, st)
        if view is not None:
            chunked[it] = view
    for it, tile in in_place.items():
        if tile.pointer is not None:
            chunked.pop(it, None)  # read by the passes, not copied
    hoisted = _hoisted(plan, chunked, hoist_regs)
    tiles = dict(plan.storage) | {it: t.storage for it, t in in_place.items()}
    return IoPlan(
        FrozenMap(chunked),
        FrozenMap(hoisted),
        FrozenMap(in_place),
        FrozenMap(_partials(plan, gd, tiles, outputs, scratch)),
    )


def _chunked(
    gd: Node, storage: Mapping[Node, Storage], it: Node, st: SmemStorage
) -> Strided | None:
    """The global view tile `it` is copied from in 16-byte chunks, or None when it is not: a
    strided view of a stored tensor of the tile's type, contiguous and 16-byte aligned along
    the last axis, in global memory and in `st` (where the tile is kept)."""
    view = strided(gd.src[it.arg], storage)
    if view is None or not it.shape:
        return None
    gst = storage[view.leaf]
    vec = 16 // it.dtype.itemsize
    chunked = (
        gst.dtype == it.dtype
        and gst.scale is None
        and view.strides[-1] == 1
        and it.shape[-1] % vec == 0
        and view.base % vec == 0
        and all(s % vec == 0 for s in view.strides[:-1])
        and st.strides[-1] == 1
        and all(s % vec == 0 for s in st.strides[:-1])
    )
    return view if chunked else None


def _in_place(plan: BlockPlan, gd: Node, storage: Mapping[Node, Storage], it: Node) -> InPlaceTile:
    """A strided view of a stored tensor of the tile's type, unscaled, is a pointer to the
    block's first element with the global strides; anything else an indexed accessor."""
    name = f"g{it.arg}"
    view = strided(gd.src[it.arg], storage)
    gst = None if view is None else storage[view.leaf]
    if gst is not None and gst.dtype == it.dtype and gst.scale is None:
        st = SmemStorage(name, it.dtype, it.shape, view.strides)
        return InPlaceTile(view, st, _chunked(gd, storage, it, st) is not None)
    return InPlaceTile(None, plan.storage[it], False)


def _hoisted(
    plan: BlockPlan, chunked: Mapping[Node, Strided], budget: int
) -> dict[Node, tuple[int, int]]:
    """Per-thread chunk offsets of the loop tiles, computed once before the prologue: every
    step's copy of a tile reads the same chunks at the same places but one step further along
    the loop axis, so a step costs one add and one cp.async per chunk instead of each chunk's
    index arithmetic (a division, a remainder and 64-bit address math: about 19 instructions
    per chunk, most of what a loop that streams a weight tile issues for its copies). Only
    tiles whose chunks divide evenly over the block, within `budget` registers in all,
    largest tiles first."""
    out: dict[Node, tuple[int, int]] = {}
    if not plan.loop_iters:
        return out
    bg, nt = plan.bg, plan.threads
    for it in sorted(plan.loop_iters, key=lambda n: -n.numel):
        view = chunked.get(it)
        if view is None:
            continue
        chunks = numel(it.shape) // (16 // it.dtype.itemsize)
        per = chunks // nt
        if chunks % nt or 2 * per > budget:
            continue
        budget -= 2 * per
        im = bg.inputs[it.arg]
        loops = bg.loop > 1 and im.fmap is not None
        out[it] = (per, it.shape[im.fmap] * view.strides[im.fmap] if loops else 0)
    return out


def _partials(
    plan: BlockPlan,
    gd: Node,
    tiles: Mapping[Node, SmemStorage],
    outputs: tuple[Storage, ...],
    scratch: Callable[[Node], Storage],
) -> dict[Node, PartialSave]:
    """The saves kept as scaled partials: a PARTIAL output to fp32 scratch whose value is scaled
    (as the save's emitter computes it) with a simple layout of its maxima."""
    out: dict[Node, PartialSave] = {}
    written: set[Node] = set()
    for save in plan.schedule.saves:
        proj = outputs[save.arg.index]
        partial_dims = [g for g in range(3) if save.arg.omap[g] == PARTIAL]
        tokens = decompose("e", save.shape)
        scale = Emitter(tiles, plan.stab, Names()).value(save.src[0], tokens).scale
        if scale is None or not partial_dims or proj.buffer.kind != "scratch":
            continue
        ps = _partial(plan, gd, tiles, save, scale, tokens, partial_dims, scratch, written)
        if ps is not None:
            written.add(ps.mbuf)
            out[save] = ps
    return out


def _partial(
    plan: BlockPlan,
    gd: Node,
    tiles: Mapping[Node, SmemStorage],
    save: Node,
    scale: Scale,
    tokens: Coords,
    partial_dims: list[int],
    scratch: Callable[[Node], Storage],
    written: set[Node],
) -> PartialSave | None:
    """The side buffer of a scaled partial save and the output's scale; None if the layout of
    its maxima is not simple (one per row of the tile, or one per tile)."""
    bs = structural(scale, tokens)
    m_node = scale.key
    tile = save.shape
    if bs is None or m_node not in tiles or len(m_node.shape) != len(tile):
        return None
    for j, f in enumerate(bs.mfunc):
        if not (f == (j, 1) and m_node.shape[j] == tile[j]) and not (
            f is None and m_node.shape[j] == 1
        ):
            return None
    om, grid = save.arg.omap, plan.bg.grid
    full = tuple(grid[g] for g in partial_dims) + tuple(
        m_node.shape[j] * next((grid[g] for g in range(3) if om[g] == j), 1)
        for j in range(len(tile))
    )
    mbuf = synthetic.partial_max(gd, m_node, om, full)
    scratch(mbuf)
    npart = len(partial_dims)
    mfunc: list[tuple[int, int] | None] = [(p, 1) for p in range(npart)]
    for j, f in enumerate(bs.mfunc):
        split = any(om[g] == j and grid[g] > 1 for g in range(3))
        if f is not None:
            mfunc.append((npart + j, 1))
        elif split:
            mfunc.append((npart + j, tile[j]))
        else:
            mfunc.append(None)
    return PartialSave(
        m_node, mbuf, mbuf not in written, BufferScale(mbuf, scale.degree, tuple(mfunc))
    )
