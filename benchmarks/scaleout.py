"""Search wall time on the local process pool against Ray clusters of the same CPU count.

For every N in --cpus and every model, this times (wall clock, as a user would see it)

    mlso optimize MODEL --dry-run --json --no-cache --executor local --jobs N
    mlso optimize MODEL --dry-run --json --no-cache --executor ray=ADDRESS

the second on a local Ray cluster of N CPUs started here (one head node, no dashboard) and shut
down after its row, so a Ray time includes joining the cluster but not starting it (the cluster's
start is its own column). Both runs must report the same search result per region (states,
verified programs, best estimate): the "same" column says whether they did.

    python -m benchmarks.scaleout MODEL... [--spec gqa:16 ...] [--cpus 1,2,4,8,16]
        [--max-states N] [--input-shape NAME=D0,D1,...] [--json FILE] [--record]

--spec NAME:BS builds a benchmark row (models/build_models.py SPECS, fp16, real width) into a
temporary folder. Needs the `ray` extra (pip install 'mlso[ray]'). Prints a Markdown table for
benchmarks/RESULTS.md, a row as each is measured; measure on a machine with at least max(--cpus)
free cores. With more than one model, each CPU count also gets a row for the whole set (the
models' times summed). --record appends every row to benchmarks/results/scaleout.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _env(cache: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "MLSO_CACHE_DIR": str(cache)}


def run_one(model: Path, executor: list[str], args: argparse.Namespace, cache: Path) -> dict:
    """One optimize run: its wall seconds and each region's search figures."""
    cmd = [sys.executable, "-m", "mlso_cli", "optimize", str(model), "--dry-run", "--json"]
    cmd += ["--no-cache", *executor]
    if args.max_states is not None:
        cmd += ["--max-states", str(args.max_states)]
    for shape in args.input_shape:
        cmd += ["--input-shape", shape]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, env=_env(cache), cwd=ROOT, timeout=args.timeout)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.decode()[-800:]}")
    rows = [json.loads(x) for x in p.stdout.decode().splitlines() if x.startswith("{")]
    regions = [
        (r["hash"], r["states"], r["verified"], r["estimate_us"])
        for r in rows
        if r.get("type") == "region"
    ]
    return {"wall_s": wall, "regions": regions}


def build_specs(specs: list[str], folder: Path) -> list[Path]:
    import onnx

    from models.build_models import SPECS

    out = []
    for s in specs:
        name, _, bs = s.partition(":")
        path = folder / f"{name}_bs{bs or 1}.onnx"
        onnx.save(SPECS[name].build(int(bs or 1), "float16", small=False), str(path))
        out.append(path)
    return out


def measure(models: list[Path], cpus: list[int], args: argparse.Namespace) -> list[dict]:
    from ray.cluster_utils import Cluster

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        for n in cpus:
            local = {
                m: run_one(m, ["--executor", "local", "--jobs", str(n)], args, cache)
                for m in models
            }
            t0 = time.perf_counter()
            cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": n,
                    "include_dashboard": False,
                    "object_store_memory": args.object_store_mb * 1024**2,
                },
            )
            start = time.perf_counter() - t0
            try:
                ray = {
                    m: run_one(m, ["--executor", f"ray={cluster.address}"], args, cache)
                    for m in models
                }
            finally:
                cluster.shutdown()
            for m in models:
                rows.append(
                    {
                        "model": m.stem,
                        "cpus": n,
                        "local_s": local[m]["wall_s"],
                        "ray_s": ray[m]["wall_s"],
                        "cluster_start_s": start,
                        "same": local[m]["regions"] == ray[m]["regions"],
                    }
                )
                # each row as it is measured, so a run stopped at a time limit keeps its rows
                print(table_row(rows[-1]), flush=True)
                if args.json is not None:
                    args.json.write_text(json.dumps(rows, indent=1) + "\n")
                if args.record:
                    record(rows[-1], args.max_states)
            if len(models) > 1:
                total = set_total(rows[-len(models) :])
                print(table_row(total), flush=True)
                if args.record:
                    record(total, args.max_states)
            print(f"# {n} CPUs done", file=sys.stderr, flush=True)
    return rows


def set_total(rows: list[dict]) -> dict:
    """One CPU count's rows summed: the wall time of searching the whole set, one model after
    another, as a batch would."""
    return {
        "model": f"all {len(rows)} models",
        "cpus": rows[0]["cpus"],
        "local_s": sum(r["local_s"] for r in rows),
        "ray_s": sum(r["ray_s"] for r in rows),
        "cluster_start_s": rows[0]["cluster_start_s"],
        "same": all(r["same"] for r in rows),
    }


def machine() -> str:
    """The CPU model and core count, for the record (the table is about CPUs, not the GPU)."""
    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} logical CPUs"


def record(r: dict, max_states: int | None) -> None:
    """Append one row to benchmarks/results/scaleout.json (RESULTS.md's "Scale-out" table)."""
    from benchmarks.results_table import append

    figures = {
        "CPUs": r["cpus"],
        "process pool s": round(r["local_s"], 1),
        "Ray s": round(r["ray_s"], 1),
        "Ray / pool": round(r["ray_s"] / r["local_s"], 2),
        "cluster start s": round(r["cluster_start_s"], 1),
        "same result": "yes" if r["same"] else "NO",
        "budget": "default" if max_states is None else f"--max-states {max_states}",
    }
    append("scaleout", [(f"{r['model']}, {r['cpus']} CPUs", figures)], machine())


HEADER = (
    "| model | CPUs | process pool s | Ray s | Ray / pool | cluster start s | same result |\n"
    "| --- | ---: | ---: | ---: | ---: | ---: | --- |"
)


def table_row(r: dict) -> str:
    return (
        f"| {r['model']} | {r['cpus']} | {r['local_s']:.1f} | {r['ray_s']:.1f} | "
        f"{r['ray_s'] / r['local_s']:.2f} | {r['cluster_start_s']:.1f} | "
        f"{'yes' if r['same'] else 'NO'} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", type=Path)
    ap.add_argument("--spec", action="append", default=[], metavar="NAME:BS")
    ap.add_argument("--cpus", default="1,2,4,8,16")
    ap.add_argument("--max-states", type=int, default=None)
    ap.add_argument("--input-shape", action="append", default=[])
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--object-store-mb", type=int, default=200)
    ap.add_argument("--json", type=Path, default=None, help="Also write the rows here.")
    ap.add_argument(
        "--record", action="store_true", help="append each row to benchmarks/results/scaleout.json"
    )
    args = ap.parse_args(argv)
    cpus = [int(x) for x in args.cpus.split(",") if x.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        models = list(args.models) + build_specs(args.spec, Path(tmp))
        if not models:
            ap.error("name at least one MODEL or --spec")
        print(HEADER, flush=True)
        rows = measure(models, cpus, args)  # prints and writes (--json) each row as measured
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
