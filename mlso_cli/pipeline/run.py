"""The whole pipeline as one call: load -> partition -> lift -> search -> select -> codegen -> package.

Why a library function: `mlso optimize` only parses flags into `PipelineOptions`, calls
`optimize()` and renders the `Outcome`; tests and scripts call the same function with a fake
search or a fake timer. Writing the model is left to the caller (`package.write_model_atomic`).

Before anything is returned for writing, the packaged model goes through the verification
library that `mlso verify` runs (pipeline/verifying.py): a region whose program any check refuses
is kept original, with the reason in its `why`, and the bound written is the union of the field
bounds that check obtained. So optimize never returns a model that `mlso verify` refuses.

With a GPU, the packaged model then goes through the whole-model check (wholemodel.py): when it
is not measurably faster than the original in the serving mode, the Outcome's model is the
original (no region packaged) and every region's `why` says so. The caller therefore never
holds a slower model labelled optimized, and nothing is written before the check decided.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import onnx

from mlso_cli import interrupt
from mlso_cli.errors import InputError
from mlso_cli.frontend.lift import LiftedRegion
from mlso_cli.frontend.load import LoadedModel
from mlso_cli.ir.hashing import graph_hash
from mlso_cli.package.chunks import Tee
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
from mlso_cli.pipeline.select import MeasureFn, choose_bounded, measure_top_k
from mlso_cli.pipeline.verdicts import VerdictCache, original_id
from mlso_cli.pipeline.verifying import Original, check_before_writing, verify_seed
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


def _verdicts(options: PipelineOptions) -> VerdictCache | None:
    """Where verdicts of the check before writing are kept: beside the search cache's folder
    when one was given, else `<MLSO_CACHE_DIR>/verdicts`; none with --no-cache."""
    if not options.use_cache:
        return None
    from mlso_cli.knobs import knobs

    root = options.cache_dir.parent if options.cache_dir else knobs().cache_dir
    return VerdictCache(root / "verdicts")


def _time_regions(model, gpu: int) -> list:
    from mlso_cli.bench.harness import time_regions

    return time_regions(model, gpu)


def _pair_timer(rounds: int, iters: int) -> ModelTimeFn:
    def time_models(original, rewritten, gpu: int, mode: str):
        from mlso_cli.bench.pair import time_pair

        return time_pair(original, rewritten, gpu, mode, rounds=rounds, iters=iters)

    return time_models


def _say_lost(choice: Choice, lost: str | None) -> Choice:
    """A region some of whose GPU timing was lost on the cluster says so in its `why` (decided
    by the figures that came back, or by the cost model where none did)."""
    return choice if lost is None else replace(choice, why=f"{choice.why} ({lost})")


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
    tee: Tee | None = None,
) -> Outcome:
    """Optimize the model at `source`; returns every region's search and choice, and the packaged
    model (None when `dry_run`: nothing is compiled unless --gpu must time, nothing packaged).

    `search` defaults to `default_search()`; `measure` (used only with `options.gpu`) to the bench
    harness's `time_regions`; `time_models` (the whole-model check, with `options.gpu`) to
    `bench.pair.time_pair`. A caller that injects `measure` but not `time_models` gets no
    whole-model check: fixed region figures and a real model timing measure different things.
    `tee`: given the bytes of the model packaged first as the check before writing hashes them
    (the CLI's package.prefile.Prefile writes them to the output's temp file meanwhile)."""
    from mlso_cli.codegen import DEFAULT_TARGETS
    from mlso_cli.package import META_BOUND, META_SERVE

    options = options or PipelineOptions()
    listener = listener or Listener()
    if options.gpu is not None:
        from mlso_cli.pipeline.gpu import require_gpu

        require_gpu(options.gpu)
    lifted = lift(source, input_shapes)
    decided: dict[int, Choice] = {}

    def decide_now(lr, s: Searched) -> None:
        # a dry run without --gpu decides a region from its own search alone: report it at once
        # (otherwise timings, the check before writing and the whole-model check come later)
        if options.gpu is None and dry_run:
            c = choose_bounded(lifted.loaded, lr, s, options.min_speedup, None, options.serve)
            decided[lr.region.id] = c
            listener.region_decided(RegionReport(s, c))

    searched = _search_all(
        lifted, options, DEFAULT_TARGETS, search or default_search(), listener, decide_now
    )
    builder = Builder(DEFAULT_TARGETS)
    timings = {}
    lost: dict[int, str] = {}
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
            executor=options.search.executor,
            lost=lost,
        )
    choices = [
        decided.get(lr.region.id)
        or _say_lost(
            choose_bounded(
                lifted.loaded, lr, s, options.min_speedup, timings.get(lr.region.id), options.serve
            ),
            lost.get(lr.region.id),
        )
        for lr, s in zip(lifted.regions, searched)
    ]
    bound = run_bound(searched)
    model, check, vseed, reused, serialized = None, None, None, False, None
    if not dry_run:
        meta = {META_SERVE: options.serve}
        vseed = options.verify_seed
        if vseed is None:
            vseed = verify_seed(options.seed, fresh=False)
        rounds = iter(range(1 << 30))
        # the first packaging round makes the loaded model itself the packaged one (a copy of a
        # 478 MB model's weights is half a second of a cached rerun), where the file can be
        # read again for a later round: a regular file, without --gpu (which packages the
        # original after the check). Nothing reads `lifted.loaded` after that.
        held = {"loaded": lifted.loaded, "consumed": False}
        consumable = options.gpu is None and _rereadable(source, lifted.loaded)

        def pack(cs):
            # progress lines show "compiled" once, on the first packaging round
            first = next(rounds) == 0
            if held["consumed"]:
                held["loaded"], held["consumed"] = _reload(source, input_shapes, lifted), False
            consume = held["consumed"] = first and consumable
            return _package(
                lifted.regions,
                held["loaded"],
                cs,
                builder,
                options.seed,
                0.0,
                listener if first else Listener(),
                meta,
                consume,
            )

        checked = check_before_writing(
            _original(source, input_shapes, lifted),
            choices,
            pack,
            vseed,
            source=source,
            verdicts=_verdicts(options),
            fresh_seed=options.verify_seed_fresh,
            tee=tee,
        )
        model, choices, bound = checked.model, list(checked.choices), checked.bound
        vseed, reused, serialized = checked.seed, checked.cached, checked.serialized
        set_metadata(model, META_BOUND, str(bound))
        if time_models is None and measure is None:
            time_models = _pair_timer(options.check_rounds, options.check_iters)
        if options.gpu is not None and time_models is not None and any(c.packaged for c in choices):
            original = package(
                lifted.loaded,
                [],
                targets=builder.targets,
                seed=options.seed,
                bound=0.0,
                extra=meta,
            )
            model, choices, check = _checked(model, original, choices, options, time_models)
            if model is not checked.model:
                serialized = None  # the original is written: not the model serialized
    reports = tuple(RegionReport(s, c) for s, c in zip(searched, choices))
    for rep in reports:  # final only now: timings and the checks before writing may change them
        if rep.searched.region not in decided:
            listener.region_decided(rep)
    return Outcome(reports, model, bound, options.serve, check, vseed, reused, serialized)


def _original(source: str, input_shapes, lifted: Lifted) -> Original:
    """A as `mlso verify A B` loads it: the file as written (no constant folding), with its
    weights. Why not the folded model optimize works on: folding can leave a float32 constant
    where the fp64 reference expects a promoted one (a MatMul of float64 by float32 in
    deepseek's export). Read from stdin there is no file to read again; the folded model is
    the original then. Loaded only if the check runs (verifying.Original); named by the bytes
    the lift read where they are all of A (no external data)."""
    from mlso_cli.frontend.load import load_model, uses_external_data, with_weights

    loaded = lifted.loaded
    known = None
    if loaded.bytes_sha256 is not None and not uses_external_data(loaded.model):
        known = original_id(loaded.bytes_sha256, input_shapes, source == "-")
    if source == "-":
        return Original(lambda: with_weights(loaded), known)
    return Original(lambda: with_weights(load_model(source, input_shapes or {}, fold=False)), known)


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
    done=None,
) -> list[Searched]:
    """Each region in turn. Structurally equal regions (a transformer's repeated layers) are
    searched once per run: later ones reuse the first's result, even with the disk cache off.
    A final result reused is reported as cached; a partial one (the budget cut it) is never
    reported as cached: it keeps `partial`, and a note names the region it came from. `done`
    sees each region as soon as it is searched."""
    cache = _cache(options)
    out = []
    seen: dict[str, Searched] = {}
    total = len(lifted.regions)
    for i, lr in enumerate(lifted.regions):
        listener.region_started(lr.region.id, lr.region.label, i, total)
        digest = graph_hash(lr.graph)
        if digest in seen:
            first = seen[digest]
            result = conform(first.result, lr.graph, lr.region.id)
            if result.partial:
                # reused, not searched again (that would double the run's time), but a result
                # cut short is never "cached": the report says where it came from
                note = f"the partial result of region {first.region} (structurally equal), reused"
                result = replace(result, notes=(*result.notes, note))
            s = Searched(lr.region.id, digest, result, not result.partial, 0.0)
        else:
            s = seen[digest] = search_region(lr, options.search, targets, search, cache, listener)
        interrupt.check()
        listener.region_searched(lr.region.id, s)
        out.append(s)
        if done is not None:
            done(lr, s)
    return out


def _rereadable(source: str, loaded: LoadedModel) -> bool:
    """Whether `source` can be loaded again in this run and told to be what `loaded` was read
    from: a regular file whose bytes were hashed, with its weights inline (with external data
    the packaged model is a copy anyway, pipeline/build.py)."""
    from mlso_cli.frontend.load import is_stream, uses_external_data

    return (
        source != "-"
        and not is_stream(source)
        and loaded.bytes_sha256 is not None
        and not uses_external_data(loaded.model)
        and Path(source).is_file()
    )


def _reload(source: str, input_shapes, lifted: Lifted) -> LoadedModel:
    """The model as the lift loaded it, loaded again from the file (the first packaging round
    made the one loaded the packaged model); the same bytes load to the same model. InputError
    when the file no longer holds the bytes the run read."""
    from mlso_cli.frontend.load import load_model

    again = load_model(source, input_shapes or {}, digest=True)
    if again.bytes_sha256 != lifted.loaded.bytes_sha256:
        raise InputError(
            f"{source} changed while optimize ran",
            "Run optimize again once nothing writes the model",
        )
    return again


def _package(
    regions: list[LiftedRegion],
    loaded: LoadedModel,
    choices: list[Choice],
    builder: Builder,
    seed: int,
    bound: float,
    listener: Listener,
    meta: dict[str, str],
    consume: bool = False,
):
    builder.prebuild(
        [(c.candidate.graph, lr.extra_inputs) for lr, c in zip(regions, choices) if c.packaged]
    )
    items = []
    for lr, c in zip(regions, choices):
        if c.packaged:
            items.append((lr, builder.build(c.candidate.graph, lr.extra_inputs)))
            listener.compiled(lr.region.id)
    return package(
        loaded,
        items,
        targets=builder.targets,
        seed=seed,
        bound=bound,
        extra=meta,
        consume=consume,
    )
