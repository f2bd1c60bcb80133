"""Degree analysis: the polynomial degree of every tensor of a program, for the Schwartz-Zippel bound.

Why a separate pass: the bound must hold for the program, not for one sample of it. This pass
runs the same walk and the same op definitions (semantics.py) as the fingerprint, but on `Deg`
records instead of field values, one per tensor (per tile inside a block graph).

A tensor's entries are rational functions N/D in the *atoms*: the inputs, the exp results and the
oracle results (each a fresh variable of degree 1). `Deg` bounds, over all entries:
  n, d    total degrees of N and D;
  hn, hd  log2 of the L1 norms of N and D's integer coefficients (for the bad-prime term);
  vary    the axes along which D may differ between entries. A sum along an axis where D does
          not vary keeps the common denominator; otherwise clearing denominators multiplies;
  q       True while the tensor is exp-free, so its q-residue is a rational function of the same
          degree in the q-residues of the inputs and oracle atoms.
Rules (the algebra methods below): add/sub (n1+d2 v n2+d1, d1+d2); mul adds degrees; inverse
swaps N and D; matmul over K adds degrees (a common denominator along K, else K-fold); a sum keeps
degrees (common denominator) or grows K-fold; exp and oracles return fresh atoms and record their
argument (exp arguments with a known q-residue are rational functions over Z_q: `exp_args`; an
exp of an exp-dependent value is an oracle; oracle arguments are p-residue functions:
`oracle_args`); every inverse adds numel * deg(N) to
`risk`, the Schwartz-Zippel mass of "some denominator vanishes" that conditions the bound.
Inside a block graph one representative block is analysed (every block has the same structure)
and risk is multiplied by the number of blocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from mlso_cli.ir.graph import PARTIAL, BlockGraph, KernelGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.shapes import broadcast as broadcast_shapes
from mlso_cli.verify.fieldrun import AlgebraBackend
from mlso_cli.verify.semantics import ACC_TERMS
from mlso_cli.verify.walk import Index, evaluate


@dataclass(frozen=True)
class Deg:
    shape: tuple[int, ...]
    n: int = 1
    d: int = 0
    hn: float = 0.0
    hd: float = 0.0
    vary: frozenset[int] = frozenset()
    q: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def __getitem__(self, idx: tuple[Any, ...]) -> Deg:
        """A tile or a partial slice: the same bounds on the selected entries."""
        shape: list[int] = []
        axes: list[int] = []
        for ax, (i, dim) in enumerate(zip(idx, self.shape)):
            if isinstance(i, slice):
                axes.append(ax)
                shape.append(len(range(*i.indices(dim))))
        rest = list(range(len(idx), len(self.shape)))
        keep = axes + rest
        shape += [self.shape[a] for a in rest]
        vary = frozenset(keep.index(a) for a in self.vary if a in keep)
        return Deg(tuple(shape), self.n, self.d, self.hn, self.hd, vary, self.q)


@dataclass(frozen=True)
class ArgBound:
    """Maxima over the recorded arguments of exp or of oracles (an argument collision between
    two formally different arguments is a zero of N1*D2 - N2*D1: degree <= n + d)."""

    n: int = 0
    d: int = 0
    hn: float = 0.0
    hd: float = 0.0
    count: int = 0

    def join(self, x: Deg) -> ArgBound:
        return ArgBound(
            max(self.n, x.n),
            max(self.d, x.d),
            max(self.hn, x.hn),
            max(self.hd, x.hd),
            self.count + 1,
        )

    def merge(self, o: ArgBound) -> ArgBound:
        return ArgBound(
            max(self.n, o.n),
            max(self.d, o.d),
            max(self.hn, o.hn),
            max(self.hd, o.hd),
            self.count + o.count,
        )

    @property
    def degree(self) -> int:
        return self.n + self.d if self.count else 0

    @property
    def height(self) -> float:
        return self.hn + self.hd + 1 if self.count else 0.0


def _varying(shape: tuple[int, ...]) -> frozenset[int]:
    return frozenset(i for i, s in enumerate(shape) if s > 1)


def _shift(vary: frozenset[int], rank: int, out_rank: int) -> frozenset[int]:
    return frozenset(a + out_rank - rank for a in vary)


@dataclass
class DegreeAlgebra:
    """The semantics.py algebra on Deg records; collects argument bounds and denominator risk."""

    exp_args: ArgBound = field(default_factory=ArgBound)
    oracle_args: ArgBound = field(default_factory=ArgBound)
    has_exp: bool = False
    risk: float = 0.0
    mult: int = 1

    def const(self, v: Fraction) -> Deg:
        return Deg((), 0, 0, math.log2(max(abs(v.numerator), 1)), math.log2(v.denominator))

    def _atom(self, shape: tuple[int, ...], q: bool) -> Deg:
        return Deg(tuple(shape), 1, 0, 0.0, 0.0, frozenset(), q)

    def add(self, a: Deg, b: Deg) -> Deg:
        shape = broadcast_shapes(a.shape, b.shape)
        r = len(shape)
        return Deg(
            shape,
            max(a.n + b.d, b.n + a.d),
            a.d + b.d,
            max(a.hn + b.hd, b.hn + a.hd) + 1,
            a.hd + b.hd,
            _shift(a.vary, len(a.shape), r) | _shift(b.vary, len(b.shape), r),
            a.q and b.q,
        )

    sub = add

    def mul(self, a: Deg, b: Deg) -> Deg:
        shape = broadcast_shapes(a.shape, b.shape)
        r = len(shape)
        return Deg(
            shape,
            a.n + b.n,
            a.d + b.d,
            a.hn + b.hn,
            a.hd + b.hd,
            _shift(a.vary, len(a.shape), r) | _shift(b.vary, len(b.shape), r),
            a.q and b.q,
        )

    def neg(self, a: Deg) -> Deg:
        return a

    def inv(self, a: Deg, nonzero: bool = False) -> Deg:
        if not nonzero:
            self.risk += self.mult * a.numel * a.n
        vary = a.vary | _varying(a.shape) if a.n else frozenset()
        return Deg(a.shape, a.d, a.n, a.hd, a.hn, vary, a.q)

    def exp(self, a: Deg) -> Deg:
        if a.q:
            self.exp_args = self.exp_args.join(a)
            self.has_exp = True
            return self._atom(a.shape, False)
        self.oracle_args = self.oracle_args.join(a)
        return self._atom(a.shape, True)  # the fallback oracle

    def oracle(self, name: str, *args: Deg) -> Deg:
        for a in args:
            self.oracle_args = self.oracle_args.join(a)
        shape: tuple[int, ...] = ()
        for a in args:
            shape = broadcast_shapes(shape, a.shape)
        return self._atom(shape, True)

    def oracle_reduce(self, name: str, a: Deg, axis: int) -> Deg:
        self.oracle_args = self.oracle_args.join(a)
        return self._atom(a.shape[:axis] + (1,) + a.shape[axis + 1 :], True)

    def q_known(self, a: Deg) -> bool:
        return a.q

    def reduce_sum(self, a: Deg, axis: int) -> Deg:
        shape = a.shape[:axis] + (1,) + a.shape[axis + 1 :]
        return _sum_copies(a, a.shape[axis], axis in a.vary, shape, a.vary - {axis})

    def matmul(self, a: Deg, b: Deg) -> Deg:
        k = a.shape[-1]
        shape = broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
        r = len(shape)
        batch = _shift(
            frozenset(x for x in a.vary if x < len(a.shape) - 2), len(a.shape), r
        ) | _shift(frozenset(x for x in b.vary if x < len(b.shape) - 2), len(b.shape), r)
        vary = (
            batch
            | ({r - 2} if len(a.shape) - 2 in a.vary else set())
            | ({r - 1} if len(b.shape) - 1 in b.vary else set())
        )
        prod = Deg(shape, a.n + b.n, a.d + b.d, a.hn + b.hn, a.hd + b.hd, frozenset(), a.q and b.q)
        distinct = len(a.shape) - 1 in a.vary or len(b.shape) - 2 in b.vary
        return _sum_copies(prod, k, distinct, shape, frozenset(vary))

    def reshape(self, a: Deg, shape: tuple[int, ...]) -> Deg:
        vary = _varying(tuple(shape)) if a.vary else frozenset()
        return Deg(tuple(shape), a.n, a.d, a.hn, a.hd, vary, a.q)

    def transpose(self, a: Deg, perm: tuple[int, ...]) -> Deg:
        return Deg(
            tuple(a.shape[p] for p in perm),
            a.n,
            a.d,
            a.hn,
            a.hd,
            frozenset(i for i, p in enumerate(perm) if p in a.vary),
            a.q,
        )

    def broadcast(self, a: Deg, shape: tuple[int, ...]) -> Deg:
        return Deg(
            tuple(shape), a.n, a.d, a.hn, a.hd, _shift(a.vary, len(a.shape), len(shape)), a.q
        )


def _sum_copies(
    a: Deg, k: int, distinct: bool, shape: tuple[int, ...], vary: frozenset[int]
) -> Deg:
    """A sum of k terms bounded by `a`: common denominator, or k different ones (cleared)."""
    lk = math.log2(k) if k > 1 else 0.0
    if not distinct or a.d == 0:
        return Deg(shape, a.n, a.d, a.hn + lk, a.hd, vary, a.q)
    return Deg(shape, a.n + (k - 1) * a.d, k * a.d, a.hn + (k - 1) * a.hd + lk, k * a.hd, vary, a.q)


class _DegBuffer:
    def __init__(self, bg: BlockGraph, save: Node) -> None:
        self.bg, self.save, self.value = bg, save, None


class DegreeBackend(AlgebraBackend):
    """Walks one representative block; a loop accumulator is a sum of `loop` like terms."""

    def blocks(self, bg: BlockGraph) -> Iterable[Index]:
        self.A.mult = bg.block_count()
        yield (0, 0, 0)
        self.A.mult = 1

    def acc_step(self, node: Node, state: Any, args: list[Any]) -> Any:
        return ACC_TERMS[node.op](self.A, *args) if state is None else state

    def acc_final(self, node: Node, state: Deg, steps: int) -> Deg:
        return _sum_copies(state, steps, True, state.shape, state.vary)

    def buffer(self, bg: BlockGraph, save: Node) -> _DegBuffer:
        return _DegBuffer(bg, save)

    def put(self, buf: _DegBuffer, index: tuple[int | slice, ...], value: Deg, save: Node) -> None:
        bg = buf.bg
        shape = bg.output_shape(save)
        npart = len(shape) - len(save.shape)
        vary = _shift(value.vary, len(value.shape), len(shape))
        if value.d:  # different blocks may divide by different denominators
            placed = {
                npart + d
                for g, d in zip(bg.grid, save.arg.omap)
                if d is not None and d != PARTIAL and g > 1
            }
            vary = vary | frozenset(range(npart)) | placed
        buf.value = Deg(shape, value.n, value.d, value.hn, value.hd, frozenset(vary), value.q)

    def finish(self, buf: _DegBuffer) -> Deg:
        return buf.value


@dataclass(frozen=True)
class Profile:
    """Everything the bound needs from one program."""

    outputs: tuple[Deg, ...]
    exp_args: ArgBound
    oracle_args: ArgBound
    has_exp: bool
    risk: float


def analyse(kg: KernelGraph) -> Profile:
    """Degree records of kg's outputs and the argument/denominator statistics of its atoms."""
    alg = DegreeAlgebra()
    outs = evaluate(kg, [Deg(i.shape) for i in kg.inputs], DegreeBackend(alg))
    return Profile(tuple(outs), alg.exp_args, alg.oracle_args, alg.has_exp, alg.risk)
