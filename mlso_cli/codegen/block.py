"""Graph-defined kernels: one CUDA kernel per block graph. This module orders and frames the
passes (the PRE / LOOP / POST skeleton, the pipeline, barriers); the passes themselves are
printed by family in blockpass/ (elementwise, rowwalk, matmul, flash, reduce, saving, loading).
The decisions are made before it runs, by job: blockanalysis.py (what is materialised, groups,
fusions, the register-path candidate, dependency order), blockstorage.py (buffers and which hold
scaled numbers), blockmatmul.py (operands, staging copies), blocklayout.py (the layout options;
the one shared-memory figure, smem_layout), barriers.py (where __syncthreads() is needed).

Layout of a generated kernel (blockIdx.{x,y,z} are the grid coordinates):

    PRE   load PRE-phase ITER tiles (one cp.async group) and the first loop stages (a group
          each), wait for the PRE group only, then the PRE ops while the stages still load
    init  accumulators = 0, running maxima = -inf
    LOOP  for it < loop: prefetch step it+1 into the other buffer (cp.async double buffering),
          wait for step it, run the LOOP ops and accumulator updates
    POST  ops on accumulators, then SAVE every output through its omap

Materialised in shared memory (fp32 unless noted): ITER tiles (their input dtype, 16-byte rows
padded by 16 bytes against ldmatrix bank conflicts), matmul and reduction results, accumulators,
running maxima, and staging copies of matmul operands that are computed values (converted to
fp16/bf16 for tensor cores; a scaled operand, exp(s - M), is staged as its scaled numbers).
Everything elementwise is fused into its consumers (thread graphs by rule) and recomputed where
needed. The architecture check's shared-memory figure (budget.py) is this layout's exact byte
count.

Each op is a pass over shared memory followed by __syncthreads(). Passes come from the table
PASSES (op -> a blockpass function). ACC_EXP_SUM / ACC_EXP_WSUM sharing a score tensor s form one group with
one running row max m: per step, m' = max(m, rowmax s), alpha = exp(m - m'), sums are rescaled
by alpha and exp(s - m') terms added (P = exp(s - m') @ v on tensor cores for WSUM). Their
values are kept relative to m (scale.py); a POST division of two of them cancels the scale, and
a PARTIAL save stores the scaled partial plus m in an fp32 side buffer, which the combining
kernel-level REDUCE_SUM uses (kernels.emit_reduce).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from mlso_cli.codegen.arch import SMEM_BUDGET
from mlso_cli.codegen.barriers import emit_with_barriers
from mlso_cli.codegen.blocklayout import CODEGEN_ARCH
from mlso_cli.codegen.blockmatmul import MatmulPlan
from mlso_cli.codegen.blockpass import flash, loading, matmul, reduce, saving
from mlso_cli.codegen.blockplan import BlockPlan, plan_block
from mlso_cli.codegen.cfmt import (
    CTYPE,
    Code,
    Names,
)
from mlso_cli.codegen.emitter import Emitter
from mlso_cli.codegen.errors import CodegenError
from mlso_cli.codegen.program import Kernel
from mlso_cli.codegen.scale import Storage
from mlso_cli.ir.graph import BlockGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import ACCUMULATORS, Op, Phase

if TYPE_CHECKING:
    from mlso_cli.codegen.lower import Lowering, Uses

PHASES = (Phase.PRE, Phase.LOOP, Phase.POST)


@dataclass(frozen=True)
class KernelContext:
    """What a block kernel's printer gets from the kernel level, decided before it prints: its
    name, its parameters so far, where each output goes, and two services (a read-only view of
    where kernel tensors live, a new fp32 scratch buffer for partial maxima)."""

    gd: Node
    """The GRAPH_DEF node."""
    name: str
    uses: Uses
    outputs: tuple[Storage, ...]
    """Where output i of the block graph is stored (its PROJ's storage)."""
    storage: Mapping[Node, Storage]
    """Kernel-level tensors' storage (global views of ITER sources, maxima already written)."""
    scratch: Callable[[Node], Storage]
    """A new fp32 scratch buffer for a node (a PARTIAL save's per-block maxima)."""
    emitter: Callable[[Uses, Names], Emitter]
    """An emitter over kernel-level tensors (an in-place tile's elementwise chain)."""


class BlockKernel:
    """Prints one graph-defined kernel from its BlockPlan (blockplan.py), deciding nothing new;
    the passes are printed by family in blockpass/."""

    def __init__(self, plan: BlockPlan, ctx: KernelContext) -> None:
        self.ctx = ctx
        self.gd = ctx.gd
        self.name = ctx.name
        self.uses = ctx.uses
        self.proj_storage: dict[int, Storage] = dict(enumerate(ctx.outputs))
        self.bg = plan.bg
        self.nt, self.nw, self.nstage = plan.threads, plan.warps, plan.stages
        self.smem, self.ptrs = plan.layout.smem, plan.layout.buffers
        self.order, self.iters, self.loop_iters = plan.order, plan.iters, plan.loop_iters
        self.direct, self.stab, self.plans = plan.direct, plan.stab, plan.plans
        self.groups, self.group_of = plan.groups, plan.group_of
        self.rows_aligned = plan.rows_aligned
        self.fused, self.fused_reduce = plan.fused, plan.fused_reduce
        self.moments, self.moment_firsts = plan.moments, plan.moment_firsts
        self.reg = plan.register
        self.flash = plan.register.group if plan.register is not None else None
        self.flash_alias = plan.register.alias if plan.register is not None else None
        self.storage: dict[Node, Storage] = dict(plan.storage)
        """The plan's storage, plus the global view of each in-place tile (`loading.point`)."""
        self.names = Names.after(plan.names)
        self.hoisted: dict[int, tuple[int, int]] = {}
        """Loop tile -> (chunks per thread, elements per step) where its offsets are hoisted."""
        self.direct_aligned: dict[str, str] = {}
        """In-place PRE tiles (`loading.point`) whose every block starts 16-byte aligned: C types."""

    # ---- emission helpers --------------------------------------------------------------------
    def emitter(self) -> Emitter:
        return Emitter(self.storage, self.stab, self.names, self._note)

    def _note(self, n: Node) -> None:
        self._reads.add(self.storage[n].ptr)

    def note_reads(self, *ptrs: str) -> None:
        """Shared-memory buffers the pass being printed reads (for barriers.py)."""
        self._reads.update(ptrs)

    def note_writes(self, *ptrs: str) -> None:
        """Shared-memory buffers the pass being printed writes (for barriers.py)."""
        self._writes.update(ptrs)

    def kernel_emitter(self) -> Emitter:
        return self.ctx.emitter(self.uses, self.names)

    # ---- the kernel --------------------------------------------------------------------------
    def build(self) -> Kernel:
        body = Code(1)
        self._emit_body(body)
        code = Code()
        code(self.uses.signature(self.name, self.nt) + " {")
        code.lines.extend(body.lines)
        code("}")
        what = f"graph-defined kernel, grid {list(self.bg.grid)}, loop {self.bg.loop}"
        return Kernel(
            self.name,
            code.text(),
            self.bg.grid,
            (self.nt, 1, 1),
            self.smem,
            self.uses.params(),
            what,
        )

    def _pass_list(self) -> tuple[dict[Phase, list[Callable[[Code], None]]], list[Node]]:
        """Passes per phase in dependency order, and the SAVE nodes. Staging copies go right
        before their first matmul when in the same phase, else at the end of the operand's phase."""
        passes: dict[Phase, list[Callable[[Code], None]]] = {p: [] for p in PHASES}
        saves: list[Node] = []
        last_of_group = {}
        for n in self.order:
            if n in self.group_of:
                last_of_group[self.group_of[n].s] = n

        staged: set[int] = set()  # each staging copy is written once, before its first matmul

        def stage(plans: list[MatmulPlan]) -> None:
            for plan in plans:
                for st in plan.stages:
                    if id(st) not in staged:
                        staged.add(id(st))
                        passes[st.phase].append(lambda c, st=st: matmul.pass_stage(self, c, st))

        for n in self.order:
            if n.op is Op.ITER or n in (g.m for g in self.groups.values()):
                continue
            if n.op is Op.SAVE:
                saves.append(n)
                continue
            if n in self.group_of:
                g = self.group_of[n]
                if last_of_group[g.s] is n:
                    plans = [self.plans[w] for w in g.wsums]
                    if not (g is self.flash and self.reg.f is not None):
                        stage(
                            plans
                        )  # (a scaled weighted operand is read unscaled by the register pass)
                    if g is self.flash:
                        passes[Phase.LOOP].append(lambda c, g=g: flash.pass_flash(self, c, g))
                        continue
                    if g.s in self.rows_aligned:
                        passes[Phase.LOOP].append(lambda c, g=g: flash.pass_group_rows(self, c, g))
                    else:
                        passes[Phase.LOOP].append(lambda c, g=g: flash.pass_group(self, c, g))
                    for plan in plans:
                        passes[Phase.LOOP].append(
                            lambda c, plan=plan: matmul.pass_matmul(self, c, plan, "exp(s - m) @ v")
                        )
                continue
            if n.op in ACCUMULATORS:
                if n.src[0] in self.fused_reduce:
                    passes[Phase.LOOP].append(lambda c, r=n.src[0]: reduce.pass_reduce(self, c, r))
                    continue
                if n.src[0] in self.fused:
                    stage([self.plans[n.src[0]]])
                passes[Phase.LOOP].append(lambda c, n=n: reduce.pass_acc_sum(self, c, n))
                continue
            if n in self.moment_firsts:
                continue  # computed by the moments pass of its second reduction
            rule = MOMENTS if n in self.moments else PASSES.get(n.op)
            if rule is None:
                raise CodegenError(f"block op {n.op.value} has no pass")
            phase = n.phase or Phase.PRE
            if n in self.plans:
                stage([self.plans[n]])
            if self.flash is not None and n in self.reg.form.terms:
                continue  # computed inside the register pass of its group
            passes[phase].append(lambda c, n=n, rule=rule: rule(self, c, n))
        return passes, saves

    def _emit_passes(self, code: Code, passes: list[Callable[[Code], None]]) -> None:
        """Emit passes with the barriers barriers.emit_with_barriers finds necessary."""

        def reset() -> None:
            self._reads, self._writes = set(), set()

        emit_with_barriers(code, passes, reset, lambda: (self._reads, self._writes))

    def _emit_body(self, code: Code) -> None:
        code("MLSO_DYNAMIC_SMEM(smem);")
        code("const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;")
        code("(void)lane; (void)warp;")
        for ctype, name, off in self.ptrs:
            code(f"{ctype}* const {name} = reinterpret_cast<{ctype}*>(smem + {off});")
        self._reads, self._writes = set(), set()
        loop_iters, ns, loop = self.loop_iters, self.nstage, self.bg.loop
        for it in self.iters:
            if it in self.direct:
                loading.point(self, code, it)
            elif it.phase is Phase.PRE:
                loading.load_tile(self, code, it, None, f"s{it.arg}", True)
        if loop_iters:
            # the PRE tiles are one cp.async group and each prologue stage another: the PRE
            # passes wait for their own tiles only, and run while the first stages still load.
            # The loop's wait<ns - 1> counts on ns - 1 prologue groups: the layout only deepens
            # the pipeline for loops of at least 3 steps (blocklayout.py).
            assert loop >= ns - 1, (loop, ns)
            loading.hoist_offsets(self, code)
            code("mlso::cp_async_commit();")
            for k in range(ns - 1):
                for it in loop_iters:
                    loading.load_tile(self, code, it, str(k), f"s{it.arg}_{k}", True)
                code("mlso::cp_async_commit();")
            code(f"mlso::cp_async_wait<{ns - 1}>();", "__syncthreads();")
        else:
            code("mlso::cp_async_commit();", "mlso::cp_async_wait<0>();", "__syncthreads();")
        passes, saves = self._pass_list()
        self._emit_passes(code, passes[Phase.PRE])
        code("__syncthreads();")
        inits = [n for n in self.order if n.op in ACCUMULATORS]
        for acc in inits:
            if acc is self.flash_alias:
                continue  # shares the loop tiles' memory; written once, by the register pass's flush
            st = self.storage[acc]
            extent = st.strides[0] * st.shape[0] if st.shape else 1  # padding rows included
            code(f"for (int e = threadIdx.x; e < {extent}; e += {self.nt}) {st.ptr}[e] = 0.0f;")
        for g in self.groups.values():
            code(
                f"for (int e = threadIdx.x; e < {g.m.numel}; e += {self.nt}) "
                f"{self.storage[g.m].ptr}[e] = mlso::neg_inf();"
            )
        if inits:
            code("__syncthreads();")
        if self.flash is not None:
            code(
                flash.flash_decl(
                    self,
                )
            )
        if loop_iters or passes[Phase.LOOP]:
            with code.block(f"for (int it = 0; it < {loop}; ++it)"):
                for it in loop_iters:
                    code(
                        f"{CTYPE[it.dtype]}* const s{it.arg} = {loading.stage_ptr(self, it.arg, 'it')};"
                    )
                if loop_iters:
                    with code.block(f"if (it + {ns - 1} < {loop})"):
                        for it in loop_iters:
                            loading.load_tile(
                                self,
                                code,
                                it,
                                f"it + {ns - 1}",
                                loading.stage_ptr(self, it.arg, f"it + {ns - 1}"),
                                True,
                            )
                    code(
                        "mlso::cp_async_commit();",
                        f"mlso::cp_async_wait<{ns - 1}>();",
                        "__syncthreads();",
                    )
                self._emit_passes(code, passes[Phase.LOOP])
                code("__syncthreads();")
        if self.flash is not None:
            flash.flash_flush(self, code)
        self._emit_passes(code, passes[Phase.POST])
        code("__syncthreads();")
        written: set[Node] = set()
        for s in saves:
            saving.pass_save(self, code, s, written)


PASSES: dict[Op, Callable[[BlockKernel, Code, Node], None]] = {
    Op.MATMUL: matmul.pass_node_matmul,
    Op.REDUCE_SUM: reduce.pass_reduce,
    Op.REDUCE_MEAN: reduce.pass_reduce,
    Op.REDUCE_MAX: reduce.pass_reduce,
}
"""Block op -> pass emitter (accumulators and SAVE have their own places in the schedule)."""
MOMENTS = reduce.pass_moments
"""Pass emitter of a reduction blockanalysis pairs with its first (`moments`)."""


def emit_graph_def(lw: Lowering, gd: Node) -> Kernel:
    if not isinstance(gd.arg, BlockGraph):
        raise CodegenError("GRAPH_DEF without a block graph")
    gx, gy, gz = gd.arg.grid
    if gx > 2**31 - 1 or gy > 65535 or gz > 65535:
        raise CodegenError(
            f"grid {gd.arg.grid} exceeds CUDA's limits (x < 2^31, y and z <= 65535)",
            "Map the largest grid dimension to x.",
        )
    plan = plan_block(gd.arg)
    if not plan.layout.fits:
        raise CodegenError(
            f"graph-defined kernel needs {plan.layout.smem} bytes of shared memory "
            f"(limit {SMEM_BUDGET[CODEGEN_ARCH]})",
            "Choose smaller tiles (a larger grid or loop) for this block graph; "
            "mlso_cli.codegen.budget.check rejects this graph for the same reason.",
        )
    name, uses = lw.kernel_name(), lw.uses()
    outputs = []
    projs = {
        n.arg: n for n in lw.order if n.op is Op.PROJ and isinstance(n.arg, int) and n.src[0] == gd
    }
    for idx, save in enumerate(plan.bg.outputs):
        proj = projs.get(idx)
        if proj is None:
            proj = Node(Op.PROJ, (gd,), idx, plan.bg.output_shape(save), save.dtype)
        st = lw.storage.get(proj) or lw.scratch_storage(proj)
        outputs.append(st)
        uses.write(st.buffer)
    ctx = KernelContext(
        gd,
        name,
        uses,
        tuple(outputs),
        MappingProxyType(lw.storage),
        lw.scratch_storage,
        lw.emitter,
    )
    return BlockKernel(plan, ctx).build()
