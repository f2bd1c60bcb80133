"""Inline evaluation of μGraph values at symbolic coordinates: the thread-graph level.

Why one emitter for both levels: a kernel-level elementwise chain fused into a kernel and a
block-level chain fused into a block op are the same thing, an expression evaluated per element
in registers. The emitter turns "value of node n at coordinates (c0, c1, ...)" into C statements:
stored tensors (global buffers or shared tiles, given by `storage`) become loads, views become
coordinate maps, elementwise ops become calls of mlso::ew functions, and THREAD nodes evaluate
their bodies. Results carry a Scale (scale.py) when they are stored relative to a running max.

The rules are a table, RULES: op -> function(emitter, node, coords) -> Val.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from mlso_cli.codegen import synthetic
from mlso_cli.codegen.cfmt import (
    Coords,
    Names,
    bcast,
    c_float,
    canon,
    contiguous,
    decompose,
    mentions,
    offset,
)
from mlso_cli.codegen.errors import CodegenError
from mlso_cli.codegen.scale import BINARY, UNARY_DEGREE, Scale, Storage, Val
from mlso_cli.codegen.selection import placed_product, selected_read
from mlso_cli.codegen.synthetic import Combined, Copy
from mlso_cli.codegen.teams import FOLD
from mlso_cli.codegen.views import strided, view_strides
from mlso_cli.ir.node import Node, const_value
from mlso_cli.ir.ops import BINARY as BINARY_OPS
from mlso_cli.ir.ops import REDUCE, UNARY, Op

UNARY_FN: dict[Op, str] = {
    Op.EXP: "mlso::ew::exp",
    Op.SQUARE: "mlso::ew::square",
    Op.SQRT: "mlso::ew::sqrt",
    Op.RSQRT: "mlso::ew::rsqrt",
    Op.RECIPROCAL: "mlso::ew::reciprocal",
    Op.NEG: "mlso::ew::neg",
    Op.SILU: "mlso::ew::silu",
    Op.SIGMOID: "mlso::ew::sigmoid",
    Op.TANH: "mlso::ew::tanh",
    Op.ERF: "mlso::ew::erf",
    Op.GELU: "mlso::ew::gelu",
    Op.RELU: "mlso::ew::relu",
}
"""Device function of each unary op. CAST is the identity on fp32 registers (the IR's CAST is
exact; rounding happens where a value is stored in a narrower type)."""

BINARY_FN: dict[Op, str] = {
    Op.ADD: "mlso::ew::add",
    Op.SUB: "mlso::ew::sub",
    Op.MUL: "mlso::ew::mul",
    Op.DIV: "mlso::ew::div",
    Op.MAX: "mlso::ew::max",
}
assert set(UNARY_FN) | {Op.CAST} == UNARY and set(BINARY_FN) == BINARY_OPS


@dataclass(frozen=True)
class Flat:
    """Coordinates that are the decomposition of a flat index `expr` over `shape`: a stored
    tensor of that shape with contiguous strides is then read at `expr` directly."""

    coords: Coords
    shape: tuple[int, ...]
    expr: str
    row: tuple[str, str, int] | None = None
    """(row, column, length) when `expr` is row * length + column (a row kernel's element): a
    view of another shape with rows of `length` is then decomposed into those two, so that the
    row's reduced values are read from the registers that hold them (rowkernel.py)."""


class Emitter:
    """Emits statements into `lines`; `value(n, coords)` returns n's value there."""

    def __init__(
        self,
        storage: Mapping[Node, Storage],
        stab: Mapping[Node, Node],
        names: Names,
        on_use: Callable[[Node], None] | None = None,
        flat: Flat | None = None,
    ) -> None:
        self.storage = storage
        self.stab = stab
        self.names = names
        self.on_use = on_use or (lambda n: None)
        self._flats: dict[tuple[Coords, tuple[int, ...]], str] = {}
        self._row_flat: tuple[str, tuple[str, str, int]] | None = None
        if flat is not None:
            self._flats[(flat.coords, flat.shape)] = flat.expr
            if flat.row is not None:
                self._row_flat = (flat.expr, flat.row)
        self.lines: list[str] = []
        self._memo: dict[tuple, Val] = {}
        self._thread: list[tuple[int, list[Val]]] = []
        self._thread_ids = 0
        self.team = 1
        """Lanes that share each in-place reduction of this emitter's own lines (a power of two
        <= 32; kernels.emit_elementwise sets it). Each strides the reduced axis from its lane in
        the team (`TEAM_LANE`), and a shuffle all-reduce leaves the result in every lane. Why:
        a split-KV combine folds 32-128 partials per output, and one thread per output ran them
        as a chain of dependent memory latencies. Loops nested in another loop (child emitters)
        stay serial: the team is already spread over the outer one."""

    # ---- public ------------------------------------------------------------------------------
    def value(self, n: Node, coords: Coords) -> Val:
        coords = canon(n.shape, coords)
        key = (n, coords, self._thread[-1][0] if self._thread else None)
        got = self._memo.get(key)
        if got is None:
            got = self._leaf(n, coords) if n in self.storage else self.compute(n, coords)
            self._memo[key] = got
        return got

    def known(self, n: Node, coords: Coords, v: Val) -> None:
        """n's value at coords is already in a register (a row kernel's reduction, rowkernel.py):
        reads of it there use `v` instead of loading or computing it."""
        self._memo[(n, canon(n.shape, coords), self._thread[-1][0] if self._thread else None)] = v

    def compute(self, n: Node, coords: Coords) -> Val:
        """n's value from its definition, even when n is stored (used for the node a kernel writes)."""
        rule = RULES.get(n.op)
        if rule is None:
            raise CodegenError(
                f"cannot evaluate {n.op.value}{list(n.shape)} inline: it must be materialised first"
            )
        return rule(self, n, canon(n.shape, coords))

    def plain(self, n: Node, coords: Coords) -> str:
        return self.materialise(self.value(n, coords))

    def materialise(self, v: Val) -> str:
        """The exact value of v: stored * exp(degree * M), guarded so that 0 stays 0."""
        if v.scale is None:
            return v.code
        m = self.mvalue(v.scale)
        dm = m if v.scale.degree == 1 else f"{c_float(v.scale.degree)} * {m}"
        return self.var(f"mlso::unscale({v.code}, {dm})")

    def mvalue(self, s: Scale) -> str:
        """The max tensor's value at the scale's coordinates."""
        v = self.value(s.key, s.mcoords)
        assert v.scale is None, "a max tensor is never scaled itself"
        return v.code

    def flat_index(self, coords: Coords, shape: tuple[int, ...]) -> str:
        """Row-major index of coords in shape (the known flat expression when there is one)."""
        return self._flats.get((coords, shape)) or offset(coords, contiguous(shape))

    def coords_of_flat(self, flat: str, shape: tuple[int, ...]) -> Coords:
        coords = canon(shape, self._row_coords(flat, shape) or decompose(flat, shape))
        self._flats.setdefault((coords, shape), flat)
        return coords

    def _row_coords(self, flat: str, shape: tuple[int, ...]) -> Coords | None:
        """`flat` over `shape` as (the row's coordinates, the column), when flat is the kernel's
        row-major element index and shape has rows of the same length (Flat.row)."""
        if self._row_flat is None or flat != self._row_flat[0]:
            return None
        row, col, length = self._row_flat[1]
        k = len(shape)
        while k and shape[k - 1] == 1:
            k -= 1
        if not k or shape[k - 1] != length:
            return None
        return (*decompose(row, shape[: k - 1]), col, *("0",) * (len(shape) - k))

    def child(self) -> Emitter:
        """An emitter for a nested loop body: same storage and names, its own lines and memo."""
        em = Emitter(self.storage, self.stab, self.names, self.on_use)
        em._flats = dict(self._flats)
        em._row_flat = self._row_flat
        em._thread = list(self._thread)
        em._thread_ids = self._thread_ids + 1000
        return em

    def loop(self, var: str, length: int, body: Emitter, folds: list[tuple[str, str, str]]) -> None:
        """Append `for (var < length) { body; acc = op(acc, value) }` for each (acc, op, value),
        op a key of teams.FOLD (strided over the team's lanes, then all-reduced, when `team` > 1)."""
        for acc, op, _ in folds:
            self.lines.append(f"float {acc} = {FOLD[op][0]};")
        inner = " ".join(
            _one_line(body.lines)
            + [f"{acc} = {FOLD[op][1].format(a=acc, b=val)};" for acc, op, val in folds]
        )
        # unrolled, so that a thread has 8 loads in flight, not one memory latency per element
        self.lines.append("#pragma unroll 8")
        self.lines.append(f"for ({self._range(var, length)}) {{ {inner} }}")
        for acc, op, _ in folds:
            self._team_reduce(acc, op)

    def _range(self, var: str, length: int, split: bool = True) -> str:
        """Loop header of an in-place fold over `length`; `split`: over the team's lanes."""
        if self.team == 1 or not split:
            return f"int {var} = 0; {var} < {length}; ++{var}"
        return f"int {var} = {TEAM_LANE}; {var} < {length}; {var} += {self.team}"

    def _team_reduce(self, acc: str, op: str) -> None:
        if self.team > 1:
            self.lines.append(f"{acc} = mlso::warp_allreduce<{FOLD[op][2]}, {self.team}>({acc});")

    def var(self, expr: str, ctype: str = "float") -> str:
        name = self.names.new("t")
        self.lines.append(f"const {ctype} {name} = {expr};")
        return name

    def load(self, n: Node, off: str) -> str:
        """Load element `off` of stored tensor n, widened to fp32."""
        st = self.storage[n]
        self.on_use(n)
        return self.var(f"mlso::to_f32({st.ptr}[{off}])")

    # ---- leaves ------------------------------------------------------------------------------
    def _leaf(self, n: Node, coords: Coords) -> Val:
        st = self.storage[n]
        if st.computed is not None:  # an index predicate (indexmask.py): computed, not loaded
            return Val(self.var(st.computed.expr(coords)))
        off = self._flats.get((coords, st.shape))
        if off is None or st.strides != contiguous(st.shape):
            off = offset(coords, st.strides)
        code = self.load(n, off)
        return Val(code, st.scale.at(coords) if st.scale else None)

    # ---- thread graphs -----------------------------------------------------------------------
    def push_thread(self, inputs: list[Val]) -> None:
        self._thread_ids += 1
        self._thread.append((self._thread_ids, inputs))

    def pop_thread(self) -> None:
        self._thread.pop()

    def thread_input(self, i: int) -> Val:
        if not self._thread:
            raise CodegenError("THREAD_IN outside a thread graph")
        return self._thread[-1][1][i]


# ---- rules -----------------------------------------------------------------------------------


def _const(em: Emitter, n: Node, coords: Coords) -> Val:
    return Val(c_float(const_value(n)))


def _unary(em: Emitter, n: Node, coords: Coords) -> Val:
    if n in em.stab:
        return _stabilised_exp(em, n, coords)
    x = em.value(n.src[0], coords)
    if n.op is Op.CAST:
        return x
    scale = None
    if x.scale is not None:
        rule = UNARY_DEGREE.get(n.op)
        degree = rule(x.scale.degree) if rule else None
        if degree is None:
            x = Val(em.materialise(x))
        elif degree != 0:
            scale = Scale(x.scale.key, degree, x.scale.mcoords)
    return Val(em.var(f"{UNARY_FN[n.op]}({x.code})"), scale)


def _stabilised_exp(em: Emitter, n: Node, coords: Coords) -> Val:
    """exp(s) as exp(s - M) scaled by M, M = max of s along the softmax axis (synthetic.RowMax)."""
    m_node = em.stab[n]
    s = em.plain(n.src[0], coords)
    mc = list(coords)
    mc[m_node.arg.axis] = "0"
    mcoords = canon(m_node.shape, mc)
    m = em.value(m_node, mcoords).code
    return Val(em.var(f"mlso::exp_rel({s}, {m})"), Scale(m_node, 1, mcoords))


def _binary(em: Emitter, n: Node, coords: Coords) -> Val:
    placed = placed_product(em, n, coords)
    if placed is not None:
        return placed
    a = em.value(n.src[0], bcast(n.src[0].shape, coords))
    b = em.value(n.src[1], bcast(n.src[1].shape, coords))
    scale, mat_a, mat_b = BINARY[n.op](a.scale, b.scale)
    ac = em.materialise(a) if mat_a else a.code
    bc = em.materialise(b) if mat_b else b.code
    return Val(em.var(f"{BINARY_FN[n.op]}({ac}, {bc})"), scale)


def _transpose(em: Emitter, n: Node, coords: Coords) -> Val:
    src = ["0"] * len(coords)
    for i, p in enumerate(n.arg):
        src[p] = coords[i]
    return em.value(n.src[0], tuple(src))


def _broadcast(em: Emitter, n: Node, coords: Coords) -> Val:
    return em.value(n.src[0], bcast(n.src[0].shape, coords))


def _reshape(em: Emitter, n: Node, coords: Coords) -> Val:
    src = n.src[0]
    if isinstance(n.arg, Copy) or n.shape == src.shape:
        return em.value(src, coords)
    view = strided(src, em.storage)  # not strided(n): n may be the stored node being computed
    if view is not None and em.storage[view.leaf].scale is None:
        st = view_strides(src.shape, view.strides, n.shape)
        if st is not None:
            return Val(em.load(view.leaf, offset(coords, st, view.base)))
    flat = em.flat_index(coords, n.shape)
    return em.value(src, em.coords_of_flat(flat, src.shape))


TEAM_LANE = "tl"
"""A thread's lane within its team (kernels.emit_elementwise declares it)."""


def _reduce(em: Emitter, n: Node, coords: Coords) -> Val:
    """A reduction evaluated in place (a loop in the consumer's kernel), for reductions over a
    short or strided axis that feed one elementwise kernel: the split-KV combine is one of them.
    Scaled inputs follow kernels.emit_reduce: an axis the scale does not vary along keeps the
    scale; partials with their own maxima are rescaled to the global max (a Combined node,
    shared by every reduction over the same partials, so num / den cancels)."""
    if isinstance(n.arg, Combined):
        return _combined(em, n, coords)
    picked = selected_read(em, n, coords)
    if picked is not None:
        return picked
    if not isinstance(n.arg, int):
        raise CodegenError(f"{n.op.value} with arg {n.arg!r} must be materialised")
    x, axis = n.src[0], n.arg
    length = x.shape[axis]
    r = em.names.new("ri")
    inner = list(coords)
    inner[axis] = r
    inner_t = canon(x.shape, inner)
    op = "max" if n.op is Op.REDUCE_MAX else "sum"
    probe = em.child().value(x, inner_t).scale
    varying = probe is not None and any(mentions(c, r) for c in probe.mcoords)
    body = em.child()
    acc = em.names.new("acc")
    scale = None
    if probe is None or (not varying and (op == "sum" or probe.degree > 0)):
        v = body.value(x, inner_t)
        em.loop(r, length, body, [(acc, op, v.code)])
        scale = v.scale
    elif op == "sum" and probe.degree == 1:
        dims = tuple(j for j, c in enumerate(probe.mcoords) if mentions(c, r))
        mg_node = synthetic.combined(probe.key, dims)
        mg_coords = canon(
            mg_node.shape, tuple("0" if j in dims else c for j, c in enumerate(probe.mcoords))
        )
        mg = em.value(mg_node, mg_coords).code
        v = body.value(x, inner_t)
        m = body.mvalue(v.scale)
        em.loop(r, length, body, [(acc, op, f"{v.code} * mlso::partial_weight({m}, {mg})")])
        scale = Scale(mg_node, 1, mg_coords)
    else:
        em.loop(r, length, body, [(acc, op, body.plain(x, inner_t))])
    out = acc if n.op is not Op.REDUCE_MEAN else em.var(f"{acc} / {c_float(length)}")
    return Val(out, scale)


def _one_line(lines: list[str]) -> list[str]:
    """Loop-body lines joined into one line: a `#pragma` line (a nested fold's unroll) becomes
    the `_Pragma` operator, since a directive must start its own line (a fold nested in a fold,
    e.g. a column selection read by RoPE's rotate-half selection, would not compile)."""
    return [f'_Pragma("{x[len("#pragma ") :]}")' if x.startswith("#pragma ") else x for x in lines]


def _combined(em: Emitter, n: Node, coords: Coords) -> Val:
    """Max of a partial-max buffer over its partial dims (nested loops), in place."""
    m = n.src[0]
    loops = [(j, em.names.new("rm")) for j in n.arg.dims]
    inner = list(coords)
    for j, var in loops:
        inner[j] = var
    body = em.child()
    val = body.value(m, canon(m.shape, inner)).code
    acc = em.names.new("mg")
    em.lines.append(f"float {acc} = mlso::neg_inf();")
    # the team strides the outermost partial dim only; inner ones run whole in each lane
    head = " ".join(
        f"for ({em._range(var, m.shape[j], split=k == 0)})" for k, (j, var) in enumerate(loops)
    )
    em.lines.append(f"{head} {{ {' '.join(_one_line(body.lines))} {acc} = fmaxf({acc}, {val}); }}")
    em._team_reduce(acc, "max")
    return Val(acc)


def _thread(em: Emitter, n: Node, coords: Coords) -> Val:
    inputs = [em.value(s, bcast(s.shape, coords)) for s in n.src]
    em.push_thread(inputs)
    try:
        body = n.arg.body
        return em.value(body, bcast(body.shape, coords))
    finally:
        em.pop_thread()


def _thread_in(em: Emitter, n: Node, coords: Coords) -> Val:
    return em.thread_input(n.arg)


RULES: dict[Op, Callable[[Emitter, Node, Coords], Val]] = {
    Op.CONST: _const,
    **{op: _unary for op in UNARY},
    **{op: _binary for op in BINARY_OPS},
    Op.TRANSPOSE: _transpose,
    Op.BROADCAST: _broadcast,
    Op.RESHAPE: _reshape,
    Op.THREAD: _thread,
    Op.THREAD_IN: _thread_in,
    **{op: _reduce for op in REDUCE},
}
