"""Ctrl-C in every phase of a run (issue 35): exit 130 within 2 s, one line, nothing left behind.

Each trial starts `mlso -v optimize` in its own session, as a shell job is, and sends SIGINT to
the whole process group, as a terminal's Ctrl-C does (the search workers receive it too). The
phases: the CLI's imports, loading and lifting, the middle of a long attention search (its
workers busy in one signature for tens of seconds), the end of a short search (its full-shape
checks), and anywhere in a whole small run (writing included). Asserted every time: exit 130
within 2 s of the signal, exactly one `mlso: error:` line and no traceback, no process of the
group left, no output model nor temp file, only complete JSON lines on stdout, and no partial
(nor half-written) entry in the search cache. 12 trials run in the default set, 38 more (50 in
all) in the slow set.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, SMALL, TRANSFORMER, TRANSFORMER_SHAPE

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="process groups and /proc: Linux"
)

LIMIT_S = 2.0
GQA = next(p for p in SMALL if p.stem == "gqa")
PHASES = ("imports", "lift", "search", "search-end", "anywhere")


class _Run:
    """mlso in its own process group, its stderr lines collected as they come."""

    def __init__(self, args: list[str], tmp: Path) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
            "MLSO_CACHE_DIR": str(tmp / "cache"),
        }
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlso_cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.out = b""
        self._err = threading.Thread(target=self._read_err, daemon=True)
        self._out = threading.Thread(target=self._read_out, daemon=True)
        self._err.start()
        self._out.start()

    def _read_err(self) -> None:
        for raw in self.proc.stderr:
            self.lines.append(raw.decode(errors="replace"))

    def _read_out(self) -> None:
        self.out = self.proc.stdout.read()

    def wait_for(self, text: str, timeout: float = 120.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(re.search(text, x) for x in self.lines):
                return True
            if self._exited():
                return False
            time.sleep(0.02)
        raise AssertionError(f"never saw {text!r}: {''.join(self.lines)[-2000:]}")

    def wait_handler(self, timeout: float = 30.0) -> None:
        """Until mlso's SIGINT handling runs: its watcher thread is the process's second thread.
        Before that the interpreter is still starting (importing `site`), where no program can
        handle a SIGINT; mlso installs it before any of its own imports."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with contextlib.suppress(OSError):
                if len(os.listdir(f"/proc/{self.proc.pid}/task")) >= 2:
                    return
            time.sleep(0.005)
        raise AssertionError("mlso never installed its SIGINT handling")

    def interrupt(self) -> float | None:
        """SIGINT to the group; seconds until the driver exited (None: it had already exited).

        The seconds are wall clock less the time the driver sat runnable in the scheduler's
        queue (/proc/PID/schedstat): on a machine whose cores other jobs fill, that wait is the
        machine's, not mlso's. The old failures (a join on a busy worker for 5-24 s, a hang)
        were sleeps, which still count."""
        pid = self.proc.pid
        if self._exited():
            self.proc.wait()
            return None
        delay0, t = _run_delay(pid), time.monotonic()
        os.killpg(pid, signal.SIGINT)
        while not self._exited():
            if time.monotonic() - t > 30:
                os.killpg(pid, signal.SIGKILL)
                self.proc.wait()
                raise AssertionError("mlso did not exit within 30 s of SIGINT")
            time.sleep(0.005)
        wall = time.monotonic() - t
        queued = max(0.0, _run_delay(pid) - delay0)  # read from the zombie, before reaping
        self.proc.wait()
        return wall - queued

    def _exited(self) -> bool:
        """Whether the driver exited, without reaping it (its /proc entry stays readable)."""
        return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def group_gone(self, timeout: float = 3.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.05)
        os.killpg(self.proc.pid, signal.SIGKILL)  # do not leave them to the next test
        return False


