"""Finite-field fingerprints of block values: exact deduplication and goal tests for the search.

Why: abstract expressions decide what *may* lead to the target (pruning), but they abstract
away which index a sum runs over, so two values with one expression can differ, and the output
test needs more than a subexpression check. A fingerprint is the value itself, evaluated in the
finite field of verify/field.py on inputs fixed once per search, at every block and loop step of
the provisional grid: values with equal fingerprints are equal programs up to the checker's
false-accept probability (observational equivalence, as in bottom-up program synthesis), and a
value is an output when its fingerprint, block for block, is the target output's.

Every value carries leading dims (B, S): B blocks of the provisional grid, and S loop steps for
loop-phase values (1 otherwise). Ops reuse verify/semantics.py with their axes shifted past
those two dims, so the search and the verifier share one meaning of every op.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import product
from types import SimpleNamespace
from typing import Any

import numpy as np

from mlso_cli.ir.graph import KernelGraph
from mlso_cli.ir.node import Node, const_value
from mlso_cli.ir.ops import ELEMENTWISE, REDUCE, Op
from mlso_cli.search.dims import DimClasses
from mlso_cli.search.space import Dims, Signature, feed_input, input_map, save_omap
from mlso_cli.verify.field import BadPrime, Field, FieldArray, ZeroDenominator
from mlso_cli.verify.fieldrun import run_field
from mlso_cli.verify.semantics import ACC_TERMS, SEMANTICS, canonical_const
from mlso_cli.verify.walk import chunk_bounds, step_index

LEAD = 2
MAX_PRINT_ELEMENTS = 1 << 23
"""The largest value (blocks x steps x tile) a fingerprint is computed for; a larger one is refused
as a zero denominator is. Why: at a real width the reduced target can keep 128 rows and a 3,072-wide
hidden index, and the enumeration then spells outer products of rows by rows by hidden (the tiny
zoo exports' norm -> linear regions have them too, at 8-32x their largest tensor): 50M residues,
800 MB with both fields, several GB with the hashing temporaries. A search worker of the
Phi-3-width export was killed by the OOM killer for it. The largest value any search of the
zoo_small exports computes is 524,288 entries (gemma3_tiny's first region), 1/16 of the cap."""
_BROADCASTING = ELEMENTWISE | {Op.MATMUL, Op.ACC_EXP_WSUM}
"""Leading dims of every fingerprint: (blocks, loop steps)."""


@dataclass(frozen=True)
class Print:
    """A value's fingerprint: field residues with shape (B, S, *tile)."""

    value: FieldArray
    field_p: int = 0
    field_q: int = 0

    def uniform(self) -> bool:
        """Every entry the same value: a constant, however it was computed (x - x, x / x)."""
        p = self.value.p
        return p.size > 0 and bool((p == p.flat[0]).all())

    def ray(self) -> Hashable:
        """The key of the value up to a constant factor: residues divided by the first nonzero
        one (in each residue field). c * x and x share a ray. A value of one entry has no ray:
        any two nonzero scalars are constant multiples of each other, so at batch 1 every per-row
        statistic (a mean, a variance plus eps, its rsqrt) would share one and all but the first
        would be dropped; its key stands in."""
        if self.value.p.size < 2:
            return ("one", self.key())
        return RayKey(self)

    def key(self) -> Hashable:
        return ValueKey(self)

    def digest_key(self) -> bytes:
        """`key()` as a digest of every residue: what ValueKey's equality stands for (tests)."""
        v = self.value
        h = hashlib.blake2b(digest_size=16)
        h.update(repr(v.shape).encode())
        h.update(np.ascontiguousarray(v.p).tobytes())
        if v.q_known():
            h.update(np.ascontiguousarray(v.q).tobytes())
        return h.digest()

    def digest_ray(self) -> Hashable:
        """`ray()` as a digest of the normalised residues: what RayKey's equality stands for."""
        if self.value.p.size < 2:
            return ("one", self.digest_key())
        h = hashlib.blake2b(digest_size=16)
        h.update(repr(self.value.shape).encode())
        for res, r in (
            (self.value.p, self.field_p),
            (self.value.q if self.value.q_known() else None, self.field_q),
        ):
            if res is None:
                continue
            flat = res.reshape(-1)
            nz = np.flatnonzero(flat)
            if nz.size == 0:
                h.update(b"zero")
                continue
            inv = pow(int(flat[nz[0]]), -1, r)
            h.update((flat * inv % r).tobytes())  # r < 2^27: products fit int64
        return h.digest()


# ---- dict keys of values ---------------------------------------------------------------------
# Why not a digest: the search asks "seen this value?" (and "seen a constant multiple of it?")
# once per admitted state, and hashing every residue of a large tile (blake2b over the bytes,
# after normalising each entry for a ray) was 30% of a linear region's exploration (deepseek_v3
# tiny's first one). These keys hash a few sampled residues and a residue sum, and compare the
# whole arrays only when the hashes meet: equal exactly when the digests were (tests/
# test_search_valuekeys.py), so every dict lookup, and with it the search, is unchanged.

_SAMPLE = 48
"""Residues a key's hash reads (spread over the array), besides their sum."""
_POSITIONS: dict[int, np.ndarray] = {}


def _positions(n: int) -> np.ndarray:
    got = _POSITIONS.get(n)
    if got is None:
        got = _POSITIONS[n] = np.unique(np.linspace(0, n - 1, min(n, _SAMPLE)).astype(np.int64))
    return got


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bytes, as the digest compared them (residues are nonnegative: the signedness of
    the dtype does not change the bytes, its width does)."""
    return a.dtype.itemsize == b.dtype.itemsize and np.array_equal(a, b)


class ValueKey:
    """A value's identity as a dict key: its shape and residues (the q-residue while known)."""

    __slots__ = ("_h", "res", "shape")

    def __init__(self, pr: Print) -> None:
        v = pr.value
        self.shape = v.shape
        self.res = (_flat(v.p),) + ((_flat(v.q),) if v.q_known() else ())
        pos = _positions(self.res[0].size)
        self._h = hash(
            (self.shape, len(self.res)) + tuple((int(r.sum()), r[pos].tobytes()) for r in self.res)
        )

    def __hash__(self) -> int:
        return self._h

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ValueKey):
            return NotImplemented
        return (
            self._h == other._h
            and self.shape == other.shape
            and len(self.res) == len(other.res)
            and all(_same(a, b) for a, b in zip(self.res, other.res))
        )


class RayKey:
    """A value up to a constant factor as a dict key: per residue field, zero, or the index of
    the first nonzero residue and the residues over it (compared by cross-multiplying, so the
    array is never normalised: x / x0 = y / y0 exactly when x * y0 = y * x0)."""

    __slots__ = ("_h", "res", "shape")

    def __init__(self, pr: Print) -> None:
        v = pr.value
        self.shape = v.shape
        fields = [(_flat(v.p), pr.field_p)]
        if v.q_known():
            fields.append((_flat(v.q), pr.field_q))
        parts: list[tuple] = []
        res: list[tuple] = []
        for flat, r in fields:
            first = 0 if flat[0] else (int(np.argmax(flat != 0)) if flat.any() else -1)
            if first < 0:
                parts.append(("zero",))
                res.append((None, -1, r))
                continue
            x0 = int(flat[first])
            inv = pow(x0, -1, r)
            pos = _positions(flat.size)
            parts.append((first, int(flat.sum()) % r * inv % r, (flat[pos] * inv % r).tobytes()))
            res.append((flat, first, r))
        self.res = tuple(res)
        self._h = hash((self.shape, tuple(parts)))

    def __hash__(self) -> int:
        return self._h

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RayKey):
            return NotImplemented
        if self._h != other._h or self.shape != other.shape or len(self.res) != len(other.res):
            return False
        for (a, fa, r), (b, fb, _) in zip(self.res, other.res):
            if fa != fb:
                return False
            if a is None:
                continue
            if a.dtype.itemsize != b.dtype.itemsize or a.size != b.size:
                return False
            a0, b0 = int(a[fa]), int(b[fb])
            if not np.array_equal(a * b0 % r, b * a0 % r):  # r < 2^27: products fit int64
                return False
        return True


