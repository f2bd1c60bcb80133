"""Per-kernel GPU time of one ONNX Runtime inference (CUDA EP), on the GPU machine.

Why: `mlso bench` says how long a whole model takes, not where the time goes inside it. An
mlso-optimized model can be slower or faster than its parts suggest: Llama's gated-MLP region
took 59 µs around a 28 µs GEMM, and only a kernel-level view shows what fills the difference
(casts, copies, ORT's own kernels between MlsoKernel nodes, launch gaps). This opens each model
exactly as `mlso bench --gpu N` does (bench/compare.open_session: the mlso custom-op library
registered, the CUDA EP, optionally ONNX Runtime's CUDA graph), binds the same inputs bench
makes (bench/harness.random_feeds, device_values, bind_session), warms up, and profiles `--runs`
calls with torch.profiler. CUPTI sees every kernel in the process, ORT's and mlso's (generated
and cuBLASLt) alike. Kernels, memcpys and memsets are aggregated by name: calls per run, µs per
run, µs per call, sorted by µs per run.

    python3 benchmarks/kernel_profile.py MODEL.onnx [MODEL2.onnx ...] \
        [--input-shape name=1,128 ...] [--runs 20] [--cuda-graph] [--json OUT.json] [--top 40]

torch is imported inside main: the CPU machine's .venv has none (the GPU machine's system python
has it, with onnxruntime-gpu on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlso_cli.bench.compare import CUDA_GRAPH, PLAIN, open_session  # noqa: E402
from mlso_cli.bench.harness import bind_session, device_values, random_feeds  # noqa: E402
from mlso_cli.bench.models import open_model  # noqa: E402
from mlso_cli.errors import MlsoError  # noqa: E402
from mlso_cli.frontend.load import parse_input_shapes  # noqa: E402

NAME_WIDTH = 90


def _kind(name: str, cat: str = "") -> str:
    low = (cat or name).lower()
    if "memcpy" in low:
        return "memcpy"
    if "memset" in low:
        return "memset"
    return "kernel"


def _device_events(prof: Any) -> list[tuple[str, str, float]]:
    """(name, kind, µs) of every GPU activity the profiler recorded, from its event list."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        tr = e.time_range
        out.append((e.name, _kind(e.name), float(tr.end - tr.start)))
    return out


def _trace_events(prof: Any) -> list[tuple[str, str, float]]:
    """The same from the exported Chrome trace, read first: its kernel rows carry the launch's
    grid and block, which tell mlso's kernels apart (every program names its first kernel
    `mlso_k0`, so a norm and an attention kernel would share one row)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        trace = json.loads(Path(path).read_text())
    finally:
        Path(path).unlink(missing_ok=True)
    out = []
    for e in trace.get("traceEvents", []):
        cat = str(e.get("cat", "")).lower()
        if e.get("ph") == "X" and cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            name = str(e.get("name", "?"))
            args = e.get("args") or {}
            if name.startswith("mlso_") and "grid" in args and "block" in args:
                name += f" grid {args['grid']} block {args['block']}"
            out.append((name, _kind(name, cat), float(e["dur"])))
    return out


def _aggregate(events: list[tuple[str, str, float]], runs: int) -> list[dict]:
    by: dict[tuple[str, str], list[float]] = defaultdict(list)
    for name, kind, us in events:
        by[(name, kind)].append(us)
    rows = [
        {
            "name": name,
            "kind": kind,
            "calls_per_run": len(ds) / runs,
            "us_per_run": sum(ds) / runs,
            "us_per_call": sum(ds) / len(ds),
        }
        for (name, kind), ds in by.items()
    ]
    rows.sort(key=lambda r: r["us_per_run"], reverse=True)
    return rows


def _short(name: str) -> str:
    name = name.replace("|", "\\|")
    return name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 1] + "…"


def profile_model(source: str, shapes: dict, args: argparse.Namespace) -> dict:
    """Open `source` as `mlso bench --gpu` does, warm up, time and profile `args.runs` calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    mode = CUDA_GRAPH if args.cuda_graph else PLAIN
    model = open_model(source, shapes)
    sess = open_session(model, mode, args.gpu)
    bound = bind_session(sess, device_values(random_feeds(model.model), args.gpu), args.gpu)
    for _ in range(args.warmup):
        bound.call()
    bound.sync()
    torch.cuda.synchronize(args.gpu)

    # wall time without the profiler: back-to-back calls, as bench times them
    t0 = time.perf_counter()
    for _ in range(args.runs):
        bound.call()
    bound.sync()
    wall_us = (time.perf_counter() - t0) / args.runs * 1e6

    kw: dict[str, Any] = {"activities": [ProfilerActivity.CUDA]}
    try:
        prof_ctx = profile(**kw, acc_events=True)
    except TypeError:  # torch older than acc_events
        prof_ctx = profile(**kw)
    with prof_ctx as prof:
        t0 = time.perf_counter()
        for _ in range(args.runs):
            bound.call()
        bound.sync()
        torch.cuda.synchronize(args.gpu)
        profiled_wall_us = (time.perf_counter() - t0) / args.runs * 1e6

    events = _trace_events(prof)
    source_of_events = "chrome trace"
    if not events:
        events = _device_events(prof)
        source_of_events = "events()"
    rows = _aggregate(events, args.runs)
    notes = []
    if not rows:
        notes.append(
            "CUPTI recorded no GPU activity"
            + (
                " under CUDA graph replay (this CUDA/torch does not trace graph nodes; "
                "rerun without --cuda-graph)"
                if mode == CUDA_GRAPH
                else ""
            )
        )
    del bound, sess
    gc.collect()
    return {
        "model": model.source,
        "mode": mode,
        "gpu": args.gpu,
        "mlso_nodes": model.mlso_nodes,
        "inputs": {n: list(s) for n, s, _ in model.inputs},
        "runs": args.runs,
        "wall_us_per_run": wall_us,
        "profiled_wall_us_per_run": profiled_wall_us,
        "gpu_us_per_run": sum(r["us_per_run"] for r in rows),
        "kernel_us_per_run": sum(r["us_per_run"] for r in rows if r["kind"] == "kernel"),
        "launches_per_run": sum(r["calls_per_run"] for r in rows),
        "events_from": source_of_events,
        "notes": notes,
        "rows": rows,
    }


