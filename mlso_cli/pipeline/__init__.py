"""The optimize pipeline as a library: load -> partition -> lift -> search -> select -> codegen -> package.

    optimize(source, shapes, PipelineOptions(...), search=..., measure=..., listener=..., dry_run=...)
        -> Outcome(regions=(RegionReport(searched, choice), ...), model, bound)

Module map (one stage each; every artifact is frozen plain data, artifacts.py):
  frontend.py   load, partition, lift -> Lifted
  searching.py  each region through the search-result cache (search/cache.py) and a SearchFn
  select.py     rank by the cost model, time the top K with --gpu, never-slower rule -> Choice
  wholemodel.py with --gpu: the packaged model against the original, whole, in the serving mode
  build.py      codegen + nvcc (content-hash cached) and packaging into MlsoKernel nodes
  run.py        the stages in order
  gpu.py        the shared "is there a GPU" check (exit 4)
`mlso optimize` (commands/optimize.py) only turns flags into PipelineOptions and renders the Outcome.
"""

from __future__ import annotations

from mlso_cli.pipeline.artifacts import (
    CUDA_GRAPH,
    NO_SEARCH,
    PLAIN,
    SERVE_MODES,
    Choice,
    Lifted,
    Listener,
    ModelCheck,
    ModeTimes,
    Outcome,
    PipelineOptions,
    RegionReport,
    Searched,
    ran_search,
)
from mlso_cli.pipeline.run import optimize
from mlso_cli.pipeline.searching import default_search, no_search

__all__ = [
    "CUDA_GRAPH",
    "NO_SEARCH",
    "PLAIN",
    "SERVE_MODES",
    "Choice",
    "Lifted",
    "Listener",
    "ModeTimes",
    "ModelCheck",
    "Outcome",
    "PipelineOptions",
    "RegionReport",
    "Searched",
    "default_search",
    "no_search",
    "optimize",
    "ran_search",
]
