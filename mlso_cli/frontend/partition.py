"""Partition a graph into maximal, convex, bounded regions of fusable ops.

1. Classify every node with the support table; unfusable nodes get a reason.
2. Join fusable neighbours into connected groups.
3. Make each group convex: a path that leaves a group and comes back (A -> outside -> B) would
   make the fused node depend on itself. Each node gets a "re-entry depth" (how many times a path
   from the group must leave it to reach the node); nodes of equal depth stay together.
4. Split groups larger than the search bounds at points in topological order, and report where.

Every cut (steps 3 and 4) is recorded as a `Cut` naming the nodes on either side, so `inspect`
can say why two neighbouring regions are not one. Recording changes no region.

Pattern labels are computed at the end from op counts, for reports only.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from mlso_cli.frontend.load import LoadedModel
from mlso_cli.frontend.support import NodeContext, OpKind, classify


@dataclass(frozen=True)
class PartitionBounds:
    """How large a region may be before it is split. Layout ops are free."""

    max_ops: int = 32
    max_contractions: int = 4


@dataclass(frozen=True)
class Region:
    id: int
    nodes: tuple[int, ...]
    """Indices into graph.node, in topological order."""
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    label: str
    ops: tuple[str, ...]


@dataclass(frozen=True)
class Excluded:
    index: int
    name: str
    op_type: str
    reason: str
    category: str = ""
    """Why, for machines: "constant", "unsupported" or "layout_only" here; empty for nodes
    excluded later (a region that could not be lifted, see frontend/analyse.py)."""


@dataclass(frozen=True)
class Cut:
    """One place where fusable nodes that are connected were put in different regions.

    `before` and `after` are graph.node indices on either side of the cut: for a size bound, the
    last node of the earlier segment and the first node of the next (in topological order); for
    convexity, a node and its direct consumer that landed at different re-entry depths.
    """

    cause: str
    """"max_ops", "max_contractions" (the partition bounds) or "convexity"."""
    reason: str
    before: int
    after: int
    limit: int | None = None
    """The bound that was hit (None for convexity)."""
    count: int | None = None
    """The count the segment would have reached with `after` in it (None for convexity)."""


@dataclass
class Partition:
    regions: list[Region] = field(default_factory=list)
    excluded: list[Excluded] = field(default_factory=list)
    splits: list[str] = field(default_factory=list)
    """The size-bound cuts as sentences (the same text as their `Cut.reason`)."""
    cuts: list[Cut] = field(default_factory=list)
    """Every cut, size bounds and convexity, in the order the partitioner made them."""


def constant_values(model: onnx.ModelProto, limit: int = 1 << 16) -> dict[str, np.ndarray]:
    """Small constants (initializers and Constant nodes) that conditions may inspect."""
    from mlso_cli.frontend.fold import constant_node_value

    out: dict[str, np.ndarray] = {}
    for t in model.graph.initializer:
        if (
            t.data_location != onnx.TensorProto.EXTERNAL
            and int(np.prod(t.dims, dtype=np.int64)) <= limit
        ):
            out[t.name] = numpy_helper.to_array(t)
    for n in model.graph.node:
        if n.op_type == "Constant":
            v = constant_node_value(n)
            if v is not None and v.size <= limit:
                out[n.output[0]] = v
    return out


def partition(loaded: LoadedModel, bounds: PartitionBounds | None = None) -> Partition:
    bounds = bounds or PartitionBounds()
    g = loaded.graph
    nodes = list(g.node)
    consts = constant_values(loaded.model)
    kinds: dict[int, OpKind] = {}
    result = Partition()
    for i, node in enumerate(nodes):
        kind, reason = classify(NodeContext(node, loaded.shapes, loaded.dtypes, consts))
        if kind is None:
            category = "constant" if node.op_type == "Constant" else "unsupported"
            result.excluded.append(
                Excluded(i, node.name or f"#{i}", node.op_type, reason or "unsupported", category)
            )
        else:
            kinds[i] = kind

    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    preds: dict[int, list[int]] = {
        i: sorted({producer[x] for x in n.input if x in producer}) for i, n in enumerate(nodes)
    }
    groups = _connected(kinds, preds)
    pieces: list[list[int]] = []
    for grp in groups:
        for convex in _convex_parts(grp, preds, len(nodes), nodes, result.cuts):
            pieces.extend(
                _split_to_bounds(convex, kinds, nodes, bounds, result.splits, result.cuts)
            )

    graph_outputs = {o.name for o in g.output}
    consumers: dict[str, set[int]] = defaultdict(set)
    for i, n in enumerate(nodes):
        for x in n.input:
            consumers[x].add(i)
    for piece in pieces:
        if not any(kinds[i] is not OpKind.LAYOUT for i in piece):
            for i in piece:
                result.excluded.append(
                    Excluded(
                        i,
                        nodes[i].name or f"#{i}",
                        nodes[i].op_type,
                        f"{nodes[i].op_type}: layout only, nothing to fuse around it",
                        "layout_only",
                    )
                )
            continue
        members = set(piece)
        produced = [o for i in piece for o in nodes[i].output if o]
        produced_set = set(produced)
        inputs: list[str] = []
        for i in piece:
            for x in nodes[i].input:
                if x and x not in produced_set and x not in inputs:
                    inputs.append(x)
        outputs = [o for o in produced if o in graph_outputs or (consumers[o] - members)]
        ops = tuple(nodes[i].op_type for i in piece)
        result.regions.append(
            Region(
                len(result.regions),
                tuple(piece),
                tuple(inputs),
                tuple(outputs),
                label_for(ops),
                ops,
            )
        )
    result.excluded.sort(key=lambda e: e.index)
    return result


def _connected(kinds: dict[int, OpKind], preds: dict[int, list[int]]) -> list[list[int]]:
    parent = {i: i for i in kinds}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i in kinds:
        for p in preds[i]:
            if p in kinds:
                parent[find(i)] = find(p)
    groups: dict[int, list[int]] = defaultdict(list)
    for i in sorted(kinds):
        groups[find(i)].append(i)
    return list(groups.values())


def _node_label(nodes: list[onnx.NodeProto], i: int) -> str:
    return f"{nodes[i].op_type} '{nodes[i].name or i}'"


def _convex_parts(
    group: list[int],
    preds: dict[int, list[int]],
    n: int,
    nodes: list[onnx.NodeProto],
    cuts: list[Cut],
) -> list[list[int]]:
    """Split a group so no path leaves a part and re-enters it (graph.node is topologically sorted).

    Every edge between two parts is recorded in `cuts`: the group was connected, so each part
    touches another through such an edge, and the edge is where a reader sees the regions meet."""
    members = set(group)
    lo = group[0]
    reach: dict[int, int] = {}  # max re-entry depth of group nodes that reach this node (-1: none)
    depth: dict[int, int] = {}
    for i in range(lo, group[-1] + 1):
        if i in members:
            d = 0
            for p in preds[i]:
                if p in members:
                    d = max(d, depth[p])
                elif reach.get(p, -1) >= 0:
                    d = max(d, reach[p] + 1)
            depth[i] = d
            reach[i] = d
        else:
            reach[i] = max((reach.get(p, -1) for p in preds[i]), default=-1)
    by_depth: dict[int, list[int]] = defaultdict(list)
    for i in group:
        by_depth[depth[i]].append(i)
    parts = []
    for d in sorted(by_depth):
        level = by_depth[d]
        sub = _connected({i: OpKind.COMPUTE for i in level}, preds)
        parts.extend(sub)
    if len(parts) > 1:
        part_of = {i: k for k, part in enumerate(parts) for i in part}
        for i in group:
            for p in preds[i]:
                if p in members and part_of[p] != part_of[i]:
                    cuts.append(
                        Cut(
                            "convexity",
                            f"cut for convexity: {_node_label(nodes, i)} (re-entry depth "
                            f"{depth[i]}) is fed by {_node_label(nodes, p)} (depth {depth[p]}); "
                            "a path that leaves the group comes back into it at or before "
                            f"{_node_label(nodes, i)}, and a region holds one depth so that it "
                            "never depends on itself",
                            p,
                            i,
                        )
                    )
    return parts


def _split_to_bounds(
    part: list[int],
    kinds: dict[int, OpKind],
    nodes: list[onnx.NodeProto],
    bounds: PartitionBounds,
    splits: list[str],
    cuts: list[Cut],
) -> list[list[int]]:
    """Cut a convex part into contiguous topological segments within the bounds."""
    out: list[list[int]] = []
    cur: list[int] = []
    ops = mms = 0
    for i in part:
        k = kinds[i]
        add_ops = 0 if k is OpKind.LAYOUT else 1
        add_mm = 1 if k is OpKind.CONTRACTION else 0
        if cur and (ops + add_ops > bounds.max_ops or mms + add_mm > bounds.max_contractions):
            if mms + add_mm > bounds.max_contractions:
                cause, count, limit = "max_contractions", mms + add_mm, bounds.max_contractions
                why = f"{count} contractions > {limit}"
            else:
                cause, count, limit = "max_ops", ops + add_ops, bounds.max_ops
                why = f"{count} ops > {limit}"
            text = f"region too large ({why}): split before {_node_label(nodes, i)}"
            splits.append(text)
            cuts.append(Cut(cause, text, cur[-1], i, limit, count))
            out.append(cur)
            cur, ops, mms = [], 0, 0
        cur.append(i)
        ops += add_ops
        mms += add_mm
    if cur:
        out.append(cur)
    # Segments are contiguous in topological order of a convex set, hence convex, but they may be
    # disconnected; keep each connected piece as its own region.
    return out


_NORMS = {"LayerNormalization", "RMSNormalization", "GroupNormalization", "BatchNormalization"}


def label_for(ops: tuple[str, ...]) -> str:
    """A name for reports only. Nothing downstream may branch on it."""
    c = Counter(ops)
    mm = c["MatMul"] + c["Gemm"]
    has_norm = bool(_NORMS & set(c)) or (c["ReduceMean"] >= 1 and (c["Sqrt"] or c["Reciprocal"]))
    if c["Attention"] or (c["Softmax"] and mm >= 2) or (c["Exp"] and c["ReduceSum"] and mm >= 2):
        return "qk-norm-attention" if has_norm else "attention"
    if mm >= 2 and c["Sigmoid"] and c["Mul"]:
        return "gated-mlp"
    if mm == 3 and c["Add"] and not has_norm:
        return "lora"
    if has_norm and mm:
        return "norm-linear"
    if has_norm:
        return "norm"
    if mm:
        return "linear"
    return "elementwise"