def _lead_node(n: Node, lead: tuple[int, int], srcs: Sequence[FieldArray]) -> Any:
    """`n` as seen with two leading dims: axes shifted, target shapes prefixed."""
    arg = n.arg
    if n.op in REDUCE:
        arg = n.arg + LEAD
    elif n.op is Op.TRANSPOSE:
        arg = (0, 1) + tuple(p + LEAD for p in n.arg)
    elif n.op in (Op.RESHAPE, Op.BROADCAST):
        arg = lead + tuple(n.arg if n.op is Op.BROADCAST else n.shape)
    src = tuple(SimpleNamespace(shape=tuple(s.shape)) for s in srcs)
    return SimpleNamespace(op=n.op, arg=arg, shape=lead + tuple(n.shape), src=src)


class Fingerprints:
    """Fixed field, inputs and target outputs for one (reduced target, signature, dims)."""

    def __init__(
        self, target: KernelGraph, dc: DimClasses, sig: Signature, dims: Dims, seed: int
    ) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(8):
            self.fld = Field.draw(rng)
            self.inputs = [self.fld.random(n.shape, rng) for n in target.inputs]
            try:
                self.outputs = run_field(target, self.inputs, self.fld)
                break
            except (ZeroDenominator, BadPrime):
                continue
        else:
            raise RuntimeError("could not draw a field in which the target evaluates")
        self.target, self.dc, self.sig, self.dims = target, dc, sig, dims
        self.grid = tuple(dims.grid) + (1,) * (3 - len(dims.grid))
        self.blocks = list(product(*(range(g) for g in self.grid)))
        self.out_tiles = [self._output_tiles(j) for j in range(len(target.outputs))]

    def _print(self, v: FieldArray) -> Print:
        return Print(v, self.fld.p, self.fld.q)

    # ---- sources -----------------------------------------------------------------------------
    def tile(self, node: Node, feed: int, sig: Signature) -> Print:
        src = self.target.inputs[feed_input(feed)]
        im = input_map(self.dc, sig, feed)
        looped = im.fmap is not None
        steps = self.dims.loop if looped else 1
        ps, qs = [], []
        full = self.inputs[feed_input(feed)]
        for idx in self.blocks:
            bounds = chunk_bounds(src.shape, im, self.grid, idx)
            for s in range(steps):
                sl = step_index(bounds, im.fmap, self.dims.loop, s)
                ps.append(full.p[sl])
                qs.append(full.q[sl])
        shape = (len(self.blocks), steps) + node.shape
        return self._print(FieldArray(np.stack(ps).reshape(shape), np.stack(qs).reshape(shape)))

    def _output_tiles(self, j: int) -> Print | None:
        """Target output j cut into this grid's blocks by the signature's omap (None when the
        signature cannot lay blocks out along that output, e.g. a split signature)."""
        if self.sig.partial() is not None:
            return None
        out = self.outputs[j]
        node = self.target.outputs[j]
        omap = save_omap(self.dc, self.sig, j)
        tile = list(node.shape)
        for g, d in zip(self.grid, omap):
            if d is not None:
                if tile[d] % g:
                    return None
                tile[d] //= g
        ps, qs = [], []
        for idx in self.blocks:
            sl = [slice(None)] * len(tile)
            for g, d in enumerate(omap):
                if d is not None:
                    sl[d] = slice(idx[g] * tile[d], (idx[g] + 1) * tile[d])
            ps.append(out.p[tuple(sl)])
            qs.append(out.q[tuple(sl)] if out.q_known() else None)
        shape = (len(self.blocks), 1) + tuple(tile)
        q = np.stack(qs).reshape(shape) if out.q_known() else None
        return self._print(FieldArray(np.stack(ps).reshape(shape), q))

    # ---- ops ---------------------------------------------------------------------------------
    def op(self, node: Node, srcs: Sequence[Print]) -> Print | None:
        """The fingerprint of `node` from its sources' (None: a zero denominator, or a value over
        MAX_PRINT_ELEMENTS)."""
        A = self.fld
        vals = [s.value for s in srcs]
        if node.op in _BROADCASTING:  # numpy aligns trailing dims: pad tiles to the result's rank
            rank = len(node.shape)
            vals = [
                v
                if v.ndim - LEAD >= rank
                else A.reshape(v, v.shape[:LEAD] + (1,) * (rank - v.ndim + LEAD) + v.shape[LEAD:])
                for v in vals
            ]
        try:
            if node.op is Op.CONST:
                # as the verifier reads it (fieldrun): a constant within fp16 rounding of
                # 1/sqrt(2) is that constant, or a GELU's scale never meets the target's
                c = A.const(canonical_const(const_value(node)))
                return self._print(A.reshape(c, (1, 1)))
            if node.op is Op.ACC_SUM:
                v = A.reduce_sum(vals[0], 1)
            elif node.op in (Op.ACC_EXP_SUM, Op.ACC_EXP_WSUM):
                # semantics' accumulator terms act on the trailing (tile) dims; sum the steps
                v = A.reduce_sum(ACC_TERMS[node.op](A, *vals), 1)
            else:
                lead = tuple(max(v.shape[i] for v in vals) for i in range(LEAD)) if vals else (1, 1)
                if math.prod(lead) * math.prod(node.shape) > MAX_PRINT_ELEMENTS:
                    return None
                v = SEMANTICS[node.op](A, _lead_node(node, lead, vals), *vals)
            return self._print(v.force())
        except ZeroDenominator:
            return None

    def combine(self, p: Print) -> Print | None:
        """Sum a post-loop value over the partial grid dim: blocks that differ only there."""
        ax = next(i for i, a in enumerate(self.sig.grid) if a.partial)
        v = p.value
        shape = tuple(self.grid) + v.shape[1:]
        A = self.fld
        summed = A.reduce_sum(A.reshape(v, shape), ax)
        keep = tuple(1 if i == ax else g for i, g in enumerate(self.grid))
        n = keep[0] * keep[1] * keep[2]
        return self._print(A.reshape(summed, (n,) + v.shape[1:]).force())

    def spatial_blocks(self) -> list[tuple[int, int, int]]:
        ax = next((i for i, a in enumerate(self.sig.grid) if a.partial), None)
        return [b for b in self.blocks if ax is None or b[ax] == 0]

    def matches(self, p: Print, j: int) -> bool:
        want = self.out_tiles[j]
        return want is not None and p.value.shape == want.value.shape and p.value.equal(want.value)

    def combined_output(self, p: Print) -> int | None:
        """Which target output a combined (split-signature) value equals, tile by tile."""
        ax = next(i for i, a in enumerate(self.sig.grid) if a.partial)
        for j, node in enumerate(self.target.outputs):
            out = self.outputs[j]
            omap = save_omap(self.dc, self.sig, j)
            tile = list(p.value.shape[LEAD:])
            if len(tile) != len(node.shape):
                continue
            ps, qs = [], []
            for idx in self.spatial_blocks():
                sl = [slice(None)] * len(tile)
                for g, d in enumerate(omap):
                    if d is not None and g != ax and d >= 0:
                        sl[d] = slice(idx[g] * tile[d], (idx[g] + 1) * tile[d])
                ps.append(out.p[tuple(sl)])
                qs.append(out.q[tuple(sl)] if out.q_known() else None)
            try:
                want_p = np.stack(ps).reshape(p.value.shape)
            except ValueError:
                continue
            if not np.array_equal(want_p, p.value.p):
                continue
            if (
                out.q_known()
                and p.value.q_known()
                and not np.array_equal(np.stack(qs).reshape(p.value.shape), p.value.q)
            ):
                continue
            return j
        return None
