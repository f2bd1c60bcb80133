"""`mlso inspect MODEL`: what is fusable, what is not, and why."""

from __future__ import annotations

import json

import click
from rich.table import Table

from mlso_cli.commands.options import input_shape_option, json_option
from mlso_cli.console import chatty, stderr
from mlso_cli.frontend.analyse import analyse
from mlso_cli.frontend.load import load_model, parse_input_shapes
from mlso_cli.frontend.partition import PartitionBounds
from mlso_cli.frontend.report import partition_reports


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
@click.option("--max-ops", default=PartitionBounds.max_ops, show_default=True, help="Split regions with more ops than this.")
@click.option("--max-contractions", default=PartitionBounds.max_contractions, show_default=True,
              help="Split regions with more MatMul-like ops than this.")
def inspect_cmd(model: str, input_shapes: tuple[str, ...], as_json: bool, max_ops: int, max_contractions: int) -> None:
    """Show the fusable regions of MODEL (a path, or - for stdin) and why other nodes are left out."""
    loaded = load_model(model, parse_input_shapes(input_shapes))
    part = analyse(loaded, PartitionBounds(max_ops=max_ops, max_contractions=max_contractions)).partition
    reports = partition_reports(loaded, part)
    kernels = [n for n in loaded.graph.node if n.domain == "ai.mlso"]
    if as_json:
        for r in reports:
            click.echo(json.dumps({"type": "region", **r.to_json()}))
        for n in kernels:
            click.echo(json.dumps({"type": "mlso_kernel", "node": n.name, "inputs": list(n.input),
                                   "outputs": list(n.output), "executable_code": True}))
    if chatty():
        _print_tables(loaded.source, reports, part)
        if kernels:
            stderr().print(f"[bold yellow]note:[/] this model carries executable GPU code: {len(kernels)} "
                           "mlso kernel node(s) (ai.mlso::MlsoKernel); the runtime checks each binary's hash")


def _print_tables(source: str, reports, part) -> None:
    con = stderr()
    table = Table(title=f"{source}: {len(reports)} fusable region(s)", title_justify="left")
    for col in ("id", "label", "ops", "inputs", "outputs", "dtype", "FLOPs", "DRAM unfused", "DRAM fused min"):
        table.add_column(col, overflow="fold")
    for r in reports:
        ops = ", ".join(f"{k}×{v}" if v > 1 else k for k, v in r.ops.items())
        ins = "\n".join(f"{i['name']} {tuple(i['shape'])}" for i in r.inputs)
        outs = "\n".join(f"{o['name']} {tuple(o['shape'])}" for o in r.outputs)
        table.add_row(str(r.region), r.label, ops, ins, outs, r.dtype, _fmt_flops(r.flops),
                      _fmt_bytes(r.dram_bytes_unfused), _fmt_bytes(r.dram_bytes_fused_min))
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
