"""The immutable μGraph node: one dataclass for every level, with structural equality.

A graph is the DAG reachable from its outputs, so op order is not part of a graph at all: two
graphs that differ only in the order of independent ops are the same value. Hashes are computed
once per node (a DAG with shared subterms would otherwise hash exponentially often).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from mlso_cli.ir.ops import DType, Op, Phase


@dataclass(frozen=True, eq=False)
class Node:
    op: Op
    src: tuple[Node, ...]
    arg: Any
    shape: tuple[int, ...]
    dtype: DType
    phase: Phase | None = None
    """Loop phase of a block op; None for kernel- and thread-level ops."""
    _hash: int = field(default=0, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "_hash", hash((self.op, self.src, self.arg, self.shape, self.dtype, self.phase))
        )

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Node) or self._hash != other._hash:
            return False
        return (self.op, self.arg, self.shape, self.dtype, self.phase) == (
            other.op,
            other.arg,
            other.shape,
            other.dtype,
            other.phase,
        ) and self.src == other.src

    def replace(self, **changes: Any) -> Node:
        return dataclasses.replace(self, **changes)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def __repr__(self) -> str:
        return f"Node({self.op.value}, {self.shape}, {self.dtype.value}{', ' + self.phase.value if self.phase else ''})"


def toposort(roots: tuple[Node, ...] | list[Node]) -> list[Node]:
    """Every node reachable from roots, sources before users, deterministic order."""
    seen: set[int] = set()
    order: list[Node] = []
    stack: list[tuple[Node, bool]] = [(r, False) for r in reversed(list(roots))]
    ids: dict[int, Node] = {}
    while stack:
        n, done = stack.pop()
        if done:
            if id(n) not in seen:
                seen.add(id(n))
                order.append(n)
            continue
        if id(n) in seen:
            continue
        # dedupe structurally equal nodes too: keep the first object seen
        ids.setdefault(id(n), n)
        stack.append((n, True))
        for s in reversed(n.src):
            if id(s) not in seen:
                stack.append((s, False))
    unique: dict[Node, Node] = {}
    out = []
    for n in order:
        if n not in unique:
            unique[n] = n
            out.append(n)
    return out


def walk(roots: tuple[Node, ...] | list[Node]) -> Iterator[Node]:
    yield from toposort(roots)


def const_value(node: Node) -> Fraction:
    """The exact rational value of a CONST node (floats are dyadic rationals, so this is exact)."""
    v = node.arg
    return v if isinstance(v, Fraction) else Fraction(float(v))
