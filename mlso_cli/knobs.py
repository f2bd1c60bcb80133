"""Every setting that comes from the environment, read in one place and typed.

Modules never read `os.environ` themselves; they call `knobs()`. Tests override a knob with
`monkeypatch.setenv` followed by `knobs.cache_clear()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True)
class Knobs:
    cache_dir: Path
    """Where compiled kernels, search results and the runtime library are cached."""
    nvcc: str
    """The nvcc executable (MLSO_NVCC, else `nvcc` on PATH, else /usr/local/cuda/bin/nvcc)."""
    ort_include: Path | None
    """ONNX Runtime C API headers (MLSO_ORT_INCLUDE); found automatically when unset."""
    keep_temps: bool
    """Keep generated .cu files even when nvcc succeeds (MLSO_KEEP_TEMPS=1)."""
    library_gemm: bool = True
    """Lower kernel-level matmuls to cuBLASLt calls where possible (MLSO_LIBRARY_GEMM=0: off)."""
    cublas_include: Path | None = None
    """cuBLASLt headers (MLSO_CUBLAS_INCLUDE); fetched into the cache when unset."""


def _default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlso"


@lru_cache(maxsize=1)
def knobs() -> Knobs:
    env = os.environ
    include = env.get("MLSO_ORT_INCLUDE")
    return Knobs(
        cache_dir=Path(env.get("MLSO_CACHE_DIR") or _default_cache()),
        nvcc=env.get("MLSO_NVCC") or "nvcc",
        ort_include=Path(include) if include else None,
        keep_temps=env.get("MLSO_KEEP_TEMPS", "") not in ("", "0"),
        library_gemm=env.get("MLSO_LIBRARY_GEMM", "1") not in ("", "0"),
        cublas_include=Path(env["MLSO_CUBLAS_INCLUDE"]) if env.get("MLSO_CUBLAS_INCLUDE") else None,
    )


cache_clear = knobs.cache_clear
