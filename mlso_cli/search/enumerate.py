"""Bottom-up enumeration of graph-defined kernels under abstract-expression pruning.

Why bottom-up over expressions: Mirage grows graphs one op at a time and prunes an op whose
abstract expression is not a subexpression of the target; two graphs that differ only in the
order of independent ops are then visited twice. Here the state is the *set of distinct values*
(one per abstract-expression key and phase, the cheapest construction kept), grown in rounds
where every new op uses at least one value of the previous round (semi-naive evaluation), so no
value is built twice and op order never matters. A block graph is complete when every target
output has a value that equals it; its recipe is the cone of ops that value needs.

The enumerator works at one provisional size per signature (search/space.py); what it records is
a `Recipe`, which `space.instantiate` replays at the sizes the cost model chooses.
For a signature with a partial grid dim, block values are partial sums: a kernel-level combine
(REDUCE_SUM over the partial dim) completes them, and a short kernel-level enumeration of
elementwise ops over the completed values reaches the outputs (split-K / split-KV).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Protocol

from mlso_cli.ir import build as b
from mlso_cli.ir.graph import PARTIAL, KernelGraph
from mlso_cli.ir.node import Node, const_value, toposort
from mlso_cli.ir.ops import ELEMENTWISE, REDUCE, Op, Phase
from mlso_cli.search import terms as T
from mlso_cli.search.dims import DimClasses, typing_is_sound, value_classes
from mlso_cli.search.fingerprint import Fingerprints, Print
from mlso_cli.search.space import (
    ROW,
    WHOLE_CLASS,
    Dims,
    Recipe,
    RecipeError,
    Regroup,
    Signature,
    Step,
    apply_step,
    feed_classes,
    feed_input,
    feeds_of,
    is_whole,
    iters,
    reshape_nodes,
    save_omap,
    tile_reshape,
)


class Pruner(Protocol):
    """Abstract-expression pruning (search/expr.py): expressions of tiles and ops, None for an op
    whose expression is not a subexpression of any target output."""

    def tile(self, node: Node, feed: int, sig: Signature) -> Any: ...

    def op(self, node: Node, srcs: Sequence[Any]) -> Any | None: ...


@dataclass(frozen=True)
class Expr:
    """A value as the search sees it: its fingerprint (identity) and abstract expression."""

    print: Print
    abstract: Any = None


class SearchAlgebra:
    """Fingerprints for identity and goals, an optional pruner for admission."""

    def __init__(self, fp: Fingerprints, pruner: Pruner | None) -> None:
        self.fp, self.pruner = fp, pruner

    def tile(self, node: Node, feed: int, sig: Signature) -> Expr:
        return Expr(
            self.fp.tile(node, feed, sig),
            self.pruner.tile(node, feed, sig) if self.pruner else None,
        )

    def op(self, node: Node, srcs: Sequence[Expr]) -> Expr | None:
        a = None
        if self.pruner is not None:
            a = self.pruner.op(node, [s.abstract for s in srcs])
            if a is None or not self._denominator(node, srcs, self.pruner.op):
                return None
        p = self.fp.op(node, [s.print for s in srcs])
        return None if p is None else Expr(p, a)

    @staticmethod
    def _denominator(node: Node, srcs: Sequence[Expr], check: Callable) -> bool:
        """A division survives only if the reciprocal of its divisor is a subexpression of the
        target too (a constant divisor always does). Why: x * y / y is x again, and admitted as
        such; the enumeration used it to broadcast a per-row statistic to a whole tile (S * P
        / P), a division by zero wherever P is 0 that no field check at random points sees.
        A target that divides by y has 1 / y in its canonical forms; one that never does, not."""
        if node.op is not Op.DIV or node.src[1].op is Op.CONST:
            return True
        return check(b.unary(Op.RECIPROCAL, node.src[1]), [srcs[1].abstract]) is not None

    def admits_accumulated(self, node: Node, e: Expr) -> bool:
        """Is the sum of this loop-phase value over all steps a subexpression of the target?"""
        if self.pruner is None:
            return True
        return self.pruner.op(b.accumulate(Op.ACC_SUM, node), [e.abstract]) is not None

    def key(self, e: Expr) -> Hashable:
        return e.print.key()

    def ray(self, e: Expr) -> Hashable:
        """The value up to a constant factor. The fingerprint's ray alone is not enough: at
        reduced shapes a tile may hold one row, and a row times its own statistic (x * rsqrt
        (mean(x^2) + eps)) is then a scalar multiple of x at any one evaluation point. The
        abstract expression, scaled to a leading coefficient of one, tells a constant factor
        from a data-dependent one."""
        a = e.abstract
        if a is None:
            return e.print.ray()
        ts = T.terms(a.poly)
        lead = ts[0][1] if ts else 1
        return e.print.ray(), a.dims, T.scale(a.poly, Fraction(1) / lead) if ts else a.poly

    def output(self, e: Expr, node: Node) -> int | None:
        return next(
            (j for j in range(len(self.fp.target.outputs)) if self.fp.matches(e.print, j)), None
        )

    def combine(self, e: Expr, node: Node, omap: tuple[int | None, ...]) -> Expr | None:
        """The value summed over the partial grid dim (None when that sum is not admitted)."""
        a = None
        if self.pruner is not None:
            a = self.pruner.combined(node, e.abstract, omap)
            if a is None:
                return None
        c = self.fp.combine(e.print)
        return None if c is None else Expr(c, a)

    def kernel_op(self, node: Node, srcs: Sequence[Expr]) -> Expr | None:
        a = None
        if self.pruner is not None:
            a = self.pruner.kernel_op(node, [s.abstract for s in srcs])
            if a is None or not self._denominator(node, srcs, self.pruner.kernel_op):
                return None
        p = self.fp.op(node, [s.print for s in srcs])
        return None if p is None else Expr(p, a)


@dataclass
class Stats:
    states: int = 0
    pruned: int = 0
    duplicates: int = 0
    invalid: int = 0


@dataclass
class Value:
    node: Node
    expr: Any
    step: Step | None
    """How it is built (None for ITER tiles)."""
    ops: int
    """Non-elementwise ops in its cone (the block-op bound counts these)."""
    cost: float
    """Work in its cone: elements computed, times loop steps for loop-phase ops."""
    round: int = 0
    classes: tuple[int | None, ...] = ()
    """Index class of each dim (dims.value_classes)."""
    partial: bool = False
    """A loop-phase value holding a sum over part of the loop's index (one step's share)."""
    scalings: int = 0
    """Multiplications by a constant in its cone: of two constant multiples of one value, the
    one with fewer represents them."""
    counted: frozenset[int] = frozenset()
    """The pool numbers of the non-elementwise values in its cone, itself included: `ops` is its
    size. A set, not a sum over operands, because cones share: a centred row and its own
    rsqrt(variance) both contain the mean, which one block computes once."""


@dataclass(frozen=True)
class Limits:
    block_ops: int = 11
    rounds: int = 9
    pool: int = 600
    """Distinct values kept per signature; beyond it, new values are dropped (counted)."""
    max_states: int | None = None


_RANGES = tuple(tuple(range(n)) for n in range(8))
"""(), (0,), (0, 1), ...: a step's operand numbers as `_add` rebuilds them."""
_STEPS: dict[tuple, Step] = {}


