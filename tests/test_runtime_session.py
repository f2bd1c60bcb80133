"""The session helper registers the library only where it can run; otherwise the fallback runs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from mlso_cli.errors import InputError
from mlso_cli.package import package_model, standard_metadata
from mlso_cli.runtime import GpuInfo, check_model, gpu_info, library_decision, library_path, session
from mlso_cli.runtime import session_helper as session_mod
from mlso_cli.runtime.gpu import plan_fits, target_runs_on
from tests.test_package_support import attention_mlp, dummy_plan, run_cpu, two_regions, use_cache

META = standard_metadata(targets=["sm_80", "sm_90a"], seed=0, verification_bound="1e-3")
X = np.random.default_rng(3).standard_normal((2, 8, 16)).astype(np.float32)
H200 = GpuInfo(index=0, name="NVIDIA H200", compute_capability=(9, 0), max_smem_optin=232448)


def quiet() -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return so


@pytest.fixture
def packaged() -> onnx.ModelProto:
    m = attention_mlp()
    return package_model(m, two_regions(m), META)


@pytest.fixture
def no_library(monkeypatch):
    def refuse():
        raise AssertionError("the library must not be registered here")

    monkeypatch.setattr(session_mod, "library_path", refuse)


@pytest.mark.skipif(gpu_info() is not None, reason="checks the no-GPU path")
@pytest.mark.parametrize(
    "providers", [None, ["CPUExecutionProvider"], ["CUDAExecutionProvider", "CPUExecutionProvider"]]
)
def test_without_a_gpu_the_fallback_runs_and_the_library_is_not_registered(
    packaged, no_library, providers
):
    sess = session(packaged.SerializeToString(), providers=providers, sess_options=quiet())
    assert sess.get_providers() == ["CPUExecutionProvider"]
    expected = run_cpu(attention_mlp(), {"x": X})[0]
    assert np.array_equal(sess.run(None, {"x": X})[0], expected)


def test_a_path_and_a_cpu_session(packaged, no_library, tmp_path):
    path = tmp_path / "fast.onnx"
    onnx.save(packaged, str(path))
    sess = session(path, providers=["CPUExecutionProvider"], sess_options=quiet())
    assert np.array_equal(sess.run(None, {"x": X})[0], run_cpu(attention_mlp(), {"x": X})[0])


def test_a_tampered_model_is_refused_even_on_cpu(packaged, no_library):
    next(
        t for t in packaged.graph.initializer if t.name.startswith("mlso_bin_")
    ).raw_data = b"evil!!!!"
    with pytest.raises(InputError, match="tampered"):
        session(packaged.SerializeToString(), providers=["CPUExecutionProvider"])


def test_registering_the_library_in_a_cpu_session_reaches_kernel_lookup(monkeypatch, packaged):
    """With the library registered, ORT resolves the schema and every type (the packager's
    value_info), then finds no CPU kernel: the documented NOT_IMPLEMENTED, which is why the
    helper never registers it for CPU sessions."""
    use_cache(monkeypatch)
    so = quiet()
    so.register_custom_ops_library(str(library_path()))
    with pytest.raises(Exception, match="NOT_IMPLEMENTED") as info:
        ort.InferenceSession(packaged.SerializeToString(), so, providers=["CPUExecutionProvider"])
    assert "type inference failed" not in str(info.value)
    assert "MlsoKernel" in str(info.value)


# ---- the decision, with a GPU described rather than present ----------------------------------


@pytest.fixture
def nodes(packaged):
    return check_model(packaged)


def decide(monkeypatch, nodes, gpu, providers=("CUDAExecutionProvider", "CPUExecutionProvider")):
    monkeypatch.setattr(session_mod, "gpu_info", lambda index=0: gpu)
    return library_decision(nodes, list(providers))


def test_decision_registers_on_a_fitting_gpu(monkeypatch, nodes):
    d = decide(monkeypatch, nodes, H200)
    assert d.register and "H200" in d.reason
    a100 = GpuInfo(0, "A100", (8, 0), 166912)
    assert decide(monkeypatch, nodes, a100).register
    ada = GpuInfo(0, "L40S", (8, 9), 101376)  # sm_80 SASS runs on 8.9
    assert decide(monkeypatch, nodes, ada).register


def test_decision_falls_back_when_it_cannot_run(monkeypatch, nodes):
    assert not decide(monkeypatch, nodes, None).register
    assert "no GPU" in decide(monkeypatch, nodes, None).reason
    turing = GpuInfo(0, "T4", (7, 5), 65536)
    d = decide(monkeypatch, nodes, turing)
    assert not d.register and "cannot run on sm_75" in d.reason
    blackwell = GpuInfo(0, "B200", (10, 0), 232448)  # no PTX in the plan, sm_90a is 9.0 only
    assert not decide(monkeypatch, nodes, blackwell).register
    assert not decide(monkeypatch, nodes, H200, providers=["CPUExecutionProvider"]).register
    assert not library_decision([], ["CUDAExecutionProvider"]).register


def test_decision_checks_shared_memory(monkeypatch, nodes):
    big = nodes[0].plan | {"smem_max": 200 * 1024}
    assert plan_fits(big, H200) is None
    a100 = GpuInfo(0, "A100", (8, 0), 166912)
    assert "shared memory" in plan_fits(big, a100)


def test_device_id_comes_from_provider_options(monkeypatch, nodes):
    seen = []

    def fake(index=0):
        seen.append(index)
        return H200

    monkeypatch.setattr(session_mod, "gpu_info", fake)
    library_decision(nodes, [("CUDAExecutionProvider", {"device_id": 1})])
    library_decision(nodes, ["CUDAExecutionProvider"], [{"device_id": "2"}])
    assert seen == [1, 2]


@pytest.mark.parametrize(
    ("target", "cc", "runs"),
    [
        ("sm_80", (8, 0), True),
        ("sm_80", (8, 6), True),
        ("sm_80", (9, 0), False),
        ("sm_90a", (9, 0), True),
        ("sm_90a", (9, 1), False),
        ("sm_90", (9, 0), True),
        ("compute_80", (9, 0), True),
        ("compute_80", (10, 0), True),
        ("compute_90a", (10, 0), False),
        ("compute_80", (7, 5), False),
        ("sm_100a", (10, 0), True),
    ],
)
def test_target_compatibility(target, cc, runs):
    assert target_runs_on(target, cc) is runs


def test_plan_targets_are_checked_before_smem():
    plan = dummy_plan([("float32", [4])], [("float32", [4])]) | {"targets": ["sm_90a"]}
    assert "sm_90a" in plan_fits(plan, GpuInfo(0, "A100", (8, 0), 166912))
