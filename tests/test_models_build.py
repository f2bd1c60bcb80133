"""CPU tests for models/: every spec's small fp32 graph is valid ONNX, runs in ONNX Runtime
and matches its float64 reference; the committed small files equal a fresh build; and the
committed torch-exported transformer loads and runs.

Why: the benchmark graphs are the inputs to everything downstream. A wrong graph (or one that
silently drifts from the committed copy) would make every later measurement meaningless.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import pytest  # noqa: E402

from models import build_models  # noqa: E402

SPEC_NAMES = sorted(build_models.SPECS)
SMALL_DIR = ROOT / "models" / "small"
TRANSFORMER = ROOT / "models" / "transformer_tiny.onnx"


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out = np.asarray(out, dtype=np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_small_model_matches_reference(name: str) -> None:
    spec = build_models.SPECS[name]
    model = spec.build(build_models.SMALL_BS, np.float32, small=True)
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version <= 11
    assert all(int(np.prod(t.dims)) <= 4096 for t in model.graph.initializer)
    inputs = build_models.random_inputs(model, seed=1)
    assert inputs and all(v.dtype == np.float32 for v in inputs.values())
    (out,) = _session(model).run(None, inputs)
    ref = spec.reference(inputs)["O"]
    assert out.shape == ref.shape
    assert np.isfinite(ref).all()
    assert _rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_reference_is_not_trivially_satisfied(name: str) -> None:
    """A perturbed input must move the output: guards against a reference that ignores one."""
    spec = build_models.SPECS[name]
    model = spec.build(build_models.SMALL_BS, np.float32, small=True)
    inputs = build_models.random_inputs(model, seed=2)
    base = spec.reference(inputs)["O"]
    for key in inputs:
        bumped = dict(inputs)
        bumped[key] = inputs[key] * np.float32(1.5) + np.float32(0.25)
        assert _rel_err(spec.reference(bumped)["O"], base) > 1e-6, key


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_committed_small_file_is_a_fresh_build(name: str) -> None:
    path = SMALL_DIR / f"{name}.onnx"
    assert path.is_file(), f"{path} missing: run python -m models.build_models --small-only"
    model = build_models.SPECS[name].build(build_models.SMALL_BS, "float32", small=True)
    assert path.read_bytes() == model.SerializeToString()


def test_no_stray_small_files() -> None:
    assert {p.stem for p in SMALL_DIR.glob("*.onnx")} == set(SPEC_NAMES)


def test_builds_are_deterministic() -> None:
    spec = build_models.SPECS["ntrans"]
    a = spec.build(8, "float16").SerializeToString()
    b = spec.build(8, "float16").SerializeToString()
    assert a == b


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_full_size_fp16_graph_is_valid(name: str) -> None:
    """Full-size fp16 graphs are only checked here (running them is for the CLI's --verify)."""
    spec = build_models.SPECS[name]
    for bs in spec.batch_sizes:
        model = spec.build(bs, "float16")
        onnx.checker.check_model(model, full_check=True)
        assert model.ir_version <= 11
        elem = onnx.TensorProto.FLOAT16
        assert all(vi.type.tensor_type.elem_type == elem for vi in model.graph.input)
        assert sum(len(t.raw_data) for t in model.graph.initializer) < 64 * 1024


def test_benchmark_shapes() -> None:
    """The shapes BENCHMARKS.md fixes, at bs 8 (g = 16)."""
    shapes = {n: build_models.SPECS[n].input_shapes(8) for n in ("gqa", "qknorm_real")}
    for s in shapes.values():
        assert s == {"Q": (16, 256, 64), "K": (16, 64, 4096), "V": (16, 4096, 64)}
    assert build_models.SPECS["rmsnorm_linear"].input_shapes(8) == {
        "X": (16, 4096),
        "W": (4096, 6144),
    }
    assert build_models.SPECS["lora"].input_shapes(1) == {
        "X": (16, 256),
        "W": (256, 4096),
        "A": (256, 16),
        "B": (16, 4096),
    }
    assert build_models.SPECS["gated_mlp"].input_shapes(1) == {
        "X": (8, 4096),
        "W1": (4096, 4096),
        "W2": (4096, 4096),
    }
    assert build_models.SPECS["ntrans"].input_shapes(16) == {
        "H": (16, 4096),
        "X": (16, 4096),
        "alpha": (16, 4096),
    }


def test_random_inputs_names_symbolic_dims() -> None:
    model = onnx.load(str(TRANSFORMER))
    with pytest.raises(ValueError, match="hidden"):
        build_models.random_inputs(model, seed=0)


def test_transformer_tiny_runs() -> None:
    assert TRANSFORMER.stat().st_size < 5 * 1024 * 1024
    model = onnx.load(str(TRANSFORMER))
    assert model.ir_version <= 11
    onnx.checker.check_model(model, full_check=True)
    (inp,) = model.graph.input
    dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
    assert inp.name == "hidden" and isinstance(dims[0], str) and isinstance(dims[1], str)
    assert dims[2] == 64
    inputs = build_models.random_inputs(model, seed=0, dims={dims[0]: 1, dims[1]: 16})
    (out,) = _session(model).run(None, inputs)
    assert out.shape == (1, 16, 64)
    assert np.isfinite(out).all()
    # Causality: changing the last token must not change earlier positions.
    bumped = {"hidden": inputs["hidden"].copy()}
    bumped["hidden"][:, -1] += 1.0
    (out2,) = _session(model).run(None, bumped)
    np.testing.assert_allclose(out2[:, :-1], out[:, :-1], rtol=1e-5, atol=1e-5)
    assert not np.allclose(out2[:, -1], out[:, -1])
