"""The one spec checker for μGraphs. Every test runs it on every graph it builds.

It re-derives what the builders compute (shapes, dtypes, phases) and checks what they cannot:
imap/fmap/omap consistency, divisibility of split dims, accumulator placement, output coverage,
partial outputs in fp32.

What is not here: whether code generation can lay a block graph out, and whether its shared
memory fits an arch's budget. Those figures are code generation's (blocklayout.smem_layout), so
that check is mlso_cli.codegen.budget, which runs this one and adds its own problems to each
block graph through the `extra` hook below; ir/ imports nothing from codegen
(tests/test_layering.py).
"""

from __future__ import annotations

from collections.abc import Callable

from mlso_cli.ir.graph import PARTIAL, BlockGraph, InputMap, KernelGraph, OutputMap, ThreadGraph
from mlso_cli.ir.node import Node, toposort
from mlso_cli.ir.ops import (
    ACCUMULATORS,
    ARITY,
    BLOCK_OPS,
    ELEMENTWISE,
    KERNEL_OPS,
    REDUCE,
    THREAD_OPS,
    VIEW,
    DType,
    Op,
    Phase,
)
from mlso_cli.ir.shapes import ShapeError, infer

_ORDER = {Phase.PRE: 0, Phase.LOOP: 1, Phase.POST: 2}


