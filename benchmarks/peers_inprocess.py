"""Peers measured in the same process as mlso's fixture programs (GPU machine; needs torch).

For each BENCHMARKS.md row: torch eager (and SDPA for gqa) captured in a CUDA graph and replayed,
next to mlso's fixture program (tests/fixtures/ugraphs.py, compiled by codegen) timed by the
launcher's CUDA-graph replay. Median of 5 x 200 replays, random normal fp16 inputs. torch's
inputs are not rotated (the launcher's are), which favours torch where inputs fit in L2.

    python3 benchmarks/peers_inprocess.py --out peers.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EPS = 1e-6


def graph_time_us(
    torch: Any, calls: list[Callable[[], Any]], iters: int = 200, repeats: int = 5
) -> tuple[float, float]:
    """(median µs per call, wall-clock µs per call of one replay): `iters` calls (cycling
    through `calls`, one per operand set) captured in one CUDA graph and replayed `repeats`
    times. The events are recorded on the stream `graph.replay()` launches on (the current one):
    events on another stream time an empty interval."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            calls[i % len(calls)]()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            calls[i % len(calls)]()
    stream = torch.cuda.current_stream()
    graph.replay()  # warm the graph itself
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        graph.replay()
        end.record(stream)
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / iters)
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e6 / iters
    del graph
    return statistics.median(samples), wall


def cuda_graph_time(torch, fn, iters: int = 200, repeats: int = 5) -> float:
    """Median µs per call of fn by `graph_time_us` (the benchmarks' one torch timer: peers here,
    real_decoders.py, library_gemm.py, hopper_table.py)."""
    return graph_time_us(torch, [fn], iters, repeats)[0]


def _peers(torch, row: str) -> dict[str, float]:
    F = torch.nn.functional
    name, _, bs = row.rpartition("_bs")
    bs = int(bs)
    g = 2 * bs
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16)  # noqa: E731

    def rms(x, w, dim=-1):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(dim, keepdim=True) + EPS)).half() * w

    out = {}
    if name in ("gqa", "qknorm_gqa"):
        q, k, v = r(g, 256, 64), r(g, 64, 4096), r(g, 4096, 64)
        wq, wv = r(64), r(64)
        if name == "gqa":
            out["eager"] = cuda_graph_time(torch, lambda: torch.softmax(q @ k, -1) @ v)
            kt = k.transpose(1, 2).contiguous()
            out["sdpa"] = cuda_graph_time(
                torch, lambda: F.scaled_dot_product_attention(q, kt, v, scale=1.0)
            )
        else:
            out["eager"] = cuda_graph_time(
                torch, lambda: torch.softmax(rms(q, wq) @ k, -1) @ rms(v, wv)
            )
    elif name == "rmsnorm_linear":
        x, w, gm = r(g, 4096), r(4096, 6144), r(4096)
        out["eager"] = cuda_graph_time(torch, lambda: rms(x, gm) @ w)
    elif name == "lora":
        x, w, a, b = r(16, 256), r(256, 4096), r(256, 16), r(16, 4096)
        out["eager"] = cuda_graph_time(torch, lambda: x @ w + (x @ a) @ b)
    elif name == "gated_mlp":
        x, w1, w2 = r(8, 4096), r(4096, 4096), r(4096, 4096)
        out["eager"] = cuda_graph_time(torch, lambda: F.silu(x @ w1) * (x @ w2))
    elif name == "ntrans":
        h, x, al, g1, g2 = r(bs, 4096), r(bs, 4096), r(bs, 4096), r(4096), r(4096)
        out["eager"] = cuda_graph_time(torch, lambda: rms(rms(h, g1) + x * al + x, g2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import torch

    from mlso_cli.codegen import compile_program
    from mlso_cli.runtime.launcher import Program
    from tests.fixtures.ugraphs import FIXTURES

    rows = [
        "gqa_bs1",
        "gqa_bs8",
        "gqa_bs16",
        "qknorm_gqa_bs1",
        "qknorm_gqa_bs8",
        "qknorm_gqa_bs16",
        "rmsnorm_linear_bs1",
        "rmsnorm_linear_bs8",
        "rmsnorm_linear_bs16",
        "lora_bs1",
        "gated_mlp_bs1",
        "ntrans_bs1",
        "ntrans_bs8",
        "ntrans_bs16",
    ]
    torch.cuda.init()
    results = []
    for row in rows:
        prog = compile_program(FIXTURES[row]())
        with Program(prog.fatbin, prog.plan, device=0) as p:
            mlso = p.time(warmup=10, repeats=5, iters=200).median_us
        peers = _peers(torch, row)
        results.append({"row": row, "mlso_us": mlso, **{f"{k}_us": v for k, v in peers.items()}})
        print(json.dumps(results[-1]), flush=True)
    args.out.write_text(json.dumps({"torch": torch.__version__, "results": results}, indent=1))
    print("\n| row | mlso µs | torch eager µs | SDPA µs | eager / mlso | SDPA / mlso |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        sd, m = r.get("sdpa_us"), r["mlso_us"]
        sdpa = f"{sd:.1f}" if sd else "—"
        ratio = f"{sd / m:.2f}x" if sd else "—"
        print(
            f"| {r['row']} | {m:.1f} | {r['eager_us']:.1f} | {sdpa} | {r['eager_us'] / m:.2f}x | {ratio} |"
        )


if __name__ == "__main__":
    main()
