"""Pattern keys of the pruner's target (mlso_cli/search/target.py), built from hash-consed forms.

Why these tests: a key is now assembled from its children's interned form ids instead of one
serialisation of the whole term, and the pruner is only right if that keeps the old partition:
terms equal up to a consistent renaming of their free variables (and of bound ones: alpha-
equivalent sums) share a key, and terms that differ in structure, in which index a factor reads,
in a constant or in a sum's axis do not. Each case is checked on fresh variables, so no key can
come out equal because two terms happen to be the same interned id.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from mlso_cli.search import state
from mlso_cli.search import terms as T
from mlso_cli.search.target import _LOCAL, _identity, _q, _ratio, mono_key, poly_key


@pytest.fixture(autouse=True)
def _pristine_tables():
    saved = state.save()
    yield
    state.restore(saved)


def x(index: int, *dims: int) -> int:
    """Input `index` at one variable per dim, as a poly."""
    return T.of_factor(T.mk(("in", index, tuple((v,) for v in dims))))


def m(p: int) -> int:
    """The single monomial of a poly."""
    ((mono, _),) = T.terms(p)
    return mono


def fresh(n: int = 4) -> int:
    return T.fresh(n)


def test_renamed_free_variables_share_a_key() -> None:
    i, j, k, l_ = fresh(), fresh(), fresh(), fresh()
    assert i != k
    a = T.mul(x(0, i, j), x(1, j))
    b = T.mul(x(0, k, l_), x(1, l_))
    assert a != b
    assert mono_key(m(a)) == mono_key(m(b))


def test_which_index_a_factor_reads_is_kept() -> None:
    i, j, k = fresh(), fresh(), fresh()
    same = T.mul(x(0, i, j), x(1, j))  # x[i, j] y[j]
    other = T.mul(x(0, i, j), x(1, i))  # x[i, j] y[i]
    outer = T.mul(x(0, i, j), x(1, k))  # x[i, j] y[k]
    keys = {mono_key(m(same)), mono_key(m(other)), mono_key(m(outer))}
    assert len(keys) == 3
    # names are forgotten: x[j, i] y[j] is x[i, j] y[i] with i and j swapped
    assert mono_key(m(T.mul(x(0, j, i), x(1, j)))) == mono_key(m(other))


def test_alpha_equivalent_sums_share_a_key_and_the_axis_is_kept() -> None:
    i, j, k, l_ = fresh(), fresh(), fresh(), fresh()
    # sum_j x[i, j] y[j] over two independent namings
    a = T.sum_over([(j, 4)], T.mul(x(0, i, j), x(1, j)))
    b = T.sum_over([(l_, 4)], T.mul(x(0, k, l_), x(1, l_)))
    assert mono_key(m(a)) == mono_key(m(b))
    # sum_i x[i, j] y[j] binds the other axis
    c = T.sum_over([(i, 4)], T.mul(x(0, i, j), x(1, j)))
    assert mono_key(m(a)) != mono_key(m(c))


def test_constants_inside_functions_are_kept() -> None:
    i, k = fresh(), fresh()
    one = T.exp(T.add(x(0, i), T.const(Fraction(1))))
    also = T.exp(T.add(x(0, k), T.const(Fraction(1))))
    two = T.exp(T.add(x(0, i), T.const(Fraction(2))))
    # exp(x + c) = exp(x) exp(c) keeps c as a factor's argument
    assert mono_key(m(one)) == mono_key(m(also))
    assert mono_key(m(one)) != mono_key(m(two))


def test_poly_keys_forget_scale_and_common_factor_but_not_signs() -> None:
    i, j, k, l_ = fresh(), fresh(), fresh(), fresh()
    s = T.add(x(0, i), x(1, i))  # x[i] + y[i]
    s2 = T.scale(T.add(x(0, k), x(1, k)), Fraction(3))  # 3 (x[k] + y[k])
    common = T.mul(x(2, j), T.add(x(0, l_), x(1, l_)))  # z[j] (x[l] + y[l])
    minus = T.sub(x(0, i), x(1, i))  # x[i] - y[i]
    assert poly_key(s) == poly_key(s2) == poly_key(common)
    assert poly_key(s) != poly_key(minus)
    # where the variables of different terms meet is part of the key: x[i] + y[j]
    apart = T.add(x(0, i), x(1, j))
    assert poly_key(s) != poly_key(apart)


def test_a_subterm_form_is_interned_once() -> None:
    i, j = fresh(), fresh()
    inner = T.sum_over([(j, 4)], T.mul(x(0, i, j), x(1, j)))
    mono_key(m(inner))
    size = len(_LOCAL)
    # a bigger term reusing the same sum adds only its own new subterms' forms
    outer = T.mul(inner, x(2, i))
    mono_key(m(outer))
    added = len(_LOCAL) - size
    assert 0 < added <= 3, added


def test_identity_codes_are_shared_tuples() -> None:
    assert _identity(3) == (0, 1, 2)
    assert _identity(3) is _identity(3)
    assert _identity(0) == ()


def test_rational_entries_are_equal_exactly_when_the_values_are() -> None:
    assert _q(3) == 3 and _q(Fraction(6, 2)) == 3
    assert _q(Fraction(-1, 2)) == (-1, 2)
    assert _ratio(Fraction(2, 3), Fraction(1, 3)) == 2
    assert _ratio(1, Fraction(-1, 2)) == -2
    assert _ratio(Fraction(1, 2), 3) == (1, 6)
    assert _ratio(-4, -6) == (2, 3)
    assert _ratio(0, 7) == 0
    assert _ratio(5, 1) == 5
    assert _ratio(Fraction(1, 2), 3) == _ratio(Fraction(1, 3), 2) != _ratio(Fraction(1, 2), 5)
