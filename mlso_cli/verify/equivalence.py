"""Probabilistic equivalence of two kernel graphs by finite-field fingerprints, with a stated bound.

Why: the search proposes millions of rewrites; each survivor must be proved equal to the original
program, fast, with a false-accept probability we can state (docs/architecture.md, Verification). Each trial
draws fresh primes (p, q) and fresh inputs, evaluates both graphs in the field (fieldrun.py) and
compares every output. Trials repeat until the product of per-trial bounds reaches the target.

Derivation of the per-trial bound (computed by `trial_bound` from degree.analyse)
--------------------------------------------------------------------------------------------
Model. A program's entries are rational functions over Q in *atoms*: the inputs x, the exp
results z = exp(u) and the oracle results o = F(w) (F a key: sqrt, erf, max, ...). Two programs
are equivalent when every output is the same rational function of the atoms, where two atoms of
one kind with formally equal arguments are one atom (and exp(a)exp(b) = exp(a+b); max is a
function of the set of its flattened leaves, max{a} = a). In the field an input is a uniform
pair (x mod p, x mod q); exp(u) = g^(u mod q) lies in the order-q subgroup H of Z_p* and its
q-residue is unknown; an oracle value is a pair of hashes of its argument's p-residue (for max,
of the set of its leaves' p-residues). The field *identifies* two atoms of one kind when their
arguments agree at the sample (mod q for exp, as p-residues or leaf sets for oracles).

Fix an output entry where A and B differ, A = N_A/D_A, B = N_B/D_B. C = N_A*D_B - N_B*D_A is a
nonzero polynomial of degree D = max(nA+dB, nB+dA), of degree D_a = max(anA+adB, anB+adA) in the
atoms alone, in at most N_e = ne_A + ne_B exp atoms and N_o = no_A + no_B oracle atoms (degree.py
counts per entry; an atom reached along two paths, or in both programs, is counted twice).

Step 1, which collisions matter. Take a monomial m of C, coefficient c != 0. Identification
merges atoms into classes and maps each monomial of C to a monomial in the classes. If no atom
of m is identified with another atom of C, then (exponents being non-negative) m is the only
monomial mapped to m's image, which keeps coefficient c: C stays nonzero. So C can only be made
to vanish identically by one of the at most min(D_a, N_kind) atoms of m of a kind meeting one of
the N_kind - 1 other atoms of its kind in C. The union runs over those pairs: not over all pairs
in the programs (a collision between atoms C does not depend on cannot change C, nor one that
leaves m's coefficient standing), and not once per trial, the old charge (for full-size gqa one
output entry depends on 4096 scores per program: 8.4M pairs of arguments, where one charge of
2/q ~ 2^-22 was made). With k_e, k_o the probabilities that two given formally different atoms
are identified (step 2):
    K = min(D_a, N_e) (N_e - 1) k_e + min(D_a, N_o) (N_o - 1) k_o   (or D_a max(..), if smaller)

Step 2, one pair. Two exp atoms: their arguments u1 != u2 are rational functions over Z_q of the
inputs' q-residues and of the q-residues of the oracle atoms inside them, and they agree where
P = N1*D2 - N2*D1 (degree <= n_u + d_u) vanishes. Three ways:
  - the prime divides every coefficient of P. A nonzero integer c has at most
    floor(log2(odd part of c) / log2 r_min) prime factors >= r_min (the primes drawn are odd), and
    a given prime is drawn with probability <= 1/Q_ELIGIBLE (field.py): bad(h) =
    floor(h / log2 r_min) / Q_ELIGIBLE, h from degree.Height (float constants are dyadic, so the
    odd parts are small where an L1 norm would not be). Per pair when P has a non-constant
    coefficient (h = its odd part). When P is a constant the arguments differ by a constant;
    every entry of one op's argument is one formula in its own variables and constants are
    scalars, so that constant is a difference of the constant terms of two recorded argument
    ops, and its primes are charged once per trial over the pairs of ops
    (`Identification.constant`). Not with max: a max that is its leaf on some entries only
    (max{a} = a on a diagonal) gives an op several constant terms, so then per pair too;
  - nested oracle atoms are identified so that P vanishes identically: step 1 one level down,
    at most min(an_u + ad_u, 2 no_u) designated atoms with 2 no_u - 1 partners each;
  - otherwise P vanishes at uniform (x mod q, oracle q-residues): Schwartz-Zippel, (n_u+d_u)/q.
    k_e = bad_q(h_u) + (n_u + d_u)/q + nested(k_o) + 2 no_u (q/2^64 + [k_w for max])
Two oracle atoms of one key: their arguments are multisets (sets for max) of k elements (the
arity; the flattened leaves for max). Take an element f whose multiplicity differs: unless f
meets one of the other <= 2k - 1 elements of the two arguments, the hashed multisets differ, and
the 64-bit sums of hashes of two different multisets of <= k values agree with probability
<= k/2^64. One pair of elements is as above, with p-residues (exp atoms nested in an oracle
argument are values in H, so S below):
    k_w = bad_p(h_w) + (n_w + d_w)/S + nested(k_e, k_o) + 2 no_w (p/2^64 + [k_w for max])
    k_o = (2k - 1) k_w + k/2^64
Nested atoms are one level down: the recursion runs innermost first (degree.Deg.depth) with
bounds that are maxima over the program (`identification`).

Step 3, no collision. Given the identification pattern with C still nonzero mod p (bad_p(H): the
prime divides c, H from the odd part of C's coefficients), C is a nonzero polynomial in the
inputs and the classes of atoms, and Schwartz-Zippel gives D/S if those are independent uniform
values, S = q if the programs contain a true exp (exp values lie in H, |H| = q), else S = p.
Two more ways for a class not to be uniform are charged: a max whose leaves all agree at the
sample is that leaf, not a hash (k_w per oracle atom), and a uniform 64-bit hash reduced mod p
or q is within p/2^64 or q/2^64 of uniform (N_o (p + q)/2^64).
    eps_p = D/S + K + N_o ((p + q)/2^64 + [k_w for max]) + constant + bad_p(H)
If the differing output is exp-free in both programs, its q-residues are compared too. Given the
p-side sample (x mod p, hence every oracle argument and the identification pattern), its
q-residue is a rational function of fresh uniform values (x mod q, o mod q), so the two
Schwartz-Zippel events multiply:
    eps_pq = (D/p)(D/q) + K + N_o (...) + constant + bad_p(H) + bad_q(H)
and eps = min(eps_p, eps_pq). The differing entry is unknown, so a trial's bound is the maximum
over outputs.

Step 4, atoms in another form. For an atom a and a constant c, 1/(c + a) is a bijection of
a's values (send the value -c, which the resampling below conditions away, to 0): for an oracle
it is again a uniform random function of the argument, for exp a value in a set of q values.
So degree.analyse also analyses each program with such 1/(c + a) taken as the atom
(`Profile.inverted`): rsqrt's 1/sqrt(w), sigmoid's 1/(1 + exp(-x)). A per-row rsqrt or a
per-key sigmoid then no longer puts one more denominator per row or key into C. This is valid
only when every kind of atom (an oracle key, or exp) appears in one form in the pairs of steps
1 and 2 (a and 1/(c + a) of one class satisfy a relation that can cancel monomials without a
designated atom): `one_form`. Where it is valid, an output's bound is the smaller of the two.

What is proved and what is assumed. Given two idealisations, everything above is proved (prime
counting, Schwartz-Zippel, union bounds). They are:
  (I1) exp: in step 3 (and in step 2 for exp atoms nested in oracle arguments) the classes of
       exp atoms are treated as independent uniform elements of H. They are not: g^(u(x mod q))
       is a fixed function of the inputs' q-residues and satisfies exp(a)exp(b) = exp(a+b)
       exactly. It holds where the distinct arguments are jointly uniform mod q (attention: the
       scores Q_i.K_j of one row, each linear in its own key column, given Q_i != 0); in general
       it is the idealisation of Mirage's analysis. Argument collisions are not part of it:
       steps 1 and 2 charge them in full.
  (I2) oracles: the salted 64-bit hash (field.mix64) is treated as a random function.
For a program pair with neither exp nor oracles the bound is Schwartz-Zippel and prime counting
exactly. `assumptions` words what a bound rests on; `Verdict.heuristic` carries it.
Consequence (docs/verification.md, The bound): with q < 2^24 an attention row of 4096 keys
costs about 2^-7 per trial where the old charge claimed 2^-17, so full-size attention needs
about 9 trials for 2^-60 instead of 4.

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
from mlso_cli.verify.degree import ArgBound, Deg, Profile, analyse, cleared
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
    heuristic: str | None = None
    """What `bound` assumes beyond proof, in words, for a caller to print ("bound assumes ..."):
    the module docstring's idealisations (I1) and (I2) where the programs have exp or oracles;
    None when the bound is a theorem or no bound is claimed (a witness, an interface mismatch)."""


def _bad(height: float, log_min: float) -> float:
    return math.floor(height / log_min) / Q_ELIGIBLE if height > 0 else 0.0


HASH_SPACE = 2.0**64
"""Oracle hashes are 64-bit (field.mix64): sums of hashes and residues of hashes are charged
against this (module docstring, steps 2 and 3)."""


@dataclass(frozen=True)
class Identification:
    """Per-trial probabilities that the field identifies two formally different atoms of one
    kind (module docstring, step 2): `exp` for two exp atoms, `oracle` for two oracle atoms of
    one key, `element` for two elements (arguments, or max leaves) of oracle atoms; `constant`
    is charged once per trial: the prime divides the difference of the constant terms of two
    recorded argument ops (the only way two arguments that differ by a constant meet for
    every input)."""

    exp: float
    oracle: float
    element: float
    constant: float


def identification(pa: Profile, pb: Profile, fld: Field) -> Identification:
    """kappa_e, kappa_o, kappa_w and the constant-term prime term of the module docstring,
    innermost atoms first."""
    ex = pa.exp_args.merge(pb.exp_args)
    orc = pa.oracle_args.merge(pb.oracle_args)
    s = fld.q if (pa.has_exp or pb.has_exp) else fld.p
    sets = orc.sets
    # a max that is its leaf on some entries only gives one op several constant terms: then the
    # constant case is charged per pair like the rest
    odd_e = max(ex.odd_rest, ex.odd_constant) if sets else ex.odd_rest
    odd_w = max(orc.odd_rest, orc.odd_constant) if sets else orc.odd_rest
    ke = ko = kw = 0.0
    for _ in range(max(ex.depth, orc.depth) + 1):
        e = _element(ex, odd_e, fld.q, fld.q, LOG_Q_MIN, ke, ko, kw, sets) if ex.count else 0.0
        w = _element(orc, odd_w, s, fld.p, LOG_P_MIN, ke, ko, kw, sets) if orc.count else 0.0
        o = (2 * orc.arity - 1) * w + orc.arity / HASH_SPACE if orc.count else 0.0
        ke, ko, kw = min(1.0, e), min(1.0, o), min(1.0, w)
    constant = 0.0
    if not sets:
        constant = _op_pairs(ex.count) * _bad(ex.odd_constant, LOG_Q_MIN)
        constant += _op_pairs(orc.count) * _bad(orc.odd_constant, LOG_P_MIN)
    return Identification(ke, ko, kw, min(1.0, constant))


def _op_pairs(ops: int) -> int:
    return ops * (ops - 1) // 2


def _element(
    ab: ArgBound,
    odd: float,
    size: int,
    modulus: int,
    log_min: float,
    ke: float,
    ko: float,
    kw: float,
    sets: bool,
) -> float:
    """Pr[two formally different argument elements of this kind coincide at the sample], given
    the identification probabilities of the atoms nested inside them (one level down); `odd`
    bounds the odd part of the coefficient whose primes are charged per pair."""
    nested = designated_pairs(ab.an + ab.ad, 2 * ab.ne, 2 * ab.no, ke, ko)
    loose = 2 * ab.no * (modulus / HASH_SPACE + (kw if sets else 0.0))
    return _bad(odd, log_min) + ab.degree / size + nested + loose


def designated_pairs(degree: int, n_exp: int, n_orc: int, ke: float, ko: float) -> float:
    """Step 1's union: Pr[one of the atoms of a monomial (at most `degree` of them, and at
    most as many of a kind as there are) is identified with another of its kind], with n_exp
    exp atoms and n_orc oracle atoms to be identified with."""
    de, do = min(degree, n_exp), min(degree, n_orc)
    by_kind = de * max(n_exp - 1, 0) * ke + do * max(n_orc - 1, 0) * ko
    worst = max(max(n_exp - 1, 0) * ke, max(n_orc - 1, 0) * ko)
    return min(by_kind, degree * worst)


def collision_term(a: Deg, b: Deg, ident: Identification, fld: Field, sets: bool) -> float:
    """Pr[an atom of one monomial of the difference at an output entry is identified with
    another atom of its kind that the entry depends on], plus the oracle atoms that are not
    uniform values (module docstring, steps 1 and 3), for output records a (of A) and b (of B)."""
    degree = max(a.an + b.ad, b.an + a.ad)
    n_exp, n_orc = a.ne + b.ne, a.no + b.no
    loose = n_orc * ((fld.p + fld.q) / HASH_SPACE + (ident.element if sets else 0.0))
    return designated_pairs(degree, n_exp, n_orc, ident.exp, ident.oracle) + loose


def trial_bound(pa: Profile, pb: Profile, fld: Field) -> float:
    """Per-trial false-accept bound for programs with these degree profiles (module docstring):
    per output the smaller of the plain analysis's bound and, where it applies, the bound with
    1/(c + atom) as atoms (step 4); the largest over outputs."""
    rho = 2 * (pa.risk + pb.risk) / fld.q
    if rho >= 1:
        return 1.0
    per = _output_bounds(pa, pb, fld)
    if pa.inverted is not None or pb.inverted is not None:
        ia, ib = pa.inverted or pa, pb.inverted or pb
        args = ia.exp_args.signs | ia.oracle_args.signs | ib.exp_args.signs | ib.oracle_args.signs
        if one_form(args):
            alt = _output_bounds(ia, ib, fld)
            per = [
                min(x, y) if one_form(a.signs | b.signs) else x
                for x, y, a, b in zip(per, alt, ia.outputs, ib.outputs)
            ]
    return min(1.0, max(per, default=0.0) / (1 - rho))


def one_form(signs: frozenset[tuple[str, str]]) -> bool:
    """Every kind of atom in one form only (step 4)."""
    return len({key for key, _ in signs}) == len(signs)


def _output_bounds(pa: Profile, pb: Profile, fld: Field) -> list[float]:
    """eps of the module docstring for each output, before the denominator conditioning."""
    s = fld.q if (pa.has_exp or pb.has_exp) else fld.p
    ident = identification(pa, pb, fld)
    sets = pa.oracle_args.sets or pb.oracle_args.sets
    out = []
    for a, b in zip(pa.outputs, pb.outputs):
        deg, height = _cleared(a, b)
        kill = collision_term(a, b, ident, fld, sets) + ident.constant
        eps = deg / s + kill + _bad(height, LOG_P_MIN)
        if a.q and b.q:
            both = (deg / fld.p) * (deg / fld.q) + kill
            eps = min(eps, both + _bad(height, LOG_P_MIN) + _bad(height, LOG_Q_MIN))
        out.append(eps)
    return out


def assumptions(pa: Profile, pb: Profile) -> str | None:
    """The idealisations the bound for these programs rests on, in words (None: none, the
    bound is Schwartz-Zippel and prime counting only). Module docstring, "What is proved"."""
    parts = []
    if pa.has_exp or pb.has_exp:
        parts.append(
            "exp values of formally different arguments behave as independent uniform elements "
            "of the order-q subgroup (collisions of the arguments are charged in full)"
        )
    if pa.oracle_args.count or pb.oracle_args.count:
        parts.append("the salted 64-bit oracle hash (sqrt, erf, max, ...) is a random function")
    return "; ".join(parts) or None


def _cleared(a: Deg, b: Deg) -> tuple[int, float]:
    """Degree of N_A*D_B - N_B*D_A, and log2 of a bound on the odd part of its coefficients."""
    return max(a.n + b.d, b.n + a.d), cleared(a.hN, a.hD, b.hN, b.hD).odd


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
    assumes = assumptions(pa, pb)
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
                assumes,
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
                "agreed, but there is no useful bound: the per-trial bound is 1 (too high a "
                "degree, too many atoms or too large coefficients for these primes); "
                "not accepted",
                assumes,
            )
        bound *= eps
    return Verdict(
        True,
        bound,
        trials,
        f"{trials} trials agreed; per-trial bound {eps:.3g}, "
        f"false-accept bound {bound:.3g} <= {target:.3g}",
        assumes,
    )


UNBOUNDED_FIELDS = 3
"""Fields drawn by `unbounded` to see whether a check could reach any usable bound."""


def unbounded(a: KernelGraph, b: KernelGraph, *, seed: int = 0) -> str | None:
    """Why the field check cannot bound `a` against `b`, or None when it can: the per-trial
    bound is 1 at every one of a few drawn fields (too high a degree, too many atoms or too
    large coefficients for these primes). No program is evaluated: the degree analysis alone
    decides, so the select stage can leave such a program out before it chooses it, instead of
    the check before writing refusing it afterwards."""
    if interface_mismatch(a, b):
        return None  # not a question of the bound: the check itself will say what differs
    pa, pb = analyse(a), analyse(b)
    rng = np.random.default_rng(seed)
    for _ in range(UNBOUNDED_FIELDS):
        if trial_bound(pa, pb, Field.draw(rng)) < 1:
            return None
    return (
        "the field check cannot bound it: the per-trial bound is 1 (too high a degree, too many "
        "atoms or too large coefficients for 23-bit primes)"
    )
