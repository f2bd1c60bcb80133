"""A kernel-level generated matmul: `plan_matmul` decides, `print_matmul` prints.

Why split: the decisions of a stand-alone matmul kernel (tensor cores or SIMT, how each operand
is read: wide loads from its buffer or element by element, k-major or not, as its scaled
numbers or exact, the scale C is left with, grid, threads, shared memory) depend on where its
operands are stored, which the lowering knows when the kernel's turn comes; the printer needs
only those decisions. `plan_matmul` reads the lowering's storage and returns a frozen
MatmulKernelPlan; `print_matmul` prints one from the plan and a site.KernelSite (name,
parameters, emitters, storage view), never seeing the Lowering.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from mlso_cli.codegen.cfmt import (
    CTYPE,
    Code,
    Names,
    bcast,
    canon,
    contiguous,
    decompose,
    numel,
    offset,
)
from mlso_cli.codegen.errors import CodegenError
from mlso_cli.codegen.program import Kernel
from mlso_cli.codegen.scale import BufferScale, Storage, matmul_scale, structural
from mlso_cli.codegen.site import KernelSite
from mlso_cli.codegen.views import strided
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import DType

if TYPE_CHECKING:
    from mlso_cli.codegen.lower import Lowering

MMA_TYPES = (DType.F16, DType.BF16)
TILE = 64
"""Output tile of mlso::gemm_mma_64x64 / gemm_simt_64x64 (one block each)."""
PATHS: Mapping[str, tuple[int, Callable[[bool, bool], int]]] = MappingProxyType(
    {
        # path -> (threads, shared-memory bytes given (A k-major, B k-major))
        "mma": (
            128,
            lambda ak, bk: (
                (2 * (64 * 40 if ak else 32 * 72) + 2 * (64 * 40 if bk else 32 * 72)) * 2
            ),
        ),
        "simt": (256, lambda ak, bk: 2 * 16 * 64 * 4),
    }
)
"""The two matmul templates: block size and the shared memory their staging tiles take."""


@dataclass(frozen=True)
class OperandRead:
    """How the kernel reads one operand."""

    vec: bool
    """Wide loads straight from its buffer (a 16-bit tensor core operand, aligned)."""
    k_major: bool
    """k is the contiguous index."""
    scaled: bool
    """Read as its scaled numbers (C is then left scaled by `c_scale`)."""


@dataclass(frozen=True)
class MatmulKernelPlan:
    root: Node
    path: str
    """"mma" (mma.sync on fp16/bf16 operands) or "simt" (fp32)."""
    mma: DType | None
    m: int
    n: int
    k: int
    a: OperandRead
    b: OperandRead
    c_scale: BufferScale | None
    """The scale C's fp32 scratch holds (scale.matmul_scale), or None: exact values."""
    grid: tuple[int, int, int]
    threads: int
    smem: int


