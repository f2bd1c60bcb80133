"""Slice, Concat, Split, Neg and row-wise ScatterND along one axis as signed block selections,
with existing IR ops.

The IR has no strided view or offset, so a slice cannot be a view. What it has is enough for an
exact form: along the selected axis, every output element is one input element, possibly negated
(rotate_half's `concat(-x[..., d/2:], x[..., :d/2])`). A `Selection` records that map element by
element. To lift it, the axis is factored as (A, B, C) on the input side and (A, B', C) on the
output side, such that the map is the identity on A and C and a signed 0/±1 matrix P (B' x B) on
the middle factor:

    out = reshape(reduce_sum(reshape(x, (..., A, 1, B, C, ...)) * P[B', B, 1, ...], axis of B))

A contiguous slice or concat piece has C = the block length and A = 1; a strided slice
(`x[..., ::2]`) has C = 1 and A = the number of strides. P is a lifted constant like the 0/1 masks;
the reduction is over at most `MAX_SELECT_BLOCKS` elements, which code generation evaluates inside
its elementwise consumer (`codegen/lower.py::INLINE_REDUCE_MAX_LEN`). The form is linear and exact
for finite values, so the finite-field checker, the abstract expressions and the search take it
as it is. A Neg of a selection and a selection of a selection compose into one P (-1 entries), so
rotate_half is one multiply and one short sum, not four ops.

The same functions decide fusability (`support.py`) and lift the node (`lift.py`), so a node the
partitioner admits always lifts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAX_SELECT_BLOCKS = 16
"""The most input blocks (B) one selection may sum over; more and the node stays out."""

MAX_SELECT_AXIS = 1 << 20
"""The longest axis a selection is analysed along (the map is held element by element); a
longer one stays out rather than costing memory at load."""


@dataclass(frozen=True, eq=False)
class Selection:
    """out[..., o, ...] = sign[o] * terms[term[o]][..., index[o], ...] along `axis`.

    `terms` are whatever the caller selects from (IR nodes in lifting, sizes in support)."""

    axis: int
    terms: tuple
    sizes: tuple[int, ...]
    """The axis length of each term."""
    term: np.ndarray
    index: np.ndarray
    sign: np.ndarray

    @property
    def size(self) -> int:
        return len(self.index)

    def take(self, idx: np.ndarray) -> Selection:
        """This selection followed by picking output elements `idx` (a slice of the result)."""
        return Selection(
            self.axis, self.terms, self.sizes, self.term[idx], self.index[idx], self.sign[idx]
        )

    def negated(self) -> Selection:
        return Selection(self.axis, self.terms, self.sizes, self.term, self.index, -self.sign)


def plain(term, size: int, axis: int) -> Selection:
    """The identity selection of one tensor whose axis has `size` elements."""
    return Selection(
        axis,
        (term,),
        (size,),
        np.zeros(size, np.int64),
        np.arange(size, dtype=np.int64),
        np.ones(size, np.int64),
    )


def concat(parts: list[Selection]) -> Selection:
    """The selections one after another along their (common) axis; equal terms are shared."""
    terms: list = []
    sizes: list[int] = []
    term_idx, index, sign = [], [], []
    for p in parts:
        remap = []
        for t, n in zip(p.terms, p.sizes):
            k = next((j for j, u in enumerate(terms) if u is t), None)
            if k is None:
                k = len(terms)
                terms.append(t)
                sizes.append(n)
            remap.append(k)
        term_idx.append(np.asarray(remap, np.int64)[p.term])
        index.append(p.index)
        sign.append(p.sign)
    return Selection(
        parts[0].axis,
        tuple(terms),
        tuple(sizes),
        np.concatenate(term_idx),
        np.concatenate(index),
        np.concatenate(sign),
    )


def scatter_rows(data, updates, n: int, indices: np.ndarray) -> Selection | str:
    """ScatterND(data, indices, updates) with constant `indices` of shape (k, 1) as a selection
    along axis 0: output row i is updates' row j where indices[j] == i, else data's row i. A
    sentence for `inspect` when it is not one (indices out of range, or repeated: ONNX leaves the
    result of a repeated index undefined).

    Why: exporters write a slice assignment (`q[..., :d] = q_nope`, DeepSeek's MLA) as ScatterND
    with a constant index list over the transposed tensor; as a node of its own it ran in ONNX
    Runtime between the regions, with its transposes."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if np.any(idx < -n) or np.any(idx >= n):
        return f"ScatterND: an index is out of range for an axis of {n}"
    idx = np.where(idx < 0, idx + n, idx)
    if len(np.unique(idx)) != len(idx):
        return "ScatterND: repeated indices (their result is undefined), so the node is kept"
    term = np.zeros(n, np.int64)
    index = np.arange(n, dtype=np.int64)
    term[idx] = 1
    index[idx] = np.arange(len(idx), dtype=np.int64)
    return Selection(0, (data, updates), (n, len(idx)), term, index, np.ones(n, np.int64))


def slice_indices(dim: int, start: int, end: int, step: int) -> np.ndarray:
    """The indices ONNX Slice takes along one axis of length `dim`.

    ONNX's rules (negative start/end count from the end; clamped to [0, dim] for a positive
    step and to [-1, dim-1] for a negative one) are Python's `slice.indices`."""
    if step == 0:
        raise ValueError("Slice: a step of 0")
    return np.arange(*slice(int(start), int(end), int(step)).indices(dim), dtype=np.int64)


@dataclass(frozen=True)
class Factor:
    """One term of a selection as the identity on A and C and the signed matrix P on B."""

    a: int
    b: int
    b_out: int
    c: int
    p: np.ndarray
    """(b_out, b) entries in {-1, 0, 1}, at most one nonzero per row."""


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def factor(sel: Selection, t: int) -> Factor | None:
    """The smallest (A, B, C) factoring of term `t`'s part of `sel`, or None when every one
    needs more than MAX_SELECT_BLOCKS input blocks."""
    n_in, n_out = sel.sizes[t], sel.size
    member = sel.term == t
    o = np.arange(n_out, dtype=np.int64)
    best: Factor | None = None
    for a in _divisors(math.gcd(n_in, n_out)):
        for c in _divisors(math.gcd(n_in // a, n_out // a)):
            b, b_out = n_in // (a * c), n_out // (a * c)
            if b > MAX_SELECT_BLOCKS:
                continue
            if best is not None and (b * b_out, -c) >= (best.b * best.b_out, -best.c):
                continue
            i = sel.index
            a_o, bo, c_o = o // (b_out * c), (o // c) % b_out, o % c
            a_i, b_i, c_i = i // (b * c), (i // c) % b, i % c
            if not np.all(~member | ((a_i == a_o) & (c_i == c_o))):
                continue
            code = np.where(member, b_i * 3 + sel.sign + 1, -1)
            ref = code[np.arange(b_out) * c]
            if not np.array_equal(code, ref[bo]):
                continue
            p = np.zeros((b_out, b), np.int64)
            rows = np.flatnonzero(ref >= 0)
            p[rows, ref[rows] // 3] = ref[rows] % 3 - 1
            best = Factor(a, b, b_out, c, p)
    return best


def too_long(op: str, axis: int) -> str:
    return (
        f"{op}: axis {axis} has more than {MAX_SELECT_AXIS} elements, too long to lift as a "
        "block selection, so the node is kept as it is"
    )


def problem(sel: Selection, op: str) -> str | None:
    """Why `sel` has no lifted form (a sentence for `inspect`), or None when every term factors
    within MAX_SELECT_BLOCKS."""
    if max((sel.size, *sel.sizes)) > MAX_SELECT_AXIS:
        return too_long(op, sel.axis)
    for t in range(len(sel.terms)):
        if np.any(sel.term == t) and factor(sel, t) is None:
            return TOO_MANY_BLOCKS.format(op=op, axis=sel.axis, max=MAX_SELECT_BLOCKS)
    return None


def is_identity(sel: Selection) -> bool:
    return (
        len(sel.terms) == 1
        and sel.sizes[0] == sel.size
        and np.array_equal(sel.index, np.arange(sel.size))
        and bool(np.all(sel.sign == 1))
    )


TOO_MANY_BLOCKS = (
    "{op}: selects along axis {axis} in more than {max} separate blocks (the lifted form sums "
    "over the blocks, at most {max}), so the node is kept as it is"
)
