"""The select stage: rank a region's candidates by the cost model, optionally time the best few
on a GPU, and apply the never-slower rule.

Why rank by `program_cost` rather than trust each candidate's `estimate_us`: every candidate of
every region is then compared on one scale, the one the never-slower rule uses against ONNX
Runtime's cost (`onnx_region_cost`), whichever search produced them.

With --gpu, the top K by estimate are compiled and timed (`time_regions`, the harness that
`mlso bench` uses: the original region in ONNX Runtime against the program by CUDA-graph
replay), and the fastest measured one is kept; the rule then compares measurements.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import onnx

from mlso_cli.frontend.lift import LiftedRegion
from mlso_cli.frontend.load import LoadedModel
from mlso_cli.pipeline.artifacts import Choice, Searched
from mlso_cli.pipeline.build import Builder, package
from mlso_cli.runtime.check import MLSO_DOMAIN
from mlso_cli.search.api import Candidate
from mlso_cli.search.cost import Cost, onnx_region_cost, program_cost

MeasureFn = Callable[[onnx.ModelProto, int], list]
"""measure(packaged_model, gpu) -> [RegionTiming]: `mlso_cli.bench.harness.time_regions`."""


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    cost: Cost


@dataclass(frozen=True)
class Timing:
    """One candidate timed: its rank by estimate, the original region's and the program's µs."""

    rank: int
    orig_us: float
    kernel_us: float


def rank(candidates: Sequence[Candidate]) -> list[Ranked]:
    """Candidates by cost-model time, fastest first; ties keep the search's order."""
    ranked = [Ranked(c, program_cost(c.graph)) for c in candidates]
    return sorted(ranked, key=lambda r: r.cost.us)  # sorted() is stable


def wins(speedup: float, min_speedup: float) -> bool:
    """The never-slower rule: at least `min_speedup`, and strictly faster unless it is 0."""
    return speedup >= min_speedup and (min_speedup == 0 or speedup > 1.0)


def _verdict(speedup: float, min_speedup: float, how: str) -> tuple[bool, str]:
    if wins(speedup, min_speedup):
        return True, f"{how} {speedup:.2f}x"
    return False, f"kept original: {how} {speedup:.2f}x < {max(min_speedup, 1.0):g}x"


def choose(
    loaded: LoadedModel,
    lr: LiftedRegion,
    searched: Searched,
    min_speedup: float,
    timings: Sequence[Timing] | None = None,
) -> Choice:
    """The region's program: the best estimate, or with `timings` the fastest measured."""
    ranked = rank(searched.result.candidates)
    if timings:
        best = min(timings, key=lambda t: (t.kernel_us, t.rank))
        pick, before, after, how = ranked[best.rank], best.orig_us, best.kernel_us, "measured"
    else:
        pick = ranked[0]
        before, after, how = onnx_region_cost(loaded, lr.region).us, pick.cost.us, "estimated"
    speedup = before / after if after else 0.0
    packaged, why = _verdict(speedup, min_speedup, how)
    return Choice(
        lr.region.id,
        lr.region.label,
        pick.candidate,
        pick.cost.us,
        pick.cost.launches,
        before,
        after,
        bool(timings),
        packaged,
        why,
    )


def measure_top_k(
    loaded: LoadedModel,
    regions: Sequence[LiftedRegion],
    searched: Sequence[Searched],
    *,
    k: int,
    gpu: int,
    builder: Builder,
    seed: int,
    measure: MeasureFn,
) -> dict[int, list[Timing]]:
    """Time the k best-estimated candidates of every region: trial model j packages each region's
    j-th candidate (regions with fewer candidates sit out), and one timing pass measures them all."""
    ranked = {s.region: rank(s.result.candidates) for s in searched}
    out: dict[int, list[Timing]] = {lr.region.id: [] for lr in regions}
    for j in range(max(1, k)):
        members = [lr for lr in regions if j < len(ranked[lr.region.id])]
        if not members:
            break
        items = [(lr, builder.build(ranked[lr.region.id][j].candidate.graph)) for lr in members]
        trial = package(loaded, items, targets=builder.targets, seed=seed, bound=0.0)
        owner = _owners(trial, members)
        for t in measure(trial, gpu):
            out[owner[t.node]].append(Timing(j, t.orig_us, t.cost_us))
    return out


def _owners(trial: onnx.ModelProto, members: Sequence[LiftedRegion]) -> dict[str, int]:
    """MlsoKernel node name -> region id, matched by the tensors the node produces (overload and
    node names can skip numbers when the input model already holds mlso kernels)."""
    by_outputs = {tuple(lr.graph.output_names): lr.region.id for lr in members}
    return {
        n.name: by_outputs[tuple(n.output)]
        for n in trial.graph.node
        if n.domain == MLSO_DOMAIN and tuple(n.output) in by_outputs
    }
