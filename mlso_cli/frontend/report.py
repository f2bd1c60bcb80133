"""What `inspect` reports: per-region numbers (shapes, FLOPs, DRAM bytes unfused vs fused
minimum), every node left out with its reason, and every cut between regions.

Why an account against the *original* model: loading folds shape arithmetic into Constant nodes
and drops what no output needs any more, so the partitioned graph is not the file the user has.
`inspect_report` maps each partitioned node back to the node of the file it is (or stands for),
so every node of the file lands in exactly one region or one left-out row, folded nodes included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import onnx
from onnx import TensorProto

from mlso_cli.frontend.load import LoadedModel
from mlso_cli.frontend.partition import Excluded, Partition, Region

_ITEMSIZE = {
    TensorProto.FLOAT: 4,
    TensorProto.FLOAT16: 2,
    TensorProto.BFLOAT16: 2,
    TensorProto.DOUBLE: 8,
    TensorProto.INT64: 8,
    TensorProto.INT32: 4,
    TensorProto.BOOL: 1,
    TensorProto.INT8: 1,
    TensorProto.UINT8: 1,
}
_FREE_VIEWS = {"Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity"}
_ELEMENTWISE_COST = {
    "LayerNormalization": 8,
    "RMSNormalization": 6,
    "GroupNormalization": 8,
    "BatchNormalization": 4,
    "Softmax": 5,
    "Gelu": 8,
    "Erf": 1,
}


@dataclass(frozen=True)
class RegionReport:
    region: int
    label: str
    ops: dict[str, int]
    inputs: list[dict]
    outputs: list[dict]
    dtype: str
    flops: int
    dram_bytes_unfused: int
    dram_bytes_fused_min: int
    nodes: list[str] = field(default_factory=list)
    """The region's nodes by name ("#<index>" for an unnamed node), in topological order."""
    node_indices: list[int] = field(default_factory=list)
    """Their indices in graph.node of the model file (names need not be unique)."""

    def to_json(self) -> dict:
        return asdict(self)


def _nbytes(loaded: LoadedModel, name: str) -> int:
    shape = loaded.shapes.get(name)
    if shape is None:
        return 0
    return int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE.get(loaded.dtypes.get(name, 0), 4)


def _dtype_name(code: int | None) -> str:
    return TensorProto.DataType.Name(code).lower() if code else "unknown"


def node_flops(loaded: LoadedModel, node: onnx.NodeProto) -> int:
    sh = loaded.shapes
    out = sh.get(node.output[0], ())
    numel = int(np.prod(out, dtype=np.int64)) if out else 1
    if node.op_type == "MatMul":
        a = sh.get(node.input[0], ())
        return 2 * numel * (a[-1] if a else 1)
    if node.op_type == "Gemm":
        a = sh.get(node.input[0], ())
        trans_a = any(x.name == "transA" and x.i for x in node.attribute)
        k = (a[0] if trans_a else a[-1]) if a else 1
        return 2 * numel * k
    if node.op_type == "Attention":
        q = sh.get(node.input[0], ())
        k = sh.get(node.input[1], ())
        if len(q) == 4 and len(k) == 4:
            return 4 * q[0] * q[1] * q[2] * k[2] * q[3]
        return 4 * numel
    if node.op_type in _FREE_VIEWS or node.op_type in ("Transpose", "Expand"):
        return 0
    return numel * _ELEMENTWISE_COST.get(node.op_type, 1)


def region_report(loaded: LoadedModel, region: Region) -> RegionReport:
    nodes = [loaded.graph.node[i] for i in region.nodes]
    flops = sum(node_flops(loaded, n) for n in nodes)
    unfused = 0
    for n in nodes:
        if n.op_type in _FREE_VIEWS:
            continue
        unfused += sum(_nbytes(loaded, x) for x in n.input if x)
        unfused += sum(_nbytes(loaded, x) for x in n.output if x)
    fused = sum(_nbytes(loaded, x) for x in region.inputs) + sum(
        _nbytes(loaded, x) for x in region.outputs
    )

    def desc(name: str) -> dict:
        return {
            "name": name,
            "shape": list(loaded.shapes.get(name, ())),
            "dtype": _dtype_name(loaded.dtypes.get(name)),
        }

    out_dtypes = {loaded.dtypes.get(o) for o in region.outputs}
    dtype = _dtype_name(out_dtypes.pop()) if len(out_dtypes) == 1 else "mixed"
    ops: dict[str, int] = {}
    for op in region.ops:
        ops[op] = ops.get(op, 0) + 1
    return RegionReport(
        region.id,
        region.label,
        ops,
        [desc(x) for x in region.inputs],
        [desc(x) for x in region.outputs],
        dtype,
        flops,
        unfused,
        fused,
        [loaded.graph.node[i].name or f"#{i}" for i in region.nodes],
        list(region.nodes),
    )


def partition_reports(loaded: LoadedModel, part: Partition) -> list[RegionReport]:
    return [region_report(loaded, r) for r in part.regions]


# ---- the whole account: regions, left-out nodes, cuts -------------------------------------------


@dataclass(frozen=True)
class NodeRef:
    """A node of the model file: `index` into its graph.node (None only for a node the loader
    made that stands for no node of the file, which the loader never does today)."""

    index: int | None
    name: str
    op_type: str

    def to_json(self) -> dict:
        return {"node": self.name, "op_type": self.op_type, "index": self.index}


