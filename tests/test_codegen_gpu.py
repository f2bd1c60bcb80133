"""Generated kernels on a real GPU (marker `gpu`; tests/conftest.py skips them without one).

Every output is poisoned with NaN before the launch, so an element no kernel writes fails.
Compared with the float64 reference (mlso_cli.verify.interpreter, or the numpy reference in
test_codegen_graphs) by norm-wise relative error: fp32 1e-5, fp16 2e-3, bf16 1e-2, at unit scale
and with softmax logits of about +-100. Covers the codegen test graphs, every full-size benchmark
fixture (tests/fixtures/ugraphs.FIXTURES) and the lifted small models.

    make test-gpu        # or: .venv/bin/python -m pytest -q -m gpu tests/test_codegen_gpu.py
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from pathlib import Path

import numpy as np
import pytest

from tests import test_codegen_graphs as T

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    """Compile every program these tests run, in parallel (nvcc is single-threaded and the GPU
    machine's time is the scarce resource); later compile_program calls hit the cache."""
    from mlso_cli.codegen import compile_program

    graphs = [f() for f in T.GRAPHS.values()] + [f() for f in _fixtures().values()]
    with cf.ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as ex:
        list(ex.map(lambda kg: compile_program(kg, constants=T.constants(kg)), graphs))


def _run(kg, inputs: list[np.ndarray]) -> list[np.ndarray]:
    from mlso_cli.codegen import compile_program
    from mlso_cli.runtime.launcher import Program

    cp = compile_program(kg, constants=T.constants(kg))  # a causal mask: computed, not read
    with Program(cp.fatbin, cp.plan) as prog:
        return prog.run(inputs, poison_outputs=True)


def _compare(name: str, kg, inputs: list[np.ndarray]) -> list[float]:
    want = T.reference(kg, inputs)
    got = _run(kg, inputs)
    tol = T.TOLERANCE[T.out_dtype(kg)]
    fmax = float(np.finfo(np.float32).max)
    errs = []
    for k, (g, w) in enumerate(zip(got, want)):
        g = np.asarray(g, dtype=np.float64)
        ok = np.abs(w) <= fmax
        assert np.all(np.isinf(g[~ok]) & (np.sign(g[~ok]) == np.sign(w[~ok]))), (
            f"{name} output {k}: overflow"
        )
        assert not np.isnan(g[ok]).any(), (
            f"{name} output {k}: {int(np.isnan(g[ok]).sum())} NaN (unwritten?)"
        )
        err = T.rel_error(g[ok], w[ok])
        errs.append(err)
        assert err <= tol, f"{name} output {k}: relative error {err:.2e} > {tol:.0e}"
    return errs


# ---- codegen test graphs --------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(T.GRAPHS))
def test_graph_on_gpu(name):
    kg = T.GRAPHS[name]()
    _compare(name, kg, T.make_inputs(kg, name))


@pytest.mark.parametrize("name", list(T.LOGIT_SCALE))
def test_graph_on_gpu_large_logits(name):
    kg = T.GRAPHS[name]()
    _compare(name, kg, T.make_inputs(kg, name, large=True))


# ---- full-size benchmark fixtures -----------------------------------------------------------------


def _fixtures() -> dict:
    try:
        from tests.fixtures import ugraphs
    except ImportError:
        return {}
    return ugraphs.FIXTURES


def _rms(x: np.ndarray, axis: int) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=axis, keepdims=True) + 1e-6)


def _logits(family: str, x: dict[str, np.ndarray]) -> np.ndarray | None:
    """The softmax logits of an attention fixture (up to a constant factor), in float64."""
    f = {k: v.astype(np.float64) for k, v in x.items()}
    if family == "gqa":
        return f["Q"] @ f["K"]
    if family == "qknorm_gqa":
        return (_rms(f["Q"], 2) * f["gamma_q"]) @ f["K"]
    if family == "qknorm_real":
        return (_rms(f["Q"], 2) * f["gamma_q"]) @ (_rms(f["K"], 1) * f["gamma_k"][:, None])
    if family == "mla":
        return f["Q_nope"] @ np.swapaxes(f["C"], 1, 2) + f["Q_pe"] @ np.swapaxes(f["K_pe"], 1, 2)
    return None


# the input(s) the logits are linear in
LOGIT_INPUTS = {
    "gqa": ("Q",),
    "qknorm_gqa": ("gamma_q",),
    "qknorm_real": ("gamma_q",),
    "mla": ("Q_nope", "Q_pe"),
}


def _fixture_inputs(key: str, kg, large: bool) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    ins = {}
    for n, nm in zip(kg.inputs, kg.input_names):
        x = rng.standard_normal(n.shape)
        if nm.startswith(("gamma", "bn_scale", "in_scale")) or nm in ("bn_var", "alpha"):
            x = np.abs(x) * 0.5 + 0.75  # norm scales and variances: positive, near 1
        ins[nm] = x.astype(T.np_dtype(n.dtype))
    family = key.rsplit("_bs", 1)[0]
    if large and family in LOGIT_INPUTS:
        peak = np.abs(_logits(family, ins)).max()
        for nm in LOGIT_INPUTS[family]:
            ins[nm] = (ins[nm].astype(np.float64) * (100.0 / peak)).astype(ins[nm].dtype)
    return [ins[nm] for nm in kg.input_names]


@pytest.mark.parametrize("key", sorted(_fixtures()))
def test_fixture_on_gpu(key):
    kg = _fixtures()[key]()
    _compare(key, kg, _fixture_inputs(key, kg, large=False))


@pytest.mark.parametrize(
    "key", sorted(k for k in _fixtures() if k.rsplit("_bs", 1)[0] in LOGIT_INPUTS)
)
def test_fixture_on_gpu_large_logits(key):
    kg = _fixtures()[key]()
    _compare(key, kg, _fixture_inputs(key, kg, large=True))


# ---- lifted models ----------------------------------------------------------------------------------


def test_lifted_models_on_gpu():
    try:
        from mlso_cli.frontend.lift import lift_model
    except ImportError:
        pytest.skip("mlso_cli.frontend.lift is not there yet")
    paths = sorted((ROOT / "models" / "small").glob("*.onnx"))
    for p in [*paths, ROOT / "models" / "transformer_tiny.onnx"]:
        shapes = {"hidden": (1, 16, 64)} if "transformer" in p.name else None
        for i, kg in enumerate(lift_model(str(p), shapes)):
            name = f"{p.stem}_{i}"
            ins = [
                np.abs(x) + 0.5 if "var" in nm else x
                for x, nm in zip(T.make_inputs(kg, name), kg.input_names)
            ]
            _compare(name, kg, ins)
