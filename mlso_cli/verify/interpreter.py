"""The numpy interpreter: runs a μGraph literally, every block, every step, every map.

Why: a wrong imap, fmap or omap must give a wrong answer on the CPU long before a GPU sees it,
and the float check needs an fp64 reference of the original region. The walk (walk.py) is shared
with the finite-field fingerprint, so both read tiles and write outputs the same way.

Modes:
  - "float64": every value in float64, no storage rounding; the exact reference semantics.
  - "simulate": float64 arithmetic, but every kernel-level tensor and SAVE output stored as
    F16/BF16 is rounded to that dtype (bf16 = fp32 rounded to nearest-even on the top 16 bits),
    so storage rounding shows. fp32 tensors stay in float64, so exact-semantics partials such as
    sum(exp(100)) cannot overflow.
  - "float32": numpy float32 compute with storage rounding, "as codegen computes": it runs
    codegen.ascomputed.as_computed(kg), so the EXPs that generated code keeps relative to a row
    max (softmax numerators, at kernel and block level) and the block rewrites are codegen's own
    decisions; ACC_EXP_SUM / ACC_EXP_WSUM keep a running max like online softmax, and scaled
    values stay scaled through the ops of scaled.RULES (matmuls included), as in codegen.

Ops are a table (op -> numpy function); inside a block everything is numpy on the tile, and only
blocks and steps are Python loops.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mlso_cli.codegen.ascomputed import as_computed_map, sixteen_bit_scratch
from mlso_cli.codegen.synthetic import Stabilised
from mlso_cli.ir.graph import BlockGraph, KernelGraph
from mlso_cli.ir.node import Node, const_value
from mlso_cli.ir.ops import DType, Op
from mlso_cli.verify import scaled as sc
from mlso_cli.verify.storage import round_to
from mlso_cli.verify.walk import LiteralBackend, Observer, evaluate

MODES = ("float64", "simulate", "float32")

_erf = np.frompyfunc(math.erf, 1, 1)


def _erf_np(x: np.ndarray) -> np.ndarray:
    return np.asarray(_erf(x), dtype=x.dtype) if np.ndim(x) else x.dtype.type(math.erf(x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def _reduce(fn: Callable[..., np.ndarray]) -> Callable[[Node, np.ndarray], np.ndarray]:
    return lambda n, x: fn(x, axis=n.arg, keepdims=True)


OPS: dict[Op, Callable[..., np.ndarray]] = {
    Op.EXP: lambda n, x: np.exp(x),
    Op.SQUARE: lambda n, x: x * x,
    Op.SQRT: lambda n, x: np.sqrt(x),
    Op.RSQRT: lambda n, x: 1 / np.sqrt(x),
    Op.RECIPROCAL: lambda n, x: 1 / x,
    Op.NEG: lambda n, x: -x,
    Op.SILU: lambda n, x: x * _sigmoid(x),
    Op.SIGMOID: lambda n, x: _sigmoid(x),
    Op.TANH: lambda n, x: np.tanh(x),
    Op.ERF: lambda n, x: _erf_np(x),
    Op.GELU: lambda n, x: 0.5 * x * (1 + _erf_np(x / math.sqrt(2))),
    Op.RELU: lambda n, x: np.maximum(x, 0),
    Op.CAST: lambda n, x: x,
    Op.ADD: lambda n, a, b: a + b,
    Op.SUB: lambda n, a, b: a - b,
    Op.MUL: lambda n, a, b: a * b,
    Op.DIV: lambda n, a, b: a / b,
    Op.MAX: lambda n, a, b: np.maximum(a, b),
    Op.MATMUL: lambda n, a, b: np.matmul(a, b),
    Op.REDUCE_SUM: _reduce(np.sum),
    Op.REDUCE_MEAN: _reduce(np.mean),
    Op.REDUCE_MAX: _reduce(np.max),
    Op.RESHAPE: lambda n, x: np.reshape(x, n.arg),
    Op.TRANSPOSE: lambda n, x: np.transpose(x, n.arg),
    Op.BROADCAST: lambda n, x: np.broadcast_to(x, n.arg),
}
"""Op -> numpy function of (node, *args); the compute dtype follows the arguments."""


class FloatBackend(LiteralBackend):
    """float64 and simulate modes: float64 arithmetic; `rounding` turns storage rounding on."""

    dtype: type = np.float64

    def __init__(self, rounding: bool) -> None:
        self.rounding = rounding

    def _round(self, x: np.ndarray, node: Node) -> np.ndarray:
        if not self.rounding or (node.dtype is DType.F32 and self.dtype is np.float64):
            return x  # simulate mode holds fp32 storage in float64: exact-semantics partials
        return round_to(x, node.dtype, self.dtype)

    def input(self, node: Node, value: Any) -> np.ndarray:
        x = np.asarray(value, dtype=np.float64)
        if x.shape != node.shape:
            raise ValueError(f"input #{node.arg}: shape {x.shape}, graph expects {node.shape}")
        return self._round(x, node).astype(self.dtype, copy=False)

    def const(self, node: Node) -> Any:
        return self.dtype(float(const_value(node)))

    def compute(self, node: Node, args: list[Any]) -> Any:
        with np.errstate(all="ignore"):
            out = OPS[node.op](node, *args)
            if node.op is Op.CAST and node.phase is not None:
                out = self._round(out, node.replace(dtype=node.arg))  # explicit cast inside a block
            return np.asarray(out, dtype=self.dtype) if np.ndim(out) else self.dtype(out)

    def store(self, node: Node, value: Any) -> Any:
        return self._round(value, node)

    def acc_step(self, node: Node, state: Any, args: list[Any]) -> Any:
        with np.errstate(all="ignore"):
            term = ACC_TERMS[node.op](*args)
        return term if state is None else state + term

    def acc_final(self, node: Node, state: Any, steps: int) -> Any:
        return state

    def buffer(self, bg: BlockGraph, save: Node) -> Any:
        return np.zeros(bg.output_shape(save), dtype=self.dtype)

    def put(self, buf: Any, index: tuple[int | slice, ...], value: Any, save: Node) -> None:
        buf[index] = self._round(np.asarray(value, dtype=self.dtype), save)

    def finish(self, buf: Any) -> Any:
        return buf


ACC_TERMS: dict[Op, Callable[..., np.ndarray]] = {
    Op.ACC_SUM: lambda x: x,
    Op.ACC_EXP_SUM: lambda s: np.sum(np.exp(s), axis=-1, keepdims=True),
    Op.ACC_EXP_WSUM: lambda s, v: np.matmul(np.exp(s), v),
}
"""Exact-semantics accumulator terms: the value added at each for-loop step."""


class _ScaledBuffer:
    """An output buffer that may receive log-scaled tiles (partials that keep their max)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.v = np.zeros(shape, np.float32)
        self.m: np.ndarray | None = None


