"""SAVE passes of a block kernel: each output tile written to global memory through its omap,
PARTIAL outputs with their running maxima in an fp32 side buffer for the combining kernel.

Why its own module: the save is the only pass that writes kernel-level buffers, and the only
one that knows what the kernel level does with scaled partials (kernels.emit_reduce).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlso_cli.codegen import synthetic
from mlso_cli.codegen.cfmt import (
    CTYPE,
    XYZ,
    Code,
    Coords,
    decompose,
    numel,
    offset,
)
from mlso_cli.codegen.scale import BufferScale, structural
from mlso_cli.ir.graph import PARTIAL
from mlso_cli.ir.node import Node

if TYPE_CHECKING:
    from mlso_cli.codegen.block import BlockKernel


def pass_save(bk: BlockKernel, code: Code, save: Node, written: set[Node]) -> None:
    om = save.arg.omap
    proj = bk.proj_storage[save.arg.index]
    ctype = CTYPE[proj.dtype]
    tile = save.shape
    partial_dims = [g for g in range(3) if om[g] == PARTIAL]
    em = bk.emitter()
    tokens = decompose("e", tile)
    v = em.value(save.src[0], tokens)
    val = None
    mwrite = None
    if v.scale is not None and partial_dims and proj.buffer.kind == "scratch":
        mwrite = partial_max(bk, save, v.scale, tokens, partial_dims)
        if mwrite is not None:
            val = v.code
    if val is None:
        val = em.materialise(v)
    gcoords = global_coords(bk, tokens, tile, om, partial_dims)
    code(f"// save output {save.arg.index}{' (scaled partial + its max)' if mwrite else ''}")
    with code.block(f"for (int e = threadIdx.x; e < {numel(tile)}; e += {bk.nt})"):
        code.extend(em.lines)
        code(f"{proj.ptr}[{offset(gcoords, proj.strides)}] = mlso::from_f32<{ctype}>({val});")
    if mwrite is not None:
        m_node, mbuf = mwrite
        if mbuf not in written:
            written.add(mbuf)
            mt = decompose("e", m_node.shape)
            g2 = global_coords(bk, mt, m_node.shape, om, partial_dims)
            mst = bk.ctx.storage[mbuf]
            with code.block(f"for (int e = threadIdx.x; e < {m_node.numel}; e += {bk.nt})"):
                code(f"{mst.ptr}[{offset(g2, mst.strides)}] = {bk.storage[m_node].ptr}[e];")


def global_coords(
    bk: BlockKernel, tokens: Coords, tile: tuple[int, ...], om, partial_dims: list[int]
) -> Coords:
    out = [f"(int)blockIdx.{XYZ[g]}" for g in partial_dims]
    for d, t in enumerate(tokens):
        terms = [t] if t != "0" else []
        for g in range(3):
            if om[g] == d and bk.bg.grid[g] > 1:
                terms.append(f"(int)blockIdx.{XYZ[g]} * {tile[d]}")
        out.append(" + ".join(terms) if terms else "0")
    return tuple(out)


def partial_max(bk: BlockKernel, save: Node, scale, tokens: Coords, partial_dims: list[int]):
    """Register the max side buffer of a scaled partial save; None if its layout is not simple."""
    bs = structural(scale, tokens)
    m_node = scale.key
    tile = save.shape
    if bs is None or m_node not in bk.storage or len(m_node.shape) != len(tile):
        return None
    for j, f in enumerate(bs.mfunc):
        if not (f == (j, 1) and m_node.shape[j] == tile[j]) and not (
            f is None and m_node.shape[j] == 1
        ):
            return None
    om = save.arg.omap
    grid = bk.bg.grid
    full = tuple(grid[g] for g in partial_dims) + tuple(
        m_node.shape[j] * next((grid[g] for g in range(3) if om[g] == j), 1)
        for j in range(len(tile))
    )
    mbuf = synthetic.partial_max(bk.gd, m_node, om, full)
    mst = bk.ctx.scratch(mbuf)
    bk.uses.write(mst.buffer)
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
    bk.proj_storage[save.arg.index].scale = BufferScale(mbuf, scale.degree, tuple(mfunc))
    return m_node, mbuf
