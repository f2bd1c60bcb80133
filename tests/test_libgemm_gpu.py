"""Library GEMMs on a GPU (marker `gpu`): through the PyCUDA launcher (the runtime library's own
cuBLASLt code via ctypes) against numpy, also under the launcher's CUDA-graph capture, and
through ONNX Runtime with its CUDA graph. CPU tests of the same lowering: test_libgemm.py."""

from __future__ import annotations

import numpy as np
import pytest

from mlso_cli.codegen import compile_program
from mlso_cli.ir import DType
from mlso_cli.runtime import gpu_info
from tests import test_libgemm as L
from tests.test_package_support import use_cache

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda(monkeypatch):
    if gpu_info() is None:
        pytest.skip("no NVIDIA GPU")
    pytest.importorskip("pycuda.driver")
    use_cache(monkeypatch)
    from mlso_cli.runtime import launcher

    return launcher


def _numpy(kg, ins):
    """float64 numpy of the graph, operands rounded as the GPU reads them."""
    from mlso_cli.verify import interpreter

    return interpreter.run(kg, ins, "float32")


SHAPES = {
    "plain_f16": lambda: L.plain(DType.F16, batch=2, m=128, k=256, n=512),
    "plain_bf16": lambda: L.plain(DType.BF16, batch=1, m=64, k=128, n=256),
    "plain_f32": lambda: L.plain(DType.F32, batch=3, m=32, k=64, n=48),
    "transposed_f16": lambda: L.transposed(DType.F16, batch=4, m=40, k=72, n=24),
    "norm_linear_f16": lambda: L.norm_linear(DType.F16, m=128, k=896, n=512),
    "linear_sigmoid_f16": lambda: L.linear_then_gelu_like(DType.F16, m=16, k=64, n=32),
    "broadcast_batch_f32": L.broadcast_batch,
    "bias_f16": lambda: L.biased(DType.F16, batch=2, m=128, k=256, n=512),
    "bias_bf16": lambda: L.biased(DType.BF16, batch=1, m=64, k=128, n=256),
    "bias_row_f32": lambda: L.biased_row(DType.F32, m=32, k=64, n=48),
    "bias_silu_f32": lambda: L.biased_silu(DType.F32, m=64, k=128, n=96),
    "residual_f16": lambda: L.residual(DType.F16, batch=2, m=128, k=256, n=512),
    "residual_bf16": lambda: L.residual(DType.BF16, batch=1, m=64, k=128, n=256),
    "residual_f32": lambda: L.residual(DType.F32, batch=0, m=32, k=64, n=48),
    "residual_left_f16": lambda: L.residual(DType.F16, batch=3, m=40, k=72, n=24, left=True),
    "residual_strided_f16": lambda: L.residual_strided(DType.F16, batch=2, m=64, k=128, n=96),
    "residual_silu_f32": lambda: L.residual_silu(DType.F32, m=64, k=128, n=96),
}
TOL = {DType.F16: 2e-3, DType.BF16: 1.6e-2, DType.F32: 1e-5}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_pycuda_runs_library_gemms_like_the_reference(cuda, name):
    kg = SHAPES[name]()
    cp = compile_program(kg)
    assert any(launch.get("kind") == "gemm" for launch in cp.plan["launches"])
    rng = np.random.default_rng(3)
    ins = [rng.standard_normal(n.shape).astype(np.float32) for n in kg.inputs]
    want = _numpy(kg, ins)
    with cuda.Program(cp.fatbin, cp.plan) as prog:
        got = prog.run(ins, poison_outputs=True)
        for g, w, out in zip(got, want, kg.outputs):
            g = np.asarray(g, np.float64)
            assert not np.isnan(g).any(), f"{name}: unwritten elements"
            err = np.abs(g - w).max() / max(np.abs(w).max(), 1e-30)
            assert err <= TOL[out.dtype], f"{name}: relative error {err:.2e}"
        again = prog.run(ins)
        np.testing.assert_array_equal(again[0], got[0])  # same algorithm, same bits