class Float32Backend(FloatBackend):
    """float32 mode: fp32 compute, storage rounding, online-softmax accumulators."""

    dtype = np.float32

    def __init__(self, outputs: frozenset[Node] = frozenset()) -> None:
        super().__init__(rounding=True)
        self.outputs = outputs
        """Kernel-level tensors that codegen stores in their own dtype: graph outputs, and library
        GEMM results kept in 16-bit scratch (ascomputed.sixteen_bit_scratch); every other kernel
        writes fp32 scratch, so logits of 100 are not rounded by 0.03."""

    def compute(self, node: Node, args: list[Any]) -> Any:
        if isinstance(node.arg, Stabilised):
            with np.errstate(all="ignore"):
                return sc.stabilised_exp(
                    node.arg.axis, sc.plain(args[0]), [sc.plain(a) for a in args[1:]]
                )
        if node.op is Op.MATMUL and node.phase is None:
            args = [self._operand(s, a) for s, a in zip(node.src, args)]
        if any(isinstance(a, sc.Scaled) for a in args):
            rule = sc.RULES.get(node.op)
            if rule is not None:
                with np.errstate(all="ignore"):
                    return rule(node, *args)
            args = [sc.plain(a) for a in args]
        return super().compute(node, args)

    def _operand(self, src: Node, value: Any) -> Any:
        """A kernel-level matmul operand as the tensor cores read it: rounded to a 16-bit dtype."""
        if src.dtype is DType.F32:
            return value
        if isinstance(value, sc.Scaled):
            return sc.Scaled(self._round(value.v, src), value.m)
        return self._round(value, src)

    def store(self, node: Node, value: Any) -> Any:
        if node.phase is None and node.op is not Op.PROJ and node not in self.outputs:
            return value  # fp32 scratch
        if isinstance(value, sc.Scaled):
            # codegen keeps scaled intermediates as their scaled numbers (rounded where they are
            # 16-bit); graph outputs are materialised by run()
            return (
                value if node.dtype is DType.F32 else sc.Scaled(self._round(value.v, node), value.m)
            )
        return self._round(value, node)

    def acc_step(self, node: Node, state: Any, args: list[Any]) -> Any:
        with np.errstate(all="ignore"):
            return F32_ACC_STEPS[node.op](state, *[sc.plain(a) for a in args])

    def acc_final(self, node: Node, state: Any, steps: int) -> Any:
        return F32_ACC_FINAL.get(node.op, lambda s: s)(state)

    def buffer(self, bg: BlockGraph, save: Node) -> Any:
        return _ScaledBuffer(bg.output_shape(save))

    def put(self, buf: Any, index: tuple[int | slice, ...], value: Any, save: Node) -> None:
        if isinstance(value, sc.Scaled) and save.dtype is DType.F32:
            if buf.m is None:
                buf.m = np.zeros(buf.v.shape, np.float32)
            buf.v[index] = value.v
            buf.m[index] = value.full_m()
            return
        buf.v[index] = self._round(np.asarray(sc.plain(value), dtype=np.float32), save)

    def finish(self, buf: Any) -> Any:
        return buf.v if buf.m is None else sc.Scaled(buf.v, buf.m)


