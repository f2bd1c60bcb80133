"""Log-scaled fp32 values: the running-max representation that float code must use for softmax.

Why: the IR says ACC_EXP_SUM / ACC_EXP_WSUM mean sum(exp(s)) and sum(exp(s) @ v) in exact
arithmetic; subtracting a running max is an obligation of code generation (docs/architecture.md). In the
"float32" interpreter mode we discharge it the way generated code does: an accumulator is held as
`v * exp(m)` with `m` the running row max, partial outputs keep their max next to them (as
flash-decoding stores it), and a split-KV combine rescales the partials to their common max
before summing. A value is materialised (v * exp(m)) only when an op has no scaled rule, so
logits of +-100 never overflow fp32 while the program's meaning stays the exact one.

Each rule is a function in `RULES` (op -> function of the node and its arguments).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import Op
from mlso_cli.verify.storage import round_to


@dataclass
class Scaled:
    """The fp32 value v * exp(m); m broadcasts against v."""

    v: np.ndarray
    m: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return self.v.shape

    def materialise(self) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):
            return (self.v * np.exp(self.m)).astype(np.float32)

    def full_m(self) -> np.ndarray:
        return np.broadcast_to(self.m, self.v.shape)

    def __getitem__(self, idx: Any) -> Scaled:
        return Scaled(self.v[idx], self.full_m()[idx])


def plain(x: Any) -> np.ndarray:
    return x.materialise() if isinstance(x, Scaled) else x


def _exp(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return np.exp(x).astype(np.float32)


def _same(a: Scaled, b: Scaled) -> bool:
    """Both relative to the same max (codegen compares the max tensor and its coordinates)."""
    try:
        shape = np.broadcast_shapes(a.m.shape, b.m.shape)
    except ValueError:
        return False
    return bool(np.array_equal(np.broadcast_to(a.m, shape), np.broadcast_to(b.m, shape)))


def _add(n: Node, a: Any, b: Any, sign: float = 1.0) -> Any:
    """Equally scaled operands add as stored; anything else is materialised first (as codegen's
    scale.BINARY does: a sum of differently scaled values has no single max)."""
    if isinstance(a, Scaled) and isinstance(b, Scaled) and _same(a, b):
        return Scaled(a.v + np.float32(sign) * b.v, a.m)
    return plain(a) + np.float32(sign) * plain(b)


def _mul(n: Node, a: Any, b: Any) -> Scaled:
    if isinstance(a, Scaled) and isinstance(b, Scaled):
        if _same(a, b):
            return Scaled(a.v * b.v, a.m + b.m)
        return Scaled(a.v * plain(b), a.m)
    if isinstance(a, Scaled):
        return Scaled(a.v * b, a.m)
    return Scaled(a * b.v, b.m)


def _div(n: Node, a: Any, b: Any) -> Any:
    with np.errstate(divide="ignore", invalid="ignore"):
        if isinstance(a, Scaled) and isinstance(b, Scaled):
            if _same(a, b):
                return a.v / b.v  # the scale cancels
            return Scaled(a.v / plain(b), a.m)
        if isinstance(a, Scaled):
            return Scaled(a.v / b, a.m)
        return Scaled(a / b.v, -b.m)


def _reciprocal(n: Node, a: Scaled) -> Scaled:
    with np.errstate(divide="ignore"):
        return Scaled(np.float32(1) / a.v, -a.m)


def _reduce_sum(n: Node, a: Scaled) -> Scaled:
    ax = n.arg
    m = a.m
    if m.ndim == a.v.ndim and m.shape[ax] != 1:
        if np.all(m == m.take([0], axis=ax)):
            m = m.take([0], axis=ax)
        else:  # rescale to the common max before summing (the split-KV combine)
            big = np.max(m, axis=ax, keepdims=True)
            big = np.where(np.isfinite(big), big, 0).astype(np.float32)
            return Scaled(np.sum(a.v * _exp(m - big), axis=ax, keepdims=True), big)
    return Scaled(np.sum(a.v, axis=ax, keepdims=True), m)


def _row_m(m: np.ndarray, ndim: int) -> np.ndarray | None:
    """m as (..., M, 1) when it is constant along the last axis, else None."""
    if m.ndim < ndim or m.shape[-1] == 1:
        return m
    return m[..., :1] if np.all(m == m[..., :1]) else None


def _col_m(m: np.ndarray, ndim: int) -> np.ndarray | None:
    """m as (..., 1, N) when it is constant along the second-last axis, else None."""
    if m.ndim < ndim or m.shape[-2] == 1:
        return m
    return m[..., :1, :] if np.all(m == m[..., :1, :]) else None


def _matmul(n: Node, a: Any, b: Any) -> Any:
    """Linear in a row-scaled A, or else a column-scaled B (codegen.scale.matmul_scale)."""
    if isinstance(a, Scaled):
        m = _row_m(a.m, a.v.ndim)
        if m is not None:
            return Scaled(np.matmul(a.v, plain(b)), m)
    if isinstance(b, Scaled):
        m = _col_m(b.m, b.v.ndim)
        if m is not None:
            return Scaled(np.matmul(plain(a), b.v), m)
    return np.matmul(plain(a), plain(b))


def _cast(n: Node, a: Scaled) -> Scaled:
    """A cast keeps the scaled numbers; inside a block it rounds them as its staging copy does."""
    if n.phase is None:
        return a
    return Scaled(round_to(a.v, n.arg, np.float32), a.m)


def stabilised_exp(axis: int, x: np.ndarray, factors: list[np.ndarray]) -> Scaled:
    """exp(x) as exp(x - M), M = max of x over `axis` where no mask factor is zero (a masked-out
    large logit must not underflow the kept ones); codegen's RowMax stabiliser."""
    keep = np.ones(x.shape, bool)
    for f in factors:
        keep = keep & (np.broadcast_to(f, x.shape) != 0)
    m = np.max(np.where(keep, x, -np.inf), axis=axis, keepdims=True)
    m = _finite(m)
    return Scaled(_exp(np.minimum(x - m, 0)), m)  # codegen's exp_rel clamps at exp(0)


