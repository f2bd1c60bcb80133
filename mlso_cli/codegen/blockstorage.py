"""Shared-memory buffers of a graph-defined kernel, and which of them hold scaled numbers.

Why together: a buffer's byte count and whether its contents are relative to a running max are
both decided once, before emission (blocklayout.py drives the order), and emission only reads
them. `alloc` is the only place a shared-memory byte is handed out, so the plan's total is
exactly what the kernel's pointers cover.

A layout attempt works on a `Draft` (the allocator, the storage decided so far, the staging
copies and matmul plans): private working state of blocklayout.plan_layout, never part of a
plan. What an attempt decides is returned frozen (`SmemStorage`, blockmatmul.MatmulPlan) and
the finished layout freezes the rest (blocklayout.LayoutPlan).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from mlso_cli.codegen import synthetic
from mlso_cli.codegen.blockanalysis import Analysis, Group
from mlso_cli.codegen.cfmt import Coords, Names, canon, contiguous, decompose, mentions
from mlso_cli.codegen.emitter import Emitter
from mlso_cli.codegen.scale import BufferScale, Scale, structural
from mlso_cli.codegen.teams import LOOP_VAR
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import DType, Op

if TYPE_CHECKING:
    from mlso_cli.codegen.blockmatmul import MatmulPlan, Stage


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


ACC_ROW_BANKS = 8
"""An fp32 accumulator row starts this many banks (mod 32) after the previous one."""


@dataclass(frozen=True)
class SmemStorage:
    """Where a block value lives in shared memory (or, for an in-place tile, its global name):
    scale.Storage's fields, frozen, so that a plan holding it is immutable and hashable."""

    ptr: str
    dtype: DType
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    scale: BufferScale | None = None
    buffer: object = None
    """Always None: shared memory has no plan buffer (the field mirrors scale.Storage)."""
    computed: object = None
    """Always None: a shared tile is stored (the field mirrors scale.Storage)."""


def _acc_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of an fp32 matmul accumulator in shared memory.

    Why: a thread of an mma.sync C fragment holds two neighbouring columns of rows lane/4 and
    lane/4 + 8; mlso::add_partial moves them as one 8-byte access per row. A half-warp then
    touches 4 rows of 8 floats. With a row length that is a multiple of 32 floats those 4 rows
    sit in the same 8 banks (a 4-way conflict on every load and store of C, every loop step).
    Rows that start 8 banks apart fill all 32 banks once. Only matrices of 8 rows or more with
    16-byte-aligned rows of at least 32 floats are padded; the rest stay contiguous."""
    if len(shape) < 2 or shape[-2] < 8 or shape[-1] < 32 or shape[-1] % 8:
        return contiguous(shape)
    row = shape[-1] + (ACC_ROW_BANKS - shape[-1]) % 32
    return contiguous(shape[:-1] + (row,))


def tile_strides(shape: tuple[int, ...], dtype: DType, pad: bool) -> tuple[int, ...]:
    """Strides of an ITER tile: 16-bit rows of 16 elements or more padded by 8 (16 bytes)
    against ldmatrix bank conflicts where `pad`; else contiguous."""
    if pad and dtype.itemsize == 2 and len(shape) >= 2 and shape[-1] % 8 == 0 and shape[-1] >= 16:
        return contiguous(shape[:-1] + (shape[-1] + 8,))
    return contiguous(shape)


@dataclass
class Draft:
    """The working state of one layout attempt (see the module docstring)."""

    an: Analysis
    names: Names
    """Shared by every attempt of one plan: a retry takes fresh identifiers after the last."""
    nt: int
    """Threads per block of this attempt."""
    pad: bool
    nstage: int
    smem: int = 0
    ptrs: list[tuple[str, str, int]] = field(default_factory=list)
    """(C type, name, byte offset) of every pointer into shared memory, in allocation order."""
    storage: dict[Node, SmemStorage] = field(default_factory=dict)
    stages: dict[tuple[Node, str, DType], Stage] = field(default_factory=dict)
    """(operand, role, dtype) -> its staging copy (blockmatmul.stage)."""
    plans: dict[Node, MatmulPlan] = field(default_factory=dict)
    """Node -> its matmul plan (blockmatmul.plan_matmul)."""


def unbacked(d: Draft, ctype: str, name: str) -> str:
    """A name for a buffer the generated code never touches (the register pass's S, P, alpha)."""
    d.ptrs.append((ctype, name, 0))
    return name


def alloc(d: Draft, ctype: str, name: str, nbytes: int) -> str:
    """`nbytes` of shared memory at the next 128-byte boundary, named `name`."""
    off = _ceil_to(d.smem, 128)
    d.smem = off + max(nbytes, 4)
    d.ptrs.append((ctype, name, off))
    return name


def fp32(d: Draft, n: Node, mma_rows: bool = False) -> SmemStorage:
    """An fp32 buffer for n (once); with `mma_rows` (the C of a tensor-core matmul), rows
    padded so that the accumulator fragments load and store without bank conflicts
    (`_acc_strides`)."""
    if n not in d.storage:
        strides = _acc_strides(n.shape) if mma_rows else contiguous(n.shape)
        nbytes = (strides[0] * n.shape[0] if n.shape else 1) * 4
        name = alloc(d, "float", d.names.new("sm"), nbytes)
        d.storage[n] = SmemStorage(name, DType.F32, n.shape, strides)
    return d.storage[n]


def set_scale(d: Draft, n: Node, scale: BufferScale | None) -> SmemStorage:
    """n's storage with `scale` (decided in dependency order, before any emission)."""
    d.storage[n] = replace(d.storage[n], scale=scale)
    return d.storage[n]


def value_scale(d: Draft, x: Node, tokens: Coords) -> Scale | None:
    """The scale x's value has at `tokens`, as emission will compute it (a dry run)."""
    return Emitter(d.storage, d.an.stab, Names()).value(x, tokens).scale


def reduce_scale(d: Draft, n: Node) -> BufferScale | None:
    """A materialised reduction keeps its input's scale when M does not vary along the axis
    (sums; maxima of a positive degree) and the layout of M is simple; else it is exact."""
    if isinstance(n.arg, synthetic.RowMax) and n.arg.weighted:
        return None
    axis = n.arg.axis if isinstance(n.arg, synthetic.RowMax) else n.arg
    tokens = decompose("o", n.shape)
    c = list(tokens)
    c[axis] = LOOP_VAR
    sc = value_scale(d, n.src[0], canon(n.src[0].shape, c))
    if sc is None or any(mentions(m, LOOP_VAR) for m in sc.mcoords):
        return None
    if n.op is Op.REDUCE_MAX and sc.degree <= 0:
        return None
    return structural(sc, tokens)


def acc_scale(g: Group, acc: Node) -> BufferScale:
    """An online-softmax accumulator is kept relative to its group's running max."""
    ms = g.m.shape
    lead = len(acc.shape) - len(ms)
    mfunc = tuple(
        None if (j == len(ms) - 1 or ms[j] == 1) else (j + lead, 1) for j in range(len(ms))
    )
    return BufferScale(g.m, 1, mfunc)
