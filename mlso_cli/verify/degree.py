"""Degree analysis: the polynomial degree of every tensor of a program, for the Schwartz-Zippel bound.

Why a separate pass: the bound must hold for the program, not for one sample of it. This pass
runs the same walk and the same op definitions (semantics.py) as the fingerprint, but on `Deg`
records instead of field values, one per tensor (per tile inside a block graph).

A tensor's entries are rational functions N/D in the *atoms*: the inputs, the exp results and the
oracle results (each a fresh variable of degree 1). `Deg` bounds, over all entries:
  n, d    total degrees of N and D;
  an, ad  the same degrees counting only exp and oracle atoms (inputs have degree 0): a monomial
          of N*D' - N'*D has at most an + ad' atom variables, the "designated" atoms of the
          argument-collision term (equivalence.py);
  hN, hD  the integer coefficients of N and D (`Height`), for the bad-prime terms;
  vary    per axis, how many different denominators the entries along it may have (1: one
          common denominator). A sum of K terms whose denominators take m values clears to
          degrees (n + (m-1) d, m d);
  q       True while the tensor is exp-free, so its q-residue is a rational function of the same
          degree in the q-residues of the inputs and oracle atoms;
  ce, co  the exp atoms and the oracle atoms one entry may depend on (`Cone`), from which ne and
          no, their numbers: the atoms a designated atom can be identified with;
  depth   how deeply atoms nest inside one entry (an atom whose argument holds atoms is one
          deeper), so identification probabilities can be computed innermost first;
  leaves  for a max value, the size of the flattened set it is the max of (0 for other values);
  bare, shift, signs, value  for the second analysis (`DegreeAlgebra.invert`, equivalence.py
          step 4): whether the tensor is an atom (or a constant plus an atom, or a constant),
          and in which forms (a, or 1/(c + a)) each kind of atom occurs in it.
Rules (the algebra methods below): add/sub (n1+d2 v n2+d1, d1+d2); mul adds degrees; inverse
swaps N and D; matmul over K adds degrees and sums K terms; a sum keeps degrees (one common
denominator) or grows with the number of different denominators; the atom degrees follow the same
rules. "How many different values along an axis" (vary, cones) is a per-axis count of classes:
the quantity is a function of the entry's class on each axis; a broadcast axis has one class, a
sum over an axis multiplies by that axis's classes, a reshape multiplies the classes of the axes
it merges, a tile keeps at most its length. exp and oracles return fresh atoms and record their
argument entries in an `ArgBound` (exp arguments with a known q-residue are rational functions over
Z_q: `exp_args`; an exp of an exp-dependent value is an oracle; oracle arguments are p-residue
functions: `oracle_args`). max is counted as a set oracle: its elements are the flattened leaves
of nested maxima (field.py hashes that set), and since max{a} = a its value may be its leaf, so
its record covers both an atom and its argument. Every inverse adds numel * deg(N) to `risk`, the
Schwartz-Zippel mass of "some denominator vanishes" that conditions the bound. Inside a block
graph one representative block is analysed (every block has the same structure), risk is
multiplied by the number of blocks, and a saved tile's counts along the block dims by the blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from mlso_cli.ir.graph import PARTIAL, BlockGraph, KernelGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.shapes import broadcast as broadcast_shapes
from mlso_cli.verify.fieldrun import AlgebraBackend
from mlso_cli.verify.semantics import ACC_TERMS
from mlso_cli.verify.walk import Index, evaluate

SET_ORACLES = frozenset({"max"})
"""Oracles counted as functions of the set of their flattened leaves (max: associative,
commutative, idempotent). Counting leaves through nesting gives at least the arity, so the count
is an upper bound whether the field hashes the flattened set or the plain multiset of arguments."""

_NONE, _ALL = float("-inf"), float("inf")


def _lsum(*logs: float) -> float:
    """log2 of the sum of 2^x (no term: -inf)."""
    xs = [x for x in logs if x != _NONE]
    if not xs:
        return _NONE
    m = max(xs)
    return m + math.log2(sum(2.0 ** (x - m) for x in xs))


def _v2(a: int) -> float:
    return float((a & -a).bit_length() - 1) if a else _ALL


@dataclass(frozen=True)
class Height:
    """Bounds on the integer coefficients of one polynomial (N or D with the constants'
    denominators cleared): log2 |constant term| and a lower bound on its 2-adic valuation, log2 of
    the L1 norm of the other coefficients and a lower bound on their 2-adic valuations (-inf and
    +inf when that part is absent).

    Why more than an L1 norm: a bad prime must divide a nonzero coefficient, and the primes drawn
    are odd, so only the coefficient's odd part counts. Float constants are dyadic, so most of a
    coefficient's size is a power of two: x^2/64 + eps with eps = 17/2^24 clears to
    (2^18 x^2 + 17)/2^24, and the difference of two such arguments has coefficients +-2^42, no odd
    factor at all, where an L1 bound of 2^62 would allow two primes of 2^23 per pair. The constant
    term is kept apart because its valuation (6 in 17*64) is usually far below the rest's (24)."""

    lc: float = _NONE
    vc: float = _ALL
    lx: float = _NONE
    vx: float = _ALL

    def times(self, o: Height) -> Height:
        return Height(
            self.lc + o.lc,
            self.vc + o.vc,
            _lsum(self.lc + o.lx, self.lx + o.lc, self.lx + o.lx),
            min(self.vc + o.vx, self.vx + o.vc, self.vx + o.vx),
        )

    def plus(self, o: Height) -> Height:
        return Height(
            _lsum(self.lc, o.lc), min(self.vc, o.vc), _lsum(self.lx, o.lx), min(self.vx, o.vx)
        )

    def copies(self, k: int) -> Height:
        """A sum of k polynomials bounded by this one."""
        lk = math.log2(k) if k > 1 else 0.0
        return Height(self.lc + lk, self.vc, self.lx + lk, self.vx)

    def power(self, k: int) -> Height:
        out, base = ONE, self
        while k:
            if k & 1:
                out = out.times(base)
            k >>= 1
            if k:
                base = base.times(base)
        return out

    def join(self, o: Height) -> Height:
        """A bound for either polynomial."""
        return Height(
            max(self.lc, o.lc), min(self.vc, o.vc), max(self.lx, o.lx), min(self.vx, o.vx)
        )

    @property
    def l1(self) -> float:
        """log2 of the L1 norm of the coefficients (-inf for the zero polynomial)."""
        return _lsum(self.lc, self.lx)

    @property
    def odd_constant(self) -> float:
        """log2 of a bound on the odd part of the constant term (0 when there is none)."""
        return max(self.lc - self.vc, 0.0)

    @property
    def odd_rest(self) -> float:
        """log2 of a bound on the odd part of any other nonzero coefficient."""
        return max(self.lx - self.vx, 0.0)

    @property
    def odd(self) -> float:
        """log2 of a bound on the odd part of any nonzero coefficient."""
        return max(self.odd_constant, self.odd_rest)


