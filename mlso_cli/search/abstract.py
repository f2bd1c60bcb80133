"""Abstract expressions of μGraph tensors: one element of a tensor (or of a block's tile) as a
normal-form term over the region's inputs (terms.py), with index variables per dim.

Why through semantics.py: `ExprAlgebra` implements the same methods as the finite-field and the
degree algebras, and every op's meaning comes from `SEMANTICS` / `ACC_TERMS`, so pruning and the
field check share one set of canonical forms (sigmoid = 1/(1+exp(-x)), rsqrt = 1/sqrt, cast =
identity, mean = sum * 1/n, ...).

Index model. An `Expr` is (poly, dims, shape): dims[d] is the digit tuple of free variables that
index tensor dim d (most significant first; () for a size-1 or broadcast dim). Views permute,
split or merge digits; elementwise ops unify their operands' digits (renaming or splitting
variables); matmul and reductions bind the contracted digits in a sum.

A block graph is abstracted once, for a symbolic block: grid dim g is a free variable G_g, the
for-loop step a free variable S. An ITER tile of an input whose dim d is split by grid dim g and
walked by the loop reads the input at digits (G_g, S, t) along d, t the tile position. A sum
inside the loop is then a partial sum over t only; ACC_* bind S (the split axiom merges (S, t)
into one digit); a PARTIAL output keeps G_g as a leading dim and the kernel-level REDUCE_SUM over
it binds G_g, merging (G_g, S, t) into the full contraction. Saved tiles become full tensors by
prefixing G_g to the dims their omap names.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from mlso_cli.ir.graph import PARTIAL, BlockGraph
from mlso_cli.ir.node import Node, const_value, toposort
from mlso_cli.ir.ops import ACCUMULATORS, Op
from mlso_cli.search import terms as T
from mlso_cli.search.terms import ExprError
from mlso_cli.verify.semantics import ACC_TERMS, SEMANTICS

Dims = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Expr:
    """One tensor's abstract expression: `poly` (a terms.py id) indexed by `dims`."""

    poly: int
    dims: Dims
    shape: tuple[int, ...]


_POS: dict[tuple[int, int], int] = {}


def _pos(r: int, n: int) -> int:
    """The shared variable of a dim of size n at offset r from the right: tensors of one shape
    index with the same variables, so most elementwise ops need no renaming."""
    v = _POS.get((r, n))
    if v is None:
        v = _POS[(r, n)] = T.fresh(n)
    return v


def input_expr(index: int, shape: tuple[int, ...]) -> Expr:
    """Kernel input `index`: the element at one free variable per dim (none for size 1)."""
    r = len(shape)
    dims = tuple((_pos(r - 1 - d, n),) if n > 1 else () for d, n in enumerate(shape))
    return Expr(T.of_factor(T.mk(("in", index, dims))), dims, tuple(shape))


def const_expr(value: Fraction) -> Expr:
    return Expr(T.const(value), (), ())


def _size(digits: tuple[int, ...]) -> int:
    n = 1
    for v in digits:
        n *= T.free_size(v)
    return n


def unify(da: tuple[int, ...], db: tuple[int, ...]) -> tuple[dict, dict, tuple[int, ...]]:
    """Common refinement of two digit tuples of equal total size: the splits/renames of a's and
    of b's variables, and the refined digits (a's variables kept where whole)."""
    sa: dict[int, list[int]] = {}
    sb: dict[int, list[int]] = {}
    out: list[int] = []
    qa = [(v, T.free_size(v)) for v in da]
    qb = [(v, T.free_size(v)) for v in db]
    i = j = 0
    ra, rb = (qa[0][1] if qa else 1), (qb[0][1] if qb else 1)
    while i < len(qa) and j < len(qb):
        (a, na), (b, _) = qa[i], qb[j]
        step = min(ra, rb)
        if max(ra, rb) % step:
            raise ExprError(
                f"index digits of sizes {[n for _, n in qa]} and {[n for _, n in qb]} do not nest"
            )
        piece = a if (ra == na and step == na) else T.fresh(step)
        sa.setdefault(a, []).append(piece)
        sb.setdefault(b, []).append(piece)
        out.append(piece)
        ra //= step
        rb //= step
        if ra == 1:
            i += 1
            ra = qa[i][1] if i < len(qa) else 1
        if rb == 1:
            j += 1
            rb = qb[j][1] if j < len(qb) else 1
    if i < len(qa) or j < len(qb):
        raise ExprError("index digits of different total size")
    ren_a = {v: tuple(p) for v, p in sa.items() if tuple(p) != (v,)}
    ren_b = {v: tuple(p) for v, p in sb.items() if tuple(p) != (v,)}
    return ren_a, ren_b, tuple(out)