F32_ACC_STEPS: dict[Op, Callable[..., Any]] = {
    Op.ACC_SUM: lambda state, x: x if state is None else state + x,
    Op.ACC_EXP_SUM: sc.exp_sum_step,
    Op.ACC_EXP_WSUM: sc.exp_wsum_step,
}
"""float32 mode: accumulator -> step function (running max for the rescaling accumulators)."""

F32_ACC_FINAL: dict[Op, Callable[[Any], Any]] = {
    Op.ACC_EXP_SUM: lambda state: sc.Scaled(state[1], state[0]),
    Op.ACC_EXP_WSUM: lambda state: sc.Scaled(state[1], state[0]),
}
"""float32 mode: (running max m, scaled sum) -> the value sum * exp(m), kept log-scaled."""


def backend(mode: str) -> FloatBackend:
    """The backend for an interpreter mode."""
    if mode not in MODES:
        raise ValueError(f"unknown interpreter mode {mode!r}; use one of {MODES}")
    return Float32Backend() if mode == "float32" else FloatBackend(rounding=mode == "simulate")


def run(
    kg: KernelGraph,
    inputs: Sequence[np.ndarray],
    mode: str = "float64",
    observe: Observer | None = None,
) -> list[np.ndarray]:
    """Execute kg on numpy inputs; outputs are float64 (float32 in "float32" mode) arrays."""
    be = backend(mode)
    if isinstance(be, Float32Backend):
        rounded = sixteen_bit_scratch(kg)
        kg, done = as_computed_map(kg)
        be.outputs = frozenset(kg.outputs) | {done[n] for n in rounded if n in done}
    outs = evaluate(kg, inputs, be, observe)
    if mode != "float32":
        return [np.asarray(sc.plain(o)) for o in outs]
    return [
        round_to(np.asarray(sc.plain(o)), n.dtype, np.float32)
        if isinstance(o, sc.Scaled)
        else np.asarray(o)
        for o, n in zip(outs, kg.outputs)
    ]


def run_field(kg: KernelGraph, inputs: Sequence[Any], fld: Any) -> list[Any]:
    """Finite-field fingerprint of kg (see field.py); re-exported here beside `run`."""
    from mlso_cli.verify.fieldrun import run_field as _run_field

    return _run_field(kg, inputs, fld)