ONE = Height(0.0, 0.0)
"""The polynomial 1."""
VAR = Height(lx=0.0, vx=0.0)
"""A variable: an input or an atom."""


def cleared(n1: Height, d1: Height, n2: Height, d2: Height) -> Height:
    """Coefficients of N1*D2 - N2*D1: where two rational functions differ."""
    return n1.times(d2).plus(n2.times(d1))


Counts = tuple[int, ...]
"""Per axis, the number of classes (different values) of a quantity along that axis."""

Form = tuple[str, str]
"""(kind, form) of the atoms of one kind in an expression, for the inverted analysis: the kind
is an oracle key or EXP_KIND, the form "" for the atom itself or "1/(c+)" for 1/(c + atom)."""

EXP_KIND = "exp()"
"""The kind of true exp atoms (the fallback oracle of an exp of an exp-dependent value is "exp")."""

Cone = tuple[tuple[Counts, int], ...]
"""The atoms of one kind that one entry of a tensor may depend on, as components (counts, size):
at most `size` atoms, a function of the entry's class on each axis (counts). Why components:
softmax(s) V sums over j both exp(s_ij) and the row sum of exp(s_i:), which is the same for every
j; counting each term's atoms would give K (K + 1) per output entry, where there are 2K (the K
row atoms, once through each path). Components with equal counts are merged by adding sizes."""