def _step(op: Op, srcs: tuple[int, ...], arg: Any = None) -> Step:
    """Step(op, srcs, arg), made once: the enumeration tries the same few steps on every pair
    of values, and a frozen dataclass costs a microsecond to build (steps are immutable and
    compared by value, so sharing one is the same as building it again)."""
    key = (op, srcs, arg)
    got = _STEPS.get(key)
    if got is None:
        got = _STEPS[key] = Step(op, srcs, arg)
    return got


_CONST_FAMILY = {Op.MUL: "scale", Op.DIV: "scale", Op.ADD: "shift", Op.SUB: "shift"}
_INVERSE = {Op.DIV: Op.MUL, Op.MUL: Op.DIV, Op.SUB: Op.ADD, Op.ADD: Op.SUB}


def _undoes(node: Node) -> bool:
    """Does this op undo its operand's own last op: (a * b) / b, (a / b) * b, (a + c) - c,
    (a - c) + c? Such a value is `a` again, spelled bigger: the enumeration had used it to
    broadcast a per-row statistic to a whole tile (S * P / P), a division by zero wherever P is
    0 that also saves a full tile where a column would do. Pruned at both levels."""
    inv = _INVERSE.get(node.op)
    if inv is None or len(node.src) != 2:
        return False
    x, y = node.src
    orders = ((x, y), (y, x)) if node.op in _COMMUTATIVE else ((x, y),)
    for inner, other in orders:
        if inner.op is not inv or len(inner.src) != 2:
            continue
        removable = inner.src if inv in _COMMUTATIVE else inner.src[1:]
        if any(r == other for r in removable):
            return True
    return False


_COMMUTATIVE = frozenset({Op.ADD, Op.MUL, Op.MAX})
_COUNTED = frozenset({Op.MATMUL, Op.ACC_SUM, Op.ACC_EXP_SUM, Op.ACC_EXP_WSUM}) | frozenset(
    {Op.REDUCE_SUM, Op.REDUCE_MAX, Op.REDUCE_MEAN}
)


_OP_WEIGHT = {Op.MATMUL: 8.0, Op.DIV: 4.0, Op.SQRT: 4.0, Op.EXP: 2.0, Op.ERF: 4.0}
"""Relative price of one output element of an op, against a multiply (1). A divide or a sqrt is
an IEEE-rounded multi-instruction sequence where rsqrt and a multiply are one instruction each."""
LOOP_PASS_WEIGHT = 4.0
"""Extra weight of a loop-phase op that is not a contraction: codegen runs it as a pass over the
tile in every step, through shared memory with a barrier, and a value between a matmul and the
online-softmax accumulator keeps the step off the register path (codegen/blocklayout.py). The
reduced shapes understate this: their loops take 2-4 steps where full shapes take up to 32, and
their score tiles are a few hundred elements, so without the weight the enumeration kept
`(q k) / sqrt(s)` in the loop over `(q / sqrt(s)) k` with q normalised once (qknorm: 29 µs
against the fixture's 18 µs on the H200, benchmarks/RESULTS.md)."""


MMA_ROWS = 16
"""Rows of one tensor-core tile: codegen's matmul computes whole m16 tiles, so a product of one
row (beta @ W beside a LayerNorm's rows) costs what 16 rows do (search/cost.py `_mma_chain_s`
prices it so too). Priced by its own rows, a per-step 1-row matmul looked 16 times cheaper than
it runs, and layernorm_linear kept `x̂ γ @ W + β @ W` (two matmuls a step) over `(x̂ γ + β) @ W`
(one): on the H200 the second matmul and its staging cost 1.4 µs of a 20 µs program."""


def construction_cost(op: Op, node: Node, loop: int) -> float:
    """The enumeration's price of computing `node` once per block: which of two constructions of
    one value to keep. Elements computed, times loop steps in the loop phase, times the op's
    weight. A ranking heuristic only; sizes and the cost model decide between programs."""
    weight = _OP_WEIGHT.get(op, 1.0)
    if node.phase is Phase.LOOP:
        weight *= loop * (1.0 if op in _COUNTED else LOOP_PASS_WEIGHT)
    numel = node.numel
    if op is Op.MATMUL and len(node.shape) >= 2:
        rows = node.shape[-2]
        numel = numel // rows * -(-rows // MMA_ROWS) * MMA_ROWS
    return numel * weight


