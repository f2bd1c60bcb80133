"""The whole pipeline as one call: load -> partition -> lift -> search -> select -> codegen -> package.

Why a library function: `mlso optimize` only parses flags into `PipelineOptions`, calls
`optimize()` and renders the `Outcome`; tests and scripts call the same function with a fake
search or a fake timer. Writing the model is left to the caller (`package.write_model_atomic`).

With a GPU, the packaged model then goes through the whole-model check (wholemodel.py): when it
is not measurably faster than the original in the serving mode, the Outcome's model is the
original (no region packaged) and every region's `why` says so. The caller therefore never
holds a slower model labelled optimized, and nothing is written before the check decided.
"""

from __future__ import annotations

from dataclasses import replace

import onnx

from mlso_cli.ir.hashing import graph_hash
from mlso_cli.pipeline.artifacts import (
    Choice,
    Lifted,
    Listener,
    ModelCheck,
    Outcome,
    PipelineOptions,
    RegionReport,
    Searched,
)
from mlso_cli.pipeline.build import Builder, package, set_metadata
from mlso_cli.pipeline.frontend import lift
from mlso_cli.pipeline.searching import conform, default_search, search_region
from mlso_cli.pipeline.select import MeasureFn, choose, measure_top_k
from mlso_cli.pipeline.wholemodel import ModelTimeFn, check_whole_model
from mlso_cli.search.api import SearchFn
from mlso_cli.search.cache import SearchCache
from mlso_cli.search.remote_cache import open_search_cache


def _cache(options: PipelineOptions) -> SearchCache | None:
    if not options.use_cache:
        return None
    from mlso_cli.knobs import knobs

    k = knobs()  # MLSO_SEARCH_CACHE: a shared directory or an fsspec URL (search/remote_cache.py)
    return open_search_cache(options.cache_dir or k.search_cache or k.cache_dir / "search")


def _time_regions(model, gpu: int) -> list:
    from mlso_cli.bench.harness import time_regions

    return time_regions(model, gpu)


def _pair_timer(rounds: int, iters: int) -> ModelTimeFn:
    def time_models(original, rewritten, gpu: int, mode: str):
        from mlso_cli.bench.pair import time_pair

        return time_pair(original, rewritten, gpu, mode, rounds=rounds, iters=iters)

    return time_models


def run_bound(searched: list[Searched]) -> float:
    """Union bound over every verification behind this run's results (each result's own bound
    already covers all candidates it verified), capped at 1. A result shared by structurally equal
    regions is one set of verifications, so it is counted once."""
    distinct = {s.region_hash: s.result.bound for s in searched}
    return min(1.0, sum(distinct.values()))


def optimize(
    source: str,
    input_shapes: dict[str, tuple[int, ...]] | None = None,
    options: PipelineOptions | None = None,
    *,
    search: SearchFn | None = None,
    measure: MeasureFn | None = None,
    time_models: ModelTimeFn | None = None,
    listener: Listener | None = None,
    dry_run: bool = False,
) -> Outcome:
    """Optimize the model at `source`; returns every region's search and choice, and the packaged
    model (None when `dry_run`: nothing is compiled unless --gpu must time, nothing packaged).

    `search` defaults to `default_search()`; `measure` (used only with `options.gpu`) to the bench
    harness's `time_regions`; `time_models` (the whole-model check, with `options.gpu`) to
    `bench.pair.time_pair`. A caller that injects `measure` but not `time_models` gets no
    whole-model check: fixed region figures and a real model timing measure different things."""
    from mlso_cli.codegen import DEFAULT_TARGETS
    from mlso_cli.package import META_SERVE

    options = options or PipelineOptions()
    listener = listener or Listener()
    if options.gpu is not None:
        from mlso_cli.pipeline.gpu import require_gpu

        require_gpu(options.gpu)
    lifted = lift(source, input_shapes)
    searched = _search_all(lifted, options, DEFAULT_TARGETS, search or default_search(), listener)
    builder = Builder(DEFAULT_TARGETS)
    timings = {}
    if options.gpu is not None:
        timings = measure_top_k(
            lifted.loaded,
            lifted.regions,
            searched,
            k=options.top_k,
            gpu=options.gpu,
            builder=builder,
            seed=options.seed,
            measure=measure or _time_regions,
        )
    choices = [
        choose(lifted.loaded, lr, s, options.min_speedup, timings.get(lr.region.id), options.serve)
        for lr, s in zip(lifted.regions, searched)
    ]
    bound = run_bound(searched)
    model, check = None, None
    if not dry_run:
        meta = {META_SERVE: options.serve}
        model = _package(lifted, choices, builder, options.seed, bound, listener, meta)
        if time_models is None and measure is None:
            time_models = _pair_timer(options.check_rounds, options.check_iters)
        if options.gpu is not None and time_models is not None and any(c.packaged for c in choices):
            original = package(
                lifted.loaded,
                [],
                targets=builder.targets,
                seed=options.seed,
                bound=bound,
                extra=meta,
            )
            model, choices, check = _checked(model, original, choices, options, time_models)
    reports = tuple(RegionReport(s, c) for s, c in zip(searched, choices))
    return Outcome(reports, model, bound, options.serve, check)


def _checked(
    rewritten: onnx.ModelProto,
    original: onnx.ModelProto,
    choices: list[Choice],
    options: PipelineOptions,
    time_models: ModelTimeFn,
) -> tuple[onnx.ModelProto, list[Choice], ModelCheck]:
    """The whole-model check applied: the model to write, the choices as they now stand, and
    the verdict (also recorded in the model's metadata)."""
    from mlso_cli.package import META_MODEL_CHECK

    check = check_whole_model(
        original, rewritten, options.gpu, options.serve, options.min_speedup, time_models
    )
    model = rewritten
    if not check.rewritten_kept:
        model = original
        choices = [
            replace(c, packaged=False, why=f"{check.why}; the region alone: {c.why}")
            if c.packaged
            else c
            for c in choices
        ]
    set_metadata(model, META_MODEL_CHECK, check.why)
    return model, choices, check


def _search_all(
    lifted: Lifted,
    options: PipelineOptions,
    targets: tuple[str, ...],
    search: SearchFn,
    listener: Listener,
) -> list[Searched]:
    """Each region in turn. Structurally equal regions (a transformer's repeated layers) are
    searched once per run: later ones reuse the first's result, even a partial one or with the
    disk cache off, and are reported as cached."""
    cache = _cache(options)
    out = []
    seen: dict[str, Searched] = {}
    total = len(lifted.regions)
    for i, lr in enumerate(lifted.regions):
        listener.region_started(lr.region.id, lr.region.label, i, total)
        digest = graph_hash(lr.graph)
        if digest in seen:
            first = seen[digest]
            s = Searched(
                lr.region.id, digest, conform(first.result, lr.graph, lr.region.id), True, 0.0
            )
        else:
            s = seen[digest] = search_region(lr, options.search, targets, search, cache, listener)
        listener.region_searched(lr.region.id, s)
        out.append(s)
    return out


def _package(
    lifted: Lifted,
    choices: list[Choice],
    builder: Builder,
    seed: int,
    bound: float,
    listener: Listener,
    meta: dict[str, str],
):
    items = []
    for lr, c in zip(lifted.regions, choices):
        if c.packaged:
            items.append((lr, builder.build(c.candidate.graph)))
            listener.compiled(lr.region.id)
    return package(
        lifted.loaded, items, targets=builder.targets, seed=seed, bound=bound, extra=meta
    )
