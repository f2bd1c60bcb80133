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

Shared memory: `smem()` is the byte count spec.block_smem reports (the one code generation
allocates, blocklayout.smem_layout). A graph being built has open values, which nothing reads
and no SAVE writes yet. Each open pre- or post-loop value gets a temporary fp32 SAVE so that the
layout can be computed; an open loop tile (ITER) is costed through a loop sum of its row sums (a
small accumulator: code generation fuses the row sum into it); any other open loop value is not
costed until an accumulator reads it, because its storage depends on the accumulator (a score
that the online softmax keeps in registers takes no shared memory). Once every value reaches a
SAVE the figure is block_smem of the finished graph, exactly. With `budget=True` an op whose
figure would exceed the arch's budget is refused. A figure before that point can exceed the
finished one (an open value stored for its temporary SAVE that the finished graph fuses), so
the search, whose recipes are judged whole, builds with budget=False: then `finish` leaves the
budget out too (a structure checked at reduced shapes is sized later, and the spec checker holds
each sized instance to the budget). Figures are computed only when asked or checked, cached per set of roots (and
smem_layout caches per block graph).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from mlso_cli.ir import build as b
from mlso_cli.ir import spec
from mlso_cli.ir.graph import PARTIAL, BlockGraph, InputMap, OutputMap
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import (
    ACCUMULATORS,
    ARITY,
    BINARY,
    REDUCE,
    SMEM_BUDGET,
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


def _pad3(t: Sequence[Any], fill: Any) -> tuple[Any, Any, Any]:
    return tuple(t) + (fill,) * (3 - len(t))  # type: ignore[return-value]


class BlockBuilder:
    """One block graph under construction over kernel tensors `srcs` read through `inputs`."""

    def __init__(
        self,
        grid: Sequence[int],
        loop: int,
        inputs: Sequence[InputMap],
        srcs: Sequence[Node],
        arch: str = "sm_90",
        *,
        budget: bool = True,
    ) -> None:
        if arch not in SMEM_BUDGET:
            raise BuildError(f"block graph: unknown arch {arch}; known: {sorted(SMEM_BUDGET)}")
        if len(grid) > 3 or any(not isinstance(g, int) or g < 1 for g in grid):
            raise BuildError(f"block graph: grid {tuple(grid)} must be up to three positive ints")
        if not isinstance(loop, int) or loop < 1:
            raise BuildError(f"block graph: loop range {loop} must be a positive int")
        if len(inputs) != len(srcs):
            raise BuildError(f"block graph: {len(inputs)} input maps for {len(srcs)} sources")
        if any(s.phase is not None for s in srcs):
            raise BuildError("block graph: sources must be kernel-level tensors")
        self.grid: tuple[int, int, int] = _pad3(grid, 1)
        self.loop = loop
        self.inputs = tuple(inputs)
        self.srcs = tuple(srcs)
        self.arch = arch
        self.budget = budget
        probs, self.tiles = spec.input_tiles(self.grid, loop, self.inputs, self.srcs)
        if probs:
            raise BuildError("block graph inputs: " + "; ".join(probs))
        self._nodes: dict[Node, None] = {}  # every value built, in order (an ordered set)
        self._used: set[Node] = set()  # values some built op reads
        self._saves: list[Node] = []
        self._checked: set[Node] = set()  # every node accepted, SAVEs included
        self._smem: dict[tuple[Node, ...], int] = {}
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
        node = self._add("save", lambda: b.save(x, index, _pad3(omap, None), dtype), (x,))
        self._saves.append(node)
        return node

    @property
    def saves(self) -> tuple[Node, ...]:
        return tuple(self._saves)

    def smem(self) -> int:
        """Bytes of shared memory the graph built so far needs (see the module docstring)."""
        if self._done is not None:
            return spec.block_smem(self._done, self.srcs, self.arch)
        return self._figure("smem", self._roots(None))

    def finish(self) -> BlockGraph:
        """The block graph, after the spec checker's block checks (BuildError on a problem).
        Values no SAVE reaches are not part of it. No op may be added afterwards."""
        if self._done is None:
            if not self._saves:
                raise BuildError("finish: the block graph has no SAVE")
            bg = b.block_graph(self.grid, self.loop, self.inputs, self._saves)
            probs = spec.block_problems(bg, self.srcs, self.arch, self._checked, budget=self.budget)
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
        if self.budget and node.op is not Op.CONST and node not in self._nodes:
            need = self._figure(name, self._roots(node))
            if need > SMEM_BUDGET[self.arch]:
                raise BuildError(
                    f"{name}: the block would need {need} bytes of shared memory; "
                    f"{self.arch} has {SMEM_BUDGET[self.arch]}"
                )
        self._checked.add(node)
        if node.op is not Op.SAVE:
            self._nodes[node] = None
        self._used.update(node.src)
        return node

    def _roots(self, extra: Node | None) -> tuple[Node, ...]:
        """The SAVEs so far, then every open value (no op reads it, no SAVE writes it),
        as if `extra` had been added."""
        saves = list(self._saves)
        nodes = list(self._nodes)
        used = self._used
        if extra is not None:
            used = used | set(extra.src)
            if extra.op is Op.SAVE:
                saves.append(extra)
            elif extra not in self._nodes:
                nodes.append(extra)
        return tuple(saves) + tuple(n for n in nodes if n not in used and n.op is not Op.CONST)

    def _figure(self, name: str, roots: tuple[Node, ...]) -> int:
        hit = self._smem.get(roots)
        if hit is not None:
            return hit
        saves = [r for r in roots if r.op is Op.SAVE]
        omap = _pad3([PARTIAL if g > 1 else None for g in self.grid], None)
        for r in roots[len(saves) :]:
            x = r
            if r.phase is Phase.LOOP:
                if r.op is not Op.ITER:
                    continue  # costed once an accumulator reads it: how depends on the accumulator
                x = b.accumulate(Op.ACC_SUM, b.reduce(Op.REDUCE_SUM, r, -1) if r.shape else r)
            saves.append(
                Node(Op.SAVE, (x,), OutputMap(len(saves), omap), x.shape, DType.F32, x.phase)
            )
        bg = b.block_graph(self.grid, self.loop, self.inputs, saves)
        from mlso_cli.codegen.errors import CodegenError  # lazily: codegen imports ir

        try:
            need = spec.block_smem(bg, self.srcs, self.arch)
        except CodegenError as exc:
            raise BuildError(
                f"{name}: code generation cannot lay this block graph out: {exc}"
            ) from exc
        self._smem[roots] = need
        return need


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
