"""Finite-field values for fingerprinting μGraphs: residues mod a random prime pair (p, q), q | p-1.

Why two residues: polynomial ops (add, mul, matmul, sums, inverses) are ring homomorphisms, so they
act on both residues. exp is not polynomial, but exp(a) = g^(a mod q) mod p with g of order q is a
homomorphism from (Z_q, +) to (Z_p*, *), so exp(a+b) = exp(a)*exp(b) holds in the field exactly as
over the reals. The q-residue of an exp result is unknown, so every value carries its q-residue
only while it is known (`FieldArray.q is None` otherwise); an op that needs an unknown q-residue
(exp of an exp-dependent value) falls back to an uninterpreted function of the p-residue.

Why random primes per run: a fixed prime that divides a coefficient difference hides that error
on every test. q is drawn uniformly from the primes in [Q_LO, Q_HI) that admit p = k*q + 1 prime
for some k in K_CHOICES; p is then k*q + 1 for a random such k.

Uninterpreted functions (sqrt, erf, max, gelu's Phi, ...) are keyed random oracles on the
p-residue: a 64-bit mixing hash of (key, salt, argument), vectorised on numpy uint64, so the same
argument under the same key gives the same value within one Field (one trial) and independent
values across trials. An oracle value is a fresh atom with no algebraic law to respect, so it
gets both residues (two independent hashes of the argument): its q-residue is known, and
exp(x - max(x)) stays a true exp, so a softmax with an explicit stabiliser equals one without.

max is a *set oracle* (SET_ORACLES): over the reals it is associative, commutative and
idempotent, so its value depends only on the set of values it ranges over, and a tiled max (a max
of partial maxima over the tiles of a grid split, at any nesting, or an elementwise MAX of two
partial maxima) equals the plain REDUCE_MAX. So a max value remembers the residues of the values
it is the max of (`Leaves`, one trailing axis of them per entry, carried through views, tiles
and saved buffers); a max whose argument is itself a max takes that argument's leaves instead of
the argument (flattening), and the value is a hash of the *set* of leaf p-residues (repeats
dropped, the sum of the distinct leaves' mixed hashes), or the leaf itself when the set has one
element (max{a} = a: max(x, x) = x, a max over a size-1 or broadcast axis is the identity).

Exactness: residues are int64 below 2^27, so elementwise products (< 2^54) and sums are exact in
int64. Matmul goes through float64 BLAS (matmul_mod): one matmul of centered residues when
K * (r/2)^2 < 2^53 (the q-residue up to K = 64), else one operand is split into limbs of w bits
with K * 2^w * r < 2^53, so every partial dot product is an integer below 2^53 and exact in any
summation order. Residues are lazy (FieldArray): only the ones something reads are computed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np

Q_LO, Q_HI = 1 << 23, 1 << 24
"""q is drawn from the primes in [Q_LO, Q_HI)."""
K_CHOICES = (2, 4, 6)
"""p = k*q + 1 for one of these k, so p < 1.5 * 2^26 and residue products stay below 2^54."""
Q_ELIGIBLE = 144_077
"""Number of primes q in [Q_LO, Q_HI) with k*q+1 prime for some k in K_CHOICES (counted with a
sieve by tests/test_verify_field.py::test_eligible_count, marked slow). Each eligible q is drawn
with probability 1/Q_ELIGIBLE; a prime P is p with probability <= 1/Q_ELIGIBLE as well, because
P-1 < 2^27 < Q_LO^2 has at most one prime factor in [Q_LO, Q_HI)."""


class ZeroDenominator(ArithmeticError):
    """A denominator vanished in the field: the checker resamples the inputs."""


class BadPrime(ArithmeticError):
    """A constant's denominator is divisible by the drawn prime: the checker draws new primes."""


# ---- primes --------------------------------------------------------------------------------

