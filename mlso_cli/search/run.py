"""The search stage: signatures -> enumeration -> verification -> dimensions -> ranked candidates.

    search(target, options, progress) -> SearchResult          (the SearchFn of search/api.py)

Order of work, and why:
  1. Reduce the target (shrink.py): enumeration and the per-structure field check run on small
     index sizes, where a check costs milliseconds.
  2. Each mapping signature (space.py) is explored on its own (`explore`): block structures
     enumerated bottom-up (enumerate.py), split signatures completed at kernel level, every
     complete structure checked against the reduced target in the finite field (a filter), and
     the survivors sized on the full shapes by the cost model (select.py). Signatures are
     independent, so `--jobs N` explores them in a process pool, or `--executor ray` as Ray
     tasks (executor.py).
  3. The parent re-verifies the cheapest few at full shapes, in a fixed order, with the run's
     union bound (the k-th full check must reach bound / (k (k+1))); only full checks accept.
     The lifted target itself is always a candidate (never-slower).
Determinism: each signature gets the same share of `max_states` and its own seed derived from
the run seed, so the result does not depend on `--jobs` or on the order workers finish.

Budgets and interrupts (`_Pool`): `--budget S` is a wall-clock promise for the whole region,
checks included. Exploration may use EXPLORE_SHARE of it; the full-shape checks the rest. The
driver waits for its workers only until the region's deadline: work still running then is
cancelled, the workers are killed, and the result is marked partial (never cached). With a budget the search
runs in a pool even at `--jobs 1`, since only a separate process can be stopped mid-check.
Workers ignore SIGINT; on Ctrl-C the driver kills them (mlso_cli/interrupt.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace

from threadpoolctl import threadpool_limits

from mlso_cli import interrupt
from mlso_cli.codegen.budget import problems
from mlso_cli.ir import build as b
from mlso_cli.ir import serialize
from mlso_cli.ir.graph import KernelGraph
from mlso_cli.ir.node import Node
from mlso_cli.ir.ops import Op
from mlso_cli.search import state
from mlso_cli.search.api import (
    DEFAULT_STATES_CAP,
    STATES_PER_SIGNATURE,
    Candidate,
    ProgressFn,
    SearchOptions,
    SearchProgress,
    SearchResult,
)
from mlso_cli.search.cost import program_cost
from mlso_cli.search.dims import DimClasses, dim_classes
from mlso_cli.search.enumerate import (
    BlockSearch,
    KernelCompletion,
    Limits,
    SearchAlgebra,
    Stats,
    Vocabulary,
)
from mlso_cli.search.executor import Executor, make_executor
from mlso_cli.search.fingerprint import Fingerprints
from mlso_cli.search.prune import ExprPruner
from mlso_cli.search.select import choose_dims, signature_sizes
from mlso_cli.search.shrink import shrink
from mlso_cli.search.space import (
    Dims,
    Recipe,
    RecipeError,
    Signature,
    feeds_of,
    instantiate,
    iters,
    signatures,
    with_whole_variants,
)
from mlso_cli.verify.equivalence import check_equivalent

FULL_BOUND = 2.0**-60
"""The false-accept bound a region's first full-shape check must reach (the k-th: FULL_BOUND /
(k (k + 1)), so that the union over a run's checks stays below FULL_BOUND)."""
CHECK_PARTS = 2
"""Each full-shape check is run as this many independent halves (own seeds, own fields), each
to the CHECK_PARTS-th root of the check's bound: a wrong program passes all of them with at most
the product of their bounds. Why: the halves run side by side on the pool, so one check costs
half the wall clock (at batch 16 one attention check took minutes of a core). The split does not
depend on --jobs, so the result does not either."""
FILTER_BOUND = 2.0**-30
"""The reduced-shape check is a filter, not an acceptance: a looser bound suffices."""
COMPLETION_STATES = 20_000
"""At most this much of a split signature's share is kept for its kernel-level completion."""


