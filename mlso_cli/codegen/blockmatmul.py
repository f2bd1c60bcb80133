"""How each matmul of a graph-defined kernel reads its operands: tensor cores or SIMT, direct from
a shared tile or through a staging copy, and which operand's scale it carries.

Why: an operand computed in registers (relu(X), exp(s - M), P of an online softmax) must be
staged in shared memory before ldmatrix can read it, in the 16-bit type of the tile it came
from; a staging copy is a buffer of the layout, so this planning runs inside the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlso_cli.codegen.blockanalysis import Group
from mlso_cli.codegen.blockstorage import BlockStorage, _ceil_to
from mlso_cli.codegen.cfmt import CTYPE, contiguous, decompose, numel
from mlso_cli.codegen.scale import BufferScale, Storage, matmul_scale, structural
from mlso_cli.codegen.views import strided
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import DType, Op, Phase

MMA_TYPES = (DType.F16, DType.BF16)

SUM_OF_SQUARES = frozenset({Op.SQUARE})
"""Ops whose values a matmul must not read rounded to 16 bits: a matmul over squares is a sum of
squares, and a one-pass variance subtracts the square of the mean from it. Rounded to fp16
first, rows offset by +100 lost 0.3 of the variance (each square carries 2^-11 of 1e4), and at
+1e3 the squares overflow fp16. Such an operand stays fp32 (`_mma_hint`), whatever the storage
dtype; `MUL(a, a)` is a square too. Products of different values (x * gamma) keep their 16-bit
staging: they are not cancelled against another sum of the same size."""


def _squares(x: Node) -> bool:
    """Whether x is computed elementwise from a square (SUM_OF_SQUARES), through views and
    elementwise ops only (a matmul or reduction between them is a sum of its own, in fp32)."""
    from mlso_cli.ir.ops import ELEMENTWISE, VIEW

    stack, seen = [x], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in SUM_OF_SQUARES or (n.op is Op.MUL and n.src[0] is n.src[1]):
            return True
        if n.op in ELEMENTWISE or n.op in VIEW:
            stack.extend(n.src)
    return False


@dataclass
class Operand:
    """How a matmul pass reads one operand: a strided shared-memory tensor."""

    ptr: str
    dtype: DType
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    base: int = 0

    def ld(self, contiguous_last: bool) -> int:
        return self.strides[-2] if contiguous_last else self.strides[-1]


@dataclass
class Stage:
    """A staging copy of a computed matmul operand, in the operand's phase."""

    src: Node
    storage: Storage
    phase: Phase
    scale: BufferScale | None = None
    """Set when the copy holds the scaled numbers (exp(s - M) in [0, 1]), not the exact values."""


@dataclass
class MatmulPlan:
    kind: str  # "mma" | "simt" | "splitk"
    a: Operand
    b: Operand
    c: Storage
    accumulate: bool
    dtype: DType | None
    a_kmajor: bool = True
    b_kmajor: bool = False
    stages: list[Stage] = field(default_factory=list)
    row_scale: str | None = (
        None  # fp32 per-row factor applied to C before accumulating (online-softmax alpha)
    )


