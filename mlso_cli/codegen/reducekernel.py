"""A kernel-level reduction: `plan_reduce` decides, `print_reduce` prints.

REDUCE_SUM / MEAN / MAX over one axis (keepdims), and the stabilisers' masked row max. What is
decided before printing (a frozen ReduceKernelPlan): the team (a thread or a warp per output),
grid and threads, and the form the fold takes, from the scale the input is kept relative to
(`FORMS`). The scale the result is stored with is decided here too, and the lowering records it
in the output's storage before the kernel is printed; a split-KV combine's fp32 buffer of
combined maxima is allocated here. `print_reduce` prints a plan from a KernelSite, never seeing
the Lowering.

Scaled inputs: a sum along an axis the scale does not vary over keeps the scale; a sum over
split-KV partials (the scale varies along the axis) is the combine: M* = max of the partial
maxima, result = sum(stored * exp(M_i - M*)) kept relative to M* (written beside it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from mlso_cli.codegen import synthetic
from mlso_cli.codegen.cfmt import (
    CTYPE,
    Code,
    Coords,
    Names,
    bcast,
    c_float,
    canon,
    decompose,
    mentions,
    offset,
)
from mlso_cli.codegen.program import Buffer, Kernel
from mlso_cli.codegen.scale import BufferScale, Scale, Storage, Val, structural
from mlso_cli.codegen.site import KernelSite
from mlso_cli.codegen.synthetic import RowMax
from mlso_cli.codegen.teams import LOOP_VAR, Pass, choose_mode, emit_passes
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import DType, Op

if TYPE_CHECKING:
    from mlso_cli.codegen.emitter import Emitter
    from mlso_cli.codegen.lower import Lowering

REDUCE_THREADS = 256
GRID_CAP = 1 << 20
FORMS = ("masked_max", "scaled", "combine", "exact")
"""How the fold reads its input: a row max skipping zero-weight (masked) entries; the input's
stored numbers, the result keeping its scale (or none); the split-KV combine (partials relative
to maxima that vary along the axis); the exact values (a max over scaled numbers, a sum of
squares of them)."""


@dataclass(frozen=True)
class Combine:
    """The split-KV combine's maxima: M* over the partial dims, where the result keeps it."""

    probe: Scale
    node: Node
    """The combined maxima (synthetic.combined)."""
    coords: Coords
    store: Storage | None
    """fp32 scratch of the combined maxima when the result stays relative to them, else None
    (the result is unscaled before it is stored)."""


@dataclass(frozen=True)
class ReduceKernelPlan:
    root: Node
    axis: int
    length: int
    count: int
    op: str
    """"max" or "sum" (a mean divides the sum)."""
    mode: str
    """teams.choose_mode: "thread" or "warp" per output."""
    threads: int
    grid: int
    form: str
    """One of FORMS."""
    tokens: Coords
    inner: Coords
    """The input's coordinates, the axis walked by teams.LOOP_VAR."""
    probe: Scale | None
    """The scale the input is kept relative to, at `inner`."""
    out_scale: BufferScale | None
    """The scale the result is stored with (fp32 scratch only), or None: exact values."""
    combine: Combine | None


