"""The per-trial bound's argument-collision term (verify/equivalence.py, steps 1-4).

Why: exp results and oracle results are atoms that the field identifies whenever their arguments
agree at the sample, and every pair of formally different arguments that an output entry depends
on can do that. The bound used to charge such a collision once per trial; a softmax row of K
keys has K^2/2 pairs. These tests pin the union to hand-computed values, check that it grows
with the arguments an entry depends on and not with the rest of the program, that a program
without exp or oracles keeps the plain Schwartz-Zippel bound, and that the refinements (odd
parts of coefficients, counting atoms once per path, inverted oracle atoms, flattened max sets)
apply exactly where their conditions hold.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from mlso_cli.ir import build as b
from mlso_cli.ir import check
from mlso_cli.ir.ops import DType, Op
from mlso_cli.verify import equivalence as eq
from mlso_cli.verify import field as field_mod
from mlso_cli.verify.degree import Height, analyse
from tests.fixtures import examples as ex

F32 = DType.F32


def _x(i: int, shape: tuple[int, ...]):
    return b.input_(i, shape, F32)


def _kg(inputs, outputs):
    return check(b.kernel_graph(inputs, outputs))


def _field(seed: int = 0) -> field_mod.Field:
    return field_mod.Field.draw(np.random.default_rng(seed))


def _softmax_pair(rows: int, k: int):
    """e / rowsum(e) against e * reciprocal(rowsum(e))."""
    x = _x(0, (rows, k))
    e = b.unary(Op.EXP, x)
    s = b.reduce(Op.REDUCE_SUM, e, 1)
    return _kg([x], [b.div(e, s)]), _kg([x], [b.mul(e, b.unary(Op.RECIPROCAL, s))])


def test_a_2x3_softmax_gives_the_hand_computed_bound():
    """An output entry e_ij / s_i depends on e_ij and on the row sum's 3 atoms: 4 per program,
    8 for the pair (an atom reached along two paths, or in both programs, is counted each time:
    the analysis cannot see that they are the same). C = N_A D_B - N_B D_A has degree 2 and two
    atoms per monomial; each may meet any of the other 7, and two arguments x_ij != x_kl
    agree mod q with probability 1/q (degree 1). Schwartz-Zippel over the exp values adds 2/q,
    and resampling on zero row sums (2 rows, degree 1, in each program) divides by 1 - 8/q."""
    a, c = _softmax_pair(2, 3)
    pa, pc = analyse(a), analyse(c)
    assert (pa.outputs[0].ne, pc.outputs[0].ne) == (4, 4)
    fld = _field()
    q = fld.q
    expected = (2 / q + 2 * 7 * (1 / q)) / (1 - 2 * (2 + 2) / q)
    assert eq.trial_bound(pa, pc, fld) == pytest.approx(expected, rel=1e-12)
    # the old charge, one collision of degree 1 per trial: 3/q, five times too small here
    assert eq.trial_bound(pa, pc, fld) > 5 * (3 / q)


@pytest.mark.parametrize("k", [4, 16, 64, 256])
def test_the_collision_term_grows_with_the_arguments_of_an_entry(k):
    """2(K + 1) exp atoms per entry (pair), two designated: (2 + 2 * 2 (2K + 1)) / q in all."""
    a, c = _softmax_pair(2, k)
    fld = _field()
    q = fld.q
    eps = eq.trial_bound(analyse(a), analyse(c), fld)
    assert eps == pytest.approx((2 + 2 * (2 * k + 1)) / q / (1 - 8 / q), rel=1e-12)


def test_the_union_runs_over_one_entry_not_the_program():
    """More rows, batches or value columns add arguments to the program, not to an entry."""
    fld = _field()

    def eps(g, m, d, n):
        ref, cand = ex.gqa_pair(g, m, d, n, 2, 2, 2)
        return eq.trial_bound(analyse(ref), analyse(cand), fld)

    base = eps(2, 8, 4, 32)
    assert eps(4, 16, 8, 32) == pytest.approx(base, rel=0.02)  # risk grows with the rows only
    assert eps(2, 8, 4, 64) > 1.9 * base  # twice the keys per row


def test_polynomial_programs_keep_the_schwartz_zippel_bound():
    """No exp, no oracle: no collision term and no assumption; an integer program's bound is
    min(D/p, (D/p)(D/q)) exactly (no bad prime: coefficients below 2^23), as before."""
    a, c = _x(0, (4, 6)), _x(1, (4, 6))
    w = _x(2, (6, 3))
    ref = _kg([a, c, w], [b.matmul(b.add(a, c), w)])
    cand = _kg([a, c, w], [b.add(b.matmul(a, w), b.matmul(c, w))])
    pr, pc = analyse(ref), analyse(cand)
    for seed in range(3):
        fld = _field(seed)
        assert eq.trial_bound(pr, pc, fld) == (2 / fld.p) * (2 / fld.q)
    assert eq.assumptions(pr, pc) is None
    v = eq.check_equivalent(ref, cand, seed=1)
    assert v.equivalent and v.heuristic is None


def test_a_division_keeps_the_schwartz_zippel_bound_with_resampling():
    """x / (x + y) against x * reciprocal(y + x): D = 2, risk 24 per program."""
    x, y = _x(0, (4, 6)), _x(1, (4, 6))
    ref = _kg([x, y], [b.div(x, b.add(x, y))])
    cand = _kg([x, y], [b.mul(x, b.unary(Op.RECIPROCAL, b.add(y, x)))])
    pr, pc = analyse(ref), analyse(cand)
    fld = _field()
    rho = 2 * (24 + 24) / fld.q
    assert eq.trial_bound(pr, pc, fld) == pytest.approx(
        (2 / fld.p) * (2 / fld.q) / (1 - rho), rel=1e-12
    )


def test_verdicts_name_what_the_bound_assumes():
    a, c = _softmax_pair(2, 3)
    v = eq.check_equivalent(a, c, seed=0)
    assert v.equivalent and "exp values" in v.heuristic and "random function" not in v.heuristic
    x = _x(0, (4, 8))
    norm = _kg([x], [ex.rmsnorm(x)])
    v = eq.check_equivalent(norm, norm, seed=0)
    assert v.equivalent and v.heuristic.startswith("the salted 64-bit oracle hash")
    wrong = _kg([x], [b.mul(x, b.unary(Op.SIGMOID, x))])
    v = eq.check_equivalent(_kg([x], [b.unary(Op.SIGMOID, x)]), wrong, seed=0)
    assert not v.equivalent and v.bound == 0.0 and v.heuristic is None  # a witness assumes nothing


def test_odd_parts_of_dyadic_coefficients_are_small():
    """mean(x^2) + eps clears to (x^2 2^k / 64 ... + m) / 2^j: its L1 height is ~2^62, but the
    difference of two such arguments has only powers of two in its non-constant coefficients.
    A bad prime could still divide the difference of two *different* eps constants: that is
    the constant case, charged once per pair of ops."""
    x = _x(0, (4, 64))
    arg = analyse(_kg([x], [ex.rmsnorm(x, Fraction(float(np.float32(1e-6))))])).oracle_args
    assert arg.hN.l1 + arg.hD.l1 + 1 > 2 * 23  # the L1 bound would allow two primes per pair
    assert arg.odd_rest < 23  # none, per pair
    assert 23 <= arg.odd_constant < 2 * 23  # at most one, per pair of ops


def test_heights_track_constant_terms_and_valuations():
    h = Height(float(np.log2(6)), 1.0)  # the constant 6
    v = Height(lx=0.0, vx=0.0)  # a variable
    prod = h.times(v.plus(h))  # 6 (x + 6) = 6x + 36
    assert prod.lc == pytest.approx(2 * np.log2(6)) and prod.vc == 2
    assert prod.lx == pytest.approx(np.log2(6)) and prod.vx == 1
    assert prod.odd == pytest.approx(2 * np.log2(6) - 2)  # 36 = 4 * 9


def test_inverted_oracle_atoms_are_used_only_one_way():
    """Per-feature rsqrt (batch-norm like): as denominators, one output entry clears 16 of them
    and C has 30+ atoms per monomial; taken as atoms (1/F(w) is a random function of w), two.
    Where a program also uses sqrt itself, the inverted analysis does not apply."""
    x, v, w = _x(0, (2, 16)), _x(1, (16,)), _x(2, (16, 8))
    scale = b.unary(Op.RSQRT, b.add(v, b.const(Fraction(1, 1024))))
    ref = _kg([x, v, w], [b.matmul(b.mul(x, scale), w)])
    cand = _kg(
        [x, v, w], [b.matmul(b.div(x, b.unary(Op.SQRT, b.add(v, b.const(Fraction(1, 1024))))), w)]
    )
    pr, pc = analyse(ref), analyse(cand)
    assert pr.inverted is not None and pc.inverted is not None
    fld = _field()
    plain = max(eq._output_bounds(pr, pc, fld))
    inverted = max(eq._output_bounds(pr.inverted, pc.inverted, fld))
    assert inverted < plain / 4
    rho = 2 * (pr.risk + pc.risk) / fld.q
    assert eq.trial_bound(pr, pc, fld) == pytest.approx(inverted / (1 - rho), rel=1e-12)
    both_ways = _kg(
        [x, v, w],
        [
            b.matmul(
                b.add(b.mul(x, scale), b.unary(Op.SQRT, b.add(v, b.const(Fraction(1, 1024))))), w
            )
        ],
    )
    pb = analyse(both_ways)
    assert not eq.one_form(pb.inverted.outputs[0].signs)
    assert eq.trial_bound(pb, pb, fld) == pytest.approx(
        max(eq._output_bounds(pb, pb, fld)) / (1 - 2 * 2 * pb.risk / fld.q), rel=1e-12
    )


def test_max_counts_the_leaves_of_nested_maxima():
    """max is a set function of its flattened leaves: a max over 4 maxima of pairs ranges over
    8 values, so a distinguishing leaf can meet 15 others (field.py hashes that set)."""
    x = _x(0, (3, 4, 2))
    inner = b.reduce(Op.REDUCE_MAX, x, 2)
    outer = b.reduce(Op.REDUCE_MAX, inner, 1)
    p = analyse(_kg([x], [outer]))
    assert p.oracle_args.arity == 8 and p.oracle_args.sets
    relu_of_max = analyse(_kg([x], [b.unary(Op.RELU, outer)]))
    assert relu_of_max.oracle_args.arity == 9  # the 8 leaves and 0


def test_a_max_may_be_its_leaf():
    """max{a} = a: a max over a size-1 axis is its argument, so its degree is not an atom's 1."""
    x = _x(0, (3, 1))
    cube = b.mul(x, b.mul(x, x))
    out = analyse(_kg([x], [b.reduce(Op.REDUCE_MAX, cube, 1)])).outputs[0]
    assert out.n == 3 and out.no == 1


