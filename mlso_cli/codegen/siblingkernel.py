"""One launch for sibling elementwise kernels (horizontal fusion): decided, then printed.

Why: siblings.py decides which consecutive, independent elementwise roots share a launch; this
module lays their grids end to end and prints one kernel. Block b runs the part whose block range
holds b, as that part's own kernel would have run it with b less the range's start: every part
keeps its own elementwise plan (team, grid), its own grid-stride loop and its own names, in a
branch of its own. The branch depends on blockIdx.x only, so every thread of a block takes the
same one (no divergence); the parts have the same block size (kernels.ELEMENTWISE_THREADS) and no
shared memory, so the launch's shape is theirs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlso_cli.codegen.cfmt import Code
from mlso_cli.codegen.kernels import (
    Blocks,
    ElementwiseKernelPlan,
    elementwise_body,
    plan_elementwise,
)
from mlso_cli.codegen.program import Kernel
from mlso_cli.codegen.scale import BufferScale, Storage
from mlso_cli.codegen.site import KernelSite, site
from mlso_cli.ir.node import Node

if TYPE_CHECKING:
    from mlso_cli.codegen.lower import Lowering


@dataclass(frozen=True)
class SiblingKernelPlan:
    """The parts' own plans and where each one's blocks start in the shared grid."""

    parts: tuple[ElementwiseKernelPlan, ...]
    starts: tuple[int, ...]
    """First block of each part; part k runs blocks starts[k] .. starts[k] + its grid - 1."""
    threads: int
    grid: tuple[int, int, int]
    what: str


def plan_siblings(storage: Mapping[Node, Storage], roots: tuple[Node, ...]) -> SiblingKernelPlan:
    """The launch of `roots` (a siblings.launch_groups group), from where kernel tensors live."""
    parts = tuple(plan_elementwise(storage, r) for r in roots)
    (threads,) = {p.threads for p in parts}
    starts, total = [], 0
    for p in parts:
        assert p.grid[1:] == (1, 1), "elementwise grids are one-dimensional"
        starts.append(total)
        total += p.grid[0]
    what = f"{len(parts)} independent kernels in one launch: " + "; ".join(
        f"{p.what} (blocks {s}-{s + p.grid[0] - 1})" for p, s in zip(parts, starts, strict=True)
    )
    return SiblingKernelPlan(parts, tuple(starts), threads, (total, 1, 1), what)


def print_siblings(
    plan: SiblingKernelPlan, site: KernelSite
) -> tuple[Kernel, list[BufferScale | None]]:
    """The kernel, and the scale each part's stored value keeps (kernels.elementwise_body)."""
    bodies, scales = [], []
    for p, start in zip(plan.parts, plan.starts, strict=True):
        index = f"(blockIdx.x - {start})" if start else "blockIdx.x"
        body, scale = elementwise_body(p, site, Blocks(index, str(p.grid[0])))
        bodies.append(body)
        scales.append(scale)
    code = Code()
    last = len(bodies) - 1
    with code.block(site.uses.signature(site.name, plan.threads)):
        for k, (p, start, body) in enumerate(zip(plan.parts, plan.starts, bodies, strict=True)):
            head = f"if (blockIdx.x < {start + p.grid[0]}u)"
            if k:
                head = "else" if k == last else f"else {head}"
            with code.block(head):
                code.extend(body)
    kernel = Kernel(
        site.name, code.text(), plan.grid, (plan.threads, 1, 1), 0, site.uses.params(), plan.what
    )
    return kernel, scales


def emit_siblings(lw: Lowering, roots: tuple[Node, ...]) -> Kernel:
    """One kernel computing every root of a sibling launch; each part's stored scale is recorded
    in its storage, as kernels.emit_elementwise does for a kernel of its own."""
    plan = plan_siblings(lw.storage, roots)
    kernel, scales = print_siblings(plan, site(lw))
    for root, scale in zip(roots, scales, strict=True):
        if scale is not None:
            lw.storage[root].scale = scale
    return kernel
