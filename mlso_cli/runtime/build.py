"""Build libmlso_ort.so (the MlsoKernel custom-op library) on demand, once per content hash.

Why on demand: the library is a few hundred lines of C++ that compile in seconds with g++, it
needs only the ONNX Runtime C headers (see ort_headers.py) and, for library GEMM launches, the
cuBLASLt headers (cublas_headers.py; without them the library is built without GEMM support and
a node with a library GEMM is refused at kernel creation, saying so), and building where it runs
avoids shipping binaries. Like Triton's cache, the key is a hash of everything that affects the output
(sources, headers, compiler identity, flags); the .so is compiled to a temporary name in the
cache and renamed into place, so concurrent builds and interrupted builds are harmless.

    python -m mlso_cli.runtime.build [--out PATH]     # prints the library's path
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import click

from mlso_cli.console import error, log
from mlso_cli.errors import EnvironmentProblem, MlsoError
from mlso_cli.knobs import knobs
from mlso_cli.runtime.cublas_headers import HEADER as CUBLAS_HEADER
from mlso_cli.runtime.cublas_headers import cuda_include, find_cublas_include
from mlso_cli.runtime.ort_headers import HEADER, find_ort_include

CSRC = Path(__file__).resolve().parent / "csrc"
LIB_NAME = "libmlso_ort.so"
CXX = "g++"
FLAGS = ("-O2", "-shared", "-fPIC", "-std=c++17", "-fvisibility=hidden", "-Wall")
LIBS = ("-ldl",)
VERSION_SCRIPT = "mlso_ort.map"


def source_files() -> list[Path]:
    """The library's sources, in a fixed order (the .cc, its headers and the export map)."""
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".cc", ".h", ".map"))


def _compiler() -> tuple[str, str]:
    path = shutil.which(CXX)
    if path is None:
        raise EnvironmentProblem(
            f"{CXX} was not found on PATH; it is needed to build the mlso runtime library",
            "Install it (Debian/Ubuntu: apt-get install g++), or run without the library so the original subgraphs run",
        )
    try:
        proc = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=60, check=True
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise EnvironmentProblem(
            f"{path} --version failed ({e})", "Check the g++ installation"
        ) from None
    return path, proc.stdout.splitlines()[0] if proc.stdout else path


def gemm_includes() -> tuple[Path, ...]:
    """(cuBLASLt include, CUDA runtime include) when both can be had, else () (the library is
    then built without library GEMMs, and says why on stderr)."""
    try:
        return find_cublas_include(), cuda_include()
    except EnvironmentProblem as e:
        log(f"mlso: building the runtime library without library GEMMs: {e.one_line()}")
        return ()


def build_key(include_dir: Path, compiler_id: str, gemm: tuple[Path, ...] = ()) -> str:
    """Content hash of everything that determines the built library."""
    h = hashlib.sha256()
    if gemm:
        h.update(b"gemm\0")
        h.update((gemm[0] / CUBLAS_HEADER).read_bytes())
    for item in (compiler_id, " ".join(FLAGS), " ".join(LIBS)):
        h.update(item.encode())
        h.update(b"\0")
    for path in source_files():
        h.update(path.name.encode())
        h.update(b"\0")
        h.update(path.read_bytes())
    h.update((include_dir / HEADER).read_bytes())
    return h.hexdigest()


def compile_library(
    out: Path, include_dir: Path, compiler: str, gemm: tuple[Path, ...] = ()
) -> None:
    """Compile to a temporary file next to `out`, then rename it into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".tmp-", suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [
        compiler,
        *FLAGS,
        f"-I{include_dir}",
        *(["-DMLSO_HAVE_CUBLASLT", *(f"-I{d}" for d in gemm)] if gemm else []),
        str(CSRC / "mlso_ort.cc"),
        "-o",
        tmp_name,
        *LIBS,
        f"-Wl,--version-script={CSRC / VERSION_SCRIPT}",
    ]
    try:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise EnvironmentProblem(
                f"{compiler} could not build {LIB_NAME} ({e})", "Check the g++ installation"
            ) from None
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines()
            errors = [line for line in lines if "error" in line][:5]
            log = "\n".join(errors or lines[-20:])
            raise EnvironmentProblem(
                f"{compiler} failed to build {LIB_NAME}:\n{log}\n",
                f"Check that {include_dir} holds the ONNX Runtime C API headers (API >= 21), or set MLSO_ORT_INCLUDE",
            )
        os.chmod(tmp_name, 0o755)
        os.replace(tmp_name, out)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


@lru_cache(maxsize=8)
def _library_path(cache_dir: Path, include: Path | None, cublas: Path | None = None) -> Path:
    compiler, compiler_id = _compiler()
    include_dir = find_ort_include()
    gemm = gemm_includes()
    key = build_key(include_dir, compiler_id, gemm)
    out = cache_dir / "lib" / key[:24] / LIB_NAME
    if not out.is_file():
        compile_library(out, include_dir, compiler, gemm)
    return out


def library_path() -> Path:
    """Path of the built library, building it into the cache when missing (EnvironmentProblem
    when g++ or the ONNX Runtime headers cannot be had)."""
    k = knobs()
    path = _library_path(k.cache_dir, k.ort_include, k.cublas_include)
    if not path.is_file():  # the cache was cleaned under a running process
        _library_path.cache_clear()
        path = _library_path(k.cache_dir, k.ort_include, k.cublas_include)
    return path


@click.command(help="Build the MlsoKernel custom-op library (if needed) and print its path.")
@click.option(
    "--out",
    "out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also copy the library to this path (atomically).",
)
def main(out: Path | None) -> None:
    try:
        path = library_path()
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".so", dir=out.parent)
            os.close(fd)
            try:
                shutil.copyfile(path, tmp)
                os.chmod(tmp, 0o755)
                os.replace(tmp, out)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            path = out
    except MlsoError as e:
        error(e.one_line())
        sys.exit(int(e.exit_code))
    click.echo(str(path))


if __name__ == "__main__":
    main()
