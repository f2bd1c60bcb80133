"""Which cuBLASLt algorithm a real-width GEMM should run, against the one torch's cuBLAS call picks.

Why: on an H100 the library GEMM at 128x2048x8192 (Llama-1B's up projection) ran 14.8 us where
torch.matmul on the same operands ran 8.9 us, and timing the heuristic's 8 candidates did not
close the gap. This probe, on the GPU machine, in one process and with rotating operand sets (as
many as keep the weights out of L2, as a model's layers do), times:
  - torch.matmul, with the kernel names its cuBLAS call launches;
  - every algorithm cuBLASLt's heuristic lists (up to 64), called through ctypes, CUDA-graph
    replayed on torch's stream;
  - every algorithm id x tile x split-K x stages that cublasLtMatmulAlgoCheck accepts (capped);
and prints the best of each with its configuration. Nothing here is used by mlso at run time.

    python3 benchmarks/cublaslt_probe.py [--shapes 128x2048x8192,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import sys

_CUBLAS_COMPUTE_32F = 68
_CUDA_R_32F = 0
_CUDA_R_16F = 2
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE = 1
_CAP_SPLITK, _CAP_REDUCTION, _CAP_SWIZZLE, _CAP_TILE_IDS, _CAP_STAGES_IDS = 0, 1, 2, 6, 13
_CFG_ID, _CFG_TILE, _CFG_SPLITK, _CFG_REDUCTION, _CFG_SWIZZLE, _CFG_STAGES = 0, 1, 2, 3, 4, 6
_WORKSPACE = 32 << 20


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [
        ("algo", Algo),
        ("workspaceSize", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("wavesCount", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def _lib():
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("no libcublasLt.so found")


class Lt:
    """The few cuBLASLt entry points the probe needs, with one handle and one GEMM's descriptors."""

    def __init__(self, torch, m: int, k: int, n: int) -> None:
        self.lib = _lib()
        self.torch = torch
        self.m, self.k, self.n = m, k, n
        self.handle = ctypes.c_void_p()
        self._ok(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "create")
        self.desc = ctypes.c_void_p()
        self._ok(
            self.lib.cublasLtMatmulDescCreate(
                ctypes.byref(self.desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F
            ),
            "desc",
        )
        n_op = ctypes.c_int(0)
        for attr in (_DESC_TRANSA, _DESC_TRANSB):
            self._ok(
                self.lib.cublasLtMatmulDescSetAttribute(
                    self.desc, attr, ctypes.byref(n_op), ctypes.sizeof(n_op)
                ),
                "trans",
            )
        # row-major X[m,k] @ W[k,n] = column-major: D^T[n,m] = W^T[n,k] . X^T[k,m]
        self.la = self._layout(n, k, n)
        self.lb = self._layout(k, m, k)
        self.lc = self._layout(n, m, n)
        self.pref = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "pref")
        ws = ctypes.c_uint64(_WORKSPACE)
        self._ok(
            self.lib.cublasLtMatmulPreferenceSetAttribute(
                self.pref, _PREF_MAX_WORKSPACE, ctypes.byref(ws), ctypes.sizeof(ws)
            ),
            "pref ws",
        )
        self.workspace = torch.empty(_WORKSPACE, dtype=torch.uint8, device="cuda")
        self.alpha = ctypes.c_float(1.0)
        self.beta = ctypes.c_float(0.0)

    @staticmethod
    def _ok(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"cuBLASLt {what}: status {status}")

    def _layout(self, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        out = ctypes.c_void_p()
        self._ok(
            self.lib.cublasLtMatrixLayoutCreate(
                ctypes.byref(out),
                _CUDA_R_16F,
                ctypes.c_uint64(rows),
                ctypes.c_uint64(cols),
                ctypes.c_int64(ld),
            ),
            "layout",
        )
        return out

    def heuristic(self, count: int = 64) -> list[tuple[Algo, float]]:
        results = (HeuristicResult * count)()
        found = ctypes.c_int(0)
        self._ok(
            self.lib.cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                self.desc,
                self.la,
                self.lb,
                self.lc,
                self.lc,
                self.pref,
                count,
                results,
                ctypes.byref(found),
            ),
            "heuristic",
        )
        return [
            (results[i].algo, results[i].wavesCount)
            for i in range(found.value)
            if results[i].state == 0
        ]

    def cap(self, algo: Algo, attr: int, count: int = 1) -> list[int]:
        buf = (ctypes.c_uint32 * 64)()
        written = ctypes.c_size_t(0)
        status = self.lib.cublasLtMatmulAlgoCapGetAttribute(
            ctypes.byref(algo), attr, buf, ctypes.sizeof(buf), ctypes.byref(written)
        )
        if status != 0:
            return []
        return list(buf[: written.value // 4]) if count > 1 else [buf[0]]

    def config(self, algo: Algo, attr: int) -> int:
        val = ctypes.c_uint32(0)
        written = ctypes.c_size_t(0)
        self.lib.cublasLtMatmulAlgoConfigGetAttribute(
            ctypes.byref(algo), attr, ctypes.byref(val), ctypes.sizeof(val), ctypes.byref(written)
        )
        return val.value

    def set_config(self, algo: Algo, attr: int, value: int) -> bool:
        val = ctypes.c_uint32(value)
        return (
            self.lib.cublasLtMatmulAlgoConfigSetAttribute(
                ctypes.byref(algo), attr, ctypes.byref(val), ctypes.sizeof(val)
            )
            == 0
        )

    def algo_ids(self) -> list[int]:
        ids = (ctypes.c_int * 256)()
        found = ctypes.c_int(0)
        self._ok(
            self.lib.cublasLtMatmulAlgoGetIds(
                self.handle,
                _CUBLAS_COMPUTE_32F,
                _CUDA_R_32F,
                _CUDA_R_16F,
                _CUDA_R_16F,
                _CUDA_R_16F,
                _CUDA_R_16F,
                256,
                ids,
                ctypes.byref(found),
            ),
            "ids",
        )
        return list(ids[: found.value])

    def init(self, algo_id: int) -> Algo | None:
        algo = Algo()
        status = self.lib.cublasLtMatmulAlgoInit(
            self.handle,
            _CUBLAS_COMPUTE_32F,
            _CUDA_R_32F,
            _CUDA_R_16F,
            _CUDA_R_16F,
            _CUDA_R_16F,
            _CUDA_R_16F,
            algo_id,
            ctypes.byref(algo),
        )
        return algo if status == 0 else None

    def check(self, algo: Algo) -> bool:
        result = HeuristicResult()
        status = self.lib.cublasLtMatmulAlgoCheck(
            self.handle,
            self.desc,
            self.la,
            self.lb,
            self.lc,
            self.lc,
            ctypes.byref(algo),
            ctypes.byref(result),
        )
        return status == 0 and result.workspaceSize <= _WORKSPACE

    def call(self, algo: Algo, x, w, out, stream: int) -> int:
        return self.lib.cublasLtMatmul(
            self.handle,
            self.desc,
            ctypes.byref(self.alpha),
            ctypes.c_void_p(w.data_ptr()),
            self.la,
            ctypes.c_void_p(x.data_ptr()),
            self.lb,
            ctypes.byref(self.beta),
            ctypes.c_void_p(out.data_ptr()),
            self.lc,
            ctypes.c_void_p(out.data_ptr()),
            self.lc,
            ctypes.byref(algo),
            ctypes.c_void_p(self.workspace.data_ptr()),
            ctypes.c_size_t(_WORKSPACE),
            ctypes.c_void_p(stream),
        )


def _describe(lt: Lt, algo: Algo) -> str:
    return (
        f"id {lt.config(algo, _CFG_ID)} tile {lt.config(algo, _CFG_TILE)} "
        f"splitk {lt.config(algo, _CFG_SPLITK)} red {lt.config(algo, _CFG_REDUCTION)} "
        f"swz {lt.config(algo, _CFG_SWIZZLE)} stages {lt.config(algo, _CFG_STAGES)}"
    )


def _graph_time(torch, fn, iters: int = 100, repeats: int = 5) -> float | None:
    """Median µs per call of fn, replayed from one CUDA graph of `iters` calls."""
    stream = torch.cuda.Stream()
    try:
        with torch.cuda.stream(stream):
            for _ in range(3):
                if fn() != 0:
                    return None
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(iters):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) * 1000 / iters)
        return sorted(times)[len(times) // 2]
    except RuntimeError:
        torch.cuda.synchronize()
        return None


def probe(torch, m: int, k: int, n: int, max_configs: int) -> dict:
    sets = max(2, (120 << 20) // ((m * k + k * n) * 2) + 1)
    ops = [
        (
            torch.randn(m, k, device="cuda", dtype=torch.float16),
            torch.randn(k, n, device="cuda", dtype=torch.float16) / k**0.5,
        )
        for _ in range(sets)
    ]
    outs = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in range(sets)]
    ref = ops[0][0].float() @ ops[0][1].float()
    counter = itertools.count()

    def torch_call() -> int:
        i = next(counter) % sets
        torch.matmul(ops[i][0], ops[i][1], out=outs[i])
        return 0

    row: dict = {"shape": f"{m}x{k}x{n}", "operand sets": sets}
    row["torch us"] = _graph_time(torch, torch_call)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch_call()
        torch.cuda.synchronize()
    row["torch kernels"] = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        row["torch (cublaslt backend) us"] = _graph_time(torch, torch_call)
        torch.backends.cuda.preferred_blas_library("cublas")
    except (AttributeError, RuntimeError) as exc:
        row["torch (cublaslt backend) us"] = f"n/a: {exc}"

    lt = Lt(torch, m, k, n)

    def timed(algo: Algo) -> float | None:
        def one() -> int:
            i = next(counter) % sets
            return lt.call(
                algo, ops[i][0], ops[i][1], outs[i], torch.cuda.current_stream().cuda_stream
            )

        us = _graph_time(torch, one)
        if us is not None:
            lt.call(algo, ops[0][0], ops[0][1], outs[0], torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()
            err = (outs[0].float() - ref).abs().max().item()
            if err > 0.05:
                return None
        return us

    heur = lt.heuristic(64)
    listed = []
    for rank, (algo, waves) in enumerate(heur):
        us = timed(algo)
        listed.append(
            {"rank": rank, "us": us, "waves": round(waves, 2), "config": _describe(lt, algo)}
        )
    row["heuristic"] = listed
    # the exhaustive sweep: every algorithm id x tile x split-K x stages that passes the check
    swept = []
    for algo_id in lt.algo_ids():
        base = lt.init(algo_id)
        if base is None:
            continue
        tiles = lt.cap(base, _CAP_TILE_IDS, 64) or [0]
        stages = lt.cap(base, _CAP_STAGES_IDS, 64) or [0]
        splitk_ok = lt.cap(base, _CAP_SPLITK)[:1] == [1]
        for tile, stage, splitk in itertools.product(
            tiles, stages[:4], (1, 2, 4, 8) if splitk_ok else (1,)
        ):
            if len(swept) >= max_configs:
                break
            algo = lt.init(algo_id)
            if algo is None:
                continue
            lt.set_config(algo, _CFG_TILE, tile)
            lt.set_config(algo, _CFG_STAGES, stage)
            lt.set_config(algo, _CFG_SPLITK, splitk)
            if not lt.check(algo):
                continue
            us = timed(algo)
            if us is not None:
                swept.append({"us": us, "config": _describe(lt, algo)})
    swept.sort(key=lambda r: r["us"])
    row["swept configs"] = len(swept)
    row["sweep best"] = swept[:5]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="128x2048x8192,128x2048x16384,128x8192x2048,128x896x4864")
    ap.add_argument("--max-configs", type=int, default=300)
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    rows = []
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        row = probe(torch, m, k, n, args.max_configs)
        rows.append(row)
        h = [r for r in row["heuristic"] if r["us"] is not None]
        best_h = min(h, key=lambda r: r["us"]) if h else None
        print(f"## {row['shape']}  (sets {row['operand sets']})")
        print(f"torch {row['torch us']:.1f} us  lt-backend {row['torch (cublaslt backend) us']}")
        print("torch kernels:", row["torch kernels"])
        if h:
            print(f"heuristic first {h[0]['us']:.1f} us [{h[0]['config']}]")
            print(
                f"heuristic best  {best_h['us']:.1f} us rank {best_h['rank']} of {len(h)} "
                f"[{best_h['config']}]"
            )
        for r in row["sweep best"]:
            print(f"sweep {r['us']:.1f} us [{r['config']}]")
        print(f"({row['swept configs']} swept)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