@pytest.mark.parametrize("algo", ["heuristic", "timed"])
def test_the_algorithm_is_the_heuristics_first_or_the_fastest_timed_once_per_shape(
    cuda, monkeypatch, algo
):
    """MLSO_GEMM_ALGO=heuristic (the default) keeps cuBLASLt's first; =timed makes creation time
    the listed algorithms and cache the winner per shape, so a second program reuses it."""
    monkeypatch.setenv("MLSO_GEMM_ALGO", algo)
    kg = L.plain(DType.F16, batch=1, m=128, k=2048, n=2048)
    cp = compile_program(kg)
    rng = np.random.default_rng(5)
    ins = [rng.standard_normal(n.shape).astype(np.float32) for n in kg.inputs]
    want = _numpy(kg, ins)[0]
    with cuda.Program(cp.fatbin, cp.plan) as prog:
        first = prog.library_choices()
        got = np.asarray(prog.run(ins)[0], np.float64)
    assert np.abs(got - want).max() <= TOL[DType.F16] * np.abs(want).max()
    assert len(first) == 1, first
    if algo == "heuristic" or first[0] == "heuristic's first of 1":
        assert first[0].startswith("heuristic's first of "), first
        return
    assert first[0].startswith("timed: candidate "), first
    with cuda.Program(cp.fatbin, cp.plan) as prog:
        second = prog.library_choices()
    assert second[0].endswith(" (cached)"), second
    assert second[0].removesuffix(" (cached)") == first[0].removesuffix(" (cached)")


def test_a_residual_gemm_is_timed_on_its_own_residual_layout(cuda, monkeypatch):
    """MLSO_GEMM_ALGO=timed on a residual GEMM: creation times the candidates with a scratch
    residual of the real layout (cuBLASLt's C apart from D), and the kept one is right."""
    monkeypatch.setenv("MLSO_GEMM_ALGO", "timed")
    kg = L.residual(DType.F16, batch=0, m=128, k=2048, n=1024)
    cp = compile_program(kg)
    assert "residual" in cp.plan["launches"][0]
    rng = np.random.default_rng(6)
    ins = [rng.standard_normal(n.shape).astype(np.float32) for n in kg.inputs]
    want = _numpy(kg, ins)[0]
    with cuda.Program(cp.fatbin, cp.plan) as prog:
        assert len(prog.library_choices()) == 1
        got = np.asarray(prog.run(ins)[0], np.float64)
    assert np.abs(got - want).max() <= TOL[DType.F16] * np.abs(want).max()


def test_library_gemms_are_captured_in_the_launchers_cuda_graph(cuda):
    kg = SHAPES["norm_linear_f16"]()
    cp = compile_program(kg)
    with cuda.Program(cp.fatbin, cp.plan) as prog:
        t = prog.time(warmup=3, repeats=3, iters=20)
        assert t.method == "cuda-graph", t.note
        assert 0 < t.median_us < 1000
        # after graph replays the result is still right
        rng = np.random.default_rng(1)
        ins = [rng.standard_normal(n.shape).astype(np.float32) for n in kg.inputs]
        got = np.asarray(prog.run(ins)[0], np.float64)
        want = _numpy(kg, ins)[0]
        assert np.abs(got - want).max() <= TOL[DType.F16] * np.abs(want).max()


