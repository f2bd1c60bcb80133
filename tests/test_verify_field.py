"""Finite-field primitives: primes, exp as a homomorphism, inverses, exact matmul, oracles, constants.

Why: every equivalence verdict rests on these being exact. An inexact modular matmul (a float64
partial sum above 2^53) or an oracle that is not a function would turn into false rejections or,
worse, accidental agreements that the bound does not account for.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from mlso_cli.ir import build as b
from mlso_cli.ir import check
from mlso_cli.ir.ops import DType, Op
from mlso_cli.verify.field import (
    K_CHOICES,
    Q_ELIGIBLE,
    Q_HI,
    Q_LO,
    BadPrime,
    Field,
    FieldArray,
    ZeroDenominator,
    draw_primes,
    is_prime,
    matmul_mod,
)
from mlso_cli.verify.interpreter import run_field
from tests.fixtures import examples as ex


@pytest.fixture(scope="module")
def fld() -> Field:
    return Field.draw(np.random.default_rng(7))


def test_primes_are_drawn_from_the_documented_ranges():
    rng = np.random.default_rng(3)
    seen = set()
    for _ in range(20):
        p, q, g = draw_primes(rng)
        assert is_prime(p) and is_prime(q) and Q_LO <= q < Q_HI
        assert (p - 1) % q == 0 and (p - 1) // q in K_CHOICES
        assert g != 1 and pow(g, q, p) == 1
        seen.add(p)
    assert len(seen) == 20
    assert draw_primes(np.random.default_rng(5)) == draw_primes(np.random.default_rng(5))


def test_is_prime_agrees_with_trial_division():
    def slow(n):
        return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))

    assert [n for n in range(2000) if is_prime(n)] == [n for n in range(2000) if slow(n)]
    assert is_prime(2**31 - 1) and not is_prime(2**31 + 1) and not is_prime(3215031751)


def test_eligible_prime_count():
    """Q_ELIGIBLE (used in the bad-prime term of the bound) matches a sieve."""
    limit = max(K_CHOICES) * Q_HI + 2
    odd = np.ones(limit // 2, dtype=bool)  # odd[i] <=> 2i+1 is prime
    odd[0] = False
    for i in range(1, int(limit**0.5) // 2 + 1):
        if odd[i]:
            n = 2 * i + 1
            odd[n * n // 2 :: n] = False
    q = np.arange(Q_LO + 1, Q_HI, 2)
    ok = np.zeros(q.shape, dtype=bool)
    for k in K_CHOICES:
        ok |= odd[(k * q + 1) // 2]
    sieve_q = odd[q // 2]
    assert int((sieve_q & ok).sum()) == Q_ELIGIBLE


def _rand(fld, shape, seed=0):
    return fld.random(shape, np.random.default_rng(seed))


def test_exp_is_a_homomorphism_and_falls_back_without_a_q_residue(fld):
    a, c = _rand(fld, (50,), 1), _rand(fld, (50,), 2)
    assert fld.mul(fld.exp(a), fld.exp(c)).equal(fld.exp(fld.add(a, c)))
    assert fld.mul(fld.exp(a), fld.exp(fld.neg(a))).equal(FieldArray(np.ones(50, np.int64), None))
    e = fld.exp(a)
    assert e.q is None and all(pow(int(v), fld.q, fld.p) == 1 for v in e.p)
    # exp of an exp-dependent value: a consistent oracle of the p-residue (with both residues)
    ee1, ee2 = fld.exp(e), fld.exp(FieldArray(e.p.copy(), None))
    assert ee1.equal(ee2) and np.array_equal(ee1.q, ee2.q)
    assert ee1.equal(fld.oracle("exp", e))


def test_inverse_and_zero_denominators(fld):
    a = _rand(fld, (64,), 3)
    a.p[a.p == 0] = 1
    a.q[a.q == 0] = 1
    one = fld.mul(a, fld.inv(a))
    assert np.all(one.p == 1) and np.all(one.q == 1)
    with pytest.raises(ZeroDenominator):
        fld.inv(FieldArray(np.array([0, 1]), None)).force()
    with pytest.raises(ZeroDenominator):
        fld.inv(FieldArray(np.array([1, 1]), np.array([1, 0]))).force()


@pytest.mark.parametrize("k", [1, 7, 64, 4096, 8192, 20000])
def test_matmul_is_exact(fld, k):
    rng = np.random.default_rng(k)
    for r in (fld.p, fld.q):
        a = rng.integers(r - 1000, r, size=(3, k), dtype=np.int64)  # near-worst-case magnitudes
        c = rng.integers(r - 1000, r, size=(k, 2), dtype=np.int64)
        want = (a.astype(object) @ c.astype(object)) % r
        np.testing.assert_array_equal(matmul_mod(a, c, r), want.astype(np.int64))
        np.testing.assert_array_equal(
            matmul_mod(c.T.copy(), a.T.copy(), r), want.T.astype(np.int64)
        )


def test_batched_matmul_and_reductions_are_exact(fld):
    a, c = _rand(fld, (2, 3, 40), 4), _rand(fld, (40, 5), 5)
    got = fld.matmul(a, c)
    want = (a.p.astype(object) @ c.p.astype(object)) % fld.p
    np.testing.assert_array_equal(got.p, want.astype(np.int64))
    s = fld.reduce_sum(a, 2)
    np.testing.assert_array_equal(s.q, a.q.sum(2, keepdims=True) % fld.q)


def test_oracles_are_consistent_keyed_and_symmetric(fld):
    a, c = _rand(fld, (100,), 6), _rand(fld, (100,), 7)
    assert fld.oracle("sqrt", a).equal(fld.oracle("sqrt", FieldArray(a.p.copy(), None)))
    assert not np.array_equal(fld.oracle("sqrt", a).p, fld.oracle("erf", a).p)
    other = Field(fld.p, fld.q, fld.g, fld.salt + 1)
    assert not np.array_equal(fld.oracle("sqrt", a).p, other.oracle("sqrt", a).p)
    m = fld.oracle("max", a, c)
    assert m.equal(fld.oracle("max", c, a))
    stacked = FieldArray(np.stack([a.p, c.p], 1), np.stack([a.q, c.q], 1))
    assert m.equal(fld.reshape(fld.oracle_reduce("max", stacked, 1), (100,)))
    assert np.all((m.p >= 0) & (m.p < fld.p)) and np.all((m.q >= 0) & (m.q < fld.q))
    # both residues are hashes of the p-residue only: a different q-residue changes nothing
    assert fld.oracle("max", FieldArray(a.p, (a.q + 1) % fld.q), c).equal(m)


def test_constants_map_by_one_rule(fld):
    third = fld.const(Fraction(1, 3))
    assert int(fld.mul(third, fld.const(Fraction(3))).p) == 1
    eps = fld.const(Fraction(1e-6))
    assert (
        int(eps.p) == Fraction(1e-6).numerator * pow(Fraction(1e-6).denominator, -1, fld.p) % fld.p
    )
    assert int(fld.const(Fraction(-1)).q) == fld.q - 1
    with pytest.raises(BadPrime):
        fld.const(Fraction(1, fld.q))


def test_views_and_tiles_are_numpy_views(fld):
    a = _rand(fld, (4, 6), 8)
    for v in (
        a[1:3, 2:],
        fld.transpose(a, (1, 0)),
        fld.reshape(a, (6, 4)),
        fld.broadcast(a[:1], (3, 6)),
    ):
        assert np.shares_memory(v.p, a.p) and np.shares_memory(v.q, a.q)


def test_run_field_on_a_block_graph_matches_the_kernel_graph(fld):
    ref, cand = ex.gqa_pair(2, 8, 4, 32, 2, 2, 2)
    rng = np.random.default_rng(9)
    xs = [fld.random(n.shape, rng) for n in ref.inputs]
    (o1,), (o2,) = run_field(ref, xs, fld), run_field(cand, xs, fld)
    assert o1.equal(o2) and o1.q is None


def test_run_field_keeps_q_residues_of_polynomial_programs(fld):
    x, w = b.input_(0, (3, 4), DType.F32), b.input_(1, (4, 2), DType.F32)
    kg = check(
        b.kernel_graph([x, w], [b.reduce(Op.REDUCE_MEAN, b.matmul(b.unary(Op.SQUARE, x), w), 0)])
    )
    rng = np.random.default_rng(10)
    xs = [fld.random((3, 4), rng), fld.random((4, 2), rng)]
    (o,) = run_field(kg, xs, fld)
    for r, res in ((fld.p, o.p), (fld.q, o.q)):
        xv, wv = (xs[0].p if r == fld.p else xs[0].q), (xs[1].p if r == fld.p else xs[1].q)
        want = (
            ((xv.astype(object) ** 2) @ wv.astype(object)).sum(0, keepdims=True) * pow(3, -1, r) % r
        )
        np.testing.assert_array_equal(res, want.astype(np.int64))


@pytest.mark.parametrize("shape", [(1,), (7,), (9,), (5, 7), (3, 33, 17)])
def test_batch_inverse_matches_fermat(shape):
    """The product-tree inverse equals x^(r-2) elementwise, for sizes that are and are not
    powers of two, and refuses a zero anywhere."""
    from mlso_cli.verify.field import ZeroDenominator, _inverse, _pow_mod

    r = 2147483647
    x = np.random.default_rng(len(shape)).integers(1, r, size=shape, dtype=np.int64)
    inv = _inverse(x, r)
    assert inv.shape == x.shape
    assert (inv == _pow_mod(x, r - 2, r)).all()
    assert (x * inv % r == 1).all()
    x.flat[-1] = 0
    with pytest.raises(ZeroDenominator):
        _inverse(x, r)
