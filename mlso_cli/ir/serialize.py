"""JSON (de)serialisation of μGraphs, with a schema version.

Nodes are written once each, in topological order, as rows that refer to earlier rows by
index, so shared subterms stay shared. Block and thread graphs nest as their own tables.
"""

from __future__ import annotations

import json
from fractions import Fraction
from typing import Any

from mlso_cli.ir.graph import BlockGraph, InputMap, KernelGraph, OutputMap, ThreadGraph
from mlso_cli.ir.node import Node, toposort
from mlso_cli.ir.ops import DType, Op, Phase

SCHEMA_VERSION = 1


class SchemaError(ValueError):
    pass


def _arg_to_json(op: Op, arg: Any) -> Any:
    if op is Op.CONST:
        return f"{arg.numerator}/{arg.denominator}"
    if op is Op.CAST:
        return arg.value
    if op is Op.SAVE:
        return {"index": arg.index, "omap": list(arg.omap)}
    if op is Op.GRAPH_DEF:
        return _block_to_json(arg)
    if op is Op.THREAD:
        return {"body": _table(arg.body and [arg.body])}
    if isinstance(arg, tuple):
        return list(arg)
    return arg


def _arg_from_json(op: Op, arg: Any) -> Any:
    if op is Op.CONST:
        n, d = str(arg).split("/")
        return Fraction(int(n), int(d))
    if op is Op.CAST:
        return DType(arg)
    if op is Op.SAVE:
        return OutputMap(int(arg["index"]), tuple(arg["omap"]))
    if op is Op.GRAPH_DEF:
        return _block_from_json(arg)
    if op is Op.THREAD:
        return ThreadGraph(_untable(arg["body"])[0])
    if isinstance(arg, list):
        return tuple(arg)
    return arg


def _table(roots: list[Node]) -> dict:
    order = toposort(roots)
    index = {n: i for i, n in enumerate(order)}
    rows = []
    for n in order:
        row = {
            "op": n.op.value,
            "src": [index[s] for s in n.src],
            "shape": list(n.shape),
            "dtype": n.dtype.value,
        }
        if n.arg is not None:
            row["arg"] = _arg_to_json(n.op, n.arg)
        if n.phase is not None:
            row["phase"] = n.phase.value
        rows.append(row)
    return {"nodes": rows, "roots": [index[r] for r in roots]}


def _untable(t: dict) -> list[Node]:
    built: list[Node] = []
    try:
        for row in t["nodes"]:
            op = Op(row["op"])
            built.append(
                Node(
                    op,
                    tuple(built[i] for i in row["src"]),
                    _arg_from_json(op, row.get("arg")),
                    tuple(row["shape"]),
                    DType(row["dtype"]),
                    Phase(row["phase"]) if row.get("phase") else None,
                )
            )
        return [built[i] for i in t["roots"]]
    except (KeyError, IndexError, ValueError, TypeError) as exc:
        raise SchemaError(f"malformed μGraph node table: {exc}") from None


def _block_to_json(bg: BlockGraph) -> dict:
    return {
        "grid": list(bg.grid),
        "loop": bg.loop,
        "inputs": [{"imap": list(im.imap), "fmap": im.fmap} for im in bg.inputs],
        "body": _table(list(bg.outputs)),
    }


def _block_from_json(d: dict) -> BlockGraph:
    return BlockGraph(
        tuple(d["grid"]),
        int(d["loop"]),
        tuple(InputMap(tuple(im["imap"]), im["fmap"]) for im in d["inputs"]),
        tuple(_untable(d["body"])),
    )


def to_dict(kg: KernelGraph) -> dict:
    t = _table(list(kg.inputs) + list(kg.outputs))
    return {
        "schema": SCHEMA_VERSION,
        "input_names": list(kg.input_names),
        "output_names": list(kg.output_names),
        "num_inputs": len(kg.inputs),
        **t,
    }


def from_dict(d: dict) -> KernelGraph:
    if d.get("schema") != SCHEMA_VERSION:
        raise SchemaError(
            f"μGraph schema {d.get('schema')!r} is not {SCHEMA_VERSION}; re-run mlso optimize"
        )
    roots = _untable(d)
    k = int(d["num_inputs"])
    return KernelGraph(
        tuple(roots[:k]), tuple(roots[k:]), tuple(d["input_names"]), tuple(d["output_names"])
    )


def dumps(kg: KernelGraph) -> str:
    return json.dumps(to_dict(kg), sort_keys=True, separators=(",", ":"))


def loads(text: str) -> KernelGraph:
    """The μGraph in `text`; SchemaError (one line) for anything that is not one.

    Why ValueError and RecursionError, not only JSONDecodeError: the text comes from a model
    file, and an integer of more than 4300 digits raises a plain ValueError (Python's
    int_max_str_digits) and deep nesting a RecursionError; both escaped as tracebacks."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise SchemaError(f"μGraph JSON does not parse: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise SchemaError(f"μGraph JSON is a {type(data).__name__}, not an object")
    return from_dict(data)
