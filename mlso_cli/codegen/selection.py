"""Constant selections read directly: a Slice, Split or rotate-half is a read, not a sum.

Why: the IR has no slice op. Lifting writes a Slice, Split, Concat or RoPE's rotate-half as a
selection (frontend/lift.py `_apply_factor`): the input reshaped to (..., 1, B, ...), multiplied
by a constant matrix P of shape (B_out, B) whose rows hold at most one nonzero (+1 or -1), and
summed over B. The constant is an input named `mlso_select_*`. Code generation that does not know
P's values folds the whole row of B: each element of a query split from a fused QKV projection
read all three fp32 blocks and multiplied two of them by zero, and each rotate-half element six.
On an H100 the RoPE kernel of a Phi-3-width layer (128 tokens) took 7.7 µs for 7 MB of traffic
(benchmarks/kernel_profile.py at 8bfbe09).

When code generation is given the constant (generate's `constants`, as for index masks), a
REDUCE_SUM over B of MUL(x, P) whose P is such a constant reads the one selected element:
x[..., k(bo), ...] times the row's sign. k and the sign are printed from P's values: a literal
when B_out is 1, else an expression of the output coordinate along B_out.

Exactness: the fold computes 0 + x_0 p_0 + ... + x_{B-1} p_{B-1} in fp32; with one nonzero
p_k = ±1 and finite x, every other term is ±0, so the sum is x_k p_k exactly (up to the sign of a
zero). A row of P with no nonzero gives 0 either way (the sign 0 times one finite element). The
two differ only where an unselected element is infinite or NaN: the fold then gives NaN, the
direct read does not, which is what the original Slice or Split computes. The decision is an
exact check of every element of the constant, and `mlso verify` regenerates the source from the
packaged model's initializers, so it reaches the same decision.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mlso_cli.codegen.cfmt import Coords, bcast, canon, paren
from mlso_cli.codegen.scale import Val
from mlso_cli.ir.graph import KernelGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import Op

if TYPE_CHECKING:
    from mlso_cli.codegen.emitter import Emitter

SELECT_PREFIX = "mlso_select_"
"""The inputs lifting invents for selections (frontend/lift.py `_apply_factor`)."""
MAX_ROWS = 64
"""Most rows of P printed as one expression (lifting's B_out is the number of output blocks of a
selection term: 1 for a slice, 2 for rotate-half)."""


@dataclass(frozen=True, eq=False)
class Selection:
    """A selection constant's values (every element 0, 1 or -1)."""

    values: np.ndarray
    digest: str
    """sha256 of the values and shape: part of the program's build key (pipeline/build.py)."""


def known_selections(
    kg: KernelGraph, constants: Mapping[str, np.ndarray] | None
) -> dict[int, Selection]:
    """Input index -> its values, for each `mlso_select_*` input of kg whose value is in
    `constants` (by input name), has the input's shape and holds only 0, 1 and -1."""
    if not constants:
        return {}
    out: dict[int, Selection] = {}
    for i, (n, name) in enumerate(zip(kg.inputs, kg.input_names)):
        arr = constants.get(name) if name.startswith(SELECT_PREFIX) else None
        if arr is None or tuple(np.shape(arr)) != tuple(n.shape) or n in kg.outputs:
            continue
        values = np.asarray(arr, dtype=np.float64)
        if not np.isin(values, (-1.0, 0.0, 1.0)).all():
            continue
        digest = hashlib.sha256(values.tobytes() + repr(values.shape).encode()).hexdigest()
        out[i] = Selection(values, digest)
    return out


@dataclass(frozen=True)
class _Rows:
    """P as (B_out, B): per output row, the selected index and its sign (0: no element)."""

    index: tuple[int, ...]
    sign: tuple[float, ...]
    coord: str
    """The output coordinate along B_out ("0" when B_out is 1)."""


def _rows(values: np.ndarray, p_shape: tuple[int, ...], axis: int, pc: Coords) -> _Rows | None:
    """P's rows when `values` (of p_shape) varies along `axis` and at most one other dim, with
    at most one nonzero per row; None otherwise."""
    others = [j for j, d in enumerate(p_shape) if d > 1 and j != axis]
    if len(others) > 1:
        return None
    if others:
        d = others[0]
        if p_shape[d] > MAX_ROWS:
            return None
        mat = np.moveaxis(values, (d, axis), (0, 1)).reshape(p_shape[d], p_shape[axis])
        coord = pc[d]
    else:
        mat = values.reshape(1, p_shape[axis])
        coord = "0"
    index, sign = [], []
    for row in mat:
        nz = np.flatnonzero(row)
        if len(nz) > 1:
            return None
        index.append(int(nz[0]) if len(nz) else 0)
        sign.append(float(row[nz[0]]) if len(nz) else 0.0)
    return _Rows(tuple(index), tuple(sign), coord)


def _table(coord: str, values: tuple, literal) -> str:
    """C expression of values[coord]: one literal, an affine form, or a chain of conditionals."""
    if len(set(values)) == 1:
        return literal(values[0])
    if all(isinstance(v, int) for v in values) and len(values) > 1:
        step = values[1] - values[0]
        if all(values[i] == values[0] + i * step for i in range(len(values))):
            scaled = paren(coord) if abs(step) == 1 else f"{abs(step)} * {paren(coord)}"
            if not values[0]:
                return f"({scaled})" if step > 0 else f"(-{scaled})"
            return f"({values[0]} {'+' if step > 0 else '-'} {scaled})"
    chain = literal(values[-1])
    for i in range(len(values) - 2, -1, -1):
        chain = f"{paren(coord)} == {i} ? {literal(values[i])} : {chain}"
    return f"({chain})"


