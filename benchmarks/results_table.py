"""benchmarks/RESULTS.md, the one current table of measured results, rendered from records.

Why: a results page written by hand, session after session, grows into a diary in which the
current figure of a row is hard to find and easy to misquote. Here every measurement is a record
in ``benchmarks/results/<table>.json`` (row, commit, date, machine, figures), written by the
script that measured it (``append``); RESULTS.md shows the newest record of every row and is
never edited by hand. The dated narrative of earlier sessions stays in HISTORY.md.

    python benchmarks/results_table.py            # rewrite RESULTS.md from the records
    python benchmarks/results_table.py --check    # exit 1 if RESULTS.md is not what they render
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RECORDS = HERE / "results"
RESULTS = HERE / "RESULTS.md"

TABLES: dict[str, tuple[str, str]] = {
    "real_decoders": (
        "Real exported decoders, whole model",
        "`benchmarks/real_decoders.py`: transformers decoders at a real checkpoint's layer width "
        "(2 layers, fp16, batch 1, sequence 128) under ONNX Runtime's CUDA EP, interleaved by "
        "`mlso bench` (median µs per call; speedup against the original in the same rounds), "
        "beside torch eager and torch.compile (reduce-overhead) on the same module.",
    ),
    "real_decoder_regions": (
        "Real exported decoders, per region: library baseline against ONNX Runtime",
        "`benchmarks/real_decoders.py`, from `mlso optimize --gpu 0 --json`: each region's "
        "baseline program (its lifted program: cuBLASLt GEMMs plus generated kernels for the "
        "rest) timed as served, its MlsoKernel node alone in ONNX Runtime, against the region's "
        "original nodes in the same trial and mode (µs). Issue 31's bar: `baseline / ORT` at most "
        "1.05. `baseline alone`: the program by CUDA-graph replay, without ORT; `chosen`: what "
        "optimize picked for the region, as served.",
    ),
    "library_gemm": (
        "Library GEMMs alone",
        "`benchmarks/library_gemm.py`: a kernel-level matmul lowered to a cuBLASLt launch against "
        "the generated matmul and torch.matmul (cuBLAS) on the same fp16 operands, in one process "
        "(median µs; CUDA-graph replay on both sides). `library µs`: each GEMM's algorithm the "
        "cuBLASLt heuristic's first (the default); `timed algo µs`: chosen by timing at creation "
        "(MLSO_GEMM_ALGO=timed). Caveat for the rows of 2026-12-05: the launcher rotated 2-64 "
        "operand sets to defeat L2 reuse while torch.matmul reused one set: every row's operands "
        "are under 60 MB, so torch read them "
        "from a warm L2 and `library / torch` overstates its lead. library_gemm.py now rotates "
        "torch's operand sets the same way.",
    ),
    "sm90_gemm": (
        "The sm_90a weight-streaming GEMM alone",
        "`benchmarks/sm90_gemm.py --record`: Y = X @ W with X of M rows and W at layer widths, the "
        "TMA + wgmma kernel of kernels_templates/mlso_sm90_gemm.cuh with `choose`'s configuration "
        "(token tile, consumer warpgroups, stages) and split count, against torch.matmul "
        "(cuBLAS) timed in a process of its own; both by CUDA-graph replay over operand sets "
        "rotated out of L2 (median µs). `% DRAM` of the card's peak (H100 3.35 TB/s). Not yet "
        "chosen by code generation.",
    ),
    "hopper_rows": (
        "Issue 33's table: searched programs against torch peers, with targets",
        "`benchmarks/hopper_table.py run --compile --record`, one process on one GPU: every "
        "benchmark row and the real-width subgraphs of `models/realwidth.py` (issue 33's "
        "classes). `mlso µs`: the program the CPU search chose (`benchmarks/searched_programs/`), "
        "by CUDA-graph replay with input sets rotated out of L2; in rows that have `searched µs` "
        "and `library baseline µs` columns, the faster of that program and the row's library "
        "baseline (its lifted program: cuBLASLt GEMMs and generated kernels), as `mlso optimize "
        "--gpu` chooses by timing (`chosen`); the peers on the same shapes and "
        "as many rotated sets: torch eager, SDPA on 4-D tensors (attention rows), torch.compile "
        "(default mode; where it compiled within the run's limits), each checked against mlso's "
        "output. `floor` = max(DRAM bytes at the card's datasheet peak, matmul FLOPs at "
        "790 TFLOP/s, 2 µs); `target` = max(best peer / 1.5, floor / 0.9); `% DRAM` and "
        "`% tensor`: mlso's time against the same two peaks; `mlso vs eager`: the norm-wise "
        "relative difference of the two outputs on the same inputs. A peer under 90% of the "
        "floor, or whose output disagrees with mlso's where another peer's agrees, is dropped "
        "(notes).",
    ),
    "model_level": (
        "Benchmark models, whole model",
        "`benchmarks/searched_models.py`: `mlso optimize --gpu 0` on the device, `mlso verify`, "
        "then original against optimized in ONNX Runtime, plain and under its CUDA graph.",
    ),
    "searched_programs": (
        "Searched programs alone",
        "`benchmarks/fixture_kernels.py --graphs benchmarks/searched_programs --verify --hot`: "
        "each program by CUDA-graph replay (µs; `hot` with inputs in L2) against the "
        "hand-written fixture of the tests in the same process.",
    ),
    "heldout_models": (
        "Held-out models, whole model",
        "`benchmarks/heldout_sweep.py --build-only`, then `searched_models.py --models`: "
        "subgraphs the search was not developed on, as `model_level`.",
    ),
    "scaleout": (
        "Scale-out: the search on a Ray cluster against the process pool",
        "`benchmarks/scaleout.py --record`: the wall time of `mlso optimize --dry-run --json "
        "--no-cache` per model on the local process pool (`--jobs N`) and on a local Ray cluster "
        "of N CPUs (`--executor ray=ADDRESS`; the cluster's start is its own column), and "
        "whether both found the same result per region. `all K models`: the set searched one "
        "model after another.",
    ),
    "search_cpu": (
        "The search on the CPU",
        "`benchmarks/search_bench.py`: `mlso optimize --dry-run --json --jobs 2` per benchmark "
        "row on 2 cores, fresh cache; what was found, how fast, and its estimate against the "
        "fixture's.",
    ),
}


def load_records() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted(RECORDS.glob("*.json")):
        for i, rec in enumerate(json.loads(path.read_text())):
            missing = {"table", "row", "commit", "date", "machine", "figures"} - set(rec)
            if missing:
                raise SystemExit(f"{path.name}[{i}]: record lacks {sorted(missing)}")
            out.append(rec)
    return out


def newest(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The newest record of each (table, row, machine): by date, and among equal dates the later
    one. A row measured on two GPUs keeps both figures (an H100 run does not hide the H200's)."""
    best: dict[tuple[str, str, str], tuple[str, int, dict]] = {}
    for i, rec in enumerate(records):
        key = (rec["table"], rec["row"], rec["machine"])
        if key not in best or (rec["date"], i) >= best[key][:2]:
            best[key] = (rec["date"], i, rec)
    tables: dict[str, list[dict[str, Any]]] = {}
    for (table, _row, _m), (_d, _i, rec) in sorted(best.items(), key=lambda kv: kv[1][1]):
        tables.setdefault(table, []).append(rec)
    return tables


