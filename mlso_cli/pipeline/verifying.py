"""The check before writing: the verification library run on the model optimize is about to write.

Why: optimize used to check less than `mlso verify` does (the search's field check only, and
none at all for a region whose lifted program was packaged unverified), so it could write a
model that mlso's own check refuses. Here the packaged model goes through the very function
`mlso verify` runs (`verify/packaged.py::verify_models`), with a seed of its own (`verify_seed`,
never the search's), and:

- a region whose kernel fails any check (chain, field, float, lifting, emulator) is kept
  original, its `why` saying which check and why, and the model is packaged and checked again
  without it (a region's kernel is checked alone, so dropping one cannot break another; the
  loop ends after at most one round per region);
- a region whose field check agreed but reached no usable bound is kept original too: a bound
  that was never obtained is never written;
- a failure of the whole model (B's outputs in ONNX Runtime, the algebraic A-vs-B check) that
  no kernel explains keeps every region original.

The bound written (mlso.verification_bound) is the union of the field bounds obtained here, one
per distinct kernel (`VerifyOptions.distinct`: kernels with the same μGraph and fallback body,
a transformer's repeated layers, are one check, and their constants are still compared each
with A's). The binary is not recompiled (`trust_binary`): it was compiled from this very source
in this run; the source and plan are still regenerated and compared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import onnx

from mlso_cli.errors import EnvironmentProblem, MlsoError
from mlso_cli.package.chunks import Serialized, Tee, serialize
from mlso_cli.pipeline.artifacts import Choice
from mlso_cli.pipeline.verdicts import Verdict, VerdictCache, model_digest
from mlso_cli.verify.packaged import (
    Failure,
    VerifyOptions,
    VerifyReport,
    check_kernels,
    verify_models,
)

PackageFn = Callable[[Sequence[Choice]], onnx.ModelProto]
"""package(choices) -> the model with every packaged choice as an MlsoKernel node."""


@dataclass
class Original:
    """A, the original the check compares with, loaded only when a check runs.

    Why lazy: a rerun whose verdict is cached needs only A's name in the verdict cache's key,
    and for a model read from its bytes alone that name is known without loading A a second
    time (`verdicts.original_id`); on a 478 MB model the second load was a third of a rerun."""

    load: Callable[[], onnx.ModelProto]
    known_id: str | None = None
    """A's name for the verdict cache where it is known without loading A (else the
    `model_digest` of A once loaded)."""
    _model: onnx.ModelProto | None = field(default=None, init=False, repr=False)

    def model(self) -> onnx.ModelProto:
        if self._model is None:
            self._model = self.load()
        return self._model

    def id(self) -> str:
        return self.known_id or model_digest(self.model())


@dataclass(frozen=True)
class Checked:
    """The model that passed, the choices as they now stand, the bound, and the last report."""

    model: onnx.ModelProto
    choices: tuple[Choice, ...]
    bound: float
    report: VerifyReport | None
    """None when nothing was packaged (there was nothing to check) or the verdict was cached."""
    seed: int
    cached: bool = False
    """The verdict came from the verdict cache (pipeline/verdicts.py): the same original, the
    same bytes to write, the same seed and code were checked before; `report` is None then."""
    serialized: Serialized | None = field(default=None, repr=False)
    """`model` as it was hashed for the verdict cache, with its weights' bytes, so that writing
    it does not copy them out of the model again (package/chunks.py `Serialized.pieces_for`);
    kept for a cached verdict only (a check that runs would hold them through it)."""


CHECK_FLOAT_HEADROOM = 0.8
"""The fraction of the float check's limit the check before writing accepts (VerifyOptions.
float_headroom; `mlso verify` accepts the whole limit). Why not 1: the margin covers another
machine's BLAS and rounding, since both sides draw the same inputs from the kernel's hash. Why
not 0.5 (the twenty-second session's value): the limit is already twice the original region's
own error, and half of it refused kernels exactly as accurate as the original (Phi-3's attention
at real width: 0.00208 against the region's own 0.002), while a machine's summation order moves
an error by far less than a fifth."""


def verify_seed(seed: int, fresh: bool) -> int:
    """The seed of the check before writing: fresh from the OS (the default of `mlso optimize`,
    as `mlso verify`'s), or, when the user fixed `--seed`, a stream of its own derived from it,
    so that runs with one --seed write the same bytes, and never the search's primes."""
    if fresh:
        import secrets

        return secrets.randbits(63)
    import numpy as np

    return int(np.random.SeedSequence([seed, 0x7E51F1]).generate_state(1, np.uint64)[0] >> 1)


def check_before_writing(
    original: onnx.ModelProto | Original,
    choices: Sequence[Choice],
    package: PackageFn,
    seed: int,
    *,
    source: str = "the input model",
    verdicts: VerdictCache | None = None,
    fresh_seed: bool = False,
    tee: Tee | None = None,
) -> Checked:
    """Package `choices`, verify the result against `original` (A, with its weights, or an
    `Original` that loads it when a check runs) and drop refused regions until what is left
    passes (module docstring). With `verdicts`, a check of these very bytes done before is
    reused (pipeline/verdicts.py), and a new one is stored; `fresh_seed`: `seed` was drawn for
    this run, so an earlier check under another seed counts. `tee` gets the bytes of the model
    packaged first as they are hashed for the verdict cache (package/prefile.py writes them
    ahead); it is told to discard them when that model is not the one returned."""
    if not isinstance(original, Original):
        original = Original(lambda a=original: a)
    choices = tuple(choices)
    model = package(choices)
    if not any(c.packaged for c in choices):
        return Checked(model, choices, 0.0, None, seed)
    if verdicts is None:
        return _check(original.model(), choices, model, package, seed, source)
    # each model is serialized and hashed once: a real-width model is gigabytes
    named = original.id()  # first: A may be loaded and hashed for it
    held = [serialize(model, tee=tee)]
    packed = held[0].sha256
    key = verdicts.key(named, packed, None if fresh_seed else seed)
    hit = _reused(verdicts.get(key), choices, held, package)
    if tee is not None and (hit is None or hit.model is not model):
        tee.discard()
    if hit is not None:
        return hit
    held.clear()  # not held through the check: a copy of every weight byte
    checked = _check(original.model(), choices, model, package, seed, source)
    final = packed if checked.model is model else model_digest(checked.model)
    verdicts.put(key, Verdict.of(checked.choices, checked.bound, final, seed))
    return checked


def _reused(
    verdict: Verdict | None,
    choices: tuple[Choice, ...],
    held: list[Serialized],
    package: PackageFn,
) -> Checked | None:
    """The stored verdict applied, when it is for these choices and the model it passed is the
    one packaged again now (byte for byte); else None: the check runs. Its seed is the one the
    stored check ran with. `held`: the packaged model, serialized (emptied here when another
    model is packaged, so that the two are not held at once)."""
    final = verdict.applied(choices) if verdict is not None else None
    if final is None:
        return None
    if all(a.packaged == b.packaged for a, b in zip(final, choices)):
        serialized = held[0]
    else:
        held.clear()
        serialized = serialize(package(final))
    if serialized.sha256 != verdict.model_sha256:
        return None
    return Checked(
        serialized.model,
        final,
        verdict.bound,
        None,
        verdict.seed,
        cached=True,
        serialized=serialized,
    )


def _check(
    original: onnx.ModelProto,
    choices: tuple[Choice, ...],
    model: onnx.ModelProto,
    package: PackageFn,
    seed: int,
    source: str,
) -> Checked:
    """The check itself: verify, drop refused regions, package again, until it passes."""
    options = VerifyOptions(
        seed=seed, trust_binary=True, distinct=True, float_headroom=CHECK_FLOAT_HEADROOM
    )
    for round_ in range(len(choices) + 1):
        if round_:
            model = package(choices)
        if not any(c.packaged for c in choices):
            return Checked(model, choices, 0.0, None, seed)
        try:
            report = verify_models(
                original, model, options, source_a=source, source_b="the model to write"
            )
        except EnvironmentProblem:
            raise
        except MlsoError as exc:
            # the whole model cannot be compared (ONNX Runtime cannot load the original, or no
            # output is finite at any scale): verify could not compare it either, whatever is
            # written, so the per-kernel checks decide alone
            report = _kernels_only(original, model, options, exc.what)
        except Exception as exc:  # noqa: BLE001 - the fp64 reference evaluator refused A
            why = f"the fp64 reference of the original failed: {type(exc).__name__}: {exc}"
            report = _kernels_only(original, model, options, why[:300])
        if report.passed:
            bound = report.summary.get("false_accept_bound") or 0.0
            return Checked(model, _with_bounds(choices, report), float(bound), report, seed)
        refused = {v.outputs: v.failure for v in report.kernels if v.failure is not None}
        if refused:
            choices = tuple(_kept(c, refused.get(_outputs(c))) for c in choices)
            continue
        why = report.failure.what if report.failure else "the whole model failed verification"
        choices = tuple(_kept(c, why) if c.packaged else c for c in choices)
    raise AssertionError("unreachable: every round keeps at least one more region original")


def _kernels_only(
    original: onnx.ModelProto, model: onnx.ModelProto, options: VerifyOptions, why: str
) -> VerifyReport:
    """The per-kernel checks alone, as a report, when the whole model cannot be compared."""
    verdicts = check_kernels(original, model, options)
    bad = next((v for v in verdicts if v.failure is not None), None)
    usable = list({id(v.field): v.bound for v in verdicts if v.bound is not None}.values())
    summary = {
        "type": "summary",
        "pass": bad is None,
        "false_accept_bound": min(1.0, sum(usable)) if usable else None,
        "whole_model": f"not compared: {why}",
    }
    failure = None if bad is None else Failure(f"mlso kernel '{bad.node}' {bad.failure}")
    return VerifyReport(tuple(verdicts), (), (), (), (), summary, failure)


def _outputs(c: Choice) -> tuple[str, ...]:
    """The tensors a packaged choice's MlsoKernel node produces (its program's outputs): how a
    kernel of the report is matched to its region, whatever the node is named."""
    return tuple(c.candidate.graph.output_names)


def _kept(c: Choice, reason: str | None) -> Choice:
    if reason is None or not c.packaged:
        return c
    return replace(
        c,
        packaged=False,
        why=f"kept original: verification before writing refused its program: {reason}",
        bound=None,
    )


def _with_bounds(choices: tuple[Choice, ...], report: VerifyReport) -> tuple[Choice, ...]:
    by_outputs = {v.outputs: v for v in report.kernels}
    out = []
    for c in choices:
        v = by_outputs.get(_outputs(c)) if c.packaged else None
        if v is None:
            out.append(c)
            continue
        out.append(replace(c, bound=v.bound, checks=_summary(v)))
    return tuple(out)


def _summary(v) -> str:
    """One line of what ran for the optimize table and --json."""
    parts = []
    if v.bound is not None:
        parts.append(f"field bound {v.bound:.2e}")
    for name, outcome in (("lifting", v.lifting), ("emulator", v.emulator)):
        parts.append(f"{name} {outcome.status}")
    return ", ".join(parts)