@dataclass(frozen=True)
class Vocabulary:
    """The ops and constants the enumeration tries, read off the target: an op that appears in no
    canonical form of the target cannot be in a subexpression of it."""

    unary: tuple[Op, ...]
    binary: tuple[Op, ...]
    reduce: tuple[Op, ...]
    consts: tuple[Fraction, ...]
    exp_accumulators: bool
    roles: frozenset[tuple[Fraction, str]] = frozenset()
    """(constant, 'scale' | 'shift'): how the target uses each constant. An epsilon is added,
    a 1/N multiplies; the search uses each constant only in its role (a search policy: a
    program that folds constants differently is not explored)."""

    @staticmethod
    def of(target: KernelGraph) -> Vocabulary:
        ops = {n.op for n in target.nodes()}
        unary = {
            op
            for op in ops
            if op in ELEMENTWISE and op not in (Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAX, Op.CAST)
        }
        if Op.SQRT in ops and Op.RECIPROCAL in ops:
            unary.add(Op.RSQRT)  # 1/sqrt(x): one canonical form in the algebra
        if Op.MUL in ops or Op.SQUARE in ops:
            unary.add(Op.SQUARE)
        binary = [Op.MUL, Op.ADD, Op.SUB, Op.DIV] + ([Op.MAX] if Op.MAX in ops else [])
        reduce = tuple(op for op in (Op.REDUCE_SUM, Op.REDUCE_MAX) if op in ops)
        consts = tuple(sorted({const_value(n) for n in target.nodes() if n.op is Op.CONST}))
        roles = set()
        for n in target.nodes():
            for s in n.src:
                if s.op is Op.CONST and n.op in _CONST_FAMILY:
                    roles.add((const_value(s), _CONST_FAMILY[n.op]))
        return Vocabulary(
            tuple(sorted(unary, key=lambda o: o.value)),
            tuple(binary),
            reduce,
            consts,
            Op.EXP in ops,
            frozenset(roles),
        )


def _rsqrt_of(search: BlockSearch, v: int | Value) -> int | None:
    return search._add(Step(Op.RSQRT, (0,)), [v], 0, existing=True)


def _div_sqrt(search: BlockSearch, srcs: list, v: int | Value) -> int | None:
    r = _rsqrt_of(search, v)
    return None if r is None else search._add(Step(Op.MUL, (0, 1)), [srcs[0], r], 0, existing=True)


_CHEAPER: dict[tuple[Op, Op], Callable[..., int | None]] = {
    (Op.DIV, Op.SQRT): _div_sqrt,
    (Op.RECIPROCAL, Op.SQRT): lambda search, srcs, v: _rsqrt_of(search, v),
}
"""Replay rewrites, (op, op of its last operand) -> the cheaper spelling: x / sqrt(v) becomes
x * rsqrt(v), and 1 / sqrt(v) becomes rsqrt(v). The abstract expressions are the same (rsqrt is
1/sqrt in the algebra), but codegen computes a per-element IEEE sqrt and division for the first
spelling: ntrans's block took 5.3 µs with it and 3.3 µs without on the H200."""


_REPLAYED = ELEMENTWISE | REDUCE | {Op.MATMUL, Op.TRANSPOSE, Op.RESHAPE}
"""Target ops the replay reproduces on tiles (block ops; the rest stop it)."""


def _summed_axis(op: Op, arg: Any, rank: int) -> int | None:
    """The operand axis an op sums over: a reduction's axis, a matmul's contraction (the last
    axis of its first operand); None for ops that sum nothing."""
    if op in REDUCE:
        return arg
    if op is Op.MATMUL:
        return rank - 1
    return None


