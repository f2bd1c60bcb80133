"""`plan(kg, arch)`: what code generation will do with a μGraph, decided before any code is printed.

Why: the spec checker, the cost model and the interpreter's float32 mode need code generation's
decisions (how many kernels in which order, each graph-defined kernel's shared memory, threads,
pipeline depth and whether its online softmax runs in registers, which exps are kept relative to
a row max), not its text. Every figure here comes from the same functions `generate` uses
(Lowering's roots and schedule, blocklayout.smem_layout, stabilise.stabilised, normalise), so a
plan and a program cannot disagree; `LoweringPlan.to_json` is plain JSON for reports and caches.

What is not here yet: the kernel-level scale decisions (which fp32 scratch buffers hold scaled
numbers) are still made as each kernel is emitted, in this schedule's order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlso_cli.codegen.blocklayout import CODEGEN_ARCH, SmemLayout, smem_layout
from mlso_cli.codegen.libgemm import eligible
from mlso_cli.codegen.lower import KERNEL_EMITTERS, Lowering
from mlso_cli.codegen.normalise import normalise
from mlso_cli.codegen.stabilise import consumers_of, stabilised
from mlso_cli.ir.graph import KernelGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import REDUCE, Op

KIND: dict[Op, str] = {
    Op.MATMUL: "matmul",
    Op.GRAPH_DEF: "graph_def",
    **{op: "reduce" for op in REDUCE},
}
"""Root op -> kernel kind; every other root is an elementwise kernel (KERNEL_EMITTERS' default)."""
assert set(KIND) == set(KERNEL_EMITTERS)


@dataclass(frozen=True)
class KernelPlan:
    kind: str
    shape: tuple[int, ...]
    """The shape the kernel computes (a graph-defined kernel: its grid)."""
    layout: SmemLayout | None = None
    """Graph-defined kernels only."""
    stabilised: int = 0
    """How many EXPs of a graph-defined kernel are kept relative to a row max."""
    root: Node | None = field(default=None, compare=False, repr=False)
    """The μGraph node the kernel computes (for the cost model; not part of the JSON)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "shape": list(self.shape)}
        if self.layout is not None:
            lay = self.layout
            out.update(
                smem=lay.smem,
                threads=lay.threads,
                pipeline=lay.stages,
                padded=lay.pad,
                register_path=lay.register_path,
                stabilised=self.stabilised,
            )
        return out


@dataclass(frozen=True)
class LoweringPlan:
    arch: str
    kernels: tuple[KernelPlan, ...]
    """In launch order."""
    stabilised: int
    """Kernel-level EXPs kept relative to a row max."""

    @property
    def smem_max(self) -> int:
        return max((k.layout.smem for k in self.kernels if k.layout is not None), default=0)

    def to_json(self) -> dict[str, Any]:
        return {
            "arch": self.arch,
            "kernels": [k.to_json() for k in self.kernels],
            "stabilised": self.stabilised,
            "smem_max": self.smem_max,
        }


def plan(kg: KernelGraph, arch: str = CODEGEN_ARCH, library: bool | None = None) -> LoweringPlan:
    """The lowering plan of kg (which must pass mlso_cli.ir.spec.check) for `arch`.

    A kernel-level matmul whose dtypes a library GEMM takes (libgemm.eligible) is kind "gemm":
    generate lowers it to cuBLASLt unless an operand turns out to be a scaled value, which only
    emission knows (then it stays a generated "matmul" kernel)."""
    lw = Lowering(kg, (), library)
    roots, targets = lw._roots()
    kernels = []
    for root in lw._schedule(roots, targets):
        if root.op is Op.GRAPH_DEF:
            bg = normalise(root.arg)
            nodes = bg.nodes()
            kernels.append(
                KernelPlan(
                    "graph_def",
                    bg.grid,
                    smem_layout(root.arg, arch),
                    len(stabilised(nodes, consumers_of(nodes))),
                    root,
                )
            )
        elif root.op is Op.MATMUL and lw.library and eligible(root):
            kernels.append(KernelPlan("gemm", root.shape, root=root))
        else:
            kernels.append(KernelPlan(KIND.get(root.op, "elementwise"), root.shape, root=root))
    return LoweringPlan(arch, tuple(kernels), len(lw.stab))
