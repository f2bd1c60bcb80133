"""`mlso optimize MODEL -o OUT`: flags -> `mlso_cli.pipeline.optimize` -> report, then write.

Why so thin: the stages (load, partition, lift, search, select, codegen, package) are a library
(mlso_cli/pipeline/) that tests and scripts call directly; this module parses flags, shows
progress, prints the report and writes OUT atomically. Nothing here decides anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import click

from mlso_cli.commands.options import input_shape_option, json_option
from mlso_cli.console import chatty, line, plain, stderr, summary
from mlso_cli.errors import InputError, UsageError
from mlso_cli.frontend.load import parse_input_shapes
from mlso_cli.package.prefile import Prefile
from mlso_cli.pipeline import (
    CUDA_GRAPH,
    SERVE_MODES,
    Choice,
    Listener,
    ModelCheck,
    Outcome,
    PipelineOptions,
    RegionReport,
    Searched,
    optimize,
)
from mlso_cli.pipeline.verifying import verify_seed
from mlso_cli.search.api import (
    DEFAULT_STATES_CAP,
    STATES_PER_SIGNATURE,
    SearchOptions,
    SearchProgress,
)
from mlso_cli.search.executor import check_spec


def _check_paths(model: str, out: str, force: bool) -> None:
    """Fail before the search, not after it: the writer checks again when it places the file (a
    run that loses a race for OUT then exits 1), but a wrong -o should not cost a search."""
    from mlso_cli.package.write import check_output_path

    if model != "-" and Path(out).resolve() == Path(model).resolve():
        raise UsageError(
            "-o names the input model; mlso never overwrites its input",
            "Choose another output path",
        )
    check_output_path(
        Path(out), replace=True
    )  # a symlink, directory, device or FIFO: exit 1, even with --force
    if os.path.lexists(out) and not force:
        raise UsageError(
            f"{out} already exists", "Pass --force to replace it, or choose another path"
        )
    parent = Path(out).resolve().parent
    if not parent.is_dir():
        raise InputError(f"output folder {parent} does not exist", "Create it first")


def _default_jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _check_numbers(
    min_speedup: float,
    budget: float | None,
    max_states: int | None,
    jobs: int,
    top_k: int,
    seed: int = 0,
    gpu: int | None = None,
) -> None:
    rules = [
        (min_speedup < 0, "--min-speedup must be >= 0"),
        (seed < 0, "--seed must be >= 0 (numpy's generators take no negative seed)"),
        (gpu is not None and gpu < 0, "--gpu must be a GPU index >= 0"),
        (budget is not None and budget <= 0, "--budget must be a positive number of seconds"),
        (max_states is not None and max_states < 1, "--max-states must be at least 1"),
        (jobs < 1, "--jobs must be at least 1"),
        (top_k < 1, "--top-k must be at least 1"),
    ]
    for bad, what in rules:
        if bad:
            raise UsageError(what)


@click.command("optimize")
@click.argument("model", metavar="MODEL")
@click.option(
    "-o",
    "--output",
    "out",
    default=None,
    metavar="OUT",
    help="Where to write the optimized model (optional with --dry-run).",
)
@input_shape_option
@json_option
@click.option(
    "--min-speedup",
    default=1.0,
    show_default=True,
    type=float,
    help="Keep a region's original nodes unless mlso's program is at least this much faster.",
)
@click.option(
    "--seed",
    type=int,
    default=None,
    help="Seed for the search (default 0) and for the check before writing (default: fresh from "
    "the OS each run, as verify's; with --seed, derived from it, so runs write the same bytes).",
)
@click.option("--force", is_flag=True, help="Replace OUT if it exists (never the input).")
@click.option(
    "--gpu",
    type=int,
    default=None,
    help="Time the best candidates on this GPU; the never-slower rule then uses the measurement, "
    "and the whole rewritten model is checked against the original.",
)
@click.option(
    "--serve",
    type=click.Choice(SERVE_MODES),
    default=CUDA_GRAPH,
    show_default=True,
    help="How the model will be served in ONNX Runtime: replayed by its CUDA graph, or plain "
    "runs. The never-slower rule compares both sides in this mode only.",
)
@click.option(
    "--budget",
    type=float,
    default=None,
    metavar="SECONDS",
    help="Stop each region's search after this many seconds, checks included (within 10%). "
    "What it verified by then is used; a result cut short is never cached. [default: no limit]",
)
@click.option(
    "--max-states",
    type=int,
    default=None,
    metavar="N",
    help="Explore at most N candidate programs per region. The same N gives the same result "
    "on any machine, so it is cached; 20000 is enough for small models. [default: "
    f"{STATES_PER_SIGNATURE:,} per tiling of the region, up to {DEFAULT_STATES_CAP:,} in all: "
    "up to minutes per region on 2 cores]",
)
@click.option(
    "--jobs",
    type=int,
    default=None,
    metavar="N",
    help="Search worker processes [default: the cores].",
)
@click.option(
    "--executor",
    default="local",
    show_default=True,
    metavar="local|ray[=ADDRESS]",
    help="Where the search runs: a local process pool, or Ray tasks on the cluster at ADDRESS "
    "(plain ray: RAY_ADDRESS, else one `ray start` left here, else a new local cluster of --jobs "
    "CPUs). Same output either way.",
)
@click.option(
    "--top-k",
    type=int,
    default=3,
    show_default=True,
    help="With --gpu: candidates verified at full shapes and timed per region (without --gpu "
    "the best-estimated one is verified).",
)
@click.option("--dry-run", is_flag=True, help="Search and report; compile and write nothing.")
@click.option("--no-cache", is_flag=True, help="Search again even when a cached result exists.")
def optimize_cmd(
    model,
    out,
    input_shapes,
    as_json,
    min_speedup,
    seed,
    force,
    gpu,
    serve,
    budget,
    max_states,
    jobs,
    executor,
    top_k,
    dry_run,
    no_cache,
) -> None:
    """Rewrite MODEL so each fusable region runs as the fastest verified mlso program found."""
    jobs = _default_jobs() if jobs is None else jobs
    fresh = seed is None
    seed = 0 if seed is None else seed
    _check_numbers(min_speedup, budget, max_states, jobs, top_k, seed, gpu)
    executor = str(check_spec(executor))  # exit 2 for a bad spec, 4 for ray not installed
    if out is None and not dry_run:
        raise UsageError(
            "optimize needs -o OUT",
            "Name the output model with -o, or pass --dry-run to only report",
        )
    if out is not None and not dry_run:
        _check_paths(model, out, force)
    options = PipelineOptions(
        search=SearchOptions(
            budget_s=budget,
            max_states=max_states,
            jobs=jobs,
            executor=executor,
            seed=seed,
            full_checks=top_k if gpu is not None else 1,
        ),
        min_speedup=min_speedup,
        seed=seed,
        gpu=gpu,
        top_k=top_k,
        use_cache=not no_cache,
        serve=serve,
        verify_seed=verify_seed(seed, fresh=fresh),
        verify_seed_fresh=fresh,
    )
    # the output's temp file, written while the check before writing hashes the model; removed
    # on any way out that does not place it (package/prefile.py)
    prefile = None if dry_run else Prefile(out)
    with prefile or contextlib.nullcontext():
        with _Display(as_json) as display:
            outcome = optimize(
                model,
                parse_input_shapes(input_shapes),
                options,
                listener=display,
                dry_run=dry_run,
                tee=prefile,
            )
        if not dry_run:
            from mlso_cli.interrupt import check, written
            from mlso_cli.package import write_model_atomic

            check()  # a Ctrl-C whose KeyboardInterrupt got lost on the way: write nothing

            write_model_atomic(
                outcome.model,
                out,
                input_path=None if model == "-" else model,
                replace=force,
                serialized=outcome.serialized,
                prefile=prefile,
            )
            written(out)
    _report(outcome, None if dry_run else out, as_json, streamed=display.streamed)
    summary(
        f"optimize: {len(outcome.regions)} region(s), {outcome.packaged} packaged, "
        f"{sum(r.searched.result.partial for r in outcome.regions)} search(es) cut short; "
        + (
            "checks before writing reused (these bytes were checked before); "
            if outcome.verdict_cached
            else ""
        )
        + f"wrote {out}"
        if not dry_run
        else f"optimize: {len(outcome.regions)} region(s), {outcome.packaged} would be packaged "
        "(dry run: nothing written)"
    )


PROGRESS_EVERY_S = 10.0
"""Plain progress lines (a log, a pipe, -v): at most one per region this often, plus its start
and its end, so a batch log grows while the search runs and stays short."""


class _Display(Listener):
    """Progress on stderr: per region, states visited, pruned, verified, best so far, elapsed.

    On a terminal, rich's live display. With -v, or whenever stderr is not a terminal, plain
    lines, flushed, at most every PROGRESS_EVERY_S per region (a live display would reach a log
    as one blob at the end, and a job killed by a timeout left an empty log). With --json, each
    region's object goes to stdout as soon as the region is decided."""

    def __init__(self, as_json: bool = False) -> None:
        self._progress = None
        self._tasks: dict[int, int] = {}
        self._plain = plain()
        self._labels: dict[int, str] = {}
        self._last: dict[int, float] = {}
        self._as_json = as_json
        self.streamed = False
        """Every region's JSON object went out already (the report prints only the summary)."""

    def region_decided(self, report: RegionReport) -> None:
        if self._as_json:
            click.echo(json.dumps(_region_row(report)))
            sys.stdout.flush()
            self.streamed = True

    def __enter__(self) -> _Display:
        if chatty() and not self._plain:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                console=stderr(),
            )
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def region_started(self, region: int, label: str, index: int, total: int) -> None:
        if self._plain:
            self._labels[region] = f"region {region} ({label}) {index + 1}/{total}"
            self._last[region] = time.monotonic()
            line(f"mlso: {self._labels[region]}: searching")
        if self._progress is not None:
            self._tasks[region] = self._progress.add_task(
                f"region {region} ({label}) {index + 1}/{total}", total=None, stats="searching"
            )

    def search_progress(self, region: int, progress: SearchProgress) -> None:
        if self._plain and region in self._labels:
            now = time.monotonic()
            if now - self._last[region] >= PROGRESS_EVERY_S:
                self._last[region] = now
                best = "-" if progress.best_us is None else f"{progress.best_us:.1f} us"
                line(
                    f"mlso: {self._labels[region]}: states {progress.states}  pruned "
                    f"{progress.pruned}  verified {progress.verified}  best {best}  "
                    f"elapsed {progress.elapsed_s:.0f} s"
                )
        if self._progress is not None and region in self._tasks:
            best = "-" if progress.best_us is None else f"{progress.best_us:.1f} µs"
            stats = (
                f"states {progress.states}  pruned {progress.pruned}  verified {progress.verified}  "
                f"best {best}"
            )
            if progress.finished is not None:
                stats += (
                    f"  tasks {progress.queued} queued {progress.running} running "
                    f"{progress.finished} done on {progress.nodes} node(s)"
                )
            self._progress.update(self._tasks[region], stats=stats)

    def region_searched(self, region: int, searched: Searched) -> None:
        if self._plain and region in self._labels:
            line(
                f"mlso: {self._labels[region]}: {_search_summary(searched).replace('µs', 'us')}"
                f"  in {searched.seconds:.1f} s"
            )
        if self._progress is not None and region in self._tasks:
            self._progress.update(
                self._tasks[region], stats=_search_summary(searched), total=1, completed=1
            )

    def compiled(self, region: int) -> None:
        if self._plain and region in self._labels:
            line(f"mlso: {self._labels[region]}: compiled")
        if self._progress is not None and region in self._tasks:
            task = self._progress.tasks[self._tasks[region]]
            self._progress.update(self._tasks[region], stats=f"{task.fields['stats']}; compiled")


