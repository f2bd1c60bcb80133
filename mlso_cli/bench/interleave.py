"""Time several models round by round, interleaved, and summarise them against the first.

Why interleave: timing one model completely and then the other lets anything that drifts over
the run (GPU clocks ramping up or throttling, a neighbour process, the host's caches) land on
one side only. `mlso bench` timed that way once read 1.31x for a model against itself. Here each
round times every model's `iters` calls, in an order rotated from round to round and mirrored
within the round (A B C C B A, half the calls in each block): every model takes every position
equally often, and a drift that is linear over a round weighs on all of them alike within that
round. The ratio against the first model is taken per round (both were timed within the same
round) before its median, which cancels what a whole round shares.

Pure Python with an injectable clock, so that the schedule is tested without ONNX Runtime.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Contender:
    """One thing to time. `call` runs it once; `sync` waits for the work `call` queued (a GPU
    stream) and is called once at the end of each block, inside the timed span."""

    call: Callable[[], object]
    sync: Callable[[], object] = _nothing


def round_order(n: int, round_index: int) -> list[int]:
    """The order in which the `n` contenders start in round `round_index`: 0..n-1 rotated left
    by the round's index, so that over n rounds each contender starts once in each position."""
    if n <= 0:
        return []
    start = round_index % n
    return [(start + k) % n for k in range(n)]


def round_blocks(n: int, round_index: int, iters: int) -> list[tuple[int, int]]:
    """The blocks of one round, as (contender, calls): the rotated order with the first half of
    each contender's `iters` calls, then the same order reversed with the second half
    (A B C C B A). Why mirrored: every contender's two blocks then sit at positions that add up
    to the same number, so a drift that is linear over the round weighs on all of them equally,
    in every round, and the per-round ratios need no even number of rounds to cancel it."""
    order = round_order(n, round_index)
    first, second = (iters + 1) // 2, iters // 2
    blocks = [(i, first) for i in order] + [(i, second) for i in reversed(order)]
    return [(i, k) for i, k in blocks if k > 0]


def interleave(
    contenders: Sequence[Contender],
    *,
    rounds: int,
    iters: int,
    settle: int = 1,
    clock: Callable[[], float] = time.perf_counter,
    on_round: Callable[[int], object] | None = None,
) -> list[list[float]]:
    """Per-call microseconds of each contender in each round: `result[i][r]` is contender i's
    `iters` calls in round r (its two blocks, see round_blocks) over `iters`.

    settle: untimed calls before each block. Why: the first call after another model ran can pay
    for that model's state in the caches; it is paid equally by everyone, but leaving it out of
    the block keeps the absolute figures closer to a model running alone.
    """
    if rounds < 1 or iters < 1:
        raise ValueError("rounds and iters must be at least 1")
    samples: list[list[float]] = [[] for _ in contenders]
    for r in range(rounds):
        spent = [0.0] * len(contenders)
        for i, calls in round_blocks(len(contenders), r, iters):
            c = contenders[i]
            for _ in range(settle):
                c.call()
            c.sync()
            t0 = clock()
            for _ in range(calls):
                c.call()
            c.sync()
            spent[i] += clock() - t0
        for i, t in enumerate(spent):
            samples[i].append(t / iters * 1e6)
        if on_round is not None:
            on_round(r)
    return samples


@dataclass(frozen=True)
class Spread:
    """The median of some per-round values, with their quartiles and extremes."""

    median: float
    q1: float
    q3: float
    lo: float
    hi: float

    @property
    def iqr(self) -> tuple[float, float]:
        return (self.q1, self.q3)


def spread(values: Sequence[float]) -> Spread:
    """Median, interquartile range (quartiles by linear interpolation between the sorted values,
    statistics' "inclusive" method) and min/max of `values`. Why the IQR as the spread: with a
    dozen rounds a single disturbed round moves min-max but not the quartiles."""
    xs = sorted(values)
    if not xs:
        raise ValueError("no values")
    if len(xs) == 1:
        q1 = q3 = xs[0]
    else:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return Spread(statistics.median(xs), q1, q3, xs[0], xs[-1])


def paired_speedups(reference: Sequence[float], other: Sequence[float]) -> list[float]:
    """The reference's time over the other's, round by round (> 1: the other is faster)."""
    if len(reference) != len(other):
        raise ValueError("both need the same rounds")
    return [a / b if b > 0 else float("inf") for a, b in zip(reference, other)]