def _cone(parts: Iterable[tuple[Counts, int]]) -> Cone:
    acc: dict[Counts, int] = {}
    for counts, size in parts:
        if size:
            acc[counts] = acc.get(counts, 0) + size
    return tuple(sorted(acc.items()))


def _cone_map(c: Cone, fn: Callable[[Counts], Counts]) -> Cone:
    return _cone((fn(counts), size) for counts, size in c)


def _full(shape: tuple[int, ...]) -> Counts:
    return tuple(shape)


def _ones(rank: int) -> Counts:
    return (1,) * rank


def _pad(c: Counts, rank: int) -> Counts:
    """Counts of a value broadcast to `rank` (leading axes added: one class)."""
    return (1,) * (rank - len(c)) + c


def _times(a: Counts, b: Counts, shape: tuple[int, ...]) -> Counts:
    """Counts of a quantity that is a function of two others (broadcast to `shape`)."""
    r = len(shape)
    return tuple(min(s, x * y) for s, x, y in zip(shape, _pad(a, r), _pad(b, r)))


def _summed(c: Counts, axis: int) -> Counts:
    return c[:axis] + (1,) + c[axis + 1 :]


def _reshaped(c: Counts, old: tuple[int, ...], new: tuple[int, ...]) -> Counts:
    """Counts after a reshape: a new axis can see every class of the old axes of its group (the
    smallest run of axes on both sides with equal element counts)."""
    po = [math.prod(old[:i]) for i in range(len(old) + 1)]
    pn = [math.prod(new[:j]) for j in range(len(new) + 1)]
    cuts = sorted(set(po) & set(pn))
    out = []
    for j, size in enumerate(new):
        lo = max(b for b in cuts if b <= pn[j])
        hi = min(b for b in cuts if b >= pn[j + 1])
        group = [c[i] for i in range(len(old)) if po[i] >= lo and po[i + 1] <= hi and old[i] > 1]
        out.append(min(size, math.prod(group)))
    return tuple(out)


def _cone_sum(c: Cone, axis: int) -> Cone:
    """The atoms of a sum along `axis` (keepdims): the classes along it, once each."""
    return _cone((_summed(counts, axis), size * counts[axis]) for counts, size in c)


def _any_class(c: Counts, shape: tuple[int, ...]) -> Counts:
    """Counts of a function of several quantities with counts c each: what was one class stays
    one, anything else may take every value."""
    return tuple(1 if x == 1 else s for x, s in zip(c, shape))


def _cone_copies(c: Cone, k: int, shape: tuple[int, ...]) -> Cone:
    """The atoms of a sum of k like terms that may all differ (loop steps): k times as many."""
    return _cone((_any_class(counts, shape), size * k) for counts, size in c)


@dataclass(frozen=True)
class Deg:
    shape: tuple[int, ...]
    n: int = 1
    d: int = 0
    hN: Height = VAR
    hD: Height = ONE
    vary: Counts = ()
    q: bool = True
    an: int = 0
    ad: int = 0
    ce: Cone = ()
    co: Cone = ()
    depth: int = 0
    leaves: int = 0
    bare: Form | None = None
    shift: tuple[str, Fraction] | None = None
    signs: frozenset[Form] = frozenset()
    value: Fraction | None = None

    def __post_init__(self) -> None:
        """vary left out: one class (a constant denominator) or any (otherwise)."""
        if len(self.vary) != len(self.shape):
            if self.vary:
                raise ValueError(f"vary {self.vary} for shape {self.shape}")
            full = _full(self.shape) if self.d else _ones(len(self.shape))
            object.__setattr__(self, "vary", full)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def ne(self) -> int:
        """At most this many distinct exp atoms in one entry."""
        return sum(s for _, s in self.ce)

    @property
    def no(self) -> int:
        """At most this many distinct oracle atoms in one entry."""
        return sum(s for _, s in self.co)

    @property
    def hn(self) -> float:
        return self.hN.l1

    @property
    def hd(self) -> float:
        return self.hD.l1

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

        def tile(c: Counts) -> Counts:
            return tuple(min(c[a], s) for a, s in zip(keep, shape))

        return replace(
            self,
            shape=tuple(shape),
            vary=tile(self.vary),
            ce=_cone_map(self.ce, tile),
            co=_cone_map(self.co, tile),
        )