def _search_summary(s: Searched) -> str:
    r = s.result
    if not s.searched:
        return "no search ran (the lifted program is the only candidate)"
    if s.cached:
        how = "cached"
    else:
        how = "partial (budget or interrupt)" if r.partial else "searched"
    best = r.best.estimate_us
    return f"{how}: states {r.states}  pruned {r.pruned}  verified {r.verified}  best {best:.1f} µs"


def _region_row(rep: RegionReport) -> dict:
    s, c, r = rep.searched, rep.choice, rep.searched.result
    return {
        "type": "region",
        "region": c.region,
        "label": c.label,
        "packaged": c.packaged,
        "serve": c.serve,
        "measured": c.measured,
        "us_before": round(c.before_us, 3),
        "us_after": round(c.after_us, 3),
        "speedup": round(c.speedup, 3),
        "program_us": _r(c.program_us),
        # the region's baseline program (library GEMMs plus generated kernels for the rest),
        # timed beside the picks with --gpu: as served, the original nodes in the same trial,
        # their ratio, and the program alone (all None without --gpu)
        "baseline_us": _r(c.baseline_us),
        "baseline_orig_us": _r(c.baseline_orig_us),
        "baseline_vs_ort": _r(c.baseline_vs_ort),
        "baseline_program_us": _r(c.baseline_program_us),
        "timed": {
            m.mode: {"orig_us": _r(m.orig_us), "served_us": _r(m.served_us)} for m in c.modes
        },
        "kernels": c.kernels,
        "estimate_us": round(c.estimate_us, 3),
        "onnx_estimate_us": _r(c.onnx_estimate_us),
        "why": c.why,
        # the MlsoKernel node's name in the model and in verify's report
        "node": f"mlso_region_{c.region}" if c.packaged else None,
        # the field bound the check before writing obtained (None: not packaged)
        "verified_bound": c.bound,
        "checks": c.checks,
        "searched": s.searched,
        "cached": s.cached,
        "partial": r.partial,
        "states": r.states,
        "pruned": r.pruned,
        "verified": r.verified,
        "candidates": len(r.candidates),
        # every program verified at full shapes, as the search ranked them (the chosen one, and
        # e.g. the fewest-launch alternative a user serving without CUDA graphs may prefer)
        "verified_programs": [
            {"kernels": v.kernels, "estimate_us": round(v.estimate_us, 3), "bound": v.bound}
            for v in r.candidates
            if v.bound > 0
        ],
        "search_s": round(s.seconds, 3),
        "bound": r.bound,
        "notes": list(r.notes),
        "hash": s.region_hash,
    }


