"""Constant masks computed from indices: a causal mask is an index predicate, not a tensor.

Why: a decoder's attention reads a seq x seq mask that folding at load made a constant (lifting
names it `mlso_mask_*`), and every block of the attention kernel loaded tiles of it from global
memory (cp.async into shared memory, or element by element), although each element is a
function of its row and column: col <= row + k. When code generation is given the constant's
values, an input whose every element equals one of the predicates below is computed from the
tile's global coordinates instead: no load, no kernel parameter.

Soundness: the decision is an exact comparison of the whole constant (numpy, every element,
every broadcast slice) with the predicate's values, so the computed value IS the tensor; the
μGraph and its hash do not change (the input stays an input, and the runtime still passes it).
`mlso verify` regenerates the source from the packaged μGraph and the same constants (the
packaged model's initializers of the node's `mlso_mask_*` inputs) and so reaches the same
decision; a mask that differs in one element keeps today's load.

The rules are data: PREDICATES (the index forms, with a diagonal offset k so that a mask with a
KV offset fits) and VALUES (what "kept" and "hidden" are stored as).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mlso_cli.codegen.cfmt import Coords, c_float
from mlso_cli.codegen.selection import SELECT_PREFIX
from mlso_cli.ir.graph import KernelGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import ELEMENTWISE, VIEW, Op

MASK_PREFIX = "mlso_mask_"
"""The inputs lifting invents for masks (frontend/lift.py `_masked`): the candidates, in optimize
and in verify alike, so both ask about the same inputs. A model weight that happens to be
triangular (a cumulative-sum matrix read by a matmul) is never one."""


@dataclass(frozen=True)
class Predicate:
    """One index form: `holds(rows, cols, k)` in numpy, `c` its C text, `offset(row, first,
    count, ncols)`: the k a row with `count` kept entries, the first at column `first`, implies
    (None when that row does not pin k)."""

    name: str
    holds: Callable[[np.ndarray, np.ndarray, int], np.ndarray]
    c: str
    offset: Callable[[int, int, int, int], int | None]


PREDICATES: tuple[Predicate, ...] = (
    # causal (lower triangle): key col visible from query row when col <= row + k
    Predicate(
        "lower",
        lambda r, c, k: c <= r + k,
        "{col} <= {row}{k}",
        lambda row, first, count, ncols: count - 1 - row if 0 < count < ncols else None,
    ),
    # anti-causal (upper triangle): col >= row + k
    Predicate(
        "upper",
        lambda r, c, k: c >= r + k,
        "{col} >= {row}{k}",
        lambda row, first, count, ncols: first - row if 0 < count < ncols else None,
    ),
)
"""Index forms, tried in order. k is the diagonal offset (k = kv_len - q_len for a causal mask
over a KV cache)."""

VALUES: tuple[tuple[object, object], ...] = (
    (1, 0),  # a 0/1 mask (lifting's form: exp(x) * mask)
    (True, False),  # a boolean mask (Where's condition)
    (0, -np.inf),  # an additive mask
)
"""(value where the predicate holds, value where it does not)."""


@dataclass(frozen=True)
class IndexMask:
    """A constant whose element at (..., row, col) is `kept` where the predicate holds with
    offset k, else `hidden`; constant along every leading axis."""

    predicate: str
    k: int
    kept: float
    hidden: float

    def describe(self) -> str:
        p = _PREDICATE[self.predicate]
        cond = p.c.format(col="col", row="row", k=_plus(self.k))
        return f"{cond} ? {_num(self.kept)} : {_num(self.hidden)}"

    def expr(self, coords: Coords) -> str:
        """The fp32 C expression of the element at `coords` (the last two are row and column)."""
        row = f"({coords[-2]})" if len(coords) >= 2 else "0"
        col = f"({coords[-1]})"
        cond = _PREDICATE[self.predicate].c.format(col=col, row=row, k=_plus(self.k))
        return f"({cond} ? {c_float(self.kept)} : {c_float(self.hidden)})"


_PREDICATE = {p.name: p for p in PREDICATES}


def _plus(k: int) -> str:
    return "" if k == 0 else f" + {k}" if k > 0 else f" - {-k}"


def _num(x: float) -> str:
    return str(int(x)) if np.isfinite(x) and float(x).is_integer() else str(x)


def recognise(arr: np.ndarray) -> IndexMask | None:
    """The index predicate every element of `arr` equals exactly, or None. Leading axes must be
    of size 1 or hold the same matrix in every slice (a mask broadcast over batch and heads)."""
    arr = np.asarray(arr)
    if arr.ndim < 2 or arr.size == 0:
        return None
    rows, cols = arr.shape[-2:]
    flat = arr.reshape(-1, rows, cols)
    first = flat[0]
    if flat.shape[0] > 1 and not (flat == first).all():
        return None
    for kept, hidden in VALUES:
        if (arr.dtype == np.bool_) != isinstance(kept, bool):
            continue
        on = first == kept
        if not (on | (first == hidden)).all():
            continue
        counts = on.sum(axis=1)
        firsts = np.where(counts > 0, on.argmax(axis=1), cols)
        r = np.arange(rows)[:, None]
        c = np.arange(cols)[None, :]
        for p in PREDICATES:
            ks = {
                p.offset(i, int(firsts[i]), int(counts[i]), cols)
                for i in range(rows)
                if p.offset(i, int(firsts[i]), int(counts[i]), cols) is not None
            }
            if len(ks) != 1:
                continue
            (k,) = ks
            want = np.where(p.holds(r, c, k), kept, hidden).astype(arr.dtype)
            if np.array_equal(first, want):  # the proof: every element, exactly
                return IndexMask(p.name, k, float(kept), float(hidden))
    return None


_PASS_THROUGH = ELEMENTWISE | VIEW | {Op.CAST, Op.THREAD, Op.GRAPH_DEF}
"""Readers through which a computed input is evaluated by the emitter or copied element by
element into a block's tile (no reader that indexes the tensor's memory directly: a kernel-level
matmul or reduction)."""


def computed_inputs(
    kg: KernelGraph, constants: Mapping[str, np.ndarray] | None
) -> dict[int, IndexMask]:
    """Input index -> its index predicate, for each `mlso_mask_*` input of kg whose value is in
    `constants` (by input name), has the input's shape, is an index predicate exactly, and is
    read only through elementwise ops, views and block kernels."""
    if not constants:
        return {}
    readers: dict[Node, list[Node]] = {}
    for n in kg.nodes():
        for s in n.src:
            readers.setdefault(s, []).append(n)
    out: dict[int, IndexMask] = {}
    for i, (n, name) in enumerate(zip(kg.inputs, kg.input_names)):
        arr = constants.get(name) if name.startswith(MASK_PREFIX) else None
        if arr is None or tuple(np.shape(arr)) != tuple(n.shape) or n in kg.outputs:
            continue
        if not _read_in_place(n, readers):
            continue
        mask = recognise(arr)
        if mask is not None:
            out[i] = mask
    return out


def _read_in_place(n: Node, readers: Mapping[Node, list[Node]]) -> bool:
    seen: set[Node] = set()
    stack = [n]
    while stack:
        x = stack.pop()
        for r in readers.get(x, []):
            if r.op not in _PASS_THROUGH:
                return False
            if r.op in VIEW and r not in seen:  # a view's own readers index it too
                seen.add(r)
                stack.append(r)
    return True


def mask_constants(
    names: Sequence[str],
    lookup: Callable[[str], np.ndarray | None],
    sources: Sequence[str] | None = None,
) -> dict[str, np.ndarray]:
    """The values of the `mlso_mask_*` and `mlso_select_*` (selection.py) inputs among `names`
    (a program's input names) that `lookup` knows, looked up by `sources[i]` when given (the
    packaged node's input names, in the program's order), else by name: what optimize (the
    lifted region's constants) and verify (the packaged model's initializers) hand to code
    generation."""
    out = {}
    for i, name in enumerate(names):
        if name.startswith((MASK_PREFIX, SELECT_PREFIX)):
            v = lookup(sources[i] if sources is not None and i < len(sources) else name)
            if v is not None:
                out[name] = np.asarray(v)
    return out
