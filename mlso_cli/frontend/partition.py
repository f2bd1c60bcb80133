"""Partition a graph into maximal, convex, bounded regions of fusable ops.

1. Classify every node with the support table; unfusable nodes get a reason.
2. Find the model's structure (`_find_structure`): the residual stream, the branch of each
   residual add, and the contraction boundaries inside a branch. Each node gets a label; only
   nodes of equal label may share a region. A model with no residual stream gets no labels and
   is partitioned by steps 3-5 alone, as before this step existed.
3. Join fusable neighbours (of equal label) into connected groups.
4. Make each group convex: a path that leaves a group and comes back (A -> outside -> B) would
   make the fused node depend on itself. Each node gets a "re-entry depth" (how many times a path
   from the group must leave it to reach the node); nodes of equal depth stay together.
5. Split groups larger than the search bounds at points in topological order, and report where.
6. Leave out groups of layout ops only, or of one elementwise op with views: nothing to fuse.

Every cut (steps 2, 4 and 5) is recorded as a `Cut` naming the nodes on either side, so `inspect`
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
    """How large a region may be before it is split. Layout ops are free.

    A safety net behind the model's structure, which is what bounds a region. Why 64 ops and not
    the 32 of before: ONNX counts an RMSNorm as 6 to 9 nodes (Cast, Pow, ReduceMean, Add, Sqrt,
    Reciprocal, Mul), so the norm -> QKV -> per-head QK-norm -> RoPE branch of Qwen3 and Gemma 3
    is 44 nodes, and 32 split its RoPE into a region of its own (a second write and read of q and
    k, and one more launch a layer), as the structure never would."""

    max_ops: int = 64
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
    """Why, for machines: "constant", "unsupported", "layout_only" or "single_op" (one
    elementwise op with nothing to fuse around it) here; empty for nodes excluded later (a region that could not be lifted, see frontend/analyse.py)."""


@dataclass(frozen=True)
class Cut:
    """One place where fusable nodes that are connected were put in different regions.

    `before` and `after` are graph.node indices on either side of the cut: for a size bound, the
    last node of the earlier segment and the first node of the next (in topological order); for
    convexity, a node and its direct consumer that landed at different re-entry depths.
    """

    cause: str
    """"max_ops", "max_contractions" (the partition bounds), "convexity", or one of the model's
    structure: "residual" (a residual add writes the stream, the next branch reads it),
    "projection" (a projection's output meets the contraction it feeds, or a projection reads
    a contraction of two computed values such as attention's P·V), "side_input" (a value
    computed beside the stream, e.g. a mask, is read by a region, not computed in it) or "branch"
    (two branches meet other than through the stream)."""
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
    structure = _find_structure(
        nodes, kinds, preds, producer, loaded.shapes, consts, {t.name for t in g.initializer}
    )
    joinable = preds
    if structure is not None:
        joinable = {}
        for i in range(len(nodes)):
            joinable[i] = []
            for p in preds[i]:
                if structure.label[p] == structure.label[i]:
                    joinable[i].append(p)
                elif i in kinds and p in kinds:
                    result.cuts.append(_structure_cut(structure, nodes, p, i))
    groups = _connected(kinds, joinable)
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
        compute = [i for i in piece if kinds[i] is not OpKind.LAYOUT]
        if (
            len(compute) == 1
            and kinds[compute[0]] is OpKind.COMPUTE
            and nodes[compute[0]].op_type not in ALONE_WORTH_A_REGION
        ):
            for i in piece:
                op = nodes[i].op_type
                why = (
                    f"{op}: one elementwise op: nothing to fuse"
                    if i == compute[0]
                    else f"{op}: layout only, beside one elementwise op: nothing to fuse"
                )
                result.excluded.append(Excluded(i, nodes[i].name or f"#{i}", op, why, "single_op"))
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


# ---- the model's structure: residual stream, branches, contraction boundaries ------------------

ROW_REDUCTIONS: dict[str, str] = {
    "ReduceMean": "axes",
    "ReduceSum": "axes",
    "ReduceSumSquare": "axes",
    "ReduceL2": "axes",
    "LayerNormalization": "axis",
    "RMSNormalization": "axis",
}
"""Ops that can start a branch of the residual stream: a normalisation reduces the stream value
over its last axis (a Reduce* whose axes hold the last one, or a normalisation op over trailing
axes, which always include the last). How the op names its axes: the `axes` input or attribute,
or an `axis` attribute that starts the trailing run."""

ALONE_WORTH_A_REGION: frozenset[str] = frozenset(
    {
        "Softmax",
        "LogSoftmax",
        "ReduceMean",
        "ReduceSum",
        "ReduceSumSquare",
        "ReduceL2",
        "ReduceMax",
        "LayerNormalization",
        "RMSNormalization",
        "GroupNormalization",
        "InstanceNormalization",
    }
)
"""Non-contraction ops worth a region even alone: they reduce (a row, a group), so a fused kernel
can do in one pass what the unfused graph does in several. Any other single op (elementwise, or
one the support table adds later) with only views around it is left out: nothing to fuse."""

_BRANCH_SEARCH_DEPTH = 6
"""How many elementwise or layout ops may stand between a stream value and the normalisation
that starts its branch (a Pow or a Cast before ReduceMean, say)."""


def _reduces_last_axis(
    node: onnx.NodeProto, shapes: dict[str, tuple[int, ...]], consts: dict[str, np.ndarray]
) -> bool:
    how = ROW_REDUCTIONS.get(node.op_type)
    if how is None or not node.input:
        return False
    rank = len(shapes.get(node.input[0], ()))
    if rank == 0:
        return False
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if how == "axis":
        axis = int(attrs.get("axis", -1))
        return -rank <= axis < rank
    if len(node.input) > 1 and node.input[1]:
        v = consts.get(node.input[1])
        axes = None if v is None else [int(a) for a in np.asarray(v).reshape(-1)]
    else:
        axes = [int(a) for a in attrs.get("axes", [])] or None
    return bool(axes) and any(a % rank == rank - 1 for a in axes)


def _bits(mask: int) -> list[int]:
    """The indices of the set bits of `mask`, in increasing order."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


