"""Tile loads of a block kernel: ITER tiles copied global -> shared with cp.async (16-byte
chunks, offsets hoisted out of the loop where registers allow), the pipeline's stage buffers, and
PRE tiles read in place from global memory.

Why its own module: loads are the only global reads of a block kernel besides in-place tiles;
the pipeline depth and which tiles are direct are decided in blocklayout/blockanalysis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mlso_cli.codegen.cfmt import (
    CTYPE,
    XYZ,
    Code,
    Coords,
    c_bool,
    decompose,
    numel,
    offset,
)
from mlso_cli.codegen.scale import Storage
from mlso_cli.codegen.views import Strided, strided
from mlso_cli.ir.node import Node

if TYPE_CHECKING:
    from mlso_cli.codegen.block import BlockKernel

HOIST_REGS = 48
"""Registers per thread the hoisted chunk offsets of the loop tiles may take (two per chunk)."""


def chunked_view(bk: BlockKernel, it: Node) -> Strided | None:
    """The global view tile `it` is copied from in 16-byte chunks, or None when it is not: a
    strided view of a stored tensor of the tile's type, contiguous and 16-byte aligned along
    the last axis, in global and shared memory."""
    view = strided(bk.gd.src[it.arg], bk.ctx.storage)
    if view is None or not it.shape:
        return None
    gst = bk.ctx.storage[view.leaf]
    st = bk.storage[it]
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


def tile_coords(bk: BlockKernel, it: Node, step: str | None) -> Callable[[Coords], Coords]:
    """Tile coordinates -> coordinates in the global tensor: plus the block's offset along
    each grid-mapped axis and, for a loop tile at step `step`, the step's along the loop axis."""
    src, im, tile = bk.gd.src[it.arg], bk.bg.inputs[it.arg], it.shape
    base = []
    for d in range(len(tile)):
        terms = [
            f"(int)blockIdx.{XYZ[g]} * {src.shape[d] // bk.bg.grid[g]}"
            for g in range(3)
            if im.imap[g] == d and bk.bg.grid[g] > 1
        ]
        if im.fmap == d and step is not None and bk.bg.loop > 1:
            terms.append(f"({step}) * {tile[d]}")
        base.append(terms)
    return lambda t: tuple(
        " + ".join(([c] if c != "0" else []) + b) or "0" for c, b in zip(t, base)
    )


def chunk_coords(tile: tuple[int, ...], vec: int) -> Coords:
    """Tile coordinates of the first element of 16-byte chunk `c` (row-major chunks)."""
    per_row = tile[-1] // vec
    rows = "c" if per_row == 1 else f"(c / {per_row})"
    return decompose(rows, tile[:-1]) + ("0" if per_row == 1 else f"(c % {per_row}) * {vec}",)


def hoist_offsets(bk: BlockKernel, code: Code) -> None:
    """Per-thread chunk offsets of the loop tiles, computed once before the prologue: every
    step's copy of a tile reads the same chunks at the same places but one step further along
    the loop axis, so a step costs one add and one cp.async per chunk instead of each chunk's
    index arithmetic (a division, a remainder and 64-bit address math: about 19 instructions
    per chunk, most of what a loop that streams a weight tile issues for its copies). Only
    tiles whose chunks divide evenly over the block, within HOIST_REGS registers in all."""
    budget = HOIST_REGS
    for it in sorted(bk.loop_iters, key=lambda n: -n.numel):
        view = chunked_view(bk, it)
        if view is None:
            continue
        vec = 16 // it.dtype.itemsize
        chunks = numel(it.shape) // vec
        per = chunks // bk.nt
        if chunks % bk.nt or 2 * per > budget:
            continue
        budget -= 2 * per
        i, im = it.arg, bk.bg.inputs[it.arg]
        loops = bk.bg.loop > 1 and im.fmap is not None
        step_elems = it.shape[im.fmap] * view.strides[im.fmap] if loops else 0
        t = chunk_coords(it.shape, vec)
        g = tile_coords(bk, it, None)(t)
        code(f"int go{i}[{per}], so{i}[{per}];", "#pragma unroll")
        with code.block(f"for (int u = 0; u < {per}; ++u)"):
            code(
                f"const int c = threadIdx.x + u * {bk.nt};",
                f"go{i}[u] = {offset(g, view.strides, view.base)};",
                f"so{i}[u] = {offset(t, bk.storage[it].strides)};",
            )
        bk.hoisted[i] = (per, step_elems)


