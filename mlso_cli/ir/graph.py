"""Kernel graphs, block graphs and thread graphs: the containers around `Node` DAGs.

- KernelGraph: tensors in device memory; its ops are predefined kernels (compute ops) or
  graph-defined kernels (GRAPH_DEF nodes holding a BlockGraph).
- BlockGraph: a grid of thread blocks and a for-loop. Each input is read through an InputMap
  (which grid dim splits which tensor dim; which tensor dim the loop walks). Each output is
  written by a SAVE node through an OutputMap (which tensor dim each grid dim concatenates
  into, or PARTIAL: a new leading dim of per-block partial results, combined by a later kernel).
- ThreadGraph: an elementwise chain fused in registers, used as a block-op prologue/epilogue.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mlso_cli.ir.node import Node, toposort
from mlso_cli.ir.ops import DType, Op

PARTIAL = -1
"""OutputMap entry: this grid dim indexes a leading dim of partial results."""


@dataclass(frozen=True)
class InputMap:
    imap: tuple[int | None, int | None, int | None]
    """For grid dims x, y, z: the tensor dim that dim splits, or None (replicated)."""
    fmap: int | None = None
    """The tensor dim the for-loop walks, or None (the whole tile every step). It may be a dim
    the grid also splits: the loop then walks the block's chunk of that dim."""

    def replace(self, **changes: Any) -> InputMap:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class OutputMap:
    index: int
    """Which kernel output this saver writes."""
    omap: tuple[int | None, int | None, int | None]
    """For grid dims x, y, z: the output dim the blocks are laid along, PARTIAL, or None (size-1 dim)."""

    def replace(self, **changes: Any) -> OutputMap:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class BlockGraph:
    grid: tuple[int, int, int]
    loop: int
    inputs: tuple[InputMap, ...]
    outputs: tuple[Node, ...]
    """SAVE nodes, one per kernel output, ordered by OutputMap.index."""

    def replace(self, **changes: Any) -> BlockGraph:
        return dataclasses.replace(self, **changes)

    def nodes(self) -> list[Node]:
        return toposort(self.outputs)

    def output_shape(self, save: Node) -> tuple[int, ...]:
        """Full tensor shape written by a SAVE node: tile shape times the grid, plus partial dims."""
        om: OutputMap = save.arg
        shape = list(save.shape)
        partial = []
        for g, d in zip(self.grid, om.omap):
            if d is None:
                continue
            if d == PARTIAL:
                partial.append(g)
            else:
                shape[d] *= g
        return tuple(partial) + tuple(shape)

    def output_dtype(self, save: Node) -> DType:
        return save.dtype

    def block_count(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


@dataclass(frozen=True)
class ThreadGraph:
    """An elementwise expression over THREAD_IN placeholders, evaluated per element in registers."""

    body: Node

    def replace(self, **changes: Any) -> ThreadGraph:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class KernelGraph:
    inputs: tuple[Node, ...]
    """INPUT nodes, arg = position."""
    outputs: tuple[Node, ...]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    def replace(self, **changes: Any) -> KernelGraph:
        return dataclasses.replace(self, **changes)

    def nodes(self) -> list[Node]:
        return toposort(list(self.inputs) + list(self.outputs))

    def kernels(self) -> list[Node]:
        """Nodes that launch work: every op except inputs, constants, projections and views."""
        from mlso_cli.ir.ops import VIEW

        return [
            n
            for n in self.nodes()
            if n.op not in (Op.INPUT, Op.CONST, Op.PROJ) and n.op not in VIEW
        ]
