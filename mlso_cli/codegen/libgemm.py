"""Library GEMMs: which kernel-level matmuls run as a cuBLASLt call instead of generated code.

Why: codegen's stand-alone matmul (kernels.py::emit_matmul, `mlso::gemm_mma_64x64`) is several
times slower than cuBLAS at real model widths, so any unfused program with a matmul lost to ONNX
Runtime, whose MatMul nodes are cuBLAS calls. As in Mirage, a kernel-graph matmul is a library
call: a region's baseline program is library GEMMs plus generated kernels for everything else,
and generated fused kernels (graph-defined kernels) compete with it. The IR op is unchanged;
only its lowering differs, so the verifier and the search treat it as the matmul it is.

The rules (a table of conditions, checked in `library_matmul`):
  - A and B have one dtype, fp16, bf16 or fp32 (`LIBRARY_TYPES`); fp32 runs in plain fp32 (no
    TF32), as ONNX Runtime's fp32 MatMul does. C is fp32 scratch, or the output buffer in the
    operands' dtype or fp32. C's scratch is the matmul's own 16-bit dtype unless a softmax's
    numerator reads it (`c_dtype`).
  - No operand is a scaled value (kept relative to a running max, scale.py): the library reads
    plain numbers, and materialising a scaled softmax numerator could overflow where the
    generated kernel, which carries the scale into C, does not. Such matmuls stay generated.
  - An operand that is a plain strided view (views.py) of a stored tensor of its own dtype, with
    one unit-stride axis among its last two and a batch expressible as one count and one stride
    (0 for a broadcast operand), is read in place. Anything else (an elementwise chain such as
    RMSNorm then Cast, a dtype change, a view that is not one stride per batch) is first
    materialised by a generated elementwise kernel into scratch of the operand's own dtype, which
    rounds exactly where ONNX Runtime's node boundary rounds (and where the interpreter's
    "as codegen computes" mode rounds a kernel-level matmul operand).
  - Bias epilogue (`epilogue`): when the matmul's one reader is an ADD of a vector that varies
    along the last axis only (a Linear's bias: ONNX MatMul + Add, or Gemm with C), stored as a
    program input in C's dtype and read in place, the GEMM adds it inside the call (cuBLASLt's
    CUBLASLT_EPILOGUE_BIAS) and writes the ADD's value: the ADD gets the GEMM's C as its storage
    and no kernel of its own (Lowering.epilogues), and a kernel that inlined it reads C instead.
    The rounding is the one generated code already had: the bias meets the fp32 product and
    the sum is rounded once to C's type (fp32 scratch, or an output in its dtype), as the
    add's kernel did from fp32 scratch. ONNX Runtime rounds the MatMul's result to its dtype
    before its Add; the verifier checks the IR (matmul then add), against the original nodes
    within their own error, as for every program. Only a bias already in C's dtype qualifies
    (cuBLASLt reads it in D's type): a 16-bit bias feeding fp32 scratch (scores a softmax reads,
    `c_dtype`) would need a staging launch that costs what the epilogue saves, so it stays an
    inlined add; with 16-bit scratch C it qualifies. Activation epilogues
    are not used: cublasLt.h does not say whether its GELU epilogue is the tanh or the erf form,
    and an erf-GELU graph must not get a tanh one (nor the reverse).
  - Residual epilogue (`epilogue` too): when that ADD's other operand is instead a full matrix of
    the matmul's shape (a residual: a decoder's o_proj or down projection + the residual stream),
    stored as a program input in exactly C's dtype and read in place as a row-major strided
    matrix (unit stride along the last axis, a leading dimension of at least n, one batch stride),
    the GEMM computes D = A @ B + R in one call: cuBLASLt's matmul with beta = 1, its C being R
    (a layout of its own) and its D the ADD's storage, which gets no kernel, as for the bias.
    Rounding as for the bias: R meets the fp32 product (cublasLt.h: C is converted to the scale
    type, fp32, before the final scaling) and the sum is rounded once to D's type, where ONNX
    Runtime rounds the MatMul's result before its Add. Refused (the ADD stays an add): a residual
    stored transposed or with strided columns (cublasLt.h: TRANSC supports only CUBLAS_OP_N), one
    in another dtype than C (a 16-bit residual with fp32 scratch C among them), one that is not a
    program input (a computed value may not be written yet when the GEMM runs), one broadcast
    across rows (no leading dimension; a row vector is the bias case) or across the batch
    (cublasLt.h says nothing of a C batch stride of 0, so none is relied on). One epilogue per
    GEMM: the matmul's one reader is the ADD that decides it, so matmul -> add bias -> add
    residual takes the bias, and the residual stays an add. Why not both in one call: cublasLt.h
    does not say whether CUBLASLT_EPILOGUE_BIAS may be combined with beta != 0, nor in which order
    the bias and beta * C meet the product, so the plan validators refuse a launch with both.
`MLSO_LIBRARY_GEMM=0` turns the library off (every matmul generated, as before).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING

from mlso_cli.codegen.cfmt import Names, contiguous, decompose, numel
from mlso_cli.codegen.program import Buffer, GemmBias, GemmLaunch, GemmOperand, GemmResidual
from mlso_cli.codegen.scale import Storage
from mlso_cli.codegen.stabilise import consumers_of, stabilisers
from mlso_cli.codegen.synthetic import stage
from mlso_cli.codegen.views import Strided, strided
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import REDUCE, DType, Op

if TYPE_CHECKING:
    from mlso_cli.codegen.lower import Lowering

LIBRARY_TYPES = frozenset({DType.F16, DType.BF16, DType.F32})
"""Operand dtypes cuBLASLt multiplies for us (with fp32 accumulation)."""


def eligible(root: Node) -> bool:
    """The dtype rules alone: what codegen/plan.py and the cost model can decide without storage."""
    a, b = root.src
    return root.op is Op.MATMUL and a.dtype == b.dtype and a.dtype in LIBRARY_TYPES


SIXTEEN_BIT = frozenset({DType.F16, DType.BF16})


def c_dtype(
    root: Node, consumers: Mapping[Node, Sequence[Node]], stab: Mapping[Node, Node]
) -> DType:
    """The dtype of library GEMM `root`'s C when it is scratch: the matmul's own 16-bit dtype,
    unless a stabilised EXP (a softmax's numerator) reads it through anything but another matmul,
    then fp32. Why: C is rounded where ONNX Runtime rounds the MatMul's output, and its readers
    (RoPE, SiLU * mul, a norm) load half the bytes; the GEMM writes half. Logits keep fp32: a
    logit of 100 in fp16 is off by up to 0.03, which exp turns into 3% (the reason every other
    scratch is fp32). A path through another matmul is not followed: that matmul reads its
    operand in 16 bits anyway (staged or in place), so the rounding happens there regardless."""
    a = root.src[0] if root.src else None
    if not eligible(root) or root.dtype not in SIXTEEN_BIT or a is None or a.dtype != root.dtype:
        return DType.F32
    seen: set[Node] = set()
    stack = list(consumers.get(root, ()))
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in stab:
            return DType.F32
        if n.op is not Op.MATMUL:
            stack.extend(consumers.get(n, ()))
    return root.dtype


VIEWS = frozenset({Op.RESHAPE, Op.TRANSPOSE, Op.BROADCAST})


def operand_only(n: Node, consumers: Mapping[Node, Sequence[Node]]) -> bool:
    """Whether every reader of n is a library-eligible matmul reading it, through views only, as
    an operand of n's own dtype."""
    readers = list(consumers.get(n, ()))
    if not readers:
        return False
    seen: set[Node] = set()
    while readers:
        r = readers.pop()
        if r in seen:
            continue
        seen.add(r)
        if r.op in VIEWS and r.dtype == n.dtype:
            more = consumers.get(r, ())
            if not more:
                return False
            readers.extend(more)
        elif r.op is not Op.MATMUL or not eligible(r) or r.src[0].dtype != n.dtype:
            return False
    return True


def from_softmax(n: Node, stab: Mapping[Node, Node]) -> bool:
    """Whether a stabilised EXP is among n's transitive sources: its value may be kept relative
    to a row max, which 16-bit storage of the plain number cannot hold, and whether a matmul's
    operand still is (so that it stays generated) only the emitter knows (codegen/plan.py)."""
    seen: set[Node] = set()
    stack = list(n.src)
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        if x in stab:
            return True
        stack.extend(x.src)
    return False


def scratch_dtype(
    n: Node, consumers: Mapping[Node, Sequence[Node]], stab: Mapping[Node, Node]
) -> DType:
    """The dtype of root n's scratch when library GEMMs are on: a matmul's C by `c_dtype`; a
    16-bit elementwise value that only library GEMMs read as an operand in its own dtype is kept
    in that dtype, so the GEMMs read it in place instead of each staging a rounded copy (a norm
    feeding q, k and v projections: one kernel and three GEMMs, not four kernels and three
    GEMMs), the rounding being the one each staging made; everything else fp32."""
    if n.op is Op.MATMUL:
        return c_dtype(n, consumers, stab)
    if (
        n.dtype in SIXTEEN_BIT
        and n.op not in (Op.GRAPH_DEF, Op.PROJ, *REDUCE)
        and n not in stab.values()
        and operand_only(n, consumers)
        and not from_softmax(n, stab)
    ):
        return n.dtype
    return DType.F32


def library_matmul(lw: Lowering, root: Node) -> bool:
    """Append the launches computing matmul `root` with the library (operand stagings, then the
    GEMM) to lw.kernels and return True, or return False (nothing appended) when it must stay a
    generated kernel. root's storage is already assigned."""
    if not eligible(root):
        return False
    a, b = root.src
    out = lw.storage[root]
    if out.dtype not in (a.dtype, DType.F32) or out.scale is not None:
        return False
    for x in (a, b):
        tokens = decompose("e", x.shape)
        if lw.emitter(lw.uses(), Names()).value(x, tokens).scale is not None:
            return False
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    bshape = root.shape[:-2]
    batch = numel(bshape)
    c_layout = _c_layout(out, root)
    if c_layout is None:
        return False
    ep = epilogue(lw, root, out)
    if ep is not None:
        add, addend, out = ep
        if add in lw.storage and lw.scratch and lw.scratch[-1] is lw.storage[root].buffer:
            lw.scratch.pop()  # C is the ADD's output: the matmul's own scratch goes unused
            del lw.storage[root]
        lw.storage[add] = out
        lw.epilogues.add(add)
    operands = []
    staged: list[Node] = []
    for i, x in enumerate((a, b)):
        op = _in_place(lw, x, bshape)
        if op is None:
            staged.append(staged_value(x, bshape))
            node = stage(staged[-1], len(lw.scratch))  # serial: unique here
            lw.scratch_storage(node, x.dtype)
            lw.kernels.append(lw.stage_kernel(root, i, node))
            op = _in_place(lw, node, bshape)
            assert op is not None, "a staged operand is contiguous"
        operands.append(op)
    c = GemmOperand(out.buffer, 0, *c_layout, False)
    bias = ep[1] if ep is not None and isinstance(ep[1], GemmBias) else None
    residual = ep[1] if ep is not None and isinstance(ep[1], GemmResidual) else None
    what = (
        f"library GEMM {list(a.shape)} x {list(b.shape)}"
        + (" + bias" if bias is not None else "")
        + (" + residual" if residual is not None else "")
        + f" -> {out.dtype.value} ({a.dtype.value}, cuBLASLt)"
    )
    lw.library_roots[root] = staged
    lw.flush_deferred(root)  # a row pair whose operand was read in place after all
    lw.kernels.append(
        GemmLaunch(
            lw.kernel_name(),
            m,
            n,
            k,
            batch,
            operands[0],
            operands[1],
            c,
            a.dtype,
            out.dtype,
            what,
            bias,
            residual,
        )
    )
    return True


def epilogue_add(
    root: Node, consumers: Mapping[Node, list[Node]], outputs: frozenset[Node] | set[Node]
) -> tuple[Node, Node] | None:
    """(add, other operand) when matmul root's only reader is an ADD of root's own shape and
    dtype, root not a program output: the structure a bias or residual epilogue needs (the other
    operand itself is checked against storage by `epilogue`). Why one reader: the GEMM then
    writes the sum, so nothing may still need the product alone."""
    users = consumers.get(root, [])
    if root in outputs or len(users) != 1:
        return None
    (add,) = users
    if add.op is not Op.ADD or add.shape != root.shape or add.dtype != root.dtype:
        return None
    bias = add.src[1] if add.src[0] is root else add.src[0]
    return None if bias is root else (add, bias)


def _input_view(
    storage: Mapping[Node, Storage], x: Node, dtype: DType
) -> tuple[Buffer, Strided] | None:
    """x as a plain view (no cast) of a program input stored unscaled in `dtype`: the buffer and
    the view, or None. What an epilogue's addend must be (see `bias_operand`)."""
    view = strided(x, storage)
    if view is None or not _leaf_plain(x, view.leaf):
        return None
    st = storage[view.leaf]
    buf = st.buffer
    if not isinstance(buf, Buffer) or buf.kind != "input" or st.scale is not None:
        return None
    if st.dtype != dtype or view.leaf.dtype != dtype:
        return None
    return buf, view


def bias_operand(storage: Mapping[Node, Storage], bias: Node, dtype: DType) -> GemmBias | None:
    """bias read in place as a cuBLASLt bias vector: a view (no cast) of a program input of
    `dtype`, contiguous along the last axis and broadcast (stride 0) over every other, or None.
    Why an input: the GEMM runs at the matmul's place in the schedule, which orders it after the
    producers of A and B only; a bias computed by another kernel might not be written yet."""
    got = _input_view(storage, bias, dtype)
    if got is None:
        return None
    buf, view = got
    *lead, last = view.strides
    if last != 1 and bias.shape[-1] != 1:
        return None
    if any(s != 0 and d > 1 for s, d in zip(lead, bias.shape[:-1], strict=True)):
        return None
    return GemmBias(buf, view.base)


def residual_operand(storage: Mapping[Node, Storage], r: Node, dtype: DType) -> GemmResidual | None:
    """r read in place as cuBLASLt's C (beta = 1): a view (no cast) of a program input of `dtype`,
    row-major (unit stride along the last axis: cuBLASLt's C is never transposed), rows `ld >= n`
    elements apart, batch entries one nonzero stride apart (module docstring), or None. Why an
    input: as for the bias (`bias_operand`)."""
    got = _input_view(storage, r, dtype)
    if got is None:
        return None
    buf, view = got
    rows, cols = r.shape[-2], r.shape[-1]
    sr, sc = view.strides[-2], view.strides[-1]
    if sc != 1 and cols > 1:
        return None
    ld = sr if rows > 1 else cols
    if ld < max(cols, 1):
        return None
    bshape = r.shape[:-2]
    stride = _batch_stride(bshape, view.strides[:-2], bshape)
    if stride is None or (stride == 0 and numel(bshape) > 1):
        return None
    return GemmResidual(buf, view.base, ld, stride)


def addend_operand(
    storage: Mapping[Node, Storage], addend: Node, dtype: DType
) -> GemmBias | GemmResidual | None:
    """What the GEMM adds for its reader's other operand `addend`: a bias vector, else a
    residual matrix, else None (the ADD stays an add)."""
    return bias_operand(storage, addend, dtype) or residual_operand(storage, addend, dtype)


def epilogue(
    lw: Lowering, root: Node, out: Storage
) -> tuple[Node, GemmBias | GemmResidual, Storage] | None:
    """(add, bias or residual, C's storage) when library GEMM `root` takes its reader's other
    operand as an epilogue (module docstring), else None. C is the ADD's output buffer when the
    ADD is a program output already given one, else root's fp32 scratch, which then also stores
    the ADD's value."""
    ep = epilogue_add(root, lw.consumers, frozenset(lw.kg.outputs))
    if ep is None:
        return None
    add, addend = ep
    c = lw.storage.get(add, out)
    if c.scale is not None or not isinstance(c.buffer, Buffer):
        return None
    if c.dtype not in (root.src[0].dtype, DType.F32):
        return None
    operand = addend_operand(lw.storage, addend, c.dtype)
    if operand is None:
        return None
    return add, operand, c


def epilogue_adds(kg_nodes: list[Node], inputs: list[Node], outputs: list[Node]) -> set[Node]:
    """The ADDs that library GEMMs compute as bias or residual epilogues, decided without lowering
    (for the cost model): C in an output's dtype when the ADD is an output read by nothing else,
    else scratch in `c_dtype`; inputs stored contiguously."""
    consumers = consumers_of(kg_nodes)
    stab = stabilisers(kg_nodes, consumers)
    storage: dict[Node, Storage] = {}
    for i, n in enumerate(inputs):
        buf = Buffer("input", i, n.dtype, n.shape)
        storage[n] = Storage(buf.name, n.dtype, n.shape, contiguous(n.shape), buffer=buf)
    found: set[Node] = set()
    outs = frozenset(outputs)
    for n in kg_nodes:
        if n.op is not Op.MATMUL or not eligible(n):
            continue
        ep = epilogue_add(n, consumers, outs)
        if ep is None:
            continue
        add, addend = ep
        dtype = add.dtype if add in outs and not consumers.get(add) else c_dtype(n, consumers, stab)
        if dtype in (n.src[0].dtype, DType.F32) and addend_operand(storage, addend, dtype):
            found.add(add)
    return found


def staged_value(x: Node, bshape: tuple[int, ...]) -> Node:
    """What a staging kernel writes for operand x: x itself, or, when x's batch broadcast is not
    one stride even stored contiguously ((2, 1) against (3,)), x broadcast to the whole batch."""
    if _batch_stride(x.shape[:-2], contiguous(x.shape)[:-2], bshape) is not None:
        return x
    full = bshape + x.shape[-2:]
    return Node(Op.BROADCAST, (x,), full, full, x.dtype)


def stagings(storage: Mapping[Node, Storage], root: Node) -> list[Node]:
    """The values codegen stages before library GEMM `root`, given where tensors are stored
    (codegen/plan.py passes a sketch of generate's storage; scaled operands are not seen)."""
    view = SimpleNamespace(storage=storage)
    bshape = root.shape[:-2]
    return [staged_value(x, bshape) for x in root.src if _in_place(view, x, bshape) is None]


def _leaf_plain(x: Node, leaf: Node) -> bool:
    """x reaches leaf through views only (no CAST: the library reads the stored bits as x's)."""
    n = x
    while n is not leaf:
        if n.op not in (Op.RESHAPE, Op.TRANSPOSE, Op.BROADCAST):
            return False
        n = n.src[0]
    return True


def _in_place(
    lw: Lowering | SimpleNamespace, x: Node, bshape: tuple[int, ...]
) -> GemmOperand | None:
    """x read in place by the library, or None when it must be staged first."""
    view = strided(x, lw.storage)
    if view is None or not _leaf_plain(x, view.leaf):
        return None
    st = lw.storage[view.leaf]
    if not isinstance(st.buffer, Buffer) or st.dtype != x.dtype or st.scale is not None:
        return None
    if view.leaf.dtype != x.dtype:
        return None
    rows, cols = x.shape[-2], x.shape[-1]
    sr, sc = view.strides[-2], view.strides[-1]
    if sc == 1 or cols == 1:
        trans, ld = False, sr if rows > 1 else cols
        if ld < max(cols, 1):
            return None
    elif sr == 1 or rows == 1:
        trans, ld = True, sc
        if ld < max(rows, 1):
            return None
    else:
        return None
    stride = _batch_stride(x.shape[:-2], view.strides[:-2], bshape)
    if stride is None:
        return None
    return GemmOperand(st.buffer, view.base, ld, stride, trans)


def _c_layout(out: Storage, root: Node) -> tuple[int, int] | None:
    """(ld, batch stride) of C in its storage: contiguous, or an output saved through views
    (roots.through_views: a [b, h, s, d] product handed on as [b, s, h * d]) when its rows are
    unit-stride and its batch one stride; None (a generated kernel writes it) otherwise."""
    m, n = root.shape[-2:]
    bshape = root.shape[:-2]
    if out.strides == contiguous(root.shape):
        return n, m * n if numel(bshape) > 1 else 0
    *lead, ld, unit = out.strides
    if unit != 1 and n > 1:
        return None
    stride = _batch_stride(bshape, tuple(lead), bshape)
    return None if stride is None else (ld, stride)


def _batch_stride(
    xb: tuple[int, ...], strides: tuple[int, ...], bshape: tuple[int, ...]
) -> int | None:
    """One stride for the flattened batch index of `bshape` over an operand with batch dims `xb`
    (right-aligned, broadcast where 1 or missing), or None when no single stride fits."""
    lead = len(bshape) - len(xb)
    per = [0 if i < lead or xb[i - lead] == 1 else strides[i - lead] for i in range(len(bshape))]
    weights = [numel(bshape[i + 1 :]) for i in range(len(bshape))]
    live = [i for i, d in enumerate(bshape) if d > 1]
    if not live:
        return 0
    inner = live[-1]
    if per[inner] % weights[inner]:
        return None
    s = per[inner] // weights[inner]
    if any(per[i] != s * weights[i] for i in live):
        return None
    return s
