"""Constants that lifting and the field semantics must agree on exactly.

Why in ir/: lifting (frontend/lift.py) snaps an erf argument's scale to INV_SQRT2, and the field
check (verify/semantics.py) takes any constant within fp16 rounding of 1/sqrt(2) or sqrt(2) as
exactly that value. Both read the same definition from here, so neither layer imports the other
(the frontend never reaches up into verify/).
"""

from __future__ import annotations

from fractions import Fraction

INV_SQRT2 = Fraction(0.7071067811865476)
"""1/sqrt(2) as the double nearest it, exactly: GELU's erf argument scale."""
SNAP = Fraction(1, 2048)
"""Relative distance within which a constant is taken as 1/sqrt(2) or sqrt(2): fp16's rounding."""


def canonical_const(v: Fraction) -> Fraction:
    """v, except that a constant within fp16 rounding of 1/sqrt(2) (or sqrt(2)) becomes
    INV_SQRT2 (or 1/INV_SQRT2): an exporter writes GELU's erf argument as x / 1.4142135 or
    x * 0.70710677, and the fused op must meet it (docs/verification.md, Canonical forms)."""
    if v > 0:
        if abs(v - INV_SQRT2) <= SNAP * INV_SQRT2:
            return INV_SQRT2
        if abs(v - 1 / INV_SQRT2) <= SNAP / INV_SQRT2:
            return 1 / INV_SQRT2
    return v