def plan_reduce(lw: Lowering, root: Node) -> ReduceKernelPlan:
    """The decisions of root's reduction kernel, from the lowering's storage at its turn
    (allocates the combine's maxima buffer where the result keeps that scale)."""
    out = lw.storage[root]
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
    out_scale: BufferScale | None = None
    combine: Combine | None = None
    if weighted:
        form = "masked_max"
    elif keeps_scale(probe, op):
        form = "scaled"
        if probe is not None and _scratch32(out):
            out_scale = structural(probe, tokens)
    elif op == "sum" and probe.degree == 1:
        form = "combine"
        dims = tuple(j for j, c in enumerate(probe.mcoords) if mentions(c, LOOP_VAR))
        node = synthetic.combined(probe.key, dims)
        coords = canon(
            node.shape, tuple("0" if j in dims else c for j, c in enumerate(probe.mcoords))
        )
        bs = structural(Scale(node, 1, coords), tokens)
        store = None
        if out.buffer.kind == "scratch" and bs is not None:
            store = lw.scratch_storage(node)
            out_scale = bs
        combine = Combine(probe, node, coords, store)
    else:
        form = "exact"
    unit = 1 if mode == "thread" else 32
    grid = min(-(-(count * unit) // nt), GRID_CAP)
    return ReduceKernelPlan(
        root, axis, length, count, op, mode, nt, grid, form, tokens, inner_t, probe, out_scale,
        combine,
    )  # fmt: skip


def _scratch32(st: Storage) -> bool:
    return isinstance(st.buffer, Buffer) and st.buffer.kind == "scratch" and st.dtype is DType.F32


Folded = tuple[list[Pass], Scale | None]
"""The fold's passes and the scale its result is relative to (None: exact)."""


def keeps_scale(probe: Scale | None, op: str) -> bool:
    """Whether a fold of values kept relative to `probe` ("sum" or "max") folds their stored
    numbers and keeps that scale (the "scaled" form): unscaled values, or a scale that does not
    vary along the axis, for a sum or a max of positively scaled values."""
    if probe is None:
        return True
    varying = any(mentions(c, LOOP_VAR) for c in probe.mcoords)
    return not varying and (op == "sum" or probe.degree > 0)


def masked_max(em: Emitter, root: Node, inner: Coords) -> str:
    """What a stabiliser's weighted row max folds at `inner`: its input, or -inf where the
    weight (the second source) is zero."""
    x, w_node = root.src[0], root.src[1]
    s = em.plain(x, inner)
    w = em.plain(w_node, bcast(w_node.shape, inner))
    return f"({w} != 0.0f ? {s} : mlso::neg_inf())"


def _fold_masked_max(plan: ReduceKernelPlan, site: KernelSite, names: Names) -> Folded:
    """A row max skipping the positions whose weight (the second source) is zero."""
    em = site.emitter(site.uses, names)
    expr = masked_max(em, plan.root, plan.inner)
    return [Pass("acc", "max", em.lines, expr)], None


def _fold_scaled(plan: ReduceKernelPlan, site: KernelSite, names: Names) -> Folded:
    """The input's stored numbers; the result keeps their scale."""
    em = site.emitter(site.uses, names)
    v = em.value(plan.root.src[0], plan.inner)
    assert v.scale == plan.probe, (v.scale, plan.probe)
    return [Pass("acc", plan.op, em.lines, v.code)], v.scale


def _fold_combine(plan: ReduceKernelPlan, site: KernelSite, names: Names) -> Folded:
    """The split-KV combine: M* = max of the partial maxima, then the partials rescaled to it."""
    em1 = site.emitter(site.uses, names)
    m1 = em1.mvalue(plan.combine.probe)
    em2 = site.emitter(site.uses, names)
    v = em2.value(plan.root.src[0], plan.inner)
    m2 = em2.mvalue(v.scale)
    return [
        Pass("mg", "max", em1.lines, m1),
        Pass("acc", "sum", em2.lines, f"{v.code} * mlso::partial_weight({m2}, mg)"),
    ], None


def _fold_exact(plan: ReduceKernelPlan, site: KernelSite, names: Names) -> Folded:
    """The exact values."""
    em = site.emitter(site.uses, names)
    return [Pass("acc", plan.op, em.lines, em.plain(plan.root.src[0], plan.inner))], None


FOLDS: Mapping[str, Callable[[ReduceKernelPlan, KernelSite, Names], Folded]] = MappingProxyType(
    {
        "masked_max": _fold_masked_max,
        "scaled": _fold_scaled,
        "combine": _fold_combine,
        "exact": _fold_exact,
    }
)
"""Form (FORMS, decided by plan_reduce) -> how the fold is printed."""
assert tuple(FOLDS) == FORMS


def print_reduce(plan: ReduceKernelPlan, site: KernelSite, what: str) -> Kernel:
    root, names, uses = plan.root, Names(), site.uses
    out = site.storage[root]
    uses.write(out.buffer)
    length, nt = plan.length, plan.threads
    passes, result_scale = FOLDS[plan.form](plan, site, names)

    result = f"acc / {c_float(length)}" if root.op is Op.REDUCE_MEAN else "acc"
    fin = site.emitter(uses, names)
    tail: list[str] = []
    if plan.combine is not None:
        mg = plan.combine.store
        if mg is not None:
            uses.write(mg.buffer)
            stored = result
            tail.append(f"{mg.ptr}[{offset(plan.combine.coords, mg.strides)}] = mg;")
        else:
            stored = fin.var(f"mlso::unscale({result}, mg)")
    elif plan.out_scale is not None:
        stored = result  # stored relative to its scale (out_scale, recorded in its storage)
    else:
        stored = fin.materialise(Val(result, result_scale))
    store = [*fin.lines, f"{out.ptr}[o] = mlso::from_f32<{CTYPE[out.dtype]}>({stored});", *tail]

    code = Code()
    count = plan.count
    with code.block(uses.signature(site.name, nt)):
        if plan.mode == "thread":
            with code.block(
                f"for (int o = blockIdx.x * {nt} + threadIdx.x; o < {count}; o += gridDim.x * {nt})"
            ):
                emit_passes(code, passes, length, plan.mode, nt)
                code.extend(store)
        else:
            code("const int lane = threadIdx.x & 31;")
            with code.block(
                f"for (int o = (blockIdx.x * {nt} + threadIdx.x) >> 5; o < {count}; "
                f"o += (gridDim.x * {nt}) >> 5)"
            ):
                emit_passes(code, passes, length, plan.mode, nt)
                with code.block("if (lane == 0)"):
                    code.extend(store)
    what += " (split-KV combine)" if plan.combine else ""
    return Kernel(site.name, code.text(), (plan.grid, 1, 1), (nt, 1, 1), 0, uses.params(), what)
