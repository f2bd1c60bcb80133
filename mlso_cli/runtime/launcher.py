"""PyCUDA launcher for mlso fatbins: load in the primary context, run, time with CUDA graphs.

    prog = Program(fatbin, plan, device=0)          # module loaded, smem limits raised
    outs = prog.run([q, k, v])                      # numpy in, numpy out (poison_outputs=True: NaN first)
    prog.run_device(in_ptrs, out_ptrs, stream=0)    # device pointers (ints), no copies
    t = prog.time(warmup=10, repeats=5, iters=200)  # TimingResult: median_us, method, ...
    prog.close()                                    # or `with Program(...) as prog:`

Why the primary context (retain_primary_context + push/pop, never pycuda.autoinit): pointers
shared with ONNX Runtime or torch then live in one context. Why ctypes for graphs: PyCUDA
(2026.1) has no stream-capture API, so capture goes through libcuda on PyCUDA's stream handle;
when that fails, timing falls back to CUDA events around plain launches, and says so.
The plan is the one codegen writes (mlso_cli/codegen/program.py); a launch whose smem exceeds
48 KB gets its function's MAX_DYNAMIC_SHARED_SIZE_BYTES raised first. A library GEMM launch
(plan version 2) runs through the runtime library's own cuBLASLt code (`mlso_gemm_create` /
`mlso_gemm_run` of libmlso_ort.so, called with ctypes): the very setup the ONNX Runtime op does,
made once here, so a capture only records cublasLtMatmul. pycuda is imported lazily, so
CPU-only machines import this module fine.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlso_cli.errors import EnvironmentProblem

DEFAULT_SMEM_LIMIT = 48 * 1024
L2_BYTES = 60 * 1024 * 1024
"""H200 L2; inputs smaller than this are rotated through several copies when timing."""
CAPTURE_MODE_RELAXED = 2
NAN_BITS = {"float32": (0x7FC00000, 4), "float16": (0x7E00, 2), "bfloat16": (0x7FC0, 2)}


@dataclass(frozen=True)
class TimingResult:
    median_us: float
    """Median over repeats of (time of `iters` back-to-back program runs) / iters."""
    samples_us: tuple[float, ...]
    method: str
    """"cuda-graph" (graph replay of iters runs) or "events" (plain launches; capture failed)."""
    iters: int
    rotated_sets: int
    """How many copies of the inputs were cycled through (1: no rotation)."""
    note: str = ""


def operand_sets(total_bytes: int) -> int:
    """How many copies of a program's inputs timing rotates through: enough that together they
    overflow L2 twice when one set fits in it (so weights are read from DRAM, as in a model whose
    layers do not share an L2), else one. benchmarks/ time their peers under the same rule."""
    if total_bytes >= L2_BYTES:
        return 1
    return min(64, max(2, math.ceil(2 * L2_BYTES / max(total_bytes, 1))))


def numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _nbytes(t: dict[str, Any]) -> int:
    return int(np.prod(t["shape"], dtype=np.int64)) * numpy_dtype(t["dtype"]).itemsize


def _pycuda():
    try:
        import pycuda.driver as cuda
    except ImportError as exc:
        raise EnvironmentProblem(
            f"PyCUDA is not importable ({exc})",
            "Install it on a machine with an NVIDIA driver: pip install 'mlso[cuda]' "
            "(pycuda>=2024.1).",
        ) from None
    try:
        cuda.init()
    except Exception as exc:  # pycuda raises its own error types
        raise EnvironmentProblem(
            f"the CUDA driver did not initialise ({exc})",
            "Check that an NVIDIA GPU and driver are present (nvidia-smi).",
        ) from None
    return cuda


class _DriverGraphs:
    """cuStreamBeginCapture / EndCapture / GraphInstantiate / GraphLaunch through ctypes."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        vp, pvp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        self._fns = {}
        for name, args in (
            ("cuStreamBeginCapture_v2", [vp, ctypes.c_int]),
            ("cuStreamEndCapture", [vp, pvp]),
            ("cuGraphInstantiateWithFlags", [pvp, vp, ctypes.c_ulonglong]),
            ("cuGraphLaunch", [vp, vp]),
            ("cuGraphExecDestroy", [vp]),
            ("cuGraphDestroy", [vp]),
        ):
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int
            self._fns[name] = fn

    def _call(self, name: str, *args: Any) -> None:
        rc = self._fns[name](*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed (CUresult {rc})")

    def capture(self, stream_handle: int, body) -> tuple[ctypes.c_void_p, ctypes.c_void_p]:
        """(graph, exec) of everything `body()` enqueues on the stream."""
        s = ctypes.c_void_p(stream_handle)
        self._call("cuStreamBeginCapture_v2", s, CAPTURE_MODE_RELAXED)
        graph = ctypes.c_void_p()
        try:
            body()
        finally:
            rc = self._fns["cuStreamEndCapture"](s, ctypes.byref(graph))
        if rc != 0 or not graph.value:
            raise RuntimeError(f"cuStreamEndCapture failed (CUresult {rc})")
        exe = ctypes.c_void_p()
        try:
            self._call("cuGraphInstantiateWithFlags", ctypes.byref(exe), graph, 0)
        except RuntimeError:
            self._fns["cuGraphDestroy"](graph)
            raise
        return graph, exe

    def launch(self, exe: ctypes.c_void_p, stream_handle: int) -> None:
        self._call("cuGraphLaunch", exe, ctypes.c_void_p(stream_handle))

    def destroy(self, graph: ctypes.c_void_p, exe: ctypes.c_void_p) -> None:
        self._fns["cuGraphExecDestroy"](exe)
        self._fns["cuGraphDestroy"](graph)


class _LibraryGemms:
    """The plan's library GEMMs, set up by the runtime library in the current context."""

    def __init__(self, plan: dict[str, Any]) -> None:
        from mlso_cli.runtime import library_path
        from mlso_cli.runtime.plan import plan_json

        lib = ctypes.CDLL(str(library_path()))
        lib.mlso_gemm_create.restype = ctypes.c_void_p
        lib.mlso_gemm_create.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.mlso_gemm_run.restype = ctypes.c_int
        lib.mlso_gemm_run.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_ulonglong,
            ctypes.c_ulonglong,
            ctypes.c_ulonglong,
            ctypes.c_ulonglong,
            ctypes.c_ulonglong,
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        lib.mlso_gemm_destroy.argtypes = [ctypes.c_void_p]
        lib.mlso_gemm_describe.restype = None
        lib.mlso_gemm_describe.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        self._lib = lib
        self._err = ctypes.create_string_buffer(1024)
        handle = lib.mlso_gemm_create(plan_json(plan).encode(), self._err, len(self._err))
        if not handle:
            raise EnvironmentProblem(
                f"cannot set up the program's library GEMMs: {self._err.value.decode()}",
                "Install cuBLAS 13 (libcublasLt.so.13), or regenerate with MLSO_LIBRARY_GEMM=0.",
            )
        self._handle = ctypes.c_void_p(handle)

    def run(
        self, index: int, a: int, b: int, c: int, bias: int, residual: int, stream_handle: int
    ) -> None:
        """Enqueue GEMM launch `index`; bias and residual are 0 when it has no such epilogue."""
        rc = self._lib.mlso_gemm_run(
            self._handle,
            index,
            a,
            b,
            c,
            bias,
            residual,
            ctypes.c_void_p(stream_handle),
            self._err,
            len(self._err),
        )
        if rc != 0:
            raise RuntimeError(f"library GEMM launch {index} failed: {self._err.value.decode()}")

    def describe(self, index: int) -> str:
        """How launch `index`'s cuBLASLt algorithm was chosen: the heuristic's first, or timed
        (MLSO_GEMM_ALGO, runtime/csrc/mlso_gemm.h)."""
        buf = ctypes.create_string_buffer(256)
        self._lib.mlso_gemm_describe(self._handle, index, buf, len(buf))
        return buf.value.decode()

    def close(self) -> None:
        if self._handle:
            self._lib.mlso_gemm_destroy(self._handle)
            self._handle = None


class Program:
    """A compiled mlso program loaded on one GPU, with its buffers."""

    def __init__(self, fatbin: bytes, plan: dict[str, Any], device: int = 0) -> None:
        self.plan = plan
        self._cuda = cuda = _pycuda()
        try:
            from pycuda._pvt_struct import pack
        except ImportError:
            pack = None
        self._pack = pack
        self._ctx = cuda.Device(device).retain_primary_context()
        self._closed = False
        self._allocs: list[Any] = []
        self._gemms: _LibraryGemms | None = None
        with self._current():
            self._module = cuda.module_from_buffer(fatbin)
            self._funcs: dict[str, Any] = {}
            need: dict[str, int] = {}
            if any(launch.get("kind") == "gemm" for launch in plan["launches"]):
                self._gemms = _LibraryGemms(plan)
            for launch in plan["launches"]:
                if launch.get("kind") == "gemm":
                    continue
                name = launch["kernel"]
                need[name] = max(need.get(name, 0), int(launch["smem"]))
                if name not in self._funcs:
                    fn = self._module.get_function(name)
                    fn.prepare("P" * len(launch["args"]))
                    self._funcs[name] = fn
            for name, smem in need.items():
                if smem > DEFAULT_SMEM_LIMIT:
                    self._funcs[name].set_attribute(
                        cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, smem
                    )
            self.inputs = [self._alloc(_nbytes(t)) for t in plan["inputs"]]
            self.outputs = [self._alloc(_nbytes(t)) for t in plan["outputs"]]
            self.scratch = [self._alloc(int(s["bytes"])) for s in plan["scratch"]]
            self.stream = cuda.Stream()

    # ---- plumbing ----------------------------------------------------------------------------
    class _Push:
        def __init__(self, prog: Program) -> None:
            self.prog = prog

        def __enter__(self) -> None:
            if self.prog._closed:
                raise RuntimeError("this Program is closed")
            self.prog._ctx.push()

        def __exit__(self, *exc: Any) -> None:
            self.prog._cuda.Context.pop()

    def library_choices(self) -> list[str]:
        """Per library GEMM launch, in plan order: how its algorithm was chosen."""
        if self._gemms is None:
            return []
        gemms = self._gemms
        return [
            gemms.describe(i)
            for i, launch in enumerate(self.plan["launches"])
            if launch.get("kind") == "gemm"
        ]

    def _current(self) -> Program._Push:
        return Program._Push(self)

    def _alloc(self, nbytes: int) -> int:
        a = self._cuda.mem_alloc(max(int(nbytes), 16))
        self._allocs.append(a)
        return int(a)

    def _enqueue(self, in_ptrs: Sequence[int], out_ptrs: Sequence[int], stream: Any) -> None:
        """Zero the `zero` buffers, then launch every kernel in plan order, on `stream`."""
        cuda = self._cuda
        table = {"input": in_ptrs, "output": out_ptrs, "scratch": self.scratch}
        for z in self.plan.get("zero", []):
            ptr = table[z["kind"]][z["index"]]
            size = (
                _nbytes(self.plan["outputs"][z["index"]])
                if z["kind"] == "output"
                else int(self.plan["scratch"][z["index"]]["bytes"])
            )
            cuda.memset_d8_async(ptr, 0, size, stream)
        for index, launch in enumerate(self.plan["launches"]):
            if launch.get("kind") == "gemm":
                a, b, c = (
                    table[launch[r]["buf"]["kind"]][launch[r]["buf"]["index"]] for r in "abc"
                )
                bias_ref = launch.get("bias", {}).get("buf")
                bias = table[bias_ref["kind"]][bias_ref["index"]] if bias_ref else 0
                res_ref = launch.get("residual", {}).get("buf")
                residual = table[res_ref["kind"]][res_ref["index"]] if res_ref else 0
                handle = stream.handle if hasattr(stream, "handle") else stream
                assert self._gemms is not None
                self._gemms.run(index, a, b, c, bias, residual, int(handle or 0))
                continue
            args = [table[a["kind"]][a["index"]] for a in launch["args"]]
            fn = self._funcs[launch["kernel"]]
            grid, block, smem = tuple(launch["grid"]), tuple(launch["block"]), int(launch["smem"])
            if self._pack is not None and hasattr(fn, "_launch_kernel"):
                # a bare cuLaunchKernel: prepared_async_call would first call the legacy
                # cuFuncSetBlockShape, which has no business inside a graph capture
                fn._launch_kernel(grid, block, self._pack("P" * len(args), *args), smem, stream)
            else:
                fn.prepared_async_call(grid, block, stream, *args, shared_size=smem)

    def _upload(self, inputs: Sequence[Any]) -> list[int]:
        if len(inputs) != len(self.plan["inputs"]):
            raise ValueError(
                f"the program takes {len(self.plan['inputs'])} inputs, got {len(inputs)}"
            )
        ptrs = []
        for i, (x, t) in enumerate(zip(inputs, self.plan["inputs"])):
            if isinstance(x, (int, np.integer)):
                ptrs.append(int(x))
                continue
            arr = np.ascontiguousarray(np.asarray(x), dtype=numpy_dtype(t["dtype"]))
            if list(arr.shape) != list(t["shape"]):
                raise ValueError(
                    f"input {i} has shape {list(arr.shape)}; the kernels were built for {t['shape']}"
                )
            self._cuda.memcpy_htod(self.inputs[i], arr)
            ptrs.append(self.inputs[i])
        return ptrs

    def _poison(self, ptrs: Sequence[int]) -> None:
        for ptr, t in zip(ptrs, self.plan["outputs"]):
            bits, size = NAN_BITS[t["dtype"]]
            n = _nbytes(t) // size
            (self._cuda.memset_d32 if size == 4 else self._cuda.memset_d16)(ptr, bits, n)

    # ---- public ------------------------------------------------------------------------------
    def run(self, inputs: Sequence[Any], poison_outputs: bool = False) -> list[np.ndarray]:
        """Run once; inputs are numpy arrays (copied in) or device pointers; outputs come back
        as numpy arrays. poison_outputs fills outputs with NaN first, so unwritten elements show."""
        with self._current():
            ptrs = self._upload(inputs)
            if poison_outputs:
                self._poison(self.outputs)
            self._enqueue(ptrs, self.outputs, self.stream)
            self.stream.synchronize()
            outs = []
            for ptr, t in zip(self.outputs, self.plan["outputs"]):
                arr = np.empty(t["shape"], dtype=numpy_dtype(t["dtype"]))
                self._cuda.memcpy_dtoh(arr, ptr)
                outs.append(arr)
            return outs

    def run_device(
        self, inputs: Sequence[int], outputs: Sequence[int] | None = None, stream: Any = None
    ) -> list[int]:
        """Enqueue one run on device pointers (no copies, no synchronisation); returns the output
        pointers (the program's own buffers when `outputs` is None)."""
        outs = list(outputs) if outputs is not None else self.outputs
        with self._current():
            self._enqueue(
                [int(p) for p in inputs], outs, stream if stream is not None else self.stream
            )
        return outs

    def time(
        self,
        inputs: Sequence[Any] | None = None,
        warmup: int = 10,
        repeats: int = 5,
        iters: int = 200,
        rotate_buffers: bool | int | None = None,
        seed: int = 0,
    ) -> TimingResult:
        """Median time of one program run: CUDA events around a CUDA graph of `iters` runs,
        `repeats` times, after `warmup` runs. inputs=None: random non-zero normal data.
        rotate_buffers: None = rotate when the inputs fit in L2 (60 MB); an int = that many sets."""
        rng = np.random.default_rng(seed)
        if inputs is None:
            inputs = [
                rng.standard_normal(t["shape"]).astype(np.float32) for t in self.plan["inputs"]
            ]
        total = sum(_nbytes(t) for t in self.plan["inputs"])
        if rotate_buffers is None:
            sets = operand_sets(total)
        else:
            sets = (
                max(1, int(rotate_buffers))
                if not isinstance(rotate_buffers, bool)
                else (2 if rotate_buffers else 1)
            )
        cuda = self._cuda
        with self._current():
            first = self._upload(inputs)
            in_sets = [first]
            extra = []
            for _ in range(sets - 1):
                copy = []
                for ptr, t in zip(first, self.plan["inputs"]):
                    a = cuda.mem_alloc(max(_nbytes(t), 16))
                    extra.append(a)
                    cuda.memcpy_dtod(int(a), ptr, _nbytes(t))
                    copy.append(int(a))
                in_sets.append(copy)
            stream = self.stream
            for i in range(max(warmup, 1)):
                self._enqueue(in_sets[i % sets], self.outputs, stream)
            stream.synchronize()

            def body() -> None:
                for i in range(iters):
                    self._enqueue(in_sets[i % sets], self.outputs, stream)

            start, end = cuda.Event(), cuda.Event()
            samples = []
            method, note = "cuda-graph", ""
            graphs = graph = exe = None
            try:
                graphs = _DriverGraphs()
                graph, exe = graphs.capture(stream.handle, body)
                graphs.launch(exe, stream.handle)  # warm the graph itself
                stream.synchronize()
            except (
                Exception
            ) as exc:  # ctypes/libcuda missing, or capture refused (pycuda error types)
                method, note = (
                    "events",
                    f"CUDA graph capture unavailable ({exc}); timed plain launches",
                )
                graph = exe = None
                stream.synchronize()
            try:
                for _ in range(repeats):
                    start.record(stream)
                    if exe is not None:
                        graphs.launch(exe, stream.handle)
                    else:
                        body()
                    end.record(stream)
                    end.synchronize()
                    samples.append(end.time_since(start) * 1000.0 / iters)
            finally:
                if exe is not None:
                    graphs.destroy(graph, exe)
                stream.synchronize()
                for a in extra:
                    a.free()
        return TimingResult(float(np.median(samples)), tuple(samples), method, iters, sets, note)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._ctx.push()
            try:
                if self._gemms is not None:
                    self._gemms.close()
                    self._gemms = None
                for a in self._allocs:
                    a.free()
                self._allocs.clear()
            finally:
                self._cuda.Context.pop()
            self._ctx.detach()
        finally:
            self._closed = True

    def __enter__(self) -> Program:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