def _view(fn: Callable[[np.ndarray, Any], np.ndarray]) -> Callable[[Node, Scaled], Scaled]:
    def rule(n: Node, a: Scaled) -> Scaled:
        return Scaled(fn(a.v, n.arg), fn(a.full_m(), n.arg))

    return rule


def _power(p: float) -> Callable[[Node, Scaled], Scaled]:
    """f(v e^m) = f(v) e^(p m) for f = x^p (square, sqrt, rsqrt): codegen's UNARY_DEGREE."""
    fns = {2.0: np.square, 0.5: np.sqrt, -0.5: lambda x: 1 / np.sqrt(x)}
    return lambda n, a: Scaled(
        fns[p](a.v).astype(np.float32), (a.m * np.float32(p)).astype(np.float32)
    )


def _reduce_mean(n: Node, a: Scaled) -> Scaled:
    out = _reduce_sum(n, a)
    return Scaled(out.v / np.float32(a.v.shape[n.arg]), out.m)


def _reduce_max(n: Node, a: Scaled) -> Any:
    """A max along an axis the max tensor does not vary over keeps the scale (exp is increasing)."""
    m = a.m
    if m.ndim == a.v.ndim and m.shape[n.arg] != 1:
        if not np.all(m == m.take([0], axis=n.arg)):
            return np.max(a.materialise(), axis=n.arg, keepdims=True)
        m = m.take([0], axis=n.arg)
    return Scaled(np.max(a.v, axis=n.arg, keepdims=True), m)


RULES: dict[Op, Callable[..., Any]] = {
    Op.ADD: _add,
    Op.SUB: lambda n, a, b: _add(n, a, b, -1.0),
    Op.MUL: _mul,
    Op.DIV: _div,
    Op.RECIPROCAL: _reciprocal,
    Op.NEG: lambda n, a: Scaled(-a.v, a.m),
    Op.REDUCE_SUM: _reduce_sum,
    Op.REDUCE_MEAN: _reduce_mean,
    Op.REDUCE_MAX: _reduce_max,
    Op.SQUARE: _power(2.0),
    Op.SQRT: _power(0.5),
    Op.RSQRT: _power(-0.5),
    Op.RELU: lambda n, a: Scaled(np.maximum(a.v, 0), a.m),
    Op.MATMUL: _matmul,
    Op.CAST: _cast,
    Op.RESHAPE: _view(lambda x, s: np.reshape(x, s)),
    Op.TRANSPOSE: _view(lambda x, p: np.transpose(x, p)),
    Op.BROADCAST: _view(lambda x, s: np.broadcast_to(x, s)),
}
"""Ops that keep a scaled value scaled, as codegen's scale.py tables (UNARY_DEGREE, BINARY) do;
every other op materialises its arguments first."""


# ---- the online-softmax accumulators -----------------------------------------------------------


def exp_sum_step(
    state: tuple[np.ndarray, np.ndarray] | None, s: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(m, l): running row max and sum of exp(s - m), rescaled when the max grows."""
    rowmax = np.max(s, axis=-1, keepdims=True)
    if state is None:
        m = _finite(rowmax)
        return m, np.sum(_exp(s - m), axis=-1, keepdims=True)
    m0, l0 = state
    m = _finite(np.maximum(m0, rowmax))
    return m, l0 * _exp(m0 - m) + np.sum(_exp(s - m), axis=-1, keepdims=True)


def exp_wsum_step(
    state: tuple[np.ndarray, np.ndarray] | None, s: np.ndarray, v: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(m, acc): running row max and sum of exp(s - m) @ v, rescaled when the max grows."""
    rowmax = np.max(s, axis=-1, keepdims=True)
    if state is None:
        m = _finite(rowmax)
        return m, np.matmul(_exp(s - m), v)
    m0, acc = state
    m = _finite(np.maximum(m0, rowmax))
    return m, acc * _exp(m0 - m) + np.matmul(_exp(s - m), v)


def _finite(m: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(m), m, 0).astype(np.float32)