@dataclass(frozen=True)
class LeftOut:
    node: NodeRef
    reason: str
    category: str
    """"constant", "unsupported", "layout_only", "single_op", "not_lifted", "folded" or
    "removed"."""

    def to_json(self) -> dict:
        return {**self.node.to_json(), "reason": self.reason, "category": self.category}


@dataclass(frozen=True)
class SplitReport:
    cause: str
    """"max_ops", "max_contractions", "convexity", "residual", "projection", "side_input" or
    "branch" (see partition.Cut)."""
    reason: str
    before: NodeRef
    after: NodeRef
    region_before: int | None
    """The region holding `before` (None when its side became no region: layout only, or not
    lifted)."""
    region_after: int | None
    limit: int | None
    count: int | None

    def to_json(self) -> dict:
        return {
            "cause": self.cause,
            "reason": self.reason,
            "before": self.before.to_json(),
            "after": self.after.to_json(),
            "region_before": self.region_before,
            "region_after": self.region_after,
            "limit": self.limit,
            "count": self.count,
        }


@dataclass(frozen=True)
class InspectReport:
    regions: list[RegionReport]
    left_out: list[LeftOut]
    splits: list[SplitReport]
    node_count: int
    """Nodes in the model file's main graph; regions and left_out account for each once."""


FOLDED_REASON = (
    "{op}: folded into a constant at load (computed from constants and the fixed input shapes)"
)
REMOVED_REASON = "{op}: dropped at load: no graph output needs it once shape arithmetic is folded"


def _origins(
    original: Sequence[onnx.NodeProto], loaded: Sequence[onnx.NodeProto]
) -> list[int | None]:
    """For each loaded node, the index of the file's node it is or stands for.

    Why by output name: loading only replaces a node by Constant nodes of the same output names
    (fold) or drops it (dead code), and output names are unique in a graph. A node with no named
    output keeps its relative order, so those are paired in order."""
    producer = {o: j for j, n in enumerate(original) for o in n.output if o}
    silent = iter([j for j, n in enumerate(original) if not any(n.output)])
    out: list[int | None] = []
    for n in loaded:
        outs = [o for o in n.output if o]
        out.append(producer.get(outs[0]) if outs else next(silent, None))
    return out


def _category(e: Excluded) -> str:
    if e.category:
        return e.category
    # analyse.py marks nodes of a region that failed to lift with this prefix.
    return "not_lifted" if e.reason.startswith("region could not be lifted") else "unsupported"


def inspect_report(
    loaded: LoadedModel, part: Partition, original: onnx.ModelProto | None = None
) -> InspectReport:
    """Regions, left-out nodes and cuts of `part`, named after the nodes of `original` (the
    model as read from its file, before folding; None: `loaded`'s own graph)."""
    lnodes = list(loaded.graph.node)
    onodes = list((original or loaded.model).graph.node)
    origin = _origins(onodes, lnodes) if original is not None else list(range(len(lnodes)))

    def ref(k: int) -> NodeRef:
        j = origin[k]
        if j is None:
            return NodeRef(None, lnodes[k].name or f"#{k}", lnodes[k].op_type)
        return NodeRef(j, onodes[j].name or f"#{j}", onodes[j].op_type)

    region_of = {k: r.id for r in part.regions for k in r.nodes}
    regions = []
    for r in part.regions:
        refs = [ref(k) for k in r.nodes]
        regions.append(
            replace(
                region_report(loaded, r),
                nodes=[x.name for x in refs],
                node_indices=[x.index for x in refs],
            )
        )

    excluded = {e.index: e for e in part.excluded}
    stands_for: dict[int, list[int]] = {}
    rows: list[tuple[int, LeftOut]] = []
    for k, j in enumerate(origin):
        if j is None:
            if k not in region_of:
                e = excluded[k]
                rows.append((len(onodes) + k, LeftOut(ref(k), e.reason, _category(e))))
            continue
        stands_for.setdefault(j, []).append(k)
    for j, node in enumerate(onodes):
        ks = stands_for.get(j, [])
        here = NodeRef(j, node.name or f"#{j}", node.op_type)
        if not ks:
            rows.append((j, LeftOut(here, REMOVED_REASON.format(op=node.op_type), "removed")))
        elif node.op_type != "Constant" and any(lnodes[k].op_type == "Constant" for k in ks):
            rows.append((j, LeftOut(here, FOLDED_REASON.format(op=node.op_type), "folded")))
        elif ks[0] not in region_of:
            e = excluded[ks[0]]
            note = loaded.fold_notes.get(next(iter(lnodes[ks[0]].output), ""))
            reason = f"{e.reason} ({note})" if note and e.category != "constant" else e.reason
            rows.append((j, LeftOut(here, reason, _category(e))))
    rows.sort(key=lambda x: x[0])

    splits = [
        SplitReport(
            c.cause,
            c.reason,
            ref(c.before),
            ref(c.after),
            region_of.get(c.before),
            region_of.get(c.after),
            c.limit,
            c.count,
        )
        for c in part.cuts
    ]
    return InspectReport(regions, [x for _, x in rows], splits, len(onodes))