class BlockSearch:
    """One signature's enumeration (at provisional dims)."""

    def __init__(
        self,
        target: KernelGraph,
        dc: DimClasses,
        sig: Signature,
        dims: Dims,
        algebra: SearchAlgebra,
        vocab: Vocabulary,
        limits: Limits,
        stats: Stats,
        tick: Callable[[], bool] | None = None,
    ) -> None:
        self.target, self.dc, self.sig, self.dims = target, dc, sig, dims
        self.alg, self.vocab, self.limits, self.stats = algebra, vocab, limits, stats
        self.tick = tick or (lambda: True)
        self.feeds = feeds_of(target, dc, sig)
        self._reshapes = reshape_nodes(target)
        tiles, _, _ = iters(target, dc, sig, dims, self.feeds)
        self.values: list[Value] = []
        self.seen: dict[tuple[Phase | None, Hashable], int] = {}
        self.typed = typing_is_sound(dc)
        for f, t in zip(self.feeds, tiles):
            e = algebra.tile(t, f, sig)
            cs = tuple(
                c if t.shape[d] > 1 else None for d, c in enumerate(feed_classes(dc, sig, f))
            )
            self.values.append(Value(t, e, None, 0, 0.0, classes=cs))
            self.seen[(t.phase, t.shape, algebra.key(e))] = len(self.values) - 1
        self.consts = [
            Value(n, algebra.op(n, ()), Step(Op.CONST, (), c), 0, 0.0)
            for c in vocab.consts
            for n in [self._const(c)]
        ]
        self.providers: dict[int, int] = {}
        self.rays: dict[tuple, int] = {
            (v.node.phase, algebra.ray(v.expr)): i for i, v in enumerate(self.values)
        }
        self.partials: list[int] = []
        self.combined: dict[int, Expr] = {}
        # partial sums are completed at kernel level for one output only (KernelCompletion)
        self.partial_omap = (
            save_omap(dc, sig, 0)
            if sig.partial() is not None and len(target.outputs) == 1
            else None
        )
        self.tile = self._tile_shape()
        """One block's tile of output 0 (split signatures only): the shape a partial is saved in."""
        self.laid_out = {d for d in self.partial_omap or () if d is not None and d != PARTIAL}
        """Output axes a grid dim lays out (`_saved_in_place`)."""
        self.donor: int | None = None
        """The first post-loop value of the tile's shape: broadcasts take their shape from it."""
        self.narrow: list[int] = []
        """Post-loop values narrower than the tile, waiting for a donor (`_broadcast_partial`)."""
        self.stopped = False

    @staticmethod
    def _const(c: Fraction) -> Node:
        return b.const(c)

    # ---- seeding -----------------------------------------------------------------------------
    def _replay_target(self) -> None:
        """Seed the pool with the target's own tile-local values.

        Why: a value the target computes from one tile's worth of each input (a normalised row,
        a scaled score tile, an elementwise chain) is by definition a subexpression of the
        target, and one tile computes it the way the target does. Enumerating it op by op costs
        one round per elementwise op (ntrans's two RMSNorms are 16 deep; its pool outgrew the
        state budget by round 5). So the target's nodes are replayed on this signature's tiles in
        topological order, through `_add` (same typing, pruning, fingerprints and dedup as any
        other value), up to the first op that would sum over a split index (the loop's, or a
        grid dim's): those sums, and everything after them, are left to the enumeration, which
        builds the accumulators and the combines. Casts are transparent (the search's values are
        exact; codegen chooses storage). Nothing here knows what the target computes: it is the
        enumeration's round 0, grown from the target instead of from the inputs alone."""
        n_in = len(self.target.inputs)
        whole = {feed_input(f): i for i, f in enumerate(self.feeds) if is_whole(f)}
        stats: dict[Node, int | Value | None] = {}
        if whole:
            # first on the whole feeds, for the statistics: a reduction over the loop's index of
            # a whole tile is a sum within the block, computed once before the loop
            first = self._replay({f: whole.get(f, f) for f in range(n_in)}, {})
            stats = {n: v for n, v in first.items() if v is not None and self._broadcasts(v)}
        self._replay({f: f for f in range(n_in)}, stats)

    def _broadcasts(self, v: int | Value) -> bool:
        """A whole-feed value that carries no loop index: it applies to every step's slice."""
        val = self.values[v] if isinstance(v, int) else v
        return all(c is None or c < WHOLE_CLASS for c in val.classes)

    def _replay(
        self, feed_of: dict[int, int], fallback: dict[Node, int | Value | None]
    ) -> dict[Node, int | Value | None]:
        """One replay of the target on the tiles `feed_of` picks per input (value numbers);
        where an op cannot be replayed on those tiles, the `fallback` value of that node (a
        statistic of a whole feed) stands in."""
        split = {ax.cls for ax in self.sig.grid} | (
            {self.sig.loop} if self.sig.loop is not None else set()
        )
        consts = {c.step.arg: c for c in self.consts}
        at: dict[Node, int | Value | None] = {
            inp: feed_of[f] for f, inp in enumerate(self.target.inputs)
        }
        for n in toposort(list(self.target.outputs)):
            if n in at:
                continue
            at[n] = self._replay_node(n, at, consts, split)
            if at[n] is None and fallback.get(n) is not None:
                at[n] = fallback[n]
        return at

    def _replay_node(
        self,
        n: Node,
        at: dict[Node, int | Value | None],
        consts: dict,
        split: set[int],
    ) -> int | Value | None:
        if n.op is Op.CONST:
            return consts.get(const_value(n))
        srcs = [at.get(s) for s in n.src]
        if any(s is None for s in srcs) or self.stopped:
            return None
        if n.op is Op.CAST:
            return srcs[0]
        rule = _CHEAPER.get((n.op, n.src[-1].op))
        if rule is not None and at.get(n.src[-1].src[0]) is not None:
            return rule(self, srcs, at[n.src[-1].src[0]])
        if n.op not in _REPLAYED:
            return None
        vals = [self.values[s] if isinstance(s, int) else s for s in srcs]
        summed = _summed_axis(n.op, n.arg, len(vals[0].node.shape))
        if summed is not None and (
            not vals[0].classes
            or (vals[0].classes[summed] in split and vals[0].node.shape[summed] > 1)
        ):
            return None  # a sum over a split index: the enumeration's to build
        arg, classes = n.arg, None
        if n.op is Op.RESHAPE:
            arg = Regroup(self._reshapes.index(n))
            classes = self.dc.node_class.get(n)
            if tile_reshape(n.src[0].shape, n.shape, vals[0].node.shape) is None or not classes:
                return None
            if any(c is not None and c >= WHOLE_CLASS for c in vals[0].classes):
                classes = tuple(
                    c + WHOLE_CLASS if c is not None and c == self.sig.loop else c for c in classes
                )
        return self._add(
            Step(n.op, tuple(range(len(srcs))), arg),
            list(srcs),
            0,
            existing=True,
            classes=classes,
        )

    # ---- growth ------------------------------------------------------------------------------
    def _add(
        self,
        step: Step,
        operands: list[int | Value],
        rnd: int,
        existing: bool = False,
        classes: tuple[int | None, ...] | None = None,
    ) -> int | None:
        """Grow the pool by one op; the new value's number, or None when it is refused or a
        duplicate (with `existing`, a duplicate answers the number of the value it equals)."""
        if self.stopped:
            return None
        srcs = [self.values[o] if isinstance(o, int) else o for o in operands]
        # (written out for one or two operands: this preamble runs for every pair tried)
        if len(srcs) == 1:
            counted = srcs[0].counted
            rank = len(srcs[0].node.shape)
        elif len(srcs) == 2:
            counted = srcs[0].counted | srcs[1].counted
            rank = max(len(srcs[0].node.shape), len(srcs[1].node.shape))
        else:
            counted = frozenset().union(*(v.counted for v in srcs))
            rank = max((len(v.node.shape) for v in srcs), default=0)
        is_counted = step.op in _COUNTED
        ops = len(counted) + (1 if is_counted else 0)
        if ops > self.limits.block_ops:
            return None
        if step.arg == ROW:
            rank += 1
        if classes is None:
            classes = value_classes(step.op, step.arg, [v.classes for v in srcs], rank)
        if classes is None and self.typed:
            self.stats.pruned += 1
            return None
        try:
            node = apply_step(
                step
                if step.srcs == _RANGES[len(srcs)]
                else Step(step.op, _RANGES[len(srcs)], step.arg),
                [v.node for v in srcs],
                self.target,
            )
        except RecipeError:
            self.stats.invalid += 1
            return None
        if _undoes(node):
            self.stats.pruned += 1
            return None
        if classes is not None:
            classes = tuple(c if node.shape[d] > 1 else None for d, c in enumerate(classes))
        self.stats.states += 1
        if not self.tick() or (
            self.limits.max_states is not None and self.stats.states >= self.limits.max_states
        ):
            self.stopped = True
        e = self.alg.op(node, [v.expr for v in srcs][: len(node.src)])  # a broadcast: no donor
        if e is None or (node.numel > 1 and e.print.uniform()):
            self.stats.pruned += 1  # not a subexpression, or a constant spelled the long way
            return None
        partial = any(v.partial for v in srcs) or self._splits_loop(step, srcs, node)
        if partial and node.phase is Phase.LOOP and not self.alg.admits_accumulated(node, e):
            self.stats.pruned += 1  # a partial sum only matters through an accumulator
            return None
        key = (node.phase, node.shape, self.alg.key(e))
        cost = sum(v.cost for v in srcs) + construction_cost(step.op, node, self.dims.loop)
        # constants used as operands become steps of their own when the recipe is extracted
        srcs_idx = []
        for o in operands:
            if isinstance(o, int):
                srcs_idx.append(o)
            else:
                srcs_idx.append(self._materialise(o))
        value = Value(
            node,
            e,
            Step(step.op, tuple(srcs_idx), step.arg),
            ops,
            cost,
            rnd,
            classes or (),
            partial and node.phase is Phase.LOOP,
        )
        direct = step.op is Op.MUL and any(self._is_const(j) for j in srcs_idx)
        value.scalings = sum(v.scalings for v in srcs) + (1 if direct else 0)
        if key in self.seen:
            self.stats.duplicates += 1
            old = self.seen[key]
            value.counted = counted | {old} if is_counted else counted
            if cost < self.values[old].cost:
                self.values[old] = value
                self._check_goal(old)
            return old if existing else None
        ray = (node.phase, self.alg.ray(e))
        rep = self.rays.get(ray)
        if rep is not None and not direct and value.scalings >= self.values[rep].scalings:
            # a constant multiple of a value we have: only `x * c` itself may spell it (a mean,
            # a scale); (c + 1) x, (c x) y and the like add nothing the abstract check can use
            self.stats.duplicates += 1
            return None
        if len(self.values) >= self.limits.pool:
            return None
        value.counted = counted | {len(self.values)} if is_counted else counted
        self.values.append(value)
        if rep is None or value.scalings < self.values[rep].scalings:
            self.rays[ray] = len(self.values) - 1
        self.seen[key] = len(self.values) - 1
        self._check_goal(len(self.values) - 1)
        return len(self.values) - 1

    def _broadcast_partial(self, i: int) -> None:
        """A post-loop value narrower than the output tile (a per-row sum of squares next to
        a rows x cols product), broadcast to the tile so that it can be saved as a partial sum
        in the output's layout. Why: saved as it is, its size-1 dim is laid out along the
        output's split grid dim (one column per block), which no kernel-level op can
        broadcast back; and without the broadcast the enumeration spelled it S * P / P. The
        step names a value of the tile's shape as its shape donor, so the recipe instantiates
        at any dims."""
        v = self.values[i]
        if v.step is not None and v.step.op is Op.BROADCAST:
            return
        tile, shape = self.tile, v.node.shape
        if tile is None or len(shape) != len(tile):
            return
        if shape == tile:
            if self.donor is None:
                # a donor at last: broadcast the narrow values that waited for one
                self.donor = i
                waiting, self.narrow = self.narrow, []
                for j in waiting:
                    self._add(Step(Op.BROADCAST, (j, i)), [j, i], self.values[j].round)
            return
        if any(s != t and s != 1 for s, t in zip(shape, tile)):
            return
        if self.donor is None:
            self.narrow.append(i)
        else:
            self._add(Step(Op.BROADCAST, (i, self.donor)), [i, self.donor], v.round)

    def _saved_in_place(self, shape: tuple[int, ...]) -> bool:
        """Can a post-loop value of this shape be saved as a partial as it is? Yes for the tile,
        and for a value narrower than it (size 1 where the tile is wider) along output axes that
        no grid dim lays out: a split-KV sum per row ([1, rows, 1] beside a [1, rows, d] weighted
        sum, grid over batch, rows and splits) is saved as [splits, .., rows, 1], and the
        combine broadcasts it. Along an axis the grid lays out (rmsnorm's columns), each block
        would write its own column: such a value is broadcast to the tile first."""
        tile = self.tile
        if tile is None or len(shape) != len(tile):
            return False
        return all(
            s == t or (s == 1 and a not in self.laid_out)
            for a, (s, t) in enumerate(zip(shape, tile))
        )

    def _tile_shape(self) -> tuple[int, ...] | None:
        """One block's tile of output 0 at this signature's provisional sizes."""
        if self.partial_omap is None:
            return None
        tile = list(self.target.outputs[0].shape)
        grid = tuple(self.dims.grid) + (1,) * (3 - len(self.dims.grid))
        for g, d in enumerate(self.partial_omap):
            if d is not None and d != PARTIAL:
                tile[d] //= grid[g]
        return tuple(tile)

    def _splits_loop(self, step: Step, srcs: list[Value], node: Node) -> bool:
        """Does this op sum over the index the loop walks (a contraction within one step)?"""
        if node.phase is not Phase.LOOP or self.sig.loop is None:
            return False
        ax = _summed_axis(step.op, step.arg, len(srcs[0].node.shape))
        return ax is not None and srcs[0].classes[ax : ax + 1] == (self.sig.loop,)

    def _materialise(self, c: Value) -> int:
        key = (None, (), ("const", c.step.arg))
        if key not in self.seen:
            self.values.append(c)
            self.seen[key] = len(self.values) - 1
        return self.seen[key]

    def _check_goal(self, i: int) -> None:
        v = self.values[i]
        if v.node.phase is Phase.LOOP:
            return
        if self.sig.partial() is not None:
            if (
                self.partial_omap is not None
                and v.node.phase is Phase.POST
                and i not in self.combined
                and len(v.node.shape) == len(self.target.outputs[0].shape)
            ):
                in_place = self._saved_in_place(v.node.shape)
                if v.node.shape == self.tile or not in_place:
                    self._broadcast_partial(i)  # a donor, or a value that must be spread first
                if not in_place:
                    return  # saved narrow, it would be laid out one column per block
                c = self.alg.combine(v.expr, v.node, self.partial_omap)
                if c is not None:
                    self.combined[i] = c
                    self.partials.append(i)
            return
        j = self.alg.output(v.expr, v.node)
        if j is not None and (
            j not in self.providers or v.cost < self.values[self.providers[j]].cost
        ):
            self.providers[j] = i

    def _candidates(self, new: list[int], rnd: int) -> None:
        everything = list(range(len(self.values)))
        views: list[int] = []
        for x in new:
            n = self.values[x].node
            if self.values[x].step is not None:
                continue  # views of input tiles only: a transposed result is the same value again
            if len(n.shape) >= 2 and n.shape[-1] > 1 and n.shape[-2] > 1:
                perm = tuple(range(len(n.shape) - 2)) + (len(n.shape) - 1, len(n.shape) - 2)
                v = self._add(_step(Op.TRANSPOSE, (0,), perm), [x], rnd)
                if v is not None:
                    views.append(v)
            if len(n.shape) == 1:
                v = self._add(_step(Op.RESHAPE, (0,), ROW), [x], rnd)
                if v is not None:
                    views.append(v)
        # views (transposed tiles, a vector as one row) only serve as contraction operands
        operands = [y for y in range(len(self.values)) if not self._is_const(y)]
        everything = [y for y in operands if not self._is_view(y)]
        new = [x for x in new if not self._is_const(x) and not self._is_view(x)]
        for v in views:
            for y in operands:
                for a, b_ in ((v, y), (y, v)):
                    if not (self._is_transpose(a) and self._is_transpose(b_)):
                        self._add(_step(Op.MATMUL, (0, 1)), [a, b_], rnd)
        for x in new:
            for op in self.vocab.unary:
                self._add(_step(op, (0,)), [x], rnd)
            for op in self.vocab.reduce:
                for ax, size in enumerate(self.values[x].node.shape):
                    if size > 1:
                        self._add(_step(op, (0,), ax), [x], rnd)
            if self.values[x].node.phase is Phase.LOOP:
                self._add(_step(Op.ACC_SUM, (0,)), [x], rnd)
                if self.vocab.exp_accumulators and len(self.values[x].node.shape) >= 2:
                    self._add(_step(Op.ACC_EXP_SUM, (0,)), [x], rnd)
            last = self._const_op(x)
            for c in self.consts:
                for op, (a, b_) in (
                    (Op.MUL, (x, c)),
                    (Op.ADD, (x, c)),
                    (Op.SUB, (x, c)),
                    (Op.SUB, (c, x)),
                    (Op.DIV, (c, x)),
                ):
                    if (
                        op in self.vocab.binary
                        and _CONST_FAMILY[op] != last
                        and (c.step.arg, _CONST_FAMILY[op]) in self.vocab.roles
                    ):
                        # no chains of one kind of constant arithmetic: (x * c1) * c2, (x + c1) + c2
                        self._add(_step(op, (0, 1)), [a, b_], rnd)
        newset = set(new)
        # every view made so far (views are made in the round their tile is new, so a later value
        # must still meet them as a contraction operand: a normalised row times W^T)
        all_views = [y for y in operands if self._is_view(y) and y not in views]
        # the pair loop below runs for every pair of values: its steps are made once
        add = self._add
        binary = [(op, _step(op, (0, 1)), op not in _COMMUTATIVE) for op in self.vocab.binary]
        mul = _step(Op.MUL, (0, 1))
        matmul = _step(Op.MATMUL, (0, 1))
        wsum = _step(Op.ACC_EXP_WSUM, (0, 1)) if self.vocab.exp_accumulators else None
        partners = everything + all_views
        values = self.values
        limit = self.limits.block_ops
        for x in new:
            for y in partners:
                if y in newset and y < x:
                    continue  # the pair was tried when y's turn came
                if len(values[x].counted | values[y].counted) > limit:
                    # every op of the pair is over the block-op bound: `_add` refuses each one
                    # before it counts or builds anything (the cones' union is what it measures)
                    continue
                if not self._is_view(y):
                    if x == y:
                        # x+x, x-x, x/x, max(x,x): a constant multiple or a constant
                        if Op.MUL in self.vocab.binary:
                            add(mul, [x, y], rnd)
                    else:
                        for _, st, swap in binary:
                            add(st, [x, y], rnd)
                            if swap:
                                add(st, [y, x], rnd)
                for a, b_ in ((x, y), (y, x)) if x != y else ((x, y),):
                    if self._is_transpose(a) and self._is_transpose(b_):
                        continue  # (B^T A^T) is (A B)^T: the same value, transposed
                    add(matmul, [a, b_], rnd)
                    if wsum is not None:
                        add(wsum, [a, b_], rnd)

    def _is_const(self, i: int) -> bool:
        st = self.values[i].step
        return st is not None and st.op is Op.CONST

    def _const_op(self, i: int) -> str | None:
        """'scale' or 'shift' when value i is a constant times / plus something, else None."""
        st = self.values[i].step
        if st is None or len(st.srcs) != 2 or not any(self._is_const(j) for j in st.srcs):
            return None
        return _CONST_FAMILY.get(st.op)

    def _is_view(self, i: int) -> bool:
        st = self.values[i].step
        return st is not None and st.op in (Op.TRANSPOSE, Op.RESHAPE)

    def _is_transpose(self, i: int) -> bool:
        st = self.values[i].step
        return st is not None and st.op is Op.TRANSPOSE

    def run(self) -> Iterator[Recipe]:
        """Grow the pool round by round; yield a recipe each time the outputs' providers improve."""
        self._replay_target()
        new = list(range(len(self.values)))
        best: dict[int, int] = {}
        for rnd in range(1, self.limits.rounds + 1):
            before = len(self.values)
            self._candidates(new, rnd)
            new = list(range(before, len(self.values)))
            if (
                self.sig.partial() is None
                and len(self.providers) == len(self.target.outputs)
                and self.providers != best
            ):
                best = dict(self.providers)
                yield self.recipe([best[j] for j in range(len(self.target.outputs))], (), None)
            if not new or self.stopped:
                break

    # ---- extraction --------------------------------------------------------------------------
    def recipe(
        self, saves: list[int], kernel_steps: tuple[Step, ...], outputs: tuple[int, ...] | None
    ) -> Recipe:
        """The cone of `saves` as a recipe, renumbered: ITERs first, then the steps it needs."""
        # operands before users: pool numbers are not a topological order, because a cheaper
        # construction found later replaces a value in place, operands and all
        nfeed = len(self.feeds)
        used = self._cone(saves)
        # every input's own tile stays (a recipe's block inputs are the kernel's inputs, in
        # order); a whole feed only where the program reads it
        order = [i for i in range(nfeed) if not is_whole(self.feeds[i]) or i in used]
        kept = len(order)
        placed = set(range(nfeed))
        for root in saves:
            stack = [(root, False)]
            while stack:
                i, expanded = stack.pop()
                if i in placed:
                    continue
                st = self.values[i].step
                if expanded or st is None:
                    placed.add(i)
                    order.append(i)
                    continue
                stack.append((i, True))
                stack.extend((j, False) for j in reversed(st.srcs) if j not in placed)
        renum = {old: new for new, old in enumerate(order)}
        steps = tuple(
            Step(
                self.values[i].step.op,
                tuple(renum[s] for s in self.values[i].step.srcs),
                self.values[i].step.arg,
            )
            for i in order[kept:]
        )
        n_in = len(self.target.inputs)
        outs = outputs if outputs is not None else tuple(n_in + j for j in range(len(saves)))
        feeds = tuple(self.feeds[i] for i in order[:kept])
        return Recipe(self.sig, feeds, steps, tuple(renum[s] for s in saves), kernel_steps, outs)

    def _cone(self, roots: list[int]) -> set[int]:
        """Pool numbers of the values `roots` are computed from, themselves included."""
        out: set[int] = set()
        stack = list(roots)
        while stack:
            i = stack.pop()
            if i in out:
                continue
            out.add(i)
            st = self.values[i].step
            if st is not None:
                stack.extend(st.srcs)
        return out


