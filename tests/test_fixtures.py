"""The hand-written fused fixtures against lifting, the interpreter and the finite-field checker.

Why: the fixtures are the known-good fusions every other component is tested with, so they must
be right in every sense the project checks: the same signature and constants as the lifted
region, accepted by the field check with a bound <= 2^-60, within DESIGN.md's fp32 limit of the
fp64 reference at unit and adversarial scales, and valid for both target archs at full shapes.
Their mutants are the other half: each one must be visibly wrong in float64 first (so that a
rejection means something) and then be rejected by the field check.

CPU only, small shapes; full shapes get only the spec checker and the signature (the
interpreter at Mirage's shapes is far too slow for CI).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from mlso_cli.codegen.budget import check
from mlso_cli.frontend.lift import lift_model
from mlso_cli.ir import KernelGraph, Op
from mlso_cli.verify.equivalence import check_equivalent
from mlso_cli.verify.interpreter import run
from models.build_models import SPECS
from tests.fixtures.mutations import KINDS, MUTATIONS, SUBTLE, Mutation
from tests.fixtures.ugraphs import FIXTURES, MODELS, SMALL_FIXTURES, fixture

ROOT = Path(__file__).resolve().parent.parent
SMALL = ROOT / "models" / "small"
ARCHS = ("sm_90", "sm_80")
FP32_LIMIT = 1e-5
"""DESIGN.md: fp32 storage, fp32 accumulation, norm-wise relative error <= 1e-5."""
MUTANT_GAP = 1e-3
"""A mutant must be at least this far from the reference in float64 to count as wrong."""
BOUND = 2.0**-60

Feeds = dict[str, np.ndarray]


# ---- helpers ----------------------------------------------------------------------------------


@cache
def lifted_small(name: str) -> KernelGraph:
    (kg,) = lift_model(str(SMALL / f"{name}.onnx"))
    return kg


@cache
def small_fixture(name: str) -> KernelGraph:
    return SMALL_FIXTURES[name]()


@cache
def initializers(name: str) -> dict[str, np.ndarray]:
    """Norm parameters live in the ONNX file; the lifted region takes them as inputs."""
    model = onnx.load(str(SMALL / f"{name}.onnx"))
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def signature(kg: KernelGraph) -> tuple:
    return (
        tuple((n, i.shape, i.dtype) for n, i in zip(kg.input_names, kg.inputs)),
        tuple((n, o.shape, o.dtype) for n, o in zip(kg.output_names, kg.outputs)),
    )


def unit_feeds(name: str, seed: int = 0) -> Feeds:
    """Standard-normal activations; norm parameters as the model stores them (the reference
    regenerates them from their names, so they must not be random)."""
    kg = lifted_small(name)
    rng = np.random.default_rng(seed)
    inits = initializers(name)
    return {
        n: inits[n] if n in inits else rng.standard_normal(i.shape).astype(np.float32)
        for n, i in zip(kg.input_names, kg.inputs)
    }


def _scaled(x: Feeds, factors: dict[str, float]) -> Feeds:
    return {
        k: (v * np.float32(factors[k])).astype(np.float32) if k in factors else v
        for k, v in x.items()
    }


def _logits_to(
    x: Feeds, logits: np.ndarray, powers: dict[str, float], target: float = 100.0
) -> Feeds:
    """Scale input k by c**powers[k], where c = target / max|logit|: the powers of the inputs
    on each side of the logits' product sum to one, so the largest |logit| becomes `target`."""
    c = target / float(np.abs(logits).max())
    return _scaled(x, {k: c**p for k, p in powers.items()})


def _rms(x: np.ndarray, axis: int = -1) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=axis, keepdims=True))


def adversarial(name: str, x: Feeds) -> Feeds:
    """DESIGN.md's adversarial scales: softmax logits of +-100, norm inputs x1e3.

    qknorm_real normalises both Q and K, so its logits stay below ~d*gamma^2 whatever the
    inputs; it gets the norm-input scale only.
    """
    x64 = {k: v.astype(np.float64) for k, v in x.items()}
    if name == "gqa":
        return _logits_to(x, x64["Q"] @ x64["K"], {"Q": 0.5, "K": 0.5})
    if name == "qknorm_gqa":
        y = _scaled(x, {"Q": 1e3, "V": 1e3})
        return _logits_to(y, _rms(x64["Q"]) * x64["gamma_q"] @ x64["K"], {"K": 1.0})
    if name == "qknorm_real":
        return _scaled(x, {"Q": 1e3, "K": 1e3})
    if name == "mla":
        s = x64["Q_nope"] @ np.swapaxes(x64["C"], 1, 2) + x64["Q_pe"] @ np.swapaxes(
            x64["K_pe"], 1, 2
        )
        scale = 1.0 / np.sqrt(3 * x64["K_pe"].shape[-1])
        return _logits_to(x, s * scale, {"Q_nope": 1.0, "Q_pe": 1.0})
    if name in ("rmsnorm_linear", "layernorm_linear", "groupnorm_linear", "batchnorm_linear"):
        return _scaled(x, {"X": 1e3})
    if name == "ntrans":
        return _scaled(x, {"H": 1e3, "X": 1e3})
    if name in ("gated_mlp", "lora"):
        return _scaled(x, {"X": 30.0})  # SiLU far into both tails; LoRA: just large
    raise KeyError(name)


def reference(name: str, x: Feeds) -> np.ndarray:
    with np.errstate(
        over="ignore"
    ):  # gated_mlp's reference sigmoid saturates at x30: exp(-a) = inf is right
        ref = SPECS[name].reference(x)["O"]
    assert np.all(np.isfinite(ref)), f"{name}: the fp64 reference must stay finite"
    return ref


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref))


