"""Row walks: a reduction of `length` values per output, by a team of one thread, lanes of a
warp or the whole block, folding one or more accumulators in the same walk.

Why its own module: reductions, the moments pass and the shared-memory online softmax
(flash.pass_group_rows) all walk rows; the team (chosen before printing, blockloops.team), the
all-reduce and the vectorised walk are printed the same way for each.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlso_cli.codegen.blockpass import elementwise
from mlso_cli.codegen.cfmt import (
    Code,
    Coords,
    decompose,
    numel,
)
from mlso_cli.codegen.emitter import Emitter
from mlso_cli.codegen.teams import FOLD, LOOP_VAR, loop_header
from mlso_cli.codegen.vectorize import READ, plan_lane

if TYPE_CHECKING:
    from mlso_cli.codegen.block import BlockKernel


@dataclass(frozen=True)
class Walk:
    """What a team reduction folds per output o (`rowwalk.team_walk`)."""

    accs: tuple[tuple[str, str], ...]
    """(accumulator, teams.FOLD op) pairs, all folded in the same walk."""
    setup: list[str]
    """Statements per output before the walk, in every thread of its team."""
    lines: list[str]
    """Statements per value (in rr, the axis variable): the emitter's loads and arithmetic."""
    steps: list[str]
    """Statements per value that fold it into the accumulators."""
    tail: list[str]
    """Statements per output after the team's all-reduce, in one lane (accumulators whole)."""
    settle: Callable[[int], list[str]] = lambda width: []
    """Statements in every thread of a team of `width` once all accumulators but the last are
    whole, before the last is all-reduced (each thread still holds its share of it)."""


def team(
    bk: BlockKernel,
    code: Code,
    out_shape: tuple[int, ...],
    length: int,
    op: str,
    body: Callable[[Emitter, Coords], str],
    finish: Callable[[Emitter, Coords, str], list[str]],
) -> None:
    """Reduce `length` values per element of out_shape; tokens are over `o`, the axis is rr."""
    tokens = decompose("o", out_shape)
    em = bk.emitter()
    expr = body(em, tokens)
    fin = bk.emitter()
    tail = finish(fin, tokens, "acc")
    fold = FOLD[op][1].format(a="acc", b=expr)
    walk = Walk((("acc", op),), [], em.lines, [f"acc = {fold};"], fin.lines + tail)
    team_walk(bk, code, numel(out_shape), length, walk)


def team_walk(bk: BlockKernel, code: Code, count: int, length: int, walk: Walk) -> None:
    """One walk per output o (of `count`) over its `length` values, by a team whose size
    the plan chose (blockloops.team): a thread, lanes of a warp, or the whole block."""
    t = bk.plan.teams[("walk", count, length)]
    mode = t.mode
    if mode == "thread":
        with code.block(f"for (int o = threadIdx.x; o < {count}; o += {bk.nt})"):
            code.extend(walk.setup)
            fold_loop(bk, code, walk, length, mode)
            all_reduce(code, walk, 1, None)
            code.extend(walk.tail)
    elif mode == "warp":
        team = t.width
        per = 32 // team
        with code.block(f"for (int ob = warp * {per}; ob < {count}; ob += {bk.nw * per})"):
            code(f"const int o = ob + (lane / {team}), tl = lane % {team};")
            code.extend(walk.setup)
            code(*(f"float {acc} = {FOLD[op][0]};" for acc, op in walk.accs))
            if not vector_team(bk, code, walk.lines, walk.steps, count, length, team):
                head, first = team_loop(code, team, length)
                with code.block(head):
                    code.extend(first + walk.lines + walk.steps)
            all_reduce(
                code,
                walk,
                team,
                lambda acc, op: f"{acc} = mlso::warp_allreduce<{FOLD[op][2]}, {team}>({acc});",
            )
            with code.block("if (tl == 0)"):
                code.extend(walk.tail)
    else:
        with code.block(f"for (int o = 0; o < {count}; ++o)"):
            code.extend(walk.setup)
            fold_loop(bk, code, walk, length, mode)
            all_reduce(
                code,
                walk,
                bk.nt,
                lambda acc, op: (
                    f"{acc} = mlso::block_allreduce<{FOLD[op][2]}, {bk.nt}>({acc}, red);"
                ),
            )
            with code.block("if (threadIdx.x == 0)"):
                code.extend(walk.tail)


