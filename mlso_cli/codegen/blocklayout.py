"""The shared-memory layout of a graph-defined kernel: `plan_layout` decides it, `smem_layout`
is its byte count.

Why: the spec checker (a graph is valid for an arch iff its layout fits the arch's budget), the
block builder (which grows graphs within that budget) and code generation must agree on the byte
count to the byte. They all read `plan_layout`, which runs the same planning code generation
runs (analysis, staging copies, padding against bank conflicts, the cp.async pipeline depth, the
register path's aliasing) and returns its result as a frozen value; no code is printed.

An option (padding, pipeline depth, threads) is laid out by `_attempt` on a fresh
blockstorage.Draft; `plan_layout` tries them in order of preference and freezes the first that
fits into a `LayoutPlan`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from mlso_cli.codegen.arch import SMEM_BUDGET
from mlso_cli.codegen.blockanalysis import (
    BLOCK_THREADS,
    Analysis,
    Group,
    RegisterCandidate,
    analyse,
)
from mlso_cli.codegen.blockmatmul import MatmulPlan, Operand, group_p, plan_matmul
from mlso_cli.codegen.blockregister import RegisterPath, register_path, scaled_v
from mlso_cli.codegen.blockstorage import (
    Draft,
    SmemStorage,
    _ceil_to,
    acc_scale,
    alloc,
    fp32,
    reduce_scale,
    set_scale,
    tile_strides,
    unbacked,
)
from mlso_cli.codegen.cfmt import CTYPE, Names, contiguous, numel
from mlso_cli.codegen.frozen import FrozenMap
from mlso_cli.codegen.mmawork import strip_width
from mlso_cli.ir.graph import BlockGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import REDUCE, DType, Op, Phase

PIPELINE_STAGES = 2
"""cp.async pipeline depth of the loop tiles. Why two, always: every searched program was
compiled and timed at 2 to 5 stages on the H200 (benchmarks/RESULTS.md, twelfth session), and two
were fastest or within noise everywhere; the four programs an earlier rule gave three stages
(a deeper pipeline wherever it still fit an sm_80 block) ran 0.4-3% faster at two. The
memory a third stage took is better left to larger tiles or a second resident block."""
SM_COUNT_HINT = 132
"""SMs of the target GPU (H100/H200), for choices that depend on blocks per SM."""
CODEGEN_ARCH = "sm_90"
"""The arch whose budget code generation lays kernels out for (the spec checker's default)."""


@dataclass(frozen=True)
class SmemLayout:
    """The shared-memory plan of one graph-defined kernel."""

    smem: int
    """Exact bytes of dynamic shared memory the kernel is launched with."""
    fits: bool
    """Whether some option fits the arch's budget (else `smem` is the smallest option tried)."""
    pad: bool
    """16-bit tile rows padded by 16 bytes against ldmatrix bank conflicts."""
    stages: int
    """cp.async pipeline depth of the loop tiles."""
    threads: int
    register_path: bool
    """The online softmax runs in registers (mlso::FlashRows)."""
    buffers: tuple[tuple[str, str, int], ...]
    """(C type, name, byte offset) of every pointer into shared memory, in allocation order."""


@dataclass(frozen=True)
class LayoutPlan:
    """Everything the layout decided for one block graph: where each value lives, each matmul's
    plan, the groups' buffers, the register path (if it holds) and the figure."""

    analysis: Analysis
    arch: str
    smem: SmemLayout
    storage: FrozenMap[Node, SmemStorage]
    plans: FrozenMap[Node, MatmulPlan]
    groups: FrozenMap[Node, Group]
    """Score -> its group, with alpha and P."""
    group_of: FrozenMap[Node, Group]
    register: RegisterPath | None
    names: tuple[tuple[str, int], ...]
    """Identifiers the layout took (cfmt.Names.counts)."""


@dataclass(frozen=True)
class _Attempt:
    """One option laid out (the frozen result of a Draft)."""

    smem: int
    ptrs: tuple[tuple[str, str, int], ...]
    storage: FrozenMap[Node, SmemStorage]
    plans: FrozenMap[Node, MatmulPlan]
    groups: FrozenMap[Node, Group]
    register: RegisterPath | None


def _attempt(
    an: Analysis, names: Names, cand: RegisterCandidate | None, nt: int, pad: bool, nstage: int
) -> _Attempt:
    """Allocate every buffer for one option (padding, pipeline depth, threads, the register
    candidate) and plan the matmuls; which stored values are scaled is decided here too, in
    dependency order."""
    d = Draft(an, names, nt, pad, nstage)
    alloc(d, "float", "red", 32 * 4)
    # the C of every block matmul: accumulators it is fused into, and stored products
    mma_out = set(an.fused.values()) | {
        n for n in an.nodes if n.op is Op.MATMUL and n not in an.fused
    }
    fl = cand.group if cand is not None else None
    # loop tiles first, in one contiguous region: after the loop it is dead, and the register
    # pass keeps its weighted sum there (flushed once the last step is done)
    region = _ceil_to(d.smem, 128)
    region_end = region
    for it in sorted(an.iters, key=lambda i: i.phase is not Phase.LOOP):
        strides = tile_strides(it.shape, it.dtype, pad)
        nbytes = (strides[0] * it.shape[0] if it.shape else 1) * it.dtype.itemsize
        base = f"s{it.arg}"
        if it.phase is Phase.LOOP:
            for k in range(nstage):
                alloc(d, CTYPE[it.dtype], f"{base}_{k}", nbytes)
            region_end = d.smem
        elif it in an.direct:
            # read in place from global memory (blockpass.loading points `g<arg>` at the tile)
            base, strides = f"g{it.arg}", contiguous(it.shape)
        else:
            alloc(d, CTYPE[it.dtype], base, nbytes)
        d.storage[it] = SmemStorage(base, it.dtype, it.shape, strides)
    alias = None
    for n in an.order:
        if n not in an.materialised or n.op is Op.ITER:
            continue
        if fl is not None and n in cand.form.terms:  # never stored: S lives in registers
            name = unbacked(d, "float", names.new("sm"))
            d.storage[n] = SmemStorage(name, DType.F32, n.shape, contiguous(n.shape))
        elif (
            fl is not None
            and n is fl.wsums[0]
            and an.loop_iters
            and n.numel * 4 <= region_end - region
        ):
            name = names.new("sm")
            d.ptrs.append(("float", name, region))
            d.storage[n] = SmemStorage(name, DType.F32, n.shape, contiguous(n.shape))
            alias = n
        else:
            fp32(d, n, pad and n in mma_out)
    groups: dict[Node, Group] = {}
    for s, g in an.groups.items():
        fp32(d, g.m)
        name = names.new("alpha")
        on_register = fl is not None and s is fl.s
        alpha = (
            unbacked(d, "float", name) if on_register else alloc(d, "float", name, g.m.numel * 4)
        )
        groups[s] = replace(g, alpha=alpha)
    for acc, g in an.group_of.items():
        set_scale(d, acc, acc_scale(g, acc))
    # which stored values are scaled is decided here, in dependency order, before any emission
    for n in an.nodes:
        if n.op in REDUCE and n in d.storage and n not in an.fused_reduce:
            set_scale(d, n, reduce_scale(d, n))
        if n.op is Op.MATMUL:
            d.plans[n] = plan_matmul(d, n.src[0], n.src[1], an.fused.get(n, n), n in an.fused)
    for s, g in list(groups.items()):
        if not g.wsums:
            continue
        on_register = fl is not None and s is fl.s
        g = groups[s] = group_p(d, g, on_register)
        row_scale = g.alpha if an.rows_aligned(g) else None
        for w in g.wsums:
            scaled = scaled_v(d, w.src[1], g.p_dtype) if on_register else None
            if scaled is not None:  # the register pass reads x of x * f as stored: no staging
                a = Operand(g.p.ptr, g.p.dtype, g.s.shape, g.p.strides)
                c = d.storage[w]
                m, k, n = g.s.shape[-2], g.s.shape[-1], w.src[1].shape[-1]
                strip = strip_width(numel(c.shape[:-2]), m, n, k, nt // 32)
                d.plans[w] = MatmulPlan(
                    "mma",
                    a,
                    scaled[0],
                    c,
                    True,
                    g.p_dtype,
                    True,
                    scaled[1],
                    (),
                    row_scale,
                    strip,
                    _ceil_to(m, 16),
                )
            else:
                d.plans[w] = plan_matmul(d, None, w.src[1], w, True, g, row_scale)
    reg = register_path(d, cand, groups[fl.s], alias) if cand is not None else None
    return _Attempt(
        d.smem,
        tuple(d.ptrs),
        FrozenMap(d.storage),
        FrozenMap(d.plans),
        FrozenMap(groups),
        reg,
    )


def plan_layout(an: Analysis, arch: str = CODEGEN_ARCH) -> LayoutPlan:
    """Padding rows against bank conflicts only where it fits at all; the pipeline is
    PIPELINE_STAGES deep. The register pass wants small blocks (a warp per 16 rows); if it
    does not fit, or its matmuls do not allow it, the usual block size is laid out instead.
    Every attempt takes fresh identifiers after the previous one's (one Names)."""
    budget = SMEM_BUDGET[arch]
    names = Names()
    cand, nt = an.register, an.threads
    options = ((True, PIPELINE_STAGES), (False, PIPELINE_STAGES))
    while True:
        before = cand
        fits = False
        for pad, nstage in options:
            att = _attempt(an, names, cand, nt, pad, nstage)
            if att.register is None:
                cand = None
            if att.smem <= budget:
                fits = True
                break
        if not fits or cand is before:
            break
        # the register path does not apply after all: the usual block size
        nt = BLOCK_THREADS
    smem = SmemLayout(att.smem, fits, pad, nstage, nt, att.register is not None, att.ptrs)
    group_of = FrozenMap((a, att.groups[g.s]) for a, g in an.group_of.items())
    return LayoutPlan(
        an, arch, smem, att.storage, att.plans, att.groups, group_of, att.register, names.counts()
    )


@lru_cache(maxsize=512)
def smem_layout(bg: BlockGraph, arch: str = CODEGEN_ARCH) -> SmemLayout:
    """The layout code generation gives `bg` when it lays kernels out for `arch`."""
    return plan_layout(analyse(bg), arch).smem


class BlockLayout:
    """The old planner's reading interface over `plan_layout`, for callers that inspect a
    layout's matmul plans (`BlockLayout(bg).plan(arch)`, then `.plans`); it decides nothing."""

    def __init__(self, bg: BlockGraph) -> None:
        self.bg = bg

    def plan(self, arch: str = CODEGEN_ARCH) -> SmemLayout:
        lp = plan_layout(analyse(self.bg), arch)
        self.plans = lp.plans
        return lp.smem