@dataclass(frozen=True)
class _Structure:
    """What the partitioner knows of a residual-stream model. Labels group nodes: only nodes with
    equal labels may share a region. `why` names, per cut edge inside a branch, the projection
    whose output crosses it."""

    label: dict[int, tuple]
    branch: dict[int, int]
    stage: dict[int, int]
    stream_producers: frozenset[int]
    downstream: frozenset[int]
    consumers: dict[int, tuple[int, ...]]
    """Each node's consumer nodes."""
    explicit: dict[tuple[int, int], int]
    """(producer, consumer) -> the projection node whose output the edge carries into a
    contraction, or (`core_ends`) the contraction of two computed values whose result the edge
    carries into a projection."""
    core_ends: frozenset[int] = frozenset()
    """Contractions of two computed values (attention's P·V) whose result a projection reads."""


def _find_structure(
    nodes: list[onnx.NodeProto],
    kinds: dict[int, OpKind],
    preds: dict[int, list[int]],
    producer: dict[str, int],
    shapes: dict[str, tuple[int, ...]],
    consts: dict[str, np.ndarray],
    initializers: set[str],
) -> _Structure | None:
    """The residual stream and its branches, or None when the model has none (then the
    partition is the plain one: connected, convex, bounded).

    A residual add is an Add of two same-shaped tensors x and b, where x (the stream value) also
    feeds, through at most a few elementwise or layout ops, a normalisation over its last axis,
    and b is computed from that normalisation through at least one contraction. The branch of
    that add is every node on a path from x to b, plus the add itself."""
    n = len(nodes)
    constant_names = set(initializers) | {
        o for node in nodes if node.op_type == "Constant" for o in node.output
    }
    succs: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        for p in preds[i]:
            succs[p].append(i)
    consumers: dict[str, list[int]] = defaultdict(list)
    for i, node in enumerate(nodes):
        for x in dict.fromkeys(node.input):
            if x:
                consumers[x].append(i)
    desc = [0] * n
    for i in reversed(range(n)):
        m = 1 << i
        for c in succs[i]:
            m |= desc[c]
        desc[i] = m
    anc = [0] * n
    for i in range(n):
        m = 1 << i
        for p in preds[i]:
            m |= anc[p]
        anc[i] = m
    contractions = 0
    for i, k in kinds.items():
        if k is OpKind.CONTRACTION:
            contractions |= 1 << i

    def opens_branch(x: str, add: int, pb: int) -> bool:
        frontier = [c for c in consumers[x] if c != add]
        seen: set[int] = set()
        for _ in range(_BRANCH_SEARCH_DEPTH):
            nxt: list[int] = []
            for v in frontier:
                if v in seen or not (anc[pb] >> v) & 1 or kinds.get(v) is OpKind.CONTRACTION:
                    continue
                seen.add(v)
                if (
                    _reduces_last_axis(nodes[v], shapes, consts)
                    and desc[v] & contractions & anc[pb]
                ):
                    return True
                nxt.extend(succs[v])
            frontier = nxt
        return False

    adds: list[tuple[int, str, int]] = []  # (add, stream operand, producer of the branch operand)
    for a, node in enumerate(nodes):
        if node.op_type != "Add" or len(node.input) != 2 or not node.output[0]:
            continue
        shape = shapes.get(node.output[0])
        if not shape:
            continue
        for x, b in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
            pb = producer.get(b)
            if pb is None or shapes.get(x) != shape or shapes.get(b) != shape:
                continue
            if opens_branch(x, a, pb):
                adds.append((a, x, pb))
                break
    if not adds:
        return None

    stream_values = {x for _, x, _ in adds} | {nodes[a].output[0] for a, _, _ in adds}
    producers = frozenset({producer[t] for t in stream_values if t in producer})
    down = 0
    for t in stream_values:
        for c in consumers[t]:
            down |= desc[c]
    downstream = frozenset(_bits(down))
    branch: dict[int, int] = {}
    for k, (a, x, pb) in enumerate(adds):
        reach = 0
        for c in consumers[x]:
            if c != a:
                reach |= desc[c]
        for i in _bits((reach & anc[pb]) | (1 << a)):
            branch.setdefault(i, k)

    def independent(t: str) -> bool:
        """A tensor computed from no stream value: a weight (initializer, Constant, graph input
        that is not the stream, or a view of one)."""
        if t in stream_values:
            return False
        p = producer.get(t)
        return p is None or p not in downstream

    projection_of: dict[int, int | None] = {}
    for i in sorted(branch):
        if kinds.get(i) is OpKind.CONTRACTION:
            ops = [t for t in nodes[i].input[:2] if t]
            projection_of[i] = i if any(independent(t) for t in ops) else None
        else:
            projection_of[i] = next(
                (
                    projection_of[p]
                    for p in preds[i]
                    if branch.get(p) == branch[i] and projection_of[p] is not None
                ),
                None,
            )

    def n_consumers(i: int) -> int:
        return len({c for o in nodes[i].output if o for c in consumers[o]})

    explicit: dict[tuple[int, int], int] = {}
    core_ends: set[int] = set()
    for c in sorted(branch):
        if kinds.get(c) is not OpKind.CONTRACTION:
            continue
        for t in dict.fromkeys(nodes[c].input):
            w, nxt = producer.get(t), c
            last_view = (w, c)
            while (
                w is not None
                and branch.get(w) == branch[c]
                and kinds.get(w) is OpKind.LAYOUT
                and n_consumers(w) == 1
            ):
                w, nxt = producer.get(nodes[w].input[0]), w
            if w is not None and branch.get(w) == branch[c] and projection_of[w] is not None:
                explicit[(w, nxt)] = projection_of[w]  # type: ignore[assignment]
            elif (
                w is not None
                and projection_of[c] == c
                and not independent(t)
                and branch.get(w) == branch[c]
                and kinds.get(w) is OpKind.CONTRACTION
                and projection_of[w] is None
            ):
                # a projection (o_proj) reading a contraction of two computed values (P·V),
                # through views only: the attention core ends at P·V. Why: a fused attention
                # program saves P·V in its own [batch, heads, seq, d] layout; with the
                # projection inside, the region's value is a contraction over heads * d of a
                # re-laid-out tile, which no block program computes, and the search kept the
                # 10-kernel lifted attention. Apart, the core fuses and the projection is a
                # library GEMM reading the views.
                explicit[last_view] = w
                core_ends.add(w)

    stage: dict[int, int] = {}
    for i in sorted(branch):
        stage[i] = max(
            (stage[p] + ((p, i) in explicit) for p in preds[i] if branch.get(p) == branch[i]),
            default=0,
        )

    label: dict[int, tuple] = {i: ("branch", branch[i], stage[i]) for i in branch}
    for i in range(n):  # after the stream: inherit the one region-mate upstream, if any
        if i in branch or i not in downstream:
            continue
        up = {label[p] for p in preds[i] if p in label and p not in producers}
        label[i] = up.pop() if len(up) == 1 else ("free", i)
    # Beside the stream: a view or function of constants alone (a transposed weight) joins the
    # one region that reads it; anything computed at run time (a mask or a position table built
    # from inputs) or read by several regions is left to itself, so that each layer's regions
    # stay alike and a region never computes what the model builds outside its layers.
    for i in reversed(range(n)):
        if i in label:
            continue
        below = {label[c] for c in succs[i]}
        constant = all(not x or x in constant_names for x in nodes[i].input)
        if len(below) == 1 and constant and i not in producers:
            label[i] = below.pop()
        else:
            label[i] = ("side", i)
    node_consumers = {i: tuple(succs[i]) for i in range(n)}
    return _Structure(
        label,
        branch,
        stage,
        producers,
        downstream,
        node_consumers,
        explicit,
        frozenset(core_ends),
    )