def _baseline_cell(c: Choice) -> str:
    if c.baseline_us is None:
        return "-"
    ratio = c.baseline_vs_ort
    return f"{c.baseline_us:.1f}" + ("" if ratio is None else f" ({ratio:.2f}x)")


def _parity_line(outcome: Outcome) -> str:
    """How many timed regions' baseline programs run within BASELINE_PARITY of ORT's nodes."""
    from mlso_cli.pipeline.select import BASELINE_PARITY

    ratios = [
        (r.choice.baseline_vs_ort, r.choice.region)
        for r in outcome.regions
        if r.choice.baseline_vs_ort is not None
    ]
    if not ratios:
        return "library baseline: not timed"
    within = sum(x <= BASELINE_PARITY for x, _ in ratios)
    worst, region = max(ratios)
    return (
        f"library baseline within {BASELINE_PARITY:g}x of ONNX Runtime in {within} of "
        f"{len(ratios)} timed region(s) (worst {worst:.2f}x, region {region})"
    )


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _check_row(check: ModelCheck | None) -> dict | None:
    if check is None:
        return None
    return {
        "mode": check.mode,
        "ran": check.ran,
        "rewritten_kept": check.rewritten_kept,
        "orig_us": _r(check.orig_us),
        "rewritten_us": _r(check.rewritten_us),
        "speedup": _r(check.speedup),
        "speedup_iqr": None if check.speedup_iqr is None else [_r(x) for x in check.speedup_iqr],
        "rounds": check.rounds,
        "why": check.why,
    }


