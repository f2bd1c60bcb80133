"""Time two in-memory models against each other, interleaved, in one ONNX Runtime serving mode.

What `optimize --gpu` uses for its whole-model check: the model it would write (regions
replaced by MlsoKernel nodes) against the same model with every region left as it was, after
each region alone was measured faster. Why a whole-model check on top of the region timings: a
region timed alone is not the region inside its model (the custom op's synchronisation, caches
shared with the neighbouring nodes, a CUDA graph captured whole), and the user pays for the
model, not for its regions.

The timing is `mlso bench`'s (bench/interleave.py: rounds, rotated and mirrored blocks, one set
of inputs shared by both sessions, IOBinding on the GPU); only the bookkeeping differs: a model
that cannot run in the mode is reported as which side failed, and why, rather than raised, so
that the pipeline can decide (a rewritten model that cannot be served in the user's mode is not
written; an original that cannot leaves nothing to compare).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import onnx

from mlso_cli.errors import first_line

ORIGINAL = "original"
REWRITTEN = "rewritten"


@dataclass(frozen=True)
class ModelTimes:
    """Per-round per-call µs of both models in `mode`, round r of each timed within the same
    round; or, when a side could not be opened, warmed up or placed on the GPU, why."""

    mode: str
    original: tuple[float, ...] = ()
    rewritten: tuple[float, ...] = ()
    original_failed: str | None = None
    """The original could not run in `mode` (then nothing was timed)."""
    rewritten_failed: str | None = None
    """The rewritten model could not run in `mode` while the original could."""


def time_pair(
    original: onnx.ModelProto,
    rewritten: onnx.ModelProto,
    gpu: int,
    mode: str,
    *,
    rounds: int = 15,
    iters: int = 50,
    warmup: int = 10,
    clock: Callable[[], float] = time.perf_counter,
) -> ModelTimes:
    """Both models (weights in memory, static inputs) on GPU `gpu` in `mode` ("plain" or
    "cuda-graph"), `rounds` rounds of `iters` calls each, interleaved. The defaults are
    `mlso bench`'s."""
    from mlso_cli.bench.compare import open_session
    from mlso_cli.bench.harness import bind_session, device_values, random_feeds
    from mlso_cli.bench.interleave import Contender, interleave
    from mlso_cli.bench.models import BenchModel
    from mlso_cli.console import log
    from mlso_cli.verify.reference64 import input_specs

    try:
        values = device_values(random_feeds(original), gpu)
    except Exception as exc:  # noqa: BLE001 - ORT's errors are one class per status code
        return ModelTimes(
            mode, original_failed=f"inputs not placed on GPU {gpu}: {first_line(exc)}"
        )
    bound = []
    for side, model in ((ORIGINAL, original), (REWRITTEN, rewritten)):
        bench_model = BenchModel(side, None, model, None, True, input_specs(model))
        try:
            b = bind_session(open_session(bench_model, mode, gpu), values, gpu)
            for _ in range(warmup):
                b.call()
            b.sync()
        except Exception as exc:  # noqa: BLE001 - as above; MlsoError (no CUDA EP) included
            return ModelTimes(mode, **{f"{side}_failed": first_line(exc)})
        bound.append(b)
    log(
        f"whole-model check on GPU {gpu}: original against rewritten under {mode}, "
        f"{rounds} rounds x {iters} calls, interleaved"
    )
    samples = interleave(
        [Contender(b.call, b.sync) for b in bound], rounds=rounds, iters=iters, clock=clock
    )
    del bound
    gc.collect()  # release both sessions (and their GPU memory) before anything else runs
    return ModelTimes(mode, tuple(samples[0]), tuple(samples[1]))
