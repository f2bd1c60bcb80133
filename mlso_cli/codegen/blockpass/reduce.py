"""Reduction passes of a block kernel: REDUCE_* over one axis, a sum and a centred sum of
squares folded in one walk (moments), and ACC_SUM loop accumulators.

Why its own module: these passes are row walks (rowwalk.py) over materialised or fused values;
which reductions are fused or paired is decided in blockanalysis.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlso_cli.codegen import synthetic
from mlso_cli.codegen.blockpass import elementwise, matmul, rowwalk
from mlso_cli.codegen.blockpass.elementwise import Store
from mlso_cli.codegen.blockpass.rowwalk import Walk
from mlso_cli.codegen.cfmt import (
    Code,
    Coords,
    bcast,
    c_float,
    canon,
    decompose,
)
from mlso_cli.codegen.emitter import Emitter
from mlso_cli.codegen.scale import Storage
from mlso_cli.codegen.teams import LOOP_VAR
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import DType, Op

if TYPE_CHECKING:
    from mlso_cli.codegen.block import BlockKernel


def pass_reduce(bk: BlockKernel, code: Code, n: Node) -> None:
    into = bk.fused_reduce.get(n)
    st = bk.storage[into] if into is not None else bk.storage[n]
    bk.note_writes(st.ptr)
    if into is not None:
        bk.note_reads(st.ptr)
    x = n.src[0]
    weighted = isinstance(n.arg, synthetic.RowMax) and n.arg.weighted
    axis = n.arg.axis if isinstance(n.arg, synthetic.RowMax) else n.arg
    length = x.shape[axis]
    op = "max" if n.op is Op.REDUCE_MAX else "sum"

    def inner(tokens: Coords) -> Coords:
        c = list(tokens)
        c[axis] = LOOP_VAR
        return canon(x.shape, c)

    planned = st.scale if into is None else None  # decided by _reduce_scale before emission

    def body(em: Emitter, tokens: Coords) -> str:
        c = inner(tokens)
        if weighted:
            w = em.plain(n.src[1], bcast(n.src[1].shape, c))
            return f"({w} != 0.0f ? {em.plain(x, c)} : mlso::neg_inf())"
        return em.value(x, c).code if planned is not None else em.plain(x, c)

    def finish(em: Emitter, tokens: Coords, acc: str) -> list[str]:
        val = f"{acc} / {float(length)}f" if n.op is Op.REDUCE_MEAN else acc
        return [f"{st.ptr}[o] {'+=' if into is not None else '='} {val};"]

    code(
        f"// {n.op.value} axis {axis} of {list(x.shape)}"
        + (" (softmax stabiliser)" if weighted or isinstance(n.arg, synthetic.RowMax) else "")
    )
    rowwalk.team(bk, code, n.shape, length, op, body, finish)


def pass_moments(bk: BlockKernel, code: Code, r2: Node) -> None:
    """r1 = sum(u) and r2 = sum((u - a)^2), a = a(r1), in one walk over u (blockanalysis
    `moments` says why). Per output row the team folds r1 = sum(u) as r1's own pass would
    (the same order: the same bits) and, with the shift K = the row's first value,
    S1 = sum(u - K) and S2 = sum((u - K)^2). Once r1 and S1 are whole, every thread
    evaluates a from r1 (its own copy: no store, no barrier) and takes its share of
    2 (a - K) S1 - N (a - K)^2 off its part of S2; the all-reduce of S2 then gives
    r2 = S2 - 2 (a - K) S1 + N (a - K)^2, exact for any a and any K.

    Why so: the shift keeps S2's terms near the spread (with K = 0, a row of mean 1000
    and spread 1 loses six of fp32's seven digits), and the correction is taken off before
    the all-reduce so that its last sums are of r2's size, not S2's. A LayerNorm stages
    (x - mean) * rstd in 16 bits, so the last bits of mean and variance show in its
    output: r1 is summed directly rather than as S1 + N K, whose rounding grows with
    N (mean - K)."""
    m = bk.moments[r2]
    first, second = bk.storage[m.first], bk.storage[r2]
    assert first.scale is None and second.scale is None, "moments of scaled values"
    bk.note_writes(first.ptr, second.ptr)
    u, axis = m.u, r2.arg
    length = u.shape[axis]
    tokens = decompose("o", r2.shape)

    def at(rr: str) -> Coords:
        c = list(tokens)
        c[axis] = rr
        return canon(u.shape, c)

    # local names (no buffer is named so): the shift, the three sums, u - K, a - K
    k, total, s1, s2, du, ak = "mom_k", "mom_u", "mom_sum", "mom_sq", "mom_d", "mom_c"
    em = bk.emitter()
    v = em.plain(u, at(LOOP_VAR))
    steps = [
        f"{total} += {v};",
        f"const float {du} = {v} - {k};",
        f"{s1} += {du};",
        f"{s2} = fmaf({du}, {du}, {s2});",
    ]
    n = c_float(length)

    def settle(width: int) -> list[str]:
        # a from r1 as this thread holds it (the whole sum, as stored below)
        local = {
            **bk.storage,
            m.first: Storage(f"(&{total})", DType.F32, r2.shape, (0,) * len(r2.shape)),
        }
        fin = Emitter(local, bk.stab, bk.names)
        centre = fin.plain(m.centre, tokens)
        share = c_float(1 / width)
        return [
            *fin.lines,
            f"const float {ak} = {centre} - {k};",
            f"{s2} -= (2.0f * {ak} * {s1} - {n} * {ak} * {ak}) * {share};",
        ]

    code(
        f"// moments: reduce_sum axis {axis} of {list(u.shape)} and of its squares about a "
        "centre derived from it, in one walk (shifted by each row's first value)"
    )
    tail = [f"{first.ptr}[o] = {total};", f"{second.ptr}[o] = {s2};"]
    accs = ((total, "sum"), (s1, "sum"), (s2, "sum"))
    head = bk.emitter()
    shift = head.plain(u, at("0"))  # the row's first value
    setup = [*head.lines, f"const float {k} = {shift};"]
    walk = Walk(accs, setup, em.lines, steps, tail, settle)
    rowwalk.team_walk(bk, code, r2.numel, length, walk)


def pass_acc_sum(bk: BlockKernel, code: Code, n: Node) -> None:
    if n.src[0] in bk.fused:
        matmul.pass_matmul(bk, code, bk.plans[n.src[0]], "accumulate matmul")
        return
    st = bk.storage[n]
    bk.note_reads(st.ptr)
    bk.note_writes(st.ptr)

    def body(em: Emitter, coords: Coords) -> list[str]:
        return [Store(f"{st.ptr}[e]", em.plain(n.src[0], coords), "+=")]

    code(f"// acc_sum{list(n.shape)}")
    elementwise.per_element(bk, code, n.shape, body, vector=True)
