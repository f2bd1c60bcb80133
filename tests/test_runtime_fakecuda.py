"""The real op code inside real ONNX Runtime, on a machine without a GPU.

mlso_ort.cc is compiled a second time for the CPU EP (-DMLSO_EXECUTION_PROVIDER) and run against a
fake libcuda.so.1 whose "kernels" are host functions and whose device memory is host memory.
That exercises everything but the GPU itself: attribute and constant-input reading, the binary's
SHA-256, module and function lookup, the shared-memory limit, the shape check before any launch,
output and scratch allocation, zeroing, argument order, heterogeneous variadic inputs, and the
error messages ORT returns. The fake library is loaded in a subprocess (by its soname, before ORT
dlopens "libcuda.so.1"), so the rest of the test process never sees it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mlso_cli.package import package_model, standard_metadata
from mlso_cli.runtime import build
from mlso_cli.runtime.ort_headers import find_ort_include
from tests.test_package_support import ROOT, region, use_cache

META = standard_metadata(targets=["sm_90a"], seed=0, verification_bound="exact")

FAKE_CUDA = r"""
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
extern "C" {
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
struct Fn { void (*run)(void** p, unsigned n); std::string name; int smem_limit; };
static int launches = 0, memsets = 0;
static std::map<std::string, Fn*> registry;

static float half_to_float(uint16_t h) {
  uint32_t s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023, bits;
  if (e == 0) { if (m == 0) bits = s << 31; else { e = 1; while (!(m & 1024)) { m <<= 1; e--; }
      m &= 1023; bits = (s << 31) | ((e + 112) << 23) | (m << 13); } }
  else if (e == 31) bits = (s << 31) | 0x7f800000u | (m << 13);
  else bits = (s << 31) | ((e + 112) << 23) | (m << 13);
  float f; std::memcpy(&f, &bits, 4); return f;
}
#define ARG(T, i) (*reinterpret_cast<T**>(p[i]))
static void k0(void** p, unsigned n) { for (unsigned i = 0; i < n; ++i) ARG(float, 1)[i] = ARG(const float, 0)[i] * 2.0f; }
static void ksum(void** p, unsigned n) { for (unsigned i = 0; i < n; ++i) ARG(float, 1)[0] += ARG(const float, 0)[i]; }
static void kadd(void** p, unsigned n) { for (unsigned i = 0; i < n; ++i) ARG(float, 2)[i] = ARG(const float, 0)[i] + ARG(const float, 1)[0]; }
static void kmix(void** p, unsigned n) { for (unsigned i = 0; i < n; ++i) ARG(float, 2)[i] = half_to_float(ARG(const uint16_t, 0)[i]) + ARG(const float, 1)[i]; }

CUresult cuInit(unsigned) {
  registry["mlso_k0"] = new Fn{k0, "mlso_k0", 0};
  registry["mlso_sum"] = new Fn{ksum, "mlso_sum", 0};
  registry["mlso_add"] = new Fn{kadd, "mlso_add", 0};
  registry["mlso_mixed"] = new Fn{kmix, "mlso_mixed", 0};
  return 0;
}
CUresult cuDeviceGet(int* d, int ordinal) { *d = ordinal; return ordinal == 0 ? 0 : 101; }
CUresult cuDeviceGetAttribute(int* v, int attr, int) {
  *v = attr == 75 ? 9 : attr == 76 ? 0 : attr == 97 ? 166912 : 0; return 0; }  // sm_80's opt-in limit
static int ctx_token;
CUresult cuDevicePrimaryCtxRetain(void** ctx, int) { *ctx = &ctx_token; return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(int) { return 0; }
CUresult cuCtxGetCurrent(void** ctx) { *ctx = nullptr; return 0; }
CUresult cuCtxPushCurrent_v2(void*) { return 0; }
CUresult cuCtxPopCurrent_v2(void** ctx) { *ctx = &ctx_token; return 0; }
CUresult cuModuleLoadData(void** mod, const void* image) {
  if (std::memcmp(image, "FAKEBIN", 7) != 0) return 209;  // CUDA_ERROR_NO_BINARY_FOR_GPU
  *mod = &registry; return 0; }
CUresult cuModuleUnload(void*) { return 0; }
CUresult cuModuleGetFunction(void** fn, void*, const char* name) {
  auto it = registry.find(name); if (it == registry.end()) return 500;
  *fn = it->second; return 0; }
CUresult cuFuncSetAttribute(void* fn, int attr, int value) {
  if (attr == 8) static_cast<Fn*>(fn)->smem_limit = value; return 0; }
CUresult cuLaunchKernel(void* fn, unsigned gx, unsigned, unsigned, unsigned bx, unsigned, unsigned,
                        unsigned smem, void*, void** params, void**) {
  Fn* f = static_cast<Fn*>(fn);
  if (smem > 49152 && (unsigned)f->smem_limit < smem) return 1;  // as the driver would refuse
  ++launches; f->run(params, gx * bx); return 0; }
CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, void*) {
  ++memsets; std::memset(reinterpret_cast<void*>(p), v, n); return 0; }
CUresult cuGetErrorName(CUresult r, const char** s) {
  *s = r == 209 ? "CUDA_ERROR_NO_BINARY_FOR_GPU" : r == 500 ? "CUDA_ERROR_NOT_FOUND" : "CUDA_ERROR_FAKE"; return 0; }
CUresult cuGetErrorString(CUresult, const char** s) { *s = "fake driver"; return 0; }
int fake_launches() { return launches; }
int fake_memsets() { return memsets; }
int fake_smem_limit(const char* name) { return registry.count(name) ? registry[name]->smem_limit : -1; }
}
"""

RUNNER = r"""
import ctypes, json, sys
import numpy as np
import onnxruntime as ort

