"""The search stage's contract: what goes in, what comes out, what a progress callback sees.

Why a separate module: the pipeline (load -> partition -> lift -> search -> select -> codegen ->
package), the result cache and the CLI depend only on these plain-data types, never on how the
enumerator works, so each side can change alone. Everything here is frozen and serialisable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mlso_cli.ir.graph import KernelGraph

STATES_PER_SIGNATURE = 2_048
DEFAULT_STATES_CAP = 1_000_000
"""Without --max-states a region gets STATES_PER_SIGNATURE states per signature, at most
DEFAULT_STATES_CAP in all, in one pass (plus the states the exhausted signatures leave unused,
which search/run.py's `_passes` gives to the ones their share stopped).
Here, not in run.py, because the CLI's help states them and must not import the enumerator.

Why per signature: a signature explores the same op structure at its own tiling, and a fixed
total shared by 66 signatures (gqa at batch 16) starved the one holding the fused program.

Why 2,048: most of a region's states go to signatures that yield nothing and run to the end of
whatever share they get (all of them in a region where no fused program exists: norm -> q/k/v
-> rotary, norm -> gate/up), so the share sets the time of those regions; the signatures that
yield mostly exhaust early and leave states that `_passes` hands to the stopped ones. At 8,192
(the default until 2026-12-07) every benchmark row at batch 1 and 16, the four zoo_small exports
and the 2-layer Qwen2-0.5B-width export chose the same programs with the same estimates as at
2,048, which took 1.0-4.8x less time (qknorm_gqa bs1 149 -> 31 s, gemma3_tiny 168 -> 89 s on
2 cores; benchmarks/HISTORY.md, twenty-fourth session). Deeper shares found nothing that was
chosen in any region measured; at 1,024 qknorm_gqa, layernorm_linear and groupnorm_linear at
batch 1 lose the programs they choose at 2,048. A user who wants a deeper search says so with --max-states."""


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
