"""The default state budget deepens: a first share per signature, then GROWTH times more for the
signatures their share stopped, until a pass finds a structure that beats the lifted program.

Why tested: this schedule decides how long `optimize` takes without --max-states (llama_tiny went
from 10.9 to about 3 minutes on 2 cores) and whether a deep signature still gets its depth.
The signatures here are fakes with a known depth; the schedule is search/run.py's."""

from __future__ import annotations

from mlso_cli.search import run as R


class FakeSig:
    """A signature that yields one structure (estimate `us`) once it has `depth` states, and is
    exhausted (not limited) at `end` states."""

    def __init__(self, depth: int | None, us: float = 1.0, end: int = 10**9) -> None:
        self.depth, self.us, self.end = depth, us, end


def _task(sig: FakeSig, states: int) -> R.Task:
    return R.Task("{}", sig, states, 0, "sm_80", 11, None, True)  # type: ignore[arg-type]


def _explore(calls: list[tuple[int, int]], sigs: list[FakeSig]):
    def run(task: R.Task) -> R.Explored:
        sig = task.sig
        calls.append((sigs.index(sig), task.states))  # type: ignore[arg-type]
        used = min(task.states, sig.end)  # type: ignore[attr-defined]
        found = ()
        if sig.depth is not None and used >= sig.depth:  # type: ignore[attr-defined]
            found = (R.Found(None, None, sig.us, 1),)  # type: ignore[attr-defined,arg-type]
        return R.Explored(sig, found, used, 0, 0, 0, False, limited=task.states < sig.end)  # type: ignore[arg-type,attr-defined]

    return run


def _run(sigs: list[FakeSig], max_states: int | None, lifted_us: float = 10.0):
    total, share = R.state_budget(max_states, len(sigs))
    tasks = [_task(s, share) for s in sigs]
    calls: list[tuple[int, int]] = []

    def enough(done: list[R.Explored]) -> bool:
        return any(f.estimate_us < lifted_us for ex in done for f in ex.found)

    done = R._passes(
        tasks,
        total,
        None,
        _explore(calls, sigs),
        None,
        lambda ex: None,
        None,
        enough if max_states is None else None,
    )
    return total, share, calls, done


def test_the_default_first_share_is_capped_and_an_explicit_budget_is_split_evenly():
    total, share = R.state_budget(None, 48)
    assert total == min(R.DEFAULT_STATES_CAP, R.STATES_PER_SIGNATURE * 48)
    assert share == R.FIRST_SHARE
    assert R.state_budget(20_000, 48) == (20_000, 20_000 // 48)
    # a tiny default total still gives each signature at least one state, at most its part
    assert R.state_budget(None, 10**6)[1] == 1


def test_a_structure_found_in_the_first_pass_ends_the_search():
    sigs = [FakeSig(None), FakeSig(R.FIRST_SHARE // 2, us=3.0), FakeSig(None)]
    _, share, calls, done = _run(sigs, None)
    assert calls == [(0, share), (1, share), (2, share)]  # one pass, nobody deepened
    assert [f.estimate_us for ex in done for f in ex.found] == [3.0]


def test_a_structure_worse_than_the_lifted_program_does_not_end_the_search():
    # the shallow structure loses to the lifted program; the deep one is found by deepening
    sigs = [FakeSig(10, us=50.0, end=20), FakeSig(3 * R.FIRST_SHARE, us=2.0)]
    _, share, calls, done = _run(sigs, None)
    assert calls[:2] == [(0, share), (1, share)]
    # signature 0 was exhausted (not limited): only signature 1 runs again, GROWTH times deeper
    assert calls[2:] == [(1, R.GROWTH * share)]
    assert sorted(f.estimate_us for ex in done for f in ex.found) == [2.0, 50.0]


def test_deepening_grows_by_GROWTH_per_pass_within_the_total():
    sigs = [FakeSig(None) for _ in range(4)]
    total, share, calls, _ = _run(sigs, None)
    per_pass = [calls[i : i + 4] for i in range(0, len(calls), 4)]
    assert [{s for _, s in p} for p in per_pass[:2]] == [{share}, {R.GROWTH * share}]
    assert len(per_pass) <= R.PASSES
    assert sum(s for _, s in calls) <= total
    # the total (STATES_PER_SIGNATURE each) is what bounds a region that never finds anything
    assert total - sum(s for _, s in calls) < 4 * R.GROWTH * share


def test_an_explicit_budget_gives_the_leftover_to_the_stopped_signatures_at_once():
    # --max-states: no early stop, and the second pass gets all that is left (not GROWTH times)
    sigs = [FakeSig(5, us=3.0, end=100), FakeSig(None, end=100), FakeSig(None)]
    total, share, calls, _ = _run(sigs, 90_000)
    assert share == 30_000
    assert calls == [(0, share), (1, share), (2, share), (2, 90_000 - 200 - share)]
