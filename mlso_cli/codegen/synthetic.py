"""Nodes that code generation adds to a μGraph, never seen by the spec checker or the search.

They reuse IR ops (REDUCE_MAX for running maxima, RESHAPE for copies, PROJ for side buffers) so
the emitter tables handle them, but carry an arg of their own type, so they can never be equal
to a node of the user's graph, and code that must treat them specially can tell them apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlso_cli.ir.graph import OutputMap
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import DType, Op, Phase


@dataclass(frozen=True)
class RowMax:
    """Stabiliser of an EXP: max of its argument over `axis` (keepdims), skipping positions whose
    weight (src[1], when present) is zero, i.e. masked entries of a masked softmax."""

    axis: int
    weighted: bool


@dataclass(frozen=True)
class RunningMax:
    """Running max of an ACC_EXP_* group over the loop: shape s[:-1] + (1,)."""


@dataclass(frozen=True)
class Combined:
    """Max over the partial dims `dims` of a split-KV max buffer (written by a combine)."""

    dims: tuple[int, ...]


@dataclass(frozen=True)
class PartialMax:
    """Per-block maxima a graph-defined kernel writes beside scaled partial outputs."""

    group: Node
    omap: OutputMap


@dataclass(frozen=True)
class Copy:
    """Identity copy of a tensor into a graph output buffer (an input or repeated output)."""

    slot: int


@dataclass(frozen=True)
class Staged(Copy):
    """A library GEMM's operand materialised into scratch of its own dtype (codegen/libgemm.py);
    slot is a serial number, so two stagings of one tensor stay distinct nodes."""


def row_max(s: Node, axis: int, weight: Node | None) -> Node:
    shape = s.shape[:axis] + (1,) + s.shape[axis + 1 :]
    srcs = (s,) if weight is None else (s, weight)
    return Node(Op.REDUCE_MAX, srcs, RowMax(axis, weight is not None), shape, DType.F32, s.phase)


def running_max(s: Node) -> Node:
    return Node(Op.REDUCE_MAX, (s,), RunningMax(), s.shape[:-1] + (1,), DType.F32, Phase.POST)


def combined(m: Node, dims: tuple[int, ...]) -> Node:
    shape = tuple(1 if i in dims else d for i, d in enumerate(m.shape))
    return Node(Op.REDUCE_MAX, (m,), Combined(dims), shape, DType.F32)


def partial_max(gd: Node, group: Node, omap: OutputMap, shape: tuple[int, ...]) -> Node:
    return Node(Op.PROJ, (gd,), PartialMax(group, omap), shape, DType.F32)


def copy(x: Node, slot: int) -> Node:
    return Node(Op.RESHAPE, (x,), Copy(slot), x.shape, x.dtype)


def stage(x: Node, serial: int) -> Node:
    return Node(Op.RESHAPE, (x,), Staged(serial), x.shape, x.dtype)


def is_synthetic(n: Node) -> bool:
    return isinstance(n.arg, (RowMax, RunningMax, Combined, PartialMax, Copy))


@dataclass(frozen=True)
class Stabilised:
    """An EXP marked as a softmax numerator (stabilise.stabilised): src = (x, *mask factors); its
    value is exp(x - M) relative to M = max of x over `axis`, skipping positions where a factor
    is zero. Only the interpreter's "as codegen computes" graph carries it (ascomputed.as_computed)."""

    axis: int