fake = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # soname libcuda.so.1
fake.fake_smem_limit.argtypes = [ctypes.c_char_p]
library, folder = sys.argv[2], sys.argv[3]
results = {}

def open_session(name):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.register_custom_ops_library(library)
    return ort.InferenceSession(f"{folder}/{name}.onnx", so, providers=["CPUExecutionProvider"])

def attempt(key, fn):
    before = fake.fake_launches()
    try:
        value = fn()
        results[key] = {"ok": True, "value": value}
    except Exception as e:  # ORT's errors
        results[key] = {"ok": False, "error": str(e)}
    results[key]["launches"] = fake.fake_launches() - before

x = np.arange(256, dtype=np.float32).reshape(4, 64) / 7
attempt("scale", lambda: open_session("scale").run(None, {"x": x})[0].tolist())
sess = open_session("scale_dynamic")
attempt("scale_ok_shape", lambda: sess.run(None, {"x": x})[0].tolist())
attempt("scale_bad_shape", lambda: sess.run(None, {"x": x[:3]})[0].tolist())
attempt("scale_bad_dtype_model", lambda: open_session("scale_bad_dtype").run(None, {"x": x.astype(np.float64)})[0].tolist())
s = np.linspace(-1, 1, 256, dtype=np.float32).reshape(1, 256)
sess = open_session("sum")
memsets = fake.fake_memsets()
attempt("sum", lambda: [sess.run(None, {"x": s})[0].tolist() for _ in range(3)])
results["sum_memsets"] = fake.fake_memsets() - memsets
results["smem_limit"] = {k: fake.fake_smem_limit(k.encode()) for k in ("mlso_sum", "mlso_add")}
a = np.linspace(-2, 2, 256).astype(np.float16)
b = np.linspace(0, 1, 256).astype(np.float32)
attempt("mixed", lambda: open_session("mixed").run(None, {"a": a, "b": b})[0].tolist())
for name in ("tampered", "missing_kernel", "too_much_smem", "not_a_binary", "plan_output_float64",
             "plan_output_shape_1", "plan_input_dtype", "plan_smem_over_cuda", "plan_grid_over_cuda"):
    attempt(name, lambda name=name: open_session(name) and None)
