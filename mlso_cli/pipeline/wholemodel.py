"""The whole-model check of `optimize --gpu`: is the model mlso would write faster, as served?

Each packaged region was measured faster alone (select.py). Regions alone are not the model: the
custom op's cost inside a captured graph, caches shared with neighbouring nodes and the graph
captured whole all differ. So the rewritten model and the original, both whole, are timed in the
user's serving mode, interleaved (bench/pair.py, `mlso bench`'s schedule), and the output is the
rewritten model only when it is measurably faster.

The rule. Let r_k = t_original,k / t_rewritten,k for each round k (both timed within that
round, so what a round shares cancels). The rewritten model is written when the lower quartile
of the r_k is above 1 (so is the median): in about three rounds of four or more it was faster.
Otherwise the output is the original model, every region written back, and the report says
why ("kept original: whole model measured 0.97x under cuda-graph ..."). `--min-speedup 0`
(package every region) writes the rewritten model whatever the check says, and says so.

Why the lower quartile, not the median: a median of 1.01x with rounds on both sides of 1 is no
evidence of a gain, and the rule is "never slower", so a tie goes to the original. Why the
whole original rather than dropping regions one at a time: each drop needs another interleaved
timing of the whole model, and when the regions' isolated measurements did not add up to a
faster model, their isolated margins are no reliable order to drop them in; the report keeps
every region's own figures, and `--min-speedup` raises the bar per region for a rerun.

When the original cannot run under ORT's CUDA graph (a node off the CUDA EP), the user cannot
serve it that way either: both are compared plain, and the verdict says so. When the original
cannot run at all, nothing is compared and the region measurements stand (the verdict says the
check did not run). A rewritten model that cannot run in the mode the original runs in is never
written.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from mlso_cli.bench.interleave import paired_speedups, spread
from mlso_cli.bench.pair import ModelTimes
from mlso_cli.pipeline.artifacts import CUDA_GRAPH, PLAIN, ModelCheck

ModelTimeFn = Callable[[onnx.ModelProto, onnx.ModelProto, int, str], ModelTimes]
"""time_models(original, rewritten, gpu, mode) -> ModelTimes: `bench.pair.time_pair`; a test
injects fixed per-round figures."""


def faster(times: ModelTimes) -> bool:
    """The rule: the lower quartile of the per-round ratios original / rewritten is above 1."""
    return spread(paired_speedups(times.original, times.rewritten)).q1 > 1.0


def model_verdict(times: ModelTimes, serve: str, min_speedup: float, note: str = "") -> ModelCheck:
    """The check's verdict on `times` (pure: what the tests drive with fixed figures)."""
    mode = times.mode
    tail = f" ({note})" if note else ""
    if times.original_failed is not None:
        why = (
            f"whole-model check not run: the original model cannot run under {mode} "
            f"({times.original_failed}); the region measurements decided{tail}"
        )
        return ModelCheck(serve, mode, False, True, why)
    if times.rewritten_failed is not None:
        why = (
            f"kept original: the rewritten model cannot run under {mode} "
            f"({times.rewritten_failed}){tail}"
        )
        return ModelCheck(serve, mode, False, False, why)
    s = spread(paired_speedups(times.original, times.rewritten))
    said = (
        f"whole model measured {s.median:.2f}x under {mode} (per-round IQR "
        f"{s.q1:.2f}-{s.q3:.2f}, {len(times.original)} rounds){tail}"
    )
    if faster(times):
        why, kept = said, True
    elif min_speedup == 0:
        why, kept = f"{said}; not measurably faster, written anyway (--min-speedup 0)", True
    else:
        why = f"kept original: {said}; not measurably faster (lower quartile <= 1)"
        kept = False
    return ModelCheck(
        serve,
        mode,
        True,
        kept,
        why,
        orig_us=spread(times.original).median,
        rewritten_us=spread(times.rewritten).median,
        speedup=s.median,
        speedup_iqr=(s.q1, s.q3),
        rounds=len(times.original),
    )


def check_whole_model(
    original: onnx.ModelProto,
    rewritten: onnx.ModelProto,
    gpu: int,
    serve: str,
    min_speedup: float,
    time_models: ModelTimeFn,
) -> ModelCheck:
    """Time both models in `serve` (plain when the original cannot be captured under a CUDA
    graph) and apply the rule."""
    times = time_models(original, rewritten, gpu, serve)
    note = ""
    if serve == CUDA_GRAPH and times.original_failed is not None:
        note = (
            f"the original model cannot run under ORT's CUDA graph ({times.original_failed}), "
            "so compared plain"
        )
        times = time_models(original, rewritten, gpu, PLAIN)
    return model_verdict(times, serve, min_speedup, note)
