"""Which passes a graph-defined kernel runs, in which phase and order: `schedule_passes`.

Why a table: which pass a block node gets (none, a staging copy before its first matmul, the
online softmax's group pass, a fused reduction, an accumulator, the moments pass, its op's own
pass) is a rule of the codegen, and the project keeps its rules as data: `RULES` is a tuple
of (why, predicate, action), tried in order for each node in dependency order; the first whose
predicate holds adds the node's steps. A `Step` names its printer (block.PRINTERS) and what it
prints; the printer chooses nothing.

Staging copies go right before their first matmul when in the same phase, else at the end of
the operand's phase (each is written once, before its first reader).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType

from mlso_cli.codegen.blockanalysis import Group
from mlso_cli.codegen.blocklayout import LayoutPlan
from mlso_cli.codegen.blockmatmul import MatmulPlan, Stage
from mlso_cli.codegen.errors import CodegenError
from mlso_cli.codegen.frozen import FrozenMap
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import ACCUMULATORS, Op, Phase

PHASES = (Phase.PRE, Phase.LOOP, Phase.POST)


@dataclass(frozen=True)
class Step:
    """One pass to print: `kind` is its printer's key in block.PRINTERS."""

    kind: str
    subject: Node | Stage | Group | MatmulPlan
    note: str = ""
    """The comment a matmul pass prints (what the product is)."""


@dataclass(frozen=True)
class Schedule:
    passes: FrozenMap[Phase, tuple[Step, ...]]
    """Phase -> its passes, in order (barriers are placed while printing, barriers.py)."""
    saves: tuple[Node, ...]
    """SAVE nodes, printed after the POST passes."""


OP_PASSES = MappingProxyType(
    {
        Op.MATMUL: "matmul_node",
        Op.REDUCE_SUM: "reduce",
        Op.REDUCE_MEAN: "reduce",
        Op.REDUCE_MAX: "reduce",
    }
)
"""Block op -> the step kind of its own pass (nodes no earlier rule claims)."""


@dataclass
class _Builder:
    """The schedule being built (private to `schedule_passes`)."""

    lp: LayoutPlan
    last_of_group: dict[Node, Node]
    passes: dict[Phase, list[Step]] = field(default_factory=lambda: {p: [] for p in PHASES})
    saves: list[Node] = field(default_factory=list)
    staged: set[int] = field(default_factory=set)
    """ids of the staging copies scheduled: each copy is written once, before its first matmul."""

    def add(self, phase: Phase, kind: str, subject: object, note: str = "") -> None:
        self.passes[phase].append(Step(kind, subject, note))

    def stage(self, plans: list[MatmulPlan]) -> None:
        """Each plan's staging copies not yet written, in their operand's phase."""
        for plan in plans:
            for st in plan.stages:
                if id(st) not in self.staged:
                    self.staged.add(id(st))
                    self.add(st.phase, "stage", st)


def _on_register(lp: LayoutPlan, g: Group) -> bool:
    return lp.register is not None and g.s is lp.register.group.s


def _group(b: _Builder, n: Node) -> None:
    """After a group's last accumulator: its staging copies (none for a register-path operand
    read as x of x * f), then the register pass, or the shared-memory passes and P @ v."""
    lp = b.lp
    g = lp.group_of[n]
    if b.last_of_group[g.s] is not n:
        return
    plans = [lp.plans[w] for w in g.wsums]
    register = _on_register(lp, g)
    if not (register and lp.register.f is not None):
        b.stage(plans)  # (a scaled weighted operand is read unscaled by the register pass)
    if register:
        b.add(Phase.LOOP, "register", g)
        return
    b.add(Phase.LOOP, "group_rows" if lp.analysis.rows_aligned(g) else "group", g)
    for plan in plans:
        b.add(Phase.LOOP, "matmul", plan, "exp(s - m) @ v")


def _accumulator(b: _Builder, n: Node) -> None:
    """An ACC_SUM: its fused matmul's staging copies, then the accumulating pass."""
    if n.src[0] in b.lp.analysis.fused:
        b.stage([b.lp.plans[n.src[0]]])
    b.add(Phase.LOOP, "acc_sum", n)


def _own_pass(kind: Callable[[Node], str]) -> Callable[[_Builder, Node], None]:
    """The node's pass of `kind(n)` in its phase, after its matmul plan's staging copies."""

    def act(b: _Builder, n: Node) -> None:
        if n in b.lp.plans:
            b.stage([b.lp.plans[n]])
        b.add(n.phase or Phase.PRE, kind(n), n)

    return act


def _stage_only(b: _Builder, n: Node) -> None:
    """A register-path score term: computed inside the register pass (its staging copies
    still go where they would)."""
    if n in b.lp.plans:
        b.stage([b.lp.plans[n]])


def _unsupported(b: _Builder, n: Node) -> None:
    raise CodegenError(f"block op {n.op.value} has no pass")


Rule = tuple[str, Callable[[LayoutPlan, Node], bool], Callable[[_Builder, Node], None]]

RULES: tuple[Rule, ...] = (
    (
        "tiles are loaded, running maxima written by their group: no pass",
        lambda lp, n: n.op is Op.ITER or any(n == g.m for g in lp.groups.values()),
        lambda b, n: None,
    ),
    (
        "SAVE: printed after the POST passes",
        lambda lp, n: n.op is Op.SAVE,
        lambda b, n: b.saves.append(n),
    ),  # fmt: skip
    ("online-softmax accumulator: its group's passes", lambda lp, n: n in lp.group_of, _group),
    (
        "ACC_SUM of a fused reduction: the reduction's pass adds into it",
        lambda lp, n: n.op in ACCUMULATORS and n.src[0] in lp.analysis.fused_reduce,
        lambda b, n: b.add(Phase.LOOP, "reduce", n.src[0]),
    ),
    ("accumulator", lambda lp, n: n.op in ACCUMULATORS, _accumulator),
    (
        "first sum of a moments pair: computed by the second's pass",
        lambda lp, n: n in lp.analysis.moment_firsts,
        lambda b, n: None,
    ),
    (
        "second sum of a moments pair: one walk for both",
        lambda lp, n: n in lp.analysis.moments,
        _own_pass(lambda n: "moments"),
    ),
    (
        "register-path score term: computed in the register pass",
        lambda lp, n: n.op in OP_PASSES and lp.register is not None and n in lp.register.form.terms,
        _stage_only,
    ),
    (
        "op with a pass of its own",
        lambda lp, n: n.op in OP_PASSES,
        _own_pass(lambda n: OP_PASSES[n.op]),
    ),  # fmt: skip
    ("anything else", lambda lp, n: True, _unsupported),
)
"""(why, predicate(layout plan, node), action(builder, node)): the first match decides."""


def schedule_passes(lp: LayoutPlan) -> Schedule:
    """The passes of lp's kernel per phase, in dependency order, and its SAVEs (`RULES`)."""
    order = lp.analysis.order
    last_of_group = {lp.group_of[n].s: n for n in order if n in lp.group_of}
    b = _Builder(lp, last_of_group)
    for n in order:
        _, _, act = next(rule for rule in RULES if rule[1](lp, n))
        act(b, n)
    return Schedule(FrozenMap((p, tuple(steps)) for p, steps in b.passes.items()), tuple(b.saves))
