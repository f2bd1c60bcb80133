"""`mlso optimize MODEL -o OUT`: load -> partition -> lift -> (search) -> codegen -> package.

Until the search lands, each region's candidate is its lifted program. The never-slower rule
keeps the original region unless the candidate's estimated speedup (cost model, or measured with
--gpu) reaches --min-speedup; tests use --min-speedup 0 to force packaging.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import click

from mlso_cli.commands.options import input_shape_option, json_option
from mlso_cli.console import chatty, stderr
from mlso_cli.errors import InputError, UsageError
from mlso_cli.frontend.analyse import analyse
from mlso_cli.frontend.load import load_model, parse_input_shapes
from mlso_cli.search.cost import onnx_region_cost, program_cost


@dataclass
class Decision:
    region: int
    label: str
    before_us: float
    after_us: float
    kernels: int
    packaged: bool
    why: str

    @property
    def speedup(self) -> float:
        return self.before_us / self.after_us if self.after_us else 0.0


def _check_paths(model: str, out: str, force: bool) -> None:
    if model != "-" and Path(out).resolve() == Path(model).resolve():
        raise UsageError("-o names the input model; mlso never overwrites its input", "Choose another output path")
    if Path(out).exists() and not force:
        raise UsageError(f"{out} already exists", "Pass --force to replace it, or choose another path")
    parent = Path(out).resolve().parent
    if not parent.is_dir():
        raise InputError(f"output folder {parent} does not exist", "Create it first")


@click.command("optimize")
@click.argument("model", metavar="MODEL")
@click.option("-o", "--output", "out", required=True, metavar="OUT", help="Where to write the optimized model.")
@input_shape_option
@json_option
@click.option("--min-speedup", default=1.0, show_default=True, type=float,
              help="Keep a region's original nodes unless mlso's program is at least this much faster.")
@click.option("--seed", default=0, show_default=True, help="Seed for verification and search.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists (never the input).")
@click.option("--gpu", type=int, default=None,
              help="Measure each region and its program on this GPU; the never-slower rule then uses the measurement.")
def optimize_cmd(model, out, input_shapes, as_json, min_speedup, seed, force, gpu) -> None:
    """Rewrite MODEL so each fusable region runs as one mlso kernel program."""
    _check_paths(model, out, force)
    if min_speedup < 0:
        raise UsageError("--min-speedup must be >= 0")
    if gpu is not None:
        from mlso_cli.commands.bench import _require_gpu

        _require_gpu(gpu)
    loaded = load_model(model, parse_input_shapes(input_shapes))
    analysis = analyse(loaded)
    decisions: list[Decision] = []
    for lr in analysis.lifted:
        before = onnx_region_cost(loaded, lr.region).us
        cost = program_cost(lr.graph)
        decisions.append(Decision(lr.region.id, lr.region.label, before, cost.us, cost.launches, False, ""))
    def wins(d: Decision) -> bool:
        return d.speedup >= min_speedup and (min_speedup == 0 or d.speedup > 1.0)

    # Without a GPU only the regions the cost model picks are compiled; with one, all are measured.
    builds = _compile([lr for lr, d in zip(analysis.lifted, decisions) if gpu is not None or wins(d)])
    if gpu is not None:
        _measure(loaded, analysis.lifted, builds, decisions, seed, gpu)
    chosen = []
    for lr, d in zip(analysis.lifted, decisions):
        how = "measured" if gpu is not None else "estimated"
        if wins(d):
            d.packaged, d.why = True, f"{how} {d.speedup:.2f}x"
            chosen.append(lr)
        else:
            d.why = f"kept original: {how} {d.speedup:.2f}x < {max(min_speedup, 1.0):g}x"
    packaged_model = _package(loaded, [(lr, builds[lr.region.id]) for lr in chosen], seed)
    from mlso_cli.package import write_model_atomic

    write_model_atomic(packaged_model, out, input_path=None if model == "-" else model)
    _report(decisions, out, as_json)


def _compile(lifted) -> dict:
    """Each region's program through codegen and nvcc (cached by source hash)."""
    from mlso_cli.codegen import compile_program
    from mlso_cli.package.assemble import Built

    builds = {}
    progress = _progress(len(lifted))
    for lr in lifted:
        prog = compile_program(lr.graph)
        builds[lr.region.id] = Built(lr.graph, prog.fatbin, prog.plan, prog.source_sha256)
        progress(lr.region.id)
    return builds


def _measure(loaded, lifted, builds, decisions, seed: int, gpu: int) -> None:
    """Time every region both ways on the GPU and replace the estimates by the measurements."""
    from mlso_cli.bench.harness import time_regions

    trial = _package(loaded, [(lr, builds[lr.region.id]) for lr in lifted], seed)
    for t in time_regions(trial, gpu):
        d = decisions[int(t.overload.lstrip("r"))]
        d.before_us, d.after_us = t.orig_us, t.kernel_us


def _package(loaded, items, seed: int):
    """Replace each (lifted region, built program) by an MlsoKernel node."""
    import onnx

    from mlso_cli.codegen import DEFAULT_TARGETS
    from mlso_cli.frontend.load import with_weights
    from mlso_cli.package import standard_metadata
    from mlso_cli.package.assemble import assemble

    model = onnx.ModelProto()
    model.CopyFrom(with_weights(loaded))
    # The lifted program is the region itself, lifted: equal by construction, so no field check
    # is needed here and the false-accept bound is 0. Searched programs will carry their bound.
    meta = standard_metadata(targets=DEFAULT_TARGETS, seed=seed, verification_bound=0.0)
    return assemble(model, items, meta)


def _progress(total: int):
    if not chatty() or total == 0:
        return lambda _rid: None
    con = stderr()
    state = {"done": 0}

    def tick(rid: int) -> None:
        state["done"] += 1
        con.print(f"  compiled region {rid} ({state['done']}/{total})")

    return tick


def _report(decisions: list[Decision], out: str, as_json: bool) -> None:
    if as_json:
        for d in decisions:
            click.echo(json.dumps({"type": "region", "region": d.region, "label": d.label, "packaged": d.packaged,
                                   "us_before": round(d.before_us, 3), "us_after": round(d.after_us, 3),
                                   "speedup": round(d.speedup, 3), "kernels": d.kernels, "why": d.why}))
        click.echo(json.dumps({"type": "summary", "output": out, "regions": len(decisions),
                               "packaged": sum(d.packaged for d in decisions)}))
    if chatty():
        from rich.table import Table

        t = Table(title=f"optimize -> {out}", title_justify="left")
        for col in ("region", "label", "before µs", "after µs", "speedup", "decision"):
            t.add_column(col)
        for d in decisions:
            t.add_row(str(d.region), d.label, f"{d.before_us:.1f}", f"{d.after_us:.1f}", f"{d.speedup:.2f}x",
                      "mlso kernel" if d.packaged else d.why)
        stderr().print(t)
