"""Row kernels (a norm and its reader in one kernel) with a warp per row against the team that
codegen/rowkernel.py chooses, on the GPU machine, in one process.

Why: at 128 tokens a norm has 128 rows of 2048-3072; a warp per row took 10.7 us (Llama-1B width)
and 20 us (Phi-3) on an H100 inside the optimized models (benchmarks/kernel_profile.py), where
the DRAM floor is under 1 us. This times the same μGraphs both ways (the warp forced by patching
rowkernel.row_team), each program by the PyCUDA launcher's CUDA-graph replay:
  - RMSNorm alone (the row kernel is the whole program);
  - RMSNorm + linear (the row kernel stages the library GEMM's operand; GEMM included).

    python3 benchmarks/row_kernels.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlso_cli.codegen import rowkernel  # noqa: E402
from mlso_cli.ir import DType  # noqa: E402
from tests import test_codegen_rows as R  # noqa: E402

CASES = [
    # row name, builder: rows are 2 * rows argument for rmsnorm (its batch of 2)
    ("rmsnorm 128x896", lambda: R.rmsnorm(DType.F16, rows=64, n=896)),
    ("rmsnorm 128x2048", lambda: R.rmsnorm(DType.F16, rows=64, n=2048)),
    ("rmsnorm 128x3072", lambda: R.rmsnorm(DType.F16, rows=64, n=3072)),
    ("rmsnorm 8x4096", lambda: R.rmsnorm(DType.F16, rows=4, n=4096)),
    ("rmsnorm 4096x4096", lambda: R.rmsnorm(DType.F16, rows=2048, n=4096)),
    ("rmsnorm+linear 128x2048x3072", lambda: R.norm_linear(DType.F16, m=128, k=2048, n=3072)),
    ("rmsnorm+linear 128x3072x9216", lambda: R.norm_linear(DType.F16, m=128, k=3072, n=9216)),
]


def _time(kg) -> dict:
    from mlso_cli.codegen import compile_program
    from mlso_cli.runtime import launcher

    cp = compile_program(kg)
    with launcher.Program(cp.fatbin, cp.plan) as p:
        r = p.time(warmup=5, repeats=7, iters=100)
    row = next(k for k in cp.plan["launches"] if k.get("kind", "kernel") == "kernel")
    return {"us": r.median_us, "method": r.method, "block": row["block"][0], "grid": row["grid"][0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    chosen_team = rowkernel.row_team
    rows = []
    teams = (64, 128, 256, 512)
    print(
        "| program (fp16) | warp per row µs | chosen µs (threads per row) | warp / chosen | "
        + " | ".join(f"{t} per row µs" for t in teams)
        + " |"
    )
    print("|---|---|---|---|" + "---|" * len(teams))
    for name, build in CASES:
        rowkernel.row_team = lambda rows, length: 32
        warp = _time(build())
        rowkernel.row_team = chosen_team
        chosen = _time(build())
        team = chosen_team(*_rows_length(name))
        ratio = warp["us"] / chosen["us"]
        # every block team, forced, to tune row_team's thresholds (MIN_PER_THREAD, the cap)
        forced = {}
        for t in teams:
            rowkernel.row_team = lambda rows, length, t=t: t
            forced[t] = _time(build())["us"]
        rowkernel.row_team = chosen_team
        rows.append(
            {"row": name, "warp": warp, "chosen": chosen, "team": team, "ratio": ratio,
             "forced_us": forced}
        )  # fmt: skip
        print(
            f"| {name} | {warp['us']:.1f} | {chosen['us']:.1f} ({team}) | {ratio:.2f}x | "
            + " | ".join(f"{forced[t]:.1f}" for t in teams)
            + " |",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


def _rows_length(name: str) -> tuple[int, int]:
    """(rows, row length) from a row name's `RxL` or `RxLxN`."""
    dims = name.split()[-1].split("x")
    return int(dims[0]), int(dims[1])


if __name__ == "__main__":
    sys.exit(main())
