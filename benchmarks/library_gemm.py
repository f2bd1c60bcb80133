"""Library GEMM launches against generated matmuls and torch.matmul, on the GPU machine.

Why: issue 31 rests on one claim, that a kernel-level matmul lowered to a cuBLASLt call runs at
library speed where the generated sm_80 matmul does not. This times, in one process and on the
same shapes (real layer widths: Qwen2-0.5B and Llama-1B projections at 128 tokens):
  - the program with library GEMMs (MLSO_LIBRARY_GEMM=1), each GEMM's algorithm chosen by timing
    at creation (MLSO_GEMM_ALGO=timed) and the cuBLASLt heuristic's first (the default),
  - the same program with every matmul generated (MLSO_LIBRARY_GEMM=0),
  - torch.matmul on the same operands (a cuBLAS call: the library-parity reference).
Each program is timed by the PyCUDA launcher (CUDA-graph replay when it can capture).

    python3 benchmarks/library_gemm.py [--out results.json] [--record]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.peers_inprocess import cuda_graph_time  # noqa: E402
from mlso_cli import knobs  # noqa: E402
from mlso_cli.ir import DType  # noqa: E402
from mlso_cli.runtime.launcher import operand_sets  # noqa: E402
from tests import test_libgemm as L  # noqa: E402


def _plain(m: int, k: int, n: int):
    return L.plain(DType.F16, 1, m, k, n)


def _norm_linear(m: int, k: int, n: int):
    return L.norm_linear(DType.F16, m, k, n)


SHAPES = [
    # row label, program builder, (m, k, n): the builder's shape and the torch reference's
    ("qwen2-0.5b up", _plain, (128, 896, 4864)),
    ("qwen2-0.5b down", _plain, (128, 4864, 896)),
    ("llama-1b up", _plain, (128, 2048, 8192)),
    ("llama-1b down", _plain, (128, 8192, 2048)),
    ("llama-1b gate/up merged", _plain, (128, 2048, 16384)),
    ("qwen2-0.5b qkv merged", _plain, (128, 896, 1152)),
    ("llama-1b q", _plain, (128, 2048, 2048)),
    ("rmsnorm+linear", _norm_linear, (128, 896, 4864)),
    ("decode up", _plain, (1, 2048, 8192)),
]
CASES = [(f"{label} {m}x{k}x{n}", build, (m, k, n)) for label, build, (m, k, n) in SHAPES]
"""(row name, builder of (m, k, n), (m, k, n)); row names are the records' keys in results/."""


def _time_program(kg, library: bool, algo: str = "heuristic") -> dict:
    from mlso_cli.codegen import compile_program
    from mlso_cli.runtime import launcher

    os.environ["MLSO_LIBRARY_GEMM"] = "1" if library else "0"
    os.environ["MLSO_GEMM_ALGO"] = algo  # read by the runtime library when a program is loaded
    knobs.cache_clear()
    cp = compile_program(kg)
    with launcher.Program(cp.fatbin, cp.plan) as p:
        r = p.time(warmup=5, repeats=7, iters=100)
        choices = p.library_choices()
    kinds = [launch.get("kind", "kernel") for launch in cp.plan["launches"]]
    return {"us": r.median_us, "method": r.method, "launches": kinds, "algo": choices}


def _time_torch(m: int, k: int, n: int) -> float:
    """torch.matmul under the same L2 conditions as the launcher's timing: as many operand sets,
    each captured call reading the next (one set let torch read weights from a warm L2)."""
    import torch

    sets = operand_sets((m * k + k * n) * 2)
    ops = [
        (
            torch.randn(m, k, device="cuda", dtype=torch.float16),
            torch.randn(k, n, device="cuda", dtype=torch.float16),
        )
        for _ in range(sets)
    ]
    calls = itertools.count()

    def one() -> object:
        a, w = ops[next(calls) % sets]
        return a @ w

    return cuda_graph_time(torch, one, iters=200, repeats=7)


def _gpu_name() -> str:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
    )
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else "GPU"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--record", action="store_true", help="append records to benchmarks/results")
    ap.add_argument(
        "--skip-generated-over",
        type=int,
        default=10**9,
        help="skip the generated matmul where m*k*n exceeds this (it can take minutes)",
    )
    ap.add_argument("--rows", default="", help="only rows whose name contains this text")
    args = ap.parse_args()
    rows = []
    print(
        "| shape (fp16) | library GEMM µs | with timed algo µs | generated µs |"
        " torch.matmul µs | library / torch |"
    )
    print("|---|---|---|---|---|---|")
    for name, build, (m, k, n) in CASES:
        if args.rows not in name:
            continue
        kg = build(m, k, n)
        lib = _time_program(kg, True)
        timed = _time_program(kg, True, "timed")
        gen = _time_program(kg, False) if m * k * n <= args.skip_generated_over else None
        ref = _time_torch(m, k, n)
        row = {"shape": name, "library": lib, "timed": timed, "generated": gen, "torch_us": ref}
        rows.append(row)
        g = f"{gen['us']:.1f}" if gen else "skipped"
        print(
            f"| {name} | {lib['us']:.1f} ({'+'.join(lib['launches'])}) | {timed['us']:.1f} | {g} |"
            f" {ref:.1f} | {lib['us'] / ref:.2f} |",
            flush=True,
        )
        print(f"  timed algorithms: {'; '.join(timed['algo'])}", file=sys.stderr, flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    if args.record:
        from benchmarks import results_table

        results_table.append(
            "library_gemm",
            [
                (
                    row["shape"],
                    {
                        "library µs": round(row["library"]["us"], 1),
                        "timed algo µs": round(row["timed"]["us"], 1),
                        "generated µs": round(row["generated"]["us"], 1)
                        if row["generated"]
                        else None,
                        "torch.matmul µs": round(row["torch_us"], 1),
                        "library / torch": round(row["library"]["us"] / row["torch_us"], 2),
                    },
                )
                for row in rows
            ],
            machine=_gpu_name(),
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
