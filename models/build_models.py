"""Build mlso's benchmark and test models as plain ONNX graphs (no torch needed).

Why this exists: mlso must find its fusions in the *unfused ONNX graphs* a user hands it, so
the benchmark set has to be ONNX files at Mirage's shapes (docs/benchmarks.md lists them),
and the CPU test-suite needs tiny fp32 twins of the same graphs.

Conventions, and why:

* Big matrices and activations (Q, K, V, X, W, W1, W2, A, B, H, alpha, C, ...) are graph
  *inputs*, as in Mirage, so that a benchmark measures the kernel and not constant folding,
  and so that the files stay tiny. Norm parameters (gamma, beta, BatchNorm statistics) are
  small *initializers*, as an exporter writes them.
* Initializer values are drawn from a fixed seed and quantised to multiples of 1/64 in a
  narrow range, so they are exact in fp32, fp16 and bf16 alike. The float64 ``reference()``
  of each spec can therefore regenerate them from their names and shapes and needs no model.
* The same math is spelled differently across models (RMSNorm as Pow/Div, as
  Mul/Reciprocal, as the opset-23 RMSNormalization op; SiLU as x*Sigmoid(x); GroupNorm as
  Reshape/InstanceNormalization/Reshape as torch.onnx emits it; Linear as MatMul or as Gemm
  with transB=1; scalar constants as initializers or as Constant nodes) because real exporters
  do, and mlso's lifter must canonicalise all of them.
* Opset 18 everywhere except qknorm_real, which needs opset 23 for RMSNormalization. The IR
  version is the minimum the opset needs (8 or 11): ONNX Runtime 1.31 rejects IR 14, which
  onnx 1.23 would otherwise write.
* Builds are deterministic: the same onnx/protobuf versions give byte-identical files, and the
  tests check the committed ``models/small/*.onnx`` against a fresh build.

CLI::

    python -m models.build_models [--out DIR] [--small-only] [--verify]

writes ``DIR/bench/{name}_bs{bs}.onnx`` (fp16, full size; git-ignored) and
``DIR/small/{name}.onnx`` (fp32, tiny; committed). DIR defaults to this package's folder.
"""

from __future__ import annotations

import argparse
import math
import sys
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "SPECS",
    "ModelSpec",
    "build_all",
    "random_inputs",
    "SMALL_BS",
    "SEED",
]

#: Seed for every initializer. Changing it changes the committed small models.
SEED = 20251129
#: Default opset; qknorm_real uses OPSET_RMSNORM for the RMSNormalization op.
OPSET = 18
OPSET_RMSNORM = 23
#: Batch size used for the committed small models: 2, not 1, so that a broadcast or
#: batch-indexing bug in a consumer cannot hide behind a size-1 leading dimension.
SMALL_BS = 2
#: Epsilons as the usual PyTorch modules use them (LLaMA RMSNorm 1e-6, nn.LayerNorm 1e-5).
EPS_RMS = 1e-6
EPS_NORM = 1e-5

DTypeLike = Any  # "float16", np.float16, np.dtype, or a TensorProto enum value


# --------------------------------------------------------------------------------------
# dtype helpers
# --------------------------------------------------------------------------------------


