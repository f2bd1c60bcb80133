"""Probabilistic equivalence of two kernel graphs by finite-field fingerprints, with a stated bound.

Why: the search proposes millions of rewrites; each survivor must be proved equal to the original
program, fast, with a false-accept probability we can state (docs/architecture.md, Verification). Each trial
draws fresh primes (p, q) and fresh inputs, evaluates both graphs in the field (fieldrun.py) and
compares every output. Trials repeat until the product of per-trial bounds reaches the target.

Derivation of the per-trial bound (computed by `trial_bound` from degree.analyse)
--------------------------------------------------------------------------------------------
Model. A program's entries are rational functions over Q in *atoms*: the inputs x, the exp
results z_j = exp(u_j) and the oracle results o_k = F_k(w_k). Two programs are equivalent when
every output is the same rational function of the atoms, where exp atoms with equal arguments
are equal and exp(a)exp(b) = exp(a+b), and oracles with equal keys and arguments are equal.
In the field an input is a uniform pair (x mod p, x mod q); exp(u) = g^(u mod q) lies in the
order-q subgroup H of Z_p* and its q-residue is unknown; an oracle value is a uniform pair
(o mod p, o mod q) drawn by hashing its argument's p-residue.

Suppose A and B are not equivalent, and fix an output entry where they differ, A = N_A/D_A,
B = N_B/D_B. A false accept at that entry needs one of these events:
 (1) C = N_A*D_B - N_B*D_A (nonzero, degree D = max(nA+dB, nB+dA) in the atoms, coefficients of
     L1 norm <= 2^H after clearing the constants' denominators) vanishes at the sample.
     - The prime may kill C: a nonzero coefficient |c| <= 2^H has at most H/log2(r_min) prime
       factors >= r_min, and any given prime is drawn with probability <= 1/Q_ELIGIBLE
       (field.py): bad(H) = floor(H / log2 r_min) / Q_ELIGIBLE.
     - Otherwise Schwartz-Zippel over Z_p with every atom drawn from a set of size >= S gives
       D/S, where S = q if the programs contain a true exp (exp atoms range over H, |H| = q),
       else S = p.
 (2) Two formally different exp arguments u1 != u2 collide mod q, so the field identifies two
     exp atoms that the model keeps apart. The exponent enters as a variable over Z_q: u_j is a
     rational function of (x mod q, o mod q) of degree <= (n_u, d_u), and u1 - u2 = 0 is a zero
     of a polynomial of degree <= n_u + d_u: probability (n_u + d_u)/q + bad(h_u) for q.
 (3) Two formally different oracle arguments collide mod p: (n_w + d_w)/S + bad(h_w) for p.
As in Mirage's analysis of LAX programs, (2) and (3) are charged once per trial for the pair of
arguments that distinguishes the programs; atoms with distinct arguments are then modelled as
independent uniform values (exp: uniform on H, oracle: uniform pair). For programs without exp
and oracles this is Schwartz-Zippel exactly; with them it is that idealisation.
    eps_p = (D + deg_oracle_args)/S + deg_exp_args/q + bad_p(H) + bad_p(h_w) + bad_q(h_u)
If the differing output is exp-free in both programs, its q-residues are compared too. Given the
p-side sample (x mod p, hence every oracle argument), its q-residue is a rational function of
fresh uniform values (x mod q, o mod q), so the two Schwartz-Zippel events multiply:
    eps_pq = (D/p)(D/q) + deg_oracle_args/S + bad_p(H) + bad_q(H) + bad_p(h_w)
and eps = min(eps_p, eps_pq). The differing entry is unknown, so a trial's bound is the maximum
over outputs.

Division. Inverses are kept as rational functions (N and D swap), so clearing denominators is
the C above. A zero denominator makes the evaluator raise and the checker resample the inputs,
i.e. the accepted sample is drawn conditioned on "no denominator vanishes". Each inverted entry
vanishes with probability <= deg(N)/q in each residue, so with rho = 2*(risk_A + risk_B)/q
(risk = sum of numel * deg(N) over every inverse executed, degree.py),
    Pr[accept | no zero] <= eps / (1 - rho).
(1 + exp(-x) never vanishes for a true exp, since -1 is not in H when q is odd.)

Trials and candidates. Trials use independent primes, salts and inputs, so T accepting trials
have false-accept probability <= prod_t eps_t: that product is `Verdict.bound`. A search run
verifies many candidates; the k-th (`runs_so_far` = k, counting from 1) must reach
target_bound / (k (k+1)), so the union over every candidate of the run stays
<= target_bound * sum_k 1/(k(k+1)) <= target_bound, however many candidates come.
Constants whose denominator the prime divides (BadPrime) make the checker draw new primes; float
constants have power-of-two denominators, so in practice this never happens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mlso_cli.ir.graph import KernelGraph
from mlso_cli.verify.degree import Deg, Profile, analyse
from mlso_cli.verify.field import (
    K_CHOICES,
    Q_ELIGIBLE,
    Q_LO,
    BadPrime,
    Field,
    FieldArray,
    ZeroDenominator,
)
from mlso_cli.verify.fieldrun import run_field

LOG_P_MIN = math.log2(min(K_CHOICES) * Q_LO + 1)
LOG_Q_MIN = math.log2(Q_LO)
MAX_RESAMPLES = 16
"""Input resamples per trial after zero denominators, before drawing new primes."""


@dataclass(frozen=True)
class Verdict:
    equivalent: bool
    """True only when every trial agreed and the bound reached the run's target."""
    bound: float
    """False-accept probability bound for this verdict (0.0 for a rejection by a witness)."""
    trials: int
    detail: str


