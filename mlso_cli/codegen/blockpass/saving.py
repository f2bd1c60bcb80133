"""SAVE passes of a block kernel: each output tile written to global memory through its omap,
PARTIAL outputs with their running maxima in an fp32 side buffer for the combining kernel.

Why its own module: the save is the only pass that writes kernel-level buffers. Which outputs
stay scaled partials is decided before printing (blockio.plan_io); this module prints it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlso_cli.codegen.cfmt import (
    CTYPE,
    XYZ,
    Code,
    Coords,
    decompose,
    numel,
    offset,
)
from mlso_cli.ir.graph import PARTIAL
from mlso_cli.ir.node import Node

if TYPE_CHECKING:
    from mlso_cli.codegen.block import BlockKernel


def pass_save(bk: BlockKernel, code: Code, save: Node) -> None:
    """Output `save.arg.index` through its omap: exact values, or (blockio `partial`) the
    scaled partial and, from the first save that uses it, its maxima in the side buffer."""
    om = save.arg.omap
    proj = bk.proj_storage[save.arg.index]
    ctype = CTYPE[proj.dtype]
    tile = save.shape
    partial_dims = [g for g in range(3) if om[g] == PARTIAL]
    em = bk.emitter()
    tokens = decompose("e", tile)
    v = em.value(save.src[0], tokens)
    ps = bk.io.partial.get(save)
    if ps is not None:
        bk.uses.write(bk.ctx.storage[ps.mbuf].buffer)
        val = v.code
    else:
        val = em.materialise(v)
    gcoords = global_coords(bk, tokens, tile, om, partial_dims)
    code(f"// save output {save.arg.index}{' (scaled partial + its max)' if ps else ''}")
    with code.block(f"for (int e = threadIdx.x; e < {numel(tile)}; e += {bk.nt})"):
        code.extend(em.lines)
        code(f"{proj.ptr}[{offset(gcoords, proj.strides)}] = mlso::from_f32<{ctype}>({val});")
    if ps is not None and ps.write_max:
        m_node = ps.m_node
        mt = decompose("e", m_node.shape)
        g2 = global_coords(bk, mt, m_node.shape, om, partial_dims)
        mst = bk.ctx.storage[ps.mbuf]
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
