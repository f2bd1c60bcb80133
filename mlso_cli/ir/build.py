"""Constructors that compute shape, dtype and phase, so hand-built graphs are right by default.

Kernel-level nodes keep their storage dtype. Block-level nodes (any node with a phase) compute in
fp32, except ITER tiles (the input's dtype) and SAVE (the output's dtype).
"""

from __future__ import annotations

from fractions import Fraction

from mlso_cli.ir.graph import BlockGraph, InputMap, KernelGraph, OutputMap, ThreadGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import ACCUMULATORS, BINARY, REDUCE, UNARY, DType, Op, Phase
from mlso_cli.ir.shapes import ShapeError, infer

_ORDER = {Phase.PRE: 0, Phase.LOOP: 1, Phase.POST: 2}


def _phase_of(srcs: tuple[Node, ...]) -> Phase | None:
    phases = [s.phase for s in srcs if s.phase is not None]
    if not phases:
        return None
    if Phase.LOOP in phases and Phase.POST in phases:
        raise ShapeError("an op cannot mix loop-phase and post-loop values")
    return max(phases, key=_ORDER.__getitem__)


def _result_dtype(srcs: tuple[Node, ...], phase: Phase | None) -> DType:
    if phase is not None:
        return DType.F32
    real = [s.dtype for s in srcs if s.op is not Op.CONST]
    if not real:
        return srcs[0].dtype if srcs else DType.F32
    return real[0] if all(d == real[0] for d in real) else DType.F32


def _make(op: Op, srcs: tuple[Node, ...], arg=None, dtype: DType | None = None) -> Node:
    block_consts = tuple(
        _as_block_const(s) if s.op is Op.CONST and any(x.phase for x in srcs) else s for s in srcs
    )
    phase = _phase_of(block_consts)
    shape = infer(op, [s.shape for s in block_consts], arg)
    return Node(op, block_consts, arg, shape, dtype or _result_dtype(block_consts, phase), phase)


def _as_block_const(c: Node) -> Node:
    return c if c.phase is not None else c.replace(phase=Phase.PRE, dtype=DType.F32)


# ---- sources ------------------------------------------------------------------------------


def input_(index: int, shape: tuple[int, ...], dtype: DType) -> Node:
    return Node(Op.INPUT, (), index, tuple(shape), dtype)


def const(value: float | int | Fraction, dtype: DType = DType.F32) -> Node:
    v = value if isinstance(value, Fraction) else Fraction(value)
    return Node(Op.CONST, (), v, (), dtype)


def iter_(index: int, tile: tuple[int, ...], dtype: DType, looped: bool) -> Node:
    return Node(Op.ITER, (), index, tuple(tile), dtype, Phase.LOOP if looped else Phase.PRE)


# ---- compute --------------------------------------------------------------------------------


def unary(op: Op, x: Node) -> Node:
    assert op in UNARY and op is not Op.CAST
    return _make(op, (x,))


def cast(x: Node, dtype: DType) -> Node:
    return _make(Op.CAST, (x,), dtype, dtype if x.phase is None else DType.F32)


def binary(op: Op, a: Node, b: Node) -> Node:
    assert op in BINARY
    return _make(op, (a, b))


def add(a: Node, b: Node) -> Node:
    return binary(Op.ADD, a, b)


def sub(a: Node, b: Node) -> Node:
    return binary(Op.SUB, a, b)


def mul(a: Node, b: Node) -> Node:
    return binary(Op.MUL, a, b)


def div(a: Node, b: Node) -> Node:
    return binary(Op.DIV, a, b)


def matmul(a: Node, b: Node) -> Node:
    return _make(Op.MATMUL, (a, b))


def reduce(op: Op, x: Node, axis: int) -> Node:
    assert op in REDUCE
    return _make(op, (x,), axis % len(x.shape))


def reshape(x: Node, shape: tuple[int, ...]) -> Node:
    return _make(Op.RESHAPE, (x,), tuple(shape), x.dtype if x.phase is None else None)


def transpose(x: Node, perm: tuple[int, ...]) -> Node:
    return _make(Op.TRANSPOSE, (x,), tuple(perm), x.dtype if x.phase is None else None)


def broadcast_to(x: Node, shape: tuple[int, ...]) -> Node:
    return _make(Op.BROADCAST, (x,), tuple(shape), x.dtype if x.phase is None else None)


# ---- block level ----------------------------------------------------------------------------


def accumulate(op: Op, *srcs: Node) -> Node:
    """A for-loop accumulator: sources are loop-phase values, the result is post-loop."""
    assert op in ACCUMULATORS
    shape = infer(op, [s.shape for s in srcs], None)
    return Node(op, tuple(srcs), None, shape, DType.F32, Phase.POST)


def save(
    x: Node, index: int, omap: tuple[int | None, int | None, int | None], dtype: DType
) -> Node:
    return Node(Op.SAVE, (x,), OutputMap(index, tuple(omap)), x.shape, dtype, x.phase)


def block_graph(
    grid: tuple[int, ...],
    loop: int,
    inputs: list[InputMap] | tuple[InputMap, ...],
    saves: list[Node] | tuple[Node, ...],
) -> BlockGraph:
    g = tuple(grid) + (1,) * (3 - len(grid))
    return BlockGraph(g, loop, tuple(inputs), tuple(sorted(saves, key=lambda s: s.arg.index)))


def graph_def(srcs: list[Node] | tuple[Node, ...], bg: BlockGraph) -> list[Node]:
    """A graph-defined kernel over kernel tensors; returns one PROJ node per output."""
    gd = Node(Op.GRAPH_DEF, tuple(srcs), bg, (), DType.F32)
    return [Node(Op.PROJ, (gd,), i, bg.output_shape(s), s.dtype) for i, s in enumerate(bg.outputs)]


def thread(body: Node, srcs: list[Node] | tuple[Node, ...]) -> Node:
    phase = _phase_of(tuple(srcs))
    return Node(
        Op.THREAD,
        tuple(srcs),
        ThreadGraph(body),
        broadcast_all([s.shape for s in srcs]),
        DType.F32 if phase else srcs[0].dtype,
        phase,
    )


def thread_in(index: int, shape: tuple[int, ...] = ()) -> Node:
    return Node(Op.THREAD_IN, (), index, tuple(shape), DType.F32)


def broadcast_all(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    from mlso_cli.ir.shapes import broadcast

    out: tuple[int, ...] = ()
    for s in shapes:
        out = broadcast(out, s)
    return out


def kernel_graph(
    inputs: list[Node],
    outputs: list[Node],
    input_names: list[str] | None = None,
    output_names: list[str] | None = None,
) -> KernelGraph:
    return KernelGraph(
        tuple(inputs),
        tuple(outputs),
        tuple(input_names or [f"in{i}" for i in range(len(inputs))]),
        tuple(output_names or [f"out{i}" for i in range(len(outputs))]),
    )
