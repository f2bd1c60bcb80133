"""How each matmul of a graph-defined kernel reads its operands: tensor cores or SIMT, direct from
a shared tile or through a staging copy, and which operand's scale it carries (`plan_matmul`).

Why: an operand computed in registers (relu(X), exp(s - M), P of an online softmax) must be
staged in shared memory before ldmatrix can read it, in the 16-bit type of the tile it came
from; a staging copy is a buffer of the layout, so this planning runs inside a layout attempt
(blockstorage.Draft) and returns frozen plans.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mlso_cli.codegen.blockanalysis import Group
from mlso_cli.codegen.blockstorage import (
    Draft,
    SmemStorage,
    _ceil_to,
    alloc,
    set_scale,
    unbacked,
    value_scale,
)
from mlso_cli.codegen.cfmt import CTYPE, contiguous, decompose, numel
from mlso_cli.codegen.mmawork import strip_width
from mlso_cli.codegen.scale import BufferScale, matmul_scale, structural
from mlso_cli.codegen.views import strided
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import ELEMENTWISE, VIEW, DType, Op, Phase

MMA_TYPES = (DType.F16, DType.BF16)

SUM_OF_SQUARES = frozenset({Op.SQUARE})
"""Ops whose values a matmul must not read rounded to 16 bits: a matmul over squares is a sum of
squares, and a one-pass variance subtracts the square of the mean from it. Rounded to fp16
first, rows offset by +100 lost 0.3 of the variance (each square carries 2^-11 of 1e4), and at
+1e3 the squares overflow fp16. Such an operand stays fp32 (`mma_hint`), whatever the storage
dtype; `MUL(a, a)` is a square too. Products of different values (x * gamma) keep their 16-bit
staging: they are not cancelled against another sum of the same size."""


def _squares(x: Node) -> bool:
    """Whether x is computed elementwise from a square (SUM_OF_SQUARES), through views and
    elementwise ops only (a matmul or reduction between them is a sum of its own, in fp32)."""
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


@dataclass(frozen=True)
class Operand:
    """How a matmul pass reads one operand: a strided shared-memory tensor."""

    ptr: str
    dtype: DType
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    base: int = 0

    def ld(self, contiguous_last: bool) -> int:
        return self.strides[-2] if contiguous_last else self.strides[-1]


@dataclass(frozen=True)
class Stage:
    """A staging copy of a computed matmul operand, in the operand's phase."""

    src: Node
    storage: SmemStorage
    phase: Phase
    scale: BufferScale | None = None
    """Set when the copy holds the scaled numbers (exp(s - M) in [0, 1]), not the exact values."""


@dataclass(frozen=True)
class MatmulPlan:
    kind: str
    """"mma" (tensor cores), "simt" (a thread per output) or "splitk" (a warp per output)."""
    a: Operand
    b: Operand
    c: SmemStorage
    accumulate: bool
    dtype: DType | None
    a_kmajor: bool = True
    b_kmajor: bool = False
    stages: tuple[Stage, ...] = ()
    row_scale: str | None = None
    """fp32 per-row factor applied to C before accumulating (online-softmax alpha)."""
    strip: int = 0
    """n8 tiles per warp strip of mlso::block_mma (mmawork.strip_width; "mma" only)."""
    rows: int = 0
    """A's rows as mlso::block_mma walks them: M padded to the 16-row mma tile ("mma" only;
    a staged A is allocated with these rows, a direct one is already a multiple of 16)."""


def direct_operand(d: Draft, x: Node) -> Operand | None:
    """x read where it is stored (a strided view of an unscaled buffer), or None."""
    view = strided(x, d.storage)
    if view is None or d.storage[view.leaf].scale is not None:
        return None
    st = d.storage[view.leaf]
    return Operand(st.ptr, st.dtype, x.shape, view.strides, view.base)


def mma_ok(op: Operand, role: str) -> tuple[bool, bool]:
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


