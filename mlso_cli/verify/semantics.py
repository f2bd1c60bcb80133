"""What every μGraph op means in the finite field, written once over an abstract algebra.

Why an algebra: the fingerprint (field.Field on FieldArray values) and the degree analysis
(degree.DegreeAlgebra on degree records) must give every op the same definition, or the bound
would be derived for a different program than the one tested. Both implement the same methods:
const, add, sub, mul, neg, inv, exp, oracle, oracle_reduce, q_known, matmul, reduce_sum,
reshape, transpose, broadcast.

The canonical forms of docs/verification.md live here, so equivalent spellings meet in the field:
  sigmoid(x) = 1 / (1 + exp(-x))       silu(x) = x * sigmoid(x)
  tanh(x)    = 2 * sigmoid(2x) - 1     rsqrt(x) = 1 / sqrt(x), sqrt an oracle
  gelu(x)    = x * (1 + erf(x * K)) / 2, erf an oracle and K = 1/sqrt(2)
  relu(x)    = max(x, 0), max an oracle
  square(x)  = x * x                   reduce_mean = reduce_sum * (1/n)
  x / y      = x * inverse(y)          cast = identity
Constants within fp16 rounding of 1/sqrt(2) or sqrt(2) are taken as K or 1/K exactly
(`canonical_const`), so the erf spelling of GELU that exporters write (x / 1.4142135 or
x * 0.70710677) meets the fused op. This is the one place the field check equates constants that
differ: two programs that differ only in such a constant are not told apart (the float check
still is).
Oracles (sqrt, erf, max) are keyed functions of the p-residue that return both residues
(field.py), so exp(x - max(x)) is a true exp and a stabilised softmax equals a plain one.
max (MAX, RELU, REDUCE_MAX) is one associative, commutative, idempotent reduction over a *set*:
  max(max(S1), max(S2)) = reduce_max(S1 | S2) = max over S1 | S2,  max{a} = a
so a tiled max (partial maxima of a grid split's tiles, at any nesting, combined by REDUCE_MAX
or an elementwise MAX) meets the plain REDUCE_MAX. The field implements it (field.SET_ORACLES):
a max value keeps the set of values it is the max of, and hashes that set.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any

from mlso_cli.ir.canonical import INV_SQRT2, canonical_const  # noqa: F401 (re-exported)
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import Op
from mlso_cli.ir.shapes import broadcast as broadcast_shapes

ONE, TWO, ZERO, HALF = Fraction(1), Fraction(2), Fraction(0), Fraction(1, 2)


def gelu(A: Any, x: Any) -> Any:
    phi2 = A.add(A.const(ONE), A.oracle("erf", A.mul(x, A.const(INV_SQRT2))))
    return A.mul(A.mul(x, phi2), A.const(HALF))


def sigmoid(A: Any, x: Any) -> Any:
    # 1 + g^k is never 0 when g has odd order q, so a true exp cannot make this denominator vanish
    return A.inv(A.add(A.const(ONE), A.exp(A.neg(x))), nonzero=A.q_known(x))


def _tanh(A: Any, x: Any) -> Any:
    return A.sub(A.mul(A.const(TWO), sigmoid(A, A.mul(A.const(TWO), x))), A.const(ONE))


def _max(A: Any, a: Any, b: Any) -> Any:
    """MAX of operands broadcast to their joint shape: inside a THREAD body a node's own shape
    is the element's, (), while the operands are whole tiles."""
    shape = broadcast_shapes(tuple(a.shape), tuple(b.shape))
    return A.oracle("max", A.broadcast(a, shape), A.broadcast(b, shape))


def _mean(A: Any, n: Node, x: Any) -> Any:
    return A.mul(A.reduce_sum(x, n.arg), A.const(Fraction(1, n.src[0].shape[n.arg])))


SEMANTICS: dict[Op, Callable[..., Any]] = {
    Op.EXP: lambda A, n, x: A.exp(x),
    Op.SQUARE: lambda A, n, x: A.mul(x, x),
    Op.SQRT: lambda A, n, x: A.oracle("sqrt", x),
    Op.RSQRT: lambda A, n, x: A.inv(A.oracle("sqrt", x)),
    Op.RECIPROCAL: lambda A, n, x: A.inv(x),
    Op.NEG: lambda A, n, x: A.neg(x),
    Op.SILU: lambda A, n, x: A.mul(x, sigmoid(A, x)),
    Op.SIGMOID: lambda A, n, x: sigmoid(A, x),
    Op.TANH: lambda A, n, x: _tanh(A, x),
    Op.ERF: lambda A, n, x: A.oracle("erf", x),
    Op.GELU: lambda A, n, x: gelu(A, x),
    Op.RELU: lambda A, n, x: A.oracle("max", x, A.broadcast(A.const(ZERO), tuple(x.shape))),
    Op.CAST: lambda A, n, x: x,
    Op.ADD: lambda A, n, a, b: A.add(a, b),
    Op.SUB: lambda A, n, a, b: A.sub(a, b),
    Op.MUL: lambda A, n, a, b: A.mul(a, b),
    Op.DIV: lambda A, n, a, b: A.mul(a, A.inv(b)),
    Op.MAX: lambda A, n, a, b: _max(A, a, b),
    Op.MATMUL: lambda A, n, a, b: A.matmul(a, b),
    Op.REDUCE_SUM: lambda A, n, x: A.reduce_sum(x, n.arg),
    Op.REDUCE_MEAN: _mean,
    Op.REDUCE_MAX: lambda A, n, x: A.oracle_reduce("max", x, n.arg),
    Op.RESHAPE: lambda A, n, x: A.reshape(x, n.arg),
    Op.TRANSPOSE: lambda A, n, x: A.transpose(x, n.arg),
    Op.BROADCAST: lambda A, n, x: A.broadcast(x, n.arg),
}
"""Op -> definition as a function of (algebra, node, *args)."""

ACC_TERMS: dict[Op, Callable[..., Any]] = {
    Op.ACC_SUM: lambda A, x: x,
    Op.ACC_EXP_SUM: lambda A, s: A.reduce_sum(A.exp(s), len(s.shape) - 1),
    Op.ACC_EXP_WSUM: lambda A, s, v: A.matmul(A.exp(s), v),
}
"""Accumulator -> the term added at each for-loop step (exact semantics, no stabiliser)."""
