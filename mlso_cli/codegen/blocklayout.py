"""The shared-memory layout of a graph-defined kernel: one pure function, `smem_layout`.

Why: the spec checker (a graph is valid for an arch iff its layout fits the arch's budget), the
block builder (which grows graphs within that budget) and code generation must agree on the byte
count to the byte. They all call `smem_layout`, which runs the same planning code generation
runs (analysis, staging copies, padding against bank conflicts, the cp.async pipeline depth, the
register path's aliasing) and returns its result as a frozen value; no code is printed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from mlso_cli.codegen import blockanalysis
from mlso_cli.codegen.arch import SMEM_BUDGET
from mlso_cli.codegen.blockmatmul import MatmulPlan, MatmulPlanning, Operand, Stage
from mlso_cli.codegen.blockstorage import _ceil_to
from mlso_cli.codegen.cfmt import CTYPE, contiguous
from mlso_cli.codegen.scale import Storage
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


class BlockLayout(MatmulPlanning):
    """Runs the layout options in order of preference and keeps the first that fits."""

    def _layout(self, pad: bool, stages: int) -> None:
        """Allocate every buffer for one option (padding, pipeline depth) and plan the matmuls;
        which stored values are scaled is decided here too, in dependency order."""
        self.pad = pad
        self.nstage = stages
        self.smem = 0
        self.ptrs: list[tuple[str, str, int]] = []  # (C type, name, byte offset)
        self.storage: dict[Node, Storage] = {}
        self.stages: dict[tuple, Stage] = {}
        self.plans: dict[Node, MatmulPlan] = {}
        self.red = self._alloc("float", "red", 32 * 4)
        # the C of every block matmul: accumulators it is fused into, and stored products
        self.mma_out = set(self.fused.values()) | {
            n for n in self.nodes if n.op is Op.MATMUL and n not in self.fused
        }
        fl = self.flash
        # loop tiles first, in one contiguous region: after the loop it is dead, and the register
        # pass keeps its weighted sum there (flushed once the last step is done)
        region = _ceil_to(self.smem, 128)
        for it in sorted(self.iters, key=lambda i: i.phase is not Phase.LOOP):
            strides = self._tile_strides(it.shape, it.dtype, pad)
            nbytes = (strides[0] * it.shape[0] if it.shape else 1) * it.dtype.itemsize
            base = f"s{it.arg}"
            if it.phase is Phase.LOOP:
                for k in range(stages):
                    self._alloc(CTYPE[it.dtype], f"{base}_{k}", nbytes)
                region_end = self.smem
            elif it in self.direct:
                # read in place from global memory (blockpass.loading points `g<arg>` at the tile)
                base, strides = f"g{it.arg}", contiguous(it.shape)
            else:
                self._alloc(CTYPE[it.dtype], base, nbytes)
            self.storage[it] = Storage(base, it.dtype, it.shape, strides)
        self.flash_alias = None
        for n in self.order:
            if n in self.materialised and n.op is not Op.ITER:
                if (
                    fl is not None and n in self.flash_form.terms
                ):  # never stored: S lives in registers
                    self.storage[n] = Storage(
                        self._unbacked("float", self.names.new("sm")),
                        DType.F32,
                        n.shape,
                        contiguous(n.shape),
                    )
                elif (
                    fl is not None
                    and n is fl.wsums[0]
                    and self.loop_iters
                    and n.numel * 4 <= region_end - region
                ):
                    name = self.names.new("sm")
                    self.ptrs.append(("float", name, region))
                    self.storage[n] = Storage(name, DType.F32, n.shape, contiguous(n.shape))
                    self.flash_alias = n
                else:
                    self._fp32(n, pad and n in self.mma_out)
        for g in self.groups.values():
            self._fp32(g.m)
            name = self.names.new("alpha")
            g.alpha = (
                self._unbacked("float", name)
                if g is fl
                else self._alloc("float", name, g.m.numel * 4)
            )
        for acc in self.group_of:
            self.storage[acc].scale = self._acc_scale(acc)
        # which stored values are scaled is decided here, in dependency order, before any emission
        for n in self.nodes:
            if n.op in REDUCE and n in self.storage and n not in self.fused_reduce:
                self.storage[n].scale = self._reduce_scale(n)
            if n.op is Op.MATMUL:
                out = self.fused.get(n, n)
                self.plans[n] = self._plan_matmul(
                    n.src[0], n.src[1], self.storage[out], n in self.fused
                )
        for g in self.groups.values():
            if g.wsums:
                self._plan_group_p(g)
                for w in g.wsums:
                    scaled = self._flash_scaled_v(w.src[1], g.p_dtype) if g is fl else None
                    if (
                        scaled is not None
                    ):  # the register pass reads x of x * f as stored: no staging
                        a = Operand(g.p.ptr, g.p.dtype, g.s.shape, g.p.strides)
                        self.plans[w] = MatmulPlan(
                            "mma", a, scaled[0], self.storage[w], True, g.p_dtype, True, scaled[1]
                        )
                    else:
                        self.plans[w] = self._plan_matmul(
                            None, w.src[1], self.storage[w], True, p_of=g
                        )
                    if self._rows_aligned(g):
                        self.plans[w].row_scale = g.alpha
        if not self._flash_ok():
            self.flash = None

    def plan(self, arch: str = CODEGEN_ARCH) -> SmemLayout:
        """Padding rows against bank conflicts only where it fits at all; the pipeline is
        PIPELINE_STAGES deep. The register pass wants small blocks (a warp per 16 rows); if it
        does not fit, the usual block size is laid out instead."""
        budget = SMEM_BUDGET[arch]
        options = [(True, PIPELINE_STAGES), (False, PIPELINE_STAGES)]
        while True:
            flash = self.flash
            fits = False
            for pad, stages in options:
                self._layout(pad, stages)
                if self.smem <= budget:
                    fits = True
                    break
            if not fits or self.flash is flash:
                break
            # the register path does not apply after all: the usual block size
            self.nt = blockanalysis.BLOCK_THREADS
            self.nw = self.nt // 32
        return SmemLayout(
            self.smem,
            fits,
            self.pad,
            self.nstage,
            self.nt,
            self.flash is not None,
            tuple(self.ptrs),
        )


@lru_cache(maxsize=512)
def smem_layout(bg: BlockGraph, arch: str = CODEGEN_ARCH) -> SmemLayout:
    """The layout code generation gives `bg` when it lays kernels out for `arch`."""
    return BlockLayout(bg).plan(arch)