def _cell(v: Any) -> str:
    if v is None:
        return "not run"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def render(records: list[dict[str, Any]]) -> str:
    tables = newest(records)
    lines = [
        "# Measured results",
        "",
        "The current figure of every benchmarked row, newest measurement first per row. This file",
        "is rendered by `python benchmarks/results_table.py` from the records in",
        "`benchmarks/results/`, which the benchmark scripts append to; do not edit it by hand.",
        "Peers, targets and how each number is taken: [docs/benchmarks.md](../docs/benchmarks.md).",
        "The dated notes of earlier sessions, with the measurements that led to each change, are in",
        "[HISTORY.md](HISTORY.md).",
    ]
    order = list(TABLES) + sorted(set(tables) - set(TABLES))
    for name in order:
        recs = tables.get(name)
        if not recs:
            continue
        title, how = TABLES.get(name, (name, ""))
        keys: list[str] = []
        for rec in recs:
            keys += [k for k in rec["figures"] if k not in keys and k != "row"]
        machines = sorted({rec["machine"] for rec in recs})
        lines += ["", f"## {title}", ""]
        if how:
            lines += [how, ""]
        lines.append("Machine: " + "; ".join(machines) + ".")
        several = len(machines) > 1
        if several:  # one table per GPU would repeat the rows; a column says which GPU
            recs = sorted(recs, key=lambda r: machines.index(r["machine"]))
        head = "| row | " + ("machine | " if several else "") + "commit | date | "
        lines += ["", head + " | ".join(keys) + " |"]
        lines.append("|---|---|---|" + ("---|" if several else "") + "---|" * len(keys))
        for rec in recs:
            figs = rec["figures"]
            cells = [rec["row"], *([rec["machine"]] if several else []), rec["commit"], rec["date"]]
            cells += [_cell(figs.get(k, "")) for k in keys]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _git_head() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short=7", "HEAD"],
            capture_output=True,
            text=True,
            cwd=HERE,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def append(table: str, rows: list[tuple[str, dict[str, Any]]], machine: str) -> Path:
    """Add one record per (row, figures) to benchmarks/results/<table>.json, stamped with the
    current commit and UTC date, written atomically (temp file, then os.replace).

    The GPU machine's copy of the tree carries a stale .git (the session's base commit), so a
    run there passes the real commit in MLSO_BENCH_COMMIT."""
    commit = os.environ.get("MLSO_BENCH_COMMIT", "").strip() or _git_head()
    date = dt.datetime.now(dt.timezone.utc).date().isoformat()
    path = RECORDS / f"{table}.json"
    existing = json.loads(path.read_text()) if path.exists() else []
    existing += [
        {
            "table": table,
            "row": row,
            "commit": commit,
            "date": date,
            "machine": machine,
            "figures": figures,
        }
        for row, figures in rows
    ]
    RECORDS.mkdir(exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=RECORDS, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(existing, f, indent=1, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if RESULTS.md is out of date")
    args = p.parse_args(argv)
    text = render(load_records())
    if args.check:
        if not RESULTS.exists() or RESULTS.read_text() != text:
            print(
                "benchmarks/RESULTS.md is not what benchmarks/results/ renders; "
                "run `python benchmarks/results_table.py`",
                file=sys.stderr,
            )
            return 1
        return 0
    RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
