"""Abstract-expression pruning for the enumerator: search/expr.py bound to one signature.

Why a binding: a block value's abstract expression depends on its graph-defined kernel's
symbolic block (which grid dim and loop step split which index), so the enumerator gets one
`BoundPruner` per signature, built from the provisional block graph's maps. A candidate op
survives iff its expression is a subexpression of some target tensor (`Target.admits`); an op
the algebra cannot express (ExprError: indices that do not nest) is pruned too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlso_cli.ir import build as b
from mlso_cli.ir.graph import BlockGraph, InputMap, KernelGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import DType
from mlso_cli.search.abstract import ALGEBRA, BlockContext, Expr, abstract, input_expr, saved_output
from mlso_cli.search.dims import DimClasses
from mlso_cli.search.target import Target
from mlso_cli.search.terms import ExprError


class ExprPruner:
    """The target normalised once per search (per process)."""

    def __init__(self, target: KernelGraph, dc: DimClasses) -> None:
        self.target = Target.from_graph(target)
        self.inputs = [input_expr(i, n.shape) for i, n in enumerate(target.inputs)]
        self.checks = 0

    def bind(
        self,
        grid: tuple[int, int, int],
        loop: int,
        maps: Sequence[InputMap],
        feeds: Sequence[int] | None = None,
    ) -> BoundPruner:
        """The pruner of one signature's block: `maps[i]` tiles kernel input `feeds[i]` (the
        same input may be fed twice, sliced and whole: search/space.py WHOLE)."""
        from mlso_cli.search.space import feed_input

        feeds = range(len(self.inputs)) if feeds is None else feeds
        srcs = [self.inputs[feed_input(f)] for f in feeds]
        return BoundPruner(self, BlockContext.of(BlockGraph(grid, loop, tuple(maps), ()), srcs))


class BoundPruner:
    """The pruner of one signature's symbolic block."""

    def __init__(self, parent: ExprPruner, ctx: BlockContext) -> None:
        self.parent, self.ctx = parent, ctx

    def tile(self, node: Node, feed: int, sig: Any) -> Expr | None:
        try:
            return abstract(node, {}, self.ctx)
        except ExprError:
            return None

    def op(self, node: Node, srcs: Sequence[Expr | None]) -> Expr | None:
        if any(s is None for s in srcs):
            return None
        try:
            e = abstract(node, dict(zip(node.src, srcs)), self.ctx)
        except ExprError:
            return None
        self.parent.checks += 1
        return e if self.parent.target.admits(e) else None

    def combined(self, node: Node, e: Expr | None, omap: tuple[int | None, ...]) -> Expr | None:
        """A block value saved with a PARTIAL omap and summed over the partial dim by the
        kernel-level combine: its expression if admitted, else None (a product of partials)."""
        if e is None:
            return None
        try:
            full = saved_output(self.ctx, b.save(node, 0, omap, DType.F32), e)
            out = ALGEBRA.reduce_sum(full, 0)
        except (ExprError, ValueError):
            return None
        self.parent.checks += 1
        return out if self.parent.target.admits(out) else None

    def kernel_op(self, node: Node, srcs: Sequence[Expr | None]) -> Expr | None:
        """A kernel-level elementwise op over combined values (no block context)."""
        if any(s is None for s in srcs):
            return None
        try:
            e = abstract(node, dict(zip(node.src, srcs)))
        except ExprError:
            return None
        self.parent.checks += 1
        return e if self.parent.target.admits(e) else None


def make_pruner(target: KernelGraph, dc: DimClasses) -> ExprPruner:
    return ExprPruner(target, dc)
