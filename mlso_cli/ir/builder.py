"""`BlockBuilder`: grows the block graph of one graph-defined kernel an op at a time, each op
checked when it is added.

Why: the search replays recipes op by op and the test generators grow random graphs the same
way; both want to hear at once which op is wrong and why (a shape, dtype or phase rule, or a
shared-memory budget it would break), not that a whole candidate failed the spec checker later.
Each op is made by ir.build (which computes shape, dtype and phase with ir.shapes' rules); the
rules ir.build does not enforce (accumulator sources, output maps, partial dtypes) are checked
with the spec checker's own per-node rules (spec.block_node_problems; SPEC_RULES says which), so
the builder accepts the ops the spec accepts in a finished graph and refuses the others; `finish`
runs the spec's block checks on the whole graph.

Shared memory is not checked here: its figure is code generation's, and ir/ imports nothing
from codegen. mlso_cli.codegen.blockbuilder.BlockBuilder is this builder with the arch's budget
(`smem()`, the refusal of an op over budget, and the layout checks in `finish`), through the two
hooks `_admit` and `_block_extra`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from mlso_cli.ir import build as b
from mlso_cli.ir import spec
from mlso_cli.ir.graph import BlockGraph, InputMap
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import (
    ACCUMULATORS,
    ARITY,
    BINARY,
    REDUCE,
    UNARY,
    DType,
    Op,
    Phase,
)
from mlso_cli.ir.shapes import ShapeError

SPEC_RULES = ACCUMULATORS | {Op.SAVE}
"""Ops whose spec rules ir.build does not enforce (accumulator source phases, omaps, partial
dtypes); the builder runs spec.block_node_problems on these. Every other op it makes holds the
spec's node rules by construction: ir.build derives its shape with ir.shapes (as the checker
does), a block op is fp32 and takes the latest phase of its sources (refusing to mix loop and
post-loop values), ITER tiles come from spec.input_tiles, and op kinds and args are checked
here before ir.build is called. `finish` therefore need not check those nodes again."""


class BuildError(ValueError):
    """An op the block builder refuses; the message names the op and the reason."""


def pad3(t: Sequence[Any], fill: Any) -> tuple[Any, Any, Any]:
    return tuple(t) + (fill,) * (3 - len(t))  # type: ignore[return-value]


class BlockBuilder:
    """One block graph under construction over kernel tensors `srcs` read through `inputs`,
    held to the IR's rules (no shared-memory budget: codegen.blockbuilder adds it)."""

    def __init__(
        self,
        grid: Sequence[int],
        loop: int,
        inputs: Sequence[InputMap],
        srcs: Sequence[Node],
    ) -> None:
        if len(grid) > 3 or any(not isinstance(g, int) or g < 1 for g in grid):
            raise BuildError(f"block graph: grid {tuple(grid)} must be up to three positive ints")
        if not isinstance(loop, int) or loop < 1:
            raise BuildError(f"block graph: loop range {loop} must be a positive int")
        if len(inputs) != len(srcs):
            raise BuildError(f"block graph: {len(inputs)} input maps for {len(srcs)} sources")
        if any(s.phase is not None for s in srcs):
            raise BuildError("block graph: sources must be kernel-level tensors")
        self.grid: tuple[int, int, int] = pad3(grid, 1)
        self.loop = loop
        self.inputs = tuple(inputs)
        self.srcs = tuple(srcs)
        probs, self.tiles = spec.input_tiles(self.grid, loop, self.inputs, self.srcs)
        if probs:
            raise BuildError("block graph inputs: " + "; ".join(probs))
        self._nodes: dict[Node, None] = {}  # every value built, in order (an ordered set)
        self._used: set[Node] = set()  # values some built op reads
        self._saves: list[Node] = []
        self._checked: set[Node] = set()  # every node accepted, SAVEs included
        self._done: BlockGraph | None = None

    # ---- sources --------------------------------------------------------------------------

    def iter(self, index: int) -> Node:
        """This block's tile of input `index` (loop-phase when its map walks a dim)."""
        if not isinstance(index, int) or not 0 <= index < len(self.srcs):
            raise BuildError(f"iter: no input {index} (the block has {len(self.srcs)})")
        looped = self.inputs[index].fmap is not None
        return self._add(
            "iter", lambda: b.iter_(index, self.tiles[index], self.srcs[index].dtype, looped), ()
        )

    def const(self, value: float | int | Fraction) -> Node:
        """A scalar constant (pre-loop, fp32); floats are kept as their exact rational value."""
        if isinstance(value, bool) or not isinstance(value, (int, float, Fraction)):
            raise BuildError(f"const: {value!r} is not a number")
        if isinstance(value, float) and not math.isfinite(value):
            raise BuildError(f"const: {value!r} is not finite")
        v = value if isinstance(value, Fraction) else Fraction(value)
        return self._add("const", lambda: Node(Op.CONST, (), v, (), DType.F32, Phase.PRE), ())

    # ---- compute --------------------------------------------------------------------------

    def unary(self, op: Op, x: Node) -> Node:
        if op not in UNARY or op is Op.CAST:
            raise BuildError(
                f"unary: {getattr(op, 'value', op)} is not a unary op (CAST has cast())"
            )
        return self._add(op.value, lambda: b.unary(op, x), (x,))

    def cast(self, x: Node, dtype: DType) -> Node:
        """Round x to `dtype` (the value stays fp32 in the block; float code may hold it in dtype)."""
        if not isinstance(dtype, DType):
            raise BuildError(f"cast: target {dtype!r} is not a DType")
        return self._add("cast", lambda: b.cast(x, dtype), (x,))

    def binary(self, op: Op, x: Node, y: Node) -> Node:
        if op not in BINARY:
            raise BuildError(f"binary: {getattr(op, 'value', op)} is not a binary op")
        return self._add(op.value, lambda: b.binary(op, x, y), (x, y))

    def matmul(self, x: Node, y: Node) -> Node:
        return self._add("matmul", lambda: b.matmul(x, y), (x, y))

    def reduce(self, op: Op, x: Node, axis: int) -> Node:
        """Reduce over one axis, keepdims; a negative axis counts from the end."""
        if op not in REDUCE:
            raise BuildError(f"reduce: {getattr(op, 'value', op)} is not a reduction")
        rank = len(x.shape) if isinstance(x, Node) else 0
        if isinstance(axis, bool) or not isinstance(axis, int) or not -rank <= axis < rank:
            raise BuildError(
                f"{op.value}: axis {axis!r} out of range for shape {getattr(x, 'shape', None)}"
            )
        return self._add(op.value, lambda: b.reduce(op, x, axis), (x,))

    def accumulate(self, op: Op, *xs: Node) -> Node:
        """A for-loop accumulator over loop-phase values; the result is a post-loop value."""
        if op not in ACCUMULATORS:
            raise BuildError(f"accumulate: {getattr(op, 'value', op)} is not an accumulator")
        if len(xs) != ARITY[op]:
            raise BuildError(f"{op.value}: takes {ARITY[op]} sources, got {len(xs)}")
        return self._add(op.value, lambda: b.accumulate(op, *xs), xs)

    def transpose(self, x: Node, perm: Sequence[int]) -> Node:
        return self._add("transpose", lambda: b.transpose(x, tuple(perm)), (x,))

    def reshape(self, x: Node, shape: Sequence[int]) -> Node:
        return self._add("reshape", lambda: b.reshape(x, tuple(shape)), (x,))

    def broadcast(self, x: Node, shape: Sequence[int]) -> Node:
        return self._add("broadcast", lambda: b.broadcast_to(x, tuple(shape)), (x,))

    def apply(self, op: Op, srcs: Sequence[Node], arg: Any = None) -> Node:
        """Any compute or accumulator op by its Op, sources and arg (as a recipe step spells it)."""
        rule = _APPLY.get(op)
        if rule is None:
            raise BuildError(f"{getattr(op, 'value', op)}: not an op a block builder makes")
        want = ARITY.get(op, 0)
        if len(srcs) != want:
            raise BuildError(f"{op.value}: takes {want} sources, got {len(srcs)}")
        return rule(self, op, list(srcs), arg)

    # ---- outputs --------------------------------------------------------------------------

    def save(self, x: Node, omap: Sequence[int | None], dtype: DType) -> Node:
        """Write x into the next output (index = number of saves so far) through `omap`."""
        if not isinstance(dtype, DType):
            raise BuildError(f"save: dtype {dtype!r} is not a DType")
        if len(omap) > 3 or any(
            d is not None and (isinstance(d, bool) or not isinstance(d, int)) for d in omap
        ):
            raise BuildError(
                f"save: omap {tuple(omap)} must be up to three tensor dims, PARTIAL or None"
            )
        index = len(self._saves)
        node = self._add("save", lambda: b.save(x, index, pad3(omap, None), dtype), (x,))
        self._saves.append(node)
        return node

    @property
    def saves(self) -> tuple[Node, ...]:
        return tuple(self._saves)

    def finish(self) -> BlockGraph:
        """The block graph, after the spec checker's block checks (BuildError on a problem).
        Values no SAVE reaches are not part of it. No op may be added afterwards."""
        if self._done is None:
            if not self._saves:
                raise BuildError("finish: the block graph has no SAVE")
            bg = b.block_graph(self.grid, self.loop, self.inputs, self._saves)
            probs = spec.block_problems(bg, self.srcs, self._checked, extra=self._block_extra)
            if probs:
                raise BuildError("finish: " + "; ".join(probs))
            self._done = bg
        return self._done

    def launch(self) -> list[Node]:
        """The finished graph as a GRAPH_DEF over the sources: one PROJ per output, in order."""
        return b.graph_def(self.srcs, self.finish())

    # ---- internals ------------------------------------------------------------------------

    def _add(self, name: str, make: Callable[[], Node], operands: tuple[Node, ...]) -> Node:
        if self._done is not None:
            raise BuildError(f"{name}: the block graph is finished")
        for x in operands:
            if not isinstance(x, Node) or x not in self._nodes:
                raise BuildError(f"{name}: operand {x!r} was not built by this builder")
        try:
            node = make()
        except (ShapeError, TypeError) as exc:
            raise BuildError(f"{name}: {exc}") from exc
        if node.op in SPEC_RULES:
            probs = spec.block_node_problems(node, self.grid, self.inputs, self.tiles, self.srcs)
            if probs:
                raise BuildError(f"{name}: " + "; ".join(probs))
        self._admit(name, node)
        self._checked.add(node)
        if node.op is not Op.SAVE:
            self._nodes[node] = None
        self._used.update(node.src)
        return node

    def _admit(self, name: str, node: Node) -> None:
        """A hook run on each op that holds the IR's rules, before it is accepted: raise
        BuildError to refuse it (the budgeted builder's shared-memory check)."""

    def _block_extra(self, bg: BlockGraph, srcs: tuple[Node, ...]) -> list[str]:
        """A hook adding problems to the finished block graph once the IR's rules hold."""
        return []


_APPLY: dict[Op, Callable[[BlockBuilder, Op, list[Node], Any], Node]] = {
    **{op: (lambda bb, op, s, a: bb.unary(op, s[0])) for op in UNARY if op is not Op.CAST},
    Op.CAST: lambda bb, op, s, a: bb.cast(s[0], a),
    **{op: (lambda bb, op, s, a: bb.binary(op, s[0], s[1])) for op in BINARY},
    Op.MATMUL: lambda bb, op, s, a: bb.matmul(s[0], s[1]),
    **{op: (lambda bb, op, s, a: bb.reduce(op, s[0], a)) for op in REDUCE},
    **{op: (lambda bb, op, s, a: bb.accumulate(op, *s)) for op in ACCUMULATORS},
    Op.TRANSPOSE: lambda bb, op, s, a: bb.transpose(s[0], a),
    Op.RESHAPE: lambda bb, op, s, a: bb.reshape(s[0], a),
    Op.BROADCAST: lambda bb, op, s, a: bb.broadcast(s[0], a),
    Op.CONST: lambda bb, op, s, a: bb.const(a),
}
"""Op -> how `BlockBuilder.apply` makes it from (sources, arg)."""
