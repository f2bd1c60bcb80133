"""Where `optimize --gpu` times its trial models: on this machine's GPU, or as Ray tasks.

    run_trials(trials, measure, gpu, executor) -> [timings | Lost]   in the order of `trials`

Why a module of its own: the timing pass (select.measure_top_k) builds one trial model per
rank j (each region's j-th pick packaged together) and times each. The trials are independent,
so with `--executor ray` each becomes a task that asks for one GPU (`num_gpus=1`; Ray then
gives it its own CUDA_VISIBLE_DEVICES, so it times on device 0 of what it sees), and the trials
run on as many GPUs as the cluster has. The trial carries its compiled binaries, so a GPU node
needs no compiler for the kernels, only the runtime library, which it builds into its own cache.

Faults: a task whose worker or node dies is rerun by Ray (RAY_RETRIES times) on another GPU. A
trial that still has no result, or that no GPU node took within `TIMING_WAIT_S`, is `Lost`: its
regions are decided by the cost model, and their report says so (pipeline/run.py). An error the
measurement itself raised is not a lost node and propagates as it does locally.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import onnx

from mlso_cli.search.executor import RAY, RAY_RETRIES, connect_ray, parse_spec

if TYPE_CHECKING:
    from mlso_cli.pipeline.select import MeasureFn

TIMING_WAIT_S = 1800.0
"""How long the driver waits for one trial's GPU timing on a cluster before it counts the trial
as lost (a task no GPU node can take waits in Ray's queue forever otherwise)."""


@dataclass(frozen=True)
class Lost:
    """A trial whose GPU timing did not come back: why, in words for the report."""

    reason: str


def run_trials(
    trials: Sequence[onnx.ModelProto],
    measure: MeasureFn,
    gpu: int,
    executor: str = "local",
    wait_s: float = TIMING_WAIT_S,
) -> list[Any]:
    """Each trial's `measure(trial, gpu)` result, or `Lost`, in the order of `trials`."""
    spec = parse_spec(executor)
    if spec.kind != RAY or not trials:
        return [measure(t, gpu) for t in trials]
    ray = connect_ray(spec.address, 1)
    gpus = _cluster_gpus(ray)
    if gpus < 1:
        return [Lost("the Ray cluster has no GPU; decided by the cost model")] * len(trials)
    task = ray.remote(num_gpus=1, max_retries=RAY_RETRIES, retry_exceptions=False)(_time_on_node)
    refs = [task.remote(measure, t.SerializeToString()) for t in trials]
    settled: set[int] = set()
    try:
        out = []
        for i, ref in enumerate(refs):
            out.append(_settle(ray, ref, wait_s))
            if not isinstance(out[-1], Lost):  # a lost one may still sit in a queue
                settled.add(i)
        return out
    finally:
        # what is still queued or running (Ctrl-C, a trial given up on) is cancelled; a task
        # that has ended is left alone (cancelling one Ray is retrying can abort the driver)
        unsettled = [ref for i, ref in enumerate(refs) if i not in settled]
        if unsettled:
            with contextlib.suppress(Exception):
                ready, _ = ray.wait(unsettled, num_returns=len(unsettled), timeout=0)
                for ref in unsettled:
                    if ref not in ready:
                        with contextlib.suppress(Exception):  # gone meanwhile: nothing to cancel
                            ray.cancel(ref, force=True)


def _cluster_gpus(ray) -> float:
    try:
        return float(ray.cluster_resources().get("GPU", 0))
    except Exception:  # noqa: BLE001 - no figure: let the tasks find out
        return 1.0


def _time_on_node(measure: MeasureFn, model: bytes) -> tuple[str, list]:
    """One trial on the GPU Ray gave this task (device 0 of its CUDA_VISIBLE_DEVICES)."""
    import ray

    trial = onnx.ModelProto()
    trial.ParseFromString(model)
    return ray.get_runtime_context().get_node_id(), measure(trial, 0)


_LOST_ERRORS = (
    "WorkerCrashedError",
    "NodeDiedError",
    "ObjectLostError",
    "OwnerDiedError",
    "TaskCancelledError",
    "RaySystemError",
    "GetTimeoutError",
)
"""Ray's names for a result that will not come (a node or worker gone, a queue never served),
as opposed to RayTaskError: the measurement itself raised."""


def _settle(ray, ref, wait_s: float) -> Any:
    try:
        _node, timings = ray.get(ref, timeout=wait_s)
        return timings
    except Exception as exc:  # noqa: BLE001 - sorted by name below
        name = type(exc).__name__
        if isinstance(exc, ray.exceptions.RayTaskError) and name not in _LOST_ERRORS:
            raise exc.as_instanceof_cause() from None
        if name not in _LOST_ERRORS and not isinstance(exc, ray.exceptions.RayError):
            raise
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else name
        if name == "GetTimeoutError":
            why = f"no GPU node returned it within {wait_s:g} s"
        else:
            why = f"its GPU node or worker was lost after {RAY_RETRIES} retries ({name}: {first})"
        return Lost(f"GPU timing lost: {why}; decided by the cost model")