class SpecError(ValueError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("μGraph spec violated:\n  " + "\n  ".join(problems))
        self.problems = problems


BlockExtra = Callable[[BlockGraph, tuple[Node, ...]], list[str]]
"""More problems of a block graph that holds every IR rule (code generation's layout and budget,
mlso_cli.codegen.budget); called once per such block graph, after its IR checks."""


def check(kg: KernelGraph) -> KernelGraph:
    """Raise SpecError listing every IR problem; return the graph unchanged when it is valid.
    (The arch's shared-memory budget is mlso_cli.codegen.budget.check.)"""
    probs = problems(kg)
    if probs:
        raise SpecError(probs)
    return kg


def problems(kg: KernelGraph, *, extra: BlockExtra | None = None) -> list[str]:
    """Every way `kg` breaks the IR's rules; `extra` adds problems to each block graph that
    holds them (see BlockExtra)."""
    out: list[str] = []
    if len(kg.input_names) != len(kg.inputs) or len(kg.output_names) != len(kg.outputs):
        out.append("input/output names do not match the inputs/outputs")
    for i, n in enumerate(kg.inputs):
        if n.op is not Op.INPUT or n.arg != i:
            out.append(f"kernel input {i} is not INPUT #{i}")
    inputs = set(kg.inputs)
    for n in kg.nodes():
        where = f"{n.op.value}{n.shape}"
        if n.op not in KERNEL_OPS:
            out.append(f"{where}: op not allowed at kernel level")
            continue
        if n.phase is not None:
            out.append(f"{where}: kernel-level op has a loop phase")
        if n.op in ARITY and len(n.src) != ARITY[n.op]:
            out.append(f"{where}: takes {ARITY[n.op]} sources, got {len(n.src)}")
            continue
        if n.op is Op.INPUT:
            if n not in inputs:
                out.append(f"{where}: INPUT #{n.arg} is not a graph input")
        elif n.op is Op.CONST:
            out.extend(_check_const(n))
        elif n.op is Op.GRAPH_DEF:
            if not isinstance(n.arg, BlockGraph):
                out.append(f"{where}: GRAPH_DEF arg is not a BlockGraph")
            else:
                out.extend(block_problems(n.arg, n.src, extra=extra))
        elif n.op is Op.PROJ:
            gd = n.src[0]
            if gd.op is not Op.GRAPH_DEF or not isinstance(gd.arg, BlockGraph):
                out.append(f"{where}: PROJ of a non-GRAPH_DEF node")
            elif not 0 <= n.arg < len(gd.arg.outputs):
                out.append(f"{where}: PROJ index {n.arg} out of range")
            else:
                s = gd.arg.outputs[n.arg]
                if n.shape != gd.arg.output_shape(s) or n.dtype != s.dtype:
                    out.append(
                        f"{where}: PROJ shape/dtype differs from its saver ({gd.arg.output_shape(s)}, {s.dtype.value})"
                    )
        else:
            out.extend(_check_compute(n, block=False))
    for o in kg.outputs:
        if o.op is Op.CONST:
            out.append("a kernel graph output is a constant")
    return out


def _check_const(n: Node) -> list[str]:
    if n.shape != () or n.src:
        return [f"const: must be a scalar with no sources, got shape {n.shape}"]
    return []


def _check_compute(n: Node, block: bool) -> list[str]:
    where = f"{n.op.value}{n.shape}"
    try:
        shape = infer(n.op, [s.shape for s in n.src], n.arg)
    except ShapeError as exc:
        return [f"{where}: {exc}"]
    if shape != n.shape:
        return [f"{where}: shape should be {shape}"]
    if n.op in REDUCE and n.src[0].shape[n.arg] == 1:
        pass  # a reduction over a size-1 dim is legal (identity); the search may avoid it
    if n.op is Op.CAST and not isinstance(n.arg, DType):
        return [f"{where}: CAST arg must be a DType"]
    if not block and n.op in ELEMENTWISE | {Op.MATMUL} and n.op is not Op.CAST:
        real = {s.dtype for s in n.src if s.op is not Op.CONST}
        if len(real) > 1:
            return [f"{where}: operands have different dtypes {sorted(d.value for d in real)}"]
    if not block and n.op in VIEW and n.dtype != n.src[0].dtype:
        return [f"{where}: a view must keep its source's dtype"]
    return []


def _split(grid: tuple[int, int, int], im: InputMap, dim: int) -> int:
    """How many ways the grid splits tensor dim `dim` (1 when no grid dim maps to it)."""
    return next((g for g, d in zip(grid, im.imap) if d == dim), 1)


def tile_shape(
    shape: tuple[int, ...], im: InputMap, grid: tuple[int, int, int], loop: int
) -> tuple[int, ...]:
    t = list(shape)
    for g, d in zip(grid, im.imap):
        if d is not None:
            t[d] //= g
    if im.fmap is not None:
        t[im.fmap] //= loop
    return tuple(t)


def input_tiles(
    grid: tuple[int, int, int],
    loop: int,
    inputs: tuple[InputMap, ...] | list[InputMap],
    srcs: tuple[Node, ...] | list[Node],
) -> tuple[list[str], list[tuple[int, ...]]]:
    """Problems of the input maps against their kernel sources, and each input's tile shape
    (the source's whole shape where its map is unusable). The block builder checks its inputs
    with this when it is constructed; `block_problems` when it checks a finished graph."""
    out: list[str] = []
    tiles: list[tuple[int, ...]] = []
    for i, (im, src) in enumerate(zip(inputs, srcs)):
        rank = len(src.shape)
        mapped = [d for d in im.imap if d is not None]
        if len(im.imap) != 3:
            out.append(f"input {i}: imap must have 3 entries")
        if any(not 0 <= d < rank for d in mapped) or len(set(mapped)) != len(mapped):
            out.append(f"input {i}: imap {im.imap} invalid for rank {rank}")
            tiles.append(src.shape)
            continue
        if im.fmap is not None and not 0 <= im.fmap < rank:
            out.append(f"input {i}: fmap {im.fmap} invalid (rank {rank}, imap {im.imap})")
            tiles.append(src.shape)
            continue
        for g, d in zip(grid, im.imap):
            if d is not None and src.shape[d] % g:
                out.append(f"input {i}: dim {d} ({src.shape[d]}) is not divisible by grid {g}")
        if im.fmap is not None:
            chunk = src.shape[im.fmap] // _split(grid, im, im.fmap)
            if chunk % loop:
                out.append(
                    f"input {i}: dim {im.fmap} (per block {chunk}) is not divisible by loop {loop}"
                )
        tiles.append(tile_shape(src.shape, im, grid, loop))
    return out, tiles


def block_problems(
    bg: BlockGraph,
    srcs: tuple[Node, ...],
    checked: frozenset[Node] | set[Node] = frozenset(),
    *,
    extra: BlockExtra | None = None,
) -> list[str]:
    """Every problem of a block graph over its kernel sources. `checked` holds nodes whose own
    rules (block_node_problems, against these same maps) are already known to hold: the block
    builder checks each op as it adds it and need not pay for it twice. `extra` runs only when
    the IR's rules hold (see BlockExtra)."""
    out: list[str] = []
    if len(bg.grid) != 3 or any((not isinstance(g, int)) or g < 1 for g in bg.grid):
        return [f"grid {bg.grid} must be three positive ints"]
    if bg.loop < 1:
        out.append(f"loop range {bg.loop} must be >= 1")
    if len(bg.inputs) != len(srcs):
        return out + [f"block graph has {len(bg.inputs)} input maps for {len(srcs)} sources"]
    probs, tiles = input_tiles(bg.grid, bg.loop, bg.inputs, srcs)
    out.extend(probs)

    saves = list(bg.outputs)
    if [s.arg.index if isinstance(s.arg, OutputMap) else None for s in saves] != list(
        range(len(saves))
    ):
        out.append("block outputs must be SAVE nodes with indices 0..n-1 in order")
    if not saves:
        out.append("block graph has no outputs")
    for n in toposort(saves):
        if n not in checked:
            out.extend(block_node_problems(n, bg.grid, bg.inputs, tiles, srcs))
    if out or extra is None:
        return out
    return extra(bg, tuple(srcs))


def block_node_problems(
    n: Node,
    grid: tuple[int, int, int],
    inputs: tuple[InputMap, ...] | list[InputMap],
    tiles: list[tuple[int, ...]],
    srcs: tuple[Node, ...] | list[Node],
) -> list[str]:
    """The rules one block node must satisfy on its own (given its sources): the same rules
    whether the spec checks a finished graph or the block builder checks an op as it is added."""
    out: list[str] = []
    where = f"block {n.op.value}{n.shape}"
    if n.op not in BLOCK_OPS:
        return [f"{where}: op not allowed in a block graph"]
    if n.phase is None:
        return [f"{where}: block op without a loop phase"]
    if n.op in ARITY and len(n.src) != ARITY[n.op]:
        return [f"{where}: takes {ARITY[n.op]} sources, got {len(n.src)}"]
    if n.op is Op.ITER:
        if not isinstance(n.arg, int) or not 0 <= n.arg < len(tiles):
            return [f"{where}: ITER of unknown input {n.arg}"]
        im = inputs[n.arg]
        want_phase = Phase.LOOP if im.fmap is not None else Phase.PRE
        if n.shape != tiles[n.arg]:
            out.append(f"{where}: tile of input {n.arg} should be {tiles[n.arg]}")
        if n.dtype != srcs[n.arg].dtype:
            out.append(
                f"{where}: ITER dtype {n.dtype.value} differs from input {srcs[n.arg].dtype.value}"
            )
        if n.phase is not want_phase:
            out.append(f"{where}: ITER phase should be {want_phase.value}")
        return out
    if n.op is Op.CONST:
        out.extend(_check_const(n))
        if n.phase is not Phase.PRE:
            out.append(f"{where}: constants are pre-loop values")
        return out
    if n.op in ACCUMULATORS:
        if any(s.phase is not Phase.LOOP for s in n.src if s.op is not Op.CONST):
            out.append(f"{where}: accumulator sources must be loop-phase values")
        if n.phase is not Phase.POST:
            out.append(f"{where}: accumulators produce post-loop values")
        try:
            if infer(n.op, [s.shape for s in n.src], None) != n.shape:
                out.append(f"{where}: wrong accumulator shape")
        except ShapeError as exc:
            out.append(f"{where}: {exc}")
        return out
    if n.op is Op.SAVE:
        return save_problems(grid, n)
    if n.op is Op.THREAD:
        out.extend(_check_thread(n))
    else:
        out.extend(_check_compute(n, block=True))
        if n.dtype is not DType.F32:
            out.append(f"{where}: block compute is fp32, got {n.dtype.value}")
    phases = [s.phase for s in n.src if s.phase is not None]
    if Phase.LOOP in phases and Phase.POST in phases:
        out.append(f"{where}: mixes loop-phase and post-loop values")
    elif phases and n.phase is not max(phases, key=_ORDER.__getitem__):
        out.append(f"{where}: phase should be {max(phases, key=_ORDER.__getitem__).value}")
    return out


def save_problems(grid: tuple[int, int, int], n: Node) -> list[str]:
    """A SAVE node against the grid: its omap, its source's phase, partial outputs in fp32."""
    where = f"block save{n.shape}"
    out = []
    om = n.arg
    if not isinstance(om, OutputMap) or len(om.omap) != 3:
        return [f"{where}: arg must be an OutputMap with 3 entries"]
    src = n.src[0]
    if src.phase is Phase.LOOP:
        out.append(f"{where}: saves a loop-phase value; accumulate it first")
    if n.shape != src.shape:
        out.append(f"{where}: shape differs from its source {src.shape}")
    dims = [d for d in om.omap if d is not None and d != PARTIAL]
    if len(set(dims)) != len(dims) or any(not 0 <= d < len(n.shape) for d in dims):
        out.append(f"{where}: omap {om.omap} invalid for rank {len(n.shape)}")
    for g, d in zip(grid, om.omap):
        if g > 1 and d is None:
            out.append(f"{where}: grid dim of size {g} is not mapped (use a tensor dim or PARTIAL)")
    if PARTIAL in om.omap and n.dtype is not DType.F32:
        out.append(f"{where}: partial outputs must be fp32")
    return out


def _check_thread(n: Node) -> list[str]:
    tg = n.arg
    if not isinstance(tg, ThreadGraph):
        return ["thread: arg must be a ThreadGraph"]
    out = []
    for t in toposort([tg.body]):
        if t.op not in THREAD_OPS:
            out.append(f"thread graph: {t.op.value} is not elementwise")
        if t.op is Op.THREAD_IN and not 0 <= t.arg < len(n.src):
            out.append(f"thread graph: input {t.arg} out of range")
    return out
