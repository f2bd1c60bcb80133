"""Code generation: μGraph -> CUDA C++ built from kernels_templates/, plus the launch plan.

    generate(kg, arch_targets=("sm_80", "sm_90a")) -> GeneratedProgram(source, plan, kernel_names)
    compile_program(kg, arch_targets=...) -> CompiledProgram(fatbin, plan, source, source_sha256)

Strategy per construct (details in each module's docstring):
  plan.py      plan(kg, arch): kernels, layouts, register paths, before any code is printed
  roots.py     which kernel-level nodes become kernels, output targets, launch order (a frozen
               KernelRoots, decided from the graph alone)
  lower.py     buffers, and each root's kernel printed in launch order
  schedule.py  the one dependency-first scheduling loop (kernels, and passes within a block)
  siblings.py  horizontal fusion: consecutive independent elementwise kernels share one launch
               (decided with the roots); siblingkernel.py plans and prints that launch
  rowfuse.py   a row reduction and its one row-wise reader (an elementwise root or a library
               GEMM's staged operand) as one kernel (decided with the roots); rowkernel.py
               plans and prints it (a warp per row: reduce, then the reader's value)
  kernels.py   the kernel-level emitters: elementwise chains (plan_elementwise, print_elementwise),
               reductions and tiled matmuls through their plan modules:
  reducekernel.py  plan_reduce (a frozen ReduceKernelPlan, incl. the split-KV combine), print_reduce
  matmulkernel.py  plan_matmul (a frozen MatmulKernelPlan), print_matmul
  site.py      KernelSite: what a kernel-level printer gets from the lowering (no Lowering)
  libgemm.py   kernel-level matmuls as cuBLASLt calls (library GEMM launches), operand staging
  normalise.py exact block rewrites (ACC_SUM of exp terms -> rescaling accumulators), and the
               graph as codegen computes it, for the interpreter's float32 mode
  blockanalysis.py, blockstorage.py, blockmatmul.py, blockregister.py, blocklayout.py,
  blockschedule.py, blockloops.py, blockio.py, barriers.py
               graph-defined kernels' decisions, each a function returning a frozen value
               (analyse, plan_layout, schedule_passes as a rule table, loop_shapes, plan_io);
               blocklayout.smem_layout is the shared-memory figure the architecture check uses
  frozen.py    FrozenMap: the read-only, hashable mapping plans hold
  arch.py      per-arch figures (shared-memory budget)
  budget.py    the architecture check: ir.spec's rules plus layout and shared-memory budget
               (check, problems, block_smem); ir/ imports nothing from codegen
  blockbuilder.py  ir.builder.BlockBuilder with the arch's shared-memory budget
  blockplan.py plan_block(bg, arch): one frozen BlockPlan per graph-defined kernel (path, threads,
               pipeline, padding, tiles, buffers, matmul operands and staging)
  block.py     graph-defined kernels printed from their BlockPlan: the PRE/LOOP/POST skeleton,
               pipeline, pass order and barriers
  blockpass/   graph-defined kernels' passes printed by family: elementwise, rowwalk, matmul,
               flash (online softmax groups), reduce, saving, loading
  scoreform.py scores the register-resident online softmax computes (scaled, per-key, two terms)
  emitter.py   fused elementwise evaluation (thread graphs), views as index maps
  scale.py     values kept relative to a running max (softmax safety at logits of +-100);
               a matmul is linear in a row-scaled A or a column-scaled B
  indexmask.py constant mask inputs that are exactly an index predicate (causal: col <= row + k)
               are computed from coordinates, not read (generate's `constants`)
  stabilise.py which EXPs are softmax numerators (reaching a sum or a contracting matmul)
  nvcc.py      fatbin compilation with a content-hash cache
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mlso_cli.codegen.budget import check
from mlso_cli.codegen.errors import CodegenError, CompileError
from mlso_cli.codegen.lower import Lowering
from mlso_cli.codegen.program import GeneratedProgram
from mlso_cli.ir.graph import KernelGraph

DEFAULT_TARGETS: tuple[str, ...] = ("sm_80", "sm_90a")


def generate(
    kg: KernelGraph,
    arch_targets: tuple[str, ...] = DEFAULT_TARGETS,
    constants: Mapping[str, np.ndarray] | None = None,
) -> GeneratedProgram:
    """CUDA source and launch plan of a μGraph that passes mlso_cli.codegen.budget.check.
    `constants`: values of constant inputs by input name (indexmask.mask_constants picks them);
    an `mlso_mask_*` input that is exactly an index predicate is then computed, not read."""
    check(kg)
    return Lowering(kg, tuple(arch_targets), constants=constants).generate()


def compile_program(
    kg: KernelGraph,
    arch_targets: tuple[str, ...] = DEFAULT_TARGETS,
    constants: Mapping[str, np.ndarray] | None = None,
):
    """generate() then nvcc (cached): a CompiledProgram ready for the launcher or packaging."""
    from mlso_cli.codegen.nvcc import compile_generated

    return compile_generated(generate(kg, arch_targets, constants), tuple(arch_targets))


__all__ = [
    "DEFAULT_TARGETS",
    "CodegenError",
    "CompileError",
    "GeneratedProgram",
    "compile_program",
    "generate",
]