def _elem_type(dtype: DTypeLike) -> int:
    """Map a numpy dtype / name / TensorProto enum to a TensorProto element type."""
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        return TensorProto.BFLOAT16
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _np_dtype(elem: int) -> np.dtype:
    """Numpy dtype of a TensorProto element type (bf16 comes from ml_dtypes via onnx)."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem))


def _rounded(value: float, like: np.ndarray | np.dtype) -> float:
    """``value`` as the model stores it, so the float64 reference uses the same constant."""
    dt = like.dtype if isinstance(like, np.ndarray) else np.dtype(like)
    return float(np.asarray(value, dtype=dt).astype(np.float64))


def _f32(value: float) -> float:
    """A float attribute as ONNX stores it (attributes are float32)."""
    return float(np.float32(value))


# --------------------------------------------------------------------------------------
# deterministic parameters
# --------------------------------------------------------------------------------------


def _param(name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """Deterministic float64 parameter, exact in fp16 and bf16 (multiples of 1/64).

    Seeded by (SEED, crc32(name)) so that build and reference draw the same values
    independently. ``kind`` picks the range: "scale" in [0.75, 1.25], "shift" in
    [-0.25, 0.25], "var" in [0.5, 1.0], "ones", "zeros".
    """
    if kind == "ones":
        return np.ones(shape)
    if kind == "zeros":
        return np.zeros(shape)
    rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])
    k = rng.integers(-16, 17, size=shape).astype(np.float64)
    if kind == "scale":
        return 1.0 + k / 64.0
    if kind == "shift":
        return k / 64.0
    if kind == "var":
        return 0.5 + (k + 16.0) / 64.0
    raise ValueError(f"unknown parameter kind {kind!r}")


# --------------------------------------------------------------------------------------
# graph builder
# --------------------------------------------------------------------------------------


class _Graph:
    """A thin, deterministic wrapper around onnx.helper for writing one graph.

    It names every node and value by a running counter, so rebuilding gives the same bytes.
    """

    def __init__(self, elem: int) -> None:
        self.elem = elem
        self.np_dtype = _np_dtype(elem)
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._count = 0

    def input(self, name: str, shape: tuple[int, ...]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, self.elem, list(shape)))
        return name

    def output(self, name: str, shape: tuple[int, ...]) -> str:
        self.outputs.append(helper.make_tensor_value_info(name, self.elem, list(shape)))
        return name

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: Any) -> str:
        self._count += 1
        out = out or f"{op_type.lower()}_{self._count}"
        node = helper.make_node(
            op_type, list(inputs), [out], name=f"{op_type}_{self._count}", **attrs
        )
        self.nodes.append(node)
        return out

    def param(self, name: str, shape: tuple[int, ...], kind: str) -> str:
        """A norm parameter as an initializer in the model dtype (see ``_param``)."""
        arr = _param(name, shape, kind).astype(self.np_dtype)
        self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def scalar_init(self, name: str, value: float) -> str:
        """A 0-d constant stored as an initializer (the dynamo exporter's habit)."""
        arr = np.asarray(value, dtype=self.np_dtype)
        self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def scalar_const(self, name: str, value: float) -> str:
        """A 0-d constant as a Constant node (the TorchScript exporter's habit)."""
        tensor = numpy_helper.from_array(np.asarray(value, dtype=self.np_dtype), name + "_value")
        self.nodes.append(helper.make_node("Constant", [], [name], name=name, value=tensor))
        return name

    def ints(self, name: str, values: list[int]) -> str:
        """An int64 vector initializer (ReduceMean axes, Reshape shapes)."""
        self.inits.append(numpy_helper.from_array(np.asarray(values, dtype=np.int64), name))
        return name

    def model(self, graph_name: str, opset: int, doc: str) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes, graph_name, self.inputs, self.outputs, initializer=self.inits
        )
        opsets = [helper.make_opsetid("", opset)]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="mlso.models")
        model.producer_version = "1"
        model.doc_string = doc
        # The minimum IR the opset needs (8 for 18, 11 for 23): ORT 1.31 rejects IR 14.
        model.ir_version = helper.find_min_ir_version_for(opsets)
        return model


# --- RMSNorm spellings -----------------------------------------------------------------


def _rms_pow_div(g: _Graph, x: str, gamma: str, axes: str, two: str, eps: str) -> str:
    """x / Sqrt(ReduceMean(Pow(x, 2)) + eps) * gamma."""
    ms = g.op("ReduceMean", g.op("Pow", x, two), axes, keepdims=1)
    den = g.op("Sqrt", g.op("Add", ms, eps))
    return g.op("Mul", g.op("Div", x, den), gamma)


def _rms_mul_recip(g: _Graph, x: str, gamma: str, axes: str, eps: str) -> str:
    """gamma * (x * Reciprocal(Sqrt(ReduceMean(x*x) + eps)))  (gamma on the left)."""
    ms = g.op("ReduceMean", g.op("Mul", x, x), axes, keepdims=1)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, eps)))
    return g.op("Mul", gamma, g.op("Mul", x, inv))


def _rms_pow_recip(g: _Graph, x: str, gamma: str, axes: str, two: str, eps: str) -> str:
    """x * Reciprocal(Sqrt(eps + ReduceMean(Pow(x, 2)))) * gamma  (what torch.onnx emits
    for x * torch.rsqrt(x.pow(2).mean(-1) + eps) * w, with the Add operands swapped)."""
    ms = g.op("ReduceMean", g.op("Pow", x, two), axes, keepdims=1)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", eps, ms)))
    return g.op("Mul", g.op("Mul", x, inv), gamma)