def _report(outcome: Outcome, out: str | None, as_json: bool, streamed: bool = False) -> None:
    if as_json:
        for rep in outcome.regions if not streamed else ():
            click.echo(json.dumps(_region_row(rep)))
        click.echo(
            json.dumps(
                {
                    "type": "summary",
                    "output": out,
                    "regions": len(outcome.regions),
                    "packaged": outcome.packaged,
                    "bound": outcome.bound,
                    "verify_seed": outcome.verify_seed,
                    "verdict_cached": outcome.verdict_cached,
                    "searched": sum(r.searched.searched for r in outcome.regions),
                    "cached": sum(r.searched.cached for r in outcome.regions),
                    "serve": outcome.serve,
                    "model_check": _check_row(outcome.check),
                }
            )
        )
    if chatty():
        from rich.table import Table

        t = Table(title=f"optimize -> {out or '(dry run: nothing written)'}", title_justify="left")
        # the baseline column only where a baseline was timed (--gpu)
        based = any(rep.choice.baseline_us is not None for rep in outcome.regions)
        cols = ("region", "label", "search", "before µs", "after µs", "speedup")
        for col in (*cols, *(("baseline µs (/ ORT)",) if based else ()), "decision"):
            t.add_column(col)
        for rep in outcome.regions:
            c = rep.choice
            t.add_row(
                str(c.region),
                c.label,
                _search_summary(rep.searched),
                f"{c.before_us:.1f}",
                f"{c.after_us:.1f}",
                f"{c.speedup:.2f}x",
                *((_baseline_cell(c),) if based else ()),
                f"mlso kernel mlso_region_{c.region} ({c.checks})" if c.packaged else c.why,
            )
        stderr().print(t)
        if based:
            stderr().print(_parity_line(outcome))
        stderr().print(f"served as: {outcome.serve}")
        if outcome.check is not None:
            stderr().print(outcome.check.why)
        seed = (
            "" if outcome.verify_seed is None else f" (checked with --seed {outcome.verify_seed})"
        )
        stderr().print(f"verification bound written: {outcome.bound:.3g}{seed}")
