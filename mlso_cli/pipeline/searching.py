"""The search stage: each lifted region -> a SearchResult, through the cache.

Why the search function is a parameter: the pipeline depends only on the `SearchFn` contract
(search/api.py), so tests inject a fake and the enumerator plugs in without the pipeline
changing. `default_search()` picks `mlso_cli.search.run.search` when that module exists; until
then `no_search` returns the lifted target as the only candidate and says so in its notes, and
every report built on it states that no search ran.
"""

from __future__ import annotations

import importlib
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace

from mlso_cli.errors import MlsoError
from mlso_cli.frontend.lift import LiftedRegion
from mlso_cli.ir.graph import KernelGraph
from mlso_cli.ir.hashing import graph_hash
from mlso_cli.pipeline.artifacts import NO_SEARCH, Listener, Searched
from mlso_cli.search.api import Candidate, ProgressFn, SearchFn, SearchOptions, SearchResult
from mlso_cli.search.cache import SearchCache, make_key
from mlso_cli.search.cost import program_cost

ENUMERATOR_MODULE = "mlso_cli.search.run"
_BUG = "This is a bug in the search function; please report it with the model"


def no_search(
    target: KernelGraph, options: SearchOptions, progress: ProgressFn | None = None
) -> SearchResult:
    """The lifted target as the only candidate: what optimize packages while no enumerator exists.
    The target is the region itself, lifted, so it needs no check and its bound is 0."""
    cost = program_cost(target)
    return SearchResult(
        candidates=(Candidate(target, cost.us, cost.launches, 0.0),),
        states=0,
        pruned=0,
        verified=0,
        seconds=0.0,
        bound=0.0,
        partial=False,
        notes=(
            f"{NO_SEARCH}{ENUMERATOR_MODULE} is not installed; the lifted program is the only "
            "candidate",
        ),
    )


WORKER_LOST = (
    "a search worker process was killed (by the operating system, most likely for lack of "
    "memory); the region keeps its lifted program. Fix: fewer workers (--jobs), or a machine "
    "with more memory"
)


def _worker_lost(target: KernelGraph, options: SearchOptions, exc: BaseException) -> SearchResult:
    """The region's result when the search's process pool broke under it: the lifted program
    alone, marked partial (so it is never cached, and a rerun searches again), with the reason.
    Why not an error: the other regions' searches and the model are still good, and a user who
    gets a model with one region less beats one who gets a traceback."""
    lifted = no_search(target, options)
    return replace(lifted, partial=True, notes=(f"{WORKER_LOST} ({type(exc).__name__})",))


def default_search() -> SearchFn:
    """The enumerator's `search` when its module exists, else `no_search`."""
    try:
        module = importlib.import_module(ENUMERATOR_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != ENUMERATOR_MODULE:
            raise  # the enumerator exists but one of its imports is missing: a real error
        return no_search
    return module.search


def _signature(kg: KernelGraph) -> tuple:
    return (
        tuple((n.shape, n.dtype) for n in kg.inputs),
        tuple((n.shape, n.dtype) for n in kg.outputs),
    )


def conform(result: SearchResult, target: KernelGraph, region: int) -> SearchResult:
    """The result with every candidate named as the target is (a cached result may come from a
    structurally equal region of another model, whose tensors have other names), after checking
    each candidate computes over the target's signature."""
    if not result.candidates:
        raise MlsoError(f"the search returned no candidate for region {region}", _BUG)
    want = _signature(target)
    fixed = []
    for i, c in enumerate(result.candidates):
        if _signature(c.graph) != want:
            raise MlsoError(
                f"search candidate {i} of region {region} has inputs/outputs {_signature(c.graph)}, "
                f"not the region's {want}",
                _BUG,
            )
        fixed.append(
            Candidate(
                c.graph.replace(input_names=target.input_names, output_names=target.output_names),
                c.estimate_us,
                c.kernels,
                c.bound,
            )
        )
    return SearchResult(
        tuple(fixed),
        result.states,
        result.pruned,
        result.verified,
        result.seconds,
        result.bound,
        result.partial,
        result.notes,
    )


def search_region(
    lr: LiftedRegion,
    options: SearchOptions,
    targets: tuple[str, ...],
    search: SearchFn,
    cache: SearchCache | None,
    listener: Listener,
) -> Searched:
    """One region: a cache hit, or a search (whose final result is then stored)."""
    rid = lr.region.id
    digest = graph_hash(lr.graph)
    t0 = time.perf_counter()
    key = make_key(digest, options.cache_fields(), targets, search) if cache is not None else None
    hit = cache.get(key) if cache is not None else None
    if hit is not None:
        result = conform(hit, lr.graph, rid)
        return Searched(rid, digest, result, True, time.perf_counter() - t0)
    try:
        found = search(lr.graph, options, lambda p: listener.search_progress(rid, p))
    except BrokenProcessPool as exc:
        found = _worker_lost(lr.graph, options, exc)
    result = conform(found, lr.graph, rid)
    if cache is not None:
        cache.put(key, result)  # refuses partial results
    return Searched(rid, digest, result, False, time.perf_counter() - t0)
