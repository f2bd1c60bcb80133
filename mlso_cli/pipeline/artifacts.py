"""The pipeline's options and the plain-data artifact each stage hands to the next.

Why plain frozen data: a stage can then be run, cached, tested or replaced alone (a test passes a
fake search and inspects what select and package saw), and the CLI only renders these records.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx

from mlso_cli.frontend.analyse import Analysis
from mlso_cli.frontend.lift import LiftedRegion
from mlso_cli.frontend.load import LoadedModel
from mlso_cli.search.api import Candidate, SearchOptions, SearchProgress, SearchResult

NO_SEARCH = "no search: "
"""Prefix of the note a result carries when no search ran for its region (see `ran_search`)."""


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

    @property
    def speedup(self) -> float:
        return self.before_us / self.after_us if self.after_us else 0.0


@dataclass(frozen=True)
class RegionReport:
    """What the CLI prints per region: the search and the choice together."""

    searched: Searched
    choice: Choice


@dataclass(frozen=True)
class Outcome:
    """The whole run. `model` is None for a dry run (nothing was compiled or packaged)."""

    regions: tuple[RegionReport, ...]
    model: onnx.ModelProto | None
    bound: float
    """Union bound over every verification in the run: the model's mlso.verification_bound."""

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


def ran_search(result: SearchResult) -> bool:
    """False when the result says no search ran (the lifted target is its only candidate)."""
    return not any(n.startswith(NO_SEARCH) for n in result.notes)
