"""nvcc driver: generated CUDA -> one fatbin (sm_80 SASS, sm_90a SASS, compute_90a PTX), cached.

Why a content-hash cache (as Triton does): compiling takes seconds, and the same region is
compiled again by every optimize/verify/bench run. The key is sha256 over the source, the flags,
nvcc's version and the templates' contents; entries are written to a temporary file and renamed
into place, so concurrent compilers never see half a file. Each entry's content hash is stored
beside it (<key>.fatbin.sha256) and checked on every read: a truncated or changed entry is
removed, reported on stderr and rebuilt, never packaged.

Flags: -O3, C++17, no --use_fast_math. Fast math would turn expf/erff/division into approximate
forms whose error grows with |x| (exp at logits of 100 loses ~1e-5 relative, the fp32 limit),
so templates call the precise functions and rsqrtf explicitly where approximation is harmless.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from mlso_cli.cachefiles import write_atomic
from mlso_cli.codegen.errors import CompileError
from mlso_cli.codegen.program import GeneratedProgram
from mlso_cli.errors import EnvironmentProblem
from mlso_cli.knobs import knobs


def _templates_dir() -> Path:
    """kernels_templates/ of the source tree (editable installs, `python -m mlso_cli`), else the
    copy a wheel installs under <prefix>/share/mlso/."""
    tree = Path(__file__).resolve().parents[2] / "kernels_templates"
    installed = Path(sys.prefix) / "share" / "mlso" / "kernels_templates"
    return tree if tree.is_dir() or not installed.is_dir() else installed


TEMPLATES_DIR = _templates_dir()
BASE_FLAGS: tuple[str, ...] = ("-O3", "-std=c++17")
NVCC_TIMEOUT_S = 900


@dataclass(frozen=True)
class CompiledProgram:
    fatbin: bytes
    plan: dict[str, Any]
    source: str
    source_sha256: str


def gencode_flags(targets: tuple[str, ...]) -> list[str]:
    """SASS for every target, plus PTX of the last one (JIT-able by the driver)."""
    flags = []
    last = None
    for t in targets:
        m = re.fullmatch(r"sm_(\d+)([a-z]?)", t)
        if not m:
            raise ValueError(f"unknown arch target {t!r}; use names such as sm_80 or sm_90a")
        arch = m.group(1) + m.group(2)
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
        last = arch
    if last is not None:
        flags.append(f"-gencode=arch=compute_{last},code=compute_{last}")
    return flags


@cache
def nvcc_path() -> str:
    """The nvcc executable: MLSO_NVCC, else nvcc on PATH, else /usr/local/cuda/bin/nvcc."""
    want = knobs().nvcc
    found = shutil.which(want)
    if found is None and want == "nvcc" and os.access("/usr/local/cuda/bin/nvcc", os.X_OK):
        found = "/usr/local/cuda/bin/nvcc"
    if found is None:
        raise EnvironmentProblem(
            f"nvcc (the CUDA compiler) was not found (looked for {want!r})",
            "Install the CUDA Toolkit (12.4 or newer; 13.0 is tested) and put nvcc on PATH, "
            "or set MLSO_NVCC=/path/to/nvcc.",
        )
    return found


@cache
def nvcc_version(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as exc:
        raise EnvironmentProblem(
            f"nvcc at {path} cannot be run ({exc})",
            "Check the CUDA Toolkit installation or set MLSO_NVCC.",
        ) from None
    lines = [s for s in out.stdout.splitlines() if s.strip()]
    return lines[-1] if lines else out.stdout


def templates_digest() -> str:
    if not TEMPLATES_DIR.is_dir():
        raise EnvironmentProblem(
            f"the CUDA templates directory {TEMPLATES_DIR} is missing",
            "Run mlso from its source checkout (pip install -e .).",
        )
    h = hashlib.sha256()
    for p in sorted(TEMPLATES_DIR.glob("*.cuh")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def cache_key(source: str, flags: list[str], version: str) -> str:
    h = hashlib.sha256()
    for part in (source, " ".join(flags), version, templates_digest()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def _first_errors(text: str, n: int = 12) -> str:
    lines = text.splitlines()
    errs = [s for s in lines if "error" in s.lower()]
    return "\n".join((errs or lines)[:n])


def _interrupted_child(res: subprocess.CompletedProcess) -> None:
    """Raise KeyboardInterrupt when nvcc died of the Ctrl-C that reached its whole process group:
    that is the user's interrupt, not a compiler failure to report (and keep a .cu for)."""
    from mlso_cli import interrupt

    by_signal = res.returncode < 0 or "died due to signal 2" in (res.stderr or "")
    end = time.monotonic() + (0.5 if by_signal else 0.0)
    while True:
        interrupt.check()
        if time.monotonic() >= end:
            return
        time.sleep(0.01)


