"""The custom-op library: it builds with g++ against fetched ORT headers, exports only what it
should, links neither onnxruntime nor libcuda, is cached, and its C++ checks agree with Python's."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from mlso_cli.errors import EnvironmentProblem, ExitCode
from mlso_cli.knobs import knobs
from mlso_cli.runtime import build, library_path
from mlso_cli.runtime.ort_headers import HEADER, api_version
from mlso_cli.runtime.plan import PlanProblem, parse_plan, plan_json
from tests.test_package_support import ROOT, dummy_plan, shared_cache, use_cache

EXPORTS = {
    "RegisterCustomOps",
    "mlso_api_version",
    "mlso_selftest_sha256",
    "mlso_selftest_plan",
    "mlso_selftest_check_input",
    "mlso_gemm_create",
    "mlso_gemm_run",
    "mlso_gemm_describe",
    "mlso_gemm_destroy",
    "mlso_gemm_supported",
}


@pytest.fixture
def lib(monkeypatch) -> ctypes.CDLL:
    use_cache(monkeypatch)
    handle = ctypes.CDLL(str(library_path()))
    handle.mlso_selftest_plan.argtypes = [
        ctypes.c_char_p,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_char_p,
        ctypes.c_size_t,
    ]
    handle.mlso_selftest_sha256.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p]
    handle.mlso_selftest_check_input.argtypes = [
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_int64),
        ctypes.c_size_t,
        ctypes.c_char_p,
        ctypes.c_size_t,
    ]
    return handle


def test_library_builds_in_the_cache_and_exports_register_custom_ops(monkeypatch, lib):
    path = library_path()
    assert path.name == "libmlso_ort.so" and path.is_relative_to(shared_cache() / "lib")
    assert lib.mlso_api_version() == 21
    assert ctypes.cast(lib.RegisterCustomOps, ctypes.c_void_p).value
    nm = subprocess.run(
        ["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True
    )
    exported = {line.split()[-1] for line in nm.stdout.splitlines() if line.strip()}
    assert exported == EXPORTS
    readelf = subprocess.run(
        ["readelf", "-d", str(path)], capture_output=True, text=True, check=True
    ).stdout
    needed = [line for line in readelf.splitlines() if "NEEDED" in line]
    assert not [n for n in needed if "onnxruntime" in n or "libcuda" in n or "cublas" in n], needed
    if knobs().ort_include is None:  # the headers came from Debian trixie's libonnxruntime-dev
        fetched = shared_cache() / "ort-headers" / "onnxruntime"
        assert (fetched / HEADER).is_file() and api_version(fetched) >= 21


def test_second_build_uses_the_cache(monkeypatch, lib):
    first = library_path()
    stamp = first.stat().st_mtime_ns
    build._library_path.cache_clear()

    def no_rebuild(*args, **kwargs):
        raise AssertionError("rebuilt although the cached library is current")

    monkeypatch.setattr(build, "compile_library", no_rebuild)
    assert library_path() == first and first.stat().st_mtime_ns == stamp


def test_build_cli_prints_the_path_and_copies(monkeypatch, tmp_path, lib):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLSO_CACHE_DIR": str(shared_cache())}
    if knobs().ort_include:
        env["MLSO_ORT_INCLUDE"] = str(knobs().ort_include)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlso_cli.runtime.build",
            "--out",
            str(tmp_path / "lib" / "libmlso_ort.so"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "lib" / "libmlso_ort.so")
    assert (tmp_path / "lib" / "libmlso_ort.so").read_bytes() == library_path().read_bytes()


def test_missing_or_old_headers_and_missing_compiler_are_environment_problems(
    monkeypatch, tmp_path
):
    use_cache(monkeypatch, tmp_path / "cache")
    monkeypatch.setenv("MLSO_ORT_INCLUDE", str(tmp_path))
    knobs.cache_clear()
    with pytest.raises(EnvironmentProblem, match="has no onnxruntime_c_api.h") as info:
        library_path()
    assert info.value.exit_code == ExitCode.ENVIRONMENT and "MLSO_ORT_INCLUDE" in info.value.fix
    (tmp_path / HEADER).write_text("#define ORT_API_VERSION 20\n")
    build._library_path.cache_clear()
    with pytest.raises(EnvironmentProblem, match="API version 20"):
        library_path()
    build._library_path.cache_clear()
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(EnvironmentProblem, match="g\\+\\+ was not found"):
        library_path()


def test_a_compile_error_is_reported_and_leaves_no_file(monkeypatch, tmp_path):
    use_cache(monkeypatch)  # the session's cache, whose cuBLAS headers are fetched once
    gemm = build.gemm_includes()
    use_cache(monkeypatch, tmp_path / "cache")
    if gemm:
        monkeypatch.setenv("MLSO_CUBLAS_INCLUDE", str(gemm[0]))
    include = tmp_path / "inc"
    include.mkdir()
    (include / HEADER).write_text("#define ORT_API_VERSION 21\n#error broken header\n")
    monkeypatch.setenv("MLSO_ORT_INCLUDE", str(include))
    knobs.cache_clear()
    with pytest.raises(EnvironmentProblem, match="broken header"):
        library_path()
    leftovers = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert leftovers == []


# ---- the C++ checks, through the self-test entry points ---------------------------------------


@pytest.mark.parametrize("size", [0, 1, 55, 56, 63, 64, 65, 1000, 100_003])
def test_cpp_sha256_matches_hashlib(lib, size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    out = ctypes.create_string_buffer(65)
    lib.mlso_selftest_sha256(data, len(data), out)
    assert out.value.decode() == hashlib.sha256(data).hexdigest()


GOOD = dummy_plan([("float16", [2, 256, 64]), ("bfloat16", [64])], [("float32", [2, 256, 64])])


def _variant(**changes) -> str:
    plan = json.loads(json.dumps(GOOD))
    for path, value in changes.items():
        target = plan
        keys = path.split("__")
        for k in keys[:-1]:
            target = target[int(k)] if k.isdigit() else target[k]
        last = keys[-1]
        target[int(last) if last.isdigit() else last] = value
    return plan_json(plan)


BAD_PLANS = {
    "bad json": "{not json",
    "trailing": plan_json(GOOD) + "x",
    "duplicate key": '{"version":1,"version":1}',
    "nan": plan_json(GOOD).replace('"smem_max":0', '"smem_max":NaN'),
    "float dim": plan_json(GOOD).replace("[2,256,64]", "[2.0,256,64]", 1),
    "deep": "[" * 200 + "]" * 200,
    "version": _variant(version=5),
    "no targets": _variant(targets=[]),
    "target name": _variant(targets=["volta"]),
    "dtype": _variant(inputs__0__dtype="float8"),
    "negative dim": _variant(inputs__0__shape=[2, -1, 64]),
    "arg index": _variant(launches__0__args__1={"kind": "input", "index": 2}),
    "arg kind": _variant(launches__0__args__0={"kind": "weights", "index": 0}),
    "zero an input": _variant(zero=[{"kind": "input", "index": 0}]),
    "zero scratch oob": _variant(zero=[{"kind": "scratch", "index": 0}]),
    "block threads": _variant(launches__0__block=[64, 32, 1]),
    "grid zero": _variant(launches__0__grid=[0, 1, 1]),
    "grid y": _variant(launches__0__grid=[1, 70000, 1]),
    "no launches": _variant(launches=[]),
    "kernel name": _variant(launches__0__kernel=""),
    "smem": _variant(launches__0__smem=-1),
    "scratch bytes": _variant(scratch=[{"bytes": "4096"}]),
}


def _cpp_plan(lib, text: str, n_in: int, n_out: int) -> tuple[int, str]:
    err = ctypes.create_string_buffer(512)
    rc = lib.mlso_selftest_plan(text.encode(), n_in, n_out, err, len(err))
    return rc, err.value.decode()


def test_cpp_and_python_accept_a_good_plan(lib):
    assert _cpp_plan(lib, plan_json(GOOD), 2, 1) == (0, "")
    parse_plan(plan_json(GOOD), 2, 1)
    with_scratch = _variant(scratch=[{"bytes": 4096}], zero=[{"kind": "scratch", "index": 0}])
    assert _cpp_plan(lib, with_scratch, 2, 1)[0] == 0
    parse_plan(with_scratch, 2, 1)


@pytest.mark.parametrize("case", sorted(BAD_PLANS))
def test_cpp_and_python_refuse_the_same_bad_plans(lib, case):
    text = BAD_PLANS[case]
    rc, why = _cpp_plan(lib, text, 2, 1)
    assert rc == 1 and why
    with pytest.raises(PlanProblem):
        parse_plan(text, 2, 1)


def test_cpp_and_python_refuse_count_mismatches(lib):
    rc, why = _cpp_plan(lib, plan_json(GOOD), 3, 1)
    assert rc == 1 and "lists 2 inputs but the node has 3 tensor inputs" in why
    with pytest.raises(PlanProblem, match="lists 2 inputs but the node has 3 tensor inputs"):
        parse_plan(plan_json(GOOD), 3, 1)
    assert _cpp_plan(lib, plan_json(GOOD), 2, 2)[0] == 1


def _check_input(lib, index: int, dtype: int, dims: list[int]) -> tuple[int, str]:
    arr = (ctypes.c_int64 * max(len(dims), 1))(*dims)
    err = ctypes.create_string_buffer(512)
    rc = lib.mlso_selftest_check_input(
        plan_json(GOOD).encode(), index, dtype, arr, len(dims), err, len(err)
    )
    return rc, err.value.decode()


def test_cpp_input_check_names_expected_and_actual(lib):
    assert _check_input(lib, 0, 10, [2, 256, 64]) == (0, "")
    rc, why = _check_input(lib, 0, 10, [2, 128, 64])
    assert rc == 1 and "[2,128,64]" in why and "expects shape [2,256,64] dtype float16" in why
    rc, why = _check_input(lib, 1, 1, [64])  # float32 where bfloat16 is planned
    assert rc == 1 and "dtype float32" in why and "bfloat16" in why
    assert _check_input(lib, 0, 10, [2, 256, 64, 1])[0] == 1


def test_gxx_is_available_here():
    assert shutil.which("g++"), "the build tests need g++"


def test_library_is_built_with_library_gemms_against_fetched_cublas_headers(monkeypatch, lib):
    """The cuBLASLt headers are found (MLSO_CUBLAS_INCLUDE, the toolkit, or the pinned wheel's
    include files fetched into the cache), so the library can run library GEMM launches; it
    still links no cuBLAS (dlopen at kernel creation)."""
    from mlso_cli.runtime.cublas_headers import HEADER as CUBLAS
    from mlso_cli.runtime.cublas_headers import find_cublas_include

    include = find_cublas_include(fetch=False)
    assert (include / CUBLAS).is_file()
    assert lib.mlso_gemm_supported() == 1
    if "cublas-headers" in include.parts:  # fetched (not the toolkit's, not MLSO_CUBLAS_INCLUDE)
        assert include.is_relative_to(shared_cache() / "cublas-headers")
        assert not list(include.parent.glob("*.whl")) and not list(include.rglob("*.so*"))


def test_gemm_create_without_a_gpu_fails_with_one_line(monkeypatch, lib):
    """On a machine without a GPU (or without cuBLAS) the launcher's entry point reports why
    instead of crashing; a bad plan is refused before any CUDA call."""
    lib.mlso_gemm_create.restype = ctypes.c_void_p
    lib.mlso_gemm_create.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    err = ctypes.create_string_buffer(512)
    assert lib.mlso_gemm_create(b'{"version": 5}', err, 512) is None
    assert err.value.decode().startswith("the plan 'version' must be 1, 2, 3 or 4")
    from mlso_cli.codegen import generate
    from mlso_cli.runtime.gpu import gpu_info
    from tests.test_libgemm import plain, residual

    if gpu_info() is not None:
        return
    for kg in (plain(), residual()):  # a version 2 and a version 4 (residual epilogue) plan
        good = plan_json(generate(kg).plan).encode()
        assert lib.mlso_gemm_create(good, err, 512) is None
        why = err.value.decode()
        assert "libcuda.so.1" in why or "cuInit" in why, why
