"""The one op walk that every evaluator shares: kernel level, block level, thread level.

Why one walk: the float interpreter, the finite-field fingerprint and the degree analysis must
agree on what a μGraph *means* (which block reads which tile, which step walks which slice, where
a saver writes). Writing that once, literally, and plugging in value semantics as a `Backend`
means a mapping bug cannot hide in one evaluator and not the others.

Block execution is literal: for every block (bx, by, bz) of the grid, the PRE ops run once, the
LOOP ops run once per for-loop step on the tiles that the imap/fmap select for that step, the
accumulators fold every step, the POST ops run on the accumulators, and each SAVE writes the
block's tile through its omap (PARTIAL grid dims become leading dims of the output).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from mlso_cli.ir.graph import PARTIAL, BlockGraph, InputMap, KernelGraph
from mlso_cli.ir.node import Node, toposort
from mlso_cli.ir.ops import ACCUMULATORS, Op, Phase

Index = tuple[int, int, int]
Observer = Callable[[Node, Any], None]


class Backend(Protocol):
    """Value semantics for the walk. `V` values are whatever the backend computes with."""

    def input(self, node: Node, value: Any) -> Any: ...
    def const(self, node: Node) -> Any: ...
    def compute(self, node: Node, args: list[Any]) -> Any: ...
    def store(self, node: Node, value: Any) -> Any:
        """A kernel-level tensor is written to device memory in node.dtype (storage rounding)."""

    def tile(self, value: Any, index: tuple[slice, ...]) -> Any: ...
    def blocks(self, bg: BlockGraph) -> Iterable[Index]: ...
    def acc_init(self, node: Node) -> Any: ...
    def acc_step(self, node: Node, state: Any, args: list[Any]) -> Any: ...
    def acc_final(self, node: Node, state: Any, steps: int) -> Any: ...
    def buffer(self, bg: BlockGraph, save: Node) -> Any: ...
    def put(self, buf: Any, index: tuple[int | slice, ...], value: Any, save: Node) -> None: ...
    def finish(self, buf: Any) -> Any: ...


def evaluate(
    kg: KernelGraph, inputs: Sequence[Any], be: Backend, observe: Observer | None = None
) -> list[Any]:
    """Evaluate every kernel-level node in topological order; return the graph's outputs."""
    if len(inputs) != len(kg.inputs):
        raise ValueError(f"graph takes {len(kg.inputs)} inputs, got {len(inputs)}")
    env: dict[Node, Any] = {}
    for n in kg.nodes():
        if n.op is Op.INPUT:
            env[n] = be.input(n, inputs[n.arg])
        elif n.op is Op.CONST:
            env[n] = be.const(n)
        elif n.op is Op.GRAPH_DEF:
            env[n] = run_block(n.arg, [env[s] for s in n.src], be, observe)
        elif n.op is Op.PROJ:
            env[n] = be.store(n, env[n.src[0]][n.arg])
        else:
            env[n] = be.store(n, compute(be, n, [env[s] for s in n.src]))
            if observe is not None:
                observe(n, env[n])
    return [env[o] for o in kg.outputs]


def compute(be: Backend, n: Node, args: list[Any]) -> Any:
    """One compute op; a THREAD op evaluates its elementwise body with THREAD_IN(i) = args[i]."""
    if n.op is not Op.THREAD:
        return be.compute(n, args)
    env: dict[Node, Any] = {}
    for t in toposort([n.arg.body]):
        if t.op is Op.THREAD_IN:
            env[t] = args[t.arg]
        elif t.op is Op.CONST:
            env[t] = be.const(t)
        else:
            env[t] = be.compute(t, [env[s] for s in t.src])
    return env[n.arg.body]


# ---- block level ------------------------------------------------------------------------------


def chunk_bounds(
    shape: tuple[int, ...], im: InputMap, grid: tuple[int, int, int], idx: Index
) -> list[tuple[int, int]]:
    """(start, length) per tensor dim of this block's chunk: grid dim g with imap[g] = d takes
    chunk idx[g] of grid[g] equal chunks of dim d; unmapped dims are whole (replicated)."""
    bounds = [(0, s) for s in shape]
    for g, d in enumerate(im.imap):
        if d is not None:
            size = shape[d] // grid[g]
            bounds[d] = (idx[g] * size, size)
    return bounds


