"""Kernel emitters for predefined kernel-level ops: elementwise chains, reductions, matmuls.

Each emitter takes the Lowering and a root node and returns a Kernel whose source computes the
root into its storage. A matmul is decided, then printed from a frozen plan (matmulkernel.py);
elementwise and reduction kernels still decide as they print (their scale choices are made by
the emitter that evaluates their operands). Operands are evaluated by the Emitter, so fused elementwise prologues,
views and scaled (running-max) values work for every kernel kind the same way.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from mlso_cli.codegen import synthetic
from mlso_cli.codegen.blocklayout import SM_COUNT_HINT
from mlso_cli.codegen.cfmt import (
    CTYPE,
    Code,
    Names,
    bcast,
    c_float,
    canon,
    decompose,
    mentions,
    offset,
)
from mlso_cli.codegen.emitter import TEAM_LANE, Flat
from mlso_cli.codegen.matmulkernel import KernelSite, plan_matmul, print_matmul
from mlso_cli.codegen.program import Kernel
from mlso_cli.codegen.scale import Scale, Val, structural
from mlso_cli.codegen.synthetic import Combined, Copy, RowMax, Staged
from mlso_cli.codegen.teams import LOOP_VAR, Pass, choose_mode, emit_passes
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import REDUCE, Op

if TYPE_CHECKING:
    from mlso_cli.codegen.lower import Lowering

ELEMENTWISE_THREADS = 256
REDUCE_THREADS = 256
GRID_CAP = 1 << 20


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _what(n: Node) -> str:
    if isinstance(n.arg, Staged):
        return f"stage a library GEMM operand -> {n.dtype.value}{list(n.shape)}"
    if isinstance(n.arg, Copy):
        return f"copy to output {n.arg.slot} {list(n.shape)}"
    if isinstance(n.arg, RowMax):
        return f"softmax stabiliser: row max over axis {n.arg.axis} -> {list(n.shape)}"
    return f"{n.op.value} -> {n.dtype.value}{list(n.shape)}"


# ---- elementwise ------------------------------------------------------------------------------


def emit_elementwise(lw: Lowering, root: Node) -> Kernel:
    """One thread per element (grid-stride), the fused chain evaluated in registers; a team of
    lanes per element when the chain folds partials in place (`team_size`)."""
    name, names, uses = lw.kernel_name(), Names(), lw.uses()
    out = lw.storage[root]
    uses.write(out.buffer)
    n, nt = root.numel, ELEMENTWISE_THREADS
    team = team_size(n, inplace_reductions(root, lw.storage))
    tokens = decompose("i", root.shape)
    em = lw.emitter(uses, names, Flat(tokens, root.shape, "i"))
    em.team = team
    v = em.compute(root, tokens)
    val = lw.stored_code(em, root, v, tokens)
    store = f"{out.ptr}[i] = mlso::from_f32<{CTYPE[out.dtype]}>({val});"
    code = Code()
    first, stride = f"blockIdx.x * {nt} + threadIdx.x", f"gridDim.x * {nt}"
    if team > 1:
        first, stride = f"({first}) / {team}", f"gridDim.x * {nt // team}"
        store = f"if ({TEAM_LANE} == 0) {store}"
    with code.block(uses.signature(name, nt)):
        if team > 1:
            code(f"const int {TEAM_LANE} = threadIdx.x & {team - 1};")
        with code.block(f"for (int i = {first}; i < {n}; i += {stride})"):
            code.extend(em.lines)
            code(store)
    grid = (min(_ceil(n * team, nt), GRID_CAP), 1, 1)
    what = _what(root) + (f" ({team} lanes per element)" if team > 1 else "")
    return Kernel(name, code.text(), grid, (nt, 1, 1), 0, uses.params(), what)


TEAM_ITEMS = 8
"""Partials each lane of a team folds: the in-place loops are unrolled 8 times, so 8 is one
round of loads in flight per lane."""
TEAM_THREADS = SM_COUNT_HINT * 2048
"""Threads one wave of the H200 holds (2048 per SM): a team is worth its redundant element work only while
the grid is short of a wave."""


def team_size(outputs: int, lengths: list[int]) -> int:
    """Lanes per output element of an elementwise kernel whose chain folds `lengths` values in
    place at its top level: a power of two up to 32, so each lane keeps about TEAM_ITEMS of the
    shortest fold, the grid stays within one wave, and every warp's lanes leave the grid-stride
    loop together (outputs a multiple of the elements a warp holds), as the shuffles need."""
    if not lengths:
        return 1
    fits = [
        t
        for t in (2, 4, 8, 16, 32)
        if t * TEAM_ITEMS <= min(lengths)
        and outputs * t <= TEAM_THREADS
        and outputs % (32 // t) == 0
    ]
    return max(fits, default=1)


def inplace_reductions(root: Node, storage) -> list[int]:
    """Lengths of the reductions `root`'s chain evaluates in place at its top level (not nested
    in another one): what the emitter turns into loops (emitter._reduce and _combined)."""
    lengths: list[int] = []
    seen: set[Node] = set()
    stack = [root]
    while stack:
        n = stack.pop()
        if n in seen or (n in storage and n is not root):
            continue
        seen.add(n)
        if n.op in REDUCE:
            if isinstance(n.arg, Combined):
                lengths.append(n.src[0].shape[n.arg.dims[0]])
            elif isinstance(n.arg, int):
                lengths.append(n.src[0].shape[n.arg])
            continue  # what it folds is evaluated inside its loop (serial per lane)
        stack.extend(n.src)
        if n.op is Op.THREAD:
            stack.append(n.arg.body)
    return lengths


# ---- reductions ---------------------------------------------------------------------------------


def emit_reduce(lw: Lowering, root: Node) -> Kernel:
    """REDUCE_SUM / MEAN / MAX over one axis (keepdims), and the stabilisers' masked row max.

    Scaled inputs: a sum along an axis the scale does not vary over keeps the scale; a sum over
    split-KV partials (the scale varies along the axis) is the combine: M* = max of the partial
    maxima, result = sum(stored * exp(M_i - M*)) kept relative to M* (written beside it)."""
    name, names, uses = lw.kernel_name(), Names(), lw.uses()
    out = lw.storage[root]
    uses.write(out.buffer)
    x = root.src[0]
    weighted = isinstance(root.arg, RowMax) and root.arg.weighted
    axis = root.arg.axis if isinstance(root.arg, RowMax) else root.arg
    length, count = x.shape[axis], root.numel
    op = "max" if root.op is Op.REDUCE_MAX else "sum"
    innermost = all(d == 1 for d in x.shape[axis + 1 :])
    mode = choose_mode(length, count, innermost, None)
    nt = REDUCE_THREADS
    tokens = decompose("o", root.shape)
    inner = list(tokens)
    inner[axis] = LOOP_VAR
    inner_t = canon(x.shape, inner)

    probe = lw.emitter(lw.uses(), Names()).value(x, inner_t).scale
    varying = probe is not None and any(mentions(c, LOOP_VAR) for c in probe.mcoords)
    passes: list[Pass] = []
    result_scale: Scale | None = None
    combine: tuple[Node, tuple[str, ...]] | None = None
    if weighted:
        em = lw.emitter(uses, names)
        s = em.plain(x, inner_t)
        w = em.plain(root.src[1], bcast(root.src[1].shape, inner_t))
        passes.append(Pass("acc", "max", em.lines, f"({w} != 0.0f ? {s} : mlso::neg_inf())"))
    elif probe is None or (not varying and (op == "sum" or probe.degree > 0)):
        em = lw.emitter(uses, names)
        v = em.value(x, inner_t)
        passes.append(Pass("acc", op, em.lines, v.code))
        result_scale = v.scale
    elif op == "sum" and probe.degree == 1:
        em1 = lw.emitter(uses, names)
        m1 = em1.mvalue(probe)
        passes.append(Pass("mg", "max", em1.lines, m1))
        em2 = lw.emitter(uses, names)
        v = em2.value(x, inner_t)
        m2 = em2.mvalue(v.scale)
        passes.append(Pass("acc", "sum", em2.lines, f"{v.code} * mlso::partial_weight({m2}, mg)"))
        dims = tuple(j for j, c in enumerate(probe.mcoords) if mentions(c, LOOP_VAR))
        mg_node = synthetic.combined(probe.key, dims)
        mg_coords = canon(
            mg_node.shape, tuple("0" if j in dims else c for j, c in enumerate(probe.mcoords))
        )
        combine = (mg_node, mg_coords)
    else:
        em = lw.emitter(uses, names)
        passes.append(Pass("acc", op, em.lines, em.plain(x, inner_t)))

    result = f"acc / {c_float(length)}" if root.op is Op.REDUCE_MEAN else "acc"
    fin = lw.emitter(uses, names)
    tail: list[str] = []
    if combine is not None:
        mg_node, mg_coords = combine
        bs = structural(Scale(mg_node, 1, mg_coords), tokens)
        if out.buffer.kind == "scratch" and bs is not None:
            mg_store = lw.scratch_storage(mg_node)
            uses.write(mg_store.buffer)
            out.scale = bs
            stored = result
            tail.append(f"{mg_store.ptr}[{offset(mg_coords, mg_store.strides)}] = mg;")
        else:
            stored = fin.var(f"mlso::unscale({result}, mg)")
    else:
        stored = lw.stored_code(fin, root, Val(result, result_scale), tokens)
    store = [*fin.lines, f"{out.ptr}[o] = mlso::from_f32<{CTYPE[out.dtype]}>({stored});", *tail]

    code = Code()
    with code.block(uses.signature(name, nt)):
        if mode == "thread":
            with code.block(
                f"for (int o = blockIdx.x * {nt} + threadIdx.x; o < {count}; o += gridDim.x * {nt})"
            ):
                emit_passes(code, passes, length, mode, nt)
                code.extend(store)
            grid = min(_ceil(count, nt), GRID_CAP)
        else:
            code("const int lane = threadIdx.x & 31;")
            with code.block(
                f"for (int o = (blockIdx.x * {nt} + threadIdx.x) >> 5; o < {count}; "
                f"o += (gridDim.x * {nt}) >> 5)"
            ):
                emit_passes(code, passes, length, mode, nt)
                with code.block("if (lane == 0)"):
                    code.extend(store)
            grid = min(_ceil(count * 32, nt), GRID_CAP)
    what = _what(root) + (" (split-KV combine)" if combine else "")
    return Kernel(name, code.text(), (grid, 1, 1), (nt, 1, 1), 0, uses.params(), what)


# ---- matmul -----------------------------------------------------------------------------------


def emit_matmul(lw: Lowering, root: Node) -> Kernel:
    """A generated matmul kernel: decided (matmulkernel.plan_matmul), then printed from the plan
    (matmulkernel.print_matmul); the scale the plan leaves C with is recorded in its storage."""
    plan = plan_matmul(lw, root)
    if plan.c_scale is not None:
        lw.storage[root].scale = plan.c_scale
    site = KernelSite(lw.kernel_name(), lw.uses(), MappingProxyType(lw.storage), lw.emitter)
    return print_matmul(plan, site)
