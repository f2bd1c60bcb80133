"""Per-region numbers for `inspect`: shapes, FLOPs, and DRAM bytes unfused vs fused minimum."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import TensorProto

from mlso_cli.frontend.load import LoadedModel
from mlso_cli.frontend.partition import Partition, Region

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
    )


def partition_reports(loaded: LoadedModel, part: Partition) -> list[RegionReport]:
    return [region_report(loaded, r) for r in part.regions]