# --------------------------------------------------------------------------------------
# float64 reference helpers
# --------------------------------------------------------------------------------------


def _f64(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v).astype(np.float64) for k, v in inputs.items()}


def _dtype_of(inputs: Mapping[str, np.ndarray]) -> np.dtype:
    return np.asarray(next(iter(inputs.values()))).dtype


def _ref_rms(x: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gamma


def _ref_softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _ref_standardise(x: np.ndarray, eps: float) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) over the last axis, population variance."""
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps)


# --------------------------------------------------------------------------------------
# the models: dims(bs, small) -> dict, graph(g, dims), reference(inputs)
# --------------------------------------------------------------------------------------


def _attn_dims(bs: int, small: bool) -> dict[str, int]:
    """Mirage's GQA: g = 2*bs KV groups, 256 queries per group, head dim 64, 4096 keys."""
    if small:
        return {"g": 2 * bs, "q": 16, "d": 16, "kv": 64}
    return {"g": 2 * bs, "q": 256, "d": 64, "kv": 4096}


def _attn_inputs(g: _Graph, d: dict[str, int]) -> tuple[str, str, str]:
    q = g.input("Q", (d["g"], d["q"], d["d"]))
    k = g.input("K", (d["g"], d["d"], d["kv"]))
    v = g.input("V", (d["g"], d["kv"], d["d"]))
    return q, k, v


def _attn_tail(g: _Graph, d: dict[str, int], q: str, k: str, v: str) -> None:
    """Softmax(Q·K, axis=-1)·V with no 1/sqrt(d) scale, as in Mirage's benchmark."""
    p = g.op("Softmax", g.op("MatMul", q, k), axis=-1)
    g.op("MatMul", p, v, out="O")
    g.output("O", (d["g"], d["q"], d["d"]))


def _gqa_graph(g: _Graph, d: dict[str, int]) -> None:
    q, k, v = _attn_inputs(g, d)
    _attn_tail(g, d, q, k, v)