def _apply(dims: Dims, ren: dict[int, tuple[int, ...]]) -> Dims:
    if not ren:
        return dims
    keys = ren.keys()
    return tuple(
        dim if keys.isdisjoint(dim) else tuple(x for v in dim for x in ren.get(v, (v,)))
        for dim in dims
    )


def _pad(x: Expr, rank: int) -> tuple[Dims, tuple[int, ...]]:
    k = rank - len(x.shape)
    return ((),) * k + x.dims, (1,) * k + x.shape


def align(a: Expr, b: Expr) -> tuple[int, int, Dims, tuple[int, ...]]:
    """Broadcast a and b to one shape and one set of index variables (numpy rules)."""
    if a.dims == b.dims and a.shape == b.shape:
        return a.poly, b.poly, a.dims, a.shape
    rank = max(len(a.shape), len(b.shape))
    da, sa_ = _pad(a, rank)
    db, sb_ = _pad(b, rank)
    # b's dim variables that a also uses in another role must not be captured by the renames
    # below: move them aside first (shared block variables G, S keep their meaning)
    agreed = {v for x, y in zip(da, db) if x == y for v in x}
    clash = ({v for d in db for v in d} - agreed) & ({v for d in da for v in d} | T.deps(a.poly))
    pre = {v: (T.fresh(T.free_size(v)),) for v in clash if v > 0}
    bp = T.subst(b.poly, pre)
    db = _apply(db, pre)
    ren_a: dict[int, tuple[int, ...]] = {}
    ren_b: dict[int, tuple[int, ...]] = {}
    dims: list[tuple[int, ...]] = []
    shape: list[int] = []
    for x, y, nx, ny in zip(da, db, sa_, sb_):
        if nx != ny and 1 not in (nx, ny):
            raise ExprError(f"shapes {a.shape} and {b.shape} do not broadcast")
        shape.append(max(nx, ny))
        if not x or not y:
            dims.append(x or y)
            continue
        ra, rb, out = unify(x, y)
        ren_a.update(ra)
        ren_b.update(rb)
        dims.append(out)
    # b's variables a left alone (b-only dims) keep their names; a's renames only split a's own
    dims_out = tuple(dims)
    return T.subst(a.poly, ren_a), T.subst(bp, ren_b), dims_out, tuple(shape)


def _renamed(x: Expr, ren: dict[int, tuple[int, ...]]) -> Expr:
    return Expr(T.subst(x.poly, ren), _apply(x.dims, ren), x.shape)


