"""The one op walk that every evaluator shares: kernel level, block level, thread level.

Why one walk: the float interpreter, the finite-field fingerprint and the degree analysis must
agree on what a μGraph *means* (which block reads which tile, which step walks which slice, where
a saver writes). Writing that once, literally, and plugging in value semantics as a `Backend`
means a mapping bug cannot hide in one evaluator and not the others.

Block execution is literal: for every block (bx, by, bz) of the grid, the PRE ops run once, the
LOOP ops run once per for-loop step on the tiles that the imap/fmap select for that step, the
accumulators fold every step, the POST ops run on the accumulators, and each SAVE writes the
block's tile through its omap (PARTIAL grid dims become leading dims of the output).

A backend that declares `batched = True` (the field backend) runs the same walk over a stacked
block axis: values carry three leading dims, one per grid dim (size 1 where the value is the
same for every block along that dim, e.g. a tile of an input the grid replicates), each phase runs
once per step for a box of blocks at a time, ops see their axes shifted past the leading dims, and
each block's tile is then saved through the same `save_index`, block by block in grid order. Why:
numpy per block and step costs the full-shape check minutes in interpreter overhead. Its meaning
is the literal walk's, element for element: every op is elementwise along the block dims (the
tests compare the two exactly); a layout the stacked tiles cannot express falls back to the
literal walk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import product
from math import prod
from types import SimpleNamespace
from typing import Any, Protocol, cast

from mlso_cli.ir.graph import PARTIAL, BlockGraph, InputMap, KernelGraph
from mlso_cli.ir.node import Node, toposort
from mlso_cli.ir.ops import ACCUMULATORS, BINARY, REDUCE, Op, Phase

Index = tuple[int, int, int]
Observer = Callable[[Node, Any], None]


class Backend(Protocol):
    """Value semantics for the walk. `V` values are whatever the backend computes with."""

    def input(self, node: Node, value: Any) -> Any: ...
    def const(self, node: Node) -> Any: ...
    def compute(self, node: Node, args: list[Any]) -> Any: ...
    def store(self, node: Node, value: Any) -> Any:
        """A kernel-level tensor is written to device memory in node.dtype (storage rounding)."""

    def tile(self, value: Any, index: tuple[int | slice, ...]) -> Any: ...
    def blocks(self, bg: BlockGraph) -> Iterable[Index]: ...
    def acc_init(self, node: Node) -> Any: ...
    def acc_step(self, node: Node, state: Any, args: list[Any]) -> Any: ...
    def acc_final(self, node: Node, state: Any, steps: int) -> Any: ...
    def buffer(self, bg: BlockGraph, save: Node) -> Any: ...
    def put(self, buf: Any, index: tuple[int | slice, ...], value: Any, save: Node) -> None: ...
    def finish(self, buf: Any) -> Any: ...


class BatchedBackend(Backend, Protocol):
    """A backend that runs the block walk over stacked blocks (`batched = True`): its values
    are arrays with leading block dims, and it reshapes and transposes them as numpy does."""

    batched: bool

    def reshape(self, value: Any, shape: tuple[int, ...]) -> Any: ...
    def transpose(self, value: Any, perm: tuple[int, ...]) -> Any: ...


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

    def tile(self, value: Any, index: tuple[int | slice, ...]) -> Any:
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
    """Execute a graph-defined kernel block by block, step by step; return its output buffers.

    A batched backend runs the same walk over boxes of stacked blocks (`_run_batched`)."""
    plan = _Plan(bg)
    if getattr(be, "batched", False) and observe is None:
        bbe = cast(BatchedBackend, be)
        stacked = _stacked_sources(bg, plan, srcs, bbe)
        if stacked is not None:
            return _run_batched(bg, plan, stacked, bbe)
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


# ---- the batched block walk --------------------------------------------------------------------

LEAD = 3
"""Leading dims of a value in the batched walk: one per grid dim (x, y, z), of size 1 where the
value is the same for every block along that grid dim."""
_ALIGNED = BINARY | {Op.MATMUL, Op.ACC_EXP_WSUM}
"""Ops whose operands numpy aligns by their trailing dims: an operand of lower rank is padded with
size-1 dims after the leading dims, so that its tile dims align as they do in the literal walk."""
BATCH_ENTRIES = 1 << 24
"""Bound on the entries a box of stacked blocks holds at once (estimated: every node's tile, every
loop step's when accumulators keep them): a larger grid is walked in boxes of fewer blocks."""


def stacked_layout(
    shape: tuple[int, ...], im: InputMap, grid: tuple[int, int, int], loop: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """How a kernel tensor becomes every block's and step's tile at once: reshape it to `split`,
    transpose by `perm` and reshape to `stacked` = (Gx, Gy, Gz, L, *tile), where Gg = grid[g] if
    grid dim g splits a dim of it (else 1: replicated) and L = loop if the for-loop walks a dim of
    it (else 1). Entry [x, y, z, s] is the tile `chunk_bounds` and `step_index` select for block
    (x, y, z) at step s (x, y or z 0 along a size-1 dim). None when that layout cannot express the
    literal tiles (a split that does not divide, two grid dims on one dim): walk literally then."""
    mapped = [d for d in im.imap if d is not None]
    if len(set(mapped)) != len(mapped) or any(not 0 <= d < len(shape) for d in mapped):
        return None
    if im.fmap is not None and not 0 <= im.fmap < len(shape):
        return None
    split: list[int] = []
    grid_axis: dict[int, int] = {}
    loop_axis: list[int] = []
    tile_axes: list[int] = []
    tile: list[int] = []
    for d, n in enumerate(shape):
        for g, m in enumerate(im.imap):
            if m == d:
                if n % grid[g]:
                    return None
                grid_axis[g] = len(split)
                split.append(grid[g])
                n //= grid[g]
        if d == im.fmap:
            if n % loop:
                return None
            loop_axis.append(len(split))
            split.append(loop)
            n //= loop
        tile_axes.append(len(split))
        split.append(n)
        tile.append(n)
    perm = [grid_axis[g] for g in sorted(grid_axis)] + loop_axis + tile_axes
    lead = tuple(grid[g] if g in grid_axis else 1 for g in range(LEAD))
    stacked = lead + ((loop,) if loop_axis else (1,)) + tuple(tile)
    return tuple(split), tuple(perm), stacked


def _stacked_sources(
    bg: BlockGraph, plan: _Plan, srcs: list[Any], be: BatchedBackend
) -> list[Any] | None:
    """Every kernel input as stacked tiles (`stacked_layout`), or None: walk literally."""
    if any(s.op is Op.CONST for a in plan.accs for s in a.src):
        return None  # an accumulated constant has no leading dims to sum along: keep it literal
    out = []
    for v, im in zip(srcs, bg.inputs):
        shape = _shape(v)
        layout = stacked_layout(shape, im, bg.grid, bg.loop)
        if layout is None:
            return None
        split, perm, stacked = layout
        if split != shape:
            v = be.reshape(v, split)
        if perm != tuple(range(len(perm))):
            v = be.transpose(v, perm)
        out.append(v if _shape(v) == stacked else be.reshape(v, stacked))
    return out


def _boxes(bg: BlockGraph, plan: _Plan) -> Iterator[tuple[tuple[int, int], ...]]:
    """The grid as boxes of blocks, each at most BATCH_ENTRIES / (entries per block) blocks,
    (lo, hi) per grid dim; boxes and the blocks within them come in row-major grid order."""
    loop = bg.loop if plan.accs else 1
    per_block = sum(prod(n.shape) for n in plan.pre + plan.post + plan.accs)
    per_block += loop * sum(prod(n.shape) for n in plan.loop)
    nb = max(1, BATCH_ENTRIES // max(1, per_block))
    gx, gy, gz = bg.grid
    cz = min(gz, nb)
    cy = min(gy, nb // cz) if cz == gz else 1
    cx = min(gx, nb // (cz * cy)) if cz == gz and cy == gy else 1
    for x in range(0, gx, cx):
        for y in range(0, gy, cy):
            for z in range(0, gz, cz):
                yield (x, min(x + cx, gx)), (y, min(y + cy, gy)), (z, min(z + cz, gz))


def _run_batched(bg: BlockGraph, plan: _Plan, stacked: list[Any], be: BatchedBackend) -> list[Any]:
    """`run_block` over stacked blocks: each phase once per box (and step), then every block's
    tile saved through `save_index`, block by block in grid order as the literal walk does."""
    bufs = [be.buffer(bg, s) for s in plan.saves]
    for box in _boxes(bg, plan):
        sel = tuple(slice(lo, hi) for lo, hi in box)
        env: dict[Node, Any] = {}
        _batched_phase(plan.pre, env, be, stacked, sel, bg, 0)
        states = {a: be.acc_init(a) for a in plan.accs}
        if plan.loop or plan.accs:
            for step in range(bg.loop):
                _batched_phase(plan.loop, env, be, stacked, sel, bg, step)
                for a in plan.accs:
                    args = [env[s] for s in a.src]
                    if a.op in _ALIGNED:
                        args = _pad(be, args, max(len(v.shape) for v in args))
                    states[a] = be.acc_step(a, states[a], args)
        for a in plan.accs:
            env[a] = be.acc_final(a, states[a], bg.loop)
        _batched_phase(plan.post, env, be, stacked, sel, bg, 0)
        for idx in product(*(range(lo, hi) for lo, hi in box)):
            for buf, s in zip(bufs, plan.saves):
                v = env[s.src[0]]
                local = tuple(
                    i - lo if n > 1 else 0 for i, (lo, _), n in zip(idx, box, v.shape[:LEAD])
                )
                be.put(buf, save_index(bg, s, idx), be.tile(v, local), s)
    return [be.finish(b) for b in bufs]


def _batched_phase(
    nodes: list[Node],
    env: dict[Node, Any],
    be: BatchedBackend,
    stacked: list[Any],
    sel: tuple[slice, ...],
    bg: BlockGraph,
    step: int,
) -> None:
    for n in nodes:
        if n.op is Op.ITER:
            w = stacked[n.arg]
            at = step if bg.inputs[n.arg].fmap is not None else 0
            lead = tuple(sl if w.shape[g] > 1 else slice(None) for g, sl in enumerate(sel))
            env[n] = be.tile(w, lead + (at,))
        elif n.op is Op.CONST:
            c = be.const(n)
            env[n] = be.reshape(c, (1,) * LEAD + tuple(c.shape))
        else:
            env[n] = _batched_compute(be, n, [env[s] for s in n.src])


def _batched_compute(be: BatchedBackend, n: Node, args: list[Any]) -> Any:
    """One op on stacked values: operands aligned as in the literal walk, axes past LEAD."""
    if n.op is Op.THREAD:
        env: dict[Node, Any] = {}
        for t in toposort([n.arg.body]):
            if t.op is Op.THREAD_IN:
                env[t] = args[t.arg]
            elif t.op is Op.CONST:
                env[t] = be.const(t)
            else:
                env[t] = _batched_compute(be, t, [env[s] for s in t.src])
        out = env[n.arg.body]
        if len(out.shape) < LEAD:  # a body of constants only: a literal scalar
            out = be.reshape(out, (1,) * LEAD + tuple(out.shape))
        return out
    if n.op in _ALIGNED:
        args = _pad(be, args, max(len(v.shape) for v in args))
    elif n.op is Op.BROADCAST:
        args = _pad(be, args, LEAD + len(n.arg))
    return be.compute(_lead_node(n, args), args)


def _pad(be: BatchedBackend, args: list[Any], rank: int) -> list[Any]:
    """Operands of rank < `rank` with size-1 dims inserted after the leading dims (a 0-d
    constant inside a thread body becomes all size-1 dims)."""
    out = []
    for v in args:
        shape = tuple(v.shape)
        if len(shape) < rank:
            v = be.reshape(v, shape[:LEAD] + (1,) * (rank - len(shape)) + shape[LEAD:])
        out.append(v)
    return out


def _lead_node(n: Node, args: list[Any]) -> Any:
    """`n` as the op sees it on stacked values: axes shifted past LEAD, target shapes prefixed
    with the operand's leading dims, source shapes those of the stacked operands."""
    lead = tuple(args[0].shape[:LEAD]) if args else (1,) * LEAD
    arg = n.arg
    if n.op in REDUCE:
        arg = n.arg + LEAD
    elif n.op is Op.TRANSPOSE:
        arg = tuple(range(LEAD)) + tuple(p + LEAD for p in n.arg)
    elif n.op in (Op.RESHAPE, Op.BROADCAST):
        arg = lead + tuple(n.arg)
    src = tuple(SimpleNamespace(shape=tuple(a.shape)) for a in args)
    return SimpleNamespace(op=n.op, arg=arg, shape=lead + tuple(n.shape), src=src)