@dataclass(frozen=True)
class ArgBound:
    """What the argument-collision term needs from the recorded arguments of one kind of atom
    (exp, or oracles), as bounds over every recorded argument entry ("element"): degrees and
    coefficients of an element (two formally different elements coincide at a zero of
    N1*D2 - N2*D1: degree <= n + d, at most an + ad atom variables in a monomial), how many atoms
    of each kind nest inside one element and how deep, and how many elements one atom's argument
    has (1 for exp and unary oracles, the flattened leaves for max)."""

    n: int = 0
    d: int = 0
    hN: Height = Height()
    hD: Height = Height()
    count: int = 0
    an: int = 0
    ad: int = 0
    arity: int = 0
    ne: int = 0
    no: int = 0
    depth: int = 0
    sets: bool = False
    signs: frozenset[Form] = frozenset()

    def join(self, x: Deg, arity: int = 1, sets: bool = False) -> ArgBound:
        one = ArgBound(
            x.n, x.d, x.hN, x.hD, 1, x.an, x.ad, arity, x.ne, x.no, x.depth, sets, x.signs
        )
        return self.merge(one)

    def merge(self, o: ArgBound) -> ArgBound:
        return ArgBound(
            max(self.n, o.n),
            max(self.d, o.d),
            self.hN.join(o.hN),
            self.hD.join(o.hD),
            self.count + o.count,
            max(self.an, o.an),
            max(self.ad, o.ad),
            max(self.arity, o.arity),
            max(self.ne, o.ne),
            max(self.no, o.no),
            max(self.depth, o.depth),
            self.sets or o.sets,
            self.signs | o.signs,
        )

    @property
    def degree(self) -> int:
        return self.n + self.d if self.count else 0

    @property
    def odd_rest(self) -> float:
        """log2 of a bound on the odd part of a non-constant coefficient of N1*D2 - N2*D1 for
        two recorded elements (0 when nothing was recorded)."""
        return cleared(self.hN, self.hD, self.hN, self.hD).odd_rest if self.count else 0.0

    @property
    def odd_constant(self) -> float:
        """The same for the constant term of N1*D2 - N2*D1."""
        return cleared(self.hN, self.hD, self.hN, self.hD).odd_constant if self.count else 0.0


