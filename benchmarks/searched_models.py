"""`optimize --gpu 0` then `bench --gpu 0 --mode both` on benchmark models, as a user runs them.

For each row (models/bench/<name>_bs<bs>.onnx, built by `python -m models.build_models`):

    mlso optimize MODEL -o OUT --gpu 0 --json --force     (select: the top-K candidates timed)
    mlso verify MODEL OUT --gpu 0 --json                  (field, chain and float checks)
    mlso bench MODEL OUT --gpu 0 --mode both --json      (whole models, ORT with and without
                                                           CUDA graphs, interleaved in one run)

The search itself is the expensive part on a 2-core machine; run it there first with
`python -m benchmarks.search_bench --keep-cache DIR` and point MLSO_CACHE_DIR at DIR here, so that
`optimize` is served the same search results (the cache key is the region and the search options,
not the machine) and spends its device time on timing candidates. Prints a Markdown table.

    python3 benchmarks/searched_models.py --rows gqa_bs1,ntrans_bs8 [--out results.json]
        [--models DIR]   (rows are DIR/<row>.onnx; default models/bench)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlso_cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )


def _lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def run_row(
    row: str, out_dir: Path, timeout: float, models: Path = ROOT / "models" / "bench"
) -> dict:
    model = models / f"{row}.onnx"
    fast = out_dir / f"{row}.mlso.onnx"
    res: dict = {"row": row}
    t0 = time.monotonic()
    opt = _cli(
        "optimize", str(model), "-o", str(fast), "--gpu", "0", "--json", "--force", timeout=timeout
    )
    res["optimize_s"] = time.monotonic() - t0
    res["optimize_rc"] = opt.returncode
    regions = [x for x in _lines(opt.stdout) if x.get("type") == "region"]
    res["regions"] = regions
    if opt.returncode != 0:
        res["error"] = (opt.stderr.strip().splitlines() or ["?"])[-1]
        return res
    ver = _cli("verify", str(model), str(fast), "--gpu", "0", "--json", timeout=timeout)
    res["verify_rc"] = ver.returncode
    res["verify"] = _lines(ver.stdout)
    ben = _cli(
        "bench", str(model), str(fast), "--gpu", "0", "--mode", "both", "--json", timeout=timeout
    )
    res["bench_rc"] = ben.returncode
    res["bench"] = _lines(ben.stdout)
    if ben.returncode != 0:
        res["error"] = (ben.stderr.strip().splitlines() or ["?"])[-1]
    return res


def table(results: list[dict]) -> str:
    lines = [
        "| row | region: kernels, µs before → after (select) | verify rc | ORT µs | mlso µs | speedup | "
        "ORT+graph µs | mlso+graph µs | speedup (graph) |",
        "|" + "---|" * 9,
    ]
    for r in results:
        if "error" in r and not r.get("bench"):
            lines.append(f"| {r['row']} | error: {r['error'][:90]} |" + " |" * 7)
            continue
        chosen = "; ".join(
            f"{g.get('label', '?')}: {g.get('kernels')} k, {g.get('us_before')} → {g.get('us_after')}"
            for g in r["regions"]
        )
        # bench prints, per mode, the first model's row last: the one whose speedup is FAST's
        model = {
            b["mode"]: b for b in r["bench"] if b.get("type") == "model" and b.get("index") == 1
        }
        plain, graph = model.get("plain", {}), model.get("cuda-graph", {})

        def f(d: dict, k: str) -> str:
            return f"{d[k]:.1f}" if k in d else "—"

        lines.append(
            f"| {r['row']} | {chosen} | {r.get('verify_rc')} | {f(plain, 'orig_us')} | "
            f"{f(plain, 'fast_us')} | {plain.get('speedup', 0):.2f} | {f(graph, 'orig_us')} | "
            f"{f(graph, 'fast_us')} | {graph.get('speedup', 0):.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", required=True, help="comma-separated rows, e.g. gqa_bs1,ntrans_bs8")
    ap.add_argument("--out", type=Path, default=None, help="write every row's raw JSON here")
    ap.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/mlso-searched-models"),
        help="where the optimized models are written",
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per command")
    ap.add_argument(
        "--models",
        type=Path,
        default=ROOT / "models" / "bench",
        help="where <row>.onnx lies (e.g. heldout_sweep.py --build-only --keep-models DIR)",
    )
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results = []
    for row in args.rows.split(","):
        try:
            res = run_row(row.strip(), args.work, args.timeout, args.models)
        except subprocess.TimeoutExpired as exc:
            res = {
                "row": row,
                "error": f"timed out: {' '.join(map(str, exc.cmd[3:5]))}",
                "regions": [],
            }
        results.append(res)
        print(table([res]).splitlines()[-1], file=sys.stderr, flush=True)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