print(json.dumps(results))
"""


def _compile(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def scale_model(
    dynamic: bool = False,
    kernel: str = "mlso_k0",
    smem: int = 0,
    binary: bytes = b"FAKEBIN-scale",
    in_dtype: str = "float32",
) -> onnx.ModelProto:
    """Fallback body: y = x * 3. The fake kernel computes x * 2, so results show which ran."""
    dim0 = "N" if dynamic else 4
    xi = helper.make_tensor_value_info("x", TensorProto.FLOAT, [dim0, 64])
    yi = helper.make_tensor_value_info("y", TensorProto.FLOAT, [dim0, 64])
    nodes = [
        helper.make_node(
            "Constant", [], ["three"], value=numpy_helper.from_array(np.array(3.0, np.float32))
        ),
        helper.make_node("Mul", ["x", "three"], ["y"]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "scale", [xi], [yi]), opset_imports=[helper.make_opsetid("", 17)]
    )
    plan = {
        "version": 1,
        "targets": ["sm_90a"],
        "smem_max": 0,
        "inputs": [{"dtype": "float32", "shape": [4, 64]}],
        "outputs": [{"dtype": "float32", "shape": [4, 64]}],
        "scratch": [],
        "zero": [],
        "launches": [
            {
                "kernel": kernel,
                "grid": [1, 1, 1],
                "block": [256, 1, 1],
                "smem": smem,
                "args": [{"kind": "input", "index": 0}, {"kind": "output", "index": 0}],
            }
        ],
    }
    return package_model(model, [region([0, 1], ["x"], ["y"], plan, binary=binary)], META)


def sum_model() -> onnx.ModelProto:
    xi = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])
    yi = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=1),
        helper.make_node("Add", ["x", "s"], ["y"]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "sum", [xi], [yi]), opset_imports=[helper.make_opsetid("", 18)]
    )
    inp, out, scr = ({"kind": k, "index": 0} for k in ("input", "output", "scratch"))
    plan = {
        "version": 1,
        "targets": ["sm_90a"],
        "smem_max": 65536,
        "inputs": [{"dtype": "float32", "shape": [1, 256]}],
        "outputs": [{"dtype": "float32", "shape": [1, 256]}],
        "scratch": [{"bytes": 4}],
        "zero": [scr],
        "launches": [
            {
                "kernel": "mlso_sum",
                "grid": [1, 1, 1],
                "block": [256, 1, 1],
                "smem": 65536,
                "args": [inp, scr],
            },
            {
                "kernel": "mlso_add",
                "grid": [1, 1, 1],
                "block": [256, 1, 1],
                "smem": 0,
                "args": [inp, scr, out],
            },
        ],
    }
    return package_model(model, [region([0, 1], ["x"], ["y"], plan, binary=b"FAKEBIN-sum")], META)


def mixed_model() -> onnx.ModelProto:
    ai = helper.make_tensor_value_info("a", TensorProto.FLOAT16, [256])
    bi = helper.make_tensor_value_info("b", TensorProto.FLOAT, [256])
    yi = helper.make_tensor_value_info("y", TensorProto.FLOAT, [256])
    nodes = [
        helper.make_node("Cast", ["a"], ["af"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["af", "b"], ["y"]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "mixed", [ai, bi], [yi]),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    args = [
        {"kind": "input", "index": 0},
        {"kind": "input", "index": 1},
        {"kind": "output", "index": 0},
    ]
    plan = {
        "version": 1,
        "targets": ["sm_90a"],
        "smem_max": 0,
        "inputs": [{"dtype": "float16", "shape": [256]}, {"dtype": "float32", "shape": [256]}],
        "outputs": [{"dtype": "float32", "shape": [256]}],
        "scratch": [],
        "zero": [],
        "launches": [
            {
                "kernel": "mlso_mixed",
                "grid": [1, 1, 1],
                "block": [256, 1, 1],
                "smem": 0,
                "args": args,
            }
        ],
    }
    return package_model(
        model, [region([0, 1], ["a", "b"], ["y"], plan, binary=b"FAKEBIN-mixed")], META
    )


def with_plan_change(model: onnx.ModelProto, path: tuple, value) -> onnx.ModelProto:
    """A hostile edit: the plan attribute changed, the graph's declared types left alone."""
    attr = next(a for a in model.graph.node[0].attribute if a.name == "plan")
    plan = json.loads(attr.s)
    target = plan
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    attr.s = json.dumps(plan).encode()
    return model


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    mp = pytest.MonkeyPatch()
    try:
        use_cache(mp)
        include = find_ort_include()
    finally:
        mp.undo()
    tmp = tmp_path_factory.mktemp("fakecuda")
    fake_src = tmp / "fake_cuda.cc"
    fake_src.write_text(FAKE_CUDA)
    fake = tmp / "libcuda.so.1"
    _compile(
        [
            "g++",
            "-O1",
            "-shared",
            "-fPIC",
            "-std=c++17",
            "-Wl,-soname,libcuda.so.1",
            str(fake_src),
            "-o",
            str(fake),
        ]
    )
    lib = tmp / "libmlso_ort_cpu_test.so"
    _compile(
        [
            "g++",
            *build.FLAGS,
            '-DMLSO_EXECUTION_PROVIDER="CPUExecutionProvider"',
            "-DMLSO_TEST_HOST_MEMORY",
            f"-I{include}",
            str(build.CSRC / "mlso_ort.cc"),
            "-o",
            str(lib),
            *build.LIBS,
            f"-Wl,--version-script={build.CSRC / build.VERSION_SCRIPT}",
        ]
    )
    models = {
        "scale": scale_model(),
        "scale_dynamic": scale_model(dynamic=True),
        "sum": sum_model(),
        "mixed": mixed_model(),
        "missing_kernel": scale_model(kernel="mlso_nope"),
        "too_much_smem": scale_model(smem=200_000),
        "not_a_binary": scale_model(binary=b"ELF-not-a-fatbin"),
    }
    tampered = scale_model()
    next(
        t for t in tampered.graph.initializer if t.name.startswith("mlso_bin_")
    ).raw_data = b"FAKEBIN-scalX"
    models["tampered"] = tampered
    bad_dtype = scale_model(dynamic=True)
    bad_dtype.graph.input[
        0
    ].type.tensor_type.elem_type = TensorProto.DOUBLE  # feeds float64 to the op
    models["scale_bad_dtype"] = bad_dtype
    for name, path, value in (
        ("plan_output_float64", ("outputs", 0, "dtype"), "float64"),
        ("plan_output_shape_1", ("outputs", 0, "shape"), [1]),
        ("plan_input_dtype", ("inputs", 0, "dtype"), "float16"),
        ("plan_smem_over_cuda", ("launches", 0, "smem"), 300_000),
        ("plan_grid_over_cuda", ("launches", 0, "grid"), [2**31, 1, 1]),
    ):
        models[name] = with_plan_change(scale_model(), path, value)
    for name, model in models.items():
        onnx.save(model, str(tmp / f"{name}.onnx"))
    runner = tmp / "runner.py"
    runner.write_text(textwrap.dedent(RUNNER))
    proc = subprocess.run(
        [sys.executable, str(runner), str(fake), str(lib), str(tmp)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


X = np.arange(256, dtype=np.float32).reshape(4, 64) / 7


def test_the_kernel_runs_instead_of_the_body(results):
    r = results["scale"]
    assert r["ok"] and r["launches"] == 1
    assert np.array_equal(np.array(r["value"], np.float32), X * 2)  # the body would give X * 3


def test_a_wrong_shape_fails_clearly_without_a_launch(results):
    assert results["scale_ok_shape"]["ok"] and results["scale_ok_shape"]["launches"] == 1
    r = results["scale_bad_shape"]
    assert not r["ok"] and r["launches"] == 0
    msg = r["error"]
    assert "MlsoKernel node 'mlso_region_0'" in msg and "input 'x'" in msg
    assert "has shape [3,64] dtype float32, but the plan expects shape [4,64] dtype float32" in msg
    assert "was not launched" in msg


def test_a_wrong_dtype_fails_without_a_launch(results):
    r = results["scale_bad_dtype_model"]
    assert not r["ok"] and r["launches"] == 0
    # The graph declares x as float64, so kernel creation already refuses the node (the
    # compute-time check, shown by the wrong shape above, is the last line).
    assert (
        "inputs[0] is float32 [4,64] in the plan, but the node declares float64 [?,64]"
        in r["error"]
    )


def test_scratch_is_zeroed_launches_run_in_order_and_smem_is_raised(results):
    r = results["sum"]
    assert r["ok"] and r["launches"] == 6
    s = np.linspace(-1, 1, 256, dtype=np.float32).reshape(1, 256)
    for y in r["value"]:  # identical on every run: the scratch accumulator starts at zero
        np.testing.assert_allclose(np.array(y, np.float32), s + s.sum(), atol=1e-5)
    assert results["sum_memsets"] == 3
    assert results["smem_limit"] == {"mlso_sum": 65536, "mlso_add": 0}


def test_heterogeneous_variadic_inputs(results):
    r = results["mixed"]
    assert r["ok"], r
    a = np.linspace(-2, 2, 256).astype(np.float16)
    b = np.linspace(0, 1, 256).astype(np.float32)
    np.testing.assert_array_equal(
        np.array(r["value"], np.float32), a.astype(np.float32) + b
    )  # body: a - b


def test_kernel_creation_refuses_bad_nodes(results):
    assert "does not match attribute binary_sha256" in results["tampered"]["error"]
    assert "tampered" in results["tampered"]["error"]
    assert "has no kernel 'mlso_nope'" in results["missing_kernel"]["error"]
    assert "needs 200000 bytes of shared memory per block" in results["too_much_smem"]["error"]
    assert "allows 166912" in results["too_much_smem"]["error"]
    assert "CUDA_ERROR_NO_BINARY_FOR_GPU" in results["not_a_binary"]["error"]
    assert "this GPU is sm_90" in results["not_a_binary"]["error"]


def test_fake_driver_source_is_not_shipped():
    assert not list(Path(build.CSRC).glob("*fake*"))


def test_kernel_creation_refuses_plans_that_disagree_with_the_graph(results):
    for name, expected in (
        (
            "plan_output_float64",
            "outputs[0] is float64 [4,64] in the plan, but the node declares float32 [4,64]",
        ),
        (
            "plan_output_shape_1",
            "outputs[0] is float32 [1] in the plan, but the node declares float32 [4,64]",
        ),
        (
            "plan_input_dtype",
            "inputs[0] is float16 [4,64] in the plan, but the node declares float32 [4,64]",
        ),
        ("plan_smem_over_cuda", "launches[0].smem must be an integer in [0, 232448]"),
        ("plan_grid_over_cuda", "launches[0].grid[0] must be an integer in [1, 2147483647]"),
    ):
        r = results[name]
        assert not r["ok"] and r["launches"] == 0, r
        assert expected in r["error"] and "tampered" in r["error"], r["error"]