def _gqa_ref(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    x = _f64(inputs)
    return {"O": _ref_softmax(x["Q"] @ x["K"]) @ x["V"]}


def _qknorm_gqa_graph(g: _Graph, d: dict[str, int]) -> None:
    q, k, v = _attn_inputs(g, d)
    axes = g.ints("axes_last", [-1])
    two = g.scalar_const("two", 2.0)
    eps = g.scalar_const("eps", EPS_RMS)
    qn = _rms_pow_div(g, q, g.param("gamma_q", (d["d"],), "scale"), axes, two, eps)
    vn = _rms_pow_div(g, v, g.param("gamma_v", (d["d"],), "scale"), axes, two, eps)
    _attn_tail(g, d, qn, k, vn)


def _qknorm_gqa_ref(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    eps = _rounded(EPS_RMS, _dtype_of(inputs))
    x = _f64(inputs)
    dh = x["Q"].shape[-1]
    qn = _ref_rms(x["Q"], _param("gamma_q", (dh,), "scale"), eps)
    vn = _ref_rms(x["V"], _param("gamma_v", (dh,), "scale"), eps)
    return {"O": _ref_softmax(qn @ x["K"]) @ vn}


def _qknorm_real_graph(g: _Graph, d: dict[str, int]) -> None:
    q, k, v = _attn_inputs(g, d)
    eps = _f32(EPS_RMS)
    qn = g.op("RMSNormalization", q, g.param("gamma_q", (d["d"],), "scale"), axis=-1, epsilon=eps)
    # K is (g, d, kv): its head dim is axis 1. Exporters normalise K in (g, kv, d) layout and
    # transpose afterwards, so do the same: Transpose, RMSNormalization(-1), Transpose.
    kt = g.op("Transpose", k, perm=[0, 2, 1])
    ktn = g.op("RMSNormalization", kt, g.param("gamma_k", (d["d"],), "scale"), axis=-1, epsilon=eps)
    kn = g.op("Transpose", ktn, perm=[0, 2, 1])
    _attn_tail(g, d, qn, kn, v)


def _qknorm_real_ref(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    eps = _f32(EPS_RMS)  # an attribute: float32, and RMSNormalization computes in fp32
    x = _f64(inputs)
    dh = x["Q"].shape[-1]
    qn = _ref_rms(x["Q"], _param("gamma_q", (dh,), "scale"), eps)
    kt = np.swapaxes(x["K"], 1, 2)
    kn = np.swapaxes(_ref_rms(kt, _param("gamma_k", (dh,), "scale"), eps), 1, 2)
    return {"O": _ref_softmax(qn @ kn) @ x["V"]}


def _rmsnorm_linear_dims(bs: int, small: bool) -> dict[str, int]:
    if small:
        return {"rows": 2 * bs, "h": 64, "n": 96}
    return {"rows": 2 * bs, "h": 4096, "n": 6144}


def _rmsnorm_linear_graph(g: _Graph, d: dict[str, int]) -> None:
    x = g.input("X", (d["rows"], d["h"]))
    w = g.input("W", (d["h"], d["n"]))
    axes = g.ints("axes_last", [-1])
    eps = g.scalar_init("eps", EPS_RMS)
    xn = _rms_mul_recip(g, x, g.param("gamma", (d["h"],), "scale"), axes, eps)
    g.op("MatMul", xn, w, out="O")
    g.output("O", (d["rows"], d["n"]))


def _rmsnorm_linear_ref(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    eps = _rounded(EPS_RMS, _dtype_of(inputs))
    x = _f64(inputs)
    h = x["X"].shape[-1]
    return {"O": _ref_rms(x["X"], _param("gamma", (h,), "scale"), eps) @ x["W"]}


def _lora_dims(bs: int, small: bool) -> dict[str, int]:
    if small:
        return {"rows": 8 * bs, "k": 32, "r": 8, "n": 64}
    return {"rows": 16 * bs, "k": 256, "r": 16, "n": 4096}


def _lora_graph(g: _Graph, d: dict[str, int]) -> None:
    x = g.input("X", (d["rows"], d["k"]))
    w = g.input("W", (d["k"], d["n"]))
    a = g.input("A", (d["k"], d["r"]))
    b = g.input("B", (d["r"], d["n"]))
    xab = g.op("MatMul", g.op("MatMul", x, a), b)
    # The base projection and the residual add as one Gemm: X·W + C with C = (X·A)·B.
    g.op("Gemm", x, w, xab, out="O")
    g.output("O", (d["rows"], d["n"]))


def _lora_ref(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    x = _f64(inputs)
    return {"O": x["X"] @ x["W"] + (x["X"] @ x["A"]) @ x["B"]}


def _gated_mlp_dims(bs: int, small: bool) -> dict[str, int]:
    if small:
        return {"rows": 8 * bs, "h": 64, "f": 96}
    return {"rows": 8 * bs, "h": 4096, "f": 4096}


def _gated_mlp_graph(g: _Graph, d: dict[str, int]) -> None:
    x = g.input("X", (d["rows"], d["h"]))
    w1 = g.input("W1", (d["h"], d["f"]))
    w2 = g.input("W2", (d["h"], d["f"]))
    gate = g.op("MatMul", x, w1)
    silu = g.op("Mul", gate, g.op("Sigmoid", gate))  # SiLU spelled x * Sigmoid(x)
    up = g.op("MatMul", x, w2)
    g.op("Mul", silu, up, out="O")
    g.output("O", (d["rows"], d["f"]))


def _gated_mlp_ref(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    x = _f64(inputs)
    gate = x["X"] @ x["W1"]
    return {"O": gate / (1.0 + np.exp(-gate)) * (x["X"] @ x["W2"])}


def _ntrans_dims(bs: int, small: bool) -> dict[str, int]:
    return {"rows": bs, "h": 64 if small else 4096}


def _ntrans_graph(g: _Graph, d: dict[str, int]) -> None:
    shape = (d["rows"], d["h"])
    h = g.input("H", shape)
    x = g.input("X", shape)
    alpha = g.input("alpha", shape)
    axes = g.ints("axes_last", [-1])
    two = g.scalar_const("two", 2.0)
    eps = g.scalar_const("eps", EPS_RMS)
    hn = _rms_pow_recip(g, h, g.param("gamma_h", (d["h"],), "scale"), axes, two, eps)
    t = g.op("Add", g.op("Add", hn, g.op("Mul", x, alpha)), x)
    # The outer norm is spelled differently from the inner one on purpose.
    ms = g.op("ReduceMean", g.op("Mul", t, t), axes, keepdims=1)
    den = g.op("Sqrt", g.op("Add", ms, eps))
    g.op("Mul", g.op("Div", t, den), g.param("gamma_o", (d["h"],), "scale"), out="O")
    g.output("O", shape)


def _ntrans_ref(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    eps = _rounded(EPS_RMS, _dtype_of(inputs))
    x = _f64(inputs)
    h = x["H"].shape[-1]
    hn = _ref_rms(x["H"], _param("gamma_h", (h,), "scale"), eps)
    t = hn + x["X"] * x["alpha"] + x["X"]
    return {"O": _ref_rms(t, _param("gamma_o", (h,), "scale"), eps)}


def _mla_dims(bs: int, small: bool) -> dict[str, int]:
    """DeepSeek-V2/V3-like decode: 16 heads, 1 query token, latent 512, rope 64, 4096 cached."""
    if small:
        return {"b": bs, "heads": 8, "r": 32, "p": 8, "t": 64}
    return {"b": bs, "heads": 16, "r": 512, "p": 64, "t": 4096}


def _mla_scale(p: int) -> float:
    """Softmax scale 1/sqrt(qk head dim). DeepSeek's qk head dim is nope 128 + rope 64 = 3*rope,
    so derive it from the rope width; the reference can then recompute it from shapes."""
    return 1.0 / math.sqrt(3 * p)


def _mla_graph(g: _Graph, d: dict[str, int]) -> None:
    b, nh, r, p, t = d["b"], d["heads"], d["r"], d["p"], d["t"]
    q_nope = g.input("Q_nope", (b, nh, r))  # q_nope already absorbed through W_UK
    q_pe = g.input("Q_pe", (b, nh, p))
    c = g.input("C", (b, t, r))  # compressed latent KV cache
    k_pe = g.input("K_pe", (b, t, p))  # decoupled rope keys, shared by all heads
    s_nope = g.op("MatMul", q_nope, g.op("Transpose", c, perm=[0, 2, 1]))
    s_pe = g.op("MatMul", q_pe, g.op("Transpose", k_pe, perm=[0, 2, 1]))
    s = g.op("Mul", g.op("Add", s_nope, s_pe), g.scalar_init("scale", _mla_scale(p)))
    g.op("MatMul", g.op("Softmax", s, axis=-1), c, out="O")  # the latent output, pre W_UV
    g.output("O", (b, nh, r))


def _mla_ref(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    dtype = _dtype_of(inputs)
    x = _f64(inputs)
    scale = _rounded(_mla_scale(x["K_pe"].shape[-1]), dtype)
    c = x["C"]
    s = (x["Q_nope"] @ np.swapaxes(c, 1, 2) + x["Q_pe"] @ np.swapaxes(x["K_pe"], 1, 2)) * scale
    return {"O": _ref_softmax(s) @ c}


def _norm_linear_dims(bs: int, small: bool) -> dict[str, int]:
    if small:
        return {"rows": 2 * bs, "h": 64, "n": 96}
    return {"rows": 2 * bs, "h": 4096, "n": 4096}


def _layernorm_linear_graph(g: _Graph, d: dict[str, int]) -> None:
    x = g.input("X", (d["rows"], d["h"]))
    w = g.input("W", (d["h"], d["n"]))
    gamma = g.param("gamma", (d["h"],), "scale")
    beta = g.param("beta", (d["h"],), "shift")
    y = g.op("LayerNormalization", x, gamma, beta, axis=-1, epsilon=_f32(EPS_NORM))
    g.op("MatMul", y, w, out="O")
    g.output("O", (d["rows"], d["n"]))


def _layernorm_linear_ref(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    x = _f64(inputs)
    h = x["X"].shape[-1]
    y = _ref_standardise(x["X"], _f32(EPS_NORM))
    y = y * _param("gamma", (h,), "scale") + _param("beta", (h,), "shift")
    return {"O": y @ x["W"]}


def _groups(h: int) -> int:
    """GroupNorm groups: 32 (the usual choice) at full size, fewer when h is tiny."""
    return min(32, h // 8)


def _groupnorm_linear_graph(g: _Graph, d: dict[str, int]) -> None:
    x = g.input("X", (d["rows"], d["h"]))
    w = g.input("W", (d["h"], d["n"]))
    groups = _groups(d["h"])
    # torch.onnx's spelling of nn.GroupNorm: Reshape to (N, G, -1), InstanceNormalization with
    # unit scale and zero bias over each group, Reshape back, then the affine Mul and Add.
    r = g.op("Reshape", x, g.ints("group_shape", [0, groups, -1]))
    inorm = g.op(
        "InstanceNormalization",
        r,
        g.param("in_scale", (groups,), "ones"),
        g.param("in_bias", (groups,), "zeros"),
        epsilon=_f32(EPS_NORM),
    )
    y = g.op("Reshape", inorm, g.ints("row_shape", [0, d["h"]]))
    y = g.op(
        "Add",
        g.op("Mul", y, g.param("gamma", (d["h"],), "scale")),
        g.param("beta", (d["h"],), "shift"),
    )
    g.op("MatMul", y, w, out="O")
    g.output("O", (d["rows"], d["n"]))


def _groupnorm_linear_ref(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    x = _f64(inputs)
    rows, h = x["X"].shape
    groups = _groups(h)
    y = _ref_standardise(x["X"].reshape(rows, groups, -1), _f32(EPS_NORM)).reshape(rows, h)
    y = y * _param("gamma", (h,), "scale") + _param("beta", (h,), "shift")
    return {"O": y @ x["W"]}


def _batchnorm_linear_graph(g: _Graph, d: dict[str, int]) -> None:
    x = g.input("X", (d["rows"], d["h"]))
    w = g.input("W", (d["n"], d["h"]))  # nn.Linear layout (out, in), used via Gemm transB=1
    h = (d["h"],)
    y = g.op(
        "BatchNormalization",
        x,
        g.param("bn_scale", h, "scale"),
        g.param("bn_bias", h, "shift"),
        g.param("bn_mean", h, "shift"),
        g.param("bn_var", h, "var"),
        epsilon=_f32(EPS_NORM),
    )
    g.op("Gemm", y, w, transB=1, out="O")
    g.output("O", (d["rows"], d["n"]))


def _batchnorm_linear_ref(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    x = _f64(inputs)
    h = (x["X"].shape[-1],)
    mean, var = _param("bn_mean", h, "shift"), _param("bn_var", h, "var")
    y = (x["X"] - mean) / np.sqrt(var + _f32(EPS_NORM))
    y = y * _param("bn_scale", h, "scale") + _param("bn_bias", h, "shift")
    return {"O": y @ x["W"].T}


# --------------------------------------------------------------------------------------
# specs
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model: how to build its ONNX graph and its float64 reference.

    ``batch_sizes`` are the benchmark rows written to ``models/bench``; ``build`` accepts any
    batch size. ``spellings`` documents which op spellings the graph uses, so a consumer can
    see what its lifter is exercised on.
    """

    name: str
    batch_sizes: tuple[int, ...]
    description: str
    spellings: tuple[str, ...]
    dims: Callable[[int, bool], dict[str, int]]
    _graph: Callable[[_Graph, dict[str, int]], None]
    _reference: Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]
    opset: int = OPSET

    def build(
        self, bs: int = 1, dtype: DTypeLike = "float16", small: bool = False
    ) -> onnx.ModelProto:
        """The ONNX model at batch size ``bs`` in ``dtype``; ``small`` gives the tiny shapes.

        ``dtype`` is a numpy dtype or name ("float16", "float32", "bfloat16") or a TensorProto
        enum. bf16 graphs build for every model but groupnorm_linear, whose
        InstanceNormalization has no bf16 type at opset 18 (onnx.checker rejects it).
        """
        if bs < 1:
            raise ValueError(f"{self.name}: batch size must be >= 1, got {bs}")
        g = _Graph(_elem_type(dtype))
        self._graph(g, self.dims(bs, small))
        suffix = "small" if small else f"bs{bs}"
        doc = f"mlso benchmark model {self.name}: {self.description}"
        return g.model(f"{self.name}_{suffix}", self.opset, doc)

    def reference(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Float64 numpy evaluation of the same math, for cross-checks (inputs by name)."""
        return self._reference(inputs)

    def input_shapes(self, bs: int = 1, small: bool = False) -> dict[str, tuple[int, ...]]:
        """Graph-input shapes by name, without building the protobuf's data."""
        model = self.build(bs, "float32", small)
        return {
            vi.name: tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
            for vi in model.graph.input
        }


_RMS_POW_DIV = "RMSNorm=Pow(x,2)/ReduceMean/Add(eps)/Sqrt/Div/Mul(gamma)"
_RMS_MUL_RECIP = "RMSNorm=Mul(x,x)/ReduceMean/Add(eps)/Sqrt/Reciprocal/Mul; Mul(gamma, .)"
_RMS_POW_RECIP = "RMSNorm=Pow(x,2)/ReduceMean/Add(eps, .)/Sqrt/Reciprocal/Mul/Mul(gamma)"

SPECS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec(
            "gqa",
            (1, 8, 16),
            "O = Softmax(Q·K, axis=-1)·V; Q(g,256,64) K(g,64,4096) V(g,4096,64), g=2*bs",
            ("MatMul", "Softmax(axis=-1), no scale"),
            _attn_dims,
            _gqa_graph,
            _gqa_ref,
        ),
        ModelSpec(
            "qknorm_gqa",
            (1, 8, 16),
            "gqa with RMSNorm(64)*gamma on Q and on V (Mirage's qknorm benchmark)",
            (_RMS_POW_DIV, "eps and 2 as Constant nodes", "MatMul", "Softmax(axis=-1)"),
            _attn_dims,
            _qknorm_gqa_graph,
            _qknorm_gqa_ref,
        ),
        ModelSpec(
            "qknorm_real",
            (1, 8, 16),
            "gqa with real QK-norm: RMSNorm over the head dim of Q (axis -1) and K (axis 1)",
            ("RMSNormalization (opset 23)", "Transpose", "MatMul", "Softmax(axis=-1)"),
            _attn_dims,
            _qknorm_real_graph,
            _qknorm_real_ref,
            opset=OPSET_RMSNORM,
        ),
        ModelSpec(
            "rmsnorm_linear",
            (1, 8, 16),
            "O = RMSNorm(X)*gamma·W; X(g,4096) W(4096,6144), g=2*bs",
            (_RMS_MUL_RECIP, "eps as initializer", "MatMul"),
            _rmsnorm_linear_dims,
            _rmsnorm_linear_graph,
            _rmsnorm_linear_ref,
        ),
        ModelSpec(
            "lora",
            (1,),
            "O = X·W + (X·A)·B; X(16,256) W(256,4096) A(256,16) B(16,4096)",
            ("MatMul", "Gemm(X, W, C) with C = (X·A)·B"),
            _lora_dims,
            _lora_graph,
            _lora_ref,
        ),
        ModelSpec(
            "gated_mlp",
            (1,),
            "O = SiLU(X·W1) ⊙ (X·W2); X(8,4096) W1,W2(4096,4096)",
            ("MatMul", "SiLU=Mul(x, Sigmoid(x))", "Mul"),
            _gated_mlp_dims,
            _gated_mlp_graph,
            _gated_mlp_ref,
        ),
        ModelSpec(
            "ntrans",
            (1, 8, 16),
            "O = RMSNorm(RMSNorm(H)*g1 + X⊙alpha + X)*g2; H,X,alpha (bs,4096)",
            (
                "inner " + _RMS_POW_RECIP,
                "outer RMSNorm=Mul(x,x)/ReduceMean/Add/Sqrt/Div/Mul(gamma)",
                "Constant nodes",
                "Mul",
                "Add",
            ),
            _ntrans_dims,
            _ntrans_graph,
            _ntrans_ref,
        ),
        ModelSpec(
            "mla",
            (1, 8),
            "absorbed MLA decode: O = Softmax((Q_nope·Cᵀ + Q_pe·K_peᵀ)*s)·C; Q_nope(bs,16,512) "
            "Q_pe(bs,16,64) C(bs,4096,512) K_pe(bs,4096,64), s=1/sqrt(192)",
            ("Transpose", "MatMul", "Add", "Mul(scale initializer)", "Softmax(axis=-1)"),
            _mla_dims,
            _mla_graph,
            _mla_ref,
        ),
        ModelSpec(
            "layernorm_linear",
            (1, 8),
            "O = LayerNorm(X; gamma, beta)·W; X(g,4096) W(4096,4096), g=2*bs",
            ("LayerNormalization(axis=-1)", "MatMul"),
            _norm_linear_dims,
            _layernorm_linear_graph,
            _layernorm_linear_ref,
        ),
        ModelSpec(
            "groupnorm_linear",
            (1, 8),
            "O = GroupNorm(32 groups; gamma, beta)(X)·W; X(g,4096) W(4096,4096), g=2*bs",
            (
                "GroupNorm=Reshape/InstanceNormalization/Reshape/Mul/Add (torch.onnx's)",
                "MatMul",
            ),
            _norm_linear_dims,
            _groupnorm_linear_graph,
            _groupnorm_linear_ref,
        ),
        ModelSpec(
            "batchnorm_linear",
            (1, 8),
            "O = BatchNorm_inference(X)·Wᵀ; X(g,4096) W(4096,4096) as (out,in), g=2*bs",
            ("BatchNormalization (initializer stats)", "Gemm(transB=1)"),
            _norm_linear_dims,
            _batchnorm_linear_graph,
            _batchnorm_linear_ref,
        ),
    ]
}


# --------------------------------------------------------------------------------------
# inputs, build_all, CLI
# --------------------------------------------------------------------------------------


def random_inputs(
    model: onnx.ModelProto, seed: int = 0, dims: Mapping[str, int] | None = None
) -> dict[str, np.ndarray]:
    """Unit-scale (standard normal) values for every graph input that is not an initializer.

    The dtype comes from the model. Symbolic dimensions must be given in ``dims`` (by
    their dim_param name); otherwise a ValueError names the input and the dimension.
    """
    rng = np.random.default_rng(seed)
    init_names = {t.name for t in model.graph.initializer}
    out: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        if vi.name in init_names:
            continue
        tt = vi.type.tensor_type
        shape: list[int] = []
        for dim in tt.shape.dim:
            if dim.HasField("dim_value"):
                shape.append(dim.dim_value)
            elif dims is not None and dim.dim_param in dims:
                shape.append(int(dims[dim.dim_param]))
            else:
                raise ValueError(
                    f"input {vi.name!r} has symbolic dim {dim.dim_param!r}; pass dims="
                    f"{{{dim.dim_param!r}: N}}"
                )
        dtype = _np_dtype(tt.elem_type)
        out[vi.name] = rng.standard_normal(shape).astype(dtype)
    return out


def _default_out() -> Path:
    return Path(__file__).resolve().parent


def _write(model: onnx.ModelProto, path: Path) -> Path:
    """Check and write ``model``; write via a temp file so a failed build leaves no stub."""
    onnx.checker.check_model(model, full_check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".onnx.tmp")
    tmp.write_bytes(model.SerializeToString())
    tmp.replace(path)
    return path


def build_all(out_dir: str | Path | None = None, small_only: bool = False) -> list[Path]:
    """Write the small fp32 set (``small/{name}.onnx``) and, unless ``small_only``, the fp16
    benchmark set (``bench/{name}_bs{bs}.onnx``) under ``out_dir``; return the paths."""
    out = Path(out_dir) if out_dir is not None else _default_out()
    paths: list[Path] = []
    for spec in SPECS.values():
        model = spec.build(SMALL_BS, "float32", small=True)
        paths.append(_write(model, out / "small" / f"{spec.name}.onnx"))
    if not small_only:
        for spec in SPECS.values():
            for bs in spec.batch_sizes:
                model = spec.build(bs, "float16", small=False)
                paths.append(_write(model, out / "bench" / f"{spec.name}_bs{bs}.onnx"))
    return paths


def _rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out64 = np.asarray(out).astype(np.float64)
    return float(np.linalg.norm(out64 - ref) / max(np.linalg.norm(ref), 1e-300))


def verify_file(path: Path, seed: int = 0) -> float:
    """Run ``path`` in ONNX Runtime (CPU) and return its relative error to the reference."""
    import onnxruntime as ort

    model = onnx.load(str(path))
    name = path.stem.rsplit("_bs", 1)[0]
    inputs = random_inputs(model, seed)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = sess.run(None, inputs)
    return _rel_err(out, SPECS[name].reference(inputs)["O"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: models/)")
    parser.add_argument("--small-only", action="store_true", help="write only the small set")
    parser.add_argument(
        "--verify", action="store_true", help="run each file in ORT CPU against the reference"
    )
    args = parser.parse_args(argv)
    paths = build_all(args.out, small_only=args.small_only)
    for p in paths:
        line = f"{p.stat().st_size:>8} B  {p}"
        if args.verify:
            line += f"  rel_err={verify_file(p):.2e}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
