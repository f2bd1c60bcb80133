"""Tile loads of a block kernel: ITER tiles copied global -> shared with cp.async (16-byte
chunks, offsets hoisted out of the loop where registers allow), the pipeline's stage buffers, and
PRE tiles read in place from global memory.

Why its own module: loads are the only global reads of a block kernel besides in-place tiles;
the pipeline depth and which tiles are direct are decided in blocklayout/blockanalysis, how
each tile is copied (chunks, hoisted offsets, pointer or accessor) in blockio.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mlso_cli.codegen import blockio
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
from mlso_cli.ir.node import Node

if TYPE_CHECKING:
    from mlso_cli.codegen.block import BlockKernel

HOIST_REGS = blockio.HOIST_REGS
"""The register budget block.emit_graph_def gives blockio.plan_io for hoisted chunk offsets
(read at each kernel, so a test may lower it here)."""


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
    """Per-thread chunk offsets of the loop tiles the plan hoists (blockio `hoisted` says
    why and which), computed once before the prologue."""
    for it, (per, _) in bk.io.hoisted.items():
        view = bk.io.chunked[it]
        i = it.arg
        t = chunk_coords(it.shape, 16 // it.dtype.itemsize)
        g = tile_coords(bk, it, None)(t)
        code(f"int go{i}[{per}], so{i}[{per}];", "#pragma unroll")
        with code.block(f"for (int u = 0; u < {per}; ++u)"):
            code(
                f"const int c = threadIdx.x + u * {bk.nt};",
                f"go{i}[u] = {offset(g, view.strides, view.base)};",
                f"so{i}[u] = {offset(t, bk.storage[it].strides)};",
            )


def load_tile(
    bk: BlockKernel, code: Code, it: Node, step: str | None, dst: str, asynchronous: bool
) -> None:
    i = it.arg
    src = bk.gd.src[i]
    tile = it.shape
    st = bk.storage[it]
    ctype = CTYPE[it.dtype]
    gcoords = tile_coords(bk, it, step)
    view = bk.io.chunked.get(it)
    if view is not None:
        gst = bk.ctx.storage[view.leaf]
        bk.uses.read(view.leaf)
        hoisted = bk.io.hoisted.get(it)
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
    """`g<arg>`: a PRE tile read in place (blockanalysis `direct`), as blockio decided: a
    pointer to the block's first element of a stored tensor of the tile's type, with the
    global strides, or an indexed accessor that computes element e as `load_tile` would
    store it (a cast, a computed view)."""
    i, name, ctype = it.arg, f"g{it.arg}", CTYPE[it.dtype]
    gcoords = tile_coords(bk, it, None)
    view = bk.io.in_place[it].pointer
    if view is not None:
        gst = bk.ctx.storage[view.leaf]
        bk.uses.read(view.leaf)
        origin = offset(gcoords(tuple("0" for _ in it.shape)), view.strides, view.base)
        code(f"const {ctype}* const {name} = {gst.ptr} + {origin};")
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
