"""`plan_block(bg, arch)`: every decision about one graph-defined kernel, as one frozen value.

Why: a block kernel used to be printed by the last class of a five-level tower (analysis ->
storage -> matmul planning -> layout -> kernel), so the printer could read, and change, any
planning state at any time. Now the tower ends at blocklayout.BlockLayout, which decides; this
module freezes what it decided into a `BlockPlan` (the path chosen, threads and warps, the
pipeline depth, padding, tile shapes and how each tile is loaded, every buffer, each matmul's
operands and staging copies, the online-softmax groups and the register path's parameters), and
block.BlockKernel prints a BlockPlan without seeing the planner.

The containers inside are read-only views (MappingProxyType, tuples, frozensets); the records
they hold (Storage, MatmulPlan, Group) are the planner's own objects, which printing only reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from mlso_cli.codegen.blockanalysis import Group, Moments
from mlso_cli.codegen.blocklayout import CODEGEN_ARCH, BlockLayout, SmemLayout
from mlso_cli.codegen.blockmatmul import MatmulPlan, Operand
from mlso_cli.codegen.scale import Storage
from mlso_cli.codegen.scoreform import ScoreForm
from mlso_cli.ir.graph import BlockGraph
from mlso_cli.ir.node import Node


@dataclass(frozen=True)
class RegisterPath:
    """The online softmax of one group run in registers (mlso::FlashRows)."""

    group: Group
    form: ScoreForm
    """The score's form: scaled matmul terms, a per-key factor (scoreform.py)."""
    strips: int
    """16-row warp strips of the scores."""
    split: int
    """Warps per strip, splitting the value columns (blockanalysis.column_split)."""
    width: int
    """Value columns one warp holds."""
    ksplit: int
    """Warps per strip that also split the score's depth (partial scores meet in `red`)."""
    v: tuple[Operand, bool]
    """The weighted operand and whether it is k-major."""
    f: Node | None
    """A per-key factor of the weighted operand, put on P's columns (x * f read as x)."""
    fbuf: str | None
    kbuf: str | None
    """Shared-memory buffer of the scores' per-key factor."""
    red: str | None
    """Shared-memory buffer where split warps add partial scores."""
    alias: Node | None
    """The weighted sum kept in the loop tiles' memory (flushed after the loop)."""


@dataclass(frozen=True)
class BlockPlan:
    """What one graph-defined kernel computes and where, decided before any code is printed."""

    bg: BlockGraph
    """The normalised block graph (normalise.normalise)."""
    arch: str
    layout: SmemLayout
    """Bytes, padding, pipeline depth, threads, buffers (blocklayout.smem_layout's figure)."""
    warps: int
    order: tuple[Node, ...]
    """Block nodes in dependency order (the passes' order)."""
    iters: tuple[Node, ...]
    loop_iters: tuple[Node, ...]
    direct: frozenset[Node]
    """PRE tiles read in place from global memory."""
    stab: Mapping[Node, Node]
    storage: Mapping[Node, Storage]
    plans: Mapping[Node, MatmulPlan]
    """Each matmul's operands, staging copies and kind."""
    groups: Mapping[Node, Group]
    group_of: Mapping[Node, Group]
    rows_aligned: frozenset[Node]
    """Scores of the groups whose weighted sums are row-aligned with them."""
    fused: Mapping[Node, Node]
    fused_reduce: Mapping[Node, Node]
    moments: Mapping[Node, Moments]
    moment_firsts: frozenset[Node]
    register: RegisterPath | None
    names: tuple[tuple[str, int], ...]
    """Identifiers the plan took (prefix, count): printing takes fresh ones after them."""

    @property
    def path(self) -> str:
        """The path chosen for the online softmax: "register" or "shared"."""
        return "register" if self.register is not None else "shared"

    @property
    def threads(self) -> int:
        return self.layout.threads

    @property
    def stages(self) -> int:
        return self.layout.stages


def plan_block(bg: BlockGraph, arch: str = CODEGEN_ARCH) -> BlockPlan:
    """The plan of `bg` for `arch` (computed afresh: printing must start from unshared names)."""
    lay = BlockLayout(bg)
    layout = lay.plan(arch)
    return _freeze(lay, layout, arch)


def _freeze(lay: BlockLayout, layout: SmemLayout, arch: str) -> BlockPlan:
    reg = None
    if lay.flash is not None:
        reg = RegisterPath(
            lay.flash,
            lay.flash_form,
            lay.flash_strips,
            lay.flash_split,
            lay.flash_width,
            lay.flash_ksplit,
            lay.flash_v,
            lay.flash_f,
            getattr(lay, "flash_fbuf", None) if lay.flash_f is not None else None,
            lay.flash_kbuf,
            lay.flash_red,
            lay.flash_alias,
        )
    return BlockPlan(
        bg=lay.bg,
        arch=arch,
        layout=layout,
        warps=lay.nw,
        order=tuple(lay.order),
        iters=tuple(lay.iters),
        loop_iters=tuple(lay.loop_iters),
        direct=frozenset(lay.direct),
        stab=MappingProxyType(dict(lay.stab)),
        storage=MappingProxyType(dict(lay.storage)),
        plans=MappingProxyType(dict(lay.plans)),
        groups=MappingProxyType(dict(lay.groups)),
        group_of=MappingProxyType(dict(lay.group_of)),
        rows_aligned=frozenset(g.s for g in lay.groups.values() if lay._rows_aligned(g)),
        fused=MappingProxyType(dict(lay.fused)),
        fused_reduce=MappingProxyType(dict(lay.fused_reduce)),
        moments=MappingProxyType(dict(lay.moments)),
        moment_firsts=frozenset(lay.moment_firsts),
        register=reg,
        names=lay.names.counts(),
    )
