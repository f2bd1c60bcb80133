"""Time ONNX Runtime sessions the way a user pays for them, and cut regions out as models.

A model is timed per `run_with_iobinding` call with inputs and outputs already on the GPU (the
call synchronises its stream), after warm-up, as the median of several repeats of many calls.
Optionally ONNX Runtime's own CUDA graph replays the whole model. Inputs are random normal,
never zeros. `device_values` and `bind_session` are the pieces `mlso bench` interleaves several
models with (bench/compare.py); `time_session` times one session alone.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx

from mlso_cli.package.regionmodel import kernel_model, region_model
from mlso_cli.package.regionmodel import value_infos as _value_infos
from mlso_cli.verify.reference64 import input_specs

PLAIN = "plain"
CUDA_GRAPH = "cuda-graph"
"""The two ways ONNX Runtime serves a model on the CUDA EP (`optimize --serve`, `bench --mode`)."""


@dataclass(frozen=True)
class Timing:
    median_us: float
    repeats: list[float]


def random_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        n: rng.standard_normal(s).astype(dt) if np.dtype(dt).kind == "f" else np.ones(s, dt)
        for n, s, dt in input_specs(model)
    }


def device_values(feeds: dict[str, np.ndarray], gpu: int | None) -> dict:
    """The feeds as ONNX Runtime values on GPU `gpu` (None: in host memory), to bind once and
    share between sessions: every model reads the same input buffers."""
    import onnxruntime as ort

    where = ("cuda", gpu) if gpu is not None else ("cpu", 0)
    return {
        name: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr), *where)
        for name, arr in feeds.items()
    }


@dataclass(frozen=True)
class BoundSession:
    """A session with its inputs and outputs bound. `call` runs it once; `sync` waits for its
    outputs. Why IOBinding: no host copy per call, so a call costs what the model costs."""

    call: Callable[[], object]
    sync: Callable[[], object]
    values: dict
    """The bound input values (kept alive here while the binding uses them)."""


def bind_session(sess, values: dict, gpu: int | None) -> BoundSession:
    """Bind `values` (from device_values) as `sess`'s inputs, and its outputs on the same device."""
    io = sess.io_binding()
    for name, v in values.items():
        io.bind_ortvalue_input(name, v)
    for o in sess.get_outputs():
        if gpu is None:
            io.bind_output(o.name, "cpu")
        else:
            io.bind_output(o.name, "cuda", gpu)
    return BoundSession(lambda: sess.run_with_iobinding(io), io.synchronize_outputs, values)


def time_session(
    sess,
    feeds: dict[str, np.ndarray],
    gpu: int,
    *,
    warmup: int = 10,
    repeats: int = 5,
    iters: int = 100,
) -> Timing:
    """One session alone: `repeats` blocks of `iters` calls after `warmup`, the median per call.
    (`mlso bench` interleaves its models instead; see bench/interleave.py.)"""
    bound = bind_session(sess, device_values(feeds, gpu), gpu)
    for _ in range(warmup):
        bound.call()
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            bound.call()
        bound.sync()
        per_call.append((time.perf_counter() - t0) / iters * 1e6)
    return Timing(statistics.median(per_call), per_call)


def _time_modes(
    sub: onnx.ModelProto, gpu: int, repeats: int, iters: int
) -> dict[str, Timing | None]:
    """`sub` in ONNX Runtime on the CUDA EP, plain and under ORT's CUDA graph, keyed by the mode
    names `optimize --serve` takes ("plain", "cuda-graph"). A plain run that fails raises; a
    graph that cannot be captured (a node off the CUDA EP) is None.

    Why both, each kept: the select stage decides by the mode the model will be served in
    (`optimize --serve`), and reports the other for calibration."""
    from mlso_cli import runtime

    out: dict[str, Timing | None] = {}
    for mode, graph in ((PLAIN, False), (CUDA_GRAPH, True)):
        opts = {"device_id": gpu, "enable_cuda_graph": "1" if graph else "0"}
        try:
            sess = runtime.session(
                sub.SerializeToString(), providers=[("CUDAExecutionProvider", opts)]
            )
            out[mode] = time_session(sess, random_feeds(sub), gpu, repeats=repeats, iters=iters)
        except Exception:  # noqa: BLE001 - a graph ORT cannot capture: no figure in that mode
            if not graph:
                raise
            out[mode] = None
    return out


