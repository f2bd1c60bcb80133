"""Values kept relative to a running max: value = stored * exp(degree * M[coords]).

Why: exp-sums of logits near 100 overflow fp32 (near 11 in fp16), yet the IR means the exact
values. Generated code therefore keeps such values *scaled*: a stored number plus a reference
to a max tensor M (the running max of an accumulator group, the row max of a stabilised EXP, the
per-block max of a split-KV partial). Ops that commute with the scale carry it along (mul, div,
neg, square, reciprocal, relu, sums along axes M does not vary over, and add/sub/max of equally
scaled operands); a division of two equally scaled values cancels it. Every other op first
*materialises* the exact value stored * exp(degree * M), which overflows exactly when the exact
value does. The rules are tables (UNARY_DEGREE, binary functions in BINARY), not if-chains.

A Scale names M's coordinates as C expressions over the kernel's coordinate tokens, so two
scales are the same iff key, degree and coordinate strings are equal (conservative), and a
scale is independent of a loop variable iff no coordinate mentions it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from mlso_cli.codegen.cfmt import Coords, cdiv
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import DType, Op


@dataclass(frozen=True)
class Scale:
    key: Node
    """The max tensor M (a materialised node)."""
    degree: int
    mcoords: Coords
    """M's coordinates at this value's position."""


@dataclass(frozen=True)
class BufferScale:
    """How a stored tensor is scaled: M's coordinate j is coords[i] // div for mfunc[j] = (i, div),
    or 0 for None."""

    key: Node
    degree: int
    mfunc: tuple[tuple[int, int] | None, ...]

    def at(self, coords: Sequence[str]) -> Scale:
        mc = []
        for f in self.mfunc:
            if f is None:
                mc.append("0")
            else:
                i, d = f
                mc.append(cdiv(coords[i], d))
        return Scale(self.key, self.degree, tuple(mc))


def structural(scale: Scale, tokens: Sequence[str]) -> BufferScale | None:
    """The BufferScale of a tensor whose element at `tokens` has `scale`, or None when M's
    coordinates are not simple functions (token, token / d, 0) of the tokens."""
    index = {t: i for i, t in enumerate(tokens) if t != "0"}
    mfunc: list[tuple[int, int] | None] = []
    for c in scale.mcoords:
        if c == "0":
            mfunc.append(None)
        elif c in index:
            mfunc.append((index[c], 1))
        else:
            m = re.fullmatch(r"\((\w+) / (\d+)\)", c)
            if not m or m.group(1) not in index:
                return None
            mfunc.append((index[m.group(1)], int(m.group(2))))
    return BufferScale(scale.key, scale.degree, tuple(mfunc))


@dataclass(frozen=True)
class Val:
    """An fp32 C expression (usually a temporary) and the scale it is stored relative to."""

    code: str
    scale: Scale | None = None


@dataclass
class Storage:
    """Where a materialised tensor lives: global buffer or shared-memory tile."""

    ptr: str
    dtype: DType
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    scale: BufferScale | None = None
    buffer: object = None
    """The plan buffer (global storages) or None (shared memory)."""
    computed: object = None
    """An input whose values are an index predicate (indexmask.IndexMask): every read computes
    the element from its coordinates, nothing is loaded (buffer is then None)."""
    selection: object = None
    """An input whose values are a constant selection (selection.Selection): a sum that selects
    with it reads the selected element only."""


def _rescaled(s: Scale, degree: int) -> Scale | None:
    return None if degree == 0 else replace(s, degree=degree)


def _half(d: int) -> int | None:
    return d // 2 if d % 2 == 0 else None


UNARY_DEGREE: dict[Op, Callable[[int], int | None]] = {
    Op.CAST: lambda d: d,
    Op.NEG: lambda d: d,
    Op.RELU: lambda d: d,
    Op.SQUARE: lambda d: 2 * d,
    Op.RECIPROCAL: lambda d: -d,
    Op.SQRT: _half,
    Op.RSQRT: lambda d: None if _half(d) is None else -_half(d),
}
"""Unary ops f with f(v * e^(d m)) = f(v) * e^(d' m), as d -> d' (None: must materialise)."""


BinaryRule = Callable[[Scale | None, Scale | None], tuple[Scale | None, bool, bool]]
"""(scale of a, scale of b) -> (scale of the result, materialise a?, materialise b?)."""


def _same(a: Scale, b: Scale) -> bool:
    return a.key == b.key and a.mcoords == b.mcoords


def _mul(a: Scale | None, b: Scale | None) -> tuple[Scale | None, bool, bool]:
    if a and b:
        if _same(a, b):
            return _rescaled(a, a.degree + b.degree), False, False
        return a, False, True
    return a or b, False, False


def _div(a: Scale | None, b: Scale | None) -> tuple[Scale | None, bool, bool]:
    if a and b:
        if _same(a, b):
            return _rescaled(a, a.degree - b.degree), False, False
        return a, False, True
    if b:
        return replace(b, degree=-b.degree), False, False
    return a, False, False


def _additive(a: Scale | None, b: Scale | None) -> tuple[Scale | None, bool, bool]:
    if a is None and b is None:
        return None, False, False
    if a is not None and a == b:
        return a, False, False
    return None, a is not None, b is not None


BINARY: dict[Op, BinaryRule] = {
    Op.MUL: _mul,
    Op.DIV: _div,
    Op.ADD: _additive,
    Op.SUB: _additive,
    Op.MAX: _additive,
}


# ---- matmul: linear in a scaled operand ---------------------------------------------------------


def _keeps(bs: BufferScale, contracted: int) -> bool:
    """A scale whose max tensor M does not vary along the contracted axis factors out of the sum."""
    return all(f is None or f[0] != contracted for f in bs.mfunc)


def _moved(bs: BufferScale, dims: dict[int, int]) -> BufferScale | None:
    """bs re-indexed from an operand's coordinates to C's: operand dim i is C dim dims[i]
    (batch dims right-aligned); None when M follows an operand dim with no C counterpart."""
    out: list[tuple[int, int] | None] = []
    for f in bs.mfunc:
        if f is None:
            out.append(None)
        elif f[0] in dims:
            out.append((dims[f[0]], f[1]))
        else:
            return None
    return BufferScale(bs.key, bs.degree, tuple(out))


def matmul_scale(
    a: BufferScale | None, b: BufferScale | None, a_rank: int, b_rank: int, c_rank: int
) -> tuple[BufferScale | None, bool, bool]:
    """(scale of C = A @ B, keep A's stored numbers?, keep B's stored numbers?).

    Why: a matmul is linear in each operand. A per-row scale of A (M independent of K) is a
    per-row scale of C, a per-column scale of B likewise. Keeping the stored numbers is what keeps
    exp(s - M) in [0, 1] when it is staged in 16-bit storage for the tensor cores. Only one
    operand's scale can be carried (C holds one max tensor); the other is materialised."""
    lead = c_rank - 2
    a_dims = {i: i + (c_rank - a_rank) for i in range(a_rank - 2)} | {a_rank - 2: lead}
    b_dims = {i: i + (c_rank - b_rank) for i in range(b_rank - 2)} | {b_rank - 1: lead + 1}
    if a is not None and _keeps(a, a_rank - 1):
        moved = _moved(a, a_dims)
        if moved is not None:
            return moved, True, False
    if b is not None and _keeps(b, b_rank - 2):
        moved = _moved(b, b_dims)
        if moved is not None:
            return moved, False, True
    return None, False, False
