"""The architecture check: a μGraph is valid for an arch when it holds the IR's rules
(mlso_cli.ir.spec) and code generation can lay each block graph out within the arch's shared
memory.

Why here and not in ir/: the byte count is code generation's (blocklayout.smem_layout, the exact
figure the kernels allocate: padding, staging copies, P buffers, pipeline stages), and ir/ imports
nothing from codegen. This module runs the IR checker and adds, to each block graph that holds the
IR's rules, the two problems only code generation can see: a construct the layout cannot plan
(not valid for any arch) and a layout over the arch's budget. `generate`, the search's sized
checks and the budgeted block builder (codegen.blockbuilder) all ask here.
"""

from __future__ import annotations

from mlso_cli.codegen.arch import SMEM_BUDGET
from mlso_cli.codegen.blocklayout import smem_layout
from mlso_cli.codegen.errors import CodegenError
from mlso_cli.ir import spec
from mlso_cli.ir.graph import BlockGraph, KernelGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.spec import SpecError

__all__ = ["SMEM_BUDGET", "SpecError", "block_problems", "block_smem", "check", "problems"]


def check(kg: KernelGraph, arch: str = "sm_90") -> KernelGraph:
    """Raise SpecError listing every problem on `arch`; return the graph when it is valid."""
    probs = problems(kg, arch)
    if probs:
        raise SpecError(probs)
    return kg


def problems(kg: KernelGraph, arch: str = "sm_90", *, budget: bool = True) -> list[str]:
    """Every way `kg` breaks the IR's rules or does not fit `arch`. `budget=False` leaves out the
    shared-memory budget only (the layout must still be plannable): the search checks structures
    at reduced shapes and provisional sizes, where a tile's bytes say nothing about the full-size
    program."""
    if arch not in SMEM_BUDGET:
        return [f"unknown arch {arch}; known: {sorted(SMEM_BUDGET)}"]
    return spec.problems(kg, extra=_layout_check(arch, budget))


def block_problems(
    bg: BlockGraph,
    srcs: tuple[Node, ...],
    arch: str = "sm_90",
    checked: frozenset[Node] | set[Node] = frozenset(),
    *,
    budget: bool = True,
) -> list[str]:
    """spec.block_problems plus the layout and (with `budget`) the arch's budget."""
    return spec.block_problems(bg, srcs, checked, extra=_layout_check(arch, budget))


def block_smem(bg: BlockGraph, srcs: tuple[Node, ...] = (), arch: str = "sm_90") -> int:
    """Bytes of shared memory one block of `bg` needs on `arch`: the figure this check holds to
    the arch's budget, and the one the block builder tracks as it grows a graph. `srcs` is kept
    for callers; the layout depends on the tiles, which the block graph holds. CodegenError when
    the layout cannot be planned."""
    return smem_layout(bg, arch).smem


def layout_problems(bg: BlockGraph, arch: str, budget: bool = True) -> list[str]:
    """The layout's problems of one block graph that holds the IR's rules."""
    try:
        smem = block_smem(bg, (), arch)
    except CodegenError as exc:  # a construct the layout cannot plan: not valid for any arch
        return [f"code generation cannot lay this block graph out: {exc}"]
    limit = SMEM_BUDGET[arch]
    if budget and smem > limit:
        return [f"block graph needs {smem} bytes of shared memory; {arch} has {limit}"]
    return []


def _layout_check(arch: str, budget: bool) -> spec.BlockExtra:
    return lambda bg, srcs: layout_problems(bg, arch, budget)