def _faster(times: dict[str, Timing | None]) -> Timing | None:
    got = [t for t in times.values() if t is not None]
    return min(got, key=lambda t: t.median_us) if got else None


def _time_in_ort(sub: onnx.ModelProto, gpu: int, repeats: int, iters: int) -> Timing:
    """`sub` in ONNX Runtime on the CUDA EP, plain and under ORT's CUDA graph: the faster.

    Why both: mlso's program is timed by CUDA-graph replay, and small-batch models are served
    with ORT's CUDA graphs, which remove the per-node launch cost the plain timing includes. A
    region judged against its plain time only (groupnorm_linear at bs 1: 65.5 µs plain, the
    whole model 32.5 µs under a graph) was packaged at a measured 1.02x and made the served
    model 2.2x slower. A model whose graph cannot be captured (a node off the CUDA EP) keeps
    its plain time. (`optimize --serve` now decides by one named mode: `_time_modes`.)"""
    return _faster(_time_modes(sub, gpu, repeats, iters))


@dataclass(frozen=True)
class RegionTiming:
    node: str
    overload: str
    """The node's function overload ("r0", "r1", ...: the region's position when packaged)."""
    orig_us: float
    """The region's original nodes (the kernel's fallback body) in ONNX Runtime on the CUDA EP."""
    kernel_us: float
    """The mlso program, by CUDA-graph replay through PyCUDA."""
    served_us: float | None = None
    """The region's MlsoKernel node alone in ONNX Runtime (the faster of plain and CUDA graph):
    the program plus what the custom op costs inside ORT (8-11 µs per region under CUDA graphs
    on the H200, measured 2026-12-02). None when it could not be timed."""
    orig_plain_us: float | None = None
    """The original nodes in plain ORT runs (None: not timed per mode, e.g. a test's timer)."""
    orig_graph_us: float | None = None
    """The original nodes replayed by ORT's CUDA graph (None: not capturable, or not timed)."""
    served_plain_us: float | None = None
    """The MlsoKernel node alone, one plain ORT call per run (None: could not be timed)."""
    served_graph_us: float | None = None
    """The MlsoKernel node alone under ORT's CUDA graph (None: not capturable, or not timed).

    Why the four figures: a region is served in one mode, and the faster-of-two figures above
    compare unlike things (a region fastest plain against a program fastest under a graph);
    `optimize --serve MODE` compares the two sides in MODE only."""

    @property
    def per_mode(self) -> bool:
        """Whether the per-mode figures were measured (the harness always does)."""
        return any(
            x is not None
            for x in (
                self.orig_plain_us,
                self.orig_graph_us,
                self.served_plain_us,
                self.served_graph_us,
            )
        )

    @property
    def cost_us(self) -> float:
        """What the region costs as served: the ORT-side time where there is one."""
        return self.served_us if self.served_us is not None else self.kernel_us

    @property
    def speedup(self) -> float:
        return self.orig_us / self.cost_us if self.cost_us else 0.0


def time_regions(
    model: onnx.ModelProto, gpu: int, *, repeats: int = 5, iters: int = 100
) -> list[RegionTiming]:
    """Each MlsoKernel of a packaged model: its original region vs its program, on one GPU."""
    from mlso_cli import runtime
    from mlso_cli.runtime.launcher import Program

    out = []
    infos = _value_infos(model)
    for checked in runtime.check_model(model):
        orig = _time_modes(region_model(model, checked.node, infos), gpu, repeats, iters)
        try:
            served = _time_modes(kernel_model(model, checked.node, infos), gpu, repeats, iters)
        except Exception:  # noqa: BLE001 - the program's own time still stands
            served = {PLAIN: None, CUDA_GRAPH: None}
        with Program(checked.binary, checked.plan, device=gpu) as prog:
            t_fast = prog.time(warmup=10, repeats=repeats, iters=iters)
        fastest = _faster(served)
        out.append(
            RegionTiming(
                checked.node.name,
                checked.overload,
                _faster(orig).median_us,
                t_fast.median_us,
                None if fastest is None else fastest.median_us,
                orig_plain_us=_us(orig[PLAIN]),
                orig_graph_us=_us(orig[CUDA_GRAPH]),
                served_plain_us=_us(served[PLAIN]),
                served_graph_us=_us(served[CUDA_GRAPH]),
            )
        )
    return out


def _us(t: Timing | None) -> float | None:
    return None if t is None else t.median_us
