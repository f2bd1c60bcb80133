"""A search worker killed under the run (the OOM killer, a SIGKILL) costs that region its search,
not the run: optimize goes on with the lifted program, says why, and caches nothing."""

from __future__ import annotations

from concurrent.futures.process import BrokenProcessPool

from mlso_cli.pipeline import PipelineOptions, optimize
from mlso_cli.pipeline.searching import WORKER_LOST
from mlso_cli.search.api import SearchOptions
from tests.test_pipeline import SRC


def killed(target, options, progress=None):
    raise BrokenProcessPool("A process in the process pool was terminated abruptly")


killed.__qualname__ = "killed"


def test_a_killed_worker_keeps_the_lifted_program_and_caches_nothing(tmp_path):
    opts = PipelineOptions(
        search=SearchOptions(max_states=10, seed=0),
        min_speedup=0.0,
        cache_dir=tmp_path / "search-cache",
    )
    out = optimize(str(SRC), None, opts, search=killed, dry_run=True)
    (rep,) = out.regions
    result = rep.searched.result
    assert result.partial and not rep.searched.cached
    assert any(WORKER_LOST in n for n in result.notes)
    assert rep.choice.candidate.graph == result.candidates[0].graph  # the lifted program
    assert not list((tmp_path / "search-cache").rglob("*.json"))
