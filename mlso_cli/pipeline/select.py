"""The select stage: rank a region's candidates by the cost model, optionally time the best few
on a GPU, and apply the never-slower rule.

Why rank by `program_cost` rather than trust each candidate's `estimate_us`: every candidate of
every region is then compared on one scale, the one the never-slower rule uses against ONNX
Runtime's cost (`onnx_region_cost`), whichever search produced them.

With --gpu, the top K by estimate are compiled and timed (`time_regions`, the harness that
`mlso bench` uses), and the fastest measured one is kept; the rule then compares measurements
like with like, in the mode the model will be served in (`--serve`, SERVE_MODES): under
`cuda-graph` the region's original nodes replayed by ORT's CUDA graph against the MlsoKernel
node alone (a one-node model) replayed the same way; under `plain` both as plain ORT runs. Why
not the faster of the two modes on each side, as before: a region fastest plain against a
program fastest under a graph is no deployment anyone runs, and it packaged programs that made
the served model slower. The program's own CUDA-graph replay time (no ORT) is reported beside.

With --gpu, each region's *baseline program* is timed too, in one more trial model beside the
picks (`measure_top_k`): the lifted program, every op a kernel-level op, which codegen lowers to
library GEMMs (cuBLASLt, codegen/libgemm.py) plus generated kernels for everything else. It is
what ONNX Runtime runs for the region, done by mlso, so its time against the original nodes'
(`baseline_vs_ort`) says whether a slower region is the fused program's fault or the baseline's.
It competes: it is chosen when it is strictly faster than every timed pick (the never-slower
rule then compares it with the original nodes as any pick). Where it is a pick already, that
pick's figures are its figures and no trial is added.

Without a GPU the cost model decides: `onnx_region_cost` (ORT's plain per-node cost included)
against `program_cost`. Under `--serve plain` the program side also pays one ORT node
(`Hardware.ort_node_s`): the MlsoKernel node is one node of the plain run. Under `cuda-graph`
the comparison is the cost model's as it was (it has no CUDA-graph figure for either side).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import onnx

from mlso_cli.errors import MlsoError
from mlso_cli.frontend.lift import LiftedRegion
from mlso_cli.frontend.load import LoadedModel
from mlso_cli.ir.hashing import graph_hash
from mlso_cli.pipeline.artifacts import CUDA_GRAPH, PLAIN, Choice, ModeTimes, Searched
from mlso_cli.pipeline.build import Builder, package
from mlso_cli.runtime.check import MLSO_DOMAIN
from mlso_cli.search.api import Candidate
from mlso_cli.search.cost import H200, Cost, onnx_region_cost, program_cost

MeasureFn = Callable[[onnx.ModelProto, int], list]
"""measure(packaged_model, gpu) -> [RegionTiming]: `mlso_cli.bench.harness.time_regions`.
A test injects its own, returning fixed figures (RegionTiming's per-mode fields, or only
`orig_us`/`kernel_us`/`served_us`, which are then taken as the named mode's)."""

BASELINE_PARITY = 1.05
"""Issue 31's bar for a region's baseline program: at most this times ONNX Runtime's time for
the region's nodes, as served (`Choice.baseline_vs_ort`)."""


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    cost: Cost


@dataclass(frozen=True)
class Figures:
    """What the rule compares for one timed candidate in one mode."""

    orig_us: float | None
    served_us: float | None
    mode: str
    note: str = ""


@dataclass(frozen=True)
class Timing:
    """One candidate timed: its rank by estimate, the original region's and the program's µs.

    `orig_us`/`kernel_us` are the harness's faster-of-two-modes figures (`kernel_us`: the
    program as served where it was timed so); `modes` the per-mode figures the rule uses, empty
    when the timer gave none (a test's fixed figures, then read as the named mode's)."""

    rank: int
    orig_us: float
    kernel_us: float
    program_us: float | None = None
    """The program alone by CUDA-graph replay (no ORT)."""
    modes: tuple[ModeTimes, ...] = ()
    baseline: bool = False
    """The timed program is the region's baseline program (its lifted program)."""
    beside: bool = False
    """Timed in the baseline trial, beside the picks rather than as one of them: chosen only
    when strictly faster than every pick, so that a tie changes nothing."""

    def in_mode(self, serve: str) -> Figures:
        """The figures for deployment mode `serve`. Under cuda-graph, a region whose original
        nodes cannot be captured (a node off the CUDA EP) cannot be served under a graph either
        way, so both sides are compared plain, and the note says so."""
        if not self.modes:
            return Figures(self.orig_us, self.kernel_us, serve)
        by = {m.mode: m for m in self.modes}
        m = by[serve]
        if serve == CUDA_GRAPH and m.orig_us is None:
            p = by[PLAIN]
            note = "the original region cannot run under ORT's CUDA graph, so compared plain"
            return Figures(p.orig_us, p.served_us, PLAIN, note)
        return Figures(m.orig_us, m.served_us, serve)


def rank(candidates: Sequence[Candidate]) -> list[Ranked]:
    """Candidates by cost-model time, fastest first; ties keep the search's order."""
    ranked = [Ranked(c, program_cost(c.graph)) for c in candidates]
    return sorted(ranked, key=lambda r: r.cost.us)  # sorted() is stable


def wins(speedup: float, min_speedup: float) -> bool:
    """The never-slower rule: at least `min_speedup`, and strictly faster unless it is 0."""
    return speedup >= min_speedup and (min_speedup == 0 or speedup > 1.0)


def _verdict(
    speedup: float, min_speedup: float, how: str, where: str, note: str = ""
) -> tuple[bool, str]:
    said = f"{how} {speedup:.2f}x {where}"
    if wins(speedup, min_speedup):
        return True, said + (f" ({note})" if note else "")
    bar = f"{max(min_speedup, 1.0):g}x"
    return False, f"kept original: {said} < {bar}" + (f" ({note})" if note else "")


def served_estimate_us(cost: Cost, serve: str) -> float:
    """The cost model's figure for a program as served in `serve`: under plain ORT it is one
    node of the run and pays ORT's per-node cost, as `onnx_region_cost` charges each original
    node; under cuda-graph the program's own estimate, as before (cost.py has no figure for an
    ORT node under a graph)."""
    return cost.us + (H200.ort_node_s * 1e6 if serve == PLAIN else 0.0)


def choose(
    loaded: LoadedModel,
    lr: LiftedRegion,
    searched: Searched,
    min_speedup: float,
    timings: Sequence[Timing] | None = None,
    serve: str = CUDA_GRAPH,
) -> Choice:
    """The region's program: the best estimate, or with `timings` the fastest measured as
    served in mode `serve`, and whether the never-slower rule packages it."""
    ranked = rank(searched.result.candidates)
    onnx_us = onnx_region_cost(loaded, lr.region).us
    if not timings:
        pick = ranked[0]
        before, after = onnx_us, served_estimate_us(pick.cost, serve)
        speedup = before / after if after else 0.0
        packaged, why = _verdict(speedup, min_speedup, "estimated", f"for {serve}")
        return _choice(lr, pick, before, after, False, packaged, why, serve, onnx_us=onnx_us)
    figs = [(t, t.in_mode(serve)) for t in timings]
    timed = [(t, f) for t, f in figs if f.orig_us is not None and f.served_us is not None]
    if not timed:
        t, f = min(figs, key=lambda x: x[0].rank)
        why = (
            f"kept original: no candidate's MlsoKernel node could be timed in ONNX Runtime "
            f"under {f.mode}, so nothing shows it is faster as served"
        )
        return _with_baseline(
            _choice(lr, ranked[t.rank], f.orig_us or 0.0, 0.0, True, False, why, serve, t, onnx_us),
            timings,
        )
    t, f = min(timed, key=lambda x: (x[1].served_us, x[0].beside, x[0].rank))
    speedup = f.orig_us / f.served_us if f.served_us else 0.0
    note = "; ".join(n for n in (f.note, "the baseline program" if t.beside else "") if n)
    packaged, why = _verdict(speedup, min_speedup, "measured", f"under {f.mode}", note)
    return _with_baseline(
        _choice(lr, ranked[t.rank], f.orig_us, f.served_us, True, packaged, why, serve, t, onnx_us),
        timings,
    )


def choose_bounded(
    loaded: LoadedModel,
    lr: LiftedRegion,
    searched: Searched,
    min_speedup: float,
    timings: Sequence[Timing] | None = None,
    serve: str = CUDA_GRAPH,
) -> Choice:
    """`choose`, among the candidates the field check can bound. Why: a candidate the search
    did not verify (its bound is 0: the lifted program itself, kept as the never-slower
    fallback) is checked only before writing, and a program whose per-trial bound is 1 would
    be refused there ("no useful bound"). The degree analysis finds that out before the choice
    (verify/equivalence.py::unbounded), so another candidate, or the original nodes, is chosen."""
    from dataclasses import replace

    from mlso_cli.verify.equivalence import unbounded

    every = tuple(timings or ())  # the baseline is reported even where it cannot be chosen
    keep, why = [], None
    for c in searched.result.candidates:
        reason = None if c.bound > 0 else unbounded(lr.graph, c.graph)
        if reason is None:
            keep.append(c)
        else:
            why = why or reason
    if len(keep) == len(searched.result.candidates):
        return choose(loaded, lr, searched, min_speedup, timings, serve)
    if not keep:
        pick = rank(searched.result.candidates)[0]
        onnx_us = onnx_region_cost(loaded, lr.region).us
        why = f"kept original: {why}"
        return _with_baseline(
            _choice(lr, pick, onnx_us, 0.0, False, False, why, serve, onnx_us=onnx_us), every
        )
    result = replace(searched.result, candidates=tuple(keep))
    if timings:  # timed ranks index the full ranking: keep those of bounded candidates only
        full = rank(searched.result.candidates)
        now = rank(keep)
        index = {id(r.candidate): i for i, r in enumerate(now)}
        timings = [
            replace(t, rank=index[id(full[t.rank].candidate)])
            for t in timings
            if id(full[t.rank].candidate) in index
        ]
    choice = choose(loaded, lr, replace(searched, result=result), min_speedup, timings, serve)
    return _with_baseline(choice, every)


def _with_baseline(choice: Choice, timings: Sequence[Timing]) -> Choice:
    """`choice` with the region's baseline program's figures in its serving mode (as the rule
    reads them: plain where the original nodes cannot be captured), where it was timed."""
    from dataclasses import replace

    base = next((t for t in timings if t.baseline), None)
    if base is None:
        return choice
    f = base.in_mode(choice.serve)
    return replace(
        choice,
        baseline_us=f.served_us,
        baseline_orig_us=f.orig_us,
        baseline_program_us=base.program_us,
    )


def _choice(
    lr: LiftedRegion,
    pick: Ranked,
    before: float,
    after: float,
    measured: bool,
    packaged: bool,
    why: str,
    serve: str,
    timing: Timing | None = None,
    onnx_us: float | None = None,
) -> Choice:
    return Choice(
        lr.region.id,
        lr.region.label,
        pick.candidate,
        pick.cost.us,
        pick.cost.launches,
        before,
        after,
        measured,
        packaged,
        why,
        serve=serve,
        program_us=None if timing is None else timing.program_us,
        modes=() if timing is None else timing.modes,
        onnx_estimate_us=onnx_us,
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
    executor: str = "local",
    lost: dict[int, str] | None = None,
) -> dict[int, list[Timing]]:
    """Time the k best-estimated candidates of every region, and the verified one with the fewest
    launches when it is not among them (the search verifies it for this: whether a launch pays
    is for the GPU to say). Trial model j packages each region's j-th pick (regions with fewer
    picks sit out), and one timing pass measures them all: on this GPU, or with `executor` ray
    as one GPU task per trial (pipeline/timing.py). A trial whose timing was lost adds its
    regions to `lost` (region id -> why), and they go without that trial's figures.

    One more trial, after the picks', packages each region's baseline program (`baseline_index`)
    where it is not a pick already; its timings carry `baseline` and `beside`. A region whose
    baseline cannot be compiled sits that trial out (the baseline is extra: it never fails a
    run that would have succeeded without it)."""
    from mlso_cli.pipeline.timing import Lost, run_trials

    ranked = {s.region: rank(s.result.candidates) for s in searched}
    picks = {r: _picks(ranked[r], k) for r in ranked}
    base = {lr.region.id: baseline_index(ranked[lr.region.id], lr) for lr in regions}
    out: dict[int, list[Timing]] = {lr.region.id: [] for lr in regions}
    builder.prebuild(
        [
            (ranked[lr.region.id][i].candidate.graph, lr.extra_inputs)
            for lr in regions
            for i in picks[lr.region.id]
        ]
    )
    # (members with their rank index in this trial, whether it is the baseline trial)
    rounds: list[tuple[list[tuple[LiftedRegion, int]], bool]] = [
        ([(lr, picks[lr.region.id][j]) for lr in regions if j < len(picks[lr.region.id])], False)
        for j in range(max(len(p) for p in picks.values()) if picks else 0)
    ]
    beside = [
        (lr, base[lr.region.id])
        for lr in regions
        if base[lr.region.id] is not None and base[lr.region.id] not in picks[lr.region.id]
    ]
    built = _build_baselines(builder, [(lr, ranked[lr.region.id][b]) for lr, b in beside])
    beside = [(lr, b) for lr, b in beside if lr.region.id in built]
    if beside:
        rounds.append((beside, True))
    trials, owners = [], []
    for members, is_base in rounds:
        items = [
            (
                lr,
                built[lr.region.id]
                if is_base
                else builder.build(ranked[lr.region.id][i].candidate.graph, lr.extra_inputs),
            )
            for lr, i in members
        ]
        trial = package(loaded, items, targets=builder.targets, seed=seed, bound=0.0)
        trials.append(trial)
        owners.append(_owners(trial, [lr for lr, _ in members]))
    for (members, is_base), owner, result in zip(
        rounds, owners, run_trials(trials, measure, gpu, executor)
    ):
        if isinstance(result, Lost):
            for lr, _ in members:
                if lost is not None:
                    lost.setdefault(lr.region.id, result.reason)
            continue
        index = {lr.region.id: i for lr, i in members}
        for t in result:
            region = owner[t.node]
            i = index[region]
            out[region].append(_timing(i, t, baseline=i == base[region], beside=is_base))
    return out


def baseline_index(ranked: Sequence[Ranked], lr: LiftedRegion) -> int | None:
    """The index in `ranked` of the region's baseline program: its lifted program, every op a
    kernel-level op, which codegen lowers to library GEMMs (codegen/libgemm.py) plus generated
    kernels for everything else. The search always returns it, as the never-slower fallback
    (search/api.py); None for a result without it (only a test's fake search returns one).
    Found by content hash, the one a region's search is cached under: names play no part."""
    want = graph_hash(lr.graph)
    return next((i for i, r in enumerate(ranked) if graph_hash(r.candidate.graph) == want), None)


def _build_baselines(builder: Builder, items: Sequence[tuple[LiftedRegion, Ranked]]) -> dict:
    """region id -> the built baseline program, for those that compile. Why not raise: the
    baseline trial is measured beside the picks; a lifted program that codegen or nvcc refuses
    (no pick needed it before) leaves its region without a baseline figure, not the run failed."""
    import contextlib

    with contextlib.suppress(MlsoError):  # a failure is met again, alone, by `build` below
        builder.prebuild([(r.candidate.graph, lr.extra_inputs) for lr, r in items])
    built = {}
    for lr, r in items:
        with contextlib.suppress(MlsoError):
            built[lr.region.id] = builder.build(r.candidate.graph, lr.extra_inputs)
    return built


def _picks(ranked: Sequence[Ranked], k: int) -> list[int]:
    """Indexes into `ranked` to time: the first k, then the fewest-launch verified candidate."""
    picks = list(range(min(max(1, k), len(ranked))))
    verified = [i for i, r in enumerate(ranked) if r.candidate.bound > 0]
    if verified:
        fewest = min(verified, key=lambda i: (ranked[i].candidate.kernels, i))
        # fewer launches than every pick (so not a pick itself)
        if all(ranked[fewest].candidate.kernels < ranked[i].candidate.kernels for i in picks):
            picks.append(fewest)
    return picks


def _timing(rank: int, t, *, baseline: bool = False, beside: bool = False) -> Timing:
    """A harness RegionTiming as the rule reads it (per-mode figures where it has them)."""
    modes: tuple[ModeTimes, ...] = ()
    if getattr(t, "per_mode", False):
        modes = (
            ModeTimes(CUDA_GRAPH, t.orig_graph_us, t.served_graph_us),
            ModeTimes(PLAIN, t.orig_plain_us, t.served_plain_us),
        )
    return Timing(rank, t.orig_us, t.cost_us, t.kernel_us, modes, baseline, beside)


def _owners(trial: onnx.ModelProto, members: Sequence[LiftedRegion]) -> dict[str, int]:
    """MlsoKernel node name -> region id, matched by the tensors the node produces (overload and
    node names can skip numbers when the input model already holds mlso kernels)."""
    by_outputs = {tuple(lr.graph.output_names): lr.region.id for lr in members}
    return {
        n.name: by_outputs[tuple(n.output)]
        for n in trial.graph.node
        if n.domain == MLSO_DOMAIN and tuple(n.output) in by_outputs
    }