def _structure_cut(s: _Structure, nodes: list[onnx.NodeProto], p: int, i: int) -> Cut:
    """The recorded cut for an edge p -> i whose ends carry different labels."""
    tensor = next((o for o in nodes[p].output if o and o in nodes[i].input), "")
    before, after = _node_label(nodes, p), _node_label(nodes, i)
    if p in s.stream_producers:
        return Cut(
            "residual",
            f"cut at the residual stream: {before} writes '{tensor}', a value of the residual "
            f"stream, and {after} reads it; a region ends where a branch (norm -> ... -> "
            "residual add) writes the stream, so no region spans two branches or two layers",
            p,
            i,
        )
    if p in s.branch and i in s.branch and s.branch[p] == s.branch[i]:
        proj = s.explicit.get((p, i))
        if proj is not None and proj in s.core_ends:
            return Cut(
                "projection",
                f"cut at a contraction boundary: {after} takes '{tensor}', the result of "
                f"{_node_label(nodes, proj)}, a contraction of two computed values (attention's "
                "P·V), through the views that re-lay it out; the core ends with those views "
                "(its kernel saves through them) and the projection starts the next region of "
                "the branch",
                p,
                i,
            )
        if proj is not None:
            return Cut(
                "projection",
                f"cut at a contraction boundary: {after} takes '{tensor}', computed from the "
                f"projection {_node_label(nodes, proj)}; a projection's output is written once "
                "and the contraction that reads it (attention scores, a down projection) starts "
                "the next region of the branch",
                p,
                i,
            )
        return Cut(
            "projection",
            f"cut at a contraction boundary: {after} lies past {s.stage[i]} contraction "
            f"boundar{'y' if s.stage[i] == 1 else 'ies'} of its branch and {before} past "
            f"{s.stage[p]}; a region holds one stage of a branch",
            p,
            i,
        )
    if p not in s.downstream and p not in s.branch:
        shared = len({s.label[c] for c in s.consumers[p]}) > 1
        why = (
            "it feeds more than one region"
            if shared
            else "it is computed at run time, not read from constants"
        )
        return Cut(
            "side_input",
            f"cut beside the residual stream: {before} computes '{tensor}' from no stream "
            f"value and {why}; a region reads such a value (a mask, a position table) rather "
            "than computing it, so that the regions of every layer stay alike",
            p,
            i,
        )
    return Cut(
        "branch",
        f"cut between branches: {before} and {after} belong to different branches of the "
        "residual stream (or to what follows two of them)",
        p,
        i,
    )


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
