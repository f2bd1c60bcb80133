"""Graph-defined kernels: one CUDA kernel per block graph. This module orders and frames the
passes (the PRE / LOOP / POST skeleton, the pipeline, barriers); the passes themselves are
printed by family in blockpass/ (elementwise, rowwalk, matmul, flash, reduce, saving, loading).
The decisions are made before it runs, by functions that each return a frozen value
(blockplan.plan_block chains them): blockanalysis.analyse (what is materialised, groups, fusions,
the register-path candidate, dependency order), blocklayout.plan_layout (buffers and which hold
scaled numbers, blockstorage.py; operands and staging copies, blockmatmul.py; the register path,
blockregister.py; the one shared-memory figure, smem_layout), blockschedule.schedule_passes
(which passes run in which phase, a table of rules); barriers.py places __syncthreads() while
printing (where a pass touches what another wrote).

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

Each op is a pass over shared memory followed by __syncthreads(). The plan's schedule names each
pass by kind; the table PRINTERS (kind -> a blockpass function) prints it. ACC_EXP_SUM / ACC_EXP_WSUM sharing a score tensor s form one group with
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
from mlso_cli.codegen.blockio import IoPlan, plan_io
from mlso_cli.codegen.blocklayout import CODEGEN_ARCH
from mlso_cli.codegen.blockpass import flash, loading, matmul, reduce, saving
from mlso_cli.codegen.blockplan import BlockPlan, plan_block
from mlso_cli.codegen.blockschedule import Step
from mlso_cli.codegen.blockstorage import SmemStorage
from mlso_cli.codegen.cfmt import (
    CTYPE,
    Code,
    Names,
)
from mlso_cli.codegen.emitter import Emitter
from mlso_cli.codegen.errors import CodegenError
from mlso_cli.codegen.frozen import FrozenMap
from mlso_cli.codegen.program import Kernel
from mlso_cli.codegen.scale import Storage
from mlso_cli.ir.graph import BlockGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import ACCUMULATORS, Op, Phase

if TYPE_CHECKING:
    from mlso_cli.codegen.lower import Lowering, Uses


@dataclass(frozen=True)
class KernelContext:
    """What a block kernel's planning of loads and saves (blockio.plan_io) and its printer get
    from the kernel level, decided before it prints: its name, its parameters so far, where each
    output goes, and services (a read-only view of where kernel tensors live, a new fp32 scratch
    buffer for partial maxima, an emitter over kernel tensors)."""

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

    def __init__(self, plan: BlockPlan, io: IoPlan, ctx: KernelContext) -> None:
        self.plan = plan
        self.io = io
        self.ctx = ctx
        self.gd = ctx.gd
        self.name = ctx.name
        self.uses = ctx.uses
        self.proj_storage: tuple[Storage, ...] = ctx.outputs
        """Output i's kernel-level storage (a scaled partial's scale recorded by emit_graph_def)."""
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
        self.storage: Mapping[Node, SmemStorage] = FrozenMap(
            dict(plan.storage) | {it: t.storage for it, t in io.in_place.items()}
        )
        """The plan's storage, with the global view of each in-place tile (blockio)."""
        self.names = Names.after(plan.names)
        self.direct_aligned: Mapping[str, str] = FrozenMap(
            (t.storage.ptr, CTYPE[it.dtype]) for it, t in io.in_place.items() if t.aligned
        )
        """In-place PRE tiles whose every block starts 16-byte aligned: C types."""

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

    def _emit_passes(self, code: Code, phase: Phase) -> None:
        """Print the plan's passes of `phase` (each by its printer in PRINTERS) with the
        barriers barriers.emit_with_barriers finds necessary."""

        def reset() -> None:
            self._reads, self._writes = set(), set()

        passes = [
            lambda c, step=step: PRINTERS[step.kind](self, c, step)
            for step in self.plan.passes(phase)
        ]
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
        self._emit_passes(code, Phase.PRE)
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
        if loop_iters or self.plan.passes(Phase.LOOP):
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
                self._emit_passes(code, Phase.LOOP)
                code("__syncthreads();")
        if self.flash is not None:
            flash.flash_flush(self, code)
        self._emit_passes(code, Phase.POST)
        code("__syncthreads();")
        for s in self.plan.schedule.saves:
            saving.pass_save(self, code, s)


PRINTERS: Mapping[str, Callable[[BlockKernel, Code, Step], None]] = MappingProxyType(
    {
        "stage": lambda bk, c, s: matmul.pass_stage(bk, c, s.subject),
        "register": lambda bk, c, s: flash.pass_flash(bk, c, s.subject),
        "group_rows": lambda bk, c, s: flash.pass_group_rows(bk, c, s.subject),
        "group": lambda bk, c, s: flash.pass_group(bk, c, s.subject),
        "matmul": lambda bk, c, s: matmul.pass_matmul(bk, c, s.subject, s.note),
        "matmul_node": lambda bk, c, s: matmul.pass_node_matmul(bk, c, s.subject),
        "reduce": lambda bk, c, s: reduce.pass_reduce(bk, c, s.subject),
        "acc_sum": lambda bk, c, s: reduce.pass_acc_sum(bk, c, s.subject),
        "moments": lambda bk, c, s: reduce.pass_moments(bk, c, s.subject),
    }
)
"""Step kind (blockschedule.Step) -> its printer; which step runs where is the plan's."""


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
    io = plan_io(plan, gd, ctx.storage, ctx.outputs, ctx.scratch, loading.HOIST_REGS)
    for save, ps in io.partial.items():
        # the lowering's output storage records the scale its partial is saved with
        ctx.outputs[save.arg.index].scale = ps.scale
    return BlockKernel(plan, io, ctx).build()