def plan_matmul(lw: Lowering, root: Node) -> MatmulKernelPlan:
    """The decisions of root's matmul kernel, from the lowering's storage at its turn."""
    a, b = root.src
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    batch = numel(root.shape[:-2])
    if batch > 65535:
        raise CodegenError(f"matmul with {batch} batch entries exceeds the grid's z limit (65535)")
    mma = a.dtype if a.dtype == b.dtype and a.dtype in MMA_TYPES else None
    out = lw.storage[root]
    c_scale, keep = _scaled_operands(lw, root, out.buffer.kind == "scratch")
    reads = [
        OperandRead(*_operand_layout(lw.storage, x, role, mma), role in keep)
        for x, role in ((a, "a"), (b, "b"))
    ]
    path = "mma" if mma else "simt"
    threads, smem = PATHS[path]
    grid = (-(-n // TILE), -(-m // TILE), batch)
    return MatmulKernelPlan(
        root, path, mma, m, n, k, reads[0], reads[1], c_scale, grid, threads,
        smem(reads[0].k_major, reads[1].k_major),
    )  # fmt: skip


def _operand_layout(
    storage: Mapping[Node, Storage], x: Node, role: str, mma: DType | None
) -> tuple[bool, bool]:
    """(vector loads ok, k is the contiguous index) for operand x of a kernel-level matmul."""
    view = strided(x, storage)
    rows, cols = x.shape[-2], x.shape[-1]
    k_is_col = role == "a"  # A is (M, K): k is the column index; B is (K, N): k is the row index
    if view is None:
        return False, k_is_col
    s = view.strides
    col_contig = s[-1] == 1 or cols == 1
    row_contig = s[-2] == 1 or rows == 1
    contig_col = col_contig if cols > 1 else not row_contig
    k_major = contig_col if k_is_col else not contig_col
    st = storage[view.leaf]
    if mma is None or st.dtype != mma or st.scale is not None:
        return False, k_major
    batch_ok = all(v % 8 == 0 for v, d in zip(s[:-2], x.shape[:-2]) if d > 1) and view.base % 8 == 0
    if contig_col:
        vec = s[-1] == 1 and cols % 8 == 0 and (rows == 1 or s[-2] % 8 == 0)
    else:
        vec = s[-2] == 1 and rows % 8 == 0 and (cols == 1 or s[-1] % 8 == 0)
    return vec and batch_ok, k_major


def _scaled_operands(
    lw: Lowering, root: Node, scratch: bool
) -> tuple[BufferScale | None, set[str]]:
    """(C's scale, which operands "a"/"b" the matmul reads as their scaled numbers): C, in fp32
    scratch, is left scaled by scale.matmul_scale; an output buffer always receives exact
    values."""
    if not scratch:
        return None, set()
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
        return None, set()
    return cs, {"a"} if keep_a else {"b"}


def print_matmul(plan: MatmulKernelPlan, site: KernelSite) -> Kernel:
    """Tiled matmul: tensor cores (mma.sync) for fp16/bf16 operands, fp32 SIMT otherwise."""
    root, names, uses = plan.root, Names(), site.uses
    out = site.storage[root]
    uses.write(out.buffer)
    a, b = root.src
    m, k, n = plan.m, plan.k, plan.n
    bt = decompose("b", root.shape[:-2])
    ctype = CTYPE[plan.mma] if plan.mma else "float"
    lambdas: list[str] = []
    flags: list[str] = []
    for x, role, (r, c), read in ((a, "a", ("m", "k"), plan.a), (b, "b", ("k", "n"), plan.b)):
        coords = canon(x.shape, bcast(x.shape[:-2], bt) + (r, c))
        em = site.emitter(uses, names)
        val = em.value(x, coords).code if read.scaled else em.plain(x, coords)
        body = " ".join(em.lines)
        lambdas.append(
            f"auto {role}_at = [&](int b, int {r}, int {c}) -> float {{ {body} return {val}; }};"
        )
        if read.vec:
            view = strided(x, site.storage)
            st = site.storage[view.leaf]
            uses.read(view.leaf)
            lambdas.append(
                f"auto {role}_ptr = [&](int b, int {r}, int {c}) -> const {ctype}* "
                f"{{ return {st.ptr} + {offset(coords, view.strides, view.base)}; }};"
            )
        else:
            lambdas.append(
                f"auto {role}_ptr = [&](int, int, int) -> const {ctype}* {{ return nullptr; }};"
            )
        flags += ["true" if read.vec else "false", "true" if read.k_major else "false"]
    at = f"(b * {m} + m) * {n} + n"
    if out.strides != contiguous(root.shape):  # an output saved through views (roots.py)
        at = offset(canon(root.shape, bt + ("m", "n")), out.strides)
    cst = (
        f"auto c_st = [&](int b, int m, int n, float v) {{ {out.ptr}[{at}] = "
        f"mlso::from_f32<{CTYPE[out.dtype]}>(v); }};"
    )
    code = Code()
    with code.block(uses.signature(site.name, 128 if plan.mma else 256)):
        code("MLSO_DYNAMIC_SMEM(smem);")
        code.extend(lambdas)
        code(cst)
        if plan.mma:
            code(
                f"mlso::gemm_mma_64x64<{ctype}, {m}, {n}, {k}, {', '.join(flags)}>"
                "(smem, a_ptr, a_at, b_ptr, b_at, c_st);"
            )
        else:
            code(
                f"mlso::gemm_simt_64x64<{m}, {n}, {k}, {flags[1]}, {flags[3]}>(smem, a_at, b_at, c_st);"
            )
    mode = "mma.sync " + plan.mma.value if plan.mma else "fp32 SIMT"
    what = f"matmul {list(a.shape)} x {list(b.shape)} ({mode})"
    return Kernel(
        site.name, code.text(), plan.grid, (plan.threads, 1, 1), plan.smem, uses.params(), what
    )
