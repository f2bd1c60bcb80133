"""Every model against the first, in ONNX Runtime, interleaved: what `mlso bench` prints.

All the models of a mode are opened in one process before any is timed, bound to one set of
inputs (made from the first model's input specs), warmed up, and then timed by
`interleave.interleave`, round by round. Each model's figure is the median per-call time of the
rounds with its interquartile range; its speedup is the first model's time over its own, taken
within each round, with the median and interquartile range of those per-round ratios.

A library, not the command: tests call `compare` with their own clock (a CPU-time clock makes a
self-against-self run on a loaded machine meaningful), and the command only parses and prints.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

from mlso_cli.bench.models import BenchModel
from mlso_cli.console import log
from mlso_cli.errors import EnvironmentProblem, InputError, MlsoError, first_line

PLAIN = "plain"
CUDA_GRAPH = "cuda-graph"
CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"


def open_session(model: BenchModel, mode: str, gpu: int | None, threads: int | None = None):
    """An ONNX Runtime session of `model` for `mode` on GPU `gpu` (None: the CPU EP), with the
    mlso library registered where it can run (runtime.session decides; on the CPU EP MlsoKernel
    nodes run their fallback bodies)."""
    import onnxruntime as ort

    from mlso_cli import runtime

    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # ORT's warnings are not ours to print; errors still raise
    if threads is not None:
        opts.intra_op_num_threads = threads
    if gpu is None:
        providers: list = [CPU_EP]
    else:
        graph = "1" if mode == CUDA_GRAPH else "0"
        providers = [(CUDA_EP, {"device_id": gpu, "enable_cuda_graph": graph})]
    sess = runtime.session(model.for_session(), providers=providers, sess_options=opts)
    if gpu is not None and CUDA_EP not in sess.get_providers():
        raise EnvironmentProblem(
            f"ONNX Runtime opened {model.source} without its CUDA EP (CUDA or cuDNN libraries "
            "could not be loaded)",
            "Check the CUDA and cuDNN versions onnxruntime-gpu needs, or drop --gpu",
        )
    return sess


def time_mode(
    models: Sequence[BenchModel],
    mode: str,
    gpu: int | None,
    feeds: dict,
    *,
    rounds: int,
    iters: int,
    warmup: int = 10,
    threads: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[dict[int, list[float]], dict[int, str]]:
    """Per-round samples of every model in `mode` (index -> per-call µs, one per round) and the
    models that cannot run in it (index -> why).

    A model ONNX Runtime cannot open or run is an InputError in plain mode; under the CUDA graph
    it is a note and a skip (a node placed on the CPU, say), since its plain figure stands. If
    the first model cannot run in a mode, that mode has no comparison at all."""
    from mlso_cli.bench.harness import bind_session, device_values
    from mlso_cli.bench.interleave import Contender, interleave

    values = device_values(feeds, gpu)
    bound: dict[int, Any] = {}
    skipped: dict[int, str] = {}
    for i, m in enumerate(models):
        try:
            b = bind_session(open_session(m, mode, gpu, threads), values, gpu)
            for _ in range(warmup):
                b.call()
            b.sync()
        except MlsoError:
            raise
        except Exception as exc:  # noqa: BLE001 - ORT's errors are one class per status code
            if mode != CUDA_GRAPH:
                raise InputError(
                    f"ONNX Runtime cannot run {m.source}: {first_line(exc)}",
                    "Check that the model runs in ONNX Runtime on this execution provider",
                ) from None
            skipped[i] = f"cannot run under ONNX Runtime's CUDA graph: {first_line(exc)}"
            log(f"note: {m.source} {skipped[i]}; its plain figure stands")
            continue
        bound[i] = b
    if 0 in skipped:
        for i in bound:
            skipped[i] = (
                f"no {mode} figure for the first model ({models[0].source}) to compare with"
            )
        log(f"note: no {mode} comparison: the first model cannot run in that mode")
        return {}, skipped
    order = sorted(bound)
    where = "CPU" if gpu is None else f"GPU {gpu}"
    log(
        f"timing {mode} on {where}: {len(order)} models, {rounds} rounds x {iters} calls, interleaved"
    )
    samples = interleave(
        [Contender(bound[i].call, bound[i].sync) for i in order],
        rounds=rounds,
        iters=iters,
        clock=clock,
    )
    del bound
    gc.collect()  # release this mode's sessions (and their GPU memory) before the next
    return dict(zip(order, samples)), skipped


def model_rows(
    models: Sequence[BenchModel],
    mode: str,
    device: str,
    samples: dict[int, list[float]],
    skipped: dict[int, str],
    *,
    rounds: int,
    iters: int,
    ep: str,
) -> list[dict]:
    """One row per model in `mode`: the compared models in order, then the first.

    Why the first model last: readers of the older two-model output took the first "model" row
    as ORIG against FAST, and that row is still the second model against the first."""
    from mlso_cli.bench.interleave import paired_speedups, spread

    rows = []
    ref = samples.get(0)
    for i in [*range(1, len(models)), 0]:
        row: dict[str, Any] = {
            "type": "model",
            "mode": mode,
            "ep": ep,
            "device": device,
            "index": i,
            "model": models[i].source,
            "rounds": rounds,
            "iters": iters,
        }
        if ref is None or i not in samples:
            row["skipped"] = skipped.get(i, "not timed")
            rows.append(row)
            continue
        t = spread(samples[i])
        s = spread(paired_speedups(ref, samples[i]))
        row.update(
            median_us=t.median,
            iqr_us=[t.q1, t.q3],
            range_us=[t.lo, t.hi],
            speedup=s.median,
            speedup_iqr=[s.q1, s.q3],
            orig_us=spread(ref).median,
            fast_us=t.median,
            verdict=verdict(s.median, s.q1, s.q3, i),
        )
        if i != 0 and gpu_less(ep) and (models[i].mlso_nodes or models[0].mlso_nodes):
            # both sides ran the same computation (MlsoKernel nodes fall back to their original
            # nodes without a GPU): any ratio is noise between two runs, never a speedup
            row.update(speedup=None, speedup_iqr=None, verdict=FALLBACK)
        rows.append(row)
    return rows


FALLBACK = (
    "no speedup reported: without a GPU the MlsoKernel nodes ran their fallback bodies (the "
    "original nodes), so both models ran the same computation"
)
NO_DIFFERENCE = "no measurable difference"


def gpu_less(ep: str) -> bool:
    """Whether the rows were timed without a GPU (the CPU EP)."""
    return ep.lower() in ("cpu", CPU_EP.lower())


def verdict(speedup: float, q1: float, q3: float, index: int) -> str:
    """What a ratio says, in words: where its interquartile range spans 1.0, the rounds do not
    tell the two models apart, and printing the median (say 1.09x) would label noise a result."""
    if index == 0:
        return "reference"
    if q1 <= 1.0 <= q3:
        return NO_DIFFERENCE
    return f"{speedup:.2f}x faster" if speedup > 1.0 else f"{1.0 / speedup:.2f}x slower"


def region_rows(
    models: Sequence[BenchModel], gpu: int, device: str, *, rounds: int, iters: int
) -> list[dict]:
    """Each MlsoKernel region of each model: its original nodes against its program
    (`harness.time_regions`, as `optimize --gpu` measures them)."""
    from mlso_cli.bench.harness import time_regions

    rows = []
    for i, m in enumerate(models):
        if not m.mlso_nodes:
            continue
        for rt in time_regions(m.with_weights(), gpu, repeats=rounds, iters=iters):
            rows.append(
                {
                    "type": "region",
                    "device": device,
                    "index": i,
                    "model": m.source,
                    "node": rt.node,
                    "orig_us": rt.orig_us,
                    "kernel_us": rt.kernel_us,
                    "served_us": rt.served_us,
                    "speedup": rt.speedup,
                }
            )
    return rows


def compare(
    models: Sequence[BenchModel],
    modes: Sequence[str],
    gpu: int | None,
    *,
    device: str,
    rounds: int,
    iters: int,
    warmup: int = 10,
    threads: int | None = None,
    regions: bool = True,
    clock: Callable[[], float] = time.perf_counter,
) -> list[dict]:
    """The rows `mlso bench --json` prints: per mode, one per model (model_rows), then with a
    GPU and `regions` one per MlsoKernel region. The models must take the same inputs
    (models.require_same_inputs); the feeds are made from the first."""
    from mlso_cli.bench.harness import random_feeds

    feeds = random_feeds(models[0].model)
    ep = "cpu" if gpu is None else "cuda"
    rows: list[dict] = []
    for mode in modes:
        samples, skipped = time_mode(
            models,
            mode,
            gpu,
            feeds,
            rounds=rounds,
            iters=iters,
            warmup=warmup,
            threads=threads,
            clock=clock,
        )
        rows += model_rows(
            models, mode, device, samples, skipped, rounds=rounds, iters=iters, ep=ep
        )
    if gpu is not None and regions:
        rows += region_rows(models, gpu, device, rounds=rounds, iters=iters)
    return rows
