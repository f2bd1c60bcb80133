"""Shared-memory buffers of a graph-defined kernel, and which of them hold scaled numbers.

Why together: a buffer's byte count and whether its contents are relative to a running max are
both decided once, before emission (blocklayout.py drives the order), and emission only reads
them. `_alloc` is the only place a shared-memory byte is handed out, so the plan's total is
exactly what the kernel's pointers cover.
"""

from __future__ import annotations

from mlso_cli.codegen import synthetic
from mlso_cli.codegen.blockanalysis import BlockAnalysis
from mlso_cli.codegen.cfmt import Coords, Names, canon, contiguous, decompose, mentions
from mlso_cli.codegen.emitter import Emitter
from mlso_cli.codegen.scale import BufferScale, Scale, Storage, structural
from mlso_cli.codegen.teams import LOOP_VAR
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import DType, Op


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


ACC_ROW_BANKS = 8
"""An fp32 accumulator row starts this many banks (mod 32) after the previous one."""


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


class BlockStorage(BlockAnalysis):
    """Allocation of shared memory (offsets 128-byte aligned) and the scale of each buffer."""

    def _unbacked(self, ctype: str, name: str) -> str:
        """A name for a buffer the generated code never touches (the register pass's S, P, alpha)."""
        self.ptrs.append((ctype, name, 0))
        return name

    def _alloc(self, ctype: str, name: str, nbytes: int) -> str:
        off = _ceil_to(self.smem, 128)
        self.smem = off + max(nbytes, 4)
        self.ptrs.append((ctype, name, off))
        return name

    def _fp32(self, n: Node, mma_rows: bool = False) -> Storage:
        """An fp32 buffer; with `mma_rows` (the C of a tensor-core matmul), rows padded so that
        the accumulator fragments load and store without bank conflicts (`_acc_strides`)."""
        if n not in self.storage:
            strides = _acc_strides(n.shape) if mma_rows else contiguous(n.shape)
            nbytes = (strides[0] * n.shape[0] if n.shape else 1) * 4
            name = self._alloc("float", self.names.new("sm"), nbytes)
            self.storage[n] = Storage(name, DType.F32, n.shape, strides)
        return self.storage[n]

    @staticmethod
    def _tile_strides(shape: tuple[int, ...], dtype: DType, pad: bool) -> tuple[int, ...]:
        if (
            pad
            and dtype.itemsize == 2
            and len(shape) >= 2
            and shape[-1] % 8 == 0
            and shape[-1] >= 16
        ):
            return contiguous(shape[:-1] + (shape[-1] + 8,))
        return contiguous(shape)

    def _value_scale(self, x: Node, tokens: Coords) -> Scale | None:
        """The scale x's value has at `tokens`, as emission will compute it (a dry run)."""
        return Emitter(self.storage, self.stab, Names()).value(x, tokens).scale

    def _reduce_scale(self, n: Node) -> BufferScale | None:
        """A materialised reduction keeps its input's scale when M does not vary along the axis
        (sums; maxima of a positive degree) and the layout of M is simple; else it is exact."""
        if isinstance(n.arg, synthetic.RowMax) and n.arg.weighted:
            return None
        axis = n.arg.axis if isinstance(n.arg, synthetic.RowMax) else n.arg
        tokens = decompose("o", n.shape)
        c = list(tokens)
        c[axis] = LOOP_VAR
        sc = self._value_scale(n.src[0], canon(n.src[0].shape, c))
        if sc is None or any(mentions(m, LOOP_VAR) for m in sc.mcoords):
            return None
        if n.op is Op.REDUCE_MAX and sc.degree <= 0:
            return None
        return structural(sc, tokens)

    def _acc_scale(self, acc: Node) -> BufferScale:
        g = self.group_of[acc]
        ms = g.m.shape
        lead = len(acc.shape) - len(ms)
        mfunc = tuple(
            None if (j == len(ms) - 1 or ms[j] == 1) else (j + lead, 1) for j in range(len(ms))
        )
        return BufferScale(g.m, 1, mfunc)
