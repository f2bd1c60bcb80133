"""`mlso inspect MODEL`: what is fusable, what is not, and why.

`--json` prints, one object a line: a `region` row per region, a `split` row per cut between
regions, a `left_out` row per node of the model file in no region (folded shape arithmetic
included), then an `mlso_kernel` row per MlsoKernel node. Region and left_out rows together
name every node of the file's main graph exactly once (schema: README.md, "inspect --json").
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click
import onnx
from rich.markup import escape
from rich.table import Table

from mlso_cli.commands.options import input_shape_option, json_option
from mlso_cli.console import chatty, stderr, summary
from mlso_cli.errors import InputError, MlsoError
from mlso_cli.frontend.analyse import analyse
from mlso_cli.frontend.load import load_model, parse_input_shapes, read_proto
from mlso_cli.frontend.partition import PartitionBounds
from mlso_cli.frontend.report import InspectReport, inspect_report
from mlso_cli.package.shapes import recorded_input_shapes
from mlso_cli.runtime.check import check_one, iter_mlso_nodes


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _fmt_flops(n: int) -> str:
    for unit, k in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return str(n)


@click.command("inspect")
@click.argument("model", metavar="MODEL")
@input_shape_option
@json_option
@click.option(
    "--max-ops",
    default=PartitionBounds.max_ops,
    show_default=True,
    help="Split regions with more ops than this.",
)
@click.option(
    "--max-contractions",
    default=PartitionBounds.max_contractions,
    show_default=True,
    help="Split regions with more MatMul-like ops than this.",
)
def inspect_cmd(
    model: str, input_shapes: tuple[str, ...], as_json: bool, max_ops: int, max_contractions: int
) -> None:
    """Show the fusable regions of MODEL (a path, or - for stdin) and why other nodes are left out.

    A model with MlsoKernel nodes (anywhere, If/Loop bodies included) carries executable GPU
    code: that is always said on stderr, and every such node's plan and binary hash are checked
    as the runtime would. Each failure is printed; any failure makes the command exit 1, after
    the usual report, so a tampered model never looks clean.
    """
    # The file as it is, read before loading: a hostile model may not load, and the report
    # names the file's nodes (loading folds some away).
    raw, base_dir = read_proto(model)
    kernels = _check_kernels(raw, base_dir, model if model != "-" else "stdin")
    with _stdin_holding(raw if model == "-" else None):
        loaded = load_model(model, parse_input_shapes(input_shapes))
    part = analyse(
        loaded, PartitionBounds(max_ops=max_ops, max_contractions=max_contractions)
    ).partition
    report = inspect_report(loaded, part, raw)
    if as_json:
        for r in report.regions:
            click.echo(json.dumps({"type": "region", **r.to_json()}))
        for s in report.splits:
            click.echo(json.dumps({"type": "split", **s.to_json()}))
        for e in report.left_out:
            click.echo(json.dumps({"type": "left_out", **e.to_json()}))
        for k in kernels:
            click.echo(json.dumps({"type": "mlso_kernel", **k, "executable_code": True}))
    if chatty():
        _print_tables(loaded.source, report)
    summary(
        f"inspect {loaded.source}: {len(report.regions)} fusable region(s), "
        f"{len(report.left_out)} node(s) left out"
        + (f", {len(kernels)} MlsoKernel node(s)" if kernels else "")
    )
    bad = [k for k in kernels if not k["valid"]]
    if bad:
        raise InputError(
            f"{len(bad)} of {len(kernels)} MlsoKernel node(s) in {loaded.source} failed their plan or hash check",
            "Do not run this model with the mlso library; re-run `mlso optimize` on the original model",
        )


@contextmanager
def _stdin_holding(model: onnx.ModelProto | None) -> Iterator[None]:
    """Serve `model` as stdin while the loader reads it (None: leave stdin alone).

    Why: a model on stdin can be read only once, and inspect needs it twice: as the file holds
    it (read_proto, above) and loaded. The loader reads stdin itself, so it gets the same bytes
    again; serializing a parsed model gives back an equal model."""
    if model is None:
        yield
        return
    saved = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(model.SerializeToString()))
    try:
        yield
    finally:
        sys.stdin = saved


def _check_kernels(model: onnx.ModelProto, base_dir: Path | None, source: str) -> list[dict]:
    """Check every MlsoKernel node (subgraphs included); say on stderr that the model carries
    executable code and print each failure. Returns one JSON-ready row per node."""
    rows = []
    for path, index, node, inits, types in iter_mlso_nodes(model):
        row = {
            "node": node.name,
            "graph": path or "main",
            "index": index,
            "inputs": list(node.input),
            "outputs": list(node.output),
            "valid": True,
            "problem": None,
        }
        try:
            row["binary_sha256"] = check_one(
                node, index, path, inits, types, base_dir
            ).binary_sha256
        except MlsoError as exc:
            row.update(valid=False, problem=exc.one_line())
        rows.append(row)
    if rows:
        nested = sum(r["graph"] != "main" for r in rows)
        where = f", {nested} of them inside subgraphs" if nested else ""
        shapes = recorded_input_shapes(model) or {}
        made_for = " ".join(
            f"{n}=" + ",".join("N" if d is None else str(d) for d in dims)
            for n, dims in shapes.items()
        )
        made_for = (
            f"; it was optimized for input shape {made_for} and runs only at it" if shapes else ""
        )
        stderr().print(
            f"[bold yellow]note:[/] {escape(source)} carries executable GPU code: {len(rows)} mlso "
            f"kernel node(s) (ai.mlso::MlsoKernel){where}; each plan and binary hash was checked"
            + escape(made_for),
            markup=True,
            highlight=False,
        )
        for r in rows:
            if not r["valid"]:
                click.echo(f"mlso: error: {r['problem']}", err=True)
    return rows


def _print_tables(source: str, report: InspectReport) -> None:
    con = stderr()
    reports = report.regions
    table = Table(title=f"{source}: {len(reports)} fusable region(s)", title_justify="left")
    for col in (
        "id",
        "label",
        "ops",
        "inputs",
        "outputs",
        "dtype",
        "FLOPs",
        "DRAM unfused",
        "DRAM fused min",
    ):
        table.add_column(col, overflow="fold")
    for r in reports:
        ops = ", ".join(f"{k}×{v}" if v > 1 else k for k, v in r.ops.items())
        ins = "\n".join(f"{i['name']} {tuple(i['shape'])}" for i in r.inputs)
        outs = "\n".join(f"{o['name']} {tuple(o['shape'])}" for o in r.outputs)
        table.add_row(
            str(r.region),
            r.label,
            ops,
            ins,
            outs,
            r.dtype,
            _fmt_flops(r.flops),
            _fmt_bytes(r.dram_bytes_unfused),
            _fmt_bytes(r.dram_bytes_fused_min),
        )
    con.print(table)
    if report.splits:
        con.print("[bold]Splits[/bold]")
        for s in report.splits:
            con.print(f"  {s.reason}", markup=False, highlight=False)
    if report.left_out:
        ex = Table(
            title=f"{len(report.left_out)} of {report.node_count} node(s) left out",
            title_justify="left",
        )
        ex.add_column("node")
        ex.add_column("op")
        ex.add_column("reason", overflow="fold")
        for e in report.left_out:
            ex.add_row(e.node.name, e.node.op_type, e.reason)
        con.print(ex)
