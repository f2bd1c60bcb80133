"""The CLI in shell pipelines and batch jobs (issue 35): closed stdout, global flags anywhere,
one-line usage errors, a summary line for logs, --json streamed region by region, plain progress
lines, partial results never reported as cached, and --budget kept with the checks included."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from mlso_cli.pipeline import Listener, PipelineOptions, optimize
from mlso_cli.search.api import Candidate, SearchOptions, SearchProgress, SearchResult
from mlso_cli.search.cost import program_cost
from tests.helpers import ROOT, SMALL, TRANSFORMER, TRANSFORMER_SHAPE, run_cli

GQA = next(p for p in SMALL if p.stem == "gqa")
COMMANDS = ("inspect", "optimize", "verify", "bench")


def _env(tmp_path=None) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    if tmp_path is not None:
        env["MLSO_CACHE_DIR"] = str(tmp_path / "cache")
    return env


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlso: error:"), r.stderr.decode()
    return lines[0]


# ---- 4. pipeline conventions ---------------------------------------------------------------


def test_a_closed_stdout_ends_the_command_quietly_with_exit_0():
    """`mlso inspect M --json | head -3`: the reader is gone before mlso writes. It used to exit 1
    with no message, which fails a `set -o pipefail` job."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlso_cli",
            "inspect",
            str(TRANSFORMER),
            *TRANSFORMER_SHAPE,
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=_env(),
    )
    proc.stdout.close()  # the reader went away
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"error" not in err.lower(), err.decode()


def test_head_in_a_pipefail_shell_pipeline_succeeds():
    cmd = (
        f"set -o pipefail; {sys.executable} -m mlso_cli inspect {TRANSFORMER} "
        f"{' '.join(TRANSFORMER_SHAPE)} --json | head -3"
    )
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, cwd=ROOT, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    assert len(r.stdout.decode().splitlines()) == 3
    assert b"Traceback" not in r.stderr


def test_global_flags_work_after_the_subcommand():
    r = run_cli("inspect", str(GQA), "-v")
    assert r.returncode == 0, r.stderr.decode()
    assert b"fusable region" in r.stderr and r.stdout == b""
    r = run_cli("inspect", str(GQA), "--quiet")
    assert r.returncode == 0 and r.stderr == b""


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_subcommand_help_lists_the_global_flags(cmd):
    r = run_cli(cmd, "--help")
    assert r.returncode == 0
    out = r.stdout.decode()
    assert "-v, --verbose" in out and "-q, --quiet" in out


@pytest.mark.parametrize(
    "args",
    [
        ["-q", "-v", "inspect", str(GQA)],
        ["-q", "inspect", str(GQA), "-v"],
        ["inspect", str(GQA), "--verbose", "--quiet"],
    ],
)
def test_quiet_with_verbose_is_a_usage_error(args):
    r = run_cli(*args)
    assert r.returncode == 2 and r.stdout == b""
    assert "-q and -v" in _one_error_line(r)


@pytest.mark.parametrize(
    "args",
    [
        ["inspect", str(GQA), "--no-such-flag"],
        ["inspect"],
        ["no-such-command"],
        ["optimize", str(GQA), "--dry-run", "--budget", "soon"],
        ["bench", str(GQA), str(GQA), "--mode", "fast"],
        ["--no-such-global"],
    ],
)
def test_every_usage_error_is_one_line_and_exit_2(args):
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr.decode()
    assert "--help" in _one_error_line(r)


def test_a_log_gets_one_summary_line_per_command_without_v(tmp_path):
    r = run_cli("inspect", str(GQA))
    assert r.returncode == 0
    assert r.stderr.decode().splitlines() == [
        f"mlso: inspect {GQA}: 1 fusable region(s), 0 node(s) left out"
    ]
    r = run_cli("verify", str(GQA), str(GQA))
    assert r.returncode == 0, r.stderr.decode()
    (line,) = r.stderr.decode().splitlines()
    assert line.startswith("mlso: verify: B matches A:")
    assert run_cli("-q", "inspect", str(GQA)).stderr == b""


# ---- 3. streaming ----------------------------------------------------------------------------


def test_json_and_progress_stream_while_later_regions_are_searched(tmp_path):
    """The first region's JSON object reaches stdout while the run is still searching (the
    eight regions after it take seconds more), and progress lines reach a non-terminal
    stderr as they happen. Both used to come only at the end."""
    args = ["optimize", str(TRANSFORMER), *TRANSFORMER_SHAPE, "--dry-run", "--json"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlso_cli", *args, "--max-states", "2000", "--no-cache"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=_env(tmp_path),
        start_new_session=True,
    )
    first: list[bytes] = []
    reader = threading.Thread(target=lambda: first.append(proc.stdout.readline()), daemon=True)
    reader.start()
    try:
        reader.join(180)
        assert first and first[0], "no JSON line came"
        running = proc.poll() is None
        row = json.loads(first[0])
        assert row["type"] == "region" and row["region"] == 0
        assert running, "the first line came only when the run ended"
        # the second region's line: by then its "searching" line was printed (interrupting
        # right after the first line raced with it on a loaded machine)
        again = threading.Thread(target=lambda: first.append(proc.stdout.readline()), daemon=True)
        again.start()
        again.join(180)
        assert len(first) == 2 and json.loads(first[1])["region"] == 1
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    lines = err.decode().splitlines()
    assert any(re.fullmatch(r"mlso: region 0 \(norm-linear\) 1/\d+: searching", x) for x in lines)
    assert any(
        re.match(r"mlso: region 0 \(norm-linear\) 1/\d+: searched: states", x) for x in lines
    )
    assert any(re.fullmatch(r"mlso: region 1 \(\S+\) 2/\d+: searching", x) for x in lines)