@dataclass
class DegreeAlgebra:
    """The semantics.py algebra on Deg records; collects argument bounds and denominator risk."""

    exp_args: ArgBound = field(default_factory=ArgBound)
    oracle_args: ArgBound = field(default_factory=ArgBound)
    has_exp: bool = False
    risk: float = 0.0
    mult: int = 1
    invert: bool = False
    """Take 1/(c + a) for an atom a and a constant c as the atom (a bijection of a's values, so
    for an oracle a random function of its argument, for exp a value in a set of size q):
    equivalence.py uses that analysis where every kind of atom appears in one form only."""
    flips: int = 0

    def const(self, v: Fraction) -> Deg:
        num = Height(math.log2(abs(v.numerator)), _v2(abs(v.numerator))) if v else Height()
        den = Height(math.log2(v.denominator), _v2(v.denominator))
        return Deg((), 0, 0, num, den, value=v)

    def _atom(
        self,
        shape: tuple[int, ...],
        q: bool,
        args: tuple[Deg, ...],
        key: str = "",
        bare: bool = True,
    ) -> Deg:
        """A fresh atom per entry: an exp atom when q is False, else an oracle atom of `key`
        (`bare` while it is nothing else: not a max, which may be its leaf)."""
        one: Cone = ((_full(shape), 1),)
        depth = 1 + max(a.depth for a in args)
        sign = (key if q else EXP_KIND, "")
        return Deg(
            tuple(shape),
            1,
            0,
            q=q,
            an=1,
            ce=() if q else one,
            co=one if q else (),
            depth=depth,
            bare=sign if bare else None,
            signs=frozenset({sign}),
        )

    def add(self, a: Deg, b: Deg) -> Deg:
        out = self._plus(a, b)
        for c, t in ((a, b), (b, a)):
            if c.value is not None and t.bare is not None and t.bare[1] == "":
                return replace(out, shift=(t.bare[0], c.value))  # c + atom
        return out

    def sub(self, a: Deg, b: Deg) -> Deg:
        return self._plus(a, b)

    def _plus(self, a: Deg, b: Deg) -> Deg:
        shape = broadcast_shapes(a.shape, b.shape)
        return Deg(
            shape,
            max(a.n + b.d, b.n + a.d),
            a.d + b.d,
            cleared(a.hN, a.hD, b.hN, b.hD),
            a.hD.times(b.hD),
            _times(a.vary, b.vary, shape),
            a.q and b.q,
            max(a.an + b.ad, b.an + a.ad),
            a.ad + b.ad,
            *_joint_cones(a, b, len(shape)),
            max(a.depth, b.depth),
            signs=a.signs | b.signs,
        )

    def mul(self, a: Deg, b: Deg) -> Deg:
        shape = broadcast_shapes(a.shape, b.shape)
        return Deg(
            shape,
            a.n + b.n,
            a.d + b.d,
            a.hN.times(b.hN),
            a.hD.times(b.hD),
            _times(a.vary, b.vary, shape),
            a.q and b.q,
            a.an + b.an,
            a.ad + b.ad,
            *_joint_cones(a, b, len(shape)),
            max(a.depth, b.depth),
            signs=a.signs | b.signs,
        )

    def neg(self, a: Deg) -> Deg:
        value = None if a.value is None else -a.value
        return replace(a, leaves=0, bare=None, shift=None, value=value)

    def inv(self, a: Deg, nonzero: bool = False) -> Deg:
        if not nonzero:
            self.risk += self.mult * a.numel * a.n
        if self.invert and (a.bare is not None or a.shift is not None):
            if a.bare is not None and a.bare[1] in ("", "1/(0+)"):  # 1/a, or a again
                form = (a.bare[0], "1/(0+)" if a.bare[1] == "" else "")
            elif a.shift is not None:
                form = (a.shift[0], f"1/({a.shift[1]}+)")
            else:
                form = None
            if form is not None:
                self.flips += 1
                return Deg(
                    a.shape,
                    1,
                    0,
                    q=a.q,
                    an=1,
                    ce=a.ce,
                    co=a.co,
                    depth=a.depth,
                    bare=form,
                    signs=frozenset({form}),
                )
        vary = _full(a.shape) if a.n else _ones(len(a.shape))
        value = None if not a.value else 1 / a.value
        return replace(
            a,
            n=a.d,
            d=a.n,
            hN=a.hD,
            hD=a.hN,
            vary=vary,
            an=a.ad,
            ad=a.an,
            leaves=0,
            bare=None,
            shift=None,
            value=value,
        )

    def exp(self, a: Deg) -> Deg:
        if a.q:
            self.exp_args = self.exp_args.join(a)
            self.has_exp = True
            return self._atom(a.shape, False, (a,))
        self.oracle_args = self.oracle_args.join(a)
        return self._atom(a.shape, True, (a,), "exp")  # the fallback oracle

    def oracle(self, name: str, *args: Deg) -> Deg:
        shape: tuple[int, ...] = ()
        for a in args:
            shape = broadcast_shapes(shape, a.shape)
        if name not in SET_ORACLES:
            for a in args:
                self.oracle_args = self.oracle_args.join(a, len(args))
            return self._atom(shape, True, args, name)
        k = sum(a.leaves or 1 for a in args)
        for a in args:
            self.oracle_args = self.oracle_args.join(a, k, sets=True)
        return _set_value(self._atom(shape, True, args, name, bare=False), args, k)

    def oracle_reduce(self, name: str, a: Deg, axis: int) -> Deg:
        shape = a.shape[:axis] + (1,) + a.shape[axis + 1 :]
        if name not in SET_ORACLES:
            self.oracle_args = self.oracle_args.join(a, a.shape[axis])
            return self._atom(shape, True, (a,), name)
        k = a.shape[axis] * (a.leaves or 1)
        self.oracle_args = self.oracle_args.join(a, k, sets=True)
        # the one leaf it may be is one of the entries along the axis
        leaf = replace(
            a,
            shape=shape,
            vary=_summed(a.vary, axis) if a.vary[axis] == 1 else _full(shape),
            ce=_cone_sum(a.ce, axis),
            co=_cone_sum(a.co, axis),
        )
        return _set_value(self._atom(shape, True, (a,), name, bare=False), (leaf,), k)

    def q_known(self, a: Deg) -> bool:
        return a.q

    def reduce_sum(self, a: Deg, axis: int) -> Deg:
        shape = a.shape[:axis] + (1,) + a.shape[axis + 1 :]
        out = _sum_copies(a, a.shape[axis], a.vary[axis], shape, _summed(a.vary, axis))
        return replace(out, ce=_cone_sum(a.ce, axis), co=_cone_sum(a.co, axis))

    def matmul(self, a: Deg, b: Deg) -> Deg:
        """out[.., i, c] = sum_k a[.., i, k] b[.., k, c]: a's counts keep their axes but c's (one
        class), b's keep theirs but i's; the K terms' denominators take the classes of the pair."""
        k = a.shape[-1]
        shape = broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
        r = len(shape)
        ka, kb = len(a.shape) - 1, len(b.shape) - 2

        def from_a(c: Counts) -> Counts:
            return _pad(c[:-1], r - 1) + (1,)

        def from_b(c: Counts) -> Counts:
            return _pad(c[:-2], r - 2) + (1, c[-1])

        vary = _times(from_a(a.vary), from_b(b.vary), shape)
        ce = _cone_map(_cone_sum(a.ce, ka), from_a) + _cone_map(_cone_sum(b.ce, kb), from_b)
        co = _cone_map(_cone_sum(a.co, ka), from_a) + _cone_map(_cone_sum(b.co, kb), from_b)
        prod = Deg(
            shape,
            a.n + b.n,
            a.d + b.d,
            a.hN.times(b.hN),
            a.hD.times(b.hD),
            _ones(r),
            a.q and b.q,
            a.an + b.an,
            a.ad + b.ad,
            depth=max(a.depth, b.depth),
            signs=a.signs | b.signs,
        )
        classes = min(k, a.vary[ka] * b.vary[kb])
        out = _sum_copies(prod, k, classes, shape, vary)
        return replace(out, ce=_cone(ce), co=_cone(co))

    def reshape(self, a: Deg, shape: tuple[int, ...]) -> Deg:
        shape = tuple(shape)

        def moved(c: Counts) -> Counts:
            return _reshaped(c, a.shape, shape)

        return replace(
            a,
            shape=shape,
            vary=moved(a.vary),
            ce=_cone_map(a.ce, moved),
            co=_cone_map(a.co, moved),
        )

    def transpose(self, a: Deg, perm: tuple[int, ...]) -> Deg:
        def moved(c: Counts) -> Counts:
            return tuple(c[p] for p in perm)

        return replace(
            a,
            shape=tuple(a.shape[p] for p in perm),
            vary=moved(a.vary),
            ce=_cone_map(a.ce, moved),
            co=_cone_map(a.co, moved),
        )

    def broadcast(self, a: Deg, shape: tuple[int, ...]) -> Deg:
        r = len(shape)
        return replace(
            a,
            shape=tuple(shape),
            vary=_pad(a.vary, r),
            ce=_cone_map(a.ce, lambda c: _pad(c, r)),
            co=_cone_map(a.co, lambda c: _pad(c, r)),
        )


