"""Matmul passes of a block kernel: staging copies of computed operands (in their 16-bit
type, or fp32 for sums of squares) and tensor-core matmuls (`mlso::block_mma` strips, or a
matmul fused into its loop accumulator).

Why its own module: it prints blockmatmul.py's plans (operands, stages, strip widths) and
nothing else; the decisions are made there and in mmawork.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlso_cli.codegen.blockmatmul import MatmulPlan, Operand, Stage
from mlso_cli.codegen.blockpass import elementwise
from mlso_cli.codegen.blockpass.elementwise import Store
from mlso_cli.codegen.cfmt import (
    CTYPE,
    Code,
    Coords,
    bcast,
    c_bool,
    canon,
    contiguous,
    decompose,
    numel,
    offset,
)
from mlso_cli.codegen.emitter import Emitter
from mlso_cli.codegen.errors import CodegenError
from mlso_cli.codegen.scale import structural
from mlso_cli.ir.node import Node

if TYPE_CHECKING:
    from mlso_cli.codegen.block import BlockKernel


def pass_stage(bk: BlockKernel, code: Code, st: Stage) -> None:
    s = st.storage
    ctype = CTYPE[s.dtype]

    def body(em: Emitter, coords: Coords) -> list[str]:
        if st.scale is None:
            v = em.plain(st.src, coords)
        else:
            val = em.value(st.src, coords)
            if val.scale is None or structural(val.scale, coords) != st.scale:
                raise CodegenError(
                    f"staged operand {st.src.op.value}{list(st.src.shape)}: emitted scale "
                    "differs from the planned one",
                    "Report this as a codegen bug.",
                )
            v = val.code
        return [
            Store(
                f"{s.ptr}[{offset(coords, s.strides)}]",
                v,
                wrap=f"mlso::from_f32<{ctype}>({{}})",
            )
        ]

    code(
        f"// stage {st.src.op.value}{list(st.src.shape)} as {s.dtype.value}"
        + (" (scaled by a row max)" if st.scale is not None else "")
    )
    elementwise.per_element(bk, code, st.src.shape, body, vector=st.scale is None)
    bk.note_writes(s.ptr)


def batch_offset(bk: BlockKernel, op: Operand, out_batch: tuple[int, ...]) -> str:
    bt = decompose("bt", out_batch)
    lead = bcast(op.shape[:-2], bt)
    return f"[&](int bt) -> int {{ return {offset(lead, op.strides[:-2], op.base)}; }}"


def pass_matmul(bk: BlockKernel, code: Code, plan: MatmulPlan, what: str) -> None:
    a, b, c = plan.a, plan.b, plan.c
    bk.note_reads(
        a.ptr,
        b.ptr,
        *([c.ptr] if plan.accumulate else []),
        *([plan.row_scale] if plan.row_scale else []),
    )
    bk.note_writes(c.ptr)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    out_batch = c.shape[:-2]
    batch = numel(out_batch)
    # C's row and batch strides: an accumulator's rows may be padded (blockstorage)
    ldc = c.strides[-2]
    cbs = c.strides[-3] if len(c.shape) > 2 else m * ldc
    lead = contiguous(out_batch)
    assert c.strides[-1] == 1 and all(s == d * cbs for s, d in zip(c.strides[:-2], lead))
    code(
        f"// {what}: ({list(a.shape)} x {list(b.shape)}), {plan.kind}{' accumulate' if plan.accumulate else ''}"
    )
    if plan.kind == "mma":
        mp, nb = plan.rows, plan.strip
        lda, ldb = a.ld(plan.a_kmajor), b.ld(not plan.b_kmajor)
        code(
            f"mlso::block_mma<{CTYPE[plan.dtype]}, {batch}, {mp}, {m}, {n}, {k}, {nb}, {c_bool(plan.a_kmajor)}, "
            f"{c_bool(plan.b_kmajor)}, {c_bool(plan.accumulate)}, {bk.nw}>({a.ptr}, {lda}, "
            f"{batch_offset(bk, a, out_batch)}, {b.ptr}, {ldb}, {batch_offset(bk, b, out_batch)}, "
            f"{c.ptr}, {ldc}, {cbs}{', ' + plan.row_scale if plan.row_scale else ''});"
        )
        return
    bt = decompose("bt", out_batch)
    ca = canon(a.shape, bcast(a.shape[:-2], bt) + ("mm", "kk"))
    cb = canon(b.shape, bcast(b.shape[:-2], bt) + ("kk", "nn"))
    ea = f"mlso::to_f32({a.ptr}[{offset(ca, a.strides, a.base)}])"
    eb = f"mlso::to_f32({b.ptr}[{offset(cb, b.strides, b.base)}])"
    total = batch * m * n
    co = "co" if ldc != n else "o"  # C's element: padded rows need their own offset
    init = f"{c.ptr}[{co}]" if plan.accumulate else "0.0f"
    if plan.accumulate and plan.row_scale:
        init = f"{c.ptr}[{co}] * {plan.row_scale}[o / {n}]"
    head = [
        f"const int bt = o / {m * n};",
        f"const int mm = (o / {n}) % {m};",
        f"const int nn = o % {n};",
    ]
    if co != "o":
        head.append(f"const int co = bt * {cbs} + mm * {ldc} + nn;")
    if plan.kind == "simt":
        with code.block(f"for (int o = threadIdx.x; o < {total}; o += {bk.nt})"):
            code.extend(head)
            code(f"float acc = {init};")
            with code.block(f"for (int kk = 0; kk < {k}; ++kk)"):
                code(f"acc = fmaf({ea}, {eb}, acc);")
            code(f"{c.ptr}[{co}] = acc;")
    else:
        with code.block(f"for (int o = warp; o < {total}; o += {bk.nw})"):
            code.extend(head)
            code("float acc = 0.0f;")
            with code.block(f"for (int kk = lane; kk < {k}; kk += 32)"):
                code(f"acc = fmaf({ea}, {eb}, acc);")
            code("acc = mlso::warp_sum(acc);")
            with code.block("if (lane == 0)"):
                code(f"{c.ptr}[{co}] = {init} + acc;")


def pass_node_matmul(bk: BlockKernel, code: Code, n: Node) -> None:
    pass_matmul(bk, code, bk.plans[n], f"matmul -> {list(n.shape)}")
