"""Elementwise passes over shared memory: every element of a shape, threads striding, each
thread computing a batch (and, where the shape allows, a vector of neighbours) before storing.

Why its own module: every family of passes (staging, reductions' finishes, the online softmax's
rescales, factor passes) prints its per-element work through `elementwise`; how that loop is
batched and vectorised is one decision, made before printing (blockloops.lanes) and printed
here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlso_cli.codegen.cfmt import (
    CTYPE,
    Code,
    Coords,
    decompose,
    numel,
    paren,
)
from mlso_cli.codegen.emitter import Emitter
from mlso_cli.codegen.vectorize import plan_lane, wide_store

if TYPE_CHECKING:
    from mlso_cli.codegen.block import BlockKernel


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


def per_element(
    bk: BlockKernel,
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
    group's scale) once per vector; vectorize.py decides which, by evaluating the indices.

    The width and the batch are the plan's (blockloops.lanes, `BlockPlan.lanes`)."""
    ln = bk.plan.lanes[(shape, vector)]
    if ln.width > 1:
        vector_pass(bk, code, shape, body, ln.width, ln.batch)
        return
    count = numel(shape)
    em = bk.emitter()
    stores = body(em, decompose("e", shape))
    batch = ln.batch
    if batch == 1:
        with code.block(f"for (int e = threadIdx.x; e < {count}; e += {bk.nt})"):
            code.extend(em.lines)
            code.extend(s.line() for s in stores)
        return
    with code.block(f"for (int eb = threadIdx.x; eb < {count}; eb += {bk.nt * batch})"):
        code(*(f"float bv{i}[{batch}];" for i in range(len(stores))))
        code("#pragma unroll")
        with code.block(f"for (int ue = 0; ue < {batch}; ++ue)"):
            code(f"const int e = eb + ue * {bk.nt};")
            code.extend(em.lines)
            code.extend(f"bv{i}[ue] = {s.computed()};" for i, s in enumerate(stores))
        code("#pragma unroll")
        with code.block(f"for (int ue = 0; ue < {batch}; ++ue)"):
            code(f"const int e = eb + ue * {bk.nt};")
            code.extend(f"{s.dest} = {s.wrap.format(f'bv{i}[ue]')};" for i, s in enumerate(stores))


def vector_pass(
    bk: BlockKernel,
    code: Code,
    shape: tuple[int, ...],
    body: Callable[[Emitter, Coords], list[Store]],
    width: int,
    batch: int,
) -> None:
    """_elementwise with `width` lanes per thread: per batch of vectors, the lane-invariant
    statements and wide loads (vectorize.plan_lane), the lanes' values, then the stores (one
    wide store where the destination is a contiguous aligned vector)."""
    vc = decompose("ev", (*shape[:-1], shape[-1] // width))
    last = "vj" if vc[-1] == "0" else f"({paren(vc[-1])} * {width} + vj)"
    em = bk.emitter()
    stores = body(em, (*vc[:-1], last))
    count = numel(shape) // width
    ctypes = aligned_buffers(
        bk,
    )
    lane = plan_lane(em.lines, count, width, ctypes)
    wide = [wide_store(s.dest, count, width, ctypes) if s.op == "=" else None for s in stores]
    flat = f"const int e = ev * {width} + vj;"
    needs_flat = any(re.search(r"\be\b", t) for t in (*lane.lane, *map(Store.line, stores)))
    slot = f"ue * {width} + vj"
    lanes = f"for (int vj = 0; vj < {width}; ++vj)"
    with code.block(f"for (int eb = threadIdx.x; eb < {count}; eb += {bk.nt * batch})"):
        code(*(f"float bv{i}[{batch * width}];" for i in range(len(stores))))
        code("#pragma unroll")
        with code.block(f"for (int ue = 0; ue < {batch}; ++ue)"):
            code(f"const int ev = eb + ue * {bk.nt};")
            code.extend(lane.pre)
            code("#pragma unroll")
            with code.block(lanes):
                code.extend([flat] if needs_flat else [])
                code.extend(lane.lane)
                code.extend(f"bv{i}[{slot}] = {s.computed()};" for i, s in enumerate(stores))
        code("#pragma unroll")
        with code.block(f"for (int ue = 0; ue < {batch}; ++ue)"):
            code(f"const int ev = eb + ue * {bk.nt};")
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
                    code.extend(f"{s.dest} = {s.wrap.format(f'bv{i}[{slot}]')};" for i, s in narrow)


def aligned_buffers(bk: BlockKernel) -> dict[str, str]:
    """Shared-memory buffers by name -> C element type, each 128-byte aligned: the allocated
    ones, and the loop tiles' per-step aliases (every stage of which is allocated)."""
    out = {name: ctype for ctype, name, _ in bk.ptrs} | dict(bk.direct_aligned)
    for it in bk.loop_iters:
        stages = [f"s{it.arg}_{k}" for k in range(bk.nstage)]
        if all(st in out for st in stages):
            out[f"s{it.arg}"] = CTYPE[it.dtype]
    return out