def _selection_of(storage: Mapping[Node, object], p: Node) -> Selection | None:
    while p.op is Op.CAST:  # 0 and ±1 are exact in every dtype
        p = p.src[0]
    sel = getattr(storage.get(p), "selection", None)
    return sel if isinstance(sel, Selection) else None


@dataclass(frozen=True)
class _Match:
    a: Node
    """The operand selected from."""
    axis: int
    """The summed axis, in the reduction's (and a's broadcast) coordinates."""
    p: Node
    values: np.ndarray


def _match(storage: Mapping[Node, object], n: Node) -> _Match | None:
    if n.op is not Op.REDUCE_SUM or not isinstance(n.arg, int):
        return None
    x, axis = n.src[0], n.arg
    if x.op is not Op.MUL:
        return None
    for a, p in ((x.src[0], x.src[1]), (x.src[1], x.src[0])):
        sel = _selection_of(storage, p)
        a_axis = axis - (len(x.shape) - len(a.shape))
        if sel is None or a_axis < 0 or a.shape[a_axis] != x.shape[axis]:
            continue
        p_axis = axis - (len(x.shape) - len(p.shape))
        if p_axis < 0 or p.shape[p_axis] != x.shape[axis]:
            continue
        values = sel.values.reshape(p.shape)
        if _rows(values, p.shape, p_axis, ("0",) * len(p.shape)) is None:
            continue
        return _Match(a, axis, p, values)
    return None


def selects(storage: Mapping[Node, object], n: Node) -> bool:
    """Whether `n` is a sum that a constant selection in `storage` turns into a read (a reduction
    root then gets an elementwise kernel: one read per element, no fold)."""
    return _match(storage, n) is not None


def selected_read(em: Emitter, n: Node, coords: Coords) -> Val | None:
    """REDUCE_SUM `n` at `coords` as the one element its constant selection picks, or None when
    n is not such a reduction (the caller folds it)."""
    m = _match(em.storage, n)
    if m is None:
        return None
    x, p = n.src[0], m.p
    p_axis = m.axis - (len(x.shape) - len(p.shape))
    rows = _rows(m.values, p.shape, p_axis, bcast(p.shape, coords))
    assert rows is not None  # _match checked the values
    inner = list(coords)
    inner[m.axis] = "0"
    probe = em.child().value(m.a, bcast(m.a.shape, canon(x.shape, inner))).scale
    if probe is not None:
        return None  # a scaled operand: the fold's rules decide its scale
    k = _table(rows.coord, rows.index, str)
    if not k.isdigit():
        name = em.names.new("sk")
        em.lines.append(f"const int {name} = {k};")
        k = name
    inner[m.axis] = k
    v = em.value(m.a, bcast(m.a.shape, canon(x.shape, inner)))
    return _signed(em, v, rows.coord, rows.sign)


def _signed(em: Emitter, v: Val, coord: str, signs: tuple[float, ...]) -> Val:
    """v times signs[coord], the sign printed from its values: v itself, its negation, or a
    product with a literal or a conditional on `coord`."""
    sign = _table(coord, signs, lambda s: f"{s:.1f}f")
    if sign == "1.0f":
        return Val(v.code)
    if sign == "-1.0f":
        return Val(em.var(f"mlso::ew::neg({v.code})"))
    return Val(em.var(f"{sign} * {v.code}"))


def placed_product(em: Emitter, n: Node, coords: Coords) -> Val | None:
    """MUL(x, P) at `coords` with P a known selection constant that varies along at most one
    dim: x times P's element there, printed from P's values (a literal, or a conditional on
    that one coordinate), so P is never read, nor x where P is all zero. None otherwise (the
    caller multiplies).

    Why: lifting writes a Concat as a sum of its pieces, each broadcast over the concatenated
    dim and multiplied by a 0/1 constant that places it (DeepSeek's MLA concatenates the rope and
    no-rope parts of each key that way); the kernel read the constant at every element. Exact
    for finite x, as `selected_read` is: x * 1 is x, and x * 0 is a zero."""
    if n.op is not Op.MUL:
        return None
    for xs, p in ((n.src[0], n.src[1]), (n.src[1], n.src[0])):
        sel = _selection_of(em.storage, p)
        if sel is None:
            continue
        varying = [j for j, d in enumerate(p.shape) if d > 1]
        if len(varying) > 1 or (varying and p.shape[varying[0]] > MAX_ROWS):
            continue
        signs = tuple(float(v) for v in sel.values.reshape(-1))
        pc = bcast(p.shape, coords)
        coord = pc[varying[0]] if varying else "0"
        if set(signs) == {0.0}:
            return Val("0.0f")
        v = em.value(xs, bcast(xs.shape, coords))
        if v.scale is not None:
            return None  # a scaled operand: the product's rules decide its scale
        return _signed(em, v, coord, signs)
    return None
