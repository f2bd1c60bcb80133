"""`mlso inspect MODEL`: what is fusable, what is not, and why."""

from __future__ import annotations

import json
from pathlib import Path

import click
import onnx
from rich.table import Table

from mlso_cli.commands.options import input_shape_option, json_option
from mlso_cli.console import chatty, stderr
from mlso_cli.errors import InputError, MlsoError
from mlso_cli.frontend.analyse import analyse
from mlso_cli.frontend.load import load_model, parse_input_shapes, read_proto
from mlso_cli.frontend.partition import PartitionBounds
from mlso_cli.frontend.report import partition_reports
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
    kernels = None
    if model != "-":
        raw, base_dir = read_proto(model)  # before loading: a hostile model may not load
        kernels = _check_kernels(raw, base_dir, model)
    loaded = load_model(model, parse_input_shapes(input_shapes))
    if kernels is None:
        kernels = _check_kernels(loaded.model, loaded.base_dir, loaded.source)
    part = analyse(
        loaded, PartitionBounds(max_ops=max_ops, max_contractions=max_contractions)
    ).partition
    reports = partition_reports(loaded, part)
    if as_json:
        for r in reports:
            click.echo(json.dumps({"type": "region", **r.to_json()}))
        for k in kernels:
            click.echo(json.dumps({"type": "mlso_kernel", **k, "executable_code": True}))
    if chatty():
        _print_tables(loaded.source, reports, part)
    bad = [k for k in kernels if not k["valid"]]
    if bad:
        raise InputError(
            f"{len(bad)} of {len(kernels)} MlsoKernel node(s) in {loaded.source} failed their plan or hash check",
            "Do not run this model with the mlso library; re-run `mlso optimize` on the original model",
        )


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
        stderr().print(
            f"[bold yellow]note:[/] {source} carries executable GPU code: {len(rows)} mlso kernel "
            f"node(s) (ai.mlso::MlsoKernel){where}; each plan and binary hash was checked",
            markup=True,
            highlight=False,
        )
        for r in rows:
            if not r["valid"]:
                click.echo(f"mlso: error: {r['problem']}", err=True)
    return rows


def _print_tables(source: str, reports, part) -> None:
    con = stderr()
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
    if part.splits:
        con.print("[bold]Splits[/bold]")
        for s in part.splits:
            con.print(f"  {s}")
    if part.excluded:
        ex = Table(title=f"{len(part.excluded)} node(s) left out", title_justify="left")
        ex.add_column("node")
        ex.add_column("op")
        ex.add_column("reason", overflow="fold")
        for e in part.excluded:
            ex.add_row(e.name, e.op_type, e.reason)
        con.print(ex)