def _bad(height: float, log_min: float) -> float:
    return math.floor(height / log_min) / Q_ELIGIBLE if height > 0 else 0.0


def trial_bound(pa: Profile, pb: Profile, fld: Field) -> float:
    """Per-trial false-accept bound for programs with these degree profiles (module docstring)."""
    ex = pa.exp_args.merge(pb.exp_args)
    orc = pa.oracle_args.merge(pb.oracle_args)
    s = fld.q if (pa.has_exp or pb.has_exp) else fld.p
    args_term = (
        orc.degree / s
        + ex.degree / fld.q
        + _bad(orc.height, LOG_P_MIN)
        + _bad(ex.height, LOG_Q_MIN)
    )
    worst = 0.0
    for a, b in zip(pa.outputs, pb.outputs):
        deg, height = _cleared(a, b)
        eps = deg / s + args_term + _bad(height, LOG_P_MIN)
        if a.q and b.q:
            both = (deg / fld.p) * (deg / fld.q) + orc.degree / s + _bad(orc.height, LOG_P_MIN)
            eps = min(eps, both + _bad(height, LOG_P_MIN) + _bad(height, LOG_Q_MIN))
        worst = max(worst, eps)
    rho = 2 * (pa.risk + pb.risk) / fld.q
    return 1.0 if rho >= 1 else min(1.0, worst / (1 - rho))


def _cleared(a: Deg, b: Deg) -> tuple[int, float]:
    return max(a.n + b.d, b.n + a.d), max(a.hn + b.hd, b.hn + a.hd) + 1


def interface_mismatch(a: KernelGraph, b: KernelGraph) -> str | None:
    """Why two graphs cannot be equivalent from their signatures alone, or None."""
    if len(a.inputs) != len(b.inputs):
        return f"different number of inputs: {len(a.inputs)} vs {len(b.inputs)}"
    for i, (x, y) in enumerate(zip(a.inputs, b.inputs)):
        if (x.shape, x.dtype) != (y.shape, y.dtype):
            return f"input {i}: {x.dtype.value}{list(x.shape)} vs {y.dtype.value}{list(y.shape)}"
    if len(a.outputs) != len(b.outputs):
        return f"different number of outputs: {len(a.outputs)} vs {len(b.outputs)}"
    for i, (x, y) in enumerate(zip(a.outputs, b.outputs)):
        if x.shape != y.shape:
            return f"output {i} ({a.output_names[i]}): shape {list(x.shape)} vs {list(y.shape)}"
        if x.dtype != y.dtype:
            return f"output {i} ({a.output_names[i]}): dtype {x.dtype.value} vs {y.dtype.value}"
    return None


def _evaluate_pair(
    a: KernelGraph, b: KernelGraph, fld: Field, rng: np.random.Generator
) -> tuple[list[FieldArray], list[FieldArray]] | None:
    """Both programs on the same random inputs, resampling on zero denominators (None: give up)."""
    for _ in range(MAX_RESAMPLES):
        xs = [fld.random(n.shape, rng) for n in a.inputs]
        try:
            return run_field(a, xs, fld), run_field(b, xs, fld)
        except ZeroDenominator:
            continue
    return None


def _difference(
    a: KernelGraph, oa: list[FieldArray], ob: list[FieldArray], fld: Field
) -> str | None:
    for i, (x, y) in enumerate(zip(oa, ob)):
        if not x.equal(y):
            bad = x.p != y.p
            if x.q is not None and y.q is not None:
                bad = bad | (x.q != y.q)
            first = tuple(int(j) for j in np.argwhere(bad)[0])
            return (
                f"output {i} ({a.output_names[i]}) differs in {int(bad.sum())} of {bad.size} entries, "
                f"first at {first} (p={fld.p}, q={fld.q})"
            )
    return None


def check_equivalent(
    a: KernelGraph,
    b: KernelGraph,
    *,
    seed: int | None = None,
    target_bound: float = 2.0**-60,
    runs_so_far: int = 1,
    max_trials: int = 32,
) -> Verdict:
    """Test a == b by field fingerprints until the false-accept bound reaches the run's target."""
    why = interface_mismatch(a, b)
    if why:
        return Verdict(False, 0.0, 0, why)
    pa, pb = analyse(a), analyse(b)
    target = target_bound / (runs_so_far * (runs_so_far + 1))
    rng = np.random.default_rng(seed)
    bound, trials, redraws = 1.0, 0, 0
    while bound > target:
        if trials >= max_trials or redraws > max_trials:
            return Verdict(
                False,
                bound,
                trials,
                f"bound {bound:.3g} did not reach {target:.3g} in {trials} trials",
            )
        fld = Field.draw(rng)
        eps = trial_bound(pa, pb, fld)
        try:
            outs = _evaluate_pair(a, b, fld, rng)
        except BadPrime:
            redraws += 1
            continue
        if outs is None:
            redraws += 1
            continue
        diff = _difference(a, *outs, fld)
        trials += 1
        if diff:
            return Verdict(False, 0.0, trials, diff)
        if eps >= 1:
            return Verdict(
                False,
                1.0,
                trials,
                "agreed, but the degree is too high for a useful bound "
                f"(per-trial bound {eps:.3g}); not accepted",
            )
        bound *= eps
    return Verdict(
        True,
        bound,
        trials,
        f"{trials} trials agreed; per-trial bound {eps:.3g}, "
        f"false-accept bound {bound:.3g} <= {target:.3g}",
    )
