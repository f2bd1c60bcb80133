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
from mlso_cli.verify.field import Field, FieldArray
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
    def __init__(self, shape: tuple[int, ...]) -> None:
        self.p = np.zeros(shape, np.int64)
        self.q: np.ndarray | None = np.zeros(shape, np.int64)


class FieldBackend(AlgebraBackend):
    """Accumulators keep their per-step terms and sum them at the end in one n-ary lazy sum (no
    deep chain of lazy additions, and only the residues something reads are computed)."""

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

    def finish(self, buf: _FieldBuffer) -> FieldArray:
        return FieldArray(buf.p, buf.q)


def run_field(kg: KernelGraph, inputs: Sequence[FieldArray], fld: Field) -> list[FieldArray]:
    """Fingerprint kg on field inputs; raises field.ZeroDenominator / field.BadPrime.

    Residues are computed lazily; the outputs' known residues are computed before returning."""
    return [o.force() for o in evaluate(kg, inputs, FieldBackend(fld))]
