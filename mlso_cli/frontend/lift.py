"""Lift a region of ONNX nodes into an unfused kernel graph of primitive ops, in one canonical form.

Rules are a table: ONNX op type -> function(ctx, node) -> output Nodes. Composite ops (Softmax,
LayerNormalization, RMSNormalization, InstanceNormalization, BatchNormalization, Gemm, Gelu,
Attention) decompose into primitives; layout ops become views. The canonical form is what makes
equivalent spellings agree in the finite-field checker:

- Pow(x, 2) -> square(x); Pow(x, 0.5) -> sqrt; Pow(x, -0.5) -> rsqrt; Pow(x, -1) -> reciprocal.
  (rsqrt(x) and 1/sqrt(x), sigmoid(x) and 1/(1+exp(-x)), x*sigmoid(x) and silu agree in the
  field by the checker's definitions, so they need no rewrite here.)
- Division by a scalar constant is multiplication by its exact reciprocal (Div(s, 8) and
  Mul(s, 0.125) are one attention scale; the search builds scaled values as products).
- The constant scaling erf's argument is snapped to exactly the checker's 1/sqrt(2)
  (verify/semantics.py INV_SQRT2) when it is within fp16 rounding of it, as the checker snaps
  it (Mul(x, 0.70710677), Div(x, 1.4142135) and fp16's Mul(x, 181/256) are the same GELU); the
  Gelu op lifts to the same erf form.
- Masks: Where(mask, x, -inf) feeding a Softmax becomes exp(x) multiplied by a 0/1 mask, so masked
  attention stays in the field.
- Composite ops compute in fp32 between casts, as ONNX Runtime's kernels do.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from mlso_cli.frontend import selection as sel
from mlso_cli.frontend import siblings as sib
from mlso_cli.frontend.load import LoadedModel, load_model, onnx_opset
from mlso_cli.frontend.partition import Region, constant_values, partition
from mlso_cli.ir import DType, KernelGraph, Node, Op, check
from mlso_cli.ir import build as b
from mlso_cli.ir import canonical as semantics  # the lifting constants, shared with verify/
from mlso_cli.ir.node import const_value
from mlso_cli.knobs import knobs

ONNX_TO_DTYPE = {
    TensorProto.FLOAT: DType.F32,
    TensorProto.FLOAT16: DType.F16,
    TensorProto.BFLOAT16: DType.BF16,
}
DTYPE_TO_ONNX = {v: k for k, v in ONNX_TO_DTYPE.items()}
_NP_OF = {DType.F32: np.float32, DType.F16: np.float16}
INV_SQRT2 = semantics.INV_SQRT2
"""The checker's 1/sqrt(2), exactly: the lifted constant must be the one the field semantics
snaps to, or a search's fingerprints (which use constants as written) never meet the target's."""
NEG_BIG = -1e4


class LiftError(ValueError):
    """A node inside a region that the lifting rules cannot express; the region is left out."""


@dataclass
class LiftedRegion:
    region: Region
    graph: KernelGraph
    extra_inputs: dict[str, np.ndarray] = field(default_factory=dict)
    """Constant tensors lifting created (0/1 masks); packaging adds them as initializers."""
    columns: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    """Output of a sibling MatMul lifted as columns of one matmul -> (its concatenated weight,
    first column, end column): where that MatMul's weight lies in the concatenation. Packaging
    (package/absorb.py) lets the fallback body read these columns instead of the original
    weight, so the file does not hold the weights twice (frontend/siblings.py)."""


@dataclass
class _Ctx:
    loaded: LoadedModel
    consts: dict[str, np.ndarray]
    env: dict[str, Node] = field(default_factory=dict)
    inputs: list[Node] = field(default_factory=list)
    input_names: list[str] = field(default_factory=list)
    masks: dict[Node, Node] = field(default_factory=dict)
    """Placeholder for "x masked" -> its 0/1 mask input. A placeholder never reaches the lifted
    graph: Softmax and Exp read `mask_base` (x) and multiply exp(x) by the mask."""
    mask_base: dict[Node, Node] = field(default_factory=dict)
    mask_arrays: dict[Node, np.ndarray] = field(default_factory=dict)
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    selections: dict[Node, sel.Selection] = field(default_factory=dict)
    """A lifted Slice/Concat/Split/Neg result -> the selection of base tensors it computes, so a
    selection of it (rotate_half's Neg then Concat of two Slices) composes into one."""
    readers: dict[str, set[str]] = field(default_factory=dict)
    """Tensor name -> the op types of the region's nodes that read it ("" for a region output)."""
    siblings: dict[str, sib.Siblings] = field(default_factory=dict)
    """Output name of a sibling projection -> its group (frontend/siblings.py)."""
    sibling_values: dict[str, Node | None] = field(default_factory=dict)
    """Sibling outputs lifted as columns of one matmul; None where the group stays separate."""
    columns: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    """Sibling output -> (concatenated weight, first column, end column): LiftedRegion.columns."""

    def dtype_of(self, name: str) -> DType:
        code = self.loaded.dtypes.get(name)
        if code not in ONNX_TO_DTYPE:
            raise LiftError(f"tensor '{name}' has element type {code}, not fp16/bf16/fp32")
        return ONNX_TO_DTYPE[code]

    def value(self, name: str) -> Node:
        """The IR node for an ONNX tensor: computed in the region, a scalar constant, or an input."""
        if name in self.env:
            return self.env[name]
        c = self.consts.get(name)
        if c is not None and c.size == 1 and c.dtype.kind == "f":
            node = b.const(
                Fraction(float(c.reshape(()))),
                ONNX_TO_DTYPE.get(self.loaded.dtypes.get(name), DType.F32),
            )
            self.env[name] = node
            return node
        shape = self.loaded.shapes.get(name)
        if shape is None:
            raise LiftError(f"shape of '{name}' is unknown")
        return self.add_input(name, shape, self.dtype_of(name))

    def add_input(self, name: str, shape: tuple[int, ...], dtype: DType) -> Node:
        node = b.input_(len(self.inputs), shape, dtype)
        self.inputs.append(node)
        self.input_names.append(name)
        self.env[name] = node
        return node

    def ints(self, name: str) -> list[int]:
        c = self.consts.get(name)
        if c is None:
            raise LiftError(f"'{name}' must be a constant")
        return [int(v) for v in np.asarray(c).reshape(-1)]

    def scalar(self, name: str) -> float | None:
        c = self.consts.get(name)
        return None if c is None or c.size != 1 else float(np.asarray(c).reshape(()))


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _x(ctx: _Ctx, node: onnx.NodeProto, i: int) -> Node:
    return ctx.value(node.input[i])


def _has(node: onnx.NodeProto, i: int) -> bool:
    return len(node.input) > i and bool(node.input[i])


# ---- helpers --------------------------------------------------------------------------------


def _axes(axes, rank: int) -> list[int]:
    return sorted(a % rank for a in axes)


def _reduce_axes(op: Op, x: Node, axes: list[int], keepdims: bool = True) -> Node:
    """Reduce over several axes with single-axis primitives (mean = sum * 1/N, exactly)."""
    rank = len(x.shape)
    axes = _axes(axes, rank)
    prim = Op.REDUCE_SUM if op is Op.REDUCE_MEAN else op
    out = x
    for a in axes:
        out = b.reduce(prim, out, a)
    if op is Op.REDUCE_MEAN:
        n = 1
        for a in axes:
            n *= x.shape[a]
        out = b.mul(out, b.const(Fraction(1, n)))
    if not keepdims:
        out = b.reshape(out, tuple(d for i, d in enumerate(x.shape) if i not in axes))
    return out


def _to32(x: Node) -> Node:
    return x if x.dtype is DType.F32 or x.op is Op.CONST else b.cast(x, DType.F32)


def _back(x: Node, dtype: DType) -> Node:
    return x if dtype is DType.F32 else b.cast(x, dtype)


def _rsqrt(x: Node) -> Node:
    return b.unary(Op.RSQRT, x)


def _softmax_core(x: Node, axis: int, mask: Node | None) -> Node:
    e = b.unary(Op.EXP, x)
    if mask is not None:
        e = b.mul(e, _to32(mask) if x.dtype is DType.F32 else mask)
    return b.div(e, b.reduce(Op.REDUCE_SUM, e, axis))


# ---- rules ----------------------------------------------------------------------------------


def _elementwise(op: Op) -> Callable:
    def rule(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
        args = [_x(ctx, node, i) for i in range(len(node.input))]
        return [b.binary(op, *args) if len(args) == 2 else b.unary(op, *args)]

    return rule


def _pow(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    x = _x(ctx, node, 0)
    e = ctx.scalar(node.input[1])
    table = {
        2.0: lambda: b.unary(Op.SQUARE, x),
        0.5: lambda: b.unary(Op.SQRT, x),
        -0.5: lambda: _rsqrt(x),
        -1.0: lambda: b.unary(Op.RECIPROCAL, x),
        1.0: lambda: x,
        3.0: lambda: b.mul(b.unary(Op.SQUARE, x), x),
    }
    if e not in table:
        raise LiftError(f"Pow with exponent {e}")
    return [table[e]()]


def _snap_gelu_scale(x: Node) -> Node:
    """erf(x * c) with c within fp16 rounding of 1/sqrt(2): the canonical GELU argument (a Div by
    a constant has already become a Mul by its reciprocal, `_div`)."""
    if x.op is Op.MUL:
        for i in (0, 1):
            c, other = x.src[i], x.src[1 - i]
            if c.op is Op.CONST and semantics.canonical_const(const_value(c)) == INV_SQRT2:
                return b.mul(other, b.const(INV_SQRT2, c.dtype))
    return x


def _div(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    """x / c for a nonzero scalar constant c is x * (1/c), exact in the rationals the checker
    works in. Why: the search spells a scaled value as a product by a constant (a quotient by one
    is a constant multiple it already has), so `Div(scores, 8)` found nothing where
    `Mul(scores, 0.125)` fused (benchmarks/heldout_sweep.py)."""
    x, d = _x(ctx, node, 0), _x(ctx, node, 1)
    if d.op is Op.CONST and const_value(d) != 0:
        return [b.mul(x, b.const(1 / const_value(d), d.dtype))]
    return [b.binary(Op.DIV, x, d)]


def _erf(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    return [b.unary(Op.ERF, _snap_gelu_scale(_x(ctx, node, 0)))]


def _gelu(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    x = _x(ctx, node, 0)
    half, one = b.const(Fraction(1, 2), x.dtype), b.const(1, x.dtype)
    if _attr(node, "approximate", b"none") in (b"tanh", "tanh"):
        c = b.const(Fraction(math.sqrt(2 / math.pi)), x.dtype)
        inner = b.mul(
            c,
            b.add(x, b.mul(b.const(Fraction(0.044715), x.dtype), b.mul(b.unary(Op.SQUARE, x), x))),
        )
        return [b.mul(b.mul(half, x), b.add(one, b.unary(Op.TANH, inner)))]
    return [
        b.mul(b.mul(half, x), b.add(one, b.unary(Op.ERF, b.mul(x, b.const(INV_SQRT2, x.dtype)))))
    ]


def _matmul(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    group = ctx.siblings.get(node.output[0])
    if group is not None:
        if node.output[0] not in ctx.sibling_values:
            ctx.sibling_values.update(_merge_siblings(ctx, node, group))
        merged = ctx.sibling_values[node.output[0]]
        if merged is not None:
            return [merged]
    a, c = _x(ctx, node, 0), _x(ctx, node, 1)
    if len(a.shape) == 1 or len(c.shape) == 1:
        a2 = b.reshape(a, (1,) + a.shape) if len(a.shape) == 1 else a
        c2 = b.reshape(c, c.shape + (1,)) if len(c.shape) == 1 else c
        out = b.matmul(a2, c2)
        want = ctx.loaded.shapes[node.output[0]]
        return [b.reshape(out, want)]
    return [b.matmul(a, c)]


def _weight(ctx: _Ctx, name: str) -> np.ndarray | None:
    """A constant weight's value: a Constant node's (lift's constants), else the initializer's,
    read from external data where it lives there; None when it cannot be read."""
    return _constant_array(ctx.loaded, ctx.consts, name)


def _constant_array(
    loaded: LoadedModel, consts: Mapping[str, np.ndarray], name: str
) -> np.ndarray | None:
    """_weight's lookup, for callers without a lifting context."""
    v = consts.get(name)
    if v is not None:
        return np.asarray(v)
    base = loaded.base_dir
    for t in loaded.graph.initializer:
        if t.name == name:
            try:
                return numpy_helper.to_array(t, str(base) if base is not None else "")
            except Exception:  # unreadable external data: the group stays separate
                return None
    return None


def column_views(loaded: LoadedModel, consts: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The value of every Slice that takes a range of columns (axis 1, step 1, constant bounds)
    of a constant matrix and is read only as MatMuls' weight: output name -> those columns.

    Why: a packaged fallback body reads each merged sibling projection's weight this way, as its
    columns of the concatenation the kernel takes (package/absorb.py). Lifting the body with
    these as constant weights finds the siblings again and lifts them as the kernel's one matmul
    over the same concatenation (the same bytes, so the same name) with the same column
    selections, so verify compares like with like; lifted as selections of the concatenation
    instead, the body would be separate matmuls whose selection constants differ from the
    kernel's. Only fallback bodies are lifted with these (`lift_whole_graph`): in a model's own
    regions a Slice's output must never be a kernel input, since the Slice itself is replaced.
    And only Slices of a concatenation lifting made (named `mlso_concat_<digest>`): a model's
    own Slice of a weight was lifted as a selection of that weight in the kernel, and its body
    must lift the same way."""
    from mlso_cli.frontend.fold import constant_node_value

    nodes = loaded.graph.node
    readers: dict[str, list[tuple[str, int]]] = {}
    for n in nodes:
        for k, x in enumerate(n.input):
            readers.setdefault(x, []).append((n.op_type, k))
    small = {
        n.output[0]: constant_node_value(n)
        for n in nodes
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.output
    }
    matrices: dict[str, np.ndarray | None] = {}
    out: dict[str, np.ndarray] = {}
    for n in nodes:
        if n.op_type != "Slice" or n.domain not in ("", "ai.onnx") or len(n.input) < 4:
            continue
        users = readers.get(n.output[0], [])
        if not users or any(u != ("MatMul", 1) for u in users):
            continue
        args = [consts.get(x, small.get(x)) for x in n.input[1:] if x]
        if len(args) != len(n.input) - 1 or any(a is None for a in args):
            continue
        starts, ends, axes = (np.ravel(a) for a in args[:3])
        steps = np.ravel(args[3]) if len(args) > 3 else np.array([1])
        if not len(starts) == len(ends) == len(axes) == len(steps) == 1:
            continue
        if int(axes[0]) not in (1, -1) or int(steps[0]) != 1:
            continue
        data = n.input[0]
        if not data.startswith(sib.PREFIX):
            continue
        if data not in matrices:
            matrices[data] = _constant_array(loaded, consts, data)
        w = matrices[data]
        if w is None or w.ndim != 2:
            continue
        out[n.output[0]] = np.ascontiguousarray(w[:, int(starts[0]) : int(ends[0])])
    return out


def _merge_siblings(ctx: _Ctx, node: onnx.NodeProto, group: sib.Siblings) -> dict[str, Node | None]:
    """Every member of `group` as its columns of one matmul over the concatenated weights
    (frontend/siblings.py), or every member None (lift each alone) when a weight cannot be read
    or a member's columns do not factor within the selection bound."""
    keep: dict[str, Node | None] = {out: None for out, _, _ in group.members}
    n_all = group.n
    spans = [np.arange(group.offset(out), group.offset(out) + n) for out, _, n in group.members]
    if any(sel.problem(sel.plain("y", n_all, 0).take(idx), "MatMul") for idx in spans):
        return keep
    ws = [_weight(ctx, w) for _, w, _ in group.members]
    if any(w is None for w in ws) or len({w.dtype for w in ws}) != 1:
        return keep
    dtype = DType.F32 if ws[0].dtype == np.float32 else DType.F16
    a = _x(ctx, node, 0)
    if a.dtype is not dtype:
        return keep
    cat = np.ascontiguousarray(np.concatenate(ws, axis=1))
    digest = hashlib.sha256(cat.tobytes() + repr((cat.shape, str(cat.dtype))).encode())
    name = f"{sib.PREFIX}{digest.hexdigest()[:12]}"
    ctx.extra[name] = cat
    y = b.matmul(a, ctx.env.get(name) or ctx.add_input(name, cat.shape, dtype))
    axis = len(y.shape) - 1
    for (out, _, _), idx in zip(group.members, spans):
        s = sel.plain(y, n_all, axis).take(idx)
        keep[out] = _select(ctx, "MatMul", s, s)
        ctx.columns[out] = (name, int(idx[0]), int(idx[-1]) + 1)
    return keep


def _gemm(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    a, w = _x(ctx, node, 0), _x(ctx, node, 1)
    if _attr(node, "transA", 0):
        a = b.transpose(a, (1, 0))
    if _attr(node, "transB", 0):
        w = b.transpose(w, (1, 0))
    out = b.matmul(a, w)
    alpha, beta = _attr(node, "alpha", 1.0), _attr(node, "beta", 1.0)
    if alpha != 1.0:
        out = b.mul(out, b.const(Fraction(alpha), out.dtype))
    if _has(node, 2):
        bias = _x(ctx, node, 2)
        if beta != 1.0:
            bias = b.mul(bias, b.const(Fraction(beta), bias.dtype))
        out = b.add(out, bias)
    return [out]


def _softmax(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    """Softmax over one axis (opset 13 on). Before opset 13 the axis (default 1) flattens the
    input to 2-D, [prod(shape[:axis]), prod(shape[axis:])], and normalises over the second dim:
    the same op only when axis is the last dim, so other axes are lifted through that reshape."""
    x = _x(ctx, node, 0)
    mask = ctx.masks.get(x)
    x = ctx.mask_base.get(x, x)
    flattening = onnx_opset(ctx.loaded.model) < 13
    axis = _attr(node, "axis", 1 if flattening else -1) % len(x.shape)
    if not flattening or axis == len(x.shape) - 1:
        return [_back(_softmax_core(_to32(x), axis, mask), x.dtype)]
    rows = int(np.prod(x.shape[:axis], dtype=np.int64))
    flat = (rows, int(np.prod(x.shape[axis:], dtype=np.int64)))
    if mask is not None and mask.shape != x.shape:
        pad = (1,) * (len(x.shape) - len(mask.shape))
        mask = b.broadcast_to(b.reshape(mask, pad + mask.shape) if pad else mask, x.shape)
    m2 = b.reshape(mask, flat) if mask is not None else None
    y = _softmax_core(_to32(b.reshape(x, flat)), 1, m2)
    return [_back(b.reshape(y, x.shape), x.dtype)]


def _exp(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    x = _x(ctx, node, 0)
    mask = ctx.masks.get(x)
    e = b.unary(Op.EXP, ctx.mask_base.get(x, x))
    return [b.mul(e, mask) if mask is not None else e]


def _where(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    """Where(cond, x, -inf) (or with the branches swapped) as a 0/1 mask on exp(x)."""
    cond_name = node.input[0]
    for masked_branch, keep_branch, keep_when in ((2, 1, True), (1, 2, False)):
        v = ctx.scalar(node.input[masked_branch])
        if v is not None and (math.isinf(v) and v < 0 or v <= NEG_BIG):
            x = _x(ctx, node, keep_branch)
            cond = ctx.consts.get(cond_name)
            if cond is None:
                raise LiftError(
                    "Where: the mask is computed at run time; only constant masks are lifted"
                )
            keep = np.broadcast_to(
                cond.astype(bool) == keep_when, ctx.loaded.shapes[node.output[0]]
            )
            return [_masked(ctx, x, keep)]
    raise LiftError("Where: only masks whose other branch is -inf are lifted")


def _masked(ctx: _Ctx, x: Node, keep: np.ndarray, full: tuple[int, ...] | None = None) -> Node:
    """A placeholder for "x where keep, -inf elsewhere", read only by Softmax and Exp, which
    multiply exp(x) by `keep` as a 0/1 mask (so masked attention stays in the field)."""
    np_dtype = _NP_OF.get(x.dtype, np.float32)
    arr = np.ascontiguousarray(keep.astype(np_dtype))
    base = x
    if x in ctx.masks:  # a mask on a masked value: one mask, the product of both
        base = ctx.mask_base[x]
        shape = np.broadcast_shapes(arr.shape, ctx.mask_arrays[x].shape)
        arr = np.ascontiguousarray(
            np.broadcast_to(arr, shape)
            * np.broadcast_to(ctx.mask_arrays[x], shape).astype(np_dtype)
        )
    # sha256, not hash(): hash() is salted per process, and output models must not depend on it
    # a mask kept at its own broadcastable shape (an additive mask's, not `full`) names its
    # shape too: two masks of equal bytes and different shapes must not share a name
    salt = repr(arr.shape).encode() if full is not None and arr.shape != full else b""
    name = f"mlso_mask_{hashlib.sha256(arr.tobytes() + salt).hexdigest()[:12]}"
    ctx.extra[name] = arr
    mask = ctx.env.get(name) or ctx.add_input(  # one input for a mask read twice
        name, arr.shape, x.dtype if x.dtype is not DType.BF16 else DType.F32
    )
    # a node standing for "base, masked by this mask": it names the mask, so two different
    # masks on one tensor get two placeholders (x * 1 for both made them one node and lost
    # a mask); it never reaches the graph (Softmax and Exp read mask_base)
    m = mask if mask.dtype is base.dtype else b.cast(mask, base.dtype)
    out = b.mul(base, b.mul(m, b.const(0, base.dtype)))
    ctx.masks[out] = mask
    ctx.mask_base[out] = base
    ctx.mask_arrays[out] = arr
    return out


_SOFTMAX_READERS = {"Softmax", "Exp"}


def _add(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    """x + M for a constant M holding -inf (or <= NEG_BIG) where attention is masked: an additive
    mask. When only Softmax/Exp read the sum it lifts as exp(x + finite part of M) times the 0/1
    mask of M's finite entries, as Where(mask, x, -inf) does; -inf itself has no field value."""
    out_name = node.output[0]
    for j in (1, 0):
        c = ctx.consts.get(node.input[j])
        if (
            c is None
            or c.size == 1
            or node.input[j] in ctx.env
            or c.dtype.kind != "f"
            or not ctx.readers.get(out_name)
            or not ctx.readers[out_name] <= _SOFTMAX_READERS
        ):
            continue
        keep = np.isfinite(c) & (c > NEG_BIG)
        if keep.all():
            continue
        x = _x(ctx, node, 1 - j)
        out_shape = tuple(ctx.loaded.shapes[out_name])
        finite = np.where(keep, c, 0).astype(c.dtype)
        if np.any(finite != 0):
            name = f"mlso_bias_{hashlib.sha256(finite.tobytes()).hexdigest()[:12]}"
            ctx.extra[name] = np.ascontiguousarray(finite)
            x = b.add(x, ctx.add_input(name, finite.shape, ctx.dtype_of(node.input[j])))
        if x.shape != out_shape:
            if len(x.shape) < len(out_shape):
                x = b.reshape(x, (1,) * (len(out_shape) - len(x.shape)) + x.shape)
            x = b.broadcast_to(x, out_shape)
        keep = keep.reshape((1,) * (len(out_shape) - keep.ndim) + keep.shape)
        return [_masked(ctx, x, keep, out_shape)]
    return [b.add(_x(ctx, node, 0), _x(ctx, node, 1))]


# ---- selections: Slice, Concat, Split, Neg (frontend/selection.py) ---------------------------


def _selection_of(ctx: _Ctx, x: Node, axis: int) -> sel.Selection:
    """What x selects from along `axis`: its recorded selection, else x itself."""
    s = ctx.selections.get(x)
    if s is not None and s.axis == axis:
        return s
    return sel.plain(x, x.shape[axis], axis)


def _select(ctx: _Ctx, op: str, composed: sel.Selection, plain: sel.Selection) -> Node:
    """The lifted selection, composed with the selections its inputs were when that factors
    within the block bound, else over its inputs as they are."""
    why = None
    for s in (composed, plain):
        why = sel.problem(s, op)
        if why is None:
            node = _materialize(ctx, s)
            if not sel.is_identity(s):
                ctx.selections[node] = s
            return node
    raise LiftError(why)


def _materialize(ctx: _Ctx, s: sel.Selection) -> Node:
    if sel.is_identity(s):
        return s.terms[0]
    total = None
    for t, x in enumerate(s.terms):
        if not np.any(s.term == t):
            continue
        f = sel.factor(s, t)
        assert f is not None  # _select checked
        part = _apply_factor(ctx, x, s.axis, f)
        total = part if total is None else b.add(total, part)
    assert total is not None
    return total


def _apply_factor(ctx: _Ctx, x: Node, axis: int, f: sel.Factor) -> Node:
    """x's selected part: reshape, multiply by P, sum over the input blocks, reshape back.

    The dims before and after the axis are merged into one each (reshapes are free views), so
    the product has rank 3 to 6 whatever x's rank: fewer dims for the search and codegen."""
    pre, post = x.shape[:axis], x.shape[axis + 1 :]
    out_shape = pre + (f.a * f.b_out * f.c,) + post
    if f.b == f.b_out == 1 and f.a * f.c == x.shape[axis]:
        if f.p[0, 0] == 1:
            return x
        if f.p[0, 0] == -1:
            return b.unary(Op.NEG, x)
    lead, trail = math.prod(pre), math.prod(post)
    head = ((lead,) if lead > 1 else ()) + ((f.a,) if f.a > 1 else ())
    tail = (trail,) if trail > 1 else ()
    xs = b.reshape(x, head + (1, f.b, f.c) + tail)
    np_dtype = _NP_OF.get(x.dtype, np.float32)
    arr = np.ascontiguousarray(
        f.p.astype(np_dtype).reshape((1,) * len(head) + (f.b_out, f.b, 1) + (1,) * len(tail))
    )
    digest = hashlib.sha256(arr.tobytes() + repr(arr.shape).encode()).hexdigest()[:12]
    name = f"mlso_select_{digest}"
    ctx.extra[name] = arr
    p = ctx.env.get(name) or ctx.add_input(
        name, arr.shape, x.dtype if x.dtype is not DType.BF16 else DType.F32
    )
    if p.dtype is not x.dtype:
        p = b.cast(p, x.dtype)
    y = b.mul(xs, p)
    if f.b > 1:
        y = b.reduce(Op.REDUCE_SUM, y, len(head) + 1)
    return b.reshape(y, out_shape)


def _slice_indices(
    ctx: _Ctx, node: onnx.NodeProto, shape: tuple[int, ...]
) -> dict[int, np.ndarray]:
    """Axis -> the indices Slice takes there, for every axis it changes."""
    if len(node.input) > 1:  # opset 10 on: starts, ends, axes, steps are inputs
        starts, ends = ctx.ints(node.input[1]), ctx.ints(node.input[2])
        axes = ctx.ints(node.input[3]) if _has(node, 3) else list(range(len(starts)))
        steps = ctx.ints(node.input[4]) if _has(node, 4) else [1] * len(starts)
    else:
        starts, ends = list(_attr(node, "starts")), list(_attr(node, "ends"))
        axes = list(_attr(node, "axes", range(len(starts))))
        steps = [1] * len(starts)
    out = {}
    for st, en, ax, sp in zip(starts, ends, axes, steps):
        ax %= len(shape)
        try:
            idx = sel.slice_indices(shape[ax], st, en, sp)
        except ValueError as exc:
            raise LiftError(str(exc)) from None
        if not np.array_equal(idx, np.arange(shape[ax])):
            out[ax] = idx
    return out


def _slice(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    view = ctx.consts.get(node.output[0])
    if view is not None:  # a column view of a weight (column_views): that constant, by name
        name = node.output[0]
        dtype = {np.dtype(np.float32): DType.F32, np.dtype(np.float16): DType.F16}.get(view.dtype)
        return [ctx.env.get(name) or ctx.add_input(name, view.shape, dtype or ctx.dtype_of(name))]
    x = _x(ctx, node, 0)
    for ax, idx in sorted(_slice_indices(ctx, node, x.shape).items()):
        x = _select(
            ctx,
            "Slice",
            _selection_of(ctx, x, ax).take(idx),
            sel.plain(x, x.shape[ax], ax).take(idx),
        )
    return [x]


def _concat(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    xs = [_x(ctx, node, i) for i in range(len(node.input)) if node.input[i]]
    axis = _attr(node, "axis") % len(xs[0].shape)
    if len(xs) == 1:
        return xs
    composed = sel.concat([_selection_of(ctx, x, axis) for x in xs])
    plain = sel.concat([sel.plain(x, x.shape[axis], axis) for x in xs])
    return [_select(ctx, "Concat", composed, plain)]


def _split(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    x = _x(ctx, node, 0)
    axis = _attr(node, "axis", 0) % len(x.shape)
    outs, start = [], 0
    for name in node.output:
        n = ctx.loaded.shapes[name][axis]
        idx = np.arange(start, start + n, dtype=np.int64)
        start += n
        outs.append(
            _select(
                ctx,
                "Split",
                _selection_of(ctx, x, axis).take(idx),
                sel.plain(x, x.shape[axis], axis).take(idx),
            )
        )
    return outs


def _scatter_nd(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    """Rows of data replaced by updates' (support._scatter_nd admitted it): a selection of two
    terms along axis 0."""
    data, updates = _x(ctx, node, 0), _x(ctx, node, 2)
    idx = ctx.consts.get(node.input[1])
    if idx is None:
        raise LiftError("ScatterND: its indices must be a constant")
    s = sel.scatter_rows(data, updates, data.shape[0], np.asarray(idx))
    if isinstance(s, str):
        raise LiftError(s)
    return [_select(ctx, "ScatterND", s, s)]


def _neg(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    """-x; the negation of a selection is that selection with -1 entries (one P, not two ops)."""
    x = _x(ctx, node, 0)
    s = ctx.selections.get(x)
    if s is not None:
        return [_select(ctx, "Neg", s.negated(), s.negated())]
    return [b.unary(Op.NEG, x)]


def _reduce_rule(op: Op) -> Callable:
    def rule(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
        x = _x(ctx, node, 0)
        if _has(node, 1):
            axes = ctx.ints(node.input[1])
        else:
            axes = _attr(node, "axes", None)
            axes = list(axes) if axes is not None else list(range(len(x.shape)))
        if not axes:
            axes = list(range(len(x.shape)))
        return [_reduce_axes(op, x, axes, bool(_attr(node, "keepdims", 1)))]

    return rule


def _norm(x: Node, axes: list[int], eps: float, *, center: bool) -> Node:
    """(x - mean) * rsqrt(var + eps), or x * rsqrt(mean(x^2) + eps) when not centred."""
    d = b.sub(x, _reduce_axes(Op.REDUCE_MEAN, x, axes)) if center else x
    var = _reduce_axes(Op.REDUCE_MEAN, b.unary(Op.SQUARE, d), axes)
    return b.mul(d, _rsqrt(b.add(var, b.const(Fraction(eps)))))


def _layernorm(ctx: _Ctx, node: onnx.NodeProto, center: bool = True) -> list[Node]:
    x = _x(ctx, node, 0)
    axis = _attr(node, "axis", -1) % len(x.shape)
    eps = _attr(node, "epsilon", 1e-5)
    y = _norm(_to32(x), list(range(axis, len(x.shape))), eps, center=center)
    y = b.mul(y, _to32(_x(ctx, node, 1)))
    if center and _has(node, 2):
        y = b.add(y, _to32(_x(ctx, node, 2)))
    return [_back(y, x.dtype)]


def _rmsnorm(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    return _layernorm(ctx, node, center=False)


def _channel(v: Node, rank: int) -> Node:
    """A per-channel vector (C,) shaped to broadcast against (N, C, ...)."""
    return b.reshape(v, (v.shape[0],) + (1,) * (rank - 2)) if rank > 2 else v


def _instancenorm(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    x = _x(ctx, node, 0)
    rank = len(x.shape)
    eps = _attr(node, "epsilon", 1e-5)
    y = _norm(_to32(x), list(range(2, rank)), eps, center=True)
    y = b.add(
        b.mul(y, _to32(_channel(_x(ctx, node, 1), rank))), _to32(_channel(_x(ctx, node, 2), rank))
    )
    return [_back(y, x.dtype)]


def _groupnorm(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    x = _x(ctx, node, 0)
    g = _attr(node, "num_groups")
    n, c = x.shape[0], x.shape[1]
    rest = x.shape[2:]
    xs = b.reshape(_to32(x), (n, g, c // g) + rest)
    y = _norm(xs, list(range(2, len(xs.shape))), _attr(node, "epsilon", 1e-5), center=True)
    y = b.reshape(y, x.shape)
    scale, bias = _x(ctx, node, 1), _x(ctx, node, 2)
    if scale.shape[0] != c:
        raise LiftError("GroupNormalization with per-group scale (opset 18) is not lifted")
    y = b.add(b.mul(y, _to32(_channel(scale, len(x.shape)))), _to32(_channel(bias, len(x.shape))))
    return [_back(y, x.dtype)]


def _batchnorm(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    x = _x(ctx, node, 0)
    rank = len(x.shape)
    scale, bias, mean, var = (_to32(_channel(_x(ctx, node, i), rank)) for i in (1, 2, 3, 4))
    eps = _attr(node, "epsilon", 1e-5)
    y = b.mul(b.sub(_to32(x), mean), _rsqrt(b.add(var, b.const(Fraction(eps)))))
    return [_back(b.add(b.mul(y, scale), bias), x.dtype)]


def _cast(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    x = _x(ctx, node, 0)
    to = ONNX_TO_DTYPE.get(_attr(node, "to"))
    if to is None:
        raise LiftError("Cast to a non-float type")
    return [x if x.dtype is to else b.cast(x, to)]


def _reshape(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    return [b.reshape(_x(ctx, node, 0), ctx.loaded.shapes[node.output[0]])]


def _transpose(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    x = _x(ctx, node, 0)
    perm = _attr(node, "perm", None) or list(reversed(range(len(x.shape))))
    return [b.transpose(x, tuple(perm))]


def _expand(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    x = _x(ctx, node, 0)
    out = ctx.loaded.shapes[node.output[0]]
    if len(x.shape) < len(out):
        x = b.reshape(x, (1,) * (len(out) - len(x.shape)) + x.shape)
    return [x if x.shape == out else b.broadcast_to(x, out)]


def _identity(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    return [_x(ctx, node, 0)]


def _attention(ctx: _Ctx, node: onnx.NodeProto) -> list[Node]:
    """ONNX Attention (opset 23), 4-D or 3-D with head counts; GQA by broadcasting KV heads."""
    q, k, v = (_x(ctx, node, i) for i in range(3))
    if len(q.shape) == 3:
        qh, kh = _attr(node, "q_num_heads"), _attr(node, "kv_num_heads")
        bsz, s, _ = q.shape
        q = b.transpose(b.reshape(q, (bsz, s, qh, q.shape[2] // qh)), (0, 2, 1, 3))
        k = b.transpose(b.reshape(k, (bsz, k.shape[1], kh, k.shape[2] // kh)), (0, 2, 1, 3))
        v = b.transpose(b.reshape(v, (bsz, v.shape[1], kh, v.shape[2] // kh)), (0, 2, 1, 3))
    bsz, hq, sq, d = q.shape
    hk, skv = k.shape[1], k.shape[2]
    _check_scores_size(bsz * hq * sq * skv)
    if hk != hq:
        rep = hq // hk
        k = b.reshape(
            b.broadcast_to(b.reshape(k, (bsz, hk, 1, skv, d)), (bsz, hk, rep, skv, d)),
            (bsz, hq, skv, d),
        )
        v = b.reshape(
            b.broadcast_to(
                b.reshape(v, (bsz, hk, 1, skv, v.shape[3])), (bsz, hk, rep, skv, v.shape[3])
            ),
            (bsz, hq, skv, v.shape[3]),
        )
    scale = _attr(node, "scale", None)
    scale = Fraction(scale) if scale is not None else Fraction(1 / math.sqrt(d))
    s = b.mul(b.matmul(_to32(q), b.transpose(_to32(k), (0, 1, 3, 2))), b.const(scale))
    mask = None
    if _attr(node, "is_causal", 0):
        # top-left aligned, as ONNX (opset 23) and ONNX Runtime define it: query i sees keys
        # 0..i whatever skv is (a bottom-right mask, k = skv - sq, differs when sq != skv)
        keep = np.tril(np.ones((sq, skv), dtype=np.float32))
        name = f"mlso_causal_tl_{sq}x{skv}"
        ctx.extra[name] = keep
        mask = ctx.add_input(name, keep.shape, DType.F32)
    if _has(node, 3):
        m = _x(ctx, node, 3)
        s = b.add(s, _to32(m))
    p = _softmax_core(s, 3, mask)
    out = _back(b.matmul(p, _to32(v)), q.dtype)
    if len(ctx.loaded.shapes[node.output[0]]) == 3:
        out = b.reshape(b.transpose(out, (0, 2, 1, 3)), ctx.loaded.shapes[node.output[0]])
    return [out]


def _check_scores_size(scores: int) -> None:
    """Refuse an Attention whose score matrix is empty or too large to index, before the causal
    mask (sq x skv floats, built here in memory) is allocated: at 65536 x 65536 it would take
    16 GiB only to be refused by `_check_sizes` afterwards."""
    from mlso_cli.frontend.support import MAX_ELEMENTS

    if scores == 0 or scores > MAX_ELEMENTS:
        what = "no elements" if scores == 0 else f"{scores} elements, over 2^31-1"
        raise LiftError(
            f"Attention: its score matrix has {what} (fused kernels index with 32-bit integers)"
        )


RULES: dict[str, Callable[[_Ctx, onnx.NodeProto], list[Node]]] = {
    "Add": _add,
    "Sub": _elementwise(Op.SUB),
    "Mul": _elementwise(Op.MUL),
    "Div": _div,
    "Sqrt": _elementwise(Op.SQRT),
    "Reciprocal": _elementwise(Op.RECIPROCAL),
    "Exp": _exp,
    "Neg": _neg,
    "Sigmoid": _elementwise(Op.SIGMOID),
    "Tanh": _elementwise(Op.TANH),
    "Erf": _erf,
    "Relu": _elementwise(Op.RELU),
    "Gelu": _gelu,
    "Pow": _pow,
    "MatMul": _matmul,
    "Gemm": _gemm,
    "Softmax": _softmax,
    "Where": _where,
    "ReduceSum": _reduce_rule(Op.REDUCE_SUM),
    "ReduceMean": _reduce_rule(Op.REDUCE_MEAN),
    "ReduceMax": _reduce_rule(Op.REDUCE_MAX),
    "LayerNormalization": _layernorm,
    "RMSNormalization": _rmsnorm,
    "InstanceNormalization": _instancenorm,
    "GroupNormalization": _groupnorm,
    "BatchNormalization": _batchnorm,
    "Cast": _cast,
    "Attention": _attention,
    "Reshape": _reshape,
    "Transpose": _transpose,
    "Unsqueeze": _reshape,
    "Squeeze": _reshape,
    "Flatten": _reshape,
    "Expand": _expand,
    "Identity": _identity,
    "Slice": _slice,
    "Concat": _concat,
    "Split": _split,
    "ScatterND": _scatter_nd,
}


def lift_region(
    loaded: LoadedModel,
    region: Region,
    consts: dict[str, np.ndarray] | None = None,
    merge: bool = True,
    *,
    merged_body: bool = False,
) -> LiftedRegion:
    """The region's unfused kernel graph; raises LiftError when a node has no rule.

    merge: lift sibling projections as one matmul (frontend/siblings.py) where the
    MLSO_MERGE_SIBLINGS knob allows it; verify's algebraic check turns it off for the original
    model, so the field compares the two forms. merged_body: the region is a fallback body whose
    kernel merged its siblings (lift_whole_graph), so they merge again whatever the knob says."""
    ctx = _Ctx(loaded, consts if consts is not None else lift_constants(loaded))
    nodes = loaded.graph.node
    if merge and (knobs().merge_siblings or merged_body):
        weights = sib.weight_types(loaded.model, ctx.consts)
        ctx.siblings = sib.groups(nodes, region.nodes, loaded.shapes, weights)
    for i in region.nodes:
        for name in nodes[i].input:
            ctx.readers.setdefault(name, set()).add(nodes[i].op_type)
    for name in region.outputs:
        ctx.readers.setdefault(name, set()).add("")
    for i in region.nodes:
        node = nodes[i]
        rule = RULES.get(node.op_type)
        if rule is None:
            raise LiftError(f"{node.op_type}: no lifting rule")
        outs = rule(ctx, node)
        for name, val in zip(node.output, outs):
            want = loaded.shapes.get(name)
            if want is not None and tuple(want) != val.shape:
                raise LiftError(
                    f"{node.op_type} '{node.name}': lifted shape {val.shape} != ONNX shape {tuple(want)}"
                )
            ctx.env[name] = val
    outputs = []
    for name in region.outputs:
        node = ctx.env[name]
        if node in ctx.masks:
            raise LiftError("Where: a masked value is used by something other than Softmax/Exp")
        want = ONNX_TO_DTYPE.get(loaded.dtypes.get(name))
        if want is not None and node.dtype is not want:
            node = b.cast(node, want)
        outputs.append(node)
    _check_masks_consumed(ctx, outputs)
    kg = b.kernel_graph(ctx.inputs, outputs, ctx.input_names, list(region.outputs))
    kg = _prune_inputs(kg)
    check(kg)
    _check_sizes(kg)
    names = set(kg.input_names)
    return LiftedRegion(
        region,
        kg,
        {k: v for k, v in ctx.extra.items() if k in names},
        {out: col for out, col in ctx.columns.items() if col[0] in names},
    )


def lift_constants(loaded: LoadedModel) -> dict[str, np.ndarray]:
    """The constants lifting reads: small initializers and Constant nodes (`constant_values`)
    and every Constant node folding made, whatever its size (a seq x seq mask folded at load must
    be readable as a mask at any sequence length the fold budget allows)."""
    from mlso_cli.frontend.fold import constant_node_value

    out = constant_values(loaded.model)
    for n in loaded.graph.node:
        if n.op_type == "Constant" and n.output and n.output[0] not in out:
            v = constant_node_value(n)
            if v is not None:
                out[n.output[0]] = v
    return out


def _check_sizes(kg: KernelGraph) -> None:
    """Refuse a graph with an empty or over-2^31-1-element intermediate.

    Why, when the partitioner already refuses such ONNX tensors: decomposing a node creates
    tensors the file never names (Attention's score matrix is seq x seq per head), and one too
    large to index used to abort `optimize` in codegen instead of leaving the region out."""
    from mlso_cli.frontend.support import MAX_ELEMENTS
    from mlso_cli.ir import toposort

    for n in toposort(list(kg.outputs)):
        if n.numel == 0 or n.numel > MAX_ELEMENTS:
            what = "no elements" if n.numel == 0 else f"{n.numel} elements, over 2^31-1"
            raise LiftError(
                f"its {n.op.value} intermediate of shape {list(n.shape)} has {what} "
                "(fused kernels index with 32-bit integers)"
            )


def _check_masks_consumed(ctx: _Ctx, outputs: list[Node]) -> None:
    """A masked placeholder is consumed by Softmax/Exp (which read its base): one left in the
    graph means something else read the masked value, which the lifted graph cannot express."""
    from mlso_cli.ir import toposort

    for n in toposort(outputs):
        if n in ctx.masks:
            raise LiftError("Where: a masked value is used by something other than Softmax/Exp")


def _substitute(roots: tuple[Node, ...], mapping: dict[Node, Node]) -> list[Node]:
    """The DAGs under roots with the nodes in mapping replaced (shared subterms stay shared)."""
    memo: dict[Node, Node] = dict(mapping)

    def rebuild(n: Node) -> Node:
        got = memo.get(n)
        if got is None:
            got = n.replace(src=tuple(rebuild(s) for s in n.src)) if n.src else n
            memo[n] = got
        return got

    return [rebuild(r) for r in roots]


def _prune_inputs(kg: KernelGraph) -> KernelGraph:
    """Drop inputs no output depends on (shape tensors read as constants) and renumber."""
    from mlso_cli.ir import toposort

    reachable = {n for n in toposort(list(kg.outputs)) if n.op is Op.INPUT}
    keep = [i for i in kg.inputs if i in reachable]
    if len(keep) == len(kg.inputs):
        return kg
    return with_input_order(kg, [kg.input_names[i.arg] for i in keep], kg)


def with_input_order(
    kg: KernelGraph, names: list[str] | tuple[str, ...], like: KernelGraph
) -> KernelGraph:
    """The same graph with its inputs in the order `names`; inputs it does not read are added,
    shaped as in `like` (so two graphs over one signature can be compared input by input)."""
    by_name = dict(zip(kg.input_names, kg.inputs))
    like_by_name = dict(zip(like.input_names, like.inputs))
    new_inputs, mapping = [], {}
    for j, name in enumerate(names):
        old = by_name.get(name) or like_by_name[name]
        node = b.input_(j, old.shape, old.dtype)
        new_inputs.append(node)
        if name in by_name:
            mapping[by_name[name]] = node
    return b.kernel_graph(
        new_inputs, _substitute(kg.outputs, mapping), list(names), list(kg.output_names)
    )


def lift_whole_graph(loaded: LoadedModel, merged: bool | None = None) -> LiftedRegion:
    """Lift every non-Constant node of a graph as one region (an MlsoKernel's fallback body).

    merged: whether the kernel this body falls back for merged sibling projections (it takes an
    `mlso_concat_` input): the body is then lifted merged (True) or not (False) whatever
    MLSO_MERGE_SIBLINGS says now, so that verify compares a kernel with its body in the kernel's
    own form; a model optimized with the merge on verifies with it off and the other way round.
    None: the knob decides, except that a body reading column views of a concatenation
    (`column_views`) always merges."""
    nodes = loaded.graph.node
    idx = tuple(i for i, n in enumerate(nodes) if n.op_type != "Constant")
    outputs = tuple(o.name for o in loaded.graph.output)
    produced = {o for i in idx for o in nodes[i].output}
    inputs = tuple(dict.fromkeys(x for i in idx for x in nodes[i].input if x and x not in produced))
    region = Region(0, idx, inputs, outputs, "body", tuple(nodes[i].op_type for i in idx))
    consts = lift_constants(loaded)
    views = column_views(loaded, consts) if merged is not False else {}
    consts.update(views)  # merged siblings' weights, as a body reads them
    return lift_region(
        loaded, region, consts, merge=merged is not False, merged_body=bool(merged or views)
    )


def merged_kernel(input_names: Sequence[str]) -> bool:
    """Whether a kernel with these inputs merged sibling projections: lift_whole_graph's
    `merged` for its fallback body."""
    return any(x.startswith(sib.PREFIX) for x in input_names)


def lift_all(
    loaded: LoadedModel, regions: list[Region], merge: bool = True
) -> tuple[list[LiftedRegion], list[tuple[Region, str]]]:
    """Lift every region; regions that fail are returned with the reason instead."""
    consts = lift_constants(loaded)
    ok, failed = [], []
    for r in regions:
        try:
            ok.append(lift_region(loaded, r, consts, merge))
        except LiftError as exc:
            failed.append((r, str(exc)))
    return ok, failed


def lift_model(
    path: str, input_shapes: dict[str, tuple[int, ...]] | None = None
) -> list[KernelGraph]:
    """Convenience for tests and tools: the lifted kernel graph of every liftable region."""
    loaded = load_model(path, input_shapes)
    lifted, _ = lift_all(loaded, partition(loaded).regions)
    return [lr.graph for lr in lifted]
