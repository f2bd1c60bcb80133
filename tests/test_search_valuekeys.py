"""The search's dict keys of fingerprints (search/fingerprint.py ValueKey, RayKey).

Why these tests: the keys replaced a blake2b digest of every residue (after normalising each
entry, for a ray) with a hash of a few sampled residues and a whole-array comparison when hashes
meet. The enumeration's duplicate and constant-multiple checks are dict lookups on them, so the
search is unchanged only if two keys are equal exactly when the digests were: checked here on
random residue arrays, on arrays that differ in one entry (which the sampled hash may not read),
on constant multiples, on zeros, and with and without q-residues.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlso_cli.search.fingerprint import Print
from mlso_cli.verify.field import FieldArray

P, Q = 50331653, 8388617  # any primes below 2^27 do: the keys only compare residues


def _print(p: np.ndarray, q: np.ndarray | None) -> Print:
    return Print(FieldArray(p, q), P, Q)


def _pair(a: Print, b: Print) -> None:
    """Key and ray equality (and hash agreement) are the digests' equality."""
    assert (a.key() == b.key()) == (a.digest_key() == b.digest_key())
    assert (a.ray() == b.ray()) == (a.digest_ray() == b.digest_ray())
    if a.key() == b.key():
        assert hash(a.key()) == hash(b.key())
    if a.ray() == b.ray():
        assert hash(a.ray()) == hash(b.ray())


shapes = st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple)


@settings(max_examples=150, deadline=None)
@given(
    shape=shapes,
    seed=st.integers(0, 2**32 - 1),
    with_q=st.booleans(),
    zeros=st.floats(0.0, 1.0),
    change=st.sampled_from(["same", "one entry", "scaled", "scaled q only", "other", "zero"]),
)
def test_keys_equal_exactly_when_digests_are(shape, seed, with_q, zeros, change):
    rng = np.random.default_rng(seed)
    p = rng.integers(0, P, size=shape, dtype=np.int64)
    p[rng.random(shape) < zeros] = 0
    q = rng.integers(0, Q, size=shape, dtype=np.int64) if with_q else None
    p2, q2 = p.copy(), None if q is None else q.copy()
    if change == "one entry":
        i = tuple(rng.integers(0, n) for n in shape)
        p2[i] = (p2[i] + 1) % P
    elif change == "scaled":
        c = int(rng.integers(2, P))
        p2 = p * c % P
        if q2 is not None:
            q2 = q2 * int(rng.integers(2, Q)) % Q
    elif change == "scaled q only" and q2 is not None:
        q2 = q2 * 3 % Q
    elif change == "other":
        p2 = rng.integers(0, P, size=shape, dtype=np.int64)
    elif change == "zero":
        p2 = np.zeros(shape, np.int64)
    a, b = _print(p, q), _print(p2, q2)
    _pair(a, b)
    _pair(a, a)
    if change == "same":
        assert a.key() == b.key() and a.ray() == b.ray()
    if change == "scaled" and p.any() and p.size > 1:
        assert a.ray() == b.ray() and a.key() != b.key()


def test_a_known_q_residue_is_part_of_the_key():
    """A value whose q-residue is unknown is not the same key as one with it known (the digest
    hashed it only while known)."""
    p = np.arange(1, 13, dtype=np.int64).reshape(3, 4)
    a, b = _print(p, p.copy()), _print(p, None)
    _pair(a, b)
    assert a.key() != b.key()


@pytest.mark.parametrize("n", [1, 2, 47, 48, 49, 1000])
def test_large_arrays_differing_off_the_sample(n):
    """Two arrays that agree wherever the hash samples still differ as keys (the comparison
    reads every residue)."""
    p = np.arange(1, n + 1, dtype=np.int64)
    for i in range(n):
        p2 = p.copy()
        p2[i] = 0 if p2[i] != 0 else 1
        _pair(_print(p, None), _print(p2, None))
        assert _print(p, None).key() != _print(p2, None).key()