_MR_BASES = (2, 3, 5, 7, 11, 13, 17)  # deterministic for n < 3.4e14


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for b in _MR_BASES:
        if n % b == 0:
            return n == b
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def draw_primes(rng: np.random.Generator) -> tuple[int, int, int]:
    """(p, q, g): q uniform over eligible primes, p = k*q+1 for a random valid k, g of order q."""
    while True:
        q = int(rng.integers(Q_LO, Q_HI))
        if not is_prime(q):
            continue
        ks = [k for k in K_CHOICES if is_prime(k * q + 1)]
        if not ks:
            continue
        p = ks[int(rng.integers(len(ks)))] * q + 1
        while True:
            g = pow(int(rng.integers(2, p - 1)), (p - 1) // q, p)
            if g != 1:
                return p, q, g


# ---- values ----------------------------------------------------------------------------------

Residue = np.ndarray | Callable[[], np.ndarray]


class _LazyResidues:
    """p- and q-residues that may be held as thunks and computed on first access (`q` None:
    unknown). Shared by FieldArray and Leaves."""

    __slots__ = ("_p", "_q")
    _p: Residue
    _q: Residue | None

    @property
    def p(self) -> np.ndarray:
        if callable(self._p):
            self._p = self._p()
        return self._p

    @property
    def q(self) -> np.ndarray | None:
        if callable(self._q):
            self._q = self._q()
        return self._q

    def q_known(self) -> bool:
        return self._q is not None


class FieldArray(_LazyResidues):
    """A tensor of field values: p-residues, and q-residues while they are known.

    A residue may be held as a thunk and computed on first access: an exp argument's p-residue,
    for instance, is never needed (exp reads the q-residue only), so the matmul producing it is
    never run. `q is None` means the q-residue is unknown (the value depends on an exp or an
    oracle); that is static, known without computing anything.
    """

    __slots__ = ("leaves", "shape")

    def __init__(
        self,
        p: Residue,
        q: Residue | None,
        shape: tuple[int, ...] | None = None,
        leaves: Leaves | None = None,
    ) -> None:
        self._p, self._q = p, q
        self.shape: tuple[int, ...] = tuple(shape if shape is not None else p.shape)
        self.leaves = leaves
        """For a set-oracle (max) value: the values it is the max of; None for any other."""

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def force(self) -> FieldArray:
        """Compute both residues now (so that a zero denominator raises here)."""
        _ = self.p, self.q
        return self

    def __getitem__(self, idx: Any) -> FieldArray:
        shape = np.broadcast_to(np.zeros((), np.int8), self.shape)[idx].shape
        leaves = None
        if self.leaves is not None:
            key = idx if isinstance(idx, tuple) else (idx,)
            # ints and slices leave the trailing leaf axis alone; anything else drops the set
            # (the value is unchanged, a later max just treats it as one opaque argument)
            if len(key) <= self.ndim and all(isinstance(i, int | np.integer | slice) for i in key):
                leaves = self.leaves.map(lambda x: x[key], self.leaves.k)
        return FieldArray(
            lambda: self.p[idx], None if self._q is None else (lambda: self.q[idx]), shape, leaves
        )

    def equal(self, other: FieldArray) -> bool:
        """Equal p-residues, and equal q-residues where both are known."""
        if self.shape != other.shape or not np.array_equal(self.p, other.p):
            return False
        return not (self.q_known() and other.q_known()) or np.array_equal(self.q, other.q)

    def __repr__(self) -> str:
        return f"FieldArray(shape={self.shape}, q_known={self.q_known()})"


class Leaves(_LazyResidues):
    """The arguments of a set-oracle value (max), flattened: residues with a trailing axis of k.

    Why: max(max(S1), max(S2)) = max(S1 | S2) over the reals, but a hash of the two partial
    maxima is not a hash of S1 | S2. Keeping the leaves lets the next max hash the union. k
    counts leaves with repeats (the hash dedupes), so a union is a concatenation and a buffer
    can pad a short set by repeating a leaf without changing it. q-residues are kept while every
    leaf's is known; they are read only when a set has one element (max{a} = a).
    """

    __slots__ = ("k", "name")

    def __init__(self, name: str, p: Residue, q: Residue | None, k: int) -> None:
        self.name, self._p, self._q, self.k = name, p, q, k

    def map(self, fn: Callable[[np.ndarray], np.ndarray], k: int) -> Leaves:
        """The same function applied (lazily) to both residue arrays; k is the result's width."""
        return Leaves(
            self.name,
            lambda: fn(self.p),
            None if self._q is None else (lambda: fn(self.q)),  # type: ignore[arg-type]
            k,
        )


# ---- mixing hash (random oracles) -------------------------------------------------------------

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def _key(name: str, salt: int) -> tuple[np.uint64, np.uint64, np.uint64]:
    h = hashlib.sha256(f"{name}:{salt}".encode()).digest()
    return tuple(np.uint64(int.from_bytes(h[i : i + 8], "little")) for i in (0, 8, 16))  # type: ignore[return-value]


# ---- modular helpers on int64 arrays -----------------------------------------------------------


def _pow_mod(a: np.ndarray, e: int, r: int) -> np.ndarray:
    result = np.ones_like(a)
    base = a.copy()
    while e:
        if e & 1:
            result = result * base % r
        e >>= 1
        if e:
            base = base * base % r
    return result


def _centered(a: np.ndarray, r: int) -> np.ndarray:
    """Residues in [0, r) as integers in (-r/2, r/2]: half the magnitude, a quarter the products."""
    return a - r * (a > r // 2)


def matmul_mod(a: np.ndarray, b: np.ndarray, r: int) -> np.ndarray:
    """Exact (a @ b) mod r for int64 residues in [0, r), through float64 BLAS.

    When K * (r/2)^2 < 2^53, one float64 matmul of the centered operands (|entries| <= r/2) is
    exact. Otherwise the operand with fewer entries is split into limbs of w bits with
    K * 2^w * r < 2^53, and the limb products are recombined mod r."""
    k = a.shape[-1]
    if k * (r // 2) ** 2 < 2**53:
        prod = np.matmul(_centered(a, r).astype(np.float64), _centered(b, r).astype(np.float64))
        out = prod.astype(np.int64)
        out %= r
        return out
    w = (2**53 // (k * r)).bit_length() - 1
    if w < 4:  # K too large for operands of this size: split the contraction
        mid = k // 2
        return (
            matmul_mod(a[..., :mid], b[..., :mid, :], r)
            + matmul_mod(a[..., mid:], b[..., mid:, :], r)
        ) % r
    split_a = a.size <= b.size
    small, other = (a, b) if split_a else (b, a)
    fo = other.astype(np.float64)
    bits = (r - 1).bit_length()
    mask = (1 << w) - 1
    out: np.ndarray | None = None
    for shift in range(0, bits, w):
        limb = ((small >> shift) & mask).astype(np.float64)
        term = (np.matmul(limb, fo) if split_a else np.matmul(fo, limb)).astype(np.int64)
        if shift:
            term %= r
            term *= pow(2, shift, r)
        out = term if out is None else out + term
        out %= r
    return out


class Field:
    """One trial's arithmetic: primes p, q, generator g, oracle salt; ops on FieldArray values.

    The methods form the algebra that semantics.py defines every μGraph op with; the degree
    analysis (degree.py) implements the same method names on degree records.
    """

    def __init__(self, p: int, q: int, g: int, salt: int = 0) -> None:
        if (p - 1) % q or pow(g, q, p) != 1 or g == 1:
            raise ValueError(f"bad field parameters p={p} q={q} g={g}")
        self.p, self.q, self.g, self.salt = p, q, g, salt
        self._lo_bits = 12
        lo = [1]
        for _ in range((1 << self._lo_bits) - 1):
            lo.append(lo[-1] * g % p)
        step = lo[-1] * g % p  # g^(2^lo_bits)
        hi = [1]
        for _ in range((q >> self._lo_bits) + 1):
            hi.append(hi[-1] * step % p)
        self._exp_lo = np.array(lo, dtype=np.int64)
        self._exp_hi = np.array(hi, dtype=np.int64)
        self._keys: dict[str, tuple[np.uint64, np.uint64, np.uint64]] = {}
        self._last_exp: tuple[FieldArray, FieldArray] | None = None

    @classmethod
    def draw(cls, rng: np.random.Generator) -> Field:
        p, q, g = draw_primes(rng)
        return cls(p, q, g, int(rng.integers(1 << 62)))

    def __repr__(self) -> str:
        return f"Field(p={self.p}, q={self.q}, g={self.g})"

    # -- sources --
    def random(self, shape: tuple[int, ...], rng: np.random.Generator) -> FieldArray:
        """Uniform independent residues mod p and mod q (a uniform value mod pq, by CRT)."""
        return FieldArray(
            rng.integers(0, self.p, size=shape, dtype=np.int64),
            rng.integers(0, self.q, size=shape, dtype=np.int64),
        )

    def const(self, value: Fraction) -> FieldArray:
        """n/d -> n * d^-1 in each residue: one fixed rule for every constant in every program."""
        v = Fraction(value)
        out = []
        for r in (self.p, self.q):
            if v.denominator % r == 0:
                raise BadPrime(f"constant {v} has a denominator divisible by {r}")
            out.append(np.array(v.numerator % r * pow(v.denominator, -1, r) % r, dtype=np.int64))
        return FieldArray(out[0], out[1])

    # -- ring ops (lazy: each residue is computed when first read) --
    def _lazy(
        self,
        shape: tuple[int, ...],
        fp: Callable[[int], np.ndarray],
        fq: Callable[[int], np.ndarray] | None,
    ) -> FieldArray:
        return FieldArray(lambda: fp(self.p), None if fq is None else (lambda: fq(self.q)), shape)

    def _binary(
        self,
        a: FieldArray,
        b: FieldArray,
        fn: Callable[[np.ndarray, np.ndarray, int], np.ndarray],
        shape: tuple[int, ...] | None = None,
    ) -> FieldArray:
        shape = shape if shape is not None else np.broadcast_shapes(a.shape, b.shape)
        fq = (lambda r: fn(a.q, b.q, r)) if a.q_known() and b.q_known() else None
        return self._lazy(shape, lambda r: fn(a.p, b.p, r), fq)

    def _unary(
        self,
        a: FieldArray,
        fn: Callable[[np.ndarray, int], np.ndarray],
        shape: tuple[int, ...] | None = None,
    ) -> FieldArray:
        fq = (lambda r: fn(a.q, r)) if a.q_known() else None
        return self._lazy(shape if shape is not None else a.shape, lambda r: fn(a.p, r), fq)

    def add(self, a: FieldArray, b: FieldArray) -> FieldArray:
        return self._binary(a, b, lambda x, y, r: (x + y) % r)

    def sub(self, a: FieldArray, b: FieldArray) -> FieldArray:
        return self._binary(a, b, lambda x, y, r: (x - y) % r)

    def mul(self, a: FieldArray, b: FieldArray) -> FieldArray:
        return self._binary(a, b, _mul_mod)

    def add_many(self, terms: list[FieldArray]) -> FieldArray:
        """The sum of several terms of one shape, as one lazy n-ary sum."""
        if len(terms) == 1:
            return terms[0]

        def total(res: Callable[[FieldArray], np.ndarray], r: int) -> np.ndarray:
            out = res(terms[0]).copy()
            for t in terms[1:]:
                out += res(t)
            return out % r

        fq = (lambda r: total(lambda t: t.q, r)) if all(t.q_known() for t in terms) else None
        return self._lazy(terms[0].shape, lambda r: total(lambda t: t.p, r), fq)

    def neg(self, a: FieldArray) -> FieldArray:
        return self._unary(a, lambda x, r: -x % r)

    def inv(self, a: FieldArray, nonzero: bool = False) -> FieldArray:
        """Modular inverse in each residue; a zero denominator raises ZeroDenominator."""
        return self._unary(a, _inverse)

    def matmul(self, a: FieldArray, b: FieldArray) -> FieldArray:
        shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
        return self._binary(a, b, matmul_mod, shape)

    def reduce_sum(self, a: FieldArray, axis: int) -> FieldArray:
        shape = a.shape[:axis] + (1,) + a.shape[axis + 1 :]
        return self._unary(a, lambda x, r: np.sum(x, axis=axis, keepdims=True) % r, shape)

    # -- exp and oracles --
    def exp(self, a: FieldArray) -> FieldArray:
        """g^(a mod q) mod p; an unknown q-residue falls back to an oracle of the p-residue."""
        if not a.q_known():
            return self.oracle("exp", a)
        if self._last_exp is not None and self._last_exp[0] is a:  # ACC_EXP_SUM/WSUM share s
            return self._last_exp[1]

        def fp() -> np.ndarray:
            e = a.q
            out = np.take(self._exp_lo, e & ((1 << self._lo_bits) - 1))
            out *= np.take(self._exp_hi, e >> self._lo_bits)
            out %= self.p
            return out

        out = FieldArray(fp, None, a.shape)
        self._last_exp = (a, out)
        return out

    def _salted(self, name: str) -> tuple[np.uint64, np.uint64, np.uint64]:
        k = self._keys.get(name)
        if k is None:
            k = self._keys[name] = _key(name, self.salt)
        return k

    def _atom(self, h: Callable[[], np.ndarray], name: str, shape: tuple[int, ...]) -> FieldArray:
        """An oracle value from the hash h of its argument: independent p- and q-residues."""
        _, kp, kq = self._salted(name)
        return FieldArray(
            lambda: (mix64(h() ^ kp) % np.uint64(self.p)).astype(np.int64),
            lambda: (mix64(h() ^ kq) % np.uint64(self.q)).astype(np.int64),
            shape,
        )

    def oracle(self, name: str, *args: FieldArray) -> FieldArray:
        """A keyed random function of the p-residues; several arguments combine symmetrically.
        A set oracle (max) is a function of the set of its flattened arguments (module doc)."""
        shape: tuple[int, ...] = ()
        for a in args:
            shape = np.broadcast_shapes(shape, a.shape)
        if name in SET_ORACLES:
            return self._set_atom(_union([self._leaves_of(name, a, shape) for a in args]), shape)
        k1 = self._salted(name)[0]
        memo: list[np.ndarray] = []

        def h() -> np.ndarray:
            if not memo:
                total = None
                for a in args:
                    t = mix64(a.p.astype(np.uint64) ^ k1)
                    total = t if total is None else total + t
                memo.append(total)
            return memo[0]

        return self._atom(h, name, shape)

    def oracle_reduce(self, name: str, a: FieldArray, axis: int) -> FieldArray:
        """The oracle of the values along `axis` (keepdims): their multiset, or for a set oracle
        the set of their flattened leaves, so a max over tiles' maxima is the max over all."""
        out = a.shape[:axis] + (1,) + a.shape[axis + 1 :]
        if name in SET_ORACLES:
            leaves = self._leaves_of(name, a, a.shape)
            n = a.shape[axis]

            def fold(x: np.ndarray) -> np.ndarray:
                # (..., n, k) -> (..., 1, ..., n*k): the reduced values' leaves side by side
                y = np.moveaxis(x, axis, -2)
                return np.expand_dims(y.reshape(y.shape[:-2] + (n * leaves.k,)), axis)

            return self._set_atom(leaves.map(fold, n * leaves.k), out)
        k1 = self._salted(name)[0]
        memo: list[np.ndarray] = []

        def h() -> np.ndarray:
            if not memo:
                memo.append(
                    np.sum(
                        mix64(a.p.astype(np.uint64) ^ k1), axis=axis, keepdims=True, dtype=np.uint64
                    )
                )
            return memo[0]

        return self._atom(h, name, out)

    def _leaves_of(self, name: str, a: FieldArray, shape: tuple[int, ...]) -> Leaves:
        """a's leaves under oracle `name` (a itself, unless a is a value of that oracle: then
        the values a is the max of), broadcast to `shape`."""
        if a.leaves is not None and a.leaves.name == name:
            leaves = a.leaves
        else:
            leaves = Leaves(
                name,
                lambda: a.p[..., None],
                None if not a.q_known() else (lambda: a.q[..., None]),  # type: ignore[index]
                1,
            )
        if a.shape == shape:
            return leaves
        return leaves.map(lambda x: np.broadcast_to(x, shape + (leaves.k,)), leaves.k)

    def _set_atom(self, leaves: Leaves, shape: tuple[int, ...]) -> FieldArray:
        """The set oracle's value on each entry's set of leaf p-residues: the leaf itself when
        the set has one element (max{a} = a), else a hash of the set (`_set_hash`: the sum of
        the distinct leaves' mixed hashes, independent of order and repeats), with both
        residues from two further hashes as for any oracle."""
        k1, kp, kq = self._salted(leaves.name)
        memo: dict[str, np.ndarray] = {}

        def stats() -> dict[str, np.ndarray]:
            if not memo:
                sig, single, first = _set_hash(leaves.p.reshape(-1, leaves.k), k1)
                memo.update(sig=sig, single=single, first=first)
            return memo

        # hashes on the flat (entries,) arrays, reshaped last: numpy scalars (a 0-d value) would
        # warn on the wrapping uint64 products of mix64
        def fp() -> np.ndarray:
            m = stats()
            hashed = (mix64(m["sig"] ^ kp) % np.uint64(self.p)).astype(np.int64)
            if m["single"].any():
                hashed = np.where(m["single"], m["first"], hashed)
            return hashed.reshape(shape)

        def fq() -> np.ndarray:
            m = stats()
            hashed = (mix64(m["sig"] ^ kq) % np.uint64(self.q)).astype(np.int64)
            # the leaves' q-residues are read only for one-element sets; a one-element set of
            # an exp-dependent leaf (q unknown) keeps the hash
            if leaves.q_known() and m["single"].any():
                lq = leaves.q.reshape(-1, leaves.k)  # type: ignore[union-attr]
                hashed = np.where(m["single"], lq[:, 0], hashed)
            return hashed.reshape(shape)

        return FieldArray(fp, fq, shape, leaves)

    def q_known(self, a: FieldArray) -> bool:
        return a.q_known()

    # -- views (numpy views of each residue, and of a max value's leaves) --
    def reshape(self, a: FieldArray, shape: tuple[int, ...]) -> FieldArray:
        return _view(
            self._unary(a, lambda x, r: x.reshape(shape), tuple(shape)),
            a,
            lambda x, k: x.reshape(tuple(shape) + (k,)),
        )

    def transpose(self, a: FieldArray, perm: tuple[int, ...]) -> FieldArray:
        return _view(
            self._unary(a, lambda x, r: x.transpose(perm), tuple(a.shape[i] for i in perm)),
            a,
            lambda x, k: x.transpose(tuple(perm) + (len(perm),)),
        )

    def broadcast(self, a: FieldArray, shape: tuple[int, ...]) -> FieldArray:
        return _view(
            self._unary(a, lambda x, r: np.broadcast_to(x, shape), tuple(shape)),
            a,
            lambda x, k: np.broadcast_to(x, tuple(shape) + (k,)),
        )


SET_ORACLES = frozenset({"max"})
"""Oracles that are functions of the *set* of their arguments, flattened through nesting: max is
associative, commutative and idempotent, so every tiling of a max over the same values is one
value (module docstring)."""


_SMALL_SET = 8
"""Sets of at most this many leaves are deduplicated column against column, not sorted: a
binary MAX or RELU (two leaves) would otherwise pay a sort of millions of two-element rows."""


def _set_hash(flat: np.ndarray, k1: np.uint64) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of flat (entries, k) of leaf p-residues: the sum of the mixed hashes of the
    row's distinct values, whether the row holds one distinct value, and a value of the row."""
    k = flat.shape[1]
    h = mix64(flat.astype(np.uint64) ^ k1)
    first = flat[:, 0]
    if k == 1:
        return h[:, 0], np.ones(first.shape, bool), first
    if k <= _SMALL_SET:
        sig = h[:, 0].copy()
        single = np.ones(first.shape, bool)
        for j in range(1, k):
            col = flat[:, j]
            fresh = col != first
            single &= ~fresh
            for i in range(1, j):
                fresh &= col != flat[:, i]
            sig += np.where(fresh, h[:, j], np.uint64(0))
        return sig, single, first
    sig = np.sum(h, axis=-1, dtype=np.uint64)
    srt = np.sort(flat, axis=-1)
    # drop each repeat's hash (a set, not a multiset); repeats are sparse on random inputs
    # (birthday collisions), dense in replicated or nested maxes
    rows, cols = np.nonzero(srt[:, 1:] == srt[:, :-1])
    if rows.size:
        np.subtract.at(sig, rows, mix64(srt[rows, cols + 1].astype(np.uint64) ^ k1))
    return sig, srt[:, 0] == srt[:, -1], srt[:, 0]


def _union(parts: list[Leaves]) -> Leaves:
    """The leaves of a max of several values of one shape: all their leaves side by side."""
    if len(parts) == 1:
        return parts[0]
    return Leaves(
        parts[0].name,
        lambda: np.concatenate([x.p for x in parts], axis=-1),
        (lambda: np.concatenate([x.q for x in parts], axis=-1))  # type: ignore[misc]
        if all(x.q_known() for x in parts)
        else None,
        sum(x.k for x in parts),
    )


def _view(
    out: FieldArray, a: FieldArray, fn: Callable[[np.ndarray, int], np.ndarray]
) -> FieldArray:
    """out (a view of a) with a's leaves viewed the same way, the leaf axis last."""
    if a.leaves is not None:
        k = a.leaves.k
        out.leaves = a.leaves.map(lambda x: fn(x, k), k)
    return out


def _mul_mod(x: np.ndarray, y: np.ndarray, r: int) -> np.ndarray:
    out = np.multiply(x, y)
    out %= r
    return out


def _inverse(x: np.ndarray, r: int) -> np.ndarray:
    """Elementwise inverse mod r by batch inversion over a product tree: one modular power for the
    whole array and about three products per element, where Fermat's x^(r-2) per element costs
    about sixty. Why: the search divides tiles of up to 65,536 entries thousands of times per
    signature, and the per-element power was half of qknorm_gqa's search time at batch 8."""
    if not np.all(x):
        raise ZeroDenominator(f"zero denominator mod {r}")
    flat = np.asarray(x, dtype=np.int64).ravel()
    n = flat.size
    if n <= 8:
        return _pow_mod(x, r - 2, r)
    size = 1 << (n - 1).bit_length()
    levels = [np.concatenate([flat, np.ones(size - n, np.int64)])]
    while levels[-1].size > 1:
        a = levels[-1]
        levels.append(_mul_mod(a[0::2], a[1::2], r))
    inv = np.array([pow(int(levels[-1][0]), r - 2, r)], dtype=np.int64)
    for a in reversed(levels[:-1]):
        down = np.empty_like(a)
        down[0::2] = _mul_mod(inv, a[1::2], r)  # 1/x = (1/(x y)) * y
        down[1::2] = _mul_mod(inv, a[0::2], r)
        inv = down
    return inv[:n].reshape(np.shape(x))