def stage(
    d: Draft, x: Node, role: str, dtype: DType, rows: int, scale: BufferScale | None = None
) -> Stage:
    """A copy of operand x (once per role and type): A as (.., rows padded, K) k-major, B as
    (.., K, N) n-major; with `scale`, the copy holds x's scaled numbers (x = stored * exp(M)),
    never the exact values."""
    key = (x, role, dtype)
    st = d.stages.get(key)
    if st is None:
        storage = in_place(d, x, role, dtype, rows) if scale is None else None
        if storage is None:
            pad = 8 if dtype.itemsize == 2 else 0
            shape = x.shape[:-2] + (rows, x.shape[-1])
            strides = contiguous(shape[:-1] + (shape[-1] + pad,))
            nbytes = (strides[0] * shape[0] if shape else 1) * dtype.itemsize
            name = alloc(d, CTYPE[dtype], d.names.new("stg"), nbytes)
            storage = SmemStorage(name, dtype, shape, strides)
        st = Stage(x, storage, x.phase or Phase.PRE, scale=scale)
        d.stages[key] = st
    return st


def staged_operand(st: Stage, x: Node, dtype: DType) -> Operand:
    s = st.storage
    return Operand(s.ptr, dtype, x.shape, s.strides)


def in_place(d: Draft, x: Node, role: str, dtype: DType, rows: int) -> SmemStorage | None:
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
    consumers = d.an.consumers
    if rows != x.shape[-2] or x.op not in ELEMENTWISE or x.phase not in (None, Phase.PRE):
        return None
    if len(consumers.get(x, ())) != 1:
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
    st = d.storage.get(t)
    if (
        t.phase is not Phase.PRE
        or t in d.an.direct
        or st is None
        or st.dtype is not dtype
        or t.shape != x.shape
        or t.dtype is not dtype
    ):
        return None
    inside = chain | {t}
    for n in inside:
        for user in consumers.get(n, ()):
            if user in inside:
                continue
            if not (n is x and user.op is Op.MATMUL):
                return None
    ok, km = mma_ok(Operand(st.ptr, dtype, st.shape, st.strides), role)
    return st if ok and km == (role == "A") else None


def mma_hint(d: Draft, x: Node) -> DType | None:
    """The 16-bit type a matmul operand should use on tensor cores: its stored type, or for a
    computed operand the type of a 16-bit tile it is computed from (None: keep fp32)."""
    op = direct_operand(d, x)
    if op is not None:
        return op.dtype if op.dtype in MMA_TYPES else None
    stack, seen = [x], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in d.storage:
            if d.storage[n].dtype in MMA_TYPES:
                return d.storage[n].dtype
            continue
        stack.extend(n.src)
    return None


def group_p(d: Draft, g: Group, register: bool) -> Group:
    """g with its P buffer (exp(s - m') for P @ v: the weighted operand's 16-bit type where
    it has one, rows padded to the mma tile) and P's type; on the register path (`register`)
    P stays in registers and its name is unbacked."""
    s = g.s
    hints = [
        mma_hint(d, w.src[1])
        for w in g.wsums
        if s.shape[-1] % 16 == 0 and w.src[1].shape[-1] % 8 == 0
    ]
    dt = next((h for h in hints if h is not None), DType.F32)
    rows = _ceil_to(s.shape[-2], 16) if dt is not DType.F32 else s.shape[-2]
    pad = 8 if dt.itemsize == 2 else 0
    shape = s.shape[:-2] + (rows, s.shape[-1])
    strides = contiguous(shape[:-1] + (shape[-1] + pad,))
    nbytes = (strides[0] * shape[0] if shape else 1) * dt.itemsize
    if register:
        name = unbacked(d, CTYPE[dt], d.names.new("p"))
    else:
        name = alloc(d, CTYPE[dt], d.names.new("p"), nbytes)
    return replace(g, p=SmemStorage(name, dt, shape, strides), p_dtype=dt)


