"""How each loop of a block kernel's passes is shaped, decided before printing: the lanes of an
element pass (`Lanes`: neighbours per thread, elements per batch) and the team of a row walk
(`Team`: a thread, lanes of a warp, or the block per output). `loop_shapes` decides every loop
a plan's schedule prints.

Why here and not in the printers: these are choices of work distribution (how many threads
cooperate on a row, how many elements a thread holds), the kind of decision a plan records;
they are pure functions of a loop's shape and the block's threads, so the plan holds them in
tables keyed by shape and the printers look them up. `LOOPS` says, per step kind, which loops
its printer prints (a data table, like blockschedule.RULES).

Still chosen while printing (they depend on the code being printed): which loads and stores of
a vectorised pass are wide (vectorize.plan_lane) and whether a warp team's walk is vectorised
(blockpass.rowwalk.vector_team).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from mlso_cli.codegen.blockanalysis import Moments
from mlso_cli.codegen.blockregister import RegisterPath
from mlso_cli.codegen.blockschedule import Schedule, Step
from mlso_cli.codegen.cfmt import numel
from mlso_cli.codegen.frozen import FrozenMap
from mlso_cli.codegen.synthetic import RowMax
from mlso_cli.codegen.teams import choose_mode
from mlso_cli.ir.node import Node

ELEMENTWISE_BATCH = 8
"""Most elements one thread of an elementwise pass computes before it stores
(blockpass.elementwise.per_element says why)."""

LanesKey = tuple[tuple[int, ...], bool]
"""(shape, vectorisable body) of an element pass."""
TeamKey = tuple[str, int, int]
"""(rule, outputs, length) of a row walk: rule "walk" (teams.choose_mode) or "rows" (the
online softmax's row pass: a warp team from 32 columns on)."""


@dataclass(frozen=True)
class Lanes:
    """An element pass's loop: `width` neighbours per thread along the last axis (1: one
    element), `batch` elements (or vectors) computed before any is stored."""

    width: int
    batch: int


@dataclass(frozen=True)
class Team:
    """Who walks one output's row: mode "thread" (width 1), "warp" (`width` lanes of a warp)
    or "block" (all `width` threads)."""

    mode: str
    width: int


def batch_size(count: int, threads: int, most: int) -> int:
    """Items per thread per batch: the most, up to `most`, that divides each thread's share."""
    per = count // threads if count % threads == 0 else 0
    return max((u for u in range(1, most + 1) if per and per % u == 0), default=1)


def vector_width(shape: tuple[int, ...], threads: int) -> int:
    """Neighbours per thread along the last axis: 8, 4 or 2 where that divides the axis and
    still leaves every thread of the block a vector; else 1."""
    n = numel(shape)
    for width in (8, 4, 2):
        if shape and shape[-1] % width == 0 and n // width >= threads:
            return width
    return 1


def lanes(shape: tuple[int, ...], vector: bool, threads: int) -> Lanes:
    """The loop of an element pass over `shape` (vectorised only where the body allows)."""
    width = vector_width(shape, threads) if vector else 1
    if width > 1:
        return Lanes(
            width, batch_size(numel(shape) // width, threads, max(1, ELEMENTWISE_BATCH // width))
        )
    return Lanes(1, batch_size(numel(shape), threads, ELEMENTWISE_BATCH))


def team_width(length: int, rows: int, warps: int) -> int:
    """Lanes per row for a row pass: enough teams that every row gets one at once (when the
    block has that many lanes), at most 16 elements per lane, rows a multiple of 32/width."""
    t_min = 1
    while t_min < 32 and -(-length // t_min) > 16:
        t_min *= 2
    t_par = 32
    while t_par > 1 and (32 // t_par) * warps < rows:
        t_par //= 2
    t = min(32, max(t_min, t_par))
    while t < 32 and rows % (32 // t):
        t *= 2
    return t


def team(key: TeamKey, threads: int) -> Team:
    """The team of a row walk (see TeamKey)."""
    rule, count, length = key
    warps = threads // 32
    if rule == "rows":
        mode = "warp" if length >= 32 else "thread"
    else:
        mode = choose_mode(length, count, True, warps)
    width = {"thread": 1, "block": threads}.get(mode) or team_width(length, count, warps)
    return Team(mode, width)


@dataclass(frozen=True)
class _Facts:
    """What the loop table reads besides a step (blockplan gives it)."""

    register: RegisterPath | None
    fused: Mapping[Node, Node]
    moments: Mapping[Node, Moments]


Loops = tuple[list[LanesKey], list[TeamKey]]


def _reduce(step: Step, f: _Facts) -> Loops:
    n = step.subject
    axis = n.arg.axis if isinstance(n.arg, RowMax) else n.arg
    return [], [("walk", numel(n.shape), n.src[0].shape[axis])]


def _moments(step: Step, f: _Facts) -> Loops:
    r2 = step.subject
    return [], [("walk", r2.numel, f.moments[r2].u.shape[r2.arg])]


def _register(step: Step, f: _Facts) -> Loops:
    reg = f.register
    shapes = [(reg.f.shape, True)] if reg.f is not None else []
    if reg.kbuf is not None:
        shapes.append((reg.form.key_factor.shape, True))
    return shapes, []


def _group(step: Step, f: _Facts) -> Loops:
    g = step.subject
    shapes = [(w.shape, False) for w in g.wsums] + ([(g.s.shape, False)] if g.wsums else [])
    return shapes, [("walk", g.m.numel, g.s.shape[-1])]


def _acc_sum(step: Step, f: _Facts) -> Loops:
    n = step.subject
    return ([] if n.src[0] in f.fused else [(n.shape, True)]), []


LOOPS: Mapping[str, Callable[[Step, _Facts], Loops]] = MappingProxyType(
    {
        "stage": lambda s, f: ([(s.subject.src.shape, s.subject.scale is None)], []),
        "register": _register,
        "group_rows": lambda s, f: ([], [("rows", s.subject.m.numel, s.subject.s.shape[-1])]),
        "group": _group,
        "matmul": lambda s, f: ([], []),
        "matmul_node": lambda s, f: ([], []),
        "reduce": _reduce,
        "acc_sum": _acc_sum,
        "moments": _moments,
    }
)
"""Step kind -> the element passes and row walks its printer prints."""


def loop_shapes(
    schedule: Schedule,
    threads: int,
    register: RegisterPath | None,
    fused: Mapping[Node, Node],
    moments: Mapping[Node, Moments],
) -> tuple[FrozenMap[LanesKey, Lanes], FrozenMap[TeamKey, Team]]:
    """The lanes of every element pass and the team of every row walk the schedule prints."""
    facts = _Facts(register, fused, moments)
    shapes: dict[LanesKey, Lanes] = {}
    teams: dict[TeamKey, Team] = {}
    steps: Iterable[Step] = (s for steps in schedule.passes.values() for s in steps)
    for step in steps:
        ls, ts = LOOPS[step.kind](step, facts)
        for key in ls:
            shapes.setdefault(key, lanes(key[0], key[1], threads))
        for key in ts:
            teams.setdefault(key, team(key, threads))
    return FrozenMap(shapes), FrozenMap(teams)
