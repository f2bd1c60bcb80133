"""MlsoKernel on a real GPU: fatbins built with nvcc, packaged, run through ORT's CUDA EP.

The GPU tests are marked `gpu` (tests/conftest.py skips them without a GPU) and also skip when
nvcc or the CUDA EP is missing. The fatbin build itself is a CPU test.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mlso_cli.knobs import knobs
from mlso_cli.package import package_model, standard_metadata
from mlso_cli.runtime import gpu_info, library_decision, library_path, session
from mlso_cli.runtime.check import check_model
from tests.test_package_support import region, use_cache

GENCODE = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_80,code=compute_80",
]
TARGETS = ["sm_80", "sm_90a", "compute_80"]
META = standard_metadata(targets=TARGETS, seed=0, verification_bound="exact")
FATBIN_MAGIC = bytes.fromhex("50ed55ba")  # 0xBA55ED50, little-endian

SCALE = r"""
extern "C" __global__ void mlso_k0(const float* x, float* y) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 256) y[i] = x[i] * FACTOR;
}
"""

# Two launches, fp32 scratch zeroed by the plan, and 64 KB of dynamic shared memory (above the
# 48 KB default, so the op must raise the function's limit): y = x + sum(x).
SUM_THEN_ADD = r"""
extern "C" __global__ void mlso_sum(const float* x, float* acc) {
  extern __shared__ float buf[];
  int i = threadIdx.x;
  buf[16383 - i] = x[i];
  __syncthreads();
  atomicAdd(acc, buf[16383 - i]);
}
extern "C" __global__ void mlso_add(const float* x, const float* acc, float* y) {
  int i = threadIdx.x;
  y[i] = x[i] + acc[0];
}
"""

# Heterogeneous variadic inputs: y(fp32) = float(a fp16) + b(fp32).
MIXED = r"""
#include <cuda_fp16.h>
extern "C" __global__ void mlso_mixed(const __half* a, const float* b, float* y) {
  int i = threadIdx.x;
  y[i] = __half2float(a[i]) + b[i];
}
"""


def find_nvcc() -> str | None:
    for candidate in (knobs().nvcc, "/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc"):
        found = shutil.which(candidate) or (candidate if Path(candidate).is_file() else None)
        if found:
            return found
    return None


def fatbin(source: str, tmp_path: Path, name: str = "k") -> bytes:
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    cu = tmp_path / f"{name}.cu"
    cu.write_text(source)
    out = tmp_path / f"{name}.fatbin"
    subprocess.run(
        [nvcc, "--fatbin", *GENCODE, "-o", str(out), str(cu)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out.read_bytes()


def plan(inputs, outputs, launches, scratch=(), zero=()) -> dict:
    return {
        "version": 1,
        "targets": TARGETS,
        "smem_max": max(launch["smem"] for launch in launches),
        "inputs": [{"dtype": d, "shape": s} for d, s in inputs],
        "outputs": [{"dtype": d, "shape": s} for d, s in outputs],
        "scratch": [{"bytes": b} for b in scratch],
        "zero": list(zero),
        "launches": launches,
    }


def arg(kind: str, index: int) -> dict:
    return {"kind": kind, "index": index}


def launch(kernel, args, grid=(1, 1, 1), block=(256, 1, 1), smem=0) -> dict:
    return {"kernel": kernel, "grid": list(grid), "block": list(block), "smem": smem, "args": args}


def scale_model(binary: bytes, dynamic: bool = False) -> onnx.ModelProto:
    """y = Mul(x, 2) on [4, 64] fp32, packaged with `binary` as its kernel."""
    dim0 = "N" if dynamic else 4
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [dim0, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [dim0, 64])
    nodes = [
        helper.make_node(
            "Constant", [], ["two"], value=numpy_helper.from_array(np.array(2.0, np.float32))
        ),
        helper.make_node("Mul", ["x", "two"], ["y"]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "scale", [x], [y]), opset_imports=[helper.make_opsetid("", 17)]
    )
    p = plan(
        [("float32", [4, 64])],
        [("float32", [4, 64])],
        [launch("mlso_k0", [arg("input", 0), arg("output", 0)])],
    )
    return package_model(model, [region([0, 1], ["x"], ["y"], p, binary=binary)], META)


def test_fatbin_builds_on_cpu(tmp_path):
    data = fatbin(SCALE.replace("FACTOR", "2.0f"), tmp_path)
    assert data[:4] == FATBIN_MAGIC and len(data) > 1000
    model = scale_model(data)
    onnx.checker.check_model(model, full_check=True)
    (node,) = check_model(model)
    assert node.binary == data and node.binary_sha256 == hashlib.sha256(data).hexdigest()


# ---- on the GPU --------------------------------------------------------------------------------


@pytest.fixture
def gpu(monkeypatch):
    import onnxruntime as ort

    if gpu_info() is None:
        pytest.skip("no NVIDIA GPU")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDA EP")
    use_cache(monkeypatch)
    library_path()  # build before timing-sensitive work
    return gpu_info()


CUDA = ["CUDAExecutionProvider"]


@pytest.mark.gpu
def test_kernel_runs_through_the_library(gpu, tmp_path):
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    honest = scale_model(fatbin(SCALE.replace("FACTOR", "2.0f"), tmp_path, "honest"))
    assert library_decision(check_model(honest), CUDA).register
    assert np.array_equal(
        session(honest.SerializeToString(), providers=CUDA).run(None, {"x": x})[0], x * 2
    )
    # A kernel that disagrees with its fallback proves the kernel, not the body, ran.
    liar = scale_model(fatbin(SCALE.replace("FACTOR", "3.0f"), tmp_path, "liar"))
    assert np.array_equal(
        session(liar.SerializeToString(), providers=CUDA).run(None, {"x": x})[0], x * 3
    )
    # And without the library (a CPU session) the body runs.
    cpu = session(liar.SerializeToString(), providers=["CPUExecutionProvider"])
    assert np.array_equal(cpu.run(None, {"x": x})[0], x * 2)


@pytest.mark.gpu
def test_wrong_shape_is_refused_without_launching(gpu, tmp_path):
    import onnxruntime as ort

    model = scale_model(fatbin(SCALE.replace("FACTOR", "2.0f"), tmp_path), dynamic=True)
    sess = session(model.SerializeToString(), providers=CUDA)
    ok = np.ones((4, 64), np.float32)
    assert np.array_equal(sess.run(None, {"x": ok})[0], ok * 2)
    with pytest.raises(
        Exception, match=r"input 'x'.*has shape \[3,64\].*expects shape \[4,64\].*not launched"
    ):
        sess.run(None, {"x": np.ones((3, 64), np.float32)})
    # Poisoned output buffer bound on the GPU: after the refused run it is untouched.
    poison = ort.OrtValue.ortvalue_from_numpy(np.full((4, 64), 7.0, np.float32), "cuda", gpu.index)
    bad = ort.OrtValue.ortvalue_from_numpy(np.ones((8, 64), np.float32), "cuda", gpu.index)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x", bad)
    binding.bind_ortvalue_output("y", poison)
    with pytest.raises(Exception, match="not launched"):
        sess.run_with_iobinding(binding)
    assert (poison.numpy() == 7.0).all()


@pytest.mark.gpu
def test_scratch_zeroing_two_launches_and_big_shared_memory(gpu, tmp_path):
    x = np.random.default_rng(1).standard_normal((1, 256)).astype(np.float32)
    xi = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])
    yi = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=1),
        helper.make_node("Add", ["x", "s"], ["y"]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "sum", [xi], [yi]), opset_imports=[helper.make_opsetid("", 18)]
    )
    p = plan(
        [("float32", [1, 256])],
        [("float32", [1, 256])],
        [
            launch("mlso_sum", [arg("input", 0), arg("scratch", 0)], smem=64 * 1024),
            launch("mlso_add", [arg("input", 0), arg("scratch", 0), arg("output", 0)]),
        ],
        scratch=[4],
        zero=[{"kind": "scratch", "index": 0}],
    )
    packaged = package_model(
        model, [region([0, 1], ["x"], ["y"], p, binary=fatbin(SUM_THEN_ADD, tmp_path))], META
    )
    sess = session(packaged.SerializeToString(), providers=CUDA)
    for _ in range(3):  # the scratch is zeroed on every run
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], x + x.sum(), rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_heterogeneous_inputs(gpu, tmp_path):
    a = np.random.default_rng(2).standard_normal((256,)).astype(np.float16)
    b = np.random.default_rng(3).standard_normal((256,)).astype(np.float32)
    ai = helper.make_tensor_value_info("a", TensorProto.FLOAT16, [256])
    bi = helper.make_tensor_value_info("b", TensorProto.FLOAT, [256])
    yi = helper.make_tensor_value_info("y", TensorProto.FLOAT, [256])
    nodes = [
        helper.make_node("Cast", ["a"], ["af"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["af", "b"], ["y"]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "mixed", [ai, bi], [yi]),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    p = plan(
        [("float16", [256]), ("float32", [256])],
        [("float32", [256])],
        [launch("mlso_mixed", [arg("input", 0), arg("input", 1), arg("output", 0)])],
    )
    packaged = package_model(
        model, [region([0, 1], ["a", "b"], ["y"], p, binary=fatbin(MIXED, tmp_path))], META
    )
    got = session(packaged.SerializeToString(), providers=CUDA).run(None, {"a": a, "b": b})[0]
    np.testing.assert_array_equal(got, a.astype(np.float32) + b)


@pytest.mark.gpu
def test_the_op_itself_refuses_a_tampered_binary(gpu, tmp_path):
    """Bypass the Python check: the C++ op hashes the binary at kernel creation."""
    import onnxruntime as ort

    model = scale_model(fatbin(SCALE.replace("FACTOR", "2.0f"), tmp_path))
    binary = next(t for t in model.graph.initializer if t.name.startswith("mlso_bin_"))
    data = bytearray(binary.raw_data)
    data[-1] ^= 0xFF
    binary.raw_data = bytes(data)
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(library_path()))
    with pytest.raises(Exception, match="does not match attribute binary_sha256"):
        ort.InferenceSession(model.SerializeToString(), so, providers=CUDA)
