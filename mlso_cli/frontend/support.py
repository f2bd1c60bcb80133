"""Which ONNX ops mlso can fuse, as a table of op -> (kind, condition).

The partitioner consults this table, and lifting implements every op it admits; a test keeps the
two in step. A condition returns None when a node is fusable, or the reason a user reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import numpy as np
import onnx
from onnx import TensorProto

MAX_ELEMENTS = 2**31 - 1
"""The most elements a fused tensor may have: generated kernels index with 32-bit integers."""

FUSABLE_DTYPES = {
    TensorProto.FLOAT: "float32",
    TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16",
}


class OpKind(Enum):
    CONTRACTION = "contraction"  # MatMul-like: counts against the matmul bound
    COMPUTE = "compute"  # elementwise, reductions, normalisations
    LAYOUT = "layout"  # views: free, do not count against the size bound


@dataclass(frozen=True)
class NodeContext:
    """What a condition may look at: the node, shapes/dtypes, and constant values."""

    node: onnx.NodeProto
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, int]
    constants: dict[str, np.ndarray]

    def attr(self, name: str, default=None):
        for a in self.node.attribute:
            if a.name == name:
                return onnx.helper.get_attribute_value(a)
        return default

    def const(self, i: int) -> np.ndarray | None:
        if i >= len(self.node.input) or not self.node.input[i]:
            return None
        return self.constants.get(self.node.input[i])


Condition = Callable[[NodeContext], "str | None"]


def _always(_: NodeContext) -> str | None:
    return None


def _const_inputs(*indices: int, what: str) -> Condition:
    def check(ctx: NodeContext) -> str | None:
        for i in indices:
            if i < len(ctx.node.input) and ctx.node.input[i] and ctx.const(i) is None:
                return f"{ctx.node.op_type}: {what} is computed at run time"
        return None

    return check


def _pow(ctx: NodeContext) -> str | None:
    e = ctx.const(1)
    if e is None or e.size != 1:
        return "Pow: exponent is not a constant scalar"
    if float(e.reshape(())) not in (0.5, 1.0, 2.0, 3.0, -1.0, -0.5):
        return (
            f"Pow: exponent {float(e.reshape(()))} has no lifting rule (0.5, 1, 2, 3, -1, -0.5 do)"
        )
    return None


def _reduce(ctx: NodeContext) -> str | None:
    if len(ctx.node.input) > 1 and ctx.node.input[1] and ctx.const(1) is None:
        return f"{ctx.node.op_type}: axes are computed at run time"
    if ctx.attr("noop_with_empty_axes", 0):
        return f"{ctx.node.op_type}: noop_with_empty_axes is not supported"
    return None


def _where(ctx: NodeContext) -> str | None:
    for i in (1, 2):
        v = ctx.const(i)
        if v is not None and v.size == 1 and (np.isneginf(v).all() or float(v.reshape(())) <= -1e4):
            return None
    return "Where: only masks whose other branch is -inf (or <= -1e4) are fusable"


def _selection_reason(op: str, pieces: list[tuple[int, list[int], list[np.ndarray]]]) -> str | None:
    """Why a Slice/Concat/Split cannot lift as a block selection, or None. Each piece is
    (axis, input sizes along it, the input elements taken); `frontend/selection.py` says how it
    lifts, and lifting uses the same test."""
    from mlso_cli.frontend import selection as sel

    for axis, sizes, takes in pieces:
        if max(sizes) > sel.MAX_SELECT_AXIS:  # before building maps of that many elements
            return sel.too_long(op, axis)
        s = sel.concat([sel.plain(k, n, axis) for k, n in enumerate(sizes)])
        s = s.take(np.concatenate(takes)) if takes else s
        why = sel.problem(s, op)
        if why:
            return why
    return None


def _slice(ctx: NodeContext) -> str | None:
    from mlso_cli.frontend import selection as sel

    node = ctx.node
    shape = ctx.shapes[node.input[0]]
    if len(node.input) > 1:
        for i in range(1, len(node.input)):
            if node.input[i] and ctx.const(i) is None:
                what = ("starts", "ends", "axes", "steps")[i - 1]
                return f"Slice: its {what} are computed at run time (only constant slices lift)"
        starts, ends = ctx.const(1).reshape(-1), ctx.const(2).reshape(-1)
        axes = ctx.const(3) if ctx.const(3) is not None else np.arange(len(starts))
        steps = ctx.const(4) if ctx.const(4) is not None else np.ones(len(starts), np.int64)
    else:
        starts, ends = ctx.attr("starts", []), ctx.attr("ends", [])
        axes, steps = ctx.attr("axes", list(range(len(starts)))), [1] * len(starts)
    pieces = []
    for st, en, ax, sp in zip(starts, ends, np.reshape(axes, -1), np.reshape(steps, -1)):
        ax = int(ax) % len(shape)
        if int(sp) == 0:
            return "Slice: a step of 0 is invalid"
        if shape[ax] > sel.MAX_SELECT_AXIS:
            return _selection_reason("Slice", [(ax, [shape[ax]], [])])
        idx = sel.slice_indices(shape[ax], int(st), int(en), int(sp))
        pieces.append((ax, [shape[ax]], [idx]))
    return _selection_reason("Slice", pieces)


def _concat(ctx: NodeContext) -> str | None:
    ins = [i for i in ctx.node.input if i]
    rank = len(ctx.shapes[ins[0]])
    axis = int(ctx.attr("axis", 0)) % rank
    return _selection_reason("Concat", [(axis, [ctx.shapes[i][axis] for i in ins], [])])


def _scatter_nd(ctx: NodeContext) -> str | None:
    """A ScatterND whose constant indices name rows of axis 0 ((k, 1) indices, no reduction):
    a selection of data's and updates' rows (selection.scatter_rows)."""
    from mlso_cli.frontend import selection as sel

    node = ctx.node
    idx = ctx.const(1)
    if idx is None:
        return "ScatterND: data-dependent writes (its indices are computed at run time)"
    if ctx.attr("reduction", b"none") not in (b"none", "none"):
        return "ScatterND: a reduction on write has no lifting rule"
    shape, upd = ctx.shapes[node.input[0]], ctx.shapes[node.input[2]]
    if idx.ndim != 2 or idx.shape[1] != 1 or tuple(upd) != (idx.shape[0], *shape[1:]):
        return "ScatterND: only whole rows of the first axis lift (indices of shape (k, 1))"
    if shape[0] > sel.MAX_SELECT_AXIS:
        return sel.too_long("ScatterND", 0)
    s = sel.scatter_rows(0, 1, shape[0], idx)
    return s if isinstance(s, str) else sel.problem(s, "ScatterND")


def _split(ctx: NodeContext) -> str | None:
    shape = ctx.shapes[ctx.node.input[0]]
    axis = int(ctx.attr("axis", 0)) % len(shape)
    pieces, start = [], 0
    for o in ctx.node.output:
        n = ctx.shapes[o][axis] if o else 0
        pieces.append((axis, [shape[axis]], [np.arange(start, start + n)]))
        start += n
    return _selection_reason("Split", pieces)


def _cast(ctx: NodeContext) -> str | None:
    to = ctx.attr("to")
    src = ctx.dtypes.get(ctx.node.input[0])
    if to in FUSABLE_DTYPES and src in FUSABLE_DTYPES:
        return None
    if to in FUSABLE_DTYPES and src == TensorProto.BOOL:
        return None
    return "Cast: only casts between float16, bfloat16 and float32 (or bool masks) are fusable"


def _batchnorm(ctx: NodeContext) -> str | None:
    if ctx.attr("training_mode", 0):
        return "BatchNormalization: training mode updates statistics"
    return _const_inputs(3, 4, what="running mean/var")(ctx)


def _attention(ctx: NodeContext) -> str | None:
    if len(ctx.node.input) > 4 and any(ctx.node.input[4:]):
        return "Attention: KV-cache inputs (past_key/past_value) are not supported"
    if len(ctx.node.output) > 1 and any(ctx.node.output[1:]):
        return "Attention: present_key/value outputs are not supported"
    if ctx.attr("softcap", 0.0):
        return "Attention: softcap is not supported"
    return None


SUPPORT: dict[str, tuple[OpKind, Condition]] = {
    "MatMul": (OpKind.CONTRACTION, _always),
    "Gemm": (OpKind.CONTRACTION, _always),
    "Attention": (OpKind.CONTRACTION, _attention),
    "Add": (OpKind.COMPUTE, _always),
    "Sub": (OpKind.COMPUTE, _always),
    "Mul": (OpKind.COMPUTE, _always),
    "Div": (OpKind.COMPUTE, _always),
    "Pow": (OpKind.COMPUTE, _pow),
    "Sqrt": (OpKind.COMPUTE, _always),
    "Reciprocal": (OpKind.COMPUTE, _always),
    "Exp": (OpKind.COMPUTE, _always),
    "Neg": (OpKind.COMPUTE, _always),
    "Sigmoid": (OpKind.COMPUTE, _always),
    "Tanh": (OpKind.COMPUTE, _always),
    "Erf": (OpKind.COMPUTE, _always),
    "Relu": (OpKind.COMPUTE, _always),
    "Gelu": (OpKind.COMPUTE, _always),
    "Softmax": (OpKind.COMPUTE, _always),
    "ReduceSum": (OpKind.COMPUTE, _reduce),
    "ReduceMean": (OpKind.COMPUTE, _reduce),
    "ReduceMax": (OpKind.COMPUTE, _reduce),
    "LayerNormalization": (OpKind.COMPUTE, _always),
    "RMSNormalization": (OpKind.COMPUTE, _always),
    "GroupNormalization": (OpKind.COMPUTE, _always),
    "InstanceNormalization": (OpKind.COMPUTE, _always),
    "BatchNormalization": (OpKind.COMPUTE, _batchnorm),
    "Where": (OpKind.COMPUTE, _where),
    "Cast": (OpKind.COMPUTE, _cast),
    "Reshape": (OpKind.LAYOUT, _const_inputs(1, what="target shape")),
    "Transpose": (OpKind.LAYOUT, _always),
    "Unsqueeze": (OpKind.LAYOUT, _const_inputs(1, what="axes")),
    "Squeeze": (OpKind.LAYOUT, _const_inputs(1, what="axes")),
    "Expand": (OpKind.LAYOUT, _const_inputs(1, what="target shape")),
    "Flatten": (OpKind.LAYOUT, _always),
    "Identity": (OpKind.LAYOUT, _always),
    # a signed block selection (multiply by a 0/±1 constant, short sum): compute, not a view
    "Slice": (OpKind.COMPUTE, _slice),
    "Concat": (OpKind.COMPUTE, _concat),
    "Split": (OpKind.COMPUTE, _split),
    "ScatterND": (OpKind.COMPUTE, _scatter_nd),
}

UNSUPPORTED_REASONS: dict[str, str] = {
    "Gather": "Gather: data-dependent indexing",
    "GatherElements": "GatherElements: data-dependent indexing",
    "GatherND": "GatherND: data-dependent indexing",
    "ScatterElements": "ScatterElements: data-dependent writes",
    "Shape": "Shape: shape arithmetic, not tensor math",
    "Size": "Size: shape arithmetic, not tensor math",
    "ConstantOfShape": "ConstantOfShape: shape arithmetic, not tensor math",
    "Range": "Range: index generation",
    "Trilu": "Trilu: mask construction (computed outside regions)",
    "Equal": "Equal: comparison producing a boolean mask (computed outside regions)",
    "Less": "Less: comparison producing a boolean mask (computed outside regions)",
    "Greater": "Greater: comparison producing a boolean mask (computed outside regions)",
    "RotaryEmbedding": "RotaryEmbedding: position-id gather has no block-graph form yet",
    "Conv": "Conv: convolutions are not in the μGraph op set",
    "TopK": "TopK: data-dependent selection",
    "NonZero": "NonZero: data-dependent output shape",
}


def classify(ctx: NodeContext) -> tuple[OpKind | None, str | None]:
    """(kind, None) when the node is fusable, else (None, reason)."""
    node = ctx.node
    if node.domain == "ai.mlso":
        return None, f"{node.op_type}: already an mlso kernel (carries executable GPU code)"
    if node.domain not in ("", "ai.onnx"):
        return None, f"{node.op_type}: op domain '{node.domain}' is not supported"
    if node.op_type == "Constant":
        return None, "Constant: a value, read by the regions that use it"
    if node.op_type not in SUPPORT:
        return None, UNSUPPORTED_REASONS.get(
            node.op_type, f"{node.op_type}: no lifting rule for this op"
        )
    for name in list(node.input) + list(node.output):
        if not name:
            continue
        if name not in ctx.shapes:
            return None, f"{node.op_type}: shape of '{name}' is unknown after shape inference"
    float_io = [
        n
        for n in list(node.input) + list(node.output)
        if n and ctx.dtypes.get(n) not in (TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL)
    ]
    for name in float_io:
        dt = ctx.dtypes.get(name)
        if dt not in FUSABLE_DTYPES:
            tname = TensorProto.DataType.Name(dt) if dt else "unknown"
            return (
                None,
                f"{node.op_type}: tensor '{name}' is {tname.lower()}; only float16, bfloat16 and float32 are fusable",
            )
    size_reason = _size_reason(node.op_type, float_io, ctx.shapes)
    if size_reason:
        return None, size_reason
    if not any(ctx.dtypes.get(o) in FUSABLE_DTYPES for o in node.output if o):
        return (
            None,
            f"{node.op_type}: produces no floating-point tensor (shape or index arithmetic)",
        )
    kind, cond = SUPPORT[node.op_type]
    reason = cond(ctx)
    return (None, reason) if reason else (kind, None)


def _size_reason(op_type: str, names: list[str], shapes: dict[str, tuple[int, ...]]) -> str | None:
    """Why a node whose float tensors are empty or too large to index stays as it is, or None.

    Why refuse here rather than later: a zero-size tensor has nothing to fuse and breaks the
    search's shape arithmetic (it divides by dimensions), and a tensor over 2**31-1 elements
    cannot be indexed by the generated kernels; either used to abort `optimize` in the search or
    in codegen instead of keeping the original nodes. Only float tensors are checked: an empty
    int64 shape or axes input (Reshape to a scalar) is normal."""
    for name in names:
        shape = shapes[name]
        numel = math.prod(shape)  # exact: int64 could overflow on hostile dims
        if numel == 0:
            return (
                f"{op_type}: tensor '{name}' has no elements (shape {list(shape)}); "
                "there is nothing to fuse, so the node is kept as it is"
            )
        if numel > MAX_ELEMENTS:
            return (
                f"{op_type}: tensor '{name}' has {numel} elements (shape {list(shape)}), over "
                "2^31-1; fused kernels index with 32-bit integers, so the node is kept as it is"
            )
    return None
