"""Evaluate a μGraph in the finite field: the shared walk with field semantics.

Why a separate backend and not the float interpreter with another dtype: the field needs the
algebraic definitions of semantics.py (sigmoid via exp, rsqrt via an oracle, ...), residue pairs
with a q-residue that may be unknown, and no storage rounding (CAST is the identity).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mlso_cli.ir.graph import BlockGraph, KernelGraph
from mlso_cli.ir.node import Node, const_value
from mlso_cli.verify.field import Field, FieldArray, Leaves
from mlso_cli.verify.semantics import ACC_TERMS, SEMANTICS, canonical_const
from mlso_cli.verify.walk import LiteralBackend, evaluate


class AlgebraBackend(LiteralBackend):
    """Walk backend over any algebra implementing the methods semantics.py uses."""

    def __init__(self, algebra: Any) -> None:
        self.A = algebra

    def input(self, node: Node, value: Any) -> Any:
        if tuple(value.shape) != node.shape:
            raise ValueError(
                f"input #{node.arg}: shape {tuple(value.shape)}, graph expects {node.shape}"
            )
        return value

    def const(self, node: Node) -> Any:
        return self.A.const(canonical_const(const_value(node)))

    def compute(self, node: Node, args: list[Any]) -> Any:
        return SEMANTICS[node.op](self.A, node, *args)

    def store(self, node: Node, value: Any) -> Any:
        return value

    def acc_step(self, node: Node, state: Any, args: list[Any]) -> Any:
        term = ACC_TERMS[node.op](self.A, *args)
        return term if state is None else self.A.add(state, term)

    def acc_final(self, node: Node, state: Any, steps: int) -> Any:
        return state


class _FieldBuffer:
    """A saved kernel output being written block by block: residues, and the leaves of a saved
    max (so a kernel-level max over the blocks' partial maxima hashes the union of their sets)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.p = np.zeros(shape, np.int64)
        self.q: np.ndarray | None = np.zeros(shape, np.int64)
        self.sets = True
        """False once a block saved a value that is not a max: the output keeps no leaves."""
        self.name = ""
        self.lp: np.ndarray | None = None
        self.lq: np.ndarray | None = None

    def put_leaves(self, index: tuple[int | slice, ...], leaves: Leaves | None) -> None:
        if leaves is None or (self.lp is not None and leaves.name != self.name):
            self.sets = False
        if not self.sets:
            self.lp = self.lq = None
            return
        lp, lq = leaves.p, leaves.q
        if self.lp is None:
            self.name = leaves.name
            self.lp = np.zeros(self.p.shape + (lp.shape[-1],), np.int64)
            self.lq = None if lq is None else np.zeros(self.lp.shape, np.int64)
        k = self.lp.shape[-1]
        if lp.shape[-1] < k:  # a short set is padded with a repeat of its last leaf: same set
            lp, lq = _pad(lp, k), None if lq is None else _pad(lq, k)
        elif lp.shape[-1] > k:
            self.lp = _pad(self.lp, lp.shape[-1])
            self.lq = None if self.lq is None else _pad(self.lq, lp.shape[-1])
        self.lp[index] = lp
        if lq is None:
            self.lq = None
        elif self.lq is not None:
            self.lq[index] = lq

    def leaves(self) -> Leaves | None:
        if not self.sets or self.lp is None:
            return None
        return Leaves(self.name, self.lp, self.lq, self.lp.shape[-1])


def _pad(x: np.ndarray, k: int) -> np.ndarray:
    return np.concatenate([x, np.repeat(x[..., -1:], k - x.shape[-1], axis=-1)], axis=-1)


class FieldBackend(AlgebraBackend):
    """Accumulators keep their per-step terms and sum them at the end in one n-ary lazy sum (no
    deep chain of lazy additions, and only the residues something reads are computed).

    Batched (walk.py): the walk runs each block graph over stacked blocks, since every field op
    acts entry by entry along the leading block dims (exp and the oracles included: they are
    functions of one entry's residues, or of one entry's leaves). `batched = False` walks block
    by block, the literal reference the tests compare it with."""

    batched = True

    def __init__(self, algebra: Any, batched: bool = True) -> None:
        super().__init__(algebra)
        self.batched = batched

    def reshape(self, value: FieldArray, shape: tuple[int, ...]) -> FieldArray:
        return self.A.reshape(value, shape)

    def transpose(self, value: FieldArray, perm: tuple[int, ...]) -> FieldArray:
        return self.A.transpose(value, perm)

    def acc_init(self, node: Node) -> list[FieldArray]:
        return []

    def acc_step(self, node: Node, state: list[FieldArray], args: list[Any]) -> list[FieldArray]:
        state.append(ACC_TERMS[node.op](self.A, *args))
        return state

    def acc_final(self, node: Node, state: list[FieldArray], steps: int) -> FieldArray:
        return self.A.add_many(state)

    def buffer(self, bg: BlockGraph, save: Node) -> _FieldBuffer:
        return _FieldBuffer(bg.output_shape(save))

    def put(
        self, buf: _FieldBuffer, index: tuple[int | slice, ...], value: FieldArray, save: Node
    ) -> None:
        buf.p[index] = value.p
        if not value.q_known():
            buf.q = None
        elif buf.q is not None:
            buf.q[index] = value.q
        buf.put_leaves(index, value.leaves)

    def finish(self, buf: _FieldBuffer) -> FieldArray:
        return FieldArray(buf.p, buf.q, leaves=buf.leaves())


def run_field(
    kg: KernelGraph, inputs: Sequence[FieldArray], fld: Field, batched: bool = True
) -> list[FieldArray]:
    """Fingerprint kg on field inputs; raises field.ZeroDenominator / field.BadPrime.

    Residues are computed lazily; the outputs' known residues are computed before returning.
    batched=False walks block graphs block by block (the literal reference; same residues)."""
    return [o.force() for o in evaluate(kg, inputs, FieldBackend(fld, batched))]