@dataclass
class KernelCompletion:
    """Split signatures: block values are partial sums. A kernel-level REDUCE_SUM over the
    partial dim completes each candidate save; then up to `depth` rounds of elementwise kernel
    ops over the completed values, deduplicated by fingerprint, until an output is matched.

    A round applies the target's unary ops to the values of the last round, its binary ops to
    pairs of values, and each of its constants in the role the target gives it (an epsilon is
    added, a 1/N scales). Why unary ops and constants: a norm split over its reduced index
    (split-K RMSNorm + linear) completes its sum of squares into rsqrt(S / N + eps) only after
    the combine, three rounds of such ops before the product with the completed matmul."""

    search: BlockSearch
    depth: int = 2
    chain: int = 3
    """Rounds of unary ops and constants on each new value before pairs are tried."""
    max_partials: int = 16
    max_pool: int = 160
    allowance: int = 20_000
    """States of its own (search/run.py keeps them out of the block search's part of the
    share). Why: the block search of a deep signature (qknorm_real's normalised split-KV
    attention) spends its whole part before its last round ends, with the partial sums the
    completion needs already in the pool; a completion that started with nothing left never
    tried their quotient."""

    def _is_const(self, i: int) -> bool:
        st = self.values[i].step
        return st is not None and st.op is Op.CONST

    def _const_op(self, i: int) -> str | None:
        """'scale' or 'shift' when value i is a constant times / plus something, else None."""
        st = self.values[i].step
        if st is None or len(st.srcs) != 2 or not any(self._is_const(j) for j in st.srcs):
            return None
        return _CONST_FAMILY.get(st.op)

    def _is_view(self, i: int) -> bool:
        st = self.values[i].step
        return st is not None and st.op in (Op.TRANSPOSE, Op.RESHAPE)

    def run(self) -> Iterator[Recipe]:
        bs = self.search
        fp = bs.alg.fp
        ranked = sorted(bs.partials, key=lambda i: (bs.values[i].cost, i))
        parts = ranked[: self.max_partials]
        pool: list[tuple[Node, Expr]] = []
        seen: set[Hashable] = set()
        for i in parts:
            v = bs.values[i]
            c = bs.combined[i]
            if c.print.key() in seen:
                continue
            seen.add(c.print.key())
            pool.append((b.input_(_PLACEHOLDER + i, v.node.shape, v.node.dtype), c))
        consts = self._consts()
        new = list(pool)
        used = 0
        found: list[Node] = []

        def admit(build: Callable[[], Node], srcs: list[Expr], into: list) -> bool:
            """Try one kernel-level op; False when the search is over (an output is matched or
            the allowance is spent)."""
            nonlocal used
            try:
                node = build()
            except Exception:
                bs.stats.invalid += 1
                return True
            bs.stats.states += 1
            used += 1
            if _undoes(node):
                bs.stats.pruned += 1
                return used < self.allowance
            e = bs.alg.kernel_op(node, srcs)
            if e is None:
                bs.stats.pruned += 1
                if self._is_output(node, srcs):
                    found.append(node)
                    return False
            elif e.print.key() in seen:
                bs.stats.duplicates += 1
            else:
                seen.add(e.print.key())
                into.append((node, e))
                if len(bs.target.outputs) == 1 and fp.combined_output(e.print) == 0:
                    found.append(node)
                    return False
            return used < self.allowance

        # a partial whose combine is the output needs no kernel-level op, whatever its rank: a
        # LayerNorm split over its contraction, normalised by statistics of its whole feed, is
        # a deep (costly) block value and ranked 23rd of 36 partials. Among the pool's, it is
        # the cheapest completion there is.
        single = len(bs.target.outputs) == 1
        direct = next(
            (i for i in ranked if single and fp.combined_output(bs.combined[i].print) == 0), None
        )
        if direct is not None:
            v = bs.values[direct]
            yield self._recipe(b.input_(_PLACEHOLDER + direct, v.node.shape, v.node.dtype))
            if direct in parts:
                return
        for _ in range(self.depth):
            if not bs.tick():
                return
            # unary ops and constants first: a chain of them on one value (rsqrt(S / N + eps))
            # costs a few states per value, where pairs cost the pool's size each
            chain, ok, ordered = list(new), True, list(new)
            for _ in range(self.chain):
                ext: list[tuple[Node, Expr]] = []
                ok = all(admit(bld, srcs, ext) for bld, srcs in self._singles(chain, consts))
                chain = ext[: self.max_pool]
                ordered += chain
                pool.extend(chain)
                if not ok:
                    break
            # pairs take the shallowest values first: the first match ends the search, and a
            # value reached in fewer steps is the cheaper spelling of it
            new = ordered
            grown: list[tuple[Node, Expr]] = []
            ok = ok and all(admit(bld, srcs, grown) for bld, srcs in self._pairs(new, pool))
            if found:
                yield self._recipe(found[0])
                return
            if not ok:
                return
            new = grown[: self.max_pool]
            pool.extend(new)

    def _singles(self, values: list, consts: list) -> Iterator[tuple[Callable[[], Node], list]]:
        """Kernel-level candidates on one value each: the target's unary ops, and its constants
        in their roles (builders, so that a shape error counts as an invalid state)."""
        binary = self.search.vocab.binary
        for x in values:
            for op in self.search.vocab.unary:
                yield (lambda op=op, x=x: b.unary(op, x[0])), [x[1]]
            for role, (cn, ce) in consts:
                for op in (o for o in binary if _CONST_FAMILY.get(o) == role):
                    yield (lambda op=op, x=x, cn=cn: b.binary(op, x[0], cn)), [x[1], ce]

    def _pairs(self, new: list, pool: list) -> Iterator[tuple[Callable[[], Node], list]]:
        """Kernel-level candidates on a new value and a pool value: the target's binary ops,
        both operand orders unless the op commutes."""
        for x in new:
            for y in pool:
                for op in self.search.vocab.binary:
                    if op is Op.MAX or (x is y and op is not Op.MUL):
                        continue
                    for a, c in ((x, y), (y, x)) if op not in _COMMUTATIVE else ((x, y),):
                        yield (lambda op=op, a=a, c=c: b.binary(op, a[0], c[0])), [a[1], c[1]]

    def _is_output(self, node: Node, srcs: list[Expr]) -> bool:
        """Does a value the abstract check refused still equal the output, by fingerprint?
        Why: the check prunes the values a search builds on, and a final value builds on
        nothing; its normal forms can miss one spelling of the output. Measured: rmsnorm split
        over its contraction, rsqrt(S / N + eps) * P with S and P completed over the split,
        was refused though its fingerprint equals the output's (the rsqrt's argument is a
        sum over split and chunk, the target's one sum). The chosen program is verified at
        full shapes like any other, so a fingerprint match is enough to propose it."""
        bs = self.search
        if len(bs.target.outputs) != 1:
            return False
        pruner = bs.alg.pruner
        if pruner is not None and not bs.alg._denominator(node, srcs, pruner.kernel_op):
            return False
        p = bs.alg.fp.op(node, [s.print for s in srcs])
        return p is not None and bs.alg.fp.combined_output(p) == 0

    def _consts(self) -> list[tuple[str, tuple[Node, Expr]]]:
        """The target's constants with their roles ('scale' or 'shift'), as kernel-level
        operands."""
        bs = self.search
        out = []
        for c, role in sorted(bs.vocab.roles):
            node = b.const(c)
            e = bs.alg.kernel_op(node, [])
            if e is not None:
                out.append((role, (node, e)))
        return out

    def _recipe(self, out: Node) -> Recipe:
        """The kernel-level node over placeholders, as recipe steps after the PROJs."""
        bs = self.search
        n_in = len(bs.target.inputs)
        saves: list[int] = []
        for n in toposort([out]):
            if n.op is Op.INPUT and n.arg >= _PLACEHOLDER:
                saves.append(n.arg - _PLACEHOLDER)
        steps: list[Step] = []
        index: dict[Node, int] = {}
        base = n_in + len(saves)
        for n in toposort([out]):
            if n.op is Op.INPUT and n.arg >= _PLACEHOLDER:
                steps.append(Step(Op.REDUCE_SUM, (n_in + saves.index(n.arg - _PLACEHOLDER),), 0))
            elif n.op is Op.CONST:
                steps.append(Step(Op.CONST, (), const_value(n)))
            else:
                steps.append(Step(n.op, tuple(index[s] for s in n.src), n.arg))
            index[n] = base + len(steps) - 1
        return bs.recipe(saves, tuple(steps), (index[out],))


_PLACEHOLDER = 1 << 20
"""Input numbers of the placeholders that stand for completed partial values."""