def _joint_cones(a: Deg, b: Deg, r: int) -> tuple[Cone, Cone]:
    """The atoms of an elementwise combination of a and b (broadcast to rank r): both sets
    (one, when a and b are the same tensor: x * x reads each entry's atoms once)."""
    if a is b:
        return a.ce, a.co
    return (
        _cone(_cone_map(a.ce, lambda c: _pad(c, r)) + _cone_map(b.ce, lambda c: _pad(c, r))),
        _cone(_cone_map(a.co, lambda c: _pad(c, r)) + _cone_map(b.co, lambda c: _pad(c, r))),
    )


def _set_value(atom: Deg, args: tuple[Deg, ...], leaves: int) -> Deg:
    """A max value: a fresh atom, or (max{a} = a, a set of one element) one of its arguments:
    bounds for any of them, and the atoms of all of them."""
    out = atom
    r = len(atom.shape)
    for a in args:
        out = replace(
            out,
            n=max(out.n, a.n),
            d=max(out.d, a.d),
            hN=out.hN.join(a.hN),
            hD=out.hD.join(a.hD),
            vary=_full(out.shape) if a.d else out.vary,
            an=max(out.an, a.an),
            ad=max(out.ad, a.ad),
            ce=_cone(out.ce + _cone_map(a.ce, lambda c: _pad(c, r))),
            co=_cone(out.co + _cone_map(a.co, lambda c: _pad(c, r))),
            signs=out.signs | a.signs,
        )
    return replace(out, leaves=leaves)