class MatmulPlanning(BlockStorage):
    """Operands, staging copies and kinds of the block's matmuls (MatmulPlan per node)."""

    def _flash_ok(self) -> bool:
        g = self.flash
        if g is None:
            return False
        wp = self.plans.get(g.wsums[0])
        if wp is None or wp.kind != "mma":
            return False
        for t in self.flash_form.terms:
            sp = self.plans.get(t)
            if not (
                sp is not None
                and sp.kind == "mma"
                and not sp.accumulate
                and sp.dtype == wp.dtype == g.p_dtype
                and sp.a.shape[-2] % 16 == 0
                and self.storage[t].scale is None
            ):
                return False
        sp = self.plans[self.flash_form.terms[0]]
        self.flash_v, self.flash_f, self.flash_kbuf = (wp.b, wp.b_kmajor), None, None
        self.flash_ksplit, self.flash_red = 1, None
        split = self.flash_split
        if split > 1 and all(
            self.plans[t].a.shape[-1] % (16 * split) == 0 for t in self.flash_form.terms
        ):
            # warps sharing a strip split the score's depth too; partial scores meet in shared memory
            self.flash_ksplit = split
            self.flash_red = self._alloc(
                "float", self.names.new("ps"), self.flash_strips * split * 16 * g.s.shape[-1] * 4
            )
        if self.flash_form.key_factor is not None:
            self.flash_kbuf = self._alloc("float", self.names.new("ks"), g.s.shape[-1] * 4)
        scaled = self._flash_scaled_v(g.wsums[0].src[1], sp.dtype)
        if scaled is not None:
            self.flash_f = scaled[2]
            self.flash_fbuf = self._alloc("float", self.names.new("vs"), g.s.shape[-1] * 4)
        return True

    def _flash_scaled_v(self, v: Node, dtype: DType) -> tuple[Operand, bool, Node] | None:
        """v = x * f with f one factor per key (row of v) and x a 16-bit tile in shared memory: the
        register pass then reads x as stored and puts f on P's columns (no staged copy of x * f)."""
        if v.op is not Op.MUL:
            return None
        keys = v.shape[-2]
        for x, f in (v.src, v.src[::-1]):
            if (
                x.shape != v.shape
                or f.shape[-1] != 1
                or len(f.shape) != len(v.shape)
                or numel(f.shape) != keys
            ):
                continue
            if f.shape[-2] != keys:
                continue
            op = self._direct(x)
            if op is None or op.dtype != dtype:
                continue
            ok, kmajor = self._mma_ok(op, "B")
            if ok:
                return op, kmajor, f
        return None

    def _direct(self, x: Node) -> Operand | None:
        view = strided(x, self.storage)
        if view is None or self.storage[view.leaf].scale is not None:
            return None
        st = self.storage[view.leaf]
        return Operand(st.ptr, st.dtype, x.shape, view.strides, view.base)

    @staticmethod
    def _mma_ok(op: Operand, role: str) -> tuple[bool, bool]:
        """(usable by ldmatrix, k-major) for a 16-bit operand."""
        s, shape = op.strides, op.shape
        aligned = op.base % 8 == 0 and all(v % 8 == 0 for v, d in zip(s[:-2], shape[:-2]) if d > 1)
        if not aligned:
            return False, True
        rows_ok = s[-2] % 8 == 0 or shape[-2] == 1
        cols_ok = s[-1] % 8 == 0 or shape[-1] == 1
        if s[-1] == 1 and rows_ok:  # row-major in shared memory
            return True, role == "A"
        if s[-2] == 1 and cols_ok:  # column-major
            return True, role == "B"
        return False, True

    def _stage(
        self, x: Node, role: str, dtype: DType, rows: int, scale: BufferScale | None = None
    ) -> Operand:
        """A copy of operand x: A as (.., rows padded, K) k-major, B as (.., K, N) n-major; with
        `scale`, the copy holds x's scaled numbers (x = stored * exp(M)), never the exact values."""
        key = (x, role, dtype)
        st = self.stages.get(key)
        if st is None:
            storage = self._in_place(x, role, dtype, rows) if scale is None else None
            if storage is None:
                pad = 8 if dtype.itemsize == 2 else 0
                shape = x.shape[:-2] + (rows, x.shape[-1])
                strides = contiguous(shape[:-1] + (shape[-1] + pad,))
                nbytes = (strides[0] * shape[0] if shape else 1) * dtype.itemsize
                name = self._alloc(CTYPE[dtype], self.names.new("stg"), nbytes)
                storage = Storage(name, dtype, shape, strides)
            st = Stage(x, storage, x.phase or Phase.PRE, scale=scale)
            self.stages[key] = st
        s = st.storage
        return Operand(s.ptr, dtype, x.shape, s.strides)

    def _in_place(self, x: Node, role: str, dtype: DType, rows: int) -> Storage | None:
        """The tile x is computed from, when x's staging copy can overwrite it (None: allocate).

        Why: an elementwise op on a tile that nothing else reads (a ReLU on C before C feeds a
        matmul) needs no second buffer: each thread writes each element where it read it. A
        block with X, W and C tiles of 64 KB each and a ReLU on C was refused at 264,320 B on
        sm_90 for the copy; in place it fits. The conditions: x is elementwise over exactly one
        PRE-phase tile held in shared memory in the staging type (constants aside), of x's shape
        with no padded rows, laid out as ldmatrix reads this role; the tile and every op of the
        chain are read only within the chain, and x by its one matmul. Every consumer of the plan
        (the spec's shared-memory figure, the cost model, the float32 interpreter mode) reads
        this layout, so all of them count the buffer once."""
        from mlso_cli.ir.ops import ELEMENTWISE

        if rows != x.shape[-2] or x.op not in ELEMENTWISE or x.phase not in (None, Phase.PRE):
            return None
        if len(self.consumers.get(x, [])) != 1:
            return None  # a second reader would see the overwritten tile
        chain, tiles, stack = set(), set(), [x]
        while stack:
            n = stack.pop()
            if n in chain or n in tiles:
                continue
            if n.op is Op.ITER:
                tiles.add(n)
            elif n.op in ELEMENTWISE:
                chain.add(n)
                stack.extend(n.src)
            elif n.op is not Op.CONST:
                return None
        if len(tiles) != 1:
            return None
        (t,) = tiles
        st = self.storage.get(t)
        if (
            t.phase is not Phase.PRE
            or t in self.direct
            or st is None
            or st.dtype is not dtype
            or t.shape != x.shape
            or t.dtype is not dtype
        ):
            return None
        inside = chain | {t}
        for n in inside:
            for user in self.consumers.get(n, []):
                if user in inside:
                    continue
                if not (n is x and user.op is Op.MATMUL):
                    return None
        ok, km = self._mma_ok(Operand(st.ptr, dtype, st.shape, st.strides), role)
        return st if ok and km == (role == "A") else None

    def _mma_hint(self, x: Node) -> DType | None:
        """The 16-bit type a matmul operand should use on tensor cores: its stored type, or for a
        computed operand the type of a 16-bit tile it is computed from (None: keep fp32)."""
        d = self._direct(x)
        if d is not None:
            return d.dtype if d.dtype in MMA_TYPES else None
        stack, seen = [x], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in self.storage:
                if self.storage[n].dtype in MMA_TYPES:
                    return self.storage[n].dtype
                continue
            stack.extend(n.src)
        return None

    def _plan_group_p(self, g: Group) -> None:
        s = g.s
        hints = [
            self._mma_hint(w.src[1])
            for w in g.wsums
            if s.shape[-1] % 16 == 0 and w.src[1].shape[-1] % 8 == 0
        ]
        dt = next((d for d in hints if d is not None), DType.F32)
        rows = _ceil_to(s.shape[-2], 16) if dt is not DType.F32 else s.shape[-2]
        pad = 8 if dt.itemsize == 2 else 0
        shape = s.shape[:-2] + (rows, s.shape[-1])
        strides = contiguous(shape[:-1] + (shape[-1] + pad,))
        nbytes = (strides[0] * shape[0] if shape else 1) * dt.itemsize
        if g is self.flash:  # P stays in registers
            name = self._unbacked(CTYPE[dt], self.names.new("p"))
        else:
            name = self._alloc(CTYPE[dt], self.names.new("p"), nbytes)
        g.p = Storage(name, dt, shape, strides)
        g.p_dtype = dt

    def _plan_matmul(
        self, a: Node | None, b: Node, c: Storage, accumulate: bool, p_of: Group | None = None
    ) -> MatmulPlan:
        a_shape = p_of.s.shape if p_of else a.shape
        m, k, n = a_shape[-2], a_shape[-1], b.shape[-1]
        batch = numel(c.shape[:-2])
        a_dir = (
            Operand(p_of.p.ptr, p_of.p.dtype, a_shape, p_of.p.strides) if p_of else self._direct(a)
        )
        b_dir = self._direct(b)
        if p_of is not None:
            mma = p_of.p_dtype if p_of.p_dtype in MMA_TYPES else None
        elif _squares(a) or _squares(b):
            mma = None  # a sum of squares stays fp32 on both sides (SUM_OF_SQUARES says why)
        else:
            mma = self._mma_hint(a) or self._mma_hint(b)
        sa, sb = self._operand_scales(a, b, len(c.shape), accumulate)
        if not accumulate:
            c.scale = sa[1] if sa is not None else sb[1] if sb is not None else None
        a_scale = sa[0] if sa is not None else None
        b_scale = sb[0] if sb is not None else None
        if mma is not None and n % 8 == 0 and k % 16 == 0:
            stages = []
            a_ok, a_km = self._mma_ok(a_dir, "A") if a_dir and a_dir.dtype == mma else (False, True)
            if p_of is None and not (a_ok and m % 16 == 0):
                a_dir, a_km = self._stage(a, "A", mma, _ceil_to(m, 16), a_scale), True
                stages.append(self.stages[(a, "A", mma)])
            b_ok, b_km = (
                self._mma_ok(b_dir, "B") if b_dir and b_dir.dtype == mma else (False, False)
            )
            if not b_ok:
                b_dir, b_km = self._stage_b(b, mma, b_scale), False
                stages.append(self.stages[(b, "B", mma)])
            return MatmulPlan("mma", a_dir, b_dir, c, accumulate, mma, a_km, b_km, stages)
        stages = []
        if a_dir is None:
            a_dir = self._stage(a, "A", DType.F32, m, a_scale)
            stages.append(self.stages[(a, "A", DType.F32)])
        if b_dir is None:
            b_dir = self._stage_b(b, DType.F32, b_scale)
            stages.append(self.stages[(b, "B", DType.F32)])
        kind = "simt" if batch * m * n >= self.nt or k < 64 else "splitk"
        return MatmulPlan(kind, a_dir, b_dir, c, accumulate, None, stages=stages)

    def _stage_b(self, b: Node, dtype: DType, scale: BufferScale | None = None) -> Operand:
        return self._stage(b, "B", dtype, b.shape[-2], scale)

    def _operand_scales(self, a: Node | None, b: Node, c_rank: int, accumulate: bool):
        """((A's copy scale, C's scale) or None, (B's copy scale, C's scale) or None): the operand
        whose scaled numbers are staged and multiplied, leaving C scaled (scale.matmul_scale).
        Never for an accumulating matmul: its C sums steps whose maxima differ."""
        if accumulate:
            return None, None
        scales = []
        for x in (a, b):
            bs = None
            if x is not None:
                tokens = decompose("e", x.shape)
                v = self._value_scale(x, tokens)
                bs = structural(v, tokens) if v is not None else None
            scales.append(bs)
        if scales == [None, None]:
            return None, None
        cs, keep_a, keep_b = matmul_scale(
            scales[0], scales[1], len(a.shape) if a is not None else 2, len(b.shape), c_rank
        )
        return ((scales[0], cs) if keep_a else None), ((scales[1], cs) if keep_b else None)
