"""The pipeline's options and the plain-data artifact each stage hands to the next.

Why plain frozen data: a stage can then be run, cached, tested or replaced alone (a test passes a
fake search and inspects what select and package saw), and the CLI only renders these records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import onnx

from mlso_cli.frontend.analyse import Analysis
from mlso_cli.frontend.lift import LiftedRegion
from mlso_cli.frontend.load import LoadedModel
from mlso_cli.package.chunks import Serialized
from mlso_cli.search.api import Candidate, SearchOptions, SearchProgress, SearchResult

NO_SEARCH = "no search: "
"""Prefix of the note a result carries when no search ran for its region (see `ran_search`)."""

CUDA_GRAPH = "cuda-graph"
PLAIN = "plain"
SERVE_MODES = (CUDA_GRAPH, PLAIN)
"""How the optimized model will be served in ONNX Runtime on the CUDA EP (`optimize --serve`):
replayed by ORT's CUDA graph, or one plain `run` call per inference. The never-slower rule
compares both sides in this mode only: a region can win in one and lose in the other (ORT pays
about 6 µs per node plain and little under a graph; the MlsoKernel node costs 8-11 µs more
than its program under a graph)."""


@dataclass(frozen=True)
class PipelineOptions:
    """What `mlso optimize`'s flags set. `search` goes to the search function unchanged."""

    search: SearchOptions = SearchOptions()
    min_speedup: float = 1.0
    """Never-slower rule: package a region only when its program is at least this much faster
    (and strictly faster unless 0, which packages every region)."""
    seed: int = 0
    gpu: int | None = None
    """Measure on this GPU instead of trusting the cost model."""
    top_k: int = 3
    """With a GPU: how many of the best-estimated candidates per region are timed."""
    cache_dir: Path | None = None
    """Search-result cache folder; None: `<MLSO_CACHE_DIR>/search`."""
    use_cache: bool = True
    serve: str = CUDA_GRAPH
    """The deployment mode the never-slower rule decides by (SERVE_MODES)."""
    verify_seed: int | None = None
    """Seed of the check before writing (pipeline/verifying.py); None: a stream derived from
    `seed`, never the search's own (`mlso optimize` passes a fresh one unless --seed is given)."""
    verify_seed_fresh: bool = False
    """`verify_seed` was drawn fresh for this run (no --seed): a stored verdict of the same
    bytes under an earlier fresh seed is reused (pipeline/verdicts.py)."""
    check_rounds: int = 15
    check_iters: int = 50
    """With a GPU: rounds and calls per round of the whole-model check (`mlso bench`'s defaults)."""

    def __post_init__(self) -> None:
        if self.serve not in SERVE_MODES:
            raise ValueError(f"serve must be one of {', '.join(SERVE_MODES)}, not {self.serve!r}")


@dataclass(frozen=True)
class Lifted:
    """load -> partition -> lift: the model and its lifted regions (each a search target)."""

    loaded: LoadedModel
    analysis: Analysis

    @property
    def regions(self) -> list[LiftedRegion]:
        return self.analysis.lifted


@dataclass(frozen=True)
class Searched:
    """One region's search outcome, wherever it came from."""

    region: int
    region_hash: str
    result: SearchResult
    cached: bool
    """Served from the cache: no search function ran in this run."""
    seconds: float
    """Wall time this run spent on the region's search stage (near 0 on a cache hit)."""

    @property
    def searched(self) -> bool:
        return ran_search(self.result)


@dataclass(frozen=True)
class ModeTimes:
    """One serving mode's measurement of a region: its original nodes and its MlsoKernel node
    alone, each in ONNX Runtime (None: could not run in that mode)."""

    mode: str
    orig_us: float | None
    served_us: float | None


