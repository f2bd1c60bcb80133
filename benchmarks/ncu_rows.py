"""What bounds a row of issue 33's table: its mlso programs' kernels under Nsight Compute.

Issue 33 asks, for a row that misses its target, ncu figures that show what bounds it. This runs
a row's two mlso candidates (the searched program and the library baseline, as
benchmarks/hopper_table.py builds them) once each, on random inputs, and nothing else (no torch
peers, no timing loop), so that ncu profiles exactly their launches:

    ncu --clock-control none --section SpeedOfLight --csv --page details \\
        python3 benchmarks/ncu_rows.py --rows rmsnorm_linear_bs1

Each candidate runs twice (the first run loads modules and chooses cuBLASLt algorithms); a line
on stderr names which launches belong to which candidate, in order, so the CSV rows can be read
against them. `benchmarks/gpu_run.sh ncu` runs it per row and bundles the CSVs.

Without a CUDA GPU it prints that it skipped and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.hopper_table import _NP, baseline_program, rows, select  # noqa: E402


def _inputs(kg, model, constants, rng: np.random.Generator) -> list[np.ndarray]:
    """Random operands for `kg` in its input order: the model's initializers as stored, lifted
    constants as lifted, everything else normal at 0.5 (index inputs over their valid range)."""
    from onnx import numpy_helper

    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    out = []
    for n, name in zip(kg.inputs, kg.input_names):
        dt = _NP[n.dtype.value]
        if name in inits:
            out.append(np.ascontiguousarray(inits[name].astype(dt)))
        elif constants and name in constants:
            out.append(np.ascontiguousarray(np.asarray(constants[name]).astype(dt)))
        elif np.dtype(dt).kind in "iu":
            out.append(rng.integers(0, 2, n.shape).astype(dt))
        else:
            out.append((rng.standard_normal(n.shape) * 0.5).astype(dt))
    return out


def run_row(row, rng: np.random.Generator) -> None:
    from mlso_cli.codegen import compile_program
    from mlso_cli.ir import serialize
    from mlso_cli.runtime.launcher import Program

    model = row.build()
    candidates = []
    if row.program.exists():
        candidates.append(("searched", serialize.loads(row.program.read_text()), None))
    lifted = baseline_program(model)
    if lifted is not None:
        candidates.append(("baseline", *lifted))
    for which, kg, constants in candidates:
        cp = compile_program(kg, constants=constants)
        kinds = [k.get("kind", "kernel") for k in cp.plan["launches"]]
        print(
            f"{row.name} {which}: {len(kinds)} launches a run ({', '.join(kinds)}), run twice",
            file=sys.stderr,
        )
        feeds = _inputs(kg, model, constants, rng)
        with Program(cp.fatbin, cp.plan, device=0) as prog:
            for _ in range(2):
                prog.run(feeds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", required=True, help="comma-separated names or globs")
    args = ap.parse_args(argv)
    try:
        import pycuda.driver as cuda

        cuda.init()
        if cuda.Device.count() == 0:
            raise RuntimeError("no device")
    except Exception as exc:  # noqa: BLE001
        print(f"ncu_rows: skipped, no CUDA GPU ({type(exc).__name__})", file=sys.stderr)
        return 0
    rng = np.random.default_rng(0)
    chosen = select(rows(), args.rows)
    if not chosen:
        print(f"ncu_rows: no row matches {args.rows!r}", file=sys.stderr)
        return 2
    for row in chosen:
        run_row(row, rng)
    return 0


if __name__ == "__main__":
    sys.exit(main())