def provisional(dc: DimClasses, sig: Signature) -> Dims | None:
    """The smallest sizes that show a signature's structure: two blocks per grid dim and two
    loop steps, where the index is large enough to leave tiles of at least two. A spatial grid
    dim may leave tiles of one: blocks side by side compute independent outputs, so a tile of
    one shows the same structure (gqa at batch 1 has two KV heads, and its fast programs put
    them on the grid); a partial sum or a loop over one element would not."""
    size = {c.id: c.size for c in dc.classes}
    grid = []
    for ax in sig.grid:
        if size[ax.cls] < (4 if ax.partial else 2):
            return None
        grid.append(2)
    loop = 1
    if sig.loop is not None:
        split = 2 if any(a.cls == sig.loop for a in sig.grid) else 1
        if size[sig.loop] // split < 4:
            return None
        loop = 2
    return Dims(tuple(grid), loop)


def save_slots(recipe: Recipe) -> tuple[int, ...]:
    """Which target output's layout each save takes (partials: the single output's)."""
    if recipe.signature.partial() is not None:
        return (0,) * len(recipe.saves)
    return tuple(range(len(recipe.saves)))


@dataclass(frozen=True)
class Task:
    """One signature's exploration, as plain data (it crosses process boundaries)."""

    target_json: str
    sig: Signature
    states: int
    seed: int
    arch: str
    block_ops: int
    deadline: float | None
    prune: bool
    """Abstract-expression pruning on (off only to measure what it saves)."""
    sizings: int = 1
    """How many sizings of each structure go on, best estimate first (`sizings_for`)."""


TIMED_SIZINGS = 2
"""Sizings kept per structure when the chosen programs are timed on a GPU."""


def sizings_for(full_checks: int) -> int:
    """One sizing per structure when the cost model chooses alone; TIMED_SIZINGS when several
    programs are verified for timing (`--gpu`). Why: the model ranks a structure's sizings less
    well than it ranks structures (the fastest measured sizing of a searched program was up to
    11% faster than the model's pick), and a timing can only pick a sizing it is given."""
    return TIMED_SIZINGS if full_checks > 1 else 1


@dataclass(frozen=True)
class Found:
    """A structure that passed the reduced check, sized for the full target."""

    recipe: Recipe
    dims: Dims
    estimate_us: float
    launches: int


@dataclass(frozen=True)
class Explored:
    sig: Signature
    found: tuple[Found, ...]
    states: int
    pruned: int
    duplicates: int
    filtered: int
    partial: bool
    error: str = ""
    """An internal error that ended this signature's exploration early (reported in notes)."""
    limited: bool = False
    """The state budget stopped it (it would have gone on): a later pass may give it more."""


@dataclass
class _Region:
    """What every signature of one region shares: the target, its reduced copy and their index
    classes, and the pruner with the term tables as they stood right after building it."""

    target: KernelGraph
    small: KernelGraph
    dcs: DimClasses
    dcf: DimClasses
    pruner: ExprPruner | None = None
    saved: state.Saved | None = None


_REGIONS: dict[str, _Region] = {}


def _region(key: str, prune: bool) -> _Region:
    """The region of `key` (its target's JSON), prepared once per process: parsing, reducing and
    classing the target, and above all normalising it for the pruner (seconds on a large
    region), are the same for every signature. The pruner is built from the pristine term
    tables, and each call restores the tables to their state right after that build, so every
    signature's exploration starts from the same state (search/state.py)."""
    r = _REGIONS.get(key)
    if r is None:
        _REGIONS.clear()  # one region at a time: keep memory flat over a whole model
        target = serialize.loads(key)
        small, _ = shrink(target)
        r = _REGIONS[key] = _Region(target, small, dim_classes(small), dim_classes(target))
    if prune and r.pruner is None:
        state.restore(state.PRISTINE)
        r.pruner = ExprPruner(r.small, r.dcs)
        r.saved = state.save(r.pruner.target._memo)
    if r.saved is not None:
        state.restore(r.saved)
    return r


