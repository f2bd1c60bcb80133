"""The sm_90a weight-streaming GEMM (kernels_templates/mlso_sm90_gemm.cuh): build, launch, time.

    python3 benchmarks/sm90_gemm.py                       # the default sweep, fp16, table on stdout
    python3 benchmarks/sm90_gemm.py --m 1 16 128 --shape 4096x11008 --dtype bfloat16 --out r.json
    python3 benchmarks/sm90_gemm.py --splits 1 --stages 4   # force a split count / stage count

Y[M,N] = X[M,K] @ W[K,N] (+ bias), row-major, fp16 or bf16 with fp32 accumulation. Time is the
median over repeats of a CUDA graph of `iters` launches, cycling through enough copies of X and W
that they overflow L2 (so W comes from DRAM, as in a model whose layers do not share an L2);
bandwidth is (bytes of W + X + Y) / time against the card's DRAM peak (H100 3.35 TB/s, H200
4.8 TB/s, or --peak-tbs). torch.matmul is timed the same way when torch is importable.

The reusable part (tests/test_sm90_gemm.py imports it): `GemmConfig` (one template
instantiation: its kernel source, threads and shared memory, mirrored from the header's
formulas), `choose` (the instantiation and split count for M, N, K), `ptxas_report` (registers
and spills, cached), and `Sm90Gemm` (loads a fatbin, encodes the two tensor maps, launches with
cuLaunchKernel and times). Why cuLaunchKernel through ctypes and not PyCUDA's launch: the kernel
takes two 128-byte CUtensorMap parameters by value; kernelParams (one pointer per parameter)
lets the driver place them by the kernel's own parameter layout, where a hand-packed argument
buffer would have to reproduce their 64-byte alignment. The module is loaded through libcuda
for the same reason (we need its raw CUfunction); PyCUDA supplies the context, memory and
streams, as in mlso_cli/runtime/launcher.py.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mlso_cli.cachefiles import seal, unseal, write_atomic  # noqa: E402
from mlso_cli.codegen import nvcc  # noqa: E402
from mlso_cli.knobs import knobs  # noqa: E402
from mlso_cli.runtime import tensormap  # noqa: E402

TOKEN_TILES = (8, 16, 32, 64, 128)
SMEM_LIMIT = 227 * 1024
BIAS_MODES = {"none": 0, "float32": 1, "same": 2}
CPP_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
MAX_STAGES = 8


@dataclass(frozen=True)
class GemmConfig:
    """One instantiation of mlso::sm90::ws_gemm (template arguments in the header's order)."""

    dtype: str = "float16"
    mt: int = 8
    consumers: int = 1
    bk: int = 128
    stages: int = 4
    splitk: bool = False
    bias: str = "none"

    # ---- mirrors of WsGemmConfig (the header static_asserts the same limits) ---------------
    @property
    def bn(self) -> int:
        """W columns (Y columns) per block."""
        return 64 * self.consumers

    @property
    def threads(self) -> int:
        return 128 * self.consumers + 32

    @property
    def stage_bytes(self) -> int:
        return self.consumers * self.bk * 64 * 2 + (self.bk // 64) * self.mt * 64 * 2

    @property
    def smem_bytes(self) -> int:
        return 1024 + self.stages * self.stage_bytes + 2 * self.stages * 8 + 16

    @property
    def partial_floats(self) -> int:
        """fp32 workspace floats per (tile, split)."""
        return 128 * self.consumers * self.mt // 2

    @property
    def name(self) -> str:
        d = {"float16": "f16", "bfloat16": "bf16"}[self.dtype]
        return (
            f"mlso_sm90_ws_gemm_{d}_mt{self.mt}_c{self.consumers}_bk{self.bk}_s{self.stages}"
            f"{'_splitk' if self.splitk else ''}_bias{BIAS_MODES[self.bias]}"
        )

    def kernel_line(self) -> str:
        return (
            f"MLSO_SM90_WS_GEMM_KERNEL({self.name}, {CPP_TYPES[self.dtype]}, {self.mt}, "
            f"{self.consumers}, {self.bk}, {self.stages}, {'true' if self.splitk else 'false'}, "
            f"{BIAS_MODES[self.bias]})"
        )


def kernel_source(configs: list[GemmConfig] | tuple[GemmConfig, ...]) -> str:
    """A .cu source defining one extern "C" kernel per config (names are unique per config)."""
    lines = ['#include "mlso_sm90_gemm.cuh"', ""]
    seen = set()
    for c in configs:
        if c.name not in seen:
            seen.add(c.name)
            lines.append(c.kernel_line())
    return "\n".join(lines) + "\n"


def token_tile(m: int) -> int:
    """wgmma's N for M tokens: M rounded up to a supported width (tiles of 128 beyond 128)."""
    for t in TOKEN_TILES:
        if m <= t:
            return t
    return TOKEN_TILES[-1]


def max_stages(cfg: GemmConfig) -> int:
    """The most pipeline stages that fit in 227 KB of shared memory (capped at MAX_STAGES):
    more stages are more W bytes in flight per SM, which is what a DRAM-bound kernel needs."""
    s = MAX_STAGES
    while s > 2 and replace(cfg, stages=s).smem_bytes > SMEM_LIMIT:
        s -= 1
    return s


def base_config(m: int, dtype: str, bias: str = "none", splitk: bool = False) -> GemmConfig:
    """The instantiation for M tokens: token tile from M; two consumer warpgroups from a 64-token
    tile up (each stage's X box is then as large as a W slab, and sharing it between two
    warpgroups halves X's reads from L2); as many stages as fit."""
    mt = token_tile(m)
    cfg = GemmConfig(dtype=dtype, mt=mt, consumers=2 if mt >= 64 else 1, bias=bias, splitk=splitk)
    return replace(cfg, stages=max_stages(cfg))


def choose_splits(m: int, n: int, k: int, cfg: GemmConfig, sms: int = 132) -> int:
    """Split count for split-K: the one with the least estimated time, where time ~ (bytes of W
    + bytes of fp32 partials written and read back) / (fraction of the last wave's SMs busy).

    Why: with one block per SM (shared memory allows one of these blocks), N = 2048 gives 16-32
    column tiles on 132 SMs; splitting K fills the machine, but each split writes a partial tile,
    so splitting only pays while the wave efficiency it buys exceeds the traffic it adds."""
    tiles = math.ceil(n / cfg.bn) * math.ceil(m / cfg.mt)
    ktiles = math.ceil(k / cfg.bk)
    w_bytes = 2 * k * n
    best, best_cost = 1, float("inf")
    for s in range(1, min(16, ktiles) + 1):
        per = math.ceil(ktiles / s)
        if s > 1 and per < 2:
            break
        eff_s = math.ceil(ktiles / per)  # splits actually launched (none empty)
        blocks = tiles * eff_s
        waves = math.ceil(blocks / sms)
        efficiency = blocks / (waves * sms)
        partial = 0 if eff_s == 1 else eff_s * tiles * cfg.partial_floats * 4 * 2
        cost = (w_bytes + partial) / efficiency
        if cost < best_cost * 0.98:  # prefer fewer splits unless clearly better
            best, best_cost = eff_s, cost
    return best


def choose(
    m: int,
    n: int,
    k: int,
    dtype: str = "float16",
    bias: str = "none",
    sms: int = 132,
    splits: int | None = None,
    stages: int | None = None,
) -> tuple[GemmConfig, int]:
    """(instantiation, split count) for Y[m,n] = X[m,k] @ W[k,n] on `sms` SMs."""
    cfg = base_config(m, dtype, bias)
    if stages is not None:
        cfg = replace(cfg, stages=stages)
    s = valid_splits(k, cfg, splits) if splits is not None else choose_splits(m, n, k, cfg, sms)
    return replace(cfg, splitk=s > 1), s


def valid_splits(k: int, cfg: GemmConfig, want: int) -> int:
    """The split count the kernel runs for a requested one: k tiles are dealt out
    ceil(ktiles / want) per split, so e.g. 63 splits of 64 tiles become 32 (no split is empty)."""
    ktiles = math.ceil(k / cfg.bk)
    per = math.ceil(ktiles / max(1, min(int(want), ktiles)))
    return math.ceil(ktiles / per)


def supported_configs() -> list[GemmConfig]:
    """Every instantiation `choose` can return without overrides (no bias): what the CPU test
    compiles and checks for spills. Bias variants change only the epilogue: a few per dtype."""
    out = []
    for dtype in CPP_TYPES:
        for mt in TOKEN_TILES:
            for splitk in (False, True):
                out.append(base_config(mt, dtype, "none", splitk))
        out.append(base_config(128, dtype, "float32", True))
        out.append(base_config(8, dtype, "same", False))
        out.append(base_config(8, dtype, "same", True))
    return out


# ---- compilation -----------------------------------------------------------------------------
_PTXAS_FUNC = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PTXAS_SPILL = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(text: str) -> dict[str, dict[str, int]]:
    """{kernel: {registers, stack, spill_stores, spill_loads}} from `-Xptxas -v` output."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in text.splitlines():
        if m := _PTXAS_FUNC.search(line):
            current = m.group(1)
            out[current] = {"registers": 0, "stack": 0, "spill_stores": 0, "spill_loads": 0}
        elif current and (m := _PTXAS_SPILL.search(line)):
            out[current].update(
                stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3))
            )
        elif current and (m := _PTXAS_REGS.search(line)):
            out[current]["registers"] = int(m.group(1))
    return out


def ptxas_report(source: str, target: str = "sm_90a") -> tuple[dict[str, dict[str, int]], str]:
    """(per-kernel ptxas numbers, raw ptxas text) of `source` for one target, cached on disk by
    source, nvcc version and templates (ptxas logs are not kept by the fatbin cache)."""
    exe = nvcc.nvcc_path()
    flags = [*nvcc.BASE_FLAGS, f"-gencode=arch=compute_{target[3:]},code={target}", "-Xptxas", "-v"]
    key = nvcc.cache_key(source, flags, nvcc.nvcc_version(exe))
    entry = knobs().cache_dir / "sm90_ptxas" / f"{key}.log"
    if entry.is_file():
        body = unseal(entry.read_bytes())
        if body is not None:
            text = body.decode()
            return parse_ptxas(text), text
    with tempfile.TemporaryDirectory(prefix="mlso-sm90-") as tmp:
        cu = Path(tmp) / "k.cu"
        cu.write_text(source)
        cmd = [
            exe,
            "-cubin",
            *flags,
            f"-I{nvcc.TEMPLATES_DIR}",
            "-o",
            str(Path(tmp) / "k.cubin"),
            str(cu),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=nvcc.NVCC_TIMEOUT_S)
    text = res.stdout + res.stderr
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed (exit {res.returncode}):\n{text[-4000:]}")
    write_atomic(entry, seal(text.encode()))
    return parse_ptxas(text), text


def compile_configs(configs: list[GemmConfig] | tuple[GemmConfig, ...]) -> bytes:
    """sm_90a fatbin holding every config's kernel (mlso's compile cache)."""
    return nvcc.compile_source(kernel_source(configs), ("sm_90a",))


# ---- bf16 on numpy -----------------------------------------------------------------------------
def to_device_dtype(a: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 values rounded to `dtype`, as the numpy array the device buffer will hold."""
    from mlso_cli.runtime.launcher import numpy_dtype

    return np.ascontiguousarray(np.asarray(a, dtype=np.float32).astype(numpy_dtype(dtype)))


# ---- launching -----------------------------------------------------------------------------------
class _Driver:
    """The few libcuda entry points the launcher calls directly."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        vp, pvp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        u = ctypes.c_uint
        sig = {
            "cuModuleLoadData": [pvp, vp],
            "cuModuleUnload": [vp],
            "cuModuleGetFunction": [pvp, vp, ctypes.c_char_p],
            "cuFuncSetAttribute": [vp, ctypes.c_int, ctypes.c_int],
            "cuLaunchKernel": [vp, u, u, u, u, u, u, u, vp, pvp, pvp],
            "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        }
        self.fns = {}
        for name, args in sig.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int
            self.fns[name] = fn

    def __call__(self, name: str, *args: Any) -> None:
        rc = self.fns[name](*args)
        if rc != 0:
            msg = ctypes.c_char_p()
            self.fns["cuGetErrorString"](rc, ctypes.byref(msg))
            text = msg.value.decode() if msg.value else f"CUresult {rc}"
            raise RuntimeError(f"{name} failed: {text}")


_FUNC_ATTR_MAX_DYNAMIC_SMEM = 8


@dataclass
class _Operands:
    """One set of device buffers and the tensor maps that describe them."""

    x: int
    w: int
    y: int
    bias: int
    tmap_w: Any
    tmap_x: Any


class Sm90Gemm:
    """A loaded fatbin of sm90 GEMM kernels, for Y = X @ W (+ bias) on one GPU.

    g = Sm90Gemm(compile_configs([cfg]), device=0)
    y = g.run(cfg, splits, x, w, bias=None)        # numpy in, numpy out
    us = g.time(cfg, splits, m, n, k)              # µs per launch, DRAM-cold operands
    g.close()
    """

    def __init__(self, fatbin: bytes, device: int = 0, l2_promotion: str = "256b") -> None:
        from mlso_cli.runtime.launcher import _pycuda

        self._cuda = cuda = _pycuda()
        self._drv = _Driver()
        # L2 fill granularity of the TMA loads (a knob to measure: 256 B also fetches the
        # neighbouring block's 128-byte W segment, useful if it stays in L2 until read)
        self.l2_promotion = l2_promotion
        self._ctx = cuda.Device(device).retain_primary_context()
        self._ctx.push()
        try:
            self._module = ctypes.c_void_p()
            image = ctypes.create_string_buffer(fatbin, len(fatbin))
            self._drv(
                "cuModuleLoadData", ctypes.byref(self._module), ctypes.cast(image, ctypes.c_void_p)
            )
            self._funcs: dict[str, ctypes.c_void_p] = {}
            self._allocs: list[Any] = []
            self.stream = cuda.Stream()
            dev = cuda.Device(device)
            self.sms = int(dev.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT))
            self.device_name = dev.name()
        finally:
            cuda.Context.pop()

    # ---- plumbing ---------------------------------------------------------------------------
    def _function(self, cfg: GemmConfig) -> ctypes.c_void_p:
        fn = self._funcs.get(cfg.name)
        if fn is None:
            fn = ctypes.c_void_p()
            self._drv("cuModuleGetFunction", ctypes.byref(fn), self._module, cfg.name.encode())
            self._drv("cuFuncSetAttribute", fn, _FUNC_ATTR_MAX_DYNAMIC_SMEM, cfg.smem_bytes)
            self._funcs[cfg.name] = fn
        return fn

    def _alloc(self, nbytes: int) -> int:
        a = self._cuda.mem_alloc(max(int(nbytes), 16))
        self._allocs.append(a)
        return int(a)

    def _maps(self, cfg: GemmConfig, x: int, w: int, m: int, n: int, k: int) -> tuple[Any, Any]:
        tw = tensormap.encode_tiled(
            tensormap.row_major_2d(cfg.dtype, w, k, n, cfg.bk, 64, l2_promotion=self.l2_promotion)
        )
        tx = tensormap.encode_tiled(
            tensormap.row_major_2d(cfg.dtype, x, m, k, cfg.mt, 64, l2_promotion=self.l2_promotion)
        )
        return (ctypes.c_uint8 * 128).from_buffer_copy(tw), (ctypes.c_uint8 * 128).from_buffer_copy(
            tx
        )

    def _workspace(self, cfg: GemmConfig, splits: int, m: int, n: int) -> tuple[int, int]:
        """(workspace, counters) for a split launch: partials of every split and tile, and one
        zeroed counter per tile (the kernel leaves them zero after each launch)."""
        if splits <= 1:
            return 0, 0
        tiles = math.ceil(n / cfg.bn) * math.ceil(m / cfg.mt)
        ws = self._alloc(splits * tiles * cfg.partial_floats * 4)
        counters = self._alloc(tiles * 4)
        self._cuda.memset_d32(counters, 0, tiles)
        return ws, counters

    def _launch(
        self,
        cfg: GemmConfig,
        ops: _Operands,
        ws: int,
        counters: int,
        m: int,
        n: int,
        k: int,
        splits: int,
        stream: Any,
    ) -> None:
        if splits > 1 and not cfg.splitk:
            raise ValueError(f"{cfg.name} was built without split-K; cannot run {splits} splits")
        ktiles = math.ceil(k / cfg.bk)
        per = math.ceil(ktiles / splits)
        z = math.ceil(ktiles / per)
        if z != splits:
            raise ValueError(f"{splits} splits of {ktiles} k tiles leave an empty split; use {z}")
        args = [
            ops.tmap_w,
            ops.tmap_x,
            ctypes.c_uint64(ops.y),
            ctypes.c_uint64(ops.bias),
            ctypes.c_uint64(ws),
            ctypes.c_uint64(counters),
            ctypes.c_int32(m),
            ctypes.c_int32(n),
            ctypes.c_int32(k),
            ctypes.c_int32(per),
        ]
        # kernelParams: one pointer per parameter, to a host copy of its value (the maps too)
        params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        grid = (math.ceil(n / cfg.bn), math.ceil(m / cfg.mt), z)
        handle = stream.handle if hasattr(stream, "handle") else int(stream or 0)
        self._drv(
            "cuLaunchKernel",
            self._function(cfg),
            *grid,
            cfg.threads,
            1,
            1,
            cfg.smem_bytes,
            ctypes.c_void_p(handle),
            params,
            None,
        )

    def _wait(self, timeout_s: float) -> None:
        import time

        end = time.monotonic() + timeout_s
        while not self.stream.is_done():
            if time.monotonic() > end:
                raise RuntimeError(
                    f"the sm90 GEMM did not finish within {timeout_s:.0f} s: a pipeline hang "
                    "(mbarrier parity or expect_tx bytes); the CUDA context is now unusable"
                )
            time.sleep(0.001)
        self.stream.synchronize()

    @staticmethod
    def _check_shape(cfg: GemmConfig, m: int, n: int, k: int) -> None:
        if n % 8 or k % 8:
            raise ValueError(
                f"N={n} and K={k} must be multiples of 8 (TMA needs 16-byte row strides)"
            )
        if m < 1:
            raise ValueError("M must be at least 1")

    # ---- public -------------------------------------------------------------------------------
    def run(
        self,
        cfg: GemmConfig,
        splits: int,
        x: np.ndarray,
        w: np.ndarray,
        bias: np.ndarray | None = None,
        timeout_s: float = 60.0,
    ) -> np.ndarray:
        """Y = X @ W (+ bias) once, numpy in (fp32 values, rounded to cfg.dtype) and numpy out
        (cfg.dtype). Y is filled with NaN first, so an element the kernel misses shows. A launch
        still running after `timeout_s` raises instead of blocking forever (an mbarrier phase
        or byte count that never completes hangs the kernel)."""
        cuda = self._cuda
        m, k = x.shape
        k2, n = w.shape
        if k2 != k:
            raise ValueError(f"X is [{m}, {k}] but W is [{k2}, {n}]")
        self._check_shape(cfg, m, n, k)
        if (bias is None) != (cfg.bias == "none"):
            raise ValueError(
                f"{cfg.name} takes bias={cfg.bias}, got {'none' if bias is None else 'a bias'}"
            )
        xd, wd = to_device_dtype(x, cfg.dtype), to_device_dtype(w, cfg.dtype)
        self._ctx.push()
        try:
            xp, wp = self._alloc(xd.nbytes), self._alloc(wd.nbytes)
            yp = self._alloc(m * n * 2)
            cuda.memcpy_htod(xp, xd)
            cuda.memcpy_htod(wp, wd)
            cuda.memset_d16(yp, 0x7E00 if cfg.dtype == "float16" else 0x7FC0, m * n)
            bp = 0
            if bias is not None:
                bd = np.ascontiguousarray(
                    bias.astype(np.float32)
                    if cfg.bias == "float32"
                    else to_device_dtype(bias, cfg.dtype)
                )
                bp = self._alloc(bd.nbytes)
                cuda.memcpy_htod(bp, bd)
            tw, tx = self._maps(cfg, xp, wp, m, n, k)
            ws, counters = self._workspace(cfg, splits, m, n)
            ops = _Operands(xp, wp, yp, bp, tw, tx)
            self._launch(cfg, ops, ws, counters, m, n, k, splits, self.stream)
            self._wait(timeout_s)
            from mlso_cli.runtime.launcher import numpy_dtype

            y = np.empty((m, n), dtype=numpy_dtype(cfg.dtype))
            cuda.memcpy_dtoh(y, yp)
            if splits > 1:
                left = np.empty(math.ceil(n / cfg.bn) * math.ceil(m / cfg.mt), dtype=np.int32)
                cuda.memcpy_dtoh(left, counters)
                if left.any():
                    raise RuntimeError("split-K counters were not reset to zero by the kernel")
            return y
        finally:
            self._free_all()
            cuda.Context.pop()

    def time(
        self,
        cfg: GemmConfig,
        splits: int,
        m: int,
        n: int,
        k: int,
        warmup: int = 10,
        repeats: int = 7,
        iters: int = 50,
    ) -> dict[str, Any]:
        """Median µs per launch over `repeats` CUDA-graph replays of `iters` launches that cycle
        through enough operand sets to overflow L2 (events around plain launches if capture
        fails)."""
        from mlso_cli.runtime.launcher import _DriverGraphs, operand_sets

        self._check_shape(cfg, m, n, k)
        cuda = self._cuda
        rng = np.random.default_rng(0)
        one_set = 2 * (m * k + k * n)
        sets = operand_sets(one_set)
        self._ctx.push()
        try:
            xd = to_device_dtype(rng.uniform(-1, 1, (m, k)), cfg.dtype)
            wd = to_device_dtype(rng.uniform(-1, 1, (k, n)) / math.sqrt(k), cfg.dtype)
            bias_bytes = {"none": 0, "float32": 4 * n, "same": 2 * n}[cfg.bias]
            op_sets = []
            for _ in range(sets):
                xp, wp, yp = self._alloc(xd.nbytes), self._alloc(wd.nbytes), self._alloc(m * n * 2)
                cuda.memcpy_htod(xp, xd)
                cuda.memcpy_htod(wp, wd)
                bp = self._alloc(bias_bytes) if bias_bytes else 0
                if bp:
                    cuda.memset_d8(bp, 0, bias_bytes)
                op_sets.append(_Operands(xp, wp, yp, bp, *self._maps(cfg, xp, wp, m, n, k)))
            ws, counters = self._workspace(cfg, splits, m, n)
            stream = self.stream

            def body(count: int) -> None:
                for i in range(count):
                    self._launch(cfg, op_sets[i % sets], ws, counters, m, n, k, splits, stream)

            body(max(warmup, sets))
            stream.synchronize()
            start, end = cuda.Event(), cuda.Event()
            method, graphs, graph, exe = "cuda-graph", None, None, None
            try:
                graphs = _DriverGraphs()
                graph, exe = graphs.capture(stream.handle, lambda: body(iters))
                graphs.launch(exe, stream.handle)
                stream.synchronize()
            except Exception:  # capture refused or libcuda missing: time plain launches
                method, exe = "events", None
                stream.synchronize()
            samples = []
            try:
                for _ in range(repeats):
                    start.record(stream)
                    if exe is not None:
                        graphs.launch(exe, stream.handle)
                    else:
                        body(iters)
                    end.record(stream)
                    end.synchronize()
                    samples.append(end.time_since(start) * 1000.0 / iters)
            finally:
                if exe is not None:
                    graphs.destroy(graph, exe)
            us = float(np.median(samples))
            nbytes = 2 * (k * n + m * k + m * n)
            return {
                "us": us,
                "method": method,
                "sets": sets,
                "bytes": nbytes,
                "tbs": nbytes / (us * 1e-6) / 1e12,
            }
        finally:
            self._free_all()
            cuda.Context.pop()

    def _free_all(self) -> None:
        for a in self._allocs:
            a.free()
        self._allocs.clear()

    def close(self) -> None:
        if self._ctx is None:
            return
        self._ctx.push()
        try:
            self._free_all()
            self._drv("cuModuleUnload", self._module)
        finally:
            self._cuda.Context.pop()
            self._ctx.detach()
            self._ctx = None

    def __enter__(self) -> Sm90Gemm:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- the benchmark -------------------------------------------------------------------------------
def torch_time(
    m: int, n: int, k: int, dtype: str, iters: int = 50, repeats: int = 7
) -> float | None:
    """µs of torch.matmul on the same shapes and rotation (None without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    from mlso_cli.runtime.launcher import operand_sets

    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    sets = operand_sets(2 * (m * k + k * n))
    xs = [torch.randn(m, k, device="cuda", dtype=tdt) for _ in range(sets)]
    ws = [torch.randn(k, n, device="cuda", dtype=tdt) / math.sqrt(k) for _ in range(sets)]
    ys = [torch.empty(m, n, device="cuda", dtype=tdt) for _ in range(sets)]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(max(10, sets)):
            torch.matmul(xs[i % sets], ws[i % sets], out=ys[i % sets])
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(iters):
            torch.matmul(xs[i % sets], ws[i % sets], out=ys[i % sets])
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # graph.replay() launches on the current stream: the events must be recorded on that
        # stream too (recorded on `stream` while the replay ran on the default stream, they
        # timed an empty interval, 0.09-0.17 µs, on the H100 on 2026-12-07)
        with torch.cuda.stream(stream):
            start.record()
            graph.replay()
            end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / iters)
    return float(np.median(samples))


def torch_times(
    plans: list[tuple[int, int, int]], dtype: str, iters: int
) -> dict[tuple[int, int, int], float | None]:
    """torch_time of every (m, n, k), measured in a child process, so that torch's allocator and
    context never share a process with the launcher's PyCUDA context. (The 0.1-0.2 µs figures
    first blamed on that sharing came from events recorded on another stream than the graph's
    replay; see torch_time.)"""
    ms = sorted({m for m, _, _ in plans})
    shapes = sorted({f"{k}x{n}" for _, n, k in plans})
    cmd = [sys.executable, str(Path(__file__).resolve()), "--torch-only", "--dtype", dtype]
    cmd += ["--iters", str(iters), "--m", *map(str, ms), "--shape", *shapes]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    except (subprocess.SubprocessError, OSError) as e:
        print(f"# torch timings failed: {e}", file=sys.stderr)
        return {}
    got = {}
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            got[(r["m"], r["n"], r["k"])] = r["us"]
    return got


def under_floor(us: float | None, m: int, n: int, k: int, peak_tbs: float | None) -> bool:
    """A time under 90% of what reading X and W once at DRAM peak takes cannot be real."""
    if us is None or not peak_tbs:
        return False
    floor_us = 2 * (m * k + k * n) / (peak_tbs * 1e12) * 1e6
    return us < 0.9 * floor_us


def dram_peak_tbs(name: str) -> float | None:
    """The card's datasheet DRAM peak in TB/s, from hopper_table.py's table (None: not listed)."""
    from benchmarks.hopper_table import dram_peak

    try:
        return dram_peak(name) / 1e12
    except ValueError:
        return None


DEFAULT_SHAPES = ("2048x8192", "4096x11008", "8192x2048", "4096x4096")
DEFAULT_MS = (1, 16, 64, 128)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=list(DEFAULT_MS), help="token counts")
    ap.add_argument("--shape", nargs="+", default=list(DEFAULT_SHAPES), help="KxN weight shapes")
    ap.add_argument("--dtype", choices=sorted(CPP_TYPES), default="float16")
    ap.add_argument("--splits", type=int, help="force this split count (default: choose_splits)")
    ap.add_argument("--stages", type=int, help="force this stage count (default: as many as fit)")
    ap.add_argument("--peak-tbs", type=float, help="DRAM peak in TB/s (default: by card name)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--l2-promotion", choices=list(tensormap.L2_PROMOTIONS), default="256b")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    ap.add_argument("--record", action="store_true", help="append records to benchmarks/results")
    ap.add_argument(
        "--torch-only", action="store_true", help="print torch.matmul's times as JSON lines"
    )
    args = ap.parse_args(argv)

    plans = []
    for shape in args.shape:
        k, n = (int(v) for v in shape.lower().split("x"))
        for m in args.m:
            plans.append((m, n, k))
    if args.torch_only:
        for m, n, k in plans:
            us = torch_time(m, n, k, args.dtype, iters=args.iters)
            print(json.dumps({"m": m, "n": n, "k": k, "us": us}), flush=True)
        return 0
    peers = torch_times(plans, args.dtype, args.iters)
    # one compile for everything; the split count is fixed after the SM count is known
    from mlso_cli.runtime.launcher import _pycuda

    cuda = _pycuda()
    sms = int(cuda.Device(0).get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT))
    chosen = [
        choose(m, n, k, args.dtype, sms=sms, splits=args.splits, stages=args.stages)
        for m, n, k in plans
    ]
    fatbin = compile_configs([c for c, _ in chosen])
    rows = []
    with Sm90Gemm(fatbin, l2_promotion=args.l2_promotion) as g:
        peak = args.peak_tbs or dram_peak_tbs(g.device_name)
        print(f"# {g.device_name}, {g.sms} SMs, DRAM peak {peak} TB/s, {args.dtype}")
        print("| M | K | N | config | splits | µs | TB/s | % DRAM | torch µs | torch / ours |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for (m, n, k), (cfg, splits) in zip(plans, chosen):
            r = g.time(cfg, splits, m, n, k, iters=args.iters)
            t = peers.get((m, n, k))
            if under_floor(t, m, n, k, peak):
                print(f"# torch's {t:.2f} µs for {m}x{k}x{n} is under the DRAM floor: dropped")
                t = None
            pct = 100.0 * r["tbs"] / peak if peak else float("nan")
            row = {
                "m": m,
                "k": k,
                "n": n,
                "config": cfg.name,
                "label": f"mt{cfg.mt} c{cfg.consumers} s{cfg.stages}",
                "splits": splits,
                **r,
                "pct_dram": pct,
                "torch_us": t,
            }
            rows.append(row)
            ratio = f"{t / r['us']:.2f}" if t else "-"
            print(
                f"| {m} | {k} | {n} | {row['label']} | {splits} | "
                f"{r['us']:.2f} | {r['tbs']:.2f} | {pct:.0f}% | {t if t is None else round(t, 2)} | {ratio} |"
            )
    if args.out:
        args.out.write_text(json.dumps({"device": g.device_name, "rows": rows}, indent=1))
    if args.record:
        from benchmarks.results_table import append

        append("sm90_gemm", [record_row(r, args.dtype) for r in rows], g.device_name)
    return 0


def record_row(r: dict[str, Any], dtype: str) -> tuple[str, dict[str, Any]]:
    """One results/ record of a timed row: its name and the figures RESULTS.md shows."""
    t = r.get("torch_us")
    return (
        f"{r['m']}x{r['k']}x{r['n']} {dtype}",
        {
            "config": r["label"],
            "splits": r["splits"],
            "µs": round(r["us"], 2),
            "TB/s": round(r["tbs"], 2),
            "% DRAM": round(r["pct_dram"]),
            "torch.matmul µs": None if t is None else round(t, 2),
            "torch / ours": None if t is None else round(t / r["us"], 2),
        },
    )


if __name__ == "__main__":
    raise SystemExit(main())
