"""A readable text form of μGraphs, for logs, `inspect` and snapshot tests."""

from __future__ import annotations

from mlso_cli.ir.graph import PARTIAL, BlockGraph, KernelGraph
from mlso_cli.ir.node import Node, toposort
from mlso_cli.ir.ops import Op


def _arg(n: Node) -> str:
    if n.arg is None:
        return ""
    if n.op is Op.CONST:
        v = n.arg
        return f" {v.numerator}" if v.denominator == 1 else f" {float(v):.6g}"
    if n.op is Op.CAST:
        return f" to={n.arg.value}"
    if n.op is Op.SAVE:
        om = ",".join("P" if d == PARTIAL else "-" if d is None else str(d) for d in n.arg.omap)
        return f" out={n.arg.index} omap=({om})"
    if n.op in (Op.GRAPH_DEF, Op.THREAD):
        return ""
    return f" {n.arg}"


def format_block(bg: BlockGraph, indent: str = "    ") -> list[str]:
    lines = [f"{indent}grid={bg.grid} loop={bg.loop}"]
    for i, im in enumerate(bg.inputs):
        imap = ",".join("-" if d is None else str(d) for d in im.imap)
        lines.append(f"{indent}in{i}: imap=({imap}) fmap={'-' if im.fmap is None else im.fmap}")
    names: dict[Node, str] = {}
    for n in toposort(list(bg.outputs)):
        names[n] = f"%b{len(names)}"
        srcs = ", ".join(names[s] for s in n.src)
        lines.append(
            f"{indent}{names[n]} = {n.op.value}{_arg(n)}({srcs}) {n.dtype.value}{list(n.shape)} [{n.phase.value if n.phase else '?'}]"
        )
    return lines


def format_graph(kg: KernelGraph) -> str:
    names: dict[Node, str] = {}
    lines = ["kernel graph"]
    for n in kg.nodes():
        names[n] = f"%{len(names)}"
        srcs = ", ".join(names[s] for s in n.src)
        label = f" {kg.input_names[n.arg]}" if n.op is Op.INPUT else _arg(n)
        lines.append(f"  {names[n]} = {n.op.value}{label}({srcs}) {n.dtype.value}{list(n.shape)}")
        if n.op is Op.GRAPH_DEF:
            lines.extend(format_block(n.arg))
    outs = ", ".join(f"{name}={names[o]}" for name, o in zip(kg.output_names, kg.outputs))
    lines.append(f"  return {outs}")
    return "\n".join(lines)
