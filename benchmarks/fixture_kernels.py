"""Time the generated kernels of fixture μGraphs on the GPU (CUDA-graph replay), as BENCHMARKS.md says.

    python benchmarks/fixture_kernels.py --fixtures tests.fixtures.ugraphs --out bench.json
    python benchmarks/fixture_kernels.py --fixtures tests.fixtures.ugraphs --only gqa_bs1,ntrans_bs16

The module named by --fixtures exposes FIXTURES: dict[str, Callable[[], KernelGraph]]. Each graph is
generated and compiled (nvcc, cached), loaded with the PyCUDA launcher, and timed: median of
--repeats (5) repeats of --iters (200) runs replayed from one CUDA graph, random non-zero normal
inputs, input buffers rotated through several copies when they fit in the 60 MB L2. Prints a
markdown table (name, µs, target µs from BENCHMARKS.md where there is one) and writes JSON to --out.
A fixture that fails to compile or run is reported and the others still run (exit status 1).
--verify also checks each output against the float64 interpreter (slow for large fixtures); where
normal inputs give a non-finite reference (a variance drawn negative), inputs from [0.5, 1.5).
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGETS_US: dict[str, float] = {
    "gqa_bs1": 12.2,
    "gqa_bs8": 26.1,
    "gqa_bs16": 26.2,
    "qknorm_gqa_bs1": 14.8,
    "qknorm_gqa_bs8": 28.0,
    "qknorm_gqa_bs16": 28.0,
    "rmsnorm_linear_bs1": 13.0,
    "rmsnorm_linear_bs8": 13.1,
    "rmsnorm_linear_bs16": 13.2,
    "lora_bs1": 6.0,
    "gated_mlp_bs1": 18.8,
    "ntrans_bs1": 2.2,
    "ntrans_bs8": 2.2,
    "ntrans_bs16": 2.2,
}
"""Targets of BENCHMARKS.md (max(best peer / 1.5, floor / 0.9)), microseconds."""


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--fixtures", default="", help="module path exposing FIXTURES, e.g. tests.fixtures.ugraphs"
    )
    p.add_argument(
        "--graphs",
        default="",
        help="also time every μGraph JSON file in this folder (e.g. the "
        "programs `search_bench.py --save` wrote), named 'searched:<file stem>'",
    )
    p.add_argument("--only", default="", help="comma-separated names or globs (default: all)")
    p.add_argument("--out", default="", help="write JSON results here")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--device", type=int, default=0)
    p.add_argument(
        "--verify", action="store_true", help="compare outputs with the float64 interpreter"
    )
    p.add_argument(
        "--hot",
        action="store_true",
        help="also time each program with one input set (no rotation): inputs that fit stay in "
        "L2 from run to run, as in `mlso bench`, which feeds the same tensors every call",
    )
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="generate and compile (filling the nvcc cache) without a GPU; time nothing",
    )
    return p.parse_args()


def _selected(names: list[str], only: str) -> list[str]:
    if not only:
        return names
    pats = [s.strip() for s in only.split(",") if s.strip()]
    return [n for n in names if any(fnmatch.fnmatch(n, p) for p in pats)]


def _saved_graphs(folder: Path) -> dict:
    """μGraph JSON files as fixture loaders, named 'searched:<stem>' (stems sorted)."""
    from mlso_cli.ir import serialize

    return {
        f"searched:{f.stem}": (lambda f=f: serialize.loads(f.read_text()))
        for f in sorted(folder.glob("*.json"))
    }


def _verify(kg, prog) -> float:
    """Largest norm-wise relative error of the outputs against the float64 interpreter."""
    import numpy as np

    from mlso_cli.runtime.launcher import numpy_dtype
    from mlso_cli.verify.interpreter import run

    rng = np.random.default_rng(7)
    ins = [rng.standard_normal(n.shape).astype(numpy_dtype(n.dtype.value)) for n in kg.inputs]
    want = run(kg, ins, mode="float64")
    if not all(np.isfinite(w).all() for w in want):  # e.g. a BatchNorm variance drawn negative
        ins = [rng.uniform(0.5, 1.5, n.shape).astype(numpy_dtype(n.dtype.value)) for n in kg.inputs]
        want = run(kg, ins, mode="float64")
    got = prog.run(ins, poison_outputs=True)
    errs = []
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        errs.append(float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)))
    return max(errs)


def main() -> int:
    args = _parse()
    from mlso_cli.codegen import compile_program
    from mlso_cli.runtime.launcher import Program

    fixtures = dict(importlib.import_module(args.fixtures).FIXTURES) if args.fixtures else {}
    if args.graphs:
        fixtures.update(_saved_graphs(Path(args.graphs)))
    if not fixtures:
        print("nothing to time: give --fixtures MODULE and/or --graphs DIR", file=sys.stderr)
        return 2
    names = _selected(list(fixtures), args.only)
    gpu = ""
    try:
        import pycuda.driver as cuda

        cuda.init()
        gpu = cuda.Device(args.device).name()
    except Exception as exc:  # reported in the JSON; every fixture will then fail to load
        gpu = f"unavailable ({exc})"
    results, errors = [], []
    for name in names:
        try:
            t0 = time.time()
            kg = fixtures[name]()
            cp = compile_program(kg)
            compile_s = time.time() - t0
            if args.compile_only:
                print(f"{name}: compiled ({compile_s:.1f} s)", file=sys.stderr)
                continue
            hot = None
            with Program(cp.fatbin, cp.plan, device=args.device) as prog:
                t = prog.time(warmup=args.warmup, repeats=args.repeats, iters=args.iters)
                if args.hot:
                    hot = prog.time(
                        warmup=args.warmup,
                        repeats=args.repeats,
                        iters=args.iters,
                        rotate_buffers=1,
                    )
                err = _verify(kg, prog) if args.verify else None
            row = {
                "name": name,
                "us": round(t.median_us, 3),
                "samples_us": [round(s, 3) for s in t.samples_us],
                "method": t.method,
                "rotated_sets": t.rotated_sets,
                "launches": len(cp.plan["launches"]),
                "smem_max": cp.plan["smem_max"],
                "target_us": TARGETS_US.get(name.removeprefix("searched:")),
                "compile_s": round(compile_s, 2),
            }
            if hot is not None:
                row["hot_us"] = round(hot.median_us, 3)
            if err is not None:
                row["rel_error"] = err
            if t.note:
                row["note"] = t.note
            results.append(row)
            print(
                f"{name}: {t.median_us:.2f} us ({t.method}, {len(cp.plan['launches'])} launches)",
                file=sys.stderr,
            )
        except Exception as exc:
            errors.append(
                {
                    "name": name,
                    "error": f"{type(exc).__name__}: {exc}",
                    "trace": traceback.format_exc(),
                }
            )
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", file=sys.stderr)

    print(
        "\n| fixture | µs | µs, L2-resident inputs | target µs | launches | method |"
        "\n|---|---:|---:|---:|---:|---|"
    )
    for r in results:
        target = f"{r['target_us']:.1f}" if r["target_us"] else "—"
        hot_us = f"{r['hot_us']:.2f}" if "hot_us" in r else "—"
        print(
            f"| {r['name']} | {r['us']:.2f} | {hot_us} | {target} | {r['launches']} "
            f"| {r['method']} |"
        )
    for e in errors:
        print(f"| {e['name']} | FAILED: {e['error'][:80]} | | | | |")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "gpu": gpu,
                    "repeats": args.repeats,
                    "iters": args.iters,
                    "results": results,
                    "errors": errors,
                },
                indent=1,
            )
        )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