def explore(task: Task) -> Explored:
    """Enumerate, filter and size the structures of one signature."""
    r = _region(task.target_json, task.prune)
    target, small, dcs, dcf = r.target, r.small, r.dcs, r.dcf
    pruner = r.pruner if task.prune else None
    stats = Stats()
    dims = provisional(dcs, task.sig)
    out: list[Found] = []
    cut = {"partial": False}
    limited = False

    def tick() -> bool:
        if task.deadline is not None and time.time() > task.deadline:
            cut["partial"] = True
            return False
        return True

    filtered = 0
    if pruner is not None and pruner.target.timed_out:
        cut["partial"] = True  # the closure was cut by the clock: this result is not reproducible
    if dims is not None:
        try:
            fp = Fingerprints(small, dcs, task.sig, dims, task.seed)
            feeds = feeds_of(small, dcs, task.sig)
            _, maps, grid = iters(small, dcs, task.sig, dims, feeds)
            bound = pruner.bind(grid, dims.loop, maps, feeds) if pruner is not None else None
            completes = task.sig.partial() is not None and len(target.outputs) == 1
            # a split signature keeps part of its share for the kernel-level completion, which
            # needs the partial sums the block search leaves when its own part runs out
            reserve = min(COMPLETION_STATES, task.states // 5) if completes else 0
            limits = Limits(block_ops=task.block_ops, max_states=task.states - reserve)
            bs = BlockSearch(
                small,
                dcs,
                task.sig,
                dims,
                SearchAlgebra(fp, bound),
                Vocabulary.of(small),
                limits,
                stats,
                tick,
            )
            recipes = list(bs.run())
            limited = bs.stopped
            if completes:
                recipes += list(KernelCompletion(bs, allowance=task.states - stats.states).run())
        except RecipeError:
            recipes = []
        seen: set[Recipe] = set()
        for k, recipe in enumerate(recipes):
            if recipe in seen:
                continue
            seen.add(recipe)
            slots = save_slots(recipe)
            try:
                cand = instantiate(small, dcs, recipe, dims, slots)
            except RecipeError:
                continue
            # the budget is not checked at reduced shapes and provisional sizes: a tile's bytes there
            # say nothing about the full-size instances, which choose_dims holds to it (gqa at
            # batch 16 keeps a 32-wide index when reduced; its structure was dropped here)
            if problems(cand, task.arch, budget=False):
                continue
            verdict = check_equivalent(
                small, cand, seed=task.seed + 7919 * (k + 1), target_bound=FILTER_BOUND
            )
            if not verdict.equivalent:
                filtered += 1
                continue
            for sized in choose_dims(target, dcf, recipe, slots, task.arch, keep=task.sizings):
                out.append(Found(recipe, sized.dims, sized.cost.us, sized.cost.launches))
    return Explored(
        task.sig,
        tuple(out),
        stats.states,
        stats.pruned,
        stats.duplicates,
        filtered,
        cut["partial"],
        limited=limited and not cut["partial"],
    )


PASSES = 3
"""Budget passes: the states a signature leaves unused go to those its share stopped."""


def _passes(
    tasks: list[Task],
    total: int,
    pool: _Pool | Executor | None,
    run,
    deadline: float | None,
    on_result,
    kill_at: float | None = None,
    weight: Callable[[Task], int] | None = None,
) -> list[Explored]:
    """Explore every signature with its first share, then give the states left over to the
    signatures their share stopped, and explore those again from scratch with the larger share
    (up to PASSES times). Why: most signatures are exhausted in a few hundred states, while the
    one that holds the fused program may need tens of thousands; an equal split starved it as
    the signature count grew with the batch size (gqa bs16: 66 signatures, 3,000 states each).

    Each pass depends only on the previous pass's results, so the outcome is the same for any
    --jobs. States of every pass are counted.

    The local pool is handed the tasks heaviest first by `weight` (ties in signature order), and
    the results are put back in signature order. Why: a region's pass ends when its last task
    does, and with the tasks in signature order the heaviest (a three-axis grid whose structure
    is sized over thousands of sizes) came last, one core working alone for seconds while the
    other waited (gemma3_tiny's final norm + lm_head: 2.1 s of its 8.5). Each exploration is a
    pure function of its task, so the order changes only when results arrive."""

    def explore_all(ts: list[Task]) -> list[Explored]:
        if isinstance(pool, Executor):  # --executor ray: tasks on the cluster, gathered in order
            out = []
            for ex in pool.map(run, ts):
                on_result(ex)
                out.append(ex)
            return out
        if pool is None:
            out = []
            for ex in map(run, ts):
                on_result(ex)
                out.append(ex)
            return out
        # the workers stop themselves at `deadline` and return what they found; only one still
        # running at `kill_at` (the region's whole budget) is killed
        order = list(range(len(ts)))
        if weight is not None:
            order.sort(key=lambda i: -weight(ts[i]))  # stable: ties stay in signature order
        ran = pool.run_all(run, [(ts[i],) for i in order], kill_at or deadline, on_result)
        got: list[Explored | None] = [None] * len(ts)
        for i, ex in zip(order, ran):
            got[i] = ex
        # a signature still running at the deadline was cut short: no structures, partial
        return [
            ex if ex is not None else Explored(t.sig, (), 0, 0, 0, 0, True)
            for t, ex in zip(ts, got)
        ]

    done = explore_all(tasks)
    used = sum(ex.states for ex in done)
    for _ in range(PASSES - 1):
        starved = [i for i, ex in enumerate(done) if ex.limited]
        left = total - used
        if not starved or left <= 0 or (deadline is not None and time.time() > deadline):
            break
        last = max(tasks[i].states for i in starved)
        share = left // len(starved)  # the passes together never exceed `total`
        if share <= last:
            break
        again = [replace(tasks[i], states=share) for i in starved]
        for i, t, ex in zip(starved, again, explore_all(again)):
            tasks[i], done[i] = t, ex
            used += ex.states
    return done


VIEW_OPS = (Op.TRANSPOSE, Op.RESHAPE)


def strip_output_views(
    target: KernelGraph,
) -> tuple[KernelGraph, tuple[tuple[tuple[Op, object], ...], ...]]:
    """The target with each output's trailing views (transposes, reshapes) taken off, and those
    views per output, innermost first.

    Why: a block saves its tile into an output in the tile's own dim order. Attention exported
    from a framework computes [batch, heads, seq, d] and hands o_proj a [batch, seq, heads * d]
    view of it; with that view as the region's output no block tile is ever laid out like the
    output, so no fused program was found (a causal GQA core of a Llama export: the 10-kernel
    lifted program only; without the view, a one-kernel program). Searching for the value the
    views read, then applying the same views at kernel level, computes exactly the target (the
    views are re-applied to every verified candidate, which was checked against the stripped
    target). A view of an input, or one whose stripped value is already another output, stays."""
    outs: list[Node] = []
    chains: list[tuple[tuple[Op, object], ...]] = []
    for out in target.outputs:
        node, chain = out, []
        while node.op in VIEW_OPS and node.src[0].op is not Op.INPUT:
            chain.append((node.op, node.arg))
            node = node.src[0]
        if chain and (node in outs or node in target.outputs):
            node, chain = out, []
        outs.append(node)
        chains.append(tuple(reversed(chain)))
    if not any(chains):
        return target, tuple(chains)
    return target.replace(outputs=tuple(outs)), tuple(chains)


def with_output_views(
    kg: KernelGraph, views: tuple[tuple[tuple[Op, object], ...], ...], original: KernelGraph
) -> KernelGraph:
    """kg's outputs with `views` applied (at kernel level), named and shaped as `original`'s."""
    outs = []
    for node, chain in zip(kg.outputs, views):
        for op, arg in chain:
            node = b.transpose(node, arg) if op is Op.TRANSPOSE else b.reshape(node, arg)
        outs.append(node)
    return b.kernel_graph(
        list(kg.inputs), outs, list(original.input_names), list(original.output_names)
    )


EXPLORE_SHARE = 0.6
"""With --budget, exploration stops itself at this share of it (each worker checks the clock
between states, then checks and sizes what it found); the full-shape checks get what is left.
Only work still running at the whole budget is killed. Why not all of it for exploration: a
found program that was never verified is worth nothing (at 0.75 with a hard stop there, every
budget-cut zoo region ended with nothing verified)."""
HEARTBEAT_S = 5.0
"""While workers run and none finishes, the driver reports progress this often."""
TEARDOWN_S = 0.3
"""The driver stops waiting this long before a region's deadline: killing the workers and
building the result take a moment, and the budget counts them."""


class _Pool:
    """The search's worker processes, held to a deadline and to Ctrl-C.

    Why not a bare ProcessPoolExecutor: its shutdown waits for the tasks running, and a
    full-shape attention check can hold a worker for minutes; after a Ctrl-C the interpreter's
    exit handler joined such a worker forever (issue 35). Here the driver waits with a timeout,
    and whatever is still running at the deadline (or on any exception, KeyboardInterrupt
    included) is cancelled and its processes killed."""

    def __init__(self, jobs: int) -> None:
        self.ex = ProcessPoolExecutor(jobs, initializer=_init_worker)
        self.cut = False
        """Work was cancelled at the deadline (the result is partial)."""
        self.heartbeat: Callable[[], None] | None = None
        """Called every HEARTBEAT_S while no task finishes."""

    def _pids(self) -> list[int]:
        return list((getattr(self.ex, "_processes", None) or {}).keys())

    def run_all(
        self,
        fn: Callable,
        args: Sequence[tuple],
        deadline: float | None,
        on_result: Callable | None = None,
    ) -> list:
        """fn(*a) for each a, in the pool; results in order, None for those not done by the
        deadline (wall clock, time.time()). on_result sees each result as it arrives."""
        futures = [self.ex.submit(fn, *a) for a in args]
        interrupt.add_workers(self._pids())
        pending = set(futures)
        while pending:
            left = None if deadline is None else deadline - TEARDOWN_S - time.time()
            if left is not None and left <= 0:
                break  # the deadline
            timeout = HEARTBEAT_S if left is None else min(HEARTBEAT_S, left)
            done, pending = wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
            for fu in futures:
                if fu in done and on_result is not None:
                    on_result(fu.result())
            if not done and self.heartbeat is not None:
                self.heartbeat()  # a long check: the progress display still hears from us
        finished = [fu.done() and not fu.cancelled() for fu in futures]
        results = [fu.result() if ok else None for fu, ok in zip(futures, finished)]
        if not all(finished):
            # the deadline: what still runs is abandoned (its futures then read "broken")
            self.cut = True
            self.kill()
        return results

    def kill(self) -> None:
        """Cancel what is queued and kill the workers now (their work is abandoned)."""
        pids = self._pids()
        procs = list((getattr(self.ex, "_processes", None) or {}).values())
        interrupt.remove_workers(pids)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        self.ex.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            with contextlib.suppress(Exception):
                p.join(1.0)
        # a fresh executor for any later stage of this region (the old one is broken)
        self.ex = ProcessPoolExecutor(self.ex._max_workers, initializer=_init_worker)

    def close(self, failed: bool) -> None:
        if failed:
            self.kill()
        interrupt.remove_workers(self._pids())
        self.ex.shutdown(wait=not failed, cancel_futures=True)


def _init_worker() -> None:
    """Each worker: SIGINT left to the driver, dies with the driver, one BLAS thread."""
    interrupt.worker_init()
    _one_blas_thread()


def _one_blas_thread() -> None:
    """Hold each worker process's BLAS to one thread. Why: the workers already fill the cores, and
    OpenBLAS's own threads on top of them oversubscribe: two full-shape checks side by side took
    70-84 s each on 2 cores with BLAS threads and 42-46 s with one thread each (qknorm_real at
    batch 16, whose verification took 237 of its 503 s)."""
    threadpool_limits(limits=1, user_api="blas")


class _Guarded:
    """explore() that turns an internal error into an empty result with a note: a bug in one
    signature's exploration must cost that signature, not the user's whole run."""

    def __call__(self, task: Task) -> Explored:
        try:
            return explore(task)
        except Exception as exc:  # noqa: BLE001 - reported in the result's notes
            return Explored(task.sig, (), 0, 0, 0, 0, False, f"{type(exc).__name__}: {exc}")


def _full_check(
    target: KernelGraph | str, program: KernelGraph | str, seed: int, bound: float
) -> tuple[bool, float, str | None]:
    """One part of a candidate's verification at full shapes (graphs as objects, or as JSON text
    when it runs in a worker process): (equivalent, bound reached, what the bound assumes)."""
    if isinstance(target, str):
        target = serialize.loads(target)
    if isinstance(program, str):
        program = serialize.loads(program)
    verdict = check_equivalent(target, program, seed=seed, target_bound=bound)
    return verdict.equivalent, verdict.bound, verdict.heuristic


ALT_SLACK = 2.0
"""The fewest-launch alternative is verified only when its estimate is at most this times the
best one's: a launch costs microseconds, so one that is twice as slow cannot be rescued by
saving one (mla's and gated_mlp's 1-launch programs were 6-14x their best)."""


def _to_verify(
    found: list, full_checks: int, lifted_us: float, graph_of: Callable[[Found], KernelGraph]
) -> list[tuple[Found, KernelGraph]]:
    """The structures to verify at full shapes, best estimate first, with their programs: the
    top `full_checks` distinct programs, and then the best one with fewer launches than all of
    those, if one beats the lifted program and is within ALT_SLACK of the best estimate.

    Why distinct: two signatures can size to the same program (mla's and gated_mlp's top two
    were one program), and verifying or timing it twice is waste. Why the alternative: the
    cost model prices a launch at a few microseconds, but whether another launch pays depends
    on how the model is served (ORT without CUDA graphs, another GPU). The fewest-launch
    alternative, verified, is what `--gpu` times against the best estimate, and what a user
    who wants fewer launches can take."""
    picks: list[tuple[Found, KernelGraph]] = []
    seen: set[str] = set()

    def take(f: Found) -> bool:
        kg = graph_of(f)
        key = serialize.dumps(kg)
        if key in seen:
            return False
        seen.add(key)
        picks.append((f, kg))
        return True

    for f in found:
        if len(picks) >= max(1, full_checks) or f.estimate_us >= lifted_us:
            break
        take(f)
    if not picks:
        return []
    fewest = min(f.launches for f, _ in picks)
    limit = min(lifted_us, ALT_SLACK * picks[0][0].estimate_us)
    for f in found:
        if f.launches < fewest and f.estimate_us < limit and take(f):
            break
    return picks


def explorable(target: KernelGraph) -> tuple[KernelGraph, DimClasses, list[Signature]]:
    """The target reduced, its full-shape index classes, and the signatures a search explores
    (those with provisional sizes, then their whole-feed variants)."""
    small, _ = shrink(target)
    dcs = dim_classes(small)
    sigs = [s for s in signatures(dcs) if provisional(dcs, s) is not None]
    return small, dim_classes(target), with_whole_variants(small, dcs, sigs)


def state_budget(max_states: int | None, n_signatures: int) -> tuple[int, int]:
    """(states for the region, each signature's first share) for `--max-states` or its default
    (STATES_PER_SIGNATURE each, at most DEFAULT_STATES_CAP in all)."""
    n = max(1, n_signatures)
    if max_states is None:
        max_states = min(DEFAULT_STATES_CAP, STATES_PER_SIGNATURE * n)
    return max_states, max(1, max_states // n)


def _task_fields(pool) -> dict:
    """The executor's task counts as SearchProgress's optional fields (the local pool, which
    stops and kills its workers at a budget, keeps no counts: none are reported then)."""
    if not isinstance(pool, Executor):
        return {}
    c = pool.counts()
    return {"queued": c.queued, "running": c.running, "finished": c.finished, "nodes": c.nodes}


def search(
    target: KernelGraph,
    options: SearchOptions,
    progress: ProgressFn | None = None,
    *,
    prune: bool = True,
    region: str = "",
) -> SearchResult:
    t0 = time.monotonic()
    start = time.time()
    final = None if options.budget_s is None else start + options.budget_s
    deadline = None if final is None else start + EXPLORE_SHARE * options.budget_s
    original = target
    target, views = strip_output_views(target)
    _, dcf, sigs = explorable(target)
    total, share = state_budget(options.max_states, len(sigs))
    seed = options.seed if options.seed is not None else 0
    text = serialize.dumps(target)
    tasks = [
        Task(
            text,
            sig,
            share,
            seed * 1_000_003 + i,
            options.arch,
            options.block_ops,
            deadline,
            prune,
            sizings_for(options.full_checks),
        )
        for i, sig in enumerate(sigs)
    ]
    totals = {"states": 0, "pruned": 0}
    best: list[float] = []

    def record(ex: Explored | None) -> None:
        if ex is not None:
            totals["states"] += ex.states
            totals["pruned"] += ex.pruned
            best.extend(f.estimate_us for f in ex.found)
        if progress is not None:
            progress(
                SearchProgress(
                    region,
                    totals["states"],
                    totals["pruned"],
                    0,
                    min(best) if best else None,
                    time.monotonic() - t0,
                    **_task_fields(pool),
                )
            )

    jobs = max(1, min(options.jobs, len(tasks), os.cpu_count() or 1))
    explore_safely = _Guarded()
    # with a budget even one job runs in a worker: only a process can be stopped mid-check
    pool: _Pool | Executor | None
    if options.executor != "local" or (jobs == 1 and final is None):
        # Ray tasks, or one job inline (the executor counts its units for the progress line)
        pool = make_executor(options.executor, jobs, _one_blas_thread, options.jobs)
    else:
        # the local pool stops its workers at a budget's deadline and kills stragglers
        pool = _Pool(jobs)
        pool.heartbeat = lambda: record(None)
    lifted = program_cost(original)
    candidates: list[Candidate] = [Candidate(original, lifted.us, lifted.launches, 0.0)]
    bound, verified = 0.0, 0
    assumes: set[str] = set()
    failed = True
    try:
        # a signature's weight: the sizes a structure of it is sized over (select.choose_dims,
        # most of the time of a signature that yields one), the one figure known beforehand
        weights = {s: sum(1 for _ in signature_sizes(dcf, s)) for s in sigs}
        done = _passes(
            tasks, total, pool, explore_safely, deadline, record, final, lambda t: weights[t.sig]
        )
        found = sorted(
            (f for ex in done for f in ex.found),
            key=lambda f: (f.estimate_us, f.launches, repr(f.recipe)),
        )
        checks = []

        def graph_of(f: Found) -> KernelGraph:
            return instantiate(target, dcf, f.recipe, f.dims, save_slots(f.recipe))

        for f, kg in _to_verify(found, options.full_checks, lifted.us, graph_of):
            k = len(checks) + 1
            part = (FULL_BOUND / (k * (k + 1))) ** (1.0 / CHECK_PARTS)
            seeds = [seed * 7 + k + 1_000_003 * p for p in range(CHECK_PARTS)]
            checks.append((f, kg, seeds, part))
        # every part of every check is independent: on the pool they run side by side
        jobs_ = [(kg, s, part) for _, kg, seeds, part in checks for s in seeds]
        if isinstance(pool, Executor):
            futures = [
                pool.submit(_full_check, target, kg, s, part)
                if pool.in_process
                else pool.submit(_full_check, text, serialize.dumps(kg), s, part)
                for kg, s, part in jobs_
            ]
            parts = pool.gather(futures)
        elif pool is not None:
            args = [(text, serialize.dumps(kg), s, part) for kg, s, part in jobs_]
            parts = pool.run_all(_full_check, args, final)
        else:
            parts = [_full_check(target, kg, s, part) for kg, s, part in jobs_]
        failed = False
    finally:
        if isinstance(pool, Executor):
            pool.shutdown(cancel=True)
        elif pool is not None:
            pool.close(failed)
    for i, (f, kg, _, _) in enumerate(checks):
        mine = parts[i * CHECK_PARTS : (i + 1) * CHECK_PARTS]
        if any(p is None for p in mine):
            continue  # the deadline stopped this check: not verified, so not a candidate
        if not all(equivalent for equivalent, _, _ in mine):
            continue
        vbound = math.prod(part for _, part, _ in mine)
        verified += 1
        bound += vbound
        assumes.update(h for _, _, h in mine if h)
        if any(views):
            kg = with_output_views(kg, views, original)
            cost = program_cost(kg)
            candidates.append(Candidate(kg, cost.us, cost.launches, vbound))
        else:
            candidates.append(Candidate(kg, f.estimate_us, f.launches, vbound))
    candidates.sort(key=lambda c: (c.estimate_us, c.kernels))
    partial = any(ex.partial for ex in done) or bool(getattr(pool, "cut", False))
    notes = (
        (
            f"{len(sigs)} signatures, "
            f"{len({f.recipe for ex in done for f in ex.found})} structures sized, "
            f"{sum(ex.filtered for ex in done)} rejected at reduced shapes, "
            f"{sum(ex.duplicates for ex in done)} duplicate values",
        )
        + tuple(
            f"signature {ex.sig}: internal error, skipped ({ex.error[:200]})"
            for ex in done
            if ex.error
        )
        + tuple(f"the verification bound assumes {a}" for a in sorted(assumes))
    )
    if progress is not None:
        progress(
            SearchProgress(
                region,
                totals["states"],
                totals["pruned"],
                verified,
                candidates[0].estimate_us,
                time.monotonic() - t0,
                **_task_fields(pool),
            )
        )
    return SearchResult(
        tuple(candidates),
        totals["states"],
        totals["pruned"],
        verified,
        time.monotonic() - t0,
        bound,
        partial,
        notes,
    )
