"""Run a generated program on the CPU (kernels_templates/mlso_host_emu.h), for tests.

Why: CI has nvcc but no GPU. Executing the very source nvcc compiles checks the index
arithmetic, phases, barriers, running-max scaling and the tensor-core fragment layouts (as the
PTX ISA defines them) against the reference interpreter. What it cannot check: cp.async timing
(copies are synchronous), real shared-memory races and performance. Binaries are cached by
content hash like fatbins.

Execution model: blocks run one after another on one OS thread; every CUDA thread of a block is
a user-space fiber that runs until it waits at a barrier (__syncthreads, or a warp's shuffle,
ldmatrix, mma or __syncwarp) and then switches to the next fiber that can run. It used to be one
OS thread per CUDA thread, where futex wake-ups at every barrier dominated (a gqa optimize spent
~17 s in four emulator runs on 2 cores, mostly system time). A barrier that some threads never
reach makes the binary print who waits where and exit 4 (it used to hang until the timeout); a
fiber stack overflow (MLSO_EMU_STACK_KIB, 256 KiB) exits 5. `-fstack-clash-protection` makes
a large frame touch the guard page below its stack before anything past it, so that overflow is
caught rather than silently writing into the next fiber's stack.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mlso_cli.codegen.cfmt import CTYPE
from mlso_cli.codegen.nvcc import TEMPLATES_DIR, templates_digest
from mlso_cli.codegen.program import GeneratedProgram
from mlso_cli.errors import EnvironmentProblem
from mlso_cli.ir.ops import DType
from mlso_cli.knobs import knobs

CXX_FLAGS = (
    "-std=c++20",
    "-O1",
    "-pthread",
    "-fstack-clash-protection",
    "-DMLSO_HOST_EMU",
    "-Wno-unknown-pragmas",
    "-x",
    "c++",
)
_KINDS = ("input", "output", "scratch")


def numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def driver(gp: GeneratedProgram) -> str:
    """C++ main() that reads inputs from argv[1]/inK.bin, runs every launch, writes outK.bin."""
    return (
        "#include <string>\n"
        + gp.source
        + "\n"
        + _runner(gp, "run_program")
        + """