def all_reduce(
    code: Code, walk: Walk, width: int, reduce: Callable[[str, str], str] | None
) -> None:
    """The team's all-reduce of each accumulator in turn (reduce(acc, op): the statement;
    None for a team of one thread), with walk.settle before the last one."""
    *rest, (last, op) = walk.accs
    if reduce is not None:
        code(*(reduce(acc, o) for acc, o in rest))
    code.extend(walk.settle(width))
    if reduce is not None:
        code(reduce(last, op))


def fold_loop(bk: BlockKernel, code: Code, walk: Walk, length: int, mode: str) -> None:
    """The walk of a thread (mode "thread") or of each thread of the block ("block") over
    one output's values, all accumulators at once."""
    code(*(f"float {acc} = {FOLD[op][0]};" for acc, op in walk.accs))
    with code.block(loop_header(mode, length, bk.nt)):
        code.extend(walk.lines + walk.steps)


def vector_team(
    bk: BlockKernel,
    code: Code,
    lines: list[str],
    steps: list[str],
    count: int,
    length: int,
    team: int,
) -> bool:
    """A team's walk over its row `width` neighbours at a time, where that makes a wide
    load: lane tl of the team takes vectors rv = tl, tl + team, ... of the row, each read
    with one 16-byte (8-, 4-byte) shared-memory load, and computes what does not depend on
    the element once per vector (vectorize.plan_lane). Why: a team that reads 16-bit
    elements one at a time issues a load and waits out its latency per element; rmsnorm +
    linear's in-loop sum of squares (16 rows of 512 halves a step) cost 4 of its 27 µs
    that way on the H200. Returns False (nothing emitted) where no read gets wider."""
    if any(READ.search(st) for st in steps):
        return False
    ctypes = elementwise.aligned_buffers(
        bk,
    )
    for width in (8, 4, 2):
        if length % (team * width):
            continue
        walk = f"(rv * {width} + vj)"
        vlines = [re.sub(rf"\b{LOOP_VAR}\b", walk, t) for t in lines]
        vsteps = [re.sub(rf"\b{LOOP_VAR}\b", walk, t) for t in steps]
        lane = plan_lane(vlines, {"o": count, "rv": length // width}, width, ctypes)
        if not lane.wide_loads:
            continue
        n = length // (team * width)
        code("#pragma unroll")
        with code.block(f"for (int ri = 0; ri < {n}; ++ri)"):
            code(f"const int rv = ((ri + lane / {team}) % {n}) * {team} + tl;")
            code.extend(lane.pre)
            code("#pragma unroll")
            with code.block(f"for (int vj = 0; vj < {width}; ++vj)"):
                code.extend(lane.lane)
                code.extend(vsteps)
        return True
    return False


def team_loop(code: Code, team: int, length: int) -> tuple[str, list[str]]:
    """The loop of a team of `team` lanes over one row of `length`: (header, first lines).
    Where rows of a power-of-two fp32 stride would put every team's lanes on the same banks,
    each team starts its walk at a different column block (the fold is order-independent)."""
    code("#pragma unroll")
    if team < 32 and length % team == 0:
        n = length // team
        return (
            f"for (int ri = 0; ri < {n}; ++ri)",
            [f"const int {LOOP_VAR} = ((ri + lane / {team}) % {n}) * {team} + tl;"],
        )
    return f"for (int {LOOP_VAR} = tl; {LOOP_VAR} < {length}; {LOOP_VAR} += {team})", []


def row_loop(
    bk: BlockKernel, code: Code, warp_mode: bool, team: int, length: int, start: str, step: str
) -> tuple[str, list[str]]:
    if warp_mode:
        return team_loop(code, team, length)
    code("#pragma unroll 4")
    return f"for (int {LOOP_VAR} = {start}; {LOOP_VAR} < {length}; {LOOP_VAR} += {step})", []
