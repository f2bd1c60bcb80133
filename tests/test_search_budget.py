"""The default state budget: STATES_PER_SIGNATURE states per signature in one pass, and what the
exhausted signatures leave goes to the ones their share stopped.

Why tested: this schedule decides how long `optimize` takes without --max-states (llama_tiny:
10.9 minutes with an even split of 64,000 per signature, about 3 with deepening, about 1 with one
pass, on 2 cores) and whether a signature with a shallow structure still finds it. The
signatures here are fakes with a known depth; the schedule is search/run.py's."""

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


def _run(sigs: list[FakeSig], max_states: int | None):
    total, share = R.state_budget(max_states, len(sigs))
    tasks = [_task(s, share) for s in sigs]
    calls: list[tuple[int, int]] = []
    done = R._passes(tasks, total, None, _explore(calls, sigs), None, lambda ex: None, None)
    return total, share, calls, done


def test_the_default_gives_each_signature_its_share_within_the_cap():
    total, share = R.state_budget(None, 48)
    assert (total, share) == (R.STATES_PER_SIGNATURE * 48, R.STATES_PER_SIGNATURE)
    big = R.DEFAULT_STATES_CAP // R.STATES_PER_SIGNATURE + 10
    assert R.state_budget(None, big) == (R.DEFAULT_STATES_CAP, R.DEFAULT_STATES_CAP // big)
    assert R.state_budget(20_000, 48) == (20_000, 20_000 // 48)
    # a tiny default total still gives each signature at least one state
    assert R.state_budget(None, 10**7)[1] == 1


def test_a_structure_within_the_share_is_found_in_one_pass():
    sigs = [FakeSig(None), FakeSig(R.STATES_PER_SIGNATURE // 2, us=3.0), FakeSig(None)]
    _, share, calls, done = _run(sigs, None)
    assert calls == [(0, share), (1, share), (2, share)]  # nothing left over: one pass
    assert [f.estimate_us for ex in done for f in ex.found] == [3.0]


def test_stopped_signatures_are_not_deepened_when_nothing_is_left_over():
    # every signature runs to its share and finds nothing: the region ends after one pass
    sigs = [FakeSig(None) for _ in range(4)]
    total, share, calls, done = _run(sigs, None)
    assert calls == [(i, share) for i in range(4)]
    assert sum(s for _, s in calls) == total
    assert not any(ex.found for ex in done)


def test_the_exhausted_signatures_leftover_deepens_the_stopped_ones():
    # three signatures exhaust at 100 states; their leftover goes to the one its share stopped,
    # which then finds its deep structure
    deep = 2 * R.STATES_PER_SIGNATURE
    sigs = [FakeSig(None, end=100) for _ in range(3)] + [FakeSig(deep, us=2.0)]
    total, share, calls, done = _run(sigs, None)
    assert calls[:4] == [(i, share) for i in range(4)]
    assert calls[4:] == [(3, total - 300 - share)]
    assert total - 300 - share >= deep
    assert [f.estimate_us for ex in done for f in ex.found] == [2.0]


def test_an_explicit_budget_gives_the_leftover_to_the_stopped_signatures_at_once():
    # --max-states: no early stop, and the second pass gets all that is left (not GROWTH times)
    sigs = [FakeSig(5, us=3.0, end=100), FakeSig(None, end=100), FakeSig(None)]
    total, share, calls, _ = _run(sigs, 90_000)
    assert share == 30_000
    assert calls == [(0, share), (1, share), (2, share), (2, 90_000 - 200 - share)]