def compile_source(source: str, targets: tuple[str, ...]) -> bytes:
    """Fatbin bytes of `source` for `targets`, from the cache when it holds them."""
    nvcc = nvcc_path()
    flags = [*BASE_FLAGS, *gencode_flags(targets)]
    key = cache_key(source, flags, nvcc_version(nvcc))
    root = knobs().cache_dir / "kernels"
    fatbin = root / f"{key}.fatbin"
    if fatbin.is_file():
        cached = read_cache_entry(fatbin)
        if cached is not None:
            return cached
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix="build-") as tmp:
        cu = Path(tmp) / f"{key}.cu"
        out = Path(tmp) / f"{key}.fatbin"
        cu.write_text(source)
        cmd = [nvcc, "-fatbin", *flags, f"-I{TEMPLATES_DIR}", "-o", str(out), str(cu)]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=NVCC_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            res = None
        if res is not None and res.returncode != 0:
            _interrupted_child(res)
        if res is None or res.returncode != 0:
            kept = root / "failed" / f"{key}.cu"
            write_atomic(kept, source.encode())
            shown = " ".join(shlex.quote(c) for c in cmd[:-1] + [str(kept)])
            detail = "timed out" if res is None else f"exit {res.returncode}"
            errors = "" if res is None else _first_errors(res.stderr + res.stdout)
            raise CompileError(
                f"nvcc failed ({detail}) on generated CUDA\n  command: {shown}\n  source kept at: {kept}\n"
                f"  first errors:\n{errors}",
                "This is a code generation bug: report it with the kept source.",
            )
        data = out.read_bytes()
        if not data:
            raise CompileError(
                f"nvcc exited 0 but wrote an empty fatbin for {key}",
                "Check the CUDA Toolkit installation (disk full?) and run again.",
            )
        if knobs().keep_temps:
            write_atomic(root / f"{key}.cu", source.encode())
    write_cache_entry(fatbin, data)
    return data


def _digest_path(fatbin: Path) -> Path:
    return fatbin.with_name(fatbin.name + ".sha256")


def write_cache_entry(fatbin: Path, data: bytes) -> None:
    """Store a fatbin and, after it, the SHA-256 of its content (each renamed into place)."""
    write_atomic(fatbin, data)
    write_atomic(_digest_path(fatbin), (hashlib.sha256(data).hexdigest() + "\n").encode())


def read_cache_entry(fatbin: Path) -> bytes | None:
    """A cached fatbin whose content hashes to its recorded SHA-256, else None.

    Why: the cache key is a hash of what went *in* (source, flags, nvcc), so a file truncated
    by a full disk or a killed copy, or changed by hand, would otherwise be packaged into a
    model as is. A bad or unrecorded entry is removed and reported, and the caller rebuilds it.
    """
    digest = _digest_path(fatbin)
    try:
        data = fatbin.read_bytes()
        recorded = digest.read_text().strip()
    except (OSError, UnicodeDecodeError):
        recorded, data = "", b""
    actual = hashlib.sha256(data).hexdigest()
    if data and actual == recorded:
        return data
    why = (
        "has no recorded hash"
        if not recorded
        else (
            f"hashes to {actual[:16]}…, not the recorded {recorded[:16]}… (truncated or changed: "
            f"{len(data)} bytes)"
        )
    )
    print(f"mlso: warning: kernel cache entry {fatbin} {why}; rebuilding it", file=sys.stderr)
    for path in (fatbin, digest):
        path.unlink(missing_ok=True)
    return None


def compile_generated(gp: GeneratedProgram, targets: tuple[str, ...]) -> CompiledProgram:
    fatbin = compile_source(gp.source, targets)
    return CompiledProgram(
        fatbin, gp.plan, gp.source, hashlib.sha256(gp.source.encode()).hexdigest()
    )