def load_tile(
    bk: BlockKernel, code: Code, it: Node, step: str | None, dst: str, asynchronous: bool
) -> None:
    i = it.arg
    src = bk.gd.src[i]
    tile = it.shape
    st = bk.storage[it]
    ctype = CTYPE[it.dtype]
    gcoords = tile_coords(bk, it, step)
    view = chunked_view(bk, it)
    if view is not None:
        gst = bk.ctx.storage[view.leaf]
        bk.uses.read(view.leaf)
        hoisted = bk.hoisted.get(i)
        if hoisted is not None and step is not None:
            per, step_elems = hoisted
            code(
                f"mlso::copy_offsets<{c_bool(asynchronous)}, {per}>({gst.ptr} + ({step}) * "
                f"{step_elems}, {dst}, go{i}, so{i});"
            )
            return
        vec = 16 // it.dtype.itemsize
        t = chunk_coords(tile, vec)
        code(
            f"mlso::copy_chunks<{c_bool(asynchronous)}, {bk.nt}, {numel(tile) // vec}>("
            f"[&](int c) -> const {ctype}* {{ return {gst.ptr} + {offset(gcoords(t), view.strides, view.base)}; }}, "
            f"[&](int c) -> {ctype}* {{ return {dst} + {offset(t, st.strides)}; }});"
        )
        return
    em = bk.kernel_emitter()
    t = decompose("e", tile)
    val = em.plain(src, gcoords(t))
    body = " ".join(em.lines)
    code(
        f"mlso::copy_elements<{bk.nt}, {numel(tile)}>([&](int e) {{ {body} "
        f"{dst}[{offset(t, st.strides)}] = mlso::from_f32<{ctype}>({val}); }});"
    )


def point(bk: BlockKernel, code: Code, it: Node) -> None:
    """`g<arg>`: a PRE tile read in place (blockanalysis `direct`). A strided view of a stored
    tensor of the tile's type is a pointer to the block's first element, with the global
    strides (16-byte loads where the chunked copy could use them); anything else (a cast, a
    computed view) an indexed accessor that computes element e as `_load` would store it."""
    i, name, ctype = it.arg, f"g{it.arg}", CTYPE[it.dtype]
    gcoords = tile_coords(bk, it, None)
    view = strided(bk.gd.src[i], bk.ctx.storage)
    gst = None if view is None else bk.ctx.storage[view.leaf]
    if gst is not None and gst.dtype == it.dtype and gst.scale is None:
        bk.uses.read(view.leaf)
        origin = offset(gcoords(tuple("0" for _ in it.shape)), view.strides, view.base)
        code(f"const {ctype}* const {name} = {gst.ptr} + {origin};")
        bk.storage[it] = Storage(name, it.dtype, it.shape, view.strides)
        if chunked_view(bk, it) is not None:
            bk.direct_aligned[name] = ctype
        return
    em = bk.kernel_emitter()
    t = decompose("e", it.shape)
    val = em.plain(bk.gd.src[i], gcoords(t))
    code(
        f"const auto {name} = mlso::indexed([&](int e) -> float {{ {' '.join(em.lines)} "
        f"return mlso::to_f32(mlso::from_f32<{ctype}>({val})); }});"
    )


def stage_ptr(bk: BlockKernel, i: int, step: str) -> str:
    """The buffer of loop tile i that holds step `step` (a C expression)."""
    if bk.nstage == 2:
        return f"(({step}) & 1 ? s{i}_1 : s{i}_0)"
    k = f"(({step}) % {bk.nstage})"
    expr = f"s{i}_{bk.nstage - 1}"
    for j in range(bk.nstage - 2, -1, -1):
        expr = f"({k} == {j} ? s{i}_{j} : {expr})"
    return expr