class ExprAlgebra:
    """The semantics.py algebra on abstract expressions."""

    def const(self, v: Fraction) -> Expr:
        return const_expr(v)

    def _binary(self, a: Expr, b: Expr, f: Any) -> Expr:
        pa, pb, dims, shape = align(a, b)
        return Expr(f(pa, pb), dims, shape)

    def add(self, a: Expr, b: Expr) -> Expr:
        return self._binary(a, b, T.add)

    def sub(self, a: Expr, b: Expr) -> Expr:
        return self._binary(a, b, T.sub)

    def mul(self, a: Expr, b: Expr) -> Expr:
        return self._binary(a, b, T.mul)

    def neg(self, a: Expr) -> Expr:
        return Expr(T.scale(a.poly, Fraction(-1)), a.dims, a.shape)

    def inv(self, a: Expr, nonzero: bool = False) -> Expr:
        return Expr(T.inv(a.poly), a.dims, a.shape)

    def exp(self, a: Expr) -> Expr:
        return Expr(T.exp(a.poly), a.dims, a.shape)

    def q_known(self, a: Expr) -> bool:
        return True

    def oracle(self, name: str, *args: Expr) -> Expr:
        if len(args) == 1:
            return Expr(T.fn(name, args[0].poly), args[0].dims, args[0].shape)
        a, b = args
        pa, pb, dims, shape = align(a, b)
        return Expr(T.fn(name, pa, pb), dims, shape)

    def oracle_reduce(self, name: str, a: Expr, axis: int) -> Expr:
        bound = [(v, T.free_size(v)) for v in a.dims[axis]]
        return Expr(T.reduce_fn(name, bound, a.poly), _drop(a.dims, axis), _one(a.shape, axis))

    def reduce_sum(self, a: Expr, axis: int) -> Expr:
        digits = a.dims[axis]
        p = T.sum_over([(v, T.free_size(v)) for v in digits], a.poly)
        extra = a.shape[axis] // _size(digits)
        if extra != 1:
            p = T.scale(p, Fraction(extra))  # a broadcast dim: sum_i c = N c
        return Expr(p, _drop(a.dims, axis), _one(a.shape, axis))

    def matmul(self, a: Expr, b: Expr) -> Expr:
        if len(a.shape) < 2 or len(b.shape) < 2:
            raise ExprError("matmul operands must have rank >= 2 (lifting reshapes 1-D operands)")
        k = a.shape[-1]
        if b.shape[-2] != k:
            raise ExprError(f"matmul contracts {a.shape} with {b.shape}")
        # a's contracted digits and b's column digits must not be names the other side uses
        # for something else (square shapes share positional variables): rename those only
        used_b = T.deps(b.poly) | {v for d in b.dims for v in d}
        a2 = _renamed(a, {v: (T.fresh(T.free_size(v)),) for v in a.dims[-1] if v in used_b})
        used_a = T.deps(a2.poly) | {v for d in a2.dims for v in d}
        b2 = _renamed(
            b, {v: (T.fresh(T.free_size(v)),) for v in b.dims[-1] + b.dims[-2] if v in used_a}
        )
        ka, kb = a2.dims[-1], b2.dims[-2]
        if ka and kb:
            ra, rb, kd = unify(ka, kb)
            a2, b2 = _renamed(a2, ra), _renamed(b2, rb)
        else:
            kd = ka or kb
        # batch dims broadcast like an elementwise op (on everything but the last two dims)
        ba = Expr(a2.poly, a2.dims[:-2], a2.shape[:-2])
        bb = Expr(b2.poly, b2.dims[:-2], b2.shape[:-2])
        pa, pb, bdims, bshape = align(ba, bb)
        prod = T.mul(pa, pb)
        p = T.sum_over([(v, T.free_size(v)) for v in kd], prod)
        extra = k // _size(kd)
        if extra != 1:
            p = T.scale(p, Fraction(extra))
        # a's row digits and b's column digits may have been renamed by the batch alignment only
        # when they were batch variables too; they are not, so they carry over unchanged
        return Expr(p, bdims + (a2.dims[-2], b2.dims[-1]), bshape + (a.shape[-2], b.shape[-1]))

    def reshape(self, a: Expr, shape: tuple[int, ...]) -> Expr:
        digits: list[int] = []
        ren: dict[int, tuple[int, ...]] = {}
        for dim, n in zip(a.dims, a.shape):
            if n == 1:
                continue
            digits.extend(dim if dim else (T.fresh(n),))  # a broadcast dim: an unused variable
        out: list[tuple[int, ...]] = []
        queue = list(digits)
        for n in shape:
            got: list[int] = []
            have = 1
            while have < n:
                if not queue:
                    raise ExprError(f"reshape {a.shape} -> {shape}: sizes do not match")
                v = queue.pop(0)
                sv = T.free_size(v)
                if have * sv <= n:
                    got.append(v)
                    have *= sv
                    continue
                need = n // have
                if n % have or sv % need:
                    raise ExprError(f"reshape {a.shape} -> {shape}: dims do not nest as digits")
                hi, lo = T.fresh(need), T.fresh(sv // need)
                ren[v] = (hi, lo)
                got.append(hi)
                have *= need
                queue.insert(0, lo)
            if have != n:
                raise ExprError(f"reshape {a.shape} -> {shape}: dims do not nest as digits")
            out.append(tuple(got))
        p = T.subst(a.poly, _close(ren))
        return Expr(p, tuple(out), tuple(shape))

    def transpose(self, a: Expr, perm: tuple[int, ...]) -> Expr:
        return Expr(a.poly, tuple(a.dims[i] for i in perm), tuple(a.shape[i] for i in perm))

    def broadcast(self, a: Expr, shape: tuple[int, ...]) -> Expr:
        dims, _ = _pad(a, len(shape))
        return Expr(a.poly, dims, tuple(shape))


def _close(ren: dict[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """Compose nested splits (a digit split, then its low part split again)."""

    def expand(v: int) -> tuple[int, ...]:
        return tuple(x for p in ren[v] for x in (expand(p) if p in ren else (p,)))

    return {v: expand(v) for v in ren}


def _drop(dims: Dims, axis: int) -> Dims:
    return dims[:axis] + ((),) + dims[axis + 1 :]


def _one(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return shape[:axis] + (1,) + shape[axis + 1 :]


ALGEBRA = ExprAlgebra()


# ---- graphs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockContext:
    """The symbolic block of one graph-defined kernel: grid and loop variables, source tensors."""

    bg: BlockGraph
    srcs: tuple[Expr, ...]
    grid_vars: tuple[int | None, int | None, int | None]
    step_var: int | None

    @classmethod
    def of(cls, bg: BlockGraph, srcs: list[Expr] | tuple[Expr, ...]) -> BlockContext:
        gv = tuple(T.fresh(g) if g > 1 else None for g in bg.grid)
        return cls(bg, tuple(srcs), gv, T.fresh(bg.loop) if bg.loop > 1 else None)  # type: ignore[arg-type]


def _iter(ctx: BlockContext, n: Node) -> Expr:
    """This block's tile of source n.arg at step S: digits (G_g, S, t) along split/walked dims."""
    src = ctx.srcs[n.arg]
    im = ctx.bg.inputs[n.arg]
    r = len(n.shape)
    ren_src: dict[int, tuple[int, ...]] = {}
    dims: list[tuple[int, ...]] = []
    for d, (full, tile) in enumerate(zip(src.shape, n.shape)):
        new: list[int] = [
            ctx.grid_vars[g]
            for g, m in enumerate(im.imap)  # type: ignore[misc]
            if m == d and ctx.grid_vars[g] is not None
        ]
        if im.fmap == d and ctx.step_var is not None:
            new.append(ctx.step_var)
        t = _pos(r - 1 - d, tile) if tile > 1 else None
        if t is not None:
            new.append(t)
        old = src.dims[d]
        if not old:
            dims.append((t,) if t is not None else ())  # broadcast source dim
            continue
        if len(old) == 1 and (not new or _size(tuple(new)) == full):
            ren_src[old[0]] = tuple(new)
            dims.append((t,) if t is not None else ())
            continue
        ra, rb, _ = unify(old, tuple(new))
        ren_src.update(ra)
        tile_ren = rb.get(t, (t,)) if t is not None else ()
        dims.append(tuple(tile_ren))
        if any(v != t for v in rb):
            raise ExprError(
                "grid/loop digits of an ITER tile do not nest in its source's index digits"
            )
    return Expr(T.subst(src.poly, ren_src), tuple(dims), tuple(n.shape))


def _accumulate(ctx: BlockContext, n: Node, args: list[Expr]) -> Expr:
    term = ACC_TERMS[n.op](ALGEBRA, *args)
    if ctx.step_var is None:
        return term
    return Expr(T.sum_over([(ctx.step_var, ctx.bg.loop)], term.poly), term.dims, term.shape)


def _thread(n: Node, args: list[Expr]) -> Expr:
    env: dict[Node, Expr] = {}
    for t in toposort([n.arg.body]):
        if t.op is Op.THREAD_IN:
            env[t] = args[t.arg]
        elif t.op is Op.CONST:
            env[t] = const_expr(const_value(t))
        else:
            env[t] = SEMANTICS[t.op](ALGEBRA, t, *[env[s] for s in t.src])
    return env[n.arg.body]


def abstract(node: Node, env: dict[Node, Any], ctx: BlockContext | None = None) -> Any:
    """The abstract expression of one node from its sources' (env[src]); block-level nodes need
    their kernel's BlockContext. GRAPH_DEF gives a tuple (one Expr per output; PROJ picks)."""
    op = node.op
    if op is Op.INPUT:
        return input_expr(node.arg, node.shape)
    if op is Op.CONST:
        return const_expr(const_value(node))
    if op is Op.ITER:
        assert ctx is not None, "ITER needs its BlockContext"
        return _iter(ctx, node)
    args = [env[s] for s in node.src]
    if op is Op.PROJ:
        return args[0][node.arg]
    if op is Op.GRAPH_DEF:
        return run_block(node.arg, args)
    if op in ACCUMULATORS:
        assert ctx is not None, "accumulators need their BlockContext"
        return _accumulate(ctx, node, args)
    if op is Op.SAVE:
        return args[0]
    if op is Op.THREAD:
        return _thread(node, args)
    return SEMANTICS[op](ALGEBRA, node, *args)


def run_block(bg: BlockGraph, srcs: list[Expr], observe: Any = None) -> tuple[Expr, ...]:
    """Abstract a graph-defined kernel for its symbolic block; return the full output tensors."""
    ctx = BlockContext.of(bg, srcs)
    env: dict[Node, Any] = {}
    for n in bg.nodes():
        env[n] = abstract(n, env, ctx)
        if observe is not None:
            observe(n, env[n])
    return tuple(saved_output(ctx, s, env[s]) for s in bg.outputs)


def saved_output(ctx: BlockContext, save: Node, tile: Expr) -> Expr:
    """The full tensor a SAVE writes: grid digits prefixed along omap dims, PARTIAL leading dims."""
    omap = save.arg.omap
    lead: list[tuple[int, ...]] = []
    dims = [list(d) for d in _pad(tile, len(save.shape))[0]]
    for g, d in enumerate(omap):
        v = ctx.grid_vars[g]
        if d is None:
            continue
        if d == PARTIAL:
            lead.append((v,) if v is not None else ())
        elif v is not None:
            dims[d].insert(0, v)
    return Expr(tile.poly, tuple(lead) + tuple(tuple(d) for d in dims), ctx.bg.output_shape(save))


def abstract_graph(kg: Any, observe: Any = None) -> dict[Node, Expr]:
    """Kernel-level expressions of every node of kg (GRAPH_DEF maps to its output tuple).
    `observe(node, expr)` also sees every block-level node inside graph-defined kernels."""
    env: dict[Node, Any] = {}
    for n in kg.nodes():
        if n.op is Op.GRAPH_DEF:
            env[n] = run_block(n.arg, [env[s] for s in n.src], observe)
        else:
            env[n] = abstract(n, env)
        if observe is not None and n.op is not Op.GRAPH_DEF:
            observe(n, env[n])
    return env


def expr_equal(a: Expr, b: Expr) -> bool:
    """Equal tensors under the axioms: same shape and the same normal form, position by position."""
    if a.shape != b.shape:
        return False
    pa, pb, _, _ = align(a, b)
    return pa == pb