@dataclass(frozen=True)
class Choice:
    """The select stage's verdict for one region."""

    region: int
    label: str
    candidate: Candidate
    estimate_us: float
    """Cost-model time of the chosen program."""
    kernels: int
    """Kernel launches of the chosen program."""
    before_us: float
    after_us: float
    """Estimated or measured (see `measured`) time of the original region and of the program."""
    measured: bool
    packaged: bool
    why: str
    serve: str = CUDA_GRAPH
    """The mode `before_us` and `after_us` are for (see SERVE_MODES)."""
    program_us: float | None = None
    """Measured: the chosen program alone by CUDA-graph replay, without ONNX Runtime."""
    modes: tuple[ModeTimes, ...] = ()
    """Measured: the chosen candidate's trial in every mode, the one not decided by included
    (the data a calibration of the cost model needs)."""
    onnx_estimate_us: float | None = None
    """The cost model's figure for the original region (`onnx_region_cost`, plain ONNX Runtime),
    kept beside any measurement for calibration."""
    bound: float | None = None
    """The false-accept bound the check before writing obtained for the packaged program
    (pipeline/verifying.py); None when it was not packaged or not yet checked."""
    checks: str = ""
    """What the check before writing ran for it, in one line (empty when it did not run)."""
    baseline_us: float | None = None
    """Measured (--gpu): the region's baseline program (its lifted program: library GEMMs plus
    generated kernels for everything else) as served, its MlsoKernel node alone in ORT in the
    mode the rule compared; None without --gpu or where it could not be timed."""
    baseline_orig_us: float | None = None
    """The region's original nodes in the same trial and mode as `baseline_us`."""
    baseline_program_us: float | None = None
    """The baseline program alone by CUDA-graph replay (no ORT)."""

    @property
    def speedup(self) -> float:
        return self.before_us / self.after_us if self.after_us else 0.0

    @property
    def baseline_vs_ort(self) -> float | None:
        """Baseline µs over ORT's µs for the region, as served (issue 31's bar: at most 1.05)."""
        if self.baseline_us is None or not self.baseline_orig_us:
            return None
        return self.baseline_us / self.baseline_orig_us


@dataclass(frozen=True)
class RegionReport:
    """What the CLI prints per region: the search and the choice together."""

    searched: Searched
    choice: Choice


@dataclass(frozen=True)
class ModelCheck:
    """The whole-model check of a run with a GPU: the rewritten model against the original, both
    whole, interleaved, in the serving mode (pipeline/wholemodel.py states the rule)."""

    serve: str
    """The mode the user named."""
    mode: str
    """The mode timed: `serve`, or plain when the original model cannot run under a CUDA graph."""
    ran: bool
    """Whether both models were timed (False: the original could not run; the region
    measurements then decided alone)."""
    rewritten_kept: bool
    """Whether the rewritten model is the output (False: the original regions were written back)."""
    why: str
    orig_us: float | None = None
    rewritten_us: float | None = None
    """Medians over the rounds of each model's per-call time."""
    speedup: float | None = None
    speedup_iqr: tuple[float, float] | None = None
    """Median and quartiles of the per-round ratios original / rewritten (> 1: faster)."""
    rounds: int = 0


@dataclass(frozen=True)
class Outcome:
    """The whole run. `model` is None for a dry run (nothing was compiled or packaged)."""

    regions: tuple[RegionReport, ...]
    model: onnx.ModelProto | None
    bound: float
    """The model's mlso.verification_bound: the union of the field bounds obtained for the
    packaged kernels by the check before writing (0 when none is packaged). For a dry run, the
    search's union bound over the programs it verified."""
    serve: str = CUDA_GRAPH
    check: ModelCheck | None = None
    """The whole-model check; None without a GPU, for a dry run, or when no region was packaged."""
    verify_seed: int | None = None
    """The seed the check before writing used (None for a dry run: nothing was checked)."""
    verdict_cached: bool = False
    """The check before writing's outcome came from the verdict cache: these very bytes were
    checked, under this code, by an earlier run (pipeline/verdicts.py)."""
    serialized: Serialized | None = field(default=None, repr=False, compare=False)
    """With a cached verdict, `model` as the check before writing hashed it, with its weights'
    bytes: `package.write_model_atomic(..., serialized=)` writes it without copying them out
    again (package/chunks.py). None otherwise; drop it to free the memory it holds."""

    @property
    def packaged(self) -> int:
        return sum(r.choice.packaged for r in self.regions)


class Listener:
    """Callbacks for a progress display; the default does nothing, a display overrides what it
    shows. The pipeline never depends on what a listener does."""

    def region_started(self, region: int, label: str, index: int, total: int) -> None:
        pass

    def search_progress(self, region: int, progress: SearchProgress) -> None:
        pass

    def region_searched(self, region: int, searched: Searched) -> None:
        pass

    def compiled(self, region: int) -> None:
        pass

    def region_decided(self, report: RegionReport) -> None:
        """The region's search and choice are final (without --gpu: right after its search;
        with --gpu: after the timings and the whole-model check). `--json` streams it."""


def ran_search(result: SearchResult) -> bool:
    """False when the result says no search ran (the lifted target is its only candidate)."""
    return not any(n.startswith(NO_SEARCH) for n in result.notes)
