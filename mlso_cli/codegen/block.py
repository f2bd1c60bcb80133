"""Graph-defined kernels: one CUDA kernel per block graph. This module prints; the decisions
are made before it runs, by job: blockanalysis.py (what is materialised, groups, fusions, the
register-path candidate, dependency order), blockstorage.py (buffers and which hold scaled
numbers), blockmatmul.py (operands, staging copies), blocklayout.py (the layout options; the
one shared-memory figure, smem_layout), barriers.py (where __syncthreads() is needed).

Layout of a generated kernel (blockIdx.{x,y,z} are the grid coordinates):

    PRE   load PRE-phase ITER tiles (one cp.async group) and the first loop stages (a group
          each), wait for the PRE group only, then the PRE ops while the stages still load
    init  accumulators = 0, running maxima = -inf
    LOOP  for it < loop: prefetch step it+1 into the other buffer (cp.async double buffering),
          wait for step it, run the LOOP ops and accumulator updates
    POST  ops on accumulators, then SAVE every output through its omap

Materialised in shared memory (fp32 unless noted): ITER tiles (their input dtype, 16-byte rows
padded by 16 bytes against ldmatrix bank conflicts), matmul and reduction results, accumulators,
running maxima, and staging copies of matmul operands that are computed values (converted to
fp16/bf16 for tensor cores; a scaled operand, exp(s - M), is staged as its scaled numbers).
Everything elementwise is fused into its consumers (thread graphs by rule) and recomputed where
needed. The spec checker's shared-memory figure is this layout's exact byte count.

Each op is a pass over shared memory followed by __syncthreads(). Passes come from the table
PASSES (op -> method). ACC_EXP_SUM / ACC_EXP_WSUM sharing a score tensor s form one group with
one running row max m: per step, m' = max(m, rowmax s), alpha = exp(m - m'), sums are rescaled
by alpha and exp(s - m') terms added (P = exp(s - m') @ v on tensor cores for WSUM). Their
values are kept relative to m (scale.py); a POST division of two of them cancels the scale, and
a PARTIAL save stores the scaled partial plus m in an fp32 side buffer, which the combining
kernel-level REDUCE_SUM uses (kernels.emit_reduce).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlso_cli.codegen import synthetic
from mlso_cli.codegen.arch import SMEM_BUDGET
from mlso_cli.codegen.barriers import emit_with_barriers
from mlso_cli.codegen.blockanalysis import Group
from mlso_cli.codegen.blocklayout import CODEGEN_ARCH, BlockLayout
from mlso_cli.codegen.blockmatmul import MatmulPlan, Operand, Stage
from mlso_cli.codegen.blockstorage import _ceil_to
from mlso_cli.codegen.cfmt import (
    CTYPE,
    Code,
    Coords,
    bcast,
    c_float,
    canon,
    contiguous,
    decompose,
    numel,
    offset,
    paren,
)
from mlso_cli.codegen.emitter import Emitter
from mlso_cli.codegen.errors import CodegenError
from mlso_cli.codegen.mmawork import strip_width
from mlso_cli.codegen.program import Kernel
from mlso_cli.codegen.scale import BufferScale, Storage, structural
from mlso_cli.codegen.teams import FOLD, LOOP_VAR, choose_mode, loop_header
from mlso_cli.codegen.vectorize import READ, plan_lane, wide_store
from mlso_cli.codegen.views import Strided, strided
from mlso_cli.ir.graph import PARTIAL, BlockGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import ACCUMULATORS, DType, Op, Phase

if TYPE_CHECKING:
    from mlso_cli.codegen.lower import Lowering

XYZ = ("x", "y", "z")
PHASES = (Phase.PRE, Phase.LOOP, Phase.POST)
ELEMENTWISE_BATCH = 8
"""Most elements one thread of an elementwise pass computes before it stores (see _elementwise)."""
HOIST_REGS = 48
"""Registers per thread the hoisted chunk offsets of the loop tiles may take (two per chunk)."""


@dataclass(frozen=True)
class Store:
    """One store of an elementwise pass: `dest op wrap(value)`, value an fp32 expression.
    op is "=", or "+=" / "*=" (read-modify-write of dest, which only this element's thread reads)."""

    dest: str
    value: str
    op: str = "="
    wrap: str = "{}"

    def line(self) -> str:
        return f"{self.dest} {self.op} {self.wrap.format(self.value)};"

    def computed(self) -> str:
        """The value to store, as an expression to evaluate before any store of the pass."""
        if self.op == "=":
            return self.value
        assert self.wrap == "{}", self
        return f"{self.dest} {self.op[0]} ({self.value})"


@dataclass(frozen=True)
class Walk:
    """What a team reduction folds per output o (block.py `_team_walk`)."""

    accs: tuple[tuple[str, str], ...]
    """(accumulator, teams.FOLD op) pairs, all folded in the same walk."""
    setup: list[str]
    """Statements per output before the walk, in every thread of its team."""
    lines: list[str]
    """Statements per value (in rr, the axis variable): the emitter's loads and arithmetic."""
    steps: list[str]
    """Statements per value that fold it into the accumulators."""
    tail: list[str]
    """Statements per output after the team's all-reduce, in one lane (accumulators whole)."""
    settle: Callable[[int], list[str]] = lambda width: []
    """Statements in every thread of a team of `width` once all accumulators but the last are
    whole, before the last is all-reduced (each thread still holds its share of it)."""


def _bool(b: bool) -> str:
    return "true" if b else "false"


class BlockKernel(BlockLayout):
    """Emission: prints the planned kernel (blocklayout.BlockLayout), deciding nothing new."""

    def __init__(self, lw: Lowering, gd: Node) -> None:
        super().__init__(gd.arg)
        self.lw = lw
        self.gd = gd
        self.name = lw.kernel_name()
        self.uses = lw.uses()
        self.hoisted: dict[int, tuple[int, int]] = {}
        """Loop tile -> (chunks per thread, elements per step) where its offsets are hoisted."""
        self.direct_aligned: dict[str, str] = {}
        """In-place PRE tiles (`_point`) whose every block starts 16-byte aligned: C types."""

    def _flash_args(self, plan: MatmulPlan, op: Operand, contiguous_last: bool) -> str:
        off = f"({self._batch_offset(op, plan.c.shape[:-2])})(0)"
        return f"{op.ptr} + {off}, {op.ld(contiguous_last)}"

    def _factor_pass(self, code: Code, f: Node, buf: str, what: str) -> None:
        """One factor per key into `buf` (fp32 shared memory), for the register pass to read."""

        def body(em: Emitter, coords: Coords) -> list[str]:
            return [Store(f"{buf}[e]", em.plain(f, coords))]

        code(f"// per-key factor of the {what}, {list(f.shape)}")
        self._elementwise(code, f.shape, body, vector=True)
        code("__syncthreads();")
        self._w(buf)

    def _pass_flash(self, code: Code, g: Group) -> None:
        form = self.flash_form
        sps = [self.plans[t] for t in form.terms]
        wp = self.plans[g.wsums[0]]
        vop, vk = self.flash_v
        self._r(*(p for sp in sps for p in (sp.a.ptr, sp.b.ptr)), vop.ptr)
        vs = ""
        if self.flash_f is not None:
            self._factor_pass(code, self.flash_f, self.flash_fbuf, "weighted operand")
            vs = f", {self.flash_fbuf}"
        if self.flash_red is not None:
            vs = (
                f"{vs or ', nullptr'}, {self.flash_red} + (warp % {self.flash_strips}) * "
                f"{self.flash_ksplit * 16 * g.s.shape[-1]}"
            )
        if self.flash_kbuf is not None:
            self._factor_pass(code, form.key_factor, self.flash_kbuf, "scores")
        ab = [
            f"{self._flash_args(sp, sp.a, sp.a_kmajor)}, {self._flash_args(sp, sp.b, not sp.b_kmajor)}"
            for sp in sps
        ]
        v = self._flash_args(wp, vop, not vk)
        if len(sps) == 1 and form.scale == 1 and self.flash_kbuf is None:
            code(
                "// online softmax in registers: s = matmul, m, l and exp(s - m) @ v per 16-row warp strip"
            )
            code(f"flash.step({ab[0]}, {v}, {self._flash_rows()}{vs});")
            return
        second = ab[1] if len(ab) > 1 else "nullptr, 0, nullptr, 0"
        code(
            f"// online softmax in registers: s = {' + '.join('matmul' for _ in sps)} (times "
            f"{float(form.scale)}{' and a per-key factor' if self.flash_kbuf else ''}), m, l and exp(s - m) @ v"
        )
        code(
            f"flash.step2({ab[0]}, {second}, {c_float(form.scale)}, {self.flash_kbuf or 'nullptr'}, {v}, "
            f"{self._flash_rows()}{vs});"
        )

    def _flash_rows(self) -> str:
        """This warp's first row and first value column: warps split rows into 16-row strips,
        then (flash_split > 1) the value columns of a strip."""
        if self.flash_split == 1:
            return "warp * 16, 0"
        return (
            f"(warp % {self.flash_strips}) * 16, (warp / {self.flash_strips}) * {self.flash_width}"
        )

    def _flash_decl(self) -> str:
        g = self.flash
        sps = [self.plans[t] for t in self.flash_form.terms]
        sp = sps[0]
        second = "".join(
            f", {p.a.shape[-1]}, {_bool(p.a_kmajor)}, {_bool(p.b_kmajor)}" for p in sps[1:]
        )
        return (
            f"mlso::FlashRows<{CTYPE[sp.dtype]}, {g.s.shape[-1]}, {sp.a.shape[-1]}, {self.flash_width}, "
            f"{_bool(sp.a_kmajor)}, {_bool(sp.b_kmajor)}, {_bool(self.flash_v[1])}, {self.flash_ksplit}{second}> flash;"
        )

    def _flash_flush(self, code: Code) -> None:
        g = self.flash
        w = self.storage[g.wsums[0]]
        sums = [self.storage[a].ptr for a in g.sums]
        code("// the register state to the shared-memory accumulators")
        if sums:
            code(f"float* const flash_l[] = {{{', '.join(sums)}}};")
        code(
            f"flash.flush({w.ptr}, {g.wsums[0].shape[-1]}, {'flash_l' if sums else 'nullptr'}, {len(sums)}, "
            f"{self.storage[g.m].ptr}, {self._flash_rows()});"
        )
        code("__syncthreads();")

    # ---- emission helpers --------------------------------------------------------------------
    def emitter(self) -> Emitter:
        return Emitter(self.storage, self.stab, self.names, self._note)

    def _note(self, n: Node) -> None:
        self._reads.add(self.storage[n].ptr)

    def _r(self, *ptrs: str) -> None:
        self._reads.update(ptrs)

    def _w(self, *ptrs: str) -> None:
        self._writes.update(ptrs)

    def kernel_emitter(self) -> Emitter:
        return self.lw.emitter(self.uses, self.names)

    def _elementwise(
        self,
        code: Code,
        shape: tuple[int, ...],
        body: Callable[[Emitter, Coords], list[Store]],
        vector: bool = False,
    ) -> None:
        """for every element e of `shape`, with threads striding: body(emitter, coords) computes
        the values and says where they go.

        Why batched: the values are read from shared memory through pointers nvcc cannot tell
        apart from the one stored to, so a loop that loads, computes and stores element by
        element waits out a shared-memory round trip per element (measured on the H200: a
        16 x 512 staging pass per loop step cost a third of a norm + linear kernel). Each thread
        therefore computes a batch of elements (all loads first) before it stores any of them.

        Why vectors (`vector`, for bodies whose coordinates may be any C expressions): a thread
        takes `width` neighbours along the last axis (lanes vj), reads and writes them with wide
        shared-memory accesses, and computes what does not depend on the lane (a row's mean, a
        group's scale) once per vector; vectorize.py decides which, by evaluating the indices."""
        width = self._vector_width(shape) if vector else 1
        if width > 1:
            self._vector_pass(code, shape, body, width)
            return
        count = numel(shape)
        em = self.emitter()
        stores = body(em, decompose("e", shape))
        batch = self._batch(count, ELEMENTWISE_BATCH)
        if batch == 1:
            with code.block(f"for (int e = threadIdx.x; e < {count}; e += {self.nt})"):
                code.extend(em.lines)
                code.extend(s.line() for s in stores)
            return
        with code.block(f"for (int eb = threadIdx.x; eb < {count}; eb += {self.nt * batch})"):
            code(*(f"float bv{i}[{batch}];" for i in range(len(stores))))
            code("#pragma unroll")
            with code.block(f"for (int ue = 0; ue < {batch}; ++ue)"):
                code(f"const int e = eb + ue * {self.nt};")
                code.extend(em.lines)
                code.extend(f"bv{i}[ue] = {s.computed()};" for i, s in enumerate(stores))
            code("#pragma unroll")
            with code.block(f"for (int ue = 0; ue < {batch}; ++ue)"):
                code(f"const int e = eb + ue * {self.nt};")
                code.extend(
                    f"{s.dest} = {s.wrap.format(f'bv{i}[ue]')};" for i, s in enumerate(stores)
                )

    def _vector_pass(
        self,
        code: Code,
        shape: tuple[int, ...],
        body: Callable[[Emitter, Coords], list[Store]],
        width: int,
    ) -> None:
        """_elementwise with `width` lanes per thread: per batch of vectors, the lane-invariant
        statements and wide loads (vectorize.plan_lane), the lanes' values, then the stores (one
        wide store where the destination is a contiguous aligned vector)."""
        vc = decompose("ev", (*shape[:-1], shape[-1] // width))
        last = "vj" if vc[-1] == "0" else f"({paren(vc[-1])} * {width} + vj)"
        em = self.emitter()
        stores = body(em, (*vc[:-1], last))
        count = numel(shape) // width
        batch = self._batch(count, max(1, ELEMENTWISE_BATCH // width))
        ctypes = self._aligned_buffers()
        lane = plan_lane(em.lines, count, width, ctypes)
        wide = [wide_store(s.dest, count, width, ctypes) if s.op == "=" else None for s in stores]
        flat = f"const int e = ev * {width} + vj;"
        needs_flat = any(re.search(r"\be\b", t) for t in (*lane.lane, *map(Store.line, stores)))
        slot = f"ue * {width} + vj"
        lanes = f"for (int vj = 0; vj < {width}; ++vj)"
        with code.block(f"for (int eb = threadIdx.x; eb < {count}; eb += {self.nt * batch})"):
            code(*(f"float bv{i}[{batch * width}];" for i in range(len(stores))))
            code("#pragma unroll")
            with code.block(f"for (int ue = 0; ue < {batch}; ++ue)"):
                code(f"const int ev = eb + ue * {self.nt};")
                code.extend(lane.pre)
                code("#pragma unroll")
                with code.block(lanes):
                    code.extend([flat] if needs_flat else [])
                    code.extend(lane.lane)
                    code.extend(f"bv{i}[{slot}] = {s.computed()};" for i, s in enumerate(stores))
            code("#pragma unroll")
            with code.block(f"for (int ue = 0; ue < {batch}; ++ue)"):
                code(f"const int ev = eb + ue * {self.nt};")
                for i, (s, w) in enumerate(zip(stores, wide)):
                    if w is None:
                        continue
                    ctype, first = w
                    vec = f"mlso::vec<{ctype}, {width}>"
                    with code.block(""):
                        code(f"{vec} pv;")
                        code("#pragma unroll")
                        with code.block(lanes):
                            code(f"pv.v[vj] = {s.wrap.format(f'bv{i}[{slot}]')};")
                        code(f"*reinterpret_cast<{vec}*>(&{first}) = pv;")
                narrow = [(i, s) for i, (s, w) in enumerate(zip(stores, wide)) if w is None]
                if narrow:
                    code("#pragma unroll")
                    with code.block(lanes):
                        code.extend([flat] if needs_flat else [])
                        code.extend(
                            f"{s.dest} = {s.wrap.format(f'bv{i}[{slot}]')};" for i, s in narrow
                        )

    def _aligned_buffers(self) -> dict[str, str]:
        """Shared-memory buffers by name -> C element type, each 128-byte aligned: the allocated
        ones, and the loop tiles' per-step aliases (every stage of which is allocated)."""
        out = {name: ctype for ctype, name, _ in self.ptrs} | self.direct_aligned
        for it in self.loop_iters:
            stages = [f"s{it.arg}_{k}" for k in range(self.nstage)]
            if all(st in out for st in stages):
                out[f"s{it.arg}"] = CTYPE[it.dtype]
        return out

    def _batch(self, count: int, most: int) -> int:
        """Items per thread per batch: the most, up to `most`, that divides each thread's share."""
        per = count // self.nt if count % self.nt == 0 else 0
        return max((u for u in range(1, most + 1) if per and per % u == 0), default=1)

    def _vector_width(self, shape: tuple[int, ...]) -> int:
        """Neighbours per thread along the last axis: 8, 4 or 2 where that divides the axis and
        still leaves every thread of the block a vector; else 1."""
        n = numel(shape)
        for width in (8, 4, 2):
            if shape and shape[-1] % width == 0 and n // width >= self.nt:
                return width
        return 1

    def _team(
        self,
        code: Code,
        out_shape: tuple[int, ...],
        length: int,
        op: str,
        body: Callable[[Emitter, Coords], str],
        finish: Callable[[Emitter, Coords, str], list[str]],
    ) -> None:
        """Reduce `length` values per element of out_shape; tokens are over `o`, the axis is rr."""
        tokens = decompose("o", out_shape)
        em = self.emitter()
        expr = body(em, tokens)
        fin = self.emitter()
        tail = finish(fin, tokens, "acc")
        fold = FOLD[op][1].format(a="acc", b=expr)
        walk = Walk((("acc", op),), [], em.lines, [f"acc = {fold};"], fin.lines + tail)
        self._team_walk(code, numel(out_shape), length, walk)

    def _team_walk(self, code: Code, count: int, length: int, walk: Walk) -> None:
        """One walk per output o (of `count`) over its `length` values, by a team whose size
        teams.choose_mode picks: a thread, lanes of a warp, or the whole block."""
        mode = choose_mode(length, count, True, self.nw)
        if mode == "thread":
            with code.block(f"for (int o = threadIdx.x; o < {count}; o += {self.nt})"):
                code.extend(walk.setup)
                self._fold_loop(code, walk, length, mode)
                self._all_reduce(code, walk, 1, None)
                code.extend(walk.tail)
        elif mode == "warp":
            team = self._team_width(length, count)
            per = 32 // team
            with code.block(f"for (int ob = warp * {per}; ob < {count}; ob += {self.nw * per})"):
                code(f"const int o = ob + (lane / {team}), tl = lane % {team};")
                code.extend(walk.setup)
                code(*(f"float {acc} = {FOLD[op][0]};" for acc, op in walk.accs))
                if not self._vector_team(code, walk.lines, walk.steps, count, length, team):
                    head, first = self._team_loop(code, team, length)
                    with code.block(head):
                        code.extend(first + walk.lines + walk.steps)
                self._all_reduce(
                    code,
                    walk,
                    team,
                    lambda acc, op: f"{acc} = mlso::warp_allreduce<{FOLD[op][2]}, {team}>({acc});",
                )
                with code.block("if (tl == 0)"):
                    code.extend(walk.tail)
        else:
            with code.block(f"for (int o = 0; o < {count}; ++o)"):
                code.extend(walk.setup)
                self._fold_loop(code, walk, length, mode)
                self._all_reduce(
                    code,
                    walk,
                    self.nt,
                    lambda acc, op: (
                        f"{acc} = mlso::block_allreduce<{FOLD[op][2]}, {self.nt}>({acc}, red);"
                    ),
                )
                with code.block("if (threadIdx.x == 0)"):
                    code.extend(walk.tail)

    @staticmethod
    def _all_reduce(
        code: Code, walk: Walk, width: int, reduce: Callable[[str, str], str] | None
    ) -> None:
        """The team's all-reduce of each accumulator in turn (reduce(acc, op): the statement;
        None for a team of one thread), with walk.settle before the last one."""
        *rest, (last, op) = walk.accs
        if reduce is not None:
            code(*(reduce(acc, o) for acc, o in rest))
        code.extend(walk.settle(width))
        if reduce is not None:
            code(reduce(last, op))

    def _fold_loop(self, code: Code, walk: Walk, length: int, mode: str) -> None:
        """The walk of a thread (mode "thread") or of each thread of the block ("block") over
        one output's values, all accumulators at once."""
        code(*(f"float {acc} = {FOLD[op][0]};" for acc, op in walk.accs))
        with code.block(loop_header(mode, length, self.nt)):
            code.extend(walk.lines + walk.steps)

    def _vector_team(
        self,
        code: Code,
        lines: list[str],
        steps: list[str],
        count: int,
        length: int,
        team: int,
    ) -> bool:
        """A team's walk over its row `width` neighbours at a time, where that makes a wide
        load: lane tl of the team takes vectors rv = tl, tl + team, ... of the row, each read
        with one 16-byte (8-, 4-byte) shared-memory load, and computes what does not depend on
        the element once per vector (vectorize.plan_lane). Why: a team that reads 16-bit
        elements one at a time issues a load and waits out its latency per element; rmsnorm +
        linear's in-loop sum of squares (16 rows of 512 halves a step) cost 4 of its 27 µs
        that way on the H200. Returns False (nothing emitted) where no read gets wider."""
        if any(READ.search(st) for st in steps):
            return False
        ctypes = self._aligned_buffers()
        for width in (8, 4, 2):
            if length % (team * width):
                continue
            walk = f"(rv * {width} + vj)"
            vlines = [re.sub(rf"\b{LOOP_VAR}\b", walk, t) for t in lines]
            vsteps = [re.sub(rf"\b{LOOP_VAR}\b", walk, t) for t in steps]
            lane = plan_lane(vlines, {"o": count, "rv": length // width}, width, ctypes)
            if not lane.wide_loads:
                continue
            n = length // (team * width)
            code("#pragma unroll")
            with code.block(f"for (int ri = 0; ri < {n}; ++ri)"):
                code(f"const int rv = ((ri + lane / {team}) % {n}) * {team} + tl;")
                code.extend(lane.pre)
                code("#pragma unroll")
                with code.block(f"for (int vj = 0; vj < {width}; ++vj)"):
                    code.extend(lane.lane)
                    code.extend(vsteps)
            return True
        return False

    # ---- passes ------------------------------------------------------------------------------
    def _pass_stage(self, code: Code, st: Stage) -> None:
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
        self._elementwise(code, st.src.shape, body, vector=st.scale is None)
        self._w(s.ptr)

    def _batch_offset(self, op: Operand, out_batch: tuple[int, ...]) -> str:
        bt = decompose("bt", out_batch)
        lead = bcast(op.shape[:-2], bt)
        return f"[&](int bt) -> int {{ return {offset(lead, op.strides[:-2], op.base)}; }}"

    def _pass_matmul(self, code: Code, plan: MatmulPlan, what: str) -> None:
        a, b, c = plan.a, plan.b, plan.c
        self._r(
            a.ptr,
            b.ptr,
            *([c.ptr] if plan.accumulate else []),
            *([plan.row_scale] if plan.row_scale else []),
        )
        self._w(c.ptr)
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
            mp = _ceil_to(m, 16)
            nb = strip_width(batch, m, n, k, self.nw)
            lda, ldb = a.ld(plan.a_kmajor), b.ld(not plan.b_kmajor)
            code(
                f"mlso::block_mma<{CTYPE[plan.dtype]}, {batch}, {mp}, {m}, {n}, {k}, {nb}, {_bool(plan.a_kmajor)}, "
                f"{_bool(plan.b_kmajor)}, {_bool(plan.accumulate)}, {self.nw}>({a.ptr}, {lda}, "
                f"{self._batch_offset(a, out_batch)}, {b.ptr}, {ldb}, {self._batch_offset(b, out_batch)}, "
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
            with code.block(f"for (int o = threadIdx.x; o < {total}; o += {self.nt})"):
                code.extend(head)
                code(f"float acc = {init};")
                with code.block(f"for (int kk = 0; kk < {k}; ++kk)"):
                    code(f"acc = fmaf({ea}, {eb}, acc);")
                code(f"{c.ptr}[{co}] = acc;")
        else:
            with code.block(f"for (int o = warp; o < {total}; o += {self.nw})"):
                code.extend(head)
                code("float acc = 0.0f;")
                with code.block(f"for (int kk = lane; kk < {k}; kk += 32)"):
                    code(f"acc = fmaf({ea}, {eb}, acc);")
                code("acc = mlso::warp_sum(acc);")
                with code.block("if (lane == 0)"):
                    code(f"{c.ptr}[{co}] = {init} + acc;")

    def _pass_node_matmul(self, code: Code, n: Node) -> None:
        self._pass_matmul(code, self.plans[n], f"matmul -> {list(n.shape)}")

    def _pass_reduce(self, code: Code, n: Node) -> None:
        into = self.fused_reduce.get(n)
        st = self.storage[into] if into is not None else self.storage[n]
        self._w(st.ptr)
        if into is not None:
            self._r(st.ptr)
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
        self._team(code, n.shape, length, op, body, finish)

    def _pass_moments(self, code: Code, r2: Node) -> None:
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
        m = self.moments[r2]
        first, second = self.storage[m.first], self.storage[r2]
        assert first.scale is None and second.scale is None, "moments of scaled values"
        self._w(first.ptr, second.ptr)
        u, axis = m.u, r2.arg
        length = u.shape[axis]
        tokens = decompose("o", r2.shape)

        def at(rr: str) -> Coords:
            c = list(tokens)
            c[axis] = rr
            return canon(u.shape, c)

        # local names (no buffer is named so): the shift, the three sums, u - K, a - K
        k, total, s1, s2, du, ak = "mom_k", "mom_u", "mom_sum", "mom_sq", "mom_d", "mom_c"
        em = self.emitter()
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
                **self.storage,
                m.first: Storage(f"(&{total})", DType.F32, r2.shape, (0,) * len(r2.shape)),
            }
            fin = Emitter(local, self.stab, self.names)
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
        head = self.emitter()
        shift = head.plain(u, at("0"))  # the row's first value
        setup = [*head.lines, f"const float {k} = {shift};"]
        walk = Walk(accs, setup, em.lines, steps, tail, settle)
        self._team_walk(code, r2.numel, length, walk)

    def _pass_acc_sum(self, code: Code, n: Node) -> None:
        if n.src[0] in self.fused:
            self._pass_matmul(code, self.plans[n.src[0]], "accumulate matmul")
            return
        st = self.storage[n]
        self._r(st.ptr)
        self._w(st.ptr)

        def body(em: Emitter, coords: Coords) -> list[str]:
            return [Store(f"{st.ptr}[e]", em.plain(n.src[0], coords), "+=")]

        code(f"// acc_sum{list(n.shape)}")
        self._elementwise(code, n.shape, body, vector=True)

    def _team_width(self, length: int, rows: int) -> int:
        """Lanes per row for a row pass: enough teams that every row gets one at once (when the
        block has that many lanes), at most 16 elements per lane, rows a multiple of 32/width."""
        t_min = 1
        while t_min < 32 and -(-length // t_min) > 16:
            t_min *= 2
        t_par = 32
        while t_par > 1 and (32 // t_par) * self.nw < rows:
            t_par //= 2
        t = min(32, max(t_min, t_par))
        while t < 32 and rows % (32 // t):
            t *= 2
        return t

    @staticmethod
    def _team_loop(code: Code, team: int, length: int) -> tuple[str, list[str]]:
        """The loop of a team of `team` lanes over one row of `length`: (header, first lines).
        Where rows of a power-of-two fp32 stride would put every team's lanes on the same banks,
        each team starts its walk at a different column block (the fold is order-independent)."""
        code("#pragma unroll")
        if team < 32 and length % team == 0:
            n = length // team
            return (
                f"for (int ri = 0; ri < {n}; ++ri)",
                [f"const int {LOOP_VAR} = ((ri + lane / {team}) % {n}) * {team} + tl;"],
            )
        return f"for (int {LOOP_VAR} = tl; {LOOP_VAR} < {length}; {LOOP_VAR} += {team})", []

    def _row_loop(
        self, code: Code, warp_mode: bool, team: int, length: int, start: str, step: str
    ) -> tuple[str, list[str]]:
        if warp_mode:
            return self._team_loop(code, team, length)
        code("#pragma unroll 4")
        return f"for (int {LOOP_VAR} = {start}; {LOOP_VAR} < {length}; {LOOP_VAR} += {step})", []

    def _pass_group_rows(self, code: Code, g: Group) -> None:
        """One pass per row r of s (a team of lanes per row, or a thread when rows are short):
        m' = max(m, max_c s[r, c]); alpha = exp(m - m'); p = exp(s - m') (staged for P @ v);
        sum accumulators l = l * alpha + sum_c p; m = m'. Weighted sums are rescaled by alpha
        (kept in g.alpha) as the P @ v matmul loads them."""
        m, s = self.storage[g.m], g.s
        length, rows = s.shape[-1], g.m.numel
        warp_mode = length >= 32
        tokens = decompose("o", g.m.shape)
        sc = canon(s.shape, tokens[:-1] + (LOOP_VAR,))
        team = self._team_width(length, rows) if warp_mode else 1
        start, step = ("tl", str(team)) if warp_mode else ("0", "1")
        self._r(m.ptr, *(self.storage[a].ptr for a in g.sums))
        self._w(m.ptr, *(self.storage[a].ptr for a in g.sums))
        if g.wsums:
            self._w(g.alpha)
        code(
            f"// rescaling accumulators over s{list(s.shape)}: row max, rescale, exp(s - m), row sums"
            + (f" ({team} lanes per row)" if warp_mode else "")
        )
        per = 32 // team
        head = (
            f"for (int ob = warp * {per}; ob < {rows}; ob += {self.nw * per})"
            if warp_mode
            else f"for (int o = threadIdx.x; o < {rows}; o += {self.nt})"
        )
        with code.block(head):
            if warp_mode:
                code(f"const int o = ob + (lane / {team}), tl = lane % {team};")
            em = self.emitter()
            v = em.plain(s, sc)
            code("float mx = mlso::neg_inf();")
            head, first = self._row_loop(code, warp_mode, team, length, start, step)
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
            em = self.emitter()
            v = em.plain(s, sc)
            head, first = self._row_loop(code, warp_mode, team, length, start, step)
            with code.block(head):
                code.extend(first + em.lines)
                code(f"const float p = mlso::exp_rel({v}, mn);", "sm += p;")
                if g.wsums:
                    p = g.p
                    self._w(p.ptr)
                    code(f"{p.ptr}[{offset(sc, p.strides)}] = mlso::from_f32<{CTYPE[p.dtype]}>(p);")
            if warp_mode and g.sums:
                code(f"sm = mlso::warp_allreduce<mlso::SumOp, {team}>(sm);")
            if warp_mode:
                code("__syncwarp();")
            tail = [f"{m.ptr}[o] = mn;"] + [
                f"{self.storage[a].ptr}[o] = {self.storage[a].ptr}[o] * alpha + sm;" for a in g.sums
            ]
            if g.wsums:
                tail.append(f"{g.alpha}[o] = alpha;")
            if warp_mode:
                with code.block("if (tl == 0)"):
                    code.extend(tail)
            else:
                code.extend(tail)

    def _pass_group(self, code: Code, g: Group) -> None:
        """General form (weighted sums whose rows do not align with s's rows): separate passes."""
        m, s = self.storage[g.m], g.s
        length = s.shape[-1]
        touched = [m.ptr, g.alpha, *(self.storage[a].ptr for a in g.sums + g.wsums)] + (
            [g.p.ptr] if g.p else []
        )
        self._r(*touched)
        self._w(*touched)

        def s_coords(tokens: Coords) -> Coords:
            return canon(s.shape, tokens[:-1] + (LOOP_VAR,))

        code(
            f"// rescaling accumulators over s{list(s.shape)}: running max, rescale, add exp(s - m)"
        )

        def rowmax(em: Emitter, tokens: Coords) -> str:
            return em.plain(s, s_coords(tokens))

        def raise_max(em: Emitter, tokens: Coords, acc: str) -> list[str]:
            return [
                f"const float mo = {m.ptr}[o];",
                f"const float mn = fmaxf(mo, {acc});",
                f"{g.alpha}[o] = mlso::rescale(mo, mn);",
                f"{m.ptr}[o] = mn;",
            ]

        self._team(code, g.m.shape, length, "max", rowmax, raise_max)
        code("__syncthreads();")
        for acc in g.sums:
            a = self.storage[acc]

            def expsum(em: Emitter, tokens: Coords) -> str:
                return f"mlso::exp_rel({em.plain(s, s_coords(tokens))}, {m.ptr}[o])"

            def add(em: Emitter, tokens: Coords, v: str, a: Storage = a) -> list[str]:
                return [f"{a.ptr}[o] = {a.ptr}[o] * {g.alpha}[o] + {v};"]

            self._team(code, g.m.shape, length, "sum", expsum, add)
        for acc in g.wsums:
            a = self.storage[acc]
            rows = self._row_index(g, acc.shape)

            def rescale(em: Emitter, coords: Coords, a: Storage = a, rows=rows) -> list[str]:
                return [Store(f"{a.ptr}[e]", f"{g.alpha}[{rows(coords)}]", "*=")]

            self._elementwise(code, acc.shape, rescale)
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

            self._elementwise(code, s.shape, stage_p)

    def _row_index(self, g: Group, shape: tuple[int, ...]) -> Callable[[Coords], str]:
        """Offset into the running max of a WSUM element at coords (rows align to s's rows)."""
        ms = g.m.shape
        lead = len(shape) - len(ms)

        def index(coords: Coords) -> str:
            mc = tuple(
                "0" if (j == len(ms) - 1 or ms[j] == 1) else coords[j + lead]
                for j in range(len(ms))
            )
            return offset(mc, contiguous(ms))

        return index

    def _pass_save(self, code: Code, save: Node, written: set[Node]) -> None:
        om = save.arg.omap
        proj = self.proj_storage[save.arg.index]
        ctype = CTYPE[proj.dtype]
        tile = save.shape
        partial_dims = [g for g in range(3) if om[g] == PARTIAL]
        em = self.emitter()
        tokens = decompose("e", tile)
        v = em.value(save.src[0], tokens)
        val = None
        mwrite = None
        if v.scale is not None and partial_dims and proj.buffer.kind == "scratch":
            mwrite = self._partial_max(save, v.scale, tokens, partial_dims)
            if mwrite is not None:
                val = v.code
        if val is None:
            val = em.materialise(v)
        gcoords = self._global_coords(tokens, tile, om, partial_dims)
        code(f"// save output {save.arg.index}{' (scaled partial + its max)' if mwrite else ''}")
        with code.block(f"for (int e = threadIdx.x; e < {numel(tile)}; e += {self.nt})"):
            code.extend(em.lines)
            code(f"{proj.ptr}[{offset(gcoords, proj.strides)}] = mlso::from_f32<{ctype}>({val});")
        if mwrite is not None:
            m_node, mbuf = mwrite
            if mbuf not in written:
                written.add(mbuf)
                mt = decompose("e", m_node.shape)
                g2 = self._global_coords(mt, m_node.shape, om, partial_dims)
                mst = self.lw.storage[mbuf]
                with code.block(f"for (int e = threadIdx.x; e < {m_node.numel}; e += {self.nt})"):
                    code(f"{mst.ptr}[{offset(g2, mst.strides)}] = {self.storage[m_node].ptr}[e];")

    def _global_coords(
        self, tokens: Coords, tile: tuple[int, ...], om, partial_dims: list[int]
    ) -> Coords:
        out = [f"(int)blockIdx.{XYZ[g]}" for g in partial_dims]
        for d, t in enumerate(tokens):
            terms = [t] if t != "0" else []
            for g in range(3):
                if om[g] == d and self.bg.grid[g] > 1:
                    terms.append(f"(int)blockIdx.{XYZ[g]} * {tile[d]}")
            out.append(" + ".join(terms) if terms else "0")
        return tuple(out)

    def _partial_max(self, save: Node, scale, tokens: Coords, partial_dims: list[int]):
        """Register the max side buffer of a scaled partial save; None if its layout is not simple."""
        bs = structural(scale, tokens)
        m_node = scale.key
        tile = save.shape
        if bs is None or m_node not in self.storage or len(m_node.shape) != len(tile):
            return None
        for j, f in enumerate(bs.mfunc):
            if not (f == (j, 1) and m_node.shape[j] == tile[j]) and not (
                f is None and m_node.shape[j] == 1
            ):
                return None
        om = save.arg.omap
        grid = self.bg.grid
        full = tuple(grid[g] for g in partial_dims) + tuple(
            m_node.shape[j] * next((grid[g] for g in range(3) if om[g] == j), 1)
            for j in range(len(tile))
        )
        mbuf = synthetic.partial_max(self.gd, m_node, om, full)
        mst = self.lw.scratch_storage(mbuf)
        self.uses.write(mst.buffer)
        npart = len(partial_dims)
        mfunc: list[tuple[int, int] | None] = [(p, 1) for p in range(npart)]
        for j, f in enumerate(bs.mfunc):
            split = any(om[g] == j and grid[g] > 1 for g in range(3))
            if f is not None:
                mfunc.append((npart + j, 1))
            elif split:
                mfunc.append((npart + j, tile[j]))
            else:
                mfunc.append(None)
        self.proj_storage[save.arg.index].scale = BufferScale(mbuf, scale.degree, tuple(mfunc))
        return m_node, mbuf

    # ---- loads -------------------------------------------------------------------------------
    def _chunked_view(self, it: Node) -> Strided | None:
        """The global view tile `it` is copied from in 16-byte chunks, or None when it is not: a
        strided view of a stored tensor of the tile's type, contiguous and 16-byte aligned along
        the last axis, in global and shared memory."""
        view = strided(self.gd.src[it.arg], self.lw.storage)
        if view is None or not it.shape:
            return None
        gst = self.lw.storage[view.leaf]
        st = self.storage[it]
        vec = 16 // it.dtype.itemsize
        chunked = (
            gst.dtype == it.dtype
            and gst.scale is None
            and view.strides[-1] == 1
            and it.shape[-1] % vec == 0
            and view.base % vec == 0
            and all(s % vec == 0 for s in view.strides[:-1])
            and st.strides[-1] == 1
            and all(s % vec == 0 for s in st.strides[:-1])
        )
        return view if chunked else None

    def _tile_coords(self, it: Node, step: str | None) -> Callable[[Coords], Coords]:
        """Tile coordinates -> coordinates in the global tensor: plus the block's offset along
        each grid-mapped axis and, for a loop tile at step `step`, the step's along the loop axis."""
        src, im, tile = self.gd.src[it.arg], self.bg.inputs[it.arg], it.shape
        base = []
        for d in range(len(tile)):
            terms = [
                f"(int)blockIdx.{XYZ[g]} * {src.shape[d] // self.bg.grid[g]}"
                for g in range(3)
                if im.imap[g] == d and self.bg.grid[g] > 1
            ]
            if im.fmap == d and step is not None and self.bg.loop > 1:
                terms.append(f"({step}) * {tile[d]}")
            base.append(terms)
        return lambda t: tuple(
            " + ".join(([c] if c != "0" else []) + b) or "0" for c, b in zip(t, base)
        )

    @staticmethod
    def _chunk_coords(tile: tuple[int, ...], vec: int) -> Coords:
        """Tile coordinates of the first element of 16-byte chunk `c` (row-major chunks)."""
        per_row = tile[-1] // vec
        rows = "c" if per_row == 1 else f"(c / {per_row})"
        return decompose(rows, tile[:-1]) + ("0" if per_row == 1 else f"(c % {per_row}) * {vec}",)

    def _hoist_offsets(self, code: Code) -> None:
        """Per-thread chunk offsets of the loop tiles, computed once before the prologue: every
        step's copy of a tile reads the same chunks at the same places but one step further along
        the loop axis, so a step costs one add and one cp.async per chunk instead of each chunk's
        index arithmetic (a division, a remainder and 64-bit address math: about 19 instructions
        per chunk, most of what a loop that streams a weight tile issues for its copies). Only
        tiles whose chunks divide evenly over the block, within HOIST_REGS registers in all."""
        budget = HOIST_REGS
        for it in sorted(self.loop_iters, key=lambda n: -n.numel):
            view = self._chunked_view(it)
            if view is None:
                continue
            vec = 16 // it.dtype.itemsize
            chunks = numel(it.shape) // vec
            per = chunks // self.nt
            if chunks % self.nt or 2 * per > budget:
                continue
            budget -= 2 * per
            i, im = it.arg, self.bg.inputs[it.arg]
            loops = self.bg.loop > 1 and im.fmap is not None
            step_elems = it.shape[im.fmap] * view.strides[im.fmap] if loops else 0
            t = self._chunk_coords(it.shape, vec)
            g = self._tile_coords(it, None)(t)
            code(f"int go{i}[{per}], so{i}[{per}];", "#pragma unroll")
            with code.block(f"for (int u = 0; u < {per}; ++u)"):
                code(
                    f"const int c = threadIdx.x + u * {self.nt};",
                    f"go{i}[u] = {offset(g, view.strides, view.base)};",
                    f"so{i}[u] = {offset(t, self.storage[it].strides)};",
                )
            self.hoisted[i] = (per, step_elems)

    def _load(self, code: Code, it: Node, step: str | None, dst: str, asynchronous: bool) -> None:
        i = it.arg
        src = self.gd.src[i]
        tile = it.shape
        st = self.storage[it]
        ctype = CTYPE[it.dtype]
        gcoords = self._tile_coords(it, step)
        view = self._chunked_view(it)
        if view is not None:
            gst = self.lw.storage[view.leaf]
            self.uses.read(view.leaf)
            hoisted = self.hoisted.get(i)
            if hoisted is not None and step is not None:
                per, step_elems = hoisted
                code(
                    f"mlso::copy_offsets<{_bool(asynchronous)}, {per}>({gst.ptr} + ({step}) * "
                    f"{step_elems}, {dst}, go{i}, so{i});"
                )
                return
            vec = 16 // it.dtype.itemsize
            t = self._chunk_coords(tile, vec)
            code(
                f"mlso::copy_chunks<{_bool(asynchronous)}, {self.nt}, {numel(tile) // vec}>("
                f"[&](int c) -> const {ctype}* {{ return {gst.ptr} + {offset(gcoords(t), view.strides, view.base)}; }}, "
                f"[&](int c) -> {ctype}* {{ return {dst} + {offset(t, st.strides)}; }});"
            )
            return
        em = self.kernel_emitter()
        t = decompose("e", tile)
        val = em.plain(src, gcoords(t))
        body = " ".join(em.lines)
        code(
            f"mlso::copy_elements<{self.nt}, {numel(tile)}>([&](int e) {{ {body} "
            f"{dst}[{offset(t, st.strides)}] = mlso::from_f32<{ctype}>({val}); }});"
        )

    def _point(self, code: Code, it: Node) -> None:
        """`g<arg>`: a PRE tile read in place (blockanalysis `direct`). A strided view of a stored
        tensor of the tile's type is a pointer to the block's first element, with the global
        strides (16-byte loads where the chunked copy could use them); anything else (a cast, a
        computed view) an indexed accessor that computes element e as `_load` would store it."""
        i, name, ctype = it.arg, f"g{it.arg}", CTYPE[it.dtype]
        gcoords = self._tile_coords(it, None)
        view = strided(self.gd.src[i], self.lw.storage)
        gst = None if view is None else self.lw.storage[view.leaf]
        if gst is not None and gst.dtype == it.dtype and gst.scale is None:
            self.uses.read(view.leaf)
            origin = offset(gcoords(tuple("0" for _ in it.shape)), view.strides, view.base)
            code(f"const {ctype}* const {name} = {gst.ptr} + {origin};")
            self.storage[it] = Storage(name, it.dtype, it.shape, view.strides)
            if self._chunked_view(it) is not None:
                self.direct_aligned[name] = ctype
            return
        em = self.kernel_emitter()
        t = decompose("e", it.shape)
        val = em.plain(self.gd.src[i], gcoords(t))
        code(
            f"const auto {name} = mlso::indexed([&](int e) -> float {{ {' '.join(em.lines)} "
            f"return mlso::to_f32(mlso::from_f32<{ctype}>({val})); }});"
        )

    # ---- the kernel --------------------------------------------------------------------------
    def build(self) -> Kernel:
        layout = self.plan()
        if not layout.fits:
            raise CodegenError(
                f"graph-defined kernel needs {layout.smem} bytes of shared memory "
                f"(limit {SMEM_BUDGET[CODEGEN_ARCH]})",
                "Choose smaller tiles (a larger grid or loop) for this block graph; "
                "mlso_cli.codegen.budget.check rejects this graph for the same reason.",
            )
        self.proj_storage: dict[int, Storage] = {}
        projs = {
            n.arg: n
            for n in self.lw.order
            if n.op is Op.PROJ and isinstance(n.arg, int) and n.src[0] == self.gd
        }
        for idx, save in enumerate(self.bg.outputs):
            proj = projs.get(idx)
            if proj is None:
                proj = Node(Op.PROJ, (self.gd,), idx, self.bg.output_shape(save), save.dtype)
            st = self.lw.storage.get(proj) or self.lw.scratch_storage(proj)
            self.proj_storage[idx] = st
            self.uses.write(st.buffer)
        body = Code(1)
        self._emit_body(body)
        code = Code()
        code(self.uses.signature(self.name, self.nt) + " {")
        code.lines.extend(body.lines)
        code("}")
        what = f"graph-defined kernel, grid {list(self.bg.grid)}, loop {self.bg.loop}"
        return Kernel(
            self.name,
            code.text(),
            self.bg.grid,
            (self.nt, 1, 1),
            self.smem,
            self.uses.params(),
            what,
        )

    def _stage_ptr(self, i: int, step: str) -> str:
        """The buffer of loop tile i that holds step `step` (a C expression)."""
        if self.nstage == 2:
            return f"(({step}) & 1 ? s{i}_1 : s{i}_0)"
        k = f"(({step}) % {self.nstage})"
        expr = f"s{i}_{self.nstage - 1}"
        for j in range(self.nstage - 2, -1, -1):
            expr = f"({k} == {j} ? s{i}_{j} : {expr})"
        return expr

    def _pass_list(self) -> tuple[dict[Phase, list[Callable[[Code], None]]], list[Node]]:
        """Passes per phase in dependency order, and the SAVE nodes. Staging copies go right
        before their first matmul when in the same phase, else at the end of the operand's phase."""
        passes: dict[Phase, list[Callable[[Code], None]]] = {p: [] for p in PHASES}
        saves: list[Node] = []
        last_of_group = {}
        for n in self.order:
            if n in self.group_of:
                last_of_group[self.group_of[n].s] = n

        staged: set[int] = set()  # each staging copy is written once, before its first matmul

        def stage(plans: list[MatmulPlan]) -> None:
            for plan in plans:
                for st in plan.stages:
                    if id(st) not in staged:
                        staged.add(id(st))
                        passes[st.phase].append(lambda c, st=st: self._pass_stage(c, st))

        for n in self.order:
            if n.op is Op.ITER or n in (g.m for g in self.groups.values()):
                continue
            if n.op is Op.SAVE:
                saves.append(n)
                continue
            if n in self.group_of:
                g = self.group_of[n]
                if last_of_group[g.s] is n:
                    plans = [self.plans[w] for w in g.wsums]
                    if not (g is self.flash and self.flash_f is not None):
                        stage(
                            plans
                        )  # (a scaled weighted operand is read unscaled by the register pass)
                    if g is self.flash:
                        passes[Phase.LOOP].append(lambda c, g=g: self._pass_flash(c, g))
                        continue
                    if self._rows_aligned(g):
                        passes[Phase.LOOP].append(lambda c, g=g: self._pass_group_rows(c, g))
                    else:
                        passes[Phase.LOOP].append(lambda c, g=g: self._pass_group(c, g))
                    for plan in plans:
                        passes[Phase.LOOP].append(
                            lambda c, plan=plan: self._pass_matmul(c, plan, "exp(s - m) @ v")
                        )
                continue
            if n.op in ACCUMULATORS:
                if n.src[0] in self.fused_reduce:
                    passes[Phase.LOOP].append(lambda c, r=n.src[0]: self._pass_reduce(c, r))
                    continue
                if n.src[0] in self.fused:
                    stage([self.plans[n.src[0]]])
                passes[Phase.LOOP].append(lambda c, n=n: self._pass_acc_sum(c, n))
                continue
            if n in self.moment_firsts:
                continue  # computed by the moments pass of its second reduction
            rule = MOMENTS if n in self.moments else PASSES.get(n.op)
            if rule is None:
                raise CodegenError(f"block op {n.op.value} has no pass")
            phase = n.phase or Phase.PRE
            if n in self.plans:
                stage([self.plans[n]])
            if self.flash is not None and n in self.flash_form.terms:
                continue  # computed inside the register pass of its group
            passes[phase].append(lambda c, n=n, rule=rule: rule(self, c, n))
        return passes, saves

    def _emit_passes(self, code: Code, passes: list[Callable[[Code], None]]) -> None:
        """Emit passes with the barriers barriers.emit_with_barriers finds necessary."""

        def reset() -> None:
            self._reads, self._writes = set(), set()

        emit_with_barriers(code, passes, reset, lambda: (self._reads, self._writes))

    def _emit_body(self, code: Code) -> None:
        code("MLSO_DYNAMIC_SMEM(smem);")
        code("const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;")
        code("(void)lane; (void)warp;")
        for ctype, name, off in self.ptrs:
            code(f"{ctype}* const {name} = reinterpret_cast<{ctype}*>(smem + {off});")
        self._reads, self._writes = set(), set()
        loop_iters, ns, loop = self.loop_iters, self.nstage, self.bg.loop
        for it in self.iters:
            if it in self.direct:
                self._point(code, it)
            elif it.phase is Phase.PRE:
                self._load(code, it, None, f"s{it.arg}", True)
        if loop_iters:
            # the PRE tiles are one cp.async group and each prologue stage another: the PRE
            # passes wait for their own tiles only, and run while the first stages still load.
            # The loop's wait<ns - 1> counts on ns - 1 prologue groups: the layout only deepens
            # the pipeline for loops of at least 3 steps (blocklayout.py).
            assert loop >= ns - 1, (loop, ns)
            self._hoist_offsets(code)
            code("mlso::cp_async_commit();")
            for k in range(ns - 1):
                for it in loop_iters:
                    self._load(code, it, str(k), f"s{it.arg}_{k}", True)
                code("mlso::cp_async_commit();")
            code(f"mlso::cp_async_wait<{ns - 1}>();", "__syncthreads();")
        else:
            code("mlso::cp_async_commit();", "mlso::cp_async_wait<0>();", "__syncthreads();")
        passes, saves = self._pass_list()
        self._emit_passes(code, passes[Phase.PRE])
        code("__syncthreads();")
        inits = [n for n in self.order if n.op in ACCUMULATORS]
        for acc in inits:
            if acc is self.flash_alias:
                continue  # shares the loop tiles' memory; written once, by the register pass's flush
            st = self.storage[acc]
            extent = st.strides[0] * st.shape[0] if st.shape else 1  # padding rows included
            code(f"for (int e = threadIdx.x; e < {extent}; e += {self.nt}) {st.ptr}[e] = 0.0f;")
        for g in self.groups.values():
            code(
                f"for (int e = threadIdx.x; e < {g.m.numel}; e += {self.nt}) "
                f"{self.storage[g.m].ptr}[e] = mlso::neg_inf();"
            )
        if inits:
            code("__syncthreads();")
        if self.flash is not None:
            code(self._flash_decl())
        if loop_iters or passes[Phase.LOOP]:
            with code.block(f"for (int it = 0; it < {loop}; ++it)"):
                for it in loop_iters:
                    code(f"{CTYPE[it.dtype]}* const s{it.arg} = {self._stage_ptr(it.arg, 'it')};")
                if loop_iters:
                    with code.block(f"if (it + {ns - 1} < {loop})"):
                        for it in loop_iters:
                            self._load(
                                code,
                                it,
                                f"it + {ns - 1}",
                                self._stage_ptr(it.arg, f"it + {ns - 1}"),
                                True,
                            )
                    code(
                        "mlso::cp_async_commit();",
                        f"mlso::cp_async_wait<{ns - 1}>();",
                        "__syncthreads();",
                    )
                self._emit_passes(code, passes[Phase.LOOP])
                code("__syncthreads();")
        if self.flash is not None:
            self._flash_flush(code)
        self._emit_passes(code, passes[Phase.POST])
        code("__syncthreads();")
        written: set[Node] = set()
        for s in saves:
            self._pass_save(code, s, written)


PASSES: dict[Op, Callable[[BlockKernel, Code, Node], None]] = {
    Op.MATMUL: BlockKernel._pass_node_matmul,
    Op.REDUCE_SUM: BlockKernel._pass_reduce,
    Op.REDUCE_MEAN: BlockKernel._pass_reduce,
    Op.REDUCE_MAX: BlockKernel._pass_reduce,
}
"""Block op -> pass emitter (accumulators and SAVE have their own places in the schedule)."""
MOMENTS = BlockKernel._pass_moments
"""Pass emitter of a reduction blockanalysis pairs with its first (`moments`)."""


def emit_graph_def(lw: Lowering, gd: Node) -> Kernel:
    if not isinstance(gd.arg, BlockGraph):
        raise CodegenError("GRAPH_DEF without a block graph")
    gx, gy, gz = gd.arg.grid
    if gx > 2**31 - 1 or gy > 65535 or gz > 65535:
        raise CodegenError(
            f"grid {gd.arg.grid} exceeds CUDA's limits (x < 2^31, y and z <= 65535)",
            "Map the largest grid dimension to x.",
        )
    return BlockKernel(lw, gd).build()
