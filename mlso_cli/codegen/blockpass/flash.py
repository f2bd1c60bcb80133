"""The online softmax of a block kernel: ACC_EXP_SUM / ACC_EXP_WSUM groups sharing one running
max, printed either in registers (`mlso::FlashRows`, the register path) or as shared-memory
passes (rescale by alpha, add exp(s - m) terms, stage P for exp(s - m) @ v).

Why its own module: this family owns the running max, alpha and the scaled numbers it leaves
in its accumulators (scale.py); which path a group takes is decided before (blockanalysis,
blocklayout), and this module prints it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mlso_cli.codegen.blockanalysis import Group
from mlso_cli.codegen.blockmatmul import MatmulPlan, Operand
from mlso_cli.codegen.blockpass import elementwise, matmul, rowwalk
from mlso_cli.codegen.blockpass.elementwise import Store
from mlso_cli.codegen.cfmt import (
    CTYPE,
    Code,
    Coords,
    c_bool,
    c_float,
    canon,
    contiguous,
    decompose,
    offset,
)
from mlso_cli.codegen.emitter import Emitter
from mlso_cli.codegen.scale import Storage
from mlso_cli.codegen.teams import LOOP_VAR
from mlso_cli.ir.node import Node

if TYPE_CHECKING:
    from mlso_cli.codegen.block import BlockKernel


def flash_args(bk: BlockKernel, plan: MatmulPlan, op: Operand, contiguous_last: bool) -> str:
    off = f"({matmul.batch_offset(bk, op, plan.c.shape[:-2])})(0)"
    return f"{op.ptr} + {off}, {op.ld(contiguous_last)}"


def factor_pass(bk: BlockKernel, code: Code, f: Node, buf: str, what: str) -> None:
    """One factor per key into `buf` (fp32 shared memory), for the register pass to read."""

    def body(em: Emitter, coords: Coords) -> list[str]:
        return [Store(f"{buf}[e]", em.plain(f, coords))]

    code(f"// per-key factor of the {what}, {list(f.shape)}")
    elementwise.per_element(bk, code, f.shape, body, vector=True)
    code("__syncthreads();")
    bk.note_writes(buf)


def pass_flash(bk: BlockKernel, code: Code, g: Group) -> None:
    form = bk.reg.form
    sps = [bk.plans[t] for t in form.terms]
    wp = bk.plans[g.wsums[0]]
    vop, vk = bk.reg.v
    bk.note_reads(*(p for sp in sps for p in (sp.a.ptr, sp.b.ptr)), vop.ptr)
    vs = ""
    if bk.reg.f is not None:
        factor_pass(bk, code, bk.reg.f, bk.reg.fbuf, "weighted operand")
        vs = f", {bk.reg.fbuf}"
    if bk.reg.red is not None:
        vs = (
            f"{vs or ', nullptr'}, {bk.reg.red} + (warp % {bk.reg.strips}) * "
            f"{bk.reg.ksplit * 16 * g.s.shape[-1]}"
        )
    if bk.reg.kbuf is not None:
        factor_pass(bk, code, form.key_factor, bk.reg.kbuf, "scores")
    ab = [
        f"{flash_args(bk, sp, sp.a, sp.a_kmajor)}, {flash_args(bk, sp, sp.b, not sp.b_kmajor)}"
        for sp in sps
    ]
    v = flash_args(bk, wp, vop, not vk)
    if bk.reg.single:
        code(
            "// online softmax in registers: s = matmul, m, l and exp(s - m) @ v per 16-row warp strip"
        )
        code(f"flash.step({ab[0]}, {v}, {flash_rows(bk)}{vs});")
        return
    second = ab[1] if len(ab) > 1 else "nullptr, 0, nullptr, 0"
    code(
        f"// online softmax in registers: s = {' + '.join('matmul' for _ in sps)} (times "
        f"{float(form.scale)}{' and a per-key factor' if bk.reg.kbuf else ''}), m, l and exp(s - m) @ v"
    )
    code(
        f"flash.step2({ab[0]}, {second}, {c_float(form.scale)}, {bk.reg.kbuf or 'nullptr'}, {v}, "
        f"{flash_rows(bk)}{vs});"
    )


def flash_rows(bk: BlockKernel) -> str:
    """This warp's first row and first value column: warps split rows into 16-row strips,
    then (reg.split > 1) the value columns of a strip."""
    if bk.reg.split == 1:
        return "warp * 16, 0"
    return f"(warp % {bk.reg.strips}) * 16, (warp / {bk.reg.strips}) * {bk.reg.width}"


def flash_decl(bk: BlockKernel) -> str:
    g = bk.flash
    sps = [bk.plans[t] for t in bk.reg.form.terms]
    sp = sps[0]
    second = "".join(
        f", {p.a.shape[-1]}, {c_bool(p.a_kmajor)}, {c_bool(p.b_kmajor)}" for p in sps[1:]
    )
    return (
        f"mlso::FlashRows<{CTYPE[sp.dtype]}, {g.s.shape[-1]}, {sp.a.shape[-1]}, {bk.reg.width}, "
        f"{c_bool(sp.a_kmajor)}, {c_bool(sp.b_kmajor)}, {c_bool(bk.reg.v[1])}, {bk.reg.ksplit}{second}> flash;"
    )


def flash_flush(bk: BlockKernel, code: Code) -> None:
    g = bk.flash
    w = bk.storage[g.wsums[0]]
    sums = [bk.storage[a].ptr for a in g.sums]
    code("// the register state to the shared-memory accumulators")
    if sums:
        code(f"float* const flash_l[] = {{{', '.join(sums)}}};")
    code(
        f"flash.flush({w.ptr}, {g.wsums[0].shape[-1]}, {'flash_l' if sums else 'nullptr'}, {len(sums)}, "
        f"{bk.storage[g.m].ptr}, {flash_rows(bk)});"
    )
    code("__syncthreads();")


def pass_group_rows(bk: BlockKernel, code: Code, g: Group) -> None:
    """One pass per row r of s (a team of lanes per row, or a thread when rows are short):
    m' = max(m, max_c s[r, c]); alpha = exp(m - m'); p = exp(s - m') (staged for P @ v);
    sum accumulators l = l * alpha + sum_c p; m = m'. Weighted sums are rescaled by alpha
    (kept in g.alpha) as the P @ v matmul loads them."""
    m, s = bk.storage[g.m], g.s
    length, rows = s.shape[-1], g.m.numel
    t = bk.plan.teams[("rows", rows, length)]
    warp_mode = t.mode == "warp"
    tokens = decompose("o", g.m.shape)
    sc = canon(s.shape, tokens[:-1] + (LOOP_VAR,))
    team = t.width
    start, step = ("tl", str(team)) if warp_mode else ("0", "1")
    bk.note_reads(m.ptr, *(bk.storage[a].ptr for a in g.sums))
    bk.note_writes(m.ptr, *(bk.storage[a].ptr for a in g.sums))
    if g.wsums:
        bk.note_writes(g.alpha)
    code(
        f"// rescaling accumulators over s{list(s.shape)}: row max, rescale, exp(s - m), row sums"
        + (f" ({team} lanes per row)" if warp_mode else "")
    )
    per = 32 // team
    head = (
        f"for (int ob = warp * {per}; ob < {rows}; ob += {bk.nw * per})"
        if warp_mode
        else f"for (int o = threadIdx.x; o < {rows}; o += {bk.nt})"
    )
    with code.block(head):
        if warp_mode:
            code(f"const int o = ob + (lane / {team}), tl = lane % {team};")
        em = bk.emitter()
        v = em.plain(s, sc)
        code("float mx = mlso::neg_inf();")
        head, first = rowwalk.row_loop(bk, code, warp_mode, team, length, start, step)
        with code.block(head):
            code.extend(first + em.lines)
            code(f"mx = fmaxf(mx, {v});")
        if warp_mode:
            code(f"mx = mlso::warp_allreduce<mlso::MaxOp, {team}>(mx);")
        code(
            f"const float mo = {m.ptr}[o];",
            "const float mn = fmaxf(mo, mx);",
            "const float alpha = mlso::rescale(mo, mn);",
            "float sm = 0.0f;",
        )
        em = bk.emitter()
        v = em.plain(s, sc)
        head, first = rowwalk.row_loop(bk, code, warp_mode, team, length, start, step)
        with code.block(head):
            code.extend(first + em.lines)
            code(f"const float p = mlso::exp_rel({v}, mn);", "sm += p;")
            if g.wsums:
                p = g.p
                bk.note_writes(p.ptr)
                code(f"{p.ptr}[{offset(sc, p.strides)}] = mlso::from_f32<{CTYPE[p.dtype]}>(p);")
        if warp_mode and g.sums:
            code(f"sm = mlso::warp_allreduce<mlso::SumOp, {team}>(sm);")
        if warp_mode:
            code("__syncwarp();")
        tail = [f"{m.ptr}[o] = mn;"] + [
            f"{bk.storage[a].ptr}[o] = {bk.storage[a].ptr}[o] * alpha + sm;" for a in g.sums
        ]
        if g.wsums:
            tail.append(f"{g.alpha}[o] = alpha;")
        if warp_mode:
            with code.block("if (tl == 0)"):
                code.extend(tail)
        else:
            code.extend(tail)


def pass_group(bk: BlockKernel, code: Code, g: Group) -> None:
    """General form (weighted sums whose rows do not align with s's rows): separate passes."""
    m, s = bk.storage[g.m], g.s
    length = s.shape[-1]
    touched = [m.ptr, g.alpha, *(bk.storage[a].ptr for a in g.sums + g.wsums)] + (
        [g.p.ptr] if g.p else []
    )
    bk.note_reads(*touched)
    bk.note_writes(*touched)

    def s_coords(tokens: Coords) -> Coords:
        return canon(s.shape, tokens[:-1] + (LOOP_VAR,))

    code(f"// rescaling accumulators over s{list(s.shape)}: running max, rescale, add exp(s - m)")

    def rowmax(em: Emitter, tokens: Coords) -> str:
        return em.plain(s, s_coords(tokens))

    def raise_max(em: Emitter, tokens: Coords, acc: str) -> list[str]:
        return [
            f"const float mo = {m.ptr}[o];",
            f"const float mn = fmaxf(mo, {acc});",
            f"{g.alpha}[o] = mlso::rescale(mo, mn);",
            f"{m.ptr}[o] = mn;",
        ]

    rowwalk.team(bk, code, g.m.shape, length, "max", rowmax, raise_max)
    code("__syncthreads();")
    for acc in g.sums:
        a = bk.storage[acc]

        def expsum(em: Emitter, tokens: Coords) -> str:
            return f"mlso::exp_rel({em.plain(s, s_coords(tokens))}, {m.ptr}[o])"

        def add(em: Emitter, tokens: Coords, v: str, a: Storage = a) -> list[str]:
            return [f"{a.ptr}[o] = {a.ptr}[o] * {g.alpha}[o] + {v};"]

        rowwalk.team(bk, code, g.m.shape, length, "sum", expsum, add)
    for acc in g.wsums:
        a = bk.storage[acc]
        rows = row_index(bk, g, acc.shape)

        def rescale(em: Emitter, coords: Coords, a: Storage = a, rows=rows) -> list[str]:
            return [Store(f"{a.ptr}[e]", f"{g.alpha}[{rows(coords)}]", "*=")]

        elementwise.per_element(bk, code, acc.shape, rescale)
    if g.wsums:
        p = g.p
        ctype = CTYPE[p.dtype]

        def stage_p(em: Emitter, coords: Coords) -> list[str]:
            row = offset(canon(g.m.shape, coords[:-1] + ("0",)), m.strides)
            val = f"mlso::exp_rel({em.plain(s, coords)}, {m.ptr}[{row}])"
            return [
                Store(
                    f"{p.ptr}[{offset(coords, p.strides)}]",
                    val,
                    wrap=f"mlso::from_f32<{ctype}>({{}})",
                )
            ]

        elementwise.per_element(bk, code, s.shape, stage_p)


def row_index(bk: BlockKernel, g: Group, shape: tuple[int, ...]) -> Callable[[Coords], str]:
    """Offset into the running max of a WSUM element at coords (rows align to s's rows)."""
    ms = g.m.shape
    lead = len(shape) - len(ms)

    def index(coords: Coords) -> str:
        mc = tuple(
            "0" if (j == len(ms) - 1 or ms[j] == 1) else coords[j + lead] for j in range(len(ms))
        )
        return offset(mc, contiguous(ms))

    return index