def test_onnx_runtime_runs_a_library_gemm_under_its_cuda_graph(cuda, tmp_path):
    """A MatMul region packaged with its library-GEMM program, in ORT on the CUDA EP with
    enable_cuda_graph: the handle, algorithm and workspace are made at kernel creation, so the
    capture records only cublasLtMatmul, and replays give the reference result."""
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDA EP")
    from onnx import TensorProto, helper, numpy_helper

    from mlso_cli.package import package_model
    from mlso_cli.runtime import session
    from tests.test_package_support import region
    from tests.test_runtime_gpu import META

    m, k, n = 64, 256, 128
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((k, n)) / 16).astype(np.float16)
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [m, k])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT16, [m, n])
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("MatMul", ["x", "W"], ["y"])],
            "mm",
            [x_info],
            [y_info],
            [numpy_helper.from_array(w, "W")],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    from mlso_cli.ir import build as b

    xi, wi = b.input_(0, (m, k), DType.F16), b.input_(1, (k, n), DType.F16)
    cp = compile_program(b.kernel_graph([xi, wi], [b.matmul(xi, wi)]))
    assert [launch.get("kind") for launch in cp.plan["launches"]] == ["gemm"]
    packed = package_model(model, [region([0], ["x", "W"], ["y"], cp.plan, binary=cp.fatbin)], META)
    providers = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"})]
    sess = session(packed.SerializeToString(), providers=providers)
    x = rng.standard_normal((m, k)).astype(np.float16)
    want = (x.astype(np.float64) @ w.astype(np.float64)).astype(np.float16)
    binding = sess.io_binding()
    xv = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    yv = ort.OrtValue.ortvalue_from_shape_and_type([m, n], np.float16, "cuda", 0)
    binding.bind_ortvalue_input("x", xv)
    binding.bind_ortvalue_output("y", yv)
    for _ in range(3):  # the first run captures, the others replay
        sess.run_with_iobinding(binding)
    got = yv.numpy().astype(np.float64)
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max() + 1e-3


def test_onnx_runtime_runs_a_residual_gemm_under_its_cuda_graph(cuda, tmp_path):
    """MatMul + Add of a graph input (a residual) packaged as one cuBLASLt call (beta 1, C the
    residual, D the output), in ORT on the CUDA EP with enable_cuda_graph: the op passes the
    residual's pointer with each run, and replays give the reference result."""
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDA EP")
    from onnx import TensorProto, helper, numpy_helper

    from mlso_cli.ir import build as b
    from mlso_cli.package import package_model
    from mlso_cli.runtime import session
    from tests.test_package_support import region
    from tests.test_runtime_gpu import META

    m, k, n = 64, 256, 128
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((k, n)) / 16).astype(np.float16)
    f16 = TensorProto.FLOAT16
    model = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("MatMul", ["x", "W"], ["h"]),
                helper.make_node("Add", ["h", "r"], ["y"]),
            ],
            "mm_residual",
            [
                helper.make_tensor_value_info("x", f16, [m, k]),
                helper.make_tensor_value_info("r", f16, [m, n]),
            ],
            [helper.make_tensor_value_info("y", f16, [m, n])],
            [numpy_helper.from_array(w, "W")],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    xi, wi = b.input_(0, (m, k), DType.F16), b.input_(1, (k, n), DType.F16)
    ri = b.input_(2, (m, n), DType.F16)
    cp = compile_program(b.kernel_graph([xi, wi, ri], [b.add(b.matmul(xi, wi), ri)]))
    (launch,) = cp.plan["launches"]
    assert launch["kind"] == "gemm" and "residual" in launch and cp.plan["version"] == 4
    region_ = region([0, 1], ["x", "W", "r"], ["y"], cp.plan, binary=cp.fatbin)
    packed = package_model(model, [region_], META)
    providers = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"})]
    sess = session(packed.SerializeToString(), providers=providers)
    x = rng.standard_normal((m, k)).astype(np.float16)
    r = rng.standard_normal((m, n)).astype(np.float16)
    want = x.astype(np.float64) @ w.astype(np.float64) + r.astype(np.float64)
    binding = sess.io_binding()
    xv = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    rv = ort.OrtValue.ortvalue_from_numpy(r, "cuda", 0)
    yv = ort.OrtValue.ortvalue_from_shape_and_type([m, n], np.float16, "cuda", 0)
    binding.bind_ortvalue_input("x", xv)
    binding.bind_ortvalue_input("r", rv)
    binding.bind_ortvalue_output("y", yv)
    for _ in range(3):  # the first run captures, the others replay
        sess.run_with_iobinding(binding)
    got = yv.numpy().astype(np.float64)
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max() + 1e-3