def plan_matmul(
    d: Draft,
    a: Node | None,
    b: Node,
    out: Node,
    accumulate: bool,
    p_of: Group | None = None,
    row_scale: str | None = None,
) -> MatmulPlan:
    """The plan of C = A @ B into out's storage (A is p_of's P when given): tensor cores where
    an operand has a 16-bit type and the shape takes the mma tile, else SIMT or split-K; the
    operands that must be staged are staged (`stage`). A non-accumulating C records the scale
    its operands leave it with (out's storage is replaced with it)."""
    c = d.storage[out]
    a_shape = p_of.s.shape if p_of else a.shape
    m, k, n = a_shape[-2], a_shape[-1], b.shape[-1]
    batch = numel(c.shape[:-2])
    a_dir = (
        Operand(p_of.p.ptr, p_of.p.dtype, a_shape, p_of.p.strides) if p_of else direct_operand(d, a)
    )
    b_dir = direct_operand(d, b)
    if p_of is not None:
        mma = p_of.p_dtype if p_of.p_dtype in MMA_TYPES else None
    elif _squares(a) or _squares(b):
        mma = None  # a sum of squares stays fp32 on both sides (SUM_OF_SQUARES says why)
    else:
        mma = mma_hint(d, a) or mma_hint(d, b)
    sa, sb = _operand_scales(d, a, b, len(c.shape), accumulate)
    if not accumulate:
        c = set_scale(d, out, sa[1] if sa is not None else sb[1] if sb is not None else None)
    a_scale = sa[0] if sa is not None else None
    b_scale = sb[0] if sb is not None else None
    stages: list[Stage] = []
    if mma is not None and n % 8 == 0 and k % 16 == 0:
        a_ok, a_km = mma_ok(a_dir, "A") if a_dir and a_dir.dtype == mma else (False, True)
        if p_of is None and not (a_ok and m % 16 == 0):
            st = stage(d, a, "A", mma, _ceil_to(m, 16), a_scale)
            a_dir, a_km = staged_operand(st, a, mma), True
            stages.append(st)
        b_ok, b_km = mma_ok(b_dir, "B") if b_dir and b_dir.dtype == mma else (False, False)
        if not b_ok:
            st = stage(d, b, "B", mma, b.shape[-2], b_scale)
            b_dir, b_km = staged_operand(st, b, mma), False
            stages.append(st)
        strip = strip_width(batch, m, n, k, d.nt // 32)
        return MatmulPlan(
            "mma",
            a_dir,
            b_dir,
            c,
            accumulate,
            mma,
            a_km,
            b_km,
            tuple(stages),
            row_scale,
            strip,
            _ceil_to(m, 16),
        )
    if a_dir is None:
        st = stage(d, a, "A", DType.F32, m, a_scale)
        a_dir = staged_operand(st, a, DType.F32)
        stages.append(st)
    if b_dir is None:
        st = stage(d, b, "B", DType.F32, b.shape[-2], b_scale)
        b_dir = staged_operand(st, b, DType.F32)
        stages.append(st)
    kind = "simt" if batch * m * n >= d.nt or k < 64 else "splitk"
    return MatmulPlan(
        kind, a_dir, b_dir, c, accumulate, None, stages=tuple(stages), row_scale=row_scale
    )


def _operand_scales(
    d: Draft, a: Node | None, b: Node, c_rank: int, accumulate: bool
) -> tuple[tuple[BufferScale, BufferScale] | None, tuple[BufferScale, BufferScale] | None]:
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
            v = value_scale(d, x, tokens)
            bs = structural(v, tokens) if v is not None else None
        scales.append(bs)
    if scales == [None, None]:
        return None, None
    cs, keep_a, keep_b = matmul_scale(
        scales[0], scales[1], len(a.shape) if a is not None else 2, len(b.shape), c_rank
    )
    return ((scales[0], cs) if keep_a else None), ((scales[1], cs) if keep_b else None)
