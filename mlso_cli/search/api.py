"""The search stage's contract: what goes in, what comes out, what a progress callback sees.

Why a separate module: the pipeline (load -> partition -> lift -> search -> select -> codegen ->
package), the result cache and the CLI depend only on these plain-data types, never on how the
enumerator works, so each side can change alone. Everything here is frozen and serialisable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mlso_cli.ir.graph import KernelGraph


@dataclass(frozen=True)
class SearchOptions:
    """Knobs of one region's search. `max_states` makes the result deterministic (a fixed seed and
    state budget give the same program); `budget_s` is wall clock and may stop anywhere."""

    budget_s: float | None = None
    max_states: int | None = None
    jobs: int = 1
    seed: int | None = None
    arch: str = "sm_90"
    kernel_ops: int = 5
    block_ops: int = 11
    full_checks: int = 1
    """How many of the best-estimated structures are verified at full shapes and returned. One
    suffices to choose by the cost model; with a GPU, `optimize` asks for as many as it times
    (`--top-k`). Why not always three: an attention check at batch 16 takes minutes of a core.
    The best-estimated structure with fewer launches than all of these is verified as well
    (search/run.py `_to_verify`)."""
    executor: str = "local"
    """Where the search's units run: `local` (inline or a process pool of `jobs`), `ray` or
    `ray=ADDRESS` (search/executor.py). Not in the cache key: results are gathered in a fixed
    order, so the executor never changes them."""

    def cache_fields(self) -> dict:
        """The options that change the result (and so belong in a cache key). `jobs` and
        `executor` do not: the enumeration is partitioned deterministically and gathered in a fixed
        order; `budget_s` only marks a result partial."""
        return {
            "max_states": self.max_states,
            "seed": self.seed,
            "arch": self.arch,
            "kernel_ops": self.kernel_ops,
            "block_ops": self.block_ops,
            "full_checks": self.full_checks,
        }


@dataclass(frozen=True)
class Candidate:
    """A verified program, its estimated time and the false-accept bound of its verification."""

    graph: KernelGraph
    estimate_us: float
    kernels: int
    bound: float


@dataclass(frozen=True)
class SearchResult:
    """The outcome for one region. `candidates` are verified programs, best estimate first (the
    target itself, lifted, is always among them as the fallback). `partial` is True when a
    budget or an interrupt cut the search short: such a result is never cached as final."""

    candidates: tuple[Candidate, ...]
    states: int
    pruned: int
    verified: int
    seconds: float
    bound: float
    partial: bool
    notes: tuple[str, ...] = field(default=())

    @property
    def best(self) -> Candidate:
        return self.candidates[0]


@dataclass(frozen=True)
class SearchProgress:
    """What a progress display shows while one region is searched."""

    region: str
    states: int
    pruned: int
    verified: int
    best_us: float | None
    elapsed_s: float
    queued: int | None = None
    running: int | None = None
    finished: int | None = None
    """The executor's units (signature explorations, check halves) so far; None when the search
    function does not report them."""
    nodes: int | None = None
    """Machines that have returned a unit (1 for the local executors, more on a Ray cluster)."""


ProgressFn = Callable[[SearchProgress], None]
SearchFn = Callable[[KernelGraph, SearchOptions, "ProgressFn | None"], SearchResult]
"""search(target, options, progress) -> SearchResult: the signature the pipeline calls."""
