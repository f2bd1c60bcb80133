"""Canonical content hash of a μGraph, stable across processes and Python versions.

The hash is over the canonical JSON of the graph, and the JSON lists nodes in a canonical
topological order (by structure, not by construction order), so graphs that differ only in the
order of independent ops hash the same. Python's hash() is salted per process and cannot be used.
"""

from __future__ import annotations

import hashlib
import json

from mlso_cli.ir.graph import KernelGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.serialize import _arg_to_json


def _digest(n: Node, memo: dict[Node, str]) -> str:
    got = memo.get(n)
    if got is not None:
        return got
    parts = {
        "op": n.op.value,
        "src": [_digest(s, memo) for s in n.src],
        "shape": list(n.shape),
        "dtype": n.dtype.value,
        "phase": n.phase.value if n.phase else None,
        "arg": _canonical_arg(n, memo),
    }
    h = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    memo[n] = h
    return h


def _canonical_arg(n: Node, memo: dict[Node, str]):
    from mlso_cli.ir.ops import Op

    if n.op is Op.GRAPH_DEF:
        bg = n.arg
        return {
            "grid": list(bg.grid),
            "loop": bg.loop,
            "inputs": [[list(im.imap), im.fmap] for im in bg.inputs],
            "outputs": [_digest(o, memo) for o in bg.outputs],
        }
    if n.op is Op.THREAD:
        return _digest(n.arg.body, memo)
    return _arg_to_json(n.op, n.arg)


def graph_hash(kg: KernelGraph) -> str:
    memo: dict[Node, str] = {}
    body = {
        "inputs": [_digest(i, memo) for i in kg.inputs],
        "outputs": [_digest(o, memo) for o in kg.outputs],
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
