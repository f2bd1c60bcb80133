"""Find the ONNX Runtime C API headers the custom-op library compiles against.

Why this exists: the headers are needed at build time only, pip's onnxruntime-gpu wheel does not
ship them, and Debian ships them (package libonnxruntime-dev) only in trixie, while our machines
run bookworm. So, in order: MLSO_ORT_INCLUDE, a system include dir, or a one-time download of
trixie's libonnxruntime-dev into the cache. The download uses a private apt state, cache and
sources list and never touches the system's apt configuration (as the GPU machine set-up does).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from mlso_cli.errors import EnvironmentProblem
from mlso_cli.knobs import knobs

HEADER = "onnxruntime_c_api.h"
MIN_API_VERSION = 21
SYSTEM_DIRS = (Path("/usr/include/onnxruntime"), Path("/usr/local/include/onnxruntime"))
DEBIAN_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")
DEBIAN_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
_FIX = (
    "Set MLSO_ORT_INCLUDE to a folder holding onnxruntime_c_api.h (API >= 21), e.g. from "
    "Debian trixie's libonnxruntime-dev or an ONNX Runtime >= 1.21 release archive"
)


def api_version(include_dir: Path) -> int:
    """ORT_API_VERSION as #defined in the header (0 when it cannot be read)."""
    try:
        text = (include_dir / HEADER).read_text(errors="replace")
    except OSError:
        return 0
    m = re.search(r"^\s*#\s*define\s+ORT_API_VERSION\s+(\d+)", text, re.M)
    return int(m.group(1)) if m else 0


def _usable(include_dir: Path) -> bool:
    return (include_dir / HEADER).is_file() and api_version(include_dir) >= MIN_API_VERSION


def _cached_dir() -> Path:
    return knobs().cache_dir / "ort-headers" / "onnxruntime"


def find_ort_include(*, fetch: bool = True) -> Path:
    """The folder holding onnxruntime_c_api.h, fetching it into the cache when needed."""
    chosen = knobs().ort_include
    if chosen is not None:
        if not (chosen / HEADER).is_file():
            raise EnvironmentProblem(f"MLSO_ORT_INCLUDE={chosen} has no {HEADER}", _FIX)
        if api_version(chosen) < MIN_API_VERSION:
            raise EnvironmentProblem(
                f"MLSO_ORT_INCLUDE={chosen} holds C API version {api_version(chosen)}, "
                f"mlso needs >= {MIN_API_VERSION}",
                _FIX,
            )
        return chosen
    for candidate in (*SYSTEM_DIRS, _cached_dir()):
        if _usable(candidate):
            return candidate
    if not fetch:
        raise EnvironmentProblem("the ONNX Runtime C API headers were not found", _FIX)
    return fetch_debian_headers(_cached_dir())


def _mirror() -> str:
    """This machine's Debian mirror (first URIs: line of debian.sources), else deb.debian.org."""
    try:
        for line in DEBIAN_SOURCES.read_text().splitlines():
            if line.startswith("URIs:") and line.split()[1:]:
                return line.split()[1]
    except OSError:
        pass
    return DEFAULT_MIRROR


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=600, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EnvironmentProblem(f"{what} failed to run ({e})", _FIX) from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise EnvironmentProblem(
            f"{what} failed: {' / '.join(tail) or 'exit ' + str(proc.returncode)}", _FIX
        )


def fetch_debian_headers(dest: Path) -> Path:
    """Download trixie's libonnxruntime-dev with private apt state and unpack its headers to dest."""
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise EnvironmentProblem(
                f"the ONNX Runtime headers are missing and {tool} is not available to fetch them",
                _FIX,
            )
    if not DEBIAN_KEYRING.is_file():
        raise EnvironmentProblem(
            f"the ONNX Runtime headers are missing and {DEBIAN_KEYRING} (needed to verify Debian's archive) is not installed",
            _FIX,
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fetch-", dir=dest.parent) as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "lists" / "partial").mkdir(parents=True)
        (tmp / "archives" / "partial").mkdir(parents=True)
        sources = tmp / "src.sources"
        sources.write_text(
            f"Types: deb\nURIs: {_mirror()}\nSuites: trixie\nComponents: main\nSigned-By: {DEBIAN_KEYRING}\n"
        )
        private = [
            "-o", f"Dir::Etc::sourcelist={sources}",
            "-o", "Dir::Etc::sourceparts=/nonexistent",
            "-o", f"Dir::State={tmp}",
            "-o", f"Dir::Cache={tmp}",
        ]  # fmt: skip
        _run(
            ["apt-get", *private, "update", "-qq"],
            tmp,
            "apt-get update (Debian trixie, private state)",
        )
        _run(
            ["apt-get", *private, "download", "-qq", "libonnxruntime-dev"],
            tmp,
            "apt-get download libonnxruntime-dev",
        )
        debs = sorted(tmp.glob("libonnxruntime-dev_*.deb"))
        if not debs:
            raise EnvironmentProblem("apt-get download libonnxruntime-dev produced no .deb", _FIX)
        _run(["dpkg", "-x", str(debs[-1]), str(tmp / "x")], tmp, "dpkg -x libonnxruntime-dev")
        unpacked = tmp / "x" / "usr" / "include" / "onnxruntime"
        if not _usable(unpacked):
            raise EnvironmentProblem(
                f"{debs[-1].name} holds no usable {HEADER} (API >= {MIN_API_VERSION})", _FIX
            )
        staged = tmp / "onnxruntime"
        shutil.copytree(unpacked, staged)
        try:
            os.replace(staged, dest)  # atomic; fails if another process already put it there
        except OSError:
            if not _usable(dest):
                raise EnvironmentProblem(
                    f"cannot write the ONNX Runtime headers to {dest}", _FIX
                ) from None
    return dest
