"""Find the cuBLASLt headers the runtime library compiles its library GEMMs against.

Why this exists: the library calls cuBLASLt through dlopen (csrc/mlso_gemm.h) and never links
it, but it needs cublasLt.h's types and enums at build time, and neither this machine's CUDA
toolkit (nvcc only) nor pip's onnxruntime-gpu ships them. NVIDIA's `nvidia-cublas` wheel for
CUDA 13 does (nvidia/cu13/include). So, in order: MLSO_CUBLAS_INCLUDE, the toolkit's own include
folder, or a one-time `pip download` of the pinned wheel into the cache, of which only the
include files are kept (the wheel is about 420 MB; its libraries are not needed). cublasLt.h
includes the CUDA runtime's headers (driver_types.h, cuda_fp16.h, ...): those come from the
toolkit next to nvcc (`cuda_include`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from mlso_cli.errors import EnvironmentProblem
from mlso_cli.knobs import knobs

HEADER = "cublasLt.h"
WHEEL = "nvidia-cublas"
WHEEL_VERSION = "13.0.2.14"
"""Pinned: the cuBLAS of CUDA 13.0, the soname (libcublasLt.so.13) ONNX Runtime's CUDA EP loads.
Any 13.x header declares the few entry points the library uses."""
WHEEL_INCLUDE = "nvidia/cu13/include/"
RUNTIME_HEADER = "driver_types.h"
_FIX = (
    f"Set MLSO_CUBLAS_INCLUDE to a folder holding {HEADER} (CUDA 13), e.g. nvidia/cu13/include "
    f"of the {WHEEL} wheel, and make sure the CUDA toolkit's include folder (with "
    f"{RUNTIME_HEADER}) is next to nvcc"
)


def _cached_dir() -> Path:
    return knobs().cache_dir / "cublas-headers" / WHEEL_VERSION / "include"


def cuda_include() -> Path:
    """The CUDA toolkit's include folder (next to nvcc's bin), which cublasLt.h needs."""
    candidates = []
    nvcc = shutil.which(knobs().nvcc)
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
    candidates += [Path("/usr/local/cuda/include"), Path("/usr/include")]
    for c in candidates:
        if (c / RUNTIME_HEADER).is_file():
            return c
    raise EnvironmentProblem(
        f"the CUDA runtime headers ({RUNTIME_HEADER}) were not found next to nvcc or in "
        "/usr/local/cuda/include",
        "Install the CUDA 13 toolkit (its headers), or set MLSO_NVCC to its nvcc",
    )


def find_cublas_include(*, fetch: bool = True) -> Path:
    """The folder holding cublasLt.h, fetching it into the cache when needed."""
    chosen = knobs().cublas_include
    if chosen is not None:
        if not (chosen / HEADER).is_file():
            raise EnvironmentProblem(f"MLSO_CUBLAS_INCLUDE={chosen} has no {HEADER}", _FIX)
        return chosen
    try:
        toolkit = cuda_include()
    except EnvironmentProblem:
        toolkit = None
    for candidate in ([toolkit] if toolkit else []) + [_cached_dir()]:
        if (candidate / HEADER).is_file():
            return candidate
    if not fetch:
        raise EnvironmentProblem(f"the cuBLAS headers ({HEADER}) were not found", _FIX)
    return fetch_wheel_headers(_cached_dir())


def fetch_wheel_headers(dest: Path) -> Path:
    """pip download the pinned nvidia-cublas wheel and keep only its include files, at dest."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fetch-", dir=dest.parent) as tmp_name:
        tmp = Path(tmp_name)
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "-q", f"{WHEEL}=={WHEEL_VERSION}", "-d", str(tmp),
        ]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise EnvironmentProblem(f"pip download {WHEEL} failed to run ({e})", _FIX) from None
        wheels = sorted(tmp.glob("nvidia_cublas-*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-2:]
            raise EnvironmentProblem(
                f"pip download {WHEEL}=={WHEEL_VERSION} failed: {' / '.join(tail)}", _FIX
            )
        staged = tmp / "include"
        staged.mkdir()
        with zipfile.ZipFile(wheels[-1]) as z:
            for name in z.namelist():
                if name.startswith(WHEEL_INCLUDE) and name.endswith(".h"):
                    target = staged / name[len(WHEEL_INCLUDE) :]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(z.read(name))
        wheels[-1].unlink()  # 420 MB: gone before the headers are put in place
        if not (staged / HEADER).is_file():
            raise EnvironmentProblem(f"{wheels[-1].name} holds no {WHEEL_INCLUDE}{HEADER}", _FIX)
        try:
            os.replace(staged, dest)  # atomic; fails if another process already put it there
        except OSError:
            if not (dest / HEADER).is_file():
                raise EnvironmentProblem(
                    f"cannot write the cuBLAS headers to {dest}", _FIX
                ) from None
    return dest
