"""`plan_block(bg, arch)`: every decision about one graph-defined kernel, as one frozen value.

Why: a block kernel used to be printed by the last class of a five-level tower (analysis ->
storage -> matmul planning -> layout -> kernel), so the printer could read, and change, any
planning state at any time. Now each stage is a function that returns a frozen value:
blockanalysis.analyse (the graph's facts) -> blocklayout.plan_layout (buffers, scales, matmul
plans with their staging copies, the register path) -> blockschedule.schedule_passes (which
passes run, where) -> blockloops.loop_shapes (each pass's lanes and teams) -> `BlockPlan`, which block.BlockKernel prints without seeing a planner.

Everything inside is immutable and hashable: tuples, frozensets, FrozenMaps (frozen.py) and
frozen records (SmemStorage, MatmulPlan, Stage, Group, RegisterPath, Step).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlso_cli.codegen.blockanalysis import Group, Moments, analyse
from mlso_cli.codegen.blocklayout import CODEGEN_ARCH, SmemLayout, plan_layout
from mlso_cli.codegen.blockloops import Lanes, LanesKey, Team, TeamKey, loop_shapes
from mlso_cli.codegen.blockmatmul import MatmulPlan
from mlso_cli.codegen.blockregister import RegisterPath
from mlso_cli.codegen.blockschedule import Schedule, Step, schedule_passes
from mlso_cli.codegen.blockstorage import SmemStorage
from mlso_cli.codegen.frozen import FrozenMap
from mlso_cli.ir.graph import BlockGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import Phase

__all__ = ["BlockPlan", "RegisterPath", "Step", "plan_block"]


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
    stab: FrozenMap[Node, Node]
    storage: FrozenMap[Node, SmemStorage]
    plans: FrozenMap[Node, MatmulPlan]
    """Each matmul's operands, staging copies and kind."""
    groups: FrozenMap[Node, Group]
    group_of: FrozenMap[Node, Group]
    rows_aligned: frozenset[Node]
    """Scores of the groups whose weighted sums are row-aligned with them."""
    fused: FrozenMap[Node, Node]
    fused_reduce: FrozenMap[Node, Node]
    moments: FrozenMap[Node, Moments]
    moment_firsts: frozenset[Node]
    register: RegisterPath | None
    schedule: Schedule
    """The passes per phase and the SAVEs (blockschedule.RULES)."""
    lanes: FrozenMap[LanesKey, Lanes]
    """(shape, vectorisable) -> the loop of every element pass the schedule prints."""
    teams: FrozenMap[TeamKey, Team]
    """(rule, outputs, length) -> the team of every row walk the schedule prints."""
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

    def passes(self, phase: Phase) -> tuple[Step, ...]:
        return self.schedule.passes[phase]


def plan_block(bg: BlockGraph, arch: str = CODEGEN_ARCH) -> BlockPlan:
    """The plan of `bg` for `arch`."""
    lp = plan_layout(analyse(bg), arch)
    an = lp.analysis
    schedule = schedule_passes(lp)
    lanes, teams = loop_shapes(schedule, lp.smem.threads, lp.register, an.fused, an.moments)
    return BlockPlan(
        bg=an.bg,
        arch=arch,
        layout=lp.smem,
        warps=lp.smem.threads // 32,
        order=an.order,
        iters=an.iters,
        loop_iters=an.loop_iters,
        direct=an.direct,
        stab=an.stab,
        storage=lp.storage,
        plans=lp.plans,
        groups=lp.groups,
        group_of=lp.group_of,
        rows_aligned=frozenset(g.s for g in lp.groups.values() if an.rows_aligned(g)),
        fused=an.fused,
        fused_reduce=an.fused_reduce,
        moments=an.moments,
        moment_firsts=an.moment_firsts,
        register=lp.register,
        schedule=schedule,
        lanes=lanes,
        teams=teams,
        names=lp.names,
    )