def print_report(rep: dict, top: int) -> None:
    print(f"\n## {rep['model']} ({rep['mode']}, GPU {rep['gpu']}, {rep['mlso_nodes']} MlsoKernel)")
    print(
        f"wall {rep['wall_us_per_run']:.1f} µs/run (profiled {rep['profiled_wall_us_per_run']:.1f}); "
        f"GPU activity {rep['gpu_us_per_run']:.1f} µs/run, kernels {rep['kernel_us_per_run']:.1f} "
        f"µs/run, {rep['launches_per_run']:.1f} launches/run, over {rep['runs']} runs "
        f"(from {rep['events_from']})"
    )
    for note in rep["notes"]:
        print(f"note: {note}")
    if not rep["rows"]:
        return
    total = rep["gpu_us_per_run"] or 1.0
    print()
    print("| # | kernel | kind | calls/run | µs/run | % | µs/call |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for i, r in enumerate(rep["rows"][:top], 1):
        print(
            f"| {i} | `{_short(r['name'])}` | {r['kind']} | {r['calls_per_run']:.2f} | "
            f"{r['us_per_run']:.2f} | {100 * r['us_per_run'] / total:.1f} | {r['us_per_call']:.2f} |"
        )
    rest = rep["rows"][top:]
    if rest:
        print(
            f"| | ({len(rest)} more) | | {sum(r['calls_per_run'] for r in rest):.2f} | "
            f"{sum(r['us_per_run'] for r in rest):.2f} | | |"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", metavar="MODEL.onnx")
    p.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="NAME=D0,D1,...",
        help="fix an input's shape, as for mlso bench (repeatable)",
    )
    p.add_argument("--runs", type=int, default=20, help="profiled calls per model [20]")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls first [10]")
    p.add_argument("--gpu", type=int, default=0, help="GPU index [0]")
    p.add_argument(
        "--cuda-graph", action="store_true", help="ONNX Runtime's CUDA graph (bench's cuda-graph)"
    )
    p.add_argument("--json", metavar="OUT.json", help="write every row of every model here")
    p.add_argument("--top", type=int, default=40, help="rows printed per model [40]")
    args = p.parse_args(argv)
    if args.runs < 1 or args.warmup < 0 or args.top < 1:
        p.error("--runs and --top must be >= 1, --warmup >= 0")

    import torch

    if not torch.cuda.is_available():
        print("kernel_profile: torch sees no CUDA device", file=sys.stderr)
        return 4
    torch.cuda.set_device(args.gpu)
    torch.cuda.init()  # one CUDA context (the primary one, shared with ONNX Runtime) before CUPTI

    try:
        shapes = parse_input_shapes(args.input_shape)
        reports = []
        for src in args.models:
            rep = profile_model(src, shapes, args)
            print_report(rep, args.top)
            reports.append(rep)
    except MlsoError as exc:
        print(f"kernel_profile: {exc.one_line()}", file=sys.stderr)
        return int(exc.exit_code)
    if len(reports) > 1:
        print("\n## summary\n")
        print("| model | mode | wall µs/run | GPU µs/run | kernel µs/run | launches/run |")
        print("|---|---|---:|---:|---:|---:|")
        for r in reports:
            print(
                f"| {r['model']} | {r['mode']} | {r['wall_us_per_run']:.1f} | "
                f"{r['gpu_us_per_run']:.1f} | {r['kernel_us_per_run']:.1f} | "
                f"{r['launches_per_run']:.1f} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1))
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
