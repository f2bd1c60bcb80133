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
    max_fold_bytes: int = 16 << 20
    """The largest tensor load-time folding writes as a constant (MLSO_MAX_FOLD_BYTES, default
    16 MiB). Why a cap: a causal mask or a RoPE table computed from shapes is worth folding at any
    usual length, but one of seq^2 elements at a long sequence would bloat the model."""
    merge_siblings: bool = True
    """Lift sibling projections (q/k/v, gate/up: matmuls of one input with constant weights) as
    one GEMM over concatenated weights (frontend/siblings.py); MLSO_MERGE_SIBLINGS=0 turns it
    off. On by default: one library GEMM launch replaces two or three, and the file does not
    grow, since the fallback body reads each projection's weight as its columns of the
    concatenation and the original weights are dropped (package/absorb.py; llama_tiny_fp32
    packaged: 4.41 MB merged, 4.42 MB not, 7.03 MB when the body kept the originals). The
    merged GEMM's speed is the cost model's estimate; it has not been timed on a GPU yet."""
    search_cache: str | None = None
    """Where search results are cached when not under cache_dir (MLSO_SEARCH_CACHE): a shared
    directory or an fsspec URL such as s3://bucket/mlso, seen by every driver and node."""


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
        max_fold_bytes=_int_knob(env, "MLSO_MAX_FOLD_BYTES", 16 << 20),
        search_cache=env.get("MLSO_SEARCH_CACHE") or None,
        merge_siblings=env.get("MLSO_MERGE_SIBLINGS", "1") not in ("", "0"),
    )


def _int_knob(env, name: str, default: int) -> int:
    """A non-negative integer setting; a value that is not one is an error naming the variable."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        from mlso_cli.errors import UsageError

        raise UsageError(
            f"{name}={raw!r} is not a non-negative whole number of bytes",
            f"Unset {name} or give e.g. {name}={default}",
        )
    return value


cache_clear = knobs.cache_clear