def test_plain_progress_lines_come_at_most_every_10_s_per_region(monkeypatch, capsys):
    from mlso_cli.commands import optimize as cmd
    from mlso_cli.console import set_verbosity

    clock = [100.0]
    monkeypatch.setattr(cmd.time, "monotonic", lambda: clock[0])
    set_verbosity(True)
    try:
        d = cmd._Display()
        d.region_started(3, "attention", 0, 1)
        for step in range(60):  # a minute of progress reports, one a second
            clock[0] += 1.0
            d.search_progress(3, SearchProgress("3", 100 * step, step, 0, 12.5, float(step)))
    finally:
        set_verbosity(None)
    lines = capsys.readouterr().err.splitlines()
    progress = [x for x in lines if "states" in x]
    assert 5 <= len(progress) <= 6, lines
    assert "pruned" in progress[0] and "verified 0" in progress[0] and "best 12.5 us" in progress[0]
    assert "elapsed" in progress[0]


class _Lifted:
    """A search that returns the lifted target (any model), final or partial; counts calls."""

    __qualname__ = "_Lifted"

    def __init__(self, partial: bool = False) -> None:
        self.partial, self.calls = partial, 0

    def __call__(self, target, options, progress=None) -> SearchResult:
        self.calls += 1
        c = program_cost(target)
        return SearchResult(
            (Candidate(target, c.us, c.launches, 0.0),), 1, 0, 0, 0.0, 0.0, self.partial
        )


class _Events(Listener):
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def region_started(self, region, label, index, total):
        self.events.append(("started", region))

    def region_decided(self, report):
        self.events.append(("decided", report.choice.region))


def test_each_region_is_decided_before_the_next_is_searched(tmp_path):
    ev = _Events()
    opts = PipelineOptions(search=SearchOptions(max_states=10, seed=0), use_cache=False)
    out = optimize(
        str(TRANSFORMER),
        {"hidden": (1, 16, 64)},
        opts,
        search=_Lifted(),
        listener=ev,
        dry_run=True,
    )
    ids = [r.choice.region for r in out.regions]
    assert ev.events == [e for r in ids for e in (("started", r), ("decided", r))]


def test_a_partial_result_is_never_reported_as_cached(tmp_path):
    """transformer_tiny repeats its layers; a budget-cut result of the first was reused for the
    later ones and reported `partial` and `cached` together. It is still reused (searching again
    would double the run), but reported as what it is."""
    fake = _Lifted(partial=True)
    opts = PipelineOptions(search=SearchOptions(max_states=10, seed=0), use_cache=False)
    out = optimize(str(TRANSFORMER), {"hidden": (1, 16, 64)}, opts, search=fake, dry_run=True)
    hashes = [r.searched.region_hash for r in out.regions]
    assert fake.calls == len(set(hashes)) < len(hashes)
    assert not any(r.searched.cached for r in out.regions)
    assert all(r.searched.result.partial for r in out.regions)
    reused = [r for r in out.regions if any("reused" in n for n in r.searched.result.notes)]
    assert len(reused) == len(hashes) - len(set(hashes))


# ---- 2. budgets ------------------------------------------------------------------------------


@pytest.mark.parametrize("jobs", [2, 1])
def test_the_budget_bounds_a_region_checks_included(jobs):
    """The largest region of transformer_tiny takes tens of seconds at these settings; with
    --budget 4 its search, full-shape checks included, ends within 10% (plus a small constant
    for the lift-side work the budget cannot see). At --jobs 1 it runs in a worker too, so the
    deadline can stop a check in the middle."""
    from mlso_cli.pipeline.frontend import lift
    from mlso_cli.search.run import search

    lifted = lift(str(TRANSFORMER), {"hidden": (1, 16, 64)})
    # the largest region (the first layer's norm + QKV + RoPE): tens of seconds unbudgeted
    target = max((lr.graph for lr in lifted.regions), key=lambda g: len(list(g.nodes())))
    budget = 4.0
    t = time.monotonic()
    result = search(target, SearchOptions(budget_s=budget, max_states=200_000, jobs=jobs, seed=0))
    took = time.monotonic() - t
    assert took <= 1.1 * budget + 0.5, took
    assert result.partial and result.seconds <= 1.1 * budget + 0.5
    assert result.candidates  # the lifted target at least: a cut search still has an answer
