"""Kernel-graph lowering: stores tensors and prints one kernel per root, in launch order.

The decisions come first, from the graph alone (roots.kernel_roots: which nodes become kernels,
what each output slot holds, the launch order); this module then stores and prints:
  - Graph outputs live in output buffers; everything else a kernel writes is fp32 scratch
    (fp16 intermediates would round logits of 100 by 0.03, ruining exp), except a library
    GEMM's staged operand, which is scratch of the operand's own 16-bit dtype, and a library
    GEMM's C, which is 16-bit unless a softmax numerator reads it (libgemm.c_dtype).
  - A MATMUL root becomes a library GEMM (cuBLASLt) whenever libgemm.library_matmul allows it,
    else a generated kernel.
  - Sibling elementwise roots that the decisions put in one launch (siblings.py) are printed as
    one kernel (siblingkernel.py).
  - A row pair's reduction (rowfuse.py) is stored at its turn but computed by its reader's
    kernel (rowkernel.py): the elementwise root's, or the library GEMM operand's staging.
Kernels are emitted in launch order by the table KERNEL_EMITTERS (op -> emitter); its keys are
plan.KIND's (the kinds the lowering plan reports).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from mlso_cli.codegen.block import emit_graph_def
from mlso_cli.codegen.cfmt import CTYPE, Names, contiguous
from mlso_cli.codegen.emitter import Emitter
from mlso_cli.codegen.indexmask import IndexMask, computed_inputs
from mlso_cli.codegen.kernels import emit_elementwise, emit_matmul, emit_reduce
from mlso_cli.codegen.libgemm import library_matmul, scratch_dtype
from mlso_cli.codegen.program import (
    Buffer,
    GemmLaunch,
    GeneratedProgram,
    Kernel,
    Launch,
    build_plan,
)
from mlso_cli.codegen.roots import INLINE_REDUCE_MAX_LEN as INLINE_REDUCE_MAX_LEN
from mlso_cli.codegen.roots import KIND, KernelRoots, kernel_roots
from mlso_cli.codegen.roots import ROOT_OPS as ROOT_OPS
from mlso_cli.codegen.rowfuse import RowPair
from mlso_cli.codegen.rowkernel import emit_row, row_scale
from mlso_cli.codegen.scale import Storage
from mlso_cli.codegen.selection import Selection, known_selections
from mlso_cli.codegen.siblingkernel import emit_siblings
from mlso_cli.ir.graph import KernelGraph
from mlso_cli.ir.hashing import graph_hash
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import DType, Op
from mlso_cli.knobs import knobs


class Uses:
    """The buffers a kernel reads and writes: its pointer parameters."""

    def __init__(self, storage: dict[Node, Storage]) -> None:
        self.storage = storage
        self.reads: set[Buffer] = set()
        self.writes: set[Buffer] = set()

    def read(self, n: Node) -> None:
        buf = self.storage[n].buffer
        if isinstance(buf, Buffer):
            self.reads.add(buf)

    def write(self, buf: Buffer) -> None:
        self.writes.add(buf)

    def params(self) -> list[Buffer]:
        return sorted(self.reads | self.writes, key=Buffer.sort_key)

    def signature(self, name: str, threads: int) -> str:
        decls = []
        for buf in self.params():
            ctype = CTYPE[buf.dtype]
            decls.append(
                f"{ctype}* __restrict__ {buf.name}"
                if buf in self.writes
                else f"const {ctype}* __restrict__ {buf.name}"
            )
        return f'extern "C" __global__ void __launch_bounds__({threads}) {name}({", ".join(decls)})'


class Lowering:
    def __init__(
        self,
        kg: KernelGraph,
        targets: tuple[str, ...],
        library: bool | None = None,
        constants: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        self.kg = kg
        self.computed: dict[int, IndexMask] = computed_inputs(kg, constants)
        """Inputs whose constant values are an index predicate (indexmask.py): every read
        computes them from coordinates; they stay in the plan's inputs but no kernel reads them."""
        self.selections: dict[int, Selection] = known_selections(kg, constants)
        """Inputs whose constant values are a selection (selection.py): a sum selecting with
        them reads the selected element; a kernel that reads them otherwise loads them."""
        self.targets = targets
        self.library = knobs().library_gemm if library is None else library
        """Lower matmuls to library GEMMs where libgemm allows (MLSO_LIBRARY_GEMM=0: never)."""
        self.library_roots: dict[Node, list[Node]] = {}
        """Matmuls lowered to library GEMMs -> the values staged for them (codegen/plan.py)."""
        self.epilogues: set[Node] = set()
        """Values a library GEMM's epilogue computes (libgemm.epilogue): no kernel of their own."""
        self.storage: dict[Node, Storage] = {}
        self.inputs: list[Buffer] = []
        self.outputs: list[Buffer] = []
        self.scratch: list[Buffer] = []
        self.kernels: list[Launch] = []
        self.decided: KernelRoots = kernel_roots(kg)
        """Which nodes become kernels, in which order (decided before anything is printed)."""
        self.stab = dict(self.decided.stab)
        self.order = list(self.decided.order)
        self.consumers = self.decided.consumers
        self.row_readers = {p.reader: p for p in self.decided.rows.values()}
        self.deferred: dict[Node, RowPair] = {}
        """Row-pair reductions stored but not yet computed: their reader's kernel will."""

    # ---- storage -----------------------------------------------------------------------------
    def _store(self, n: Node, buf: Buffer) -> Storage:
        # a target saved through views (roots.through_views) has its own dims and strides
        strides = self.decided.target_strides.get(n)
        shape = buf.shape if strides is None else n.shape
        st = Storage(buf.name, buf.dtype, shape, strides or contiguous(shape), buffer=buf)
        self.storage[n] = st
        return st

    def scratch_storage(self, n: Node, dtype: DType = DType.F32) -> Storage:
        if n not in self.storage:
            buf = Buffer("scratch", len(self.scratch), dtype, n.shape)
            self.scratch.append(buf)
            self._store(n, buf)
        return self.storage[n]

    def _scratch_dtype(self, root: Node) -> DType:
        """fp32, except with library GEMMs a GEMM's C and a value only GEMMs read as an operand
        (libgemm.scratch_dtype: their 16-bit dtype)."""
        if self.library:
            return scratch_dtype(root, self.consumers, self.stab)
        return DType.F32

    def _generated_c(self, root: Node) -> None:
        """A matmul that stays generated keeps fp32 scratch for C (the scale it may carry, and
        the rounding the generated kernel always had): 16-bit scratch given for a library GEMM
        that was then refused is given back."""
        st = self.storage[root]
        buf = st.buffer
        if not (isinstance(buf, Buffer) and buf.kind == "scratch" and st.dtype is not DType.F32):
            return
        assert self.scratch and self.scratch[-1] is buf, "a refused GEMM appended nothing"
        self.scratch.pop()
        del self.storage[root]
        self.scratch_storage(root)

    def uses(self) -> Uses:
        return Uses(self.storage)

    def emitter(self, uses: Uses, names, flat=None) -> Emitter:
        return Emitter(self.storage, self.stab, names, uses.read, flat)

    def kernel_name(self) -> str:
        return f"mlso_k{len(self.kernels)}"

    # ---- row pairs (rowfuse.py) ---------------------------------------------------------------
    def _defer(self, root: Node) -> bool:
        """Whether reduction `root` waits for its reader's kernel (rowkernel.py): always for an
        elementwise reader, for a matmul's operand only if the matmul may be a library GEMM."""
        pair = self.decided.rows.get(root)
        if pair is None or not pair.holds(self.library):
            return False
        self.deferred[root] = pair
        if pair.chain:  # the scale its row kernel will store it with, for the launches before
            self.storage[root].scale = row_scale(
                self.emitter(self.uses(), Names()), self.storage[root], root
            )
        return True

    def _row_kernel(self, pair: RowPair, value: Node) -> Kernel:
        """The row kernel of a pair whose reductions were all deferred."""
        for r in pair.reductions:
            self.deferred.pop(r)
        return emit_row(self, pair.reductions, value)

    def flush_deferred(self, reader: Node) -> None:
        """Launch, each alone and in order, the deferred reductions that `reader`'s kernel was to
        compute but did not (a library GEMM that staged no operand for them, or a matmul that
        stays generated); a chain's inlined values are then recomputed where they are read."""
        for reduce in [r for r, p in self.deferred.items() if p.reader is reader]:
            self.deferred.pop(reduce)
            self.storage[reduce].scale = None  # emit_reduce decides it afresh
            self.kernels.append(emit_reduce(self, reduce))

    def stage_kernel(self, matmul: Node, operand: int, node: Node) -> Kernel:
        """The kernel staging operand `operand` of library GEMM `matmul` into `node`: with the
        reductions it reads row by row when they are a row pair, else an elementwise kernel."""
        for pair in self.deferred.values():
            if pair.reader is matmul and pair.operand == operand:
                return self._row_kernel(pair, node)
        return emit_elementwise(self, node)

    # ---- driver ------------------------------------------------------------------------------
    def generate(self) -> GeneratedProgram:
        for i, n in enumerate(self.kg.inputs):
            buf = Buffer("input", i, n.dtype, n.shape)
            self.inputs.append(buf)
            mask = self.computed.get(i)
            if mask is None:
                self._store(n, buf).selection = self.selections.get(i)
            else:  # no buffer: Uses never makes it a kernel parameter
                self.storage[n] = Storage(
                    buf.name, n.dtype, n.shape, contiguous(n.shape), computed=mask
                )
        for k, n in enumerate(self.decided.targets):
            buf = Buffer("output", k, self.kg.outputs[k].dtype, self.kg.outputs[k].shape)
            self.outputs.append(buf)
            self._store(n, buf)
        for group in self.decided.launches:
            if len(group) > 1:  # sibling elementwise kernels: one launch (siblings.py)
                for root in group:
                    self.scratch_storage(root, self._scratch_dtype(root))
                self.kernels.append(emit_siblings(self, group))
                continue
            (root,) = group
            if root in self.epilogues:
                continue
            if root.op is not Op.GRAPH_DEF:
                self.scratch_storage(root, self._scratch_dtype(root))
            if self._defer(root):
                continue
            pair = self.row_readers.get(root)
            if pair is not None and pair.operand is None:
                self.kernels.append(self._row_kernel(pair, root))
                continue
            if root.op is Op.MATMUL and self.library and library_matmul(self, root):
                continue
            if root.op is Op.MATMUL:
                self._generated_c(root)
            self.flush_deferred(root)  # a matmul that stays generated stages nothing
            emit = KERNEL_EMITTERS.get(root.op, emit_elementwise)
            self.kernels.append(emit(self, root))
        assert not self.deferred, "every deferred reduction is computed by some kernel"
        source = self._source()
        plan = build_plan(self.targets, self.inputs, self.outputs, self.scratch, self.kernels)
        names = [k.name for k in self.kernels if isinstance(k, Kernel)]
        return GeneratedProgram(source, plan, names, self.kernels)

    def _source(self) -> str:
        head = [
            "// Generated by mlso codegen: do not edit.",
            f"// uGraph sha256 {graph_hash(self.kg)}; targets {', '.join(self.targets)}",
            *(
                f"// input {i} ({self.kg.input_names[i]}) is computed, not read: "
                f"{m.describe()} (indexmask.py)"
                for i, m in sorted(self.computed.items())
            ),
            *(
                f"// input {i} ({self.kg.input_names[i]}) is a constant selection "
                f"(sha256 {sel.digest[:16]}): sums over it read the selected element (selection.py)"
                for i, sel in sorted(self.selections.items())
            ),
            '#include "mlso.cuh"',
            "",
        ]
        body = []
        for k in self.kernels:
            if isinstance(k, GemmLaunch):
                body.append(f"// {k.name}: {k.what} (no code: a cuBLASLt call in the plan)")
                continue
            body.append(
                f"// {k.name}: {k.what}; grid {list(k.grid)}, block {list(k.block)}, smem {k.smem} B"
            )
            body.append(k.source)
        return "\n".join(head + body)


KERNEL_EMITTERS: dict[Op, Callable[[Lowering, Node], Kernel]] = {
    Op.MATMUL: emit_matmul,
    Op.REDUCE_SUM: emit_reduce,
    Op.REDUCE_MEAN: emit_reduce,
    Op.REDUCE_MAX: emit_reduce,
    Op.GRAPH_DEF: emit_graph_def,
}
"""Root op -> kernel emitter; elementwise and view roots (and output copies) use emit_elementwise."""
assert set(KERNEL_EMITTERS) == set(KIND), "every kernel kind the plan reports has an emitter"
