"""Kernel-graph lowering: which nodes become kernels, where tensors live, in which order.

Rules (thread graphs are built by rules, not search):
  - MATMUL, REDUCE_*, GRAPH_DEF and the row maxima of stabilised EXPs are kernels ("roots").
  - Views never launch: consumers index through them.
  - An elementwise op is inlined into the one kernel that uses it (into an elementwise chain,
    a matmul's operand loader, a reduction's loop or a graph-defined kernel's tile loader);
    it becomes a kernel of its own when several kernels need it or when it is a graph output.
  - Graph outputs live in output buffers; everything else a kernel writes is fp32 scratch
    (fp16 intermediates would round logits of 100 by 0.03, ruining exp), except a library
    GEMM's staged operand, which is scratch of the operand's own 16-bit dtype.
  - A MATMUL root becomes a library GEMM (cuBLASLt) whenever libgemm.library_matmul allows it,
    else a generated kernel.
Kernels are emitted in dependency order by the table KERNEL_EMITTERS (op -> emitter).
"""

from __future__ import annotations

from collections.abc import Callable

from mlso_cli.codegen import synthetic
from mlso_cli.codegen.block import emit_graph_def
from mlso_cli.codegen.cfmt import CTYPE, Coords, contiguous
from mlso_cli.codegen.emitter import Emitter
from mlso_cli.codegen.errors import CodegenError
from mlso_cli.codegen.kernels import emit_elementwise, emit_matmul, emit_reduce
from mlso_cli.codegen.libgemm import library_matmul
from mlso_cli.codegen.program import (
    Buffer,
    GemmLaunch,
    GeneratedProgram,
    Kernel,
    Launch,
    build_plan,
)
from mlso_cli.codegen.scale import Storage, Val, structural
from mlso_cli.codegen.schedule import schedule
from mlso_cli.codegen.stabilise import consumers_of, stabilisers
from mlso_cli.ir.graph import KernelGraph
from mlso_cli.ir.hashing import graph_hash
from mlso_cli.ir.node import Node, toposort
from mlso_cli.ir.ops import REDUCE, VIEW, DType, Op
from mlso_cli.knobs import knobs