def interpret(kg: KernelGraph, x: Feeds, mode: str) -> np.ndarray:
    (out,) = run(kg, [x[n] for n in kg.input_names], mode)
    return out


def _mutants() -> list[tuple[str, Mutation]]:
    return [(name, m) for name in MODELS for m in MUTATIONS[name]]


# ---- the fixtures themselves ------------------------------------------------------------------


def test_every_benchmark_model_has_fixtures_and_mutations():
    assert set(MODELS) == set(SPECS)
    assert set(SMALL_FIXTURES) == set(SPECS)
    assert set(FIXTURES) == {f"{n}_bs{bs}" for n, s in SPECS.items() for bs in s.batch_sizes}
    for name in MODELS:
        assert len(MUTATIONS[name]) >= 3, name
        assert all(m.kind in KINDS for m in MUTATIONS[name])
    assert {m.kind for _, m in _mutants()} == set(KINDS)


@pytest.mark.parametrize("name", MODELS)
def test_small_fixture_has_the_lifted_signature_and_passes_spec(name):
    kg = small_fixture(name)
    for arch in ARCHS:
        check(kg, arch=arch)
    assert signature(kg) == signature(lifted_small(name))
    assert any(n.op is Op.GRAPH_DEF for n in kg.nodes()), "a fixture is a fused program"


@pytest.mark.parametrize("key", sorted(FIXTURES))
def test_full_fixture_passes_spec_and_has_the_lifted_signature(key, tmp_path):
    name, bs = key.rsplit("_bs", 1)
    kg = FIXTURES[key]()
    for arch in ARCHS:
        check(kg, arch=arch)
    path = ROOT / "models" / "bench" / f"{key}.onnx"
    if not path.exists():  # models/bench is git-ignored: build the row's model in memory
        path = tmp_path / f"{key}.onnx"
        onnx.save(SPECS[name].build(int(bs), "float16"), str(path))
    (lifted,) = lift_model(str(path))
    assert signature(kg) == signature(lifted)
    for gd in (n for n in kg.nodes() if n.op is Op.GRAPH_DEF):
        blocks = gd.arg.block_count()
        assert blocks <= 4 * 132, f"{key}: {blocks} blocks is more than four waves"
        if name != "ntrans":  # one row per block: bs blocks is all the parallelism there is
            assert blocks >= 64, f"{key}: {blocks} blocks leave most of 132 SMs idle"


def test_fixture_small_rejects_other_batch_sizes():
    with pytest.raises(ValueError):
        fixture("gqa", True, 3)


# ---- the field check ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_small_fixture_is_equivalent_to_its_lifted_region(name):
    verdict = check_equivalent(lifted_small(name), small_fixture(name), seed=1)
    assert verdict.equivalent, f"{name}: {verdict.detail}"
    assert verdict.bound <= BOUND, f"{name}: bound {verdict.bound}"


# ---- floats ------------------------------------------------------------------------------------

SCALES: dict[str, Callable[[str, Feeds], Feeds]] = {
    "unit": lambda name, x: x,
    "adversarial": adversarial,
}


@pytest.mark.parametrize("scale", sorted(SCALES))
@pytest.mark.parametrize("mode", ["float64", "float32"])
@pytest.mark.parametrize("name", MODELS)
def test_small_fixture_matches_fp64_reference(name, mode, scale):
    x = SCALES[scale](name, unit_feeds(name))
    ref = reference(name, x)
    err = rel_err(interpret(small_fixture(name), x, mode), ref)
    assert err <= FP32_LIMIT, f"{name} {mode} {scale}: relative error {err:.3g}"


# ---- mutants -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "mutation"), _mutants(), ids=[f"{n}-{m.name}" for n, m in _mutants()]
)
def test_mutant_is_wrong_in_float64_and_rejected_by_the_field_check(name, mutation):
    mutant = mutation(small_fixture(name))
    for arch in ARCHS:
        check(mutant, arch=arch)
    assert signature(mutant) == signature(small_fixture(name))
    x = unit_feeds(name, seed=2)
    err = rel_err(interpret(mutant, x, "float64"), reference(name, x))
    assert err > MUTANT_GAP, f"{name}/{mutation.name}: float64 error {err:.3g} shows no bug"
    verdict = check_equivalent(lifted_small(name), mutant, seed=3)
    assert not verdict.equivalent, f"{name}/{mutation.name} was accepted: {verdict.detail}"


def _subtle() -> list[tuple[str, Mutation]]:
    return [(name, m) for name, ms in SUBTLE.items() for m in ms]


@pytest.mark.parametrize(
    ("name", "mutation"), _subtle(), ids=[f"{n}-{m.name}" for n, m in _subtle()]
)
def test_float_invisible_mutant_is_still_rejected_by_the_field_check(name, mutation):
    """An eps dropped or rounded differently is below every float limit at unit scale; only the
    exact algebra can tell. This is why constants must map to the field by one exact rule."""
    mutant = mutation(small_fixture(name))
    for arch in ARCHS:
        check(mutant, arch=arch)
    x = unit_feeds(name, seed=2)
    err = rel_err(interpret(mutant, x, "float64"), reference(name, x))
    assert err < FP32_LIMIT, (
        f"{name}/{mutation.name}: float64 error {err:.3g} (meant to be invisible)"
    )
    verdict = check_equivalent(lifted_small(name), mutant, seed=4)
    assert not verdict.equivalent, f"{name}/{mutation.name} was accepted: {verdict.detail}"