def _run_delay(pid: int) -> float:
    """Seconds the process's main thread has waited on a run queue."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    return 0.0


def _cache_entries(cache: Path) -> list[Path]:
    return [p for p in (cache / "search").rglob("*") if p.is_file()] if cache.exists() else []


def _trial(phase: str, k: int, tmp: Path) -> None:
    out = tmp / "out" / "fast.onnx"
    out.parent.mkdir()
    if phase == "anywhere":
        args = ["-v", "optimize", str(GQA), "-o", str(out), "--max-states", "300", "--json"]
    else:
        args = ["-v", "optimize", str(TRANSFORMER), *TRANSFORMER_SHAPE, "-o", str(out)]
        args += ["--max-states", "2000", "--json"]
    run = _Run(args, tmp)
    if phase == "imports":
        run.wait_handler()
        time.sleep(0.1 * (k % 5))  # importing the CLI itself takes a second or more
    elif phase == "lift":
        time.sleep(1.0 + 0.4 * (k % 4))
    elif phase == "search":
        run.wait_for(
            r"\(attention\) 2/\d+: searching"
        )  # the attention region: a long search on both workers
        time.sleep(0.3 + 0.6 * (k % 4))
    elif phase == "search-end":
        run.wait_for(r" 1/\d+: searching")  # a short search: its full-shape checks come soon
        time.sleep(0.2 + 0.3 * (k % 4))
    else:
        time.sleep(0.5 + 0.8 * (k % 6))  # anywhere in a small run, the write included
    took = run.interrupt()
    run._err.join(5)
    run._out.join(5)
    err = "".join(run.lines)
    assert run.group_gone(), f"{phase}: a process of the run outlived it"
    rows = [json.loads(x) for x in run.out.decode().splitlines()]  # only complete lines
    tmps = [p.name for p in out.parent.iterdir() if p.name != out.name]
    assert not tmps, f"{phase}: temp files left: {tmps}"
    for entry in _cache_entries(tmp / "cache"):
        assert entry.suffix == ".json", f"{phase}: a half-written cache entry {entry.name}"
        body = json.loads(entry.read_bytes().partition(b"\n")[2])
        assert body["result"]["partial"] is False, f"{phase}: a partial result was cached"
    if took is None or run.proc.returncode == 0:
        # the small run finished before the signal (or was exiting when it came): a whole result
        assert phase == "anywhere" and run.proc.returncode == 0, err
        assert out.exists() and rows[-1]["type"] == "summary"
        return
    if out.exists():  # the signal came after the output was placed: said so, never hidden
        assert phase == "anywhere" and run.proc.returncode == 130 and took < LIMIT_S, err
        assert f"mlso: error: interrupted after {out} was written in full" in err
        return
    assert run.proc.returncode == 130, (phase, run.proc.returncode, err[-3000:])
    assert took < LIMIT_S, f"{phase}: exited {took:.2f} s after SIGINT"
    assert "Traceback" not in err, err[-3000:]
    errors = [x for x in err.splitlines() if x.startswith("mlso: error:")]
    assert errors == ["mlso: error: interrupted; nothing was written"], err[-3000:]
    assert not out.exists(), f"{phase}: an output was written"
    assert all(r["type"] == "region" for r in rows), "an interrupted run printed its summary"


@pytest.mark.parametrize("k", range(12))
def test_sigint_in_every_phase_exits_130_within_2s_leaving_nothing(k, tmp_path):
    _trial(PHASES[k % len(PHASES)], k, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("k", range(12, 50))
def test_sigint_in_every_phase_50_trials_in_all(k, tmp_path):
    _trial(PHASES[k % len(PHASES)], k, tmp_path)


_AT_FORK = """
import os, signal, sys, time
from mlso_cli import interrupt
interrupt.install(hard_exit=False)

def after_fork_in_parent():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)  # the handler runs here, inside the callback, where Python cannot raise

os.register_at_fork(after_in_parent=after_fork_in_parent)
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
try:
    interrupt.check()
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
"""


def test_sigint_inside_an_at_fork_callback_prints_no_traceback():
    """A Ctrl-C landing in logging's at-fork lock release (CI saw it) was swallowed by Python
    and printed as "Exception ignored ... Traceback". The run must still stop, without it."""
    done = subprocess.run(
        [sys.executable, "-c", _AT_FORK], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "interrupted"
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
