"""Kernel emitters for predefined kernel-level ops: elementwise chains, reductions, matmuls.

Each emitter takes the Lowering and a root node and returns a Kernel whose source computes the
root into its storage. Operands are evaluated by the Emitter, so fused elementwise prologues,
views and scaled (running-max) values work for every kernel kind the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlso_cli.codegen import synthetic
from mlso_cli.codegen.blocklayout import SM_COUNT_HINT
from mlso_cli.codegen.cfmt import (
    CTYPE,
    Code,
    Names,
    bcast,
    c_float,
    canon,
    decompose,
    mentions,
    numel,
    offset,
)
from mlso_cli.codegen.emitter import TEAM_LANE, Flat
from mlso_cli.codegen.errors import CodegenError
from mlso_cli.codegen.program import Kernel
from mlso_cli.codegen.scale import Scale, Val, matmul_scale, structural
from mlso_cli.codegen.synthetic import Combined, Copy, RowMax, Staged
from mlso_cli.codegen.teams import LOOP_VAR, Pass, choose_mode, emit_passes
from mlso_cli.codegen.views import strided
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import REDUCE, DType, Op

if TYPE_CHECKING:
    from mlso_cli.codegen.lower import Lowering

ELEMENTWISE_THREADS = 256
REDUCE_THREADS = 256
GRID_CAP = 1 << 20
MMA_TYPES = (DType.F16, DType.BF16)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _what(n: Node) -> str:
    if isinstance(n.arg, Staged):
        return f"stage a library GEMM operand -> {n.dtype.value}{list(n.shape)}"
    if isinstance(n.arg, Copy):
        return f"copy to output {n.arg.slot} {list(n.shape)}"
    if isinstance(n.arg, RowMax):
        return f"softmax stabiliser: row max over axis {n.arg.axis} -> {list(n.shape)}"
    return f"{n.op.value} -> {n.dtype.value}{list(n.shape)}"


# ---- elementwise ------------------------------------------------------------------------------


def emit_elementwise(lw: Lowering, root: Node) -> Kernel:
    """One thread per element (grid-stride), the fused chain evaluated in registers; a team of
    lanes per element when the chain folds partials in place (`team_size`)."""
    name, names, uses = lw.kernel_name(), Names(), lw.uses()
    out = lw.storage[root]
    uses.write(out.buffer)
    n, nt = root.numel, ELEMENTWISE_THREADS
    team = team_size(n, inplace_reductions(root, lw.storage))
    tokens = decompose("i", root.shape)
    em = lw.emitter(uses, names, Flat(tokens, root.shape, "i"))
    em.team = team
    v = em.compute(root, tokens)
    val = lw.stored_code(em, root, v, tokens)
    store = f"{out.ptr}[i] = mlso::from_f32<{CTYPE[out.dtype]}>({val});"
    code = Code()
    first, stride = f"blockIdx.x * {nt} + threadIdx.x", f"gridDim.x * {nt}"
    if team > 1:
        first, stride = f"({first}) / {team}", f"gridDim.x * {nt // team}"
        store = f"if ({TEAM_LANE} == 0) {store}"
    with code.block(uses.signature(name, nt)):
        if team > 1:
            code(f"const int {TEAM_LANE} = threadIdx.x & {team - 1};")
        with code.block(f"for (int i = {first}; i < {n}; i += {stride})"):
            code.extend(em.lines)
            code(store)
    grid = (min(_ceil(n * team, nt), GRID_CAP), 1, 1)
    what = _what(root) + (f" ({team} lanes per element)" if team > 1 else "")
    return Kernel(name, code.text(), grid, (nt, 1, 1), 0, uses.params(), what)


TEAM_ITEMS = 8
"""Partials each lane of a team folds: the in-place loops are unrolled 8 times, so 8 is one
round of loads in flight per lane."""
TEAM_THREADS = SM_COUNT_HINT * 2048
"""Threads one wave of the H200 holds (2048 per SM): a team is worth its redundant element work only while
the grid is short of a wave."""


def team_size(outputs: int, lengths: list[int]) -> int:
    """Lanes per output element of an elementwise kernel whose chain folds `lengths` values in
    place at its top level: a power of two up to 32, so each lane keeps about TEAM_ITEMS of the
    shortest fold, the grid stays within one wave, and every warp's lanes leave the grid-stride
    loop together (outputs a multiple of the elements a warp holds), as the shuffles need."""
    if not lengths:
        return 1
    fits = [
        t
        for t in (2, 4, 8, 16, 32)
        if t * TEAM_ITEMS <= min(lengths)
        and outputs * t <= TEAM_THREADS
        and outputs % (32 // t) == 0
    ]
    return max(fits, default=1)


def inplace_reductions(root: Node, storage) -> list[int]:
    """Lengths of the reductions `root`'s chain evaluates in place at its top level (not nested
    in another one): what the emitter turns into loops (emitter._reduce and _combined)."""
    lengths: list[int] = []
    seen: set[Node] = set()
    stack = [root]
    while stack:
        n = stack.pop()
        if n in seen or (n in storage and n is not root):
            continue
        seen.add(n)
        if n.op in REDUCE:
            if isinstance(n.arg, Combined):
                lengths.append(n.src[0].shape[n.arg.dims[0]])
            elif isinstance(n.arg, int):
                lengths.append(n.src[0].shape[n.arg])
            continue  # what it folds is evaluated inside its loop (serial per lane)
        stack.extend(n.src)
        if n.op is Op.THREAD:
            stack.append(n.arg.body)
    return lengths


# ---- reductions ---------------------------------------------------------------------------------


def emit_reduce(lw: Lowering, root: Node) -> Kernel:
    """REDUCE_SUM / MEAN / MAX over one axis (keepdims), and the stabilisers' masked row max.

    Scaled inputs: a sum along an axis the scale does not vary over keeps the scale; a sum over
    split-KV partials (the scale varies along the axis) is the combine: M* = max of the partial
    maxima, result = sum(stored * exp(M_i - M*)) kept relative to M* (written beside it)."""
    name, names, uses = lw.kernel_name(), Names(), lw.uses()
    out = lw.storage[root]
    uses.write(out.buffer)
    x = root.src[0]
    weighted = isinstance(root.arg, RowMax) and root.arg.weighted
    axis = root.arg.axis if isinstance(root.arg, RowMax) else root.arg
    length, count = x.shape[axis], root.numel
    op = "max" if root.op is Op.REDUCE_MAX else "sum"
    innermost = all(d == 1 for d in x.shape[axis + 1 :])
    mode = choose_mode(length, count, innermost, None)
    nt = REDUCE_THREADS
    tokens = decompose("o", root.shape)
    inner = list(tokens)
    inner[axis] = LOOP_VAR
    inner_t = canon(x.shape, inner)

    probe = lw.emitter(lw.uses(), Names()).value(x, inner_t).scale
    varying = probe is not None and any(mentions(c, LOOP_VAR) for c in probe.mcoords)
    passes: list[Pass] = []
    result_scale: Scale | None = None
    combine: tuple[Node, tuple[str, ...]] | None = None
    if weighted:
        em = lw.emitter(uses, names)
        s = em.plain(x, inner_t)
        w = em.plain(root.src[1], bcast(root.src[1].shape, inner_t))
        passes.append(Pass("acc", "max", em.lines, f"({w} != 0.0f ? {s} : mlso::neg_inf())"))
    elif probe is None or (not varying and (op == "sum" or probe.degree > 0)):
        em = lw.emitter(uses, names)
        v = em.value(x, inner_t)
        passes.append(Pass("acc", op, em.lines, v.code))
        result_scale = v.scale
    elif op == "sum" and probe.degree == 1:
        em1 = lw.emitter(uses, names)
        m1 = em1.mvalue(probe)
        passes.append(Pass("mg", "max", em1.lines, m1))
        em2 = lw.emitter(uses, names)
        v = em2.value(x, inner_t)
        m2 = em2.mvalue(v.scale)
        passes.append(Pass("acc", "sum", em2.lines, f"{v.code} * mlso::partial_weight({m2}, mg)"))
        dims = tuple(j for j, c in enumerate(probe.mcoords) if mentions(c, LOOP_VAR))
        mg_node = synthetic.combined(probe.key, dims)
        mg_coords = canon(
            mg_node.shape, tuple("0" if j in dims else c for j, c in enumerate(probe.mcoords))
        )
        combine = (mg_node, mg_coords)
    else:
        em = lw.emitter(uses, names)
        passes.append(Pass("acc", op, em.lines, em.plain(x, inner_t)))

    result = f"acc / {c_float(length)}" if root.op is Op.REDUCE_MEAN else "acc"
    fin = lw.emitter(uses, names)
    tail: list[str] = []
    if combine is not None:
        mg_node, mg_coords = combine
        bs = structural(Scale(mg_node, 1, mg_coords), tokens)
        if out.buffer.kind == "scratch" and bs is not None:
            mg_store = lw.scratch_storage(mg_node)
            uses.write(mg_store.buffer)
            out.scale = bs
            stored = result
            tail.append(f"{mg_store.ptr}[{offset(mg_coords, mg_store.strides)}] = mg;")
        else:
            stored = fin.var(f"mlso::unscale({result}, mg)")
    else:
        stored = lw.stored_code(fin, root, Val(result, result_scale), tokens)
    store = [*fin.lines, f"{out.ptr}[o] = mlso::from_f32<{CTYPE[out.dtype]}>({stored});", *tail]

    code = Code()
    with code.block(uses.signature(name, nt)):
        if mode == "thread":
            with code.block(
                f"for (int o = blockIdx.x * {nt} + threadIdx.x; o < {count}; o += gridDim.x * {nt})"
            ):
                emit_passes(code, passes, length, mode, nt)
                code.extend(store)
            grid = min(_ceil(count, nt), GRID_CAP)
        else:
            code("const int lane = threadIdx.x & 31;")
            with code.block(
                f"for (int o = (blockIdx.x * {nt} + threadIdx.x) >> 5; o < {count}; "
                f"o += (gridDim.x * {nt}) >> 5)"
            ):
                emit_passes(code, passes, length, mode, nt)
                with code.block("if (lane == 0)"):
                    code.extend(store)
            grid = min(_ceil(count * 32, nt), GRID_CAP)
    what = _what(root) + (" (split-KV combine)" if combine else "")
    return Kernel(name, code.text(), (grid, 1, 1), (nt, 1, 1), 0, uses.params(), what)


# ---- matmul -----------------------------------------------------------------------------------


def _operand_layout(lw: Lowering, x: Node, role: str, mma: DType | None) -> tuple[bool, bool]:
    """(vector loads ok, k is the contiguous index) for operand x of a kernel-level matmul."""
    view = strided(x, lw.storage)
    rows, cols = x.shape[-2], x.shape[-1]
    k_is_col = role == "a"  # A is (M, K): k is the column index; B is (K, N): k is the row index
    if view is None:
        return False, k_is_col
    s = view.strides
    col_contig = s[-1] == 1 or cols == 1
    row_contig = s[-2] == 1 or rows == 1
    contig_col = col_contig if cols > 1 else not row_contig
    k_major = contig_col if k_is_col else not contig_col
    st = lw.storage[view.leaf]
    if mma is None or st.dtype != mma or st.scale is not None:
        return False, k_major
    batch_ok = all(v % 8 == 0 for v, d in zip(s[:-2], x.shape[:-2]) if d > 1) and view.base % 8 == 0
    if contig_col:
        vec = s[-1] == 1 and cols % 8 == 0 and (rows == 1 or s[-2] % 8 == 0)
    else:
        vec = s[-2] == 1 and rows % 8 == 0 and (cols == 1 or s[-1] % 8 == 0)
    return vec and batch_ok, k_major


def _scaled_operands(lw: Lowering, root: Node, scratch: bool) -> set[str]:
    """Which operands ("a"/"b") the matmul reads as their scaled numbers, leaving C (fp32
    scratch) scaled by scale.matmul_scale; an output buffer always receives the exact values."""
    if not scratch:
        return set()
    scales = []
    for x in root.src:
        tokens = decompose("e", x.shape)
        v = lw.emitter(lw.uses(), Names()).value(x, tokens).scale
        scales.append(structural(v, tokens) if v is not None else None)
    a, b = root.src
    cs, keep_a, keep_b = matmul_scale(
        scales[0], scales[1], len(a.shape), len(b.shape), len(root.shape)
    )
    if cs is None:
        return set()
    lw.storage[root].scale = cs
    return {"a"} if keep_a else {"b"}


def emit_matmul(lw: Lowering, root: Node) -> Kernel:
    """Tiled matmul: tensor cores (mma.sync) for fp16/bf16 operands, fp32 SIMT otherwise."""
    name, names, uses = lw.kernel_name(), Names(), lw.uses()
    out = lw.storage[root]
    uses.write(out.buffer)
    a, b = root.src
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    batch_shape = root.shape[:-2]
    batch = numel(batch_shape)
    if batch > 65535:
        raise CodegenError(f"matmul with {batch} batch entries exceeds the grid's z limit (65535)")
    mma = a.dtype if a.dtype == b.dtype and a.dtype in MMA_TYPES else None
    bt = decompose("b", batch_shape)
    ctype = CTYPE[mma] if mma else "float"
    lambdas: list[str] = []
    flags: list[str] = []
    keep = _scaled_operands(lw, root, out.buffer.kind == "scratch")
    for x, role, (r, c) in ((a, "a", ("m", "k")), (b, "b", ("k", "n"))):
        coords = canon(x.shape, bcast(x.shape[:-2], bt) + (r, c))
        vec, k_major = _operand_layout(lw, x, role, mma)
        em = lw.emitter(uses, names)
        val = em.value(x, coords).code if role in keep else em.plain(x, coords)
        body = " ".join(em.lines)
        lambdas.append(
            f"auto {role}_at = [&](int b, int {r}, int {c}) -> float {{ {body} return {val}; }};"
        )
        if vec:
            view = strided(x, lw.storage)
            st = lw.storage[view.leaf]
            uses.read(view.leaf)
            lambdas.append(
                f"auto {role}_ptr = [&](int b, int {r}, int {c}) -> const {ctype}* "
                f"{{ return {st.ptr} + {offset(coords, view.strides, view.base)}; }};"
            )
        else:
            lambdas.append(
                f"auto {role}_ptr = [&](int, int, int) -> const {ctype}* {{ return nullptr; }};"
            )
        flags += ["true" if vec else "false", "true" if k_major else "false"]
    cst = (
        f"auto c_st = [&](int b, int m, int n, float v) {{ {out.ptr}[(b * {m} + m) * {n} + n] = "
        f"mlso::from_f32<{CTYPE[out.dtype]}>(v); }};"
    )
    code = Code()
    with code.block(uses.signature(name, 128 if mma else 256)):
        code("MLSO_DYNAMIC_SMEM(smem);")
        code.extend(lambdas)
        code(cst)
        if mma:
            code(
                f"mlso::gemm_mma_64x64<{ctype}, {m}, {n}, {k}, {', '.join(flags)}>"
                "(smem, a_ptr, a_at, b_ptr, b_at, c_st);"
            )
            ak, bk = flags[1] == "true", flags[3] == "true"
            elems = 2 * (64 * 40 if ak else 32 * 72) + 2 * (64 * 40 if bk else 32 * 72)
            smem, threads = elems * 2, 128
        else:
            code(
                f"mlso::gemm_simt_64x64<{m}, {n}, {k}, {flags[1]}, {flags[3]}>(smem, a_at, b_at, c_st);"
            )
            smem, threads = 2 * 16 * 64 * 4, 256
    grid = (_ceil(n, 64), _ceil(m, 64), batch)
    what = f"matmul {list(a.shape)} x {list(b.shape)} ({'mma.sync ' + mma.value if mma else 'fp32 SIMT'})"
    return Kernel(name, code.text(), grid, (threads, 1, 1), smem, uses.params(), what)