def step_index(
    bounds: list[tuple[int, int]], fmap: int | None, loop: int, step: int
) -> tuple[slice, ...]:
    """The tile read at for-loop `step`: dim fmap walks the block's chunk in `loop` equal steps."""
    sl = [slice(s, s + n) for s, n in bounds]
    if fmap is not None:
        start, n = bounds[fmap]
        width = n // loop
        sl[fmap] = slice(start + step * width, start + (step + 1) * width)
    return tuple(sl)


def save_index(bg: BlockGraph, save: Node, idx: Index) -> tuple[int | slice, ...]:
    """Where a block's saved tile lands: PARTIAL grid dims pick a leading partial index; a grid
    dim with omap[g] = d places the tile at offset idx[g] * tile[d] along output dim d."""
    omap = save.arg.omap
    partial: list[int] = []
    sl = [slice(None)] * len(save.shape)
    for g, d in enumerate(omap):
        if d is None:
            continue
        if d == PARTIAL:
            partial.append(idx[g])
        else:
            t = save.shape[d]
            sl[d] = slice(idx[g] * t, (idx[g] + 1) * t)
    return tuple(partial) + tuple(sl)


class LiteralBackend:
    """What every literal backend shares: numpy slicing for tiles, every block of the grid in
    row-major order, and accumulators that start empty (the first step's term becomes the state)."""

    def tile(self, value: Any, index: tuple[slice, ...]) -> Any:
        return value[index]

    def blocks(self, bg: BlockGraph) -> Iterable[Index]:
        gx, gy, gz = bg.grid
        return ((x, y, z) for x in range(gx) for y in range(gy) for z in range(gz))

    def acc_init(self, node: Node) -> Any:
        return None


class _Plan:
    """A block graph's nodes split by phase, computed once per GRAPH_DEF execution."""

    def __init__(self, bg: BlockGraph) -> None:
        nodes = bg.nodes()
        self.saves = list(bg.outputs)
        body = [n for n in nodes if n.op is not Op.SAVE]
        self.pre = [n for n in body if n.phase is Phase.PRE]
        self.loop = [n for n in body if n.phase is Phase.LOOP]
        self.accs = [n for n in body if n.op in ACCUMULATORS]
        self.post = [n for n in body if n.phase is Phase.POST and n.op not in ACCUMULATORS]


def run_block(
    bg: BlockGraph, srcs: list[Any], be: Backend, observe: Observer | None = None
) -> list[Any]:
    """Execute a graph-defined kernel block by block, step by step; return its output buffers."""
    plan = _Plan(bg)
    shapes = [_shape(s) for s in srcs]
    bufs = [be.buffer(bg, s) for s in plan.saves]
    for idx in be.blocks(bg):
        bounds = [chunk_bounds(shapes[i], im, bg.grid, idx) for i, im in enumerate(bg.inputs)]
        env: dict[Node, Any] = {}
        _phase(plan.pre, env, be, srcs, bounds, bg, 0, observe)
        states = {a: be.acc_init(a) for a in plan.accs}
        if plan.loop or plan.accs:
            for step in range(bg.loop):
                _phase(plan.loop, env, be, srcs, bounds, bg, step, observe)
                for a in plan.accs:
                    states[a] = be.acc_step(a, states[a], [env[s] for s in a.src])
        for a in plan.accs:
            env[a] = be.acc_final(a, states[a], bg.loop)
        _phase(plan.post, env, be, srcs, bounds, bg, 0, observe)
        for buf, s in zip(bufs, plan.saves):
            be.put(buf, save_index(bg, s, idx), env[s.src[0]], s)
    return [be.finish(b) for b in bufs]


def _phase(
    nodes: list[Node],
    env: dict[Node, Any],
    be: Backend,
    srcs: list[Any],
    bounds: list[list[tuple[int, int]]],
    bg: BlockGraph,
    step: int,
    observe: Observer | None,
) -> None:
    for n in nodes:
        if n.op is Op.ITER:
            im = bg.inputs[n.arg]
            env[n] = be.tile(srcs[n.arg], step_index(bounds[n.arg], im.fmap, bg.loop, step))
        elif n.op is Op.CONST:
            env[n] = be.const(n)
        else:
            env[n] = compute(be, n, [env[s] for s in n.src])
            if observe is not None:
                observe(n, env[n])


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(v.shape)