int main(int argc, char** argv) { return argc < 2 ? 2 : run_program(argv[1]); }
"""
    )


def _runner(gp: GeneratedProgram, fn: str) -> str:
    plan = gp.plan
    lines = [f"static int {fn}(const std::string& dir) {{"]
    sizes = {}
    for i, t in enumerate(plan["inputs"]):
        n = int(np.prod(t["shape"], dtype=np.int64)) * numpy_dtype(t["dtype"]).itemsize
        sizes[("input", i)] = n
        lines.append(f'  auto in{i} = mlso_emu::read_file((dir + "/in{i}.bin").c_str(), {n});')
    for i, t in enumerate(plan["outputs"]):
        n = int(np.prod(t["shape"], dtype=np.int64)) * numpy_dtype(t["dtype"]).itemsize
        sizes[("output", i)] = n
        lines.append(f"  auto out{i} = mlso_emu::poisoned({n});")
    for i, s in enumerate(plan["scratch"]):
        lines.append(f"  auto sc{i} = mlso_emu::poisoned({s['bytes']});")
    ctypes = {("input", i): CTYPE[DType(t["dtype"])] for i, t in enumerate(plan["inputs"])}
    ctypes.update({("output", i): CTYPE[DType(t["dtype"])] for i, t in enumerate(plan["outputs"])})
    ctypes.update(
        {
            ("scratch", i): CTYPE[DType(s["dtype"])]
            for i, s in enumerate(plan["scratch"])
            if "dtype" in s
        }
    )
    prefix = {"input": "in", "output": "out", "scratch": "sc"}

    def ptr(ref: dict) -> str:
        ctype = ctypes.get((ref["kind"], ref["index"]), "float")
        return f"reinterpret_cast<{ctype}*>({prefix[ref['kind']]}{ref['index']}.data())"

    for launch in plan["launches"]:
        if launch.get("kind") == "gemm":
            ta, tc = CTYPE[DType(launch["dtype_ab"])], CTYPE[DType(launch["dtype_c"])]
            ops = []
            for role in ("a", "b", "c"):
                o = launch[role]
                ops.append(
                    f"{ptr(o['buf'])}, {o['offset']}, {o['ld']}, {o['stride']}"
                    + ("" if role == "c" else f", {str(o['trans']).lower()}")
                )
            bias, resid = launch.get("bias"), launch.get("residual")
            epilogue = f", {ptr(bias['buf'])}, {bias['offset']}" if bias else ""
            if resid:
                epilogue = (
                    f"{epilogue or ', nullptr, 0'}, {ptr(resid['buf'])}, {resid['offset']}, "
                    f"{resid['ld']}, {resid['stride']}"
                )
            lines.append(
                f"  mlso_emu::gemm<{ta}, {tc}>({launch['m']}, {launch['n']}, {launch['k']}, "
                f"{launch['batch']}, {', '.join(ops)}, {float(launch['alpha'])!r}f, "
                f"{float(launch['beta'])!r}f{epilogue});"
            )
            continue
        args = []
        for a in launch["args"]:
            key = (a["kind"], a["index"])
            ctype = ctypes.get(key, "float")
            args.append(f"reinterpret_cast<{ctype}*>({prefix[a['kind']]}{a['index']}.data())")
        g, b = launch["grid"], launch["block"]
        lines.append(
            f"  mlso_emu::launch(dim3{{{g[0]}u, {g[1]}u, {g[2]}u}}, dim3{{{b[0]}u, {b[1]}u, {b[2]}u}}, "
            f"{launch['smem']}, {launch['kernel']}, {', '.join(args)});"
        )
    for i in range(len(plan["outputs"])):
        lines.append(
            f'  mlso_emu::write_file((dir + "/out{i}.bin").c_str(), out{i}, {sizes[("output", i)]});'
        )
    lines += ["  return 0;", "}", ""]
    return "\n".join(lines)


def bundle_source(programs: Sequence[GeneratedProgram]) -> str:
    """One translation unit running program argv[2] of `programs` (kernels renamed per program)."""
    parts = ["#include <string>", '#include "mlso.cuh"']
    for i, gp in enumerate(programs):
        text = gp.source + "\n" + _runner(gp, f"run_p{i}")
        parts.append(re.sub(r"\bmlso_k(\d+)\b", rf"p{i}_k\1", text))
    cases = " ".join(f"case {i}: return run_p{i}(argv[1]);" for i in range(len(programs)))
    parts.append(
        f"int main(int argc, char** argv) {{ if (argc < 3) return 2; "
        f"switch (std::atoi(argv[2])) {{ {cases} }} return 2; }}"
    )
    return "\n".join(parts) + "\n"


def build(gp: GeneratedProgram) -> Path:
    """The emulation executable for gp (cached by content hash)."""
    return _build_source(driver(gp))


def _build_source(src: str) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise EnvironmentProblem(
            "no host C++ compiler (g++) for the kernel emulator",
            "Install g++ 12 or newer (nvcc needs one anyway).",
        )
    # templates_digest() covers the *.cuh files only (nvcc's key); the emulator also compiles
    # mlso_host_emu.h, so an edit to it must not reuse a binary built from the old one.
    emu_header = (TEMPLATES_DIR / "mlso_host_emu.h").read_bytes()
    key = hashlib.sha256(
        "\0".join(
            [src, " ".join(CXX_FLAGS), templates_digest(), hashlib.sha256(emu_header).hexdigest()]
        ).encode()
    ).hexdigest()
    root = knobs().cache_dir / "emu"
    exe = root / key
    if exe.is_file():
        return exe
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix="build-") as tmp:
        cpp = Path(tmp) / "main.cpp"
        cpp.write_text(src)
        out = Path(tmp) / "a.out"
        cmd = [cxx, *CXX_FLAGS, f"-I{TEMPLATES_DIR}", str(cpp), "-o", str(out)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            kept = root / f"{key}.failed.cpp"
            kept.write_text(src)
            raise RuntimeError(
                f"host emulation build failed; source kept at {kept}\n{res.stderr[:4000]}"
            )
        out.replace(exe)
    return exe


class Bundle:
    """Several programs in a few emulator binaries (one g++ run per binary, built in parallel)."""

    def __init__(self, programs: dict[str, GeneratedProgram], binaries: int = 2) -> None:
        import concurrent.futures as cf

        names = list(programs)
        chunks = [names[i::binaries] for i in range(binaries) if names[i::binaries]]
        with cf.ThreadPoolExecutor(len(chunks) or 1) as ex:
            exes = list(
                ex.map(lambda c: _build_source(bundle_source([programs[n] for n in c])), chunks)
            )
        self._where = {n: (exe, i) for c, exe in zip(chunks, exes) for i, n in enumerate(c)}
        self.programs = programs

    def run(
        self, name: str, inputs: Sequence[np.ndarray], timeout: float = 600
    ) -> list[np.ndarray]:
        exe, index = self._where[name]
        return _execute(exe, self.programs[name], inputs, timeout, [str(index)])


def run(
    gp: GeneratedProgram, inputs: Sequence[np.ndarray], timeout: float = 600
) -> list[np.ndarray]:
    """Execute gp on the CPU; outputs start as NaN, so unwritten elements stay NaN."""
    return _execute(build(gp), gp, inputs, timeout, [])


def _execute(
    exe: Path, gp: GeneratedProgram, inputs: Sequence[np.ndarray], timeout: float, extra: list[str]
) -> list[np.ndarray]:
    plan = gp.plan
    with tempfile.TemporaryDirectory() as tmp:
        for i, (x, t) in enumerate(zip(inputs, plan["inputs"])):
            arr = np.ascontiguousarray(np.asarray(x).astype(numpy_dtype(t["dtype"])))
            if list(arr.shape) != list(t["shape"]):
                raise ValueError(f"input {i} has shape {arr.shape}, the plan wants {t['shape']}")
            (Path(tmp) / f"in{i}.bin").write_bytes(arr.tobytes())
        res = subprocess.run(
            [str(exe), tmp, *extra], capture_output=True, text=True, timeout=timeout
        )
        if res.returncode != 0:
            raise RuntimeError(f"emulated run failed ({res.returncode}): {res.stderr[:2000]}")
        outs = []
        for i, t in enumerate(plan["outputs"]):
            data = (Path(tmp) / f"out{i}.bin").read_bytes()
            outs.append(
                np.frombuffer(data, dtype=numpy_dtype(t["dtype"])).reshape(t["shape"]).copy()
            )
        return outs
