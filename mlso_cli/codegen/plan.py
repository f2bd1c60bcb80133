"""`plan(kg, arch)`: what code generation will do with a μGraph, decided before any code is printed.

Why: the spec checker, the cost model and the interpreter's float32 mode need code generation's
decisions (how many kernels in which order, each graph-defined kernel's shared memory, threads,
pipeline depth and whether its online softmax runs in registers, which exps are kept relative to
a row max), not its text. Every figure here comes from the same functions `generate` uses
(roots.kernel_roots, blocklayout.smem_layout, stabilise.stabilised, normalise), so a plan and a
program cannot disagree; `LoweringPlan.to_json` is plain JSON for reports and caches. Nothing
here prints, except the one fallback `_library_decisions` documents.

What is not here yet: the kernel-level scale decisions (which fp32 scratch buffers hold scaled
numbers) are still made as each kernel is emitted, in this schedule's order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlso_cli.codegen.blocklayout import CODEGEN_ARCH, SmemLayout, smem_layout
from mlso_cli.codegen.cfmt import contiguous
from mlso_cli.codegen.libgemm import eligible, from_softmax, scratch_dtype, stagings
from mlso_cli.codegen.normalise import normalise
from mlso_cli.codegen.program import Buffer
from mlso_cli.codegen.roots import KIND, KernelRoots, kernel_roots
from mlso_cli.codegen.rowfuse import RowPair
from mlso_cli.codegen.scale import Storage
from mlso_cli.codegen.stabilise import consumers_of, stabilised
from mlso_cli.ir.graph import KernelGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import DType, Op
from mlso_cli.knobs import knobs


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
    """The μGraph node the kernel computes (for the cost model; not part of the JSON); None for
    a sibling launch, whose parts name theirs."""
    parts: tuple[KernelPlan, ...] = ()
    """Kind "siblings": the elementwise kernels one launch computes (siblings.py), each with
    its root; the launch's shape is then the parts' elements in all, (count,). Kind "row": the
    reduction and the value computed from it row by row (rowfuse.py: kinds "reduce", then
    "elementwise" or "stage"); the launch's shape is the value's."""

    @property
    def roots(self) -> tuple[Node, ...]:
        """The μGraph nodes the launch computes: its root, or its parts' roots."""
        if self.parts:
            return tuple(r for p in self.parts for r in p.roots)
        return () if self.root is None else (self.root,)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "shape": list(self.shape)}
        if self.parts:
            out["parts"] = [p.to_json() for p in self.parts]
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
    """The lowering plan of kg (which must pass mlso_cli.codegen.budget.check) for `arch`.

    A kernel-level matmul that generate lowers to a library GEMM is kind "gemm", preceded by a
    "stage" kernel (root: the value it stores) per operand codegen stages
    (`_library_decisions`). Elementwise kernels that share one launch (siblings.py) are one
    kernel of kind "siblings" whose `parts` are theirs; a reduction computed by its row-wise
    reader's kernel (rowfuse.py) is one kernel of kind "row" at the reader's place."""
    if library is None:
        library = knobs().library_gemm
    kr = kernel_roots(kg)
    readers = {p.reader: p for p in kr.rows.values()}
    kernels = []
    decided: dict[Node, list[Node]] | None = None
    for group in kr.launches:
        if len(group) > 1:
            parts = tuple(KernelPlan("elementwise", r.shape, root=r) for r in group)
            shape = (sum(r.numel for r in group),)
            kernels.append(KernelPlan("siblings", shape, parts=parts))
            continue
        (root,) = group
        pair = kr.rows.get(root)
        if pair is not None and pair.holds(library):
            continue  # computed by its reader's kernel (a "row" kernel, below)
        pair = readers.get(root)
        if pair is not None and pair.operand is None:
            kernels.append(_row(pair, "elementwise", root))
            continue
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
        elif root.op is Op.MATMUL and library and eligible(root):
            if decided is None:
                decided = _library_decisions(kg, kr, library)
            if root not in decided:
                kernels.append(KernelPlan("matmul", root.shape, root=root))
                continue
            for value in decided[root]:
                pair = readers.get(root)
                if pair is not None and pair.value == value:  # (equal: a fold rebuilds nodes)
                    kernels.append(_row(pair, "stage", value))
                else:
                    kernels.append(KernelPlan("stage", value.shape, root=value))
            kernels.append(KernelPlan("gemm", root.shape, root=root))
        else:
            kernels.append(KernelPlan(KIND.get(root.op, "elementwise"), root.shape, root=root))
    return LoweringPlan(arch, tuple(kernels), len(kr.stab))


def _row(pair: RowPair, kind: str, value: Node) -> KernelPlan:
    """A row kernel: the reductions (a chain's in order), then the reader's value (its own, or a
    staged operand)."""
    parts = (
        *(KernelPlan("reduce", r.shape, root=r) for r in pair.reductions),
        KernelPlan(kind, value.shape, root=value),
    )
    return KernelPlan("row", value.shape, parts=parts)


def _library_decisions(kg: KernelGraph, kr: KernelRoots, library: bool) -> dict[Node, list[Node]]:
    """Library GEMM roots -> the values staged for them, as generate decides. Decided from a
    sketch of generate's storage (dtypes and strides) without emitting anything, except where a
    matmul's operands derive from a softmax numerator kept relative to its row max: whether the
    value reaching the matmul is still scaled (then it stays generated) is only known to the
    emitter, so that rare program is lowered for real and its decisions read back."""
    matmuls = [r for r in kr.schedule if r.op is Op.MATMUL and eligible(r)]
    if kr.stab and any(from_softmax(r, kr.stab) for r in matmuls):
        from mlso_cli.codegen.lower import Lowering  # the fallback prints: lower imports this

        full = Lowering(kg, ("sm_90",), library)
        full.generate()
        return full.library_roots
    storage = _storage_sketch(kg, kr)
    return {r: stagings(storage, r) for r in matmuls}


def _storage_sketch(kg: KernelGraph, kr: KernelRoots) -> dict[Node, Storage]:
    """Where generate stores each tensor, without emitting anything: inputs and outputs in their
    buffers, every other kernel's result (and a graph-defined kernel's outputs) in fp32 scratch,
    a library GEMM's C and a value only GEMMs read in libgemm.scratch_dtype.
    Enough for libgemm.stagings, which reads dtypes and strides only."""
    out: dict[Node, Storage] = {}

    def put(n: Node, kind: str, index: int, dtype: DType, shape: tuple[int, ...]) -> None:
        if n not in out:
            buf = Buffer(kind, index, dtype, shape)
            strides = kr.target_strides.get(n) if kind == "output" else None
            out[n] = Storage(buf.name, dtype, n.shape, strides or contiguous(n.shape), buffer=buf)

    for i, n in enumerate(kg.inputs):
        put(n, "input", i, n.dtype, n.shape)
    for k, n in enumerate(kr.targets):
        put(n, "output", k, kg.outputs[k].dtype, kg.outputs[k].shape)
    for i, n in enumerate(kr.order):
        if n in kr.roots or n.op is Op.PROJ:
            put(n, "scratch", i, scratch_dtype(n, kr.consumers, kr.stab), n.shape)
    return out