def _sum_copies(a: Deg, k: int, classes: int, shape: tuple[int, ...], vary: Counts) -> Deg:
    """A sum of k terms bounded by `a` whose denominators take `classes` values: one common
    denominator, or the product of the different ones (cleared). Atoms are the caller's."""
    if classes <= 1 or a.d == 0:
        return replace(
            a,
            shape=shape,
            vary=vary,
            hN=a.hN.copies(k),
            leaves=0,
            bare=None,
            shift=None,
            value=None,
        )
    m = classes
    return replace(
        a,
        shape=shape,
        vary=vary,
        n=a.n + (m - 1) * a.d,
        d=m * a.d,
        hN=a.hN.times(a.hD.power(m - 1)).copies(k),
        hD=a.hD.power(m),
        an=a.an + (m - 1) * a.ad,
        ad=m * a.ad,
        leaves=0,
        bare=None,
        shift=None,
        value=None,
    )


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
        """Each step's term may have its own denominator and its own atoms."""
        classes = steps if state.d else 1
        out = _sum_copies(state, steps, classes, state.shape, state.vary)
        return replace(
            out,
            vary=_any_class(state.vary, state.shape),
            ce=_cone_copies(state.ce, steps, state.shape),
            co=_cone_copies(state.co, steps, state.shape),
        )

    def buffer(self, bg: BlockGraph, save: Node) -> _DegBuffer:
        return _DegBuffer(bg, save)

    def put(self, buf: _DegBuffer, index: tuple[int | slice, ...], value: Deg, save: Node) -> None:
        """Different blocks hold different atoms and may divide by different denominators: along
        a PARTIAL dim every index is its own class, along a dim the grid tiles g ways there are
        g times the tile's classes."""
        bg = buf.bg
        shape = bg.output_shape(save)
        npart = len(shape) - len(save.shape)
        grown = {a: shape[a] for a in range(npart)}
        for g, d in zip(bg.grid, save.arg.omap):
            if d is not None and d != PARTIAL and g > 1:
                grown[npart + d] = g

        def placed(c: Counts) -> Counts:
            c = _pad(c, len(shape))
            return tuple(
                min(s, x * grown[a]) if a >= npart and a in grown else grown.get(a, x)
                for a, (s, x) in enumerate(zip(shape, c))
            )

        vary = placed(value.vary) if value.d else _pad(value.vary, len(shape))
        buf.value = replace(
            value,
            shape=shape,
            vary=vary,
            ce=_cone_map(value.ce, placed),
            co=_cone_map(value.co, placed),
        )

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
    inverted: Profile | None = None
    """The analysis with inverted oracle atoms taken as atoms (DegreeAlgebra.invert), when the
    program inverts one; valid where no oracle key appears both ways (equivalence.py)."""


def analyse(kg: KernelGraph) -> Profile:
    """Degree records of kg's outputs and the argument/denominator statistics of its atoms."""
    plain, _ = _analyse(kg, False)
    inverted, flips = _analyse(kg, True)
    return replace(plain, inverted=inverted) if flips else plain


def _analyse(kg: KernelGraph, invert: bool) -> tuple[Profile, int]:
    alg = DegreeAlgebra(invert=invert)
    outs = evaluate(kg, [Deg(i.shape) for i in kg.inputs], DegreeBackend(alg))
    return Profile(tuple(outs), alg.exp_args, alg.oracle_args, alg.has_exp, alg.risk), alg.flips