ROOT_OPS = frozenset({Op.MATMUL, Op.GRAPH_DEF}) | REDUCE
INT_LIMIT = 2**31 - 1
INLINE_REDUCE_MAX_LEN = 64
"""Reductions over a strided axis up to this long are evaluated inside their one elementwise
consumer (a loop per element) instead of as a kernel of their own: the split-KV combine."""


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
        self, kg: KernelGraph, targets: tuple[str, ...], library: bool | None = None
    ) -> None:
        self.kg = kg
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
        nodes = kg.nodes()
        self.stab = stabilisers(nodes, consumers_of(nodes))
        self.order = toposort(list(kg.outputs) + list(self.stab.values()))
        self.consumers = consumers_of(self.order)
        for n in self.order:
            if n.numel > INT_LIMIT:
                raise CodegenError(
                    f"{n.op.value}{list(n.shape)} has more than 2^31-1 elements",
                    "Split the region: kernels index with 32-bit integers.",
                )

    # ---- storage -----------------------------------------------------------------------------
    def _store(self, n: Node, buf: Buffer) -> Storage:
        st = Storage(buf.name, buf.dtype, buf.shape, contiguous(buf.shape), buffer=buf)
        self.storage[n] = st
        return st

    def scratch_storage(self, n: Node, dtype: DType = DType.F32) -> Storage:
        if n not in self.storage:
            buf = Buffer("scratch", len(self.scratch), dtype, n.shape)
            self.scratch.append(buf)
            self._store(n, buf)
        return self.storage[n]

    def uses(self) -> Uses:
        return Uses(self.storage)

    def emitter(self, uses: Uses, names, flat=None) -> Emitter:
        return Emitter(self.storage, self.stab, names, uses.read, flat)

    def stored_code(self, em: Emitter, root: Node, v: Val, tokens: Coords) -> str:
        """What to store for root at `tokens`: the scaled number when root is fp32 scratch and its
        scale has a simple layout (root's storage records the scale), else the exact value."""
        st = self.storage[root]
        if (
            v.scale is not None
            and isinstance(st.buffer, Buffer)
            and st.buffer.kind == "scratch"
            and st.dtype is DType.F32
        ):
            bs = structural(v.scale, tokens)
            if bs is not None:
                st.scale = bs
                return v.code
        return em.materialise(v)

    def kernel_name(self) -> str:
        return f"mlso_k{len(self.kernels)}"

    # ---- roots -------------------------------------------------------------------------------
    def _roots(self) -> tuple[set[Node], list[Node]]:
        """(root set, output targets): which nodes get kernels, and what each output slot holds."""
        roots: set[Node] = {n for n in self.order if n.op in (Op.MATMUL, Op.GRAPH_DEF)} | set(
            self.stab.values()
        )
        outs = set(self.kg.outputs)
        users: dict[Node, set[Node]] = {}
        for n in reversed(self.order):
            if n.op in (Op.INPUT, Op.CONST, Op.PROJ) or n in roots:
                continue
            u: set[Node] = set()
            for c in self.consumers.get(n, []):
                u |= {c} if c in roots else users.get(c, set())
            if n.op in REDUCE:
                if n in outs or not self._inline_reduce(n, u):
                    roots.add(n)
                else:
                    users[n] = u
            elif n in outs or (n.op not in VIEW and len(u) > 1):
                roots.add(n)
            else:
                users[n] = u
        targets: list[Node] = []
        taken: set[Node] = set()
        taken_proj: set[tuple[Node, int]] = set()
        for k, n in enumerate(self.kg.outputs):
            key = (n.src[0], n.arg) if n.op is Op.PROJ else None
            # An output that other kernels also read goes out through a copy: the node keeps fp32
            # scratch that may stay scaled (a split-KV partial, a softmax numerator), and only the
            # copy materialises the exact value, which may overflow where the result does not.
            used = any(c is not n for c in self.consumers.get(n, []))
            if n.op is Op.INPUT or n in taken or (key is not None and key in taken_proj) or used:
                n = synthetic.copy(n, k)
                roots.add(n)
            taken.add(n)
            if key is not None:
                taken_proj.add(key)
            targets.append(n)
        return roots, targets

    @staticmethod
    def _inline_reduce(n: Node, users: set[Node]) -> bool:
        """A reduction over a short strided axis with one elementwise kernel using it."""
        x = n.src[0]
        strided_axis = any(d > 1 for d in x.shape[n.arg + 1 :])
        if not strided_axis or x.shape[n.arg] > INLINE_REDUCE_MAX_LEN or len(users) != 1:
            return False
        (user,) = users
        return user.op not in ROOT_OPS

    def _deps(self, root: Node, roots: set[Node]) -> list[Node]:
        out: list[Node] = []
        seen: set[Node] = set()

        def walk(s: Node) -> None:
            if s.op in (Op.INPUT, Op.CONST) or s in seen:
                return
            seen.add(s)
            if s in roots:
                out.append(s)
            elif s.op is Op.PROJ:
                out.append(s.src[0])
            else:
                if s in self.stab:
                    out.append(self.stab[s])
                for t in s.src:
                    walk(t)

        if root.op is Op.PROJ:
            return [root.src[0]]
        if root in self.stab:
            out.append(self.stab[root])
        for s in root.src:
            walk(s)
        return out

    def _schedule(self, roots: set[Node], targets: list[Node]) -> list[Node]:
        return schedule(targets, lambda n: self._deps(n, roots), keep=lambda n: n in roots)

    # ---- driver ------------------------------------------------------------------------------
    def generate(self) -> GeneratedProgram:
        for i, n in enumerate(self.kg.inputs):
            buf = Buffer("input", i, n.dtype, n.shape)
            self.inputs.append(buf)
            self._store(n, buf)
        roots, targets = self._roots()
        for k, n in enumerate(targets):
            buf = Buffer("output", k, self.kg.outputs[k].dtype, self.kg.outputs[k].shape)
            self.outputs.append(buf)
            self._store(n, buf)
        schedule = self._schedule(roots, targets)
        for root in schedule:
            if root in self.epilogues:
                continue
            if root.op is not Op.GRAPH_DEF:
                self.scratch_storage(root)
            if root.op is Op.MATMUL and self.library and library_matmul(self, root):
                continue
            emit = KERNEL_EMITTERS.get(root.op, emit_elementwise)
            self.kernels.append(emit(self, root))
        source = self._source()
        plan = build_plan(self.targets, self.inputs, self.outputs, self.scratch, self.kernels)
        names = [k.name for k in self.kernels if isinstance(k, Kernel)]
        return GeneratedProgram(source, plan, names, self.kernels)

    def _source(self) -> str:
        head = [
            "// Generated by mlso codegen: do not edit.",
            f"// uGraph sha256 {graph_hash(self.kg)}; targets {', '.join(self.targets)}",
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