def test_softmax_times_v_counts_each_row_once_per_path():
    """softmax(s) V sums over j both exp(s_ij) and the row sum, which is the same for every j:
    2n atoms per entry (once per path), not n (n + 1)."""
    out = analyse(ex.attention(1, 4, 3, 16)).outputs[0]
    assert out.ne == 2 * 16


@pytest.mark.parametrize(
    "name", ["wrong_softmax_scale", "missing_normalisation", "wrong_split_combine", "wrong_eps"]
)
def test_mutants_are_still_rejected_by_a_witness(name):
    from tests.test_verify_equivalence import NOT_EQUIVALENT

    a, c = NOT_EQUIVALENT[name]()
    v = eq.check_equivalent(a, c, seed=21)
    assert not v.equivalent and v.bound == 0.0 and "differs" in v.detail


def test_sigmoids_inside_a_sum_are_atoms_in_one_form():
    """sum_k sigmoid(x_k) w_k has 32 different denominators 1 + exp(-x_k); taking
    1/(1 + exp(-x_k)) as the atom (a bijection of the exp values) leaves degree 1. A program
    that also uses exp(-x) itself has one kind in two forms, and keeps the plain analysis."""
    x, w = _x(0, (2, 32)), _x(1, (32, 4))
    gated = _kg([x, w], [b.matmul(b.unary(Op.SIGMOID, x), w)])
    p = analyse(gated)
    assert (p.outputs[0].n, p.outputs[0].d) == (1 + 31, 32)  # w_k / (1 + z_k), cleared
    assert (p.inverted.outputs[0].n, p.inverted.outputs[0].d) == (2, 0)
    assert eq.one_form(p.inverted.outputs[0].signs)
    fld = _field()
    rho = 2 * 2 * p.risk / fld.q
    assert eq.trial_bound(p, p, fld) == pytest.approx(
        max(eq._output_bounds(p.inverted, p.inverted, fld)) / (1 - rho), rel=1e-12
    )
    mixed = _kg(
        [x, w], [b.matmul(b.add(b.unary(Op.SIGMOID, x), b.unary(Op.EXP, b.unary(Op.NEG, x))), w)]
    )
    pm = analyse(mixed)
    assert not eq.one_form(pm.inverted.outputs[0].signs)
    assert eq.trial_bound(pm, pm, fld) == pytest.approx(
        max(eq._output_bounds(pm, pm, fld)) / (1 - 2 * 2 * pm.risk / fld.q), rel=1e-12
    )
