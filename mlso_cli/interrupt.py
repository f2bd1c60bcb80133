"""Ctrl-C: exit 130 within 2 s with one line, whatever the run is doing, and leave nothing behind.

Why a module of its own, with only the standard library: the entry point installs this before it
imports anything heavy (importing the CLI takes a second or more on a busy machine), so a Ctrl-C
during the imports gets the same one line as one during a search, not a traceback.

How (docs/cli-errors.md):
  - The driver alone handles SIGINT. Search workers ignore it (`worker_init`), so a Ctrl-C typed
    in a terminal, which the whole process group receives, never breaks the pool half-way.
  - The first SIGINT kills the registered worker processes at once (a worker can hold a core
    for minutes in one full-shape check), then raises KeyboardInterrupt in the main thread, so
    the code in flight unwinds: temp files of a write are removed, nothing is placed, nothing
    partial is cached. The CLI prints the one line and exits 130.
  - A watchdog bounds that: a thread woken by `signal.set_wakeup_fd` (the C-level handler writes
    to it even while the main thread is busy in C code, where Python handlers cannot run) gives
    the main thread GRACE_S, then prints the line, kills the workers and ends the process.
  - Worker processes also die with the driver (PR_SET_PDEATHSIG on Linux), so even a SIGKILL of
    the driver leaves no orphan.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

EXIT_INTERRUPTED = 130
GRACE_S = 1.2
"""How long the main thread may take to unwind after a SIGINT before the watchdog ends the
process (the promise is 2 s in all; the rest is margin for a busy machine)."""
MESSAGE = "mlso: error: interrupted; nothing was written"

_state: dict = {"owner": None, "hard": False, "fired": False, "said": False}
_workers: set[int] = set()
_lock = threading.Lock()


def install(hard_exit: bool = True) -> None:
    """Handle SIGINT from now on (the entry point calls this first). `hard_exit`: end the process
    with os._exit after the line (the real CLI); off where the caller is a test's interpreter."""
    if threading.current_thread() is not threading.main_thread():
        return
    _state.update(owner=os.getpid(), hard=hard_exit, fired=False, said=False, written=None)
    signal.signal(signal.SIGINT, _on_sigint)
    if not getattr(sys.unraisablehook, "_mlso", False):
        sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)
    if hard_exit:
        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=_wakeups, args=(r,), name="mlso-sigint", daemon=True).start()


def installed() -> bool:
    return _state["owner"] == os.getpid()


def interrupted() -> bool:
    """True once a SIGINT arrived (code that catches BaseException can tell it apart)."""
    return bool(_state["fired"])


def _quiet_unraisable(default):
    """Why: Python swallows an exception raised where it cannot propagate (an at-fork callback,
    a __del__) and prints "Exception ignored in ... Traceback" to stderr. Our own
    KeyboardInterrupt raised there is expected, not a fault: drop it quietly (the run still
    stops, at `check()` or by the watchdog); anything else goes to the previous hook."""

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and _state["fired"]:
            return
        default(unraisable)

    hook._mlso = True
    return hook


def _wakeups(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGINT in data:
            _begin()


def _on_sigint(signum: int, frame: object) -> None:
    if os.getpid() != _state["owner"]:
        return  # a forked worker before its initializer ran: the driver handles this one
    first = not _state["fired"]
    _begin()
    if first:
        raise KeyboardInterrupt
    # a second Ctrl-C while unwinding: the watchdog ends the run; do not break the cleanup


def _begin() -> None:
    with _lock:
        if _state["fired"] and _state.get("timer") is not None:
            return
        _state["fired"] = True
        kill_workers()
        if _state["hard"] and _state.get("timer") is None:
            t = threading.Timer(GRACE_S, hard_stop)
            t.daemon = True
            _state["timer"] = t
            t.start()


def check() -> None:
    """Raise KeyboardInterrupt if a SIGINT arrived. Why: C code that clears Python errors (an
    extension module's import does) can swallow the KeyboardInterrupt the handler raised; the
    run then calls this before anything it must not do once interrupted (writing the output)."""
    if _state["fired"] and installed():
        raise KeyboardInterrupt


def written(path: str) -> None:
    """The output is in place: a later Ctrl-C must not say that nothing was written."""
    _state["written"] = str(path)


def message() -> str:
    out = _state.get("written")
    if out and installed():
        return f"mlso: error: interrupted after {out} was written in full"
    return MESSAGE


def say() -> None:
    """The one line, printed once however many paths reach it."""
    with _lock:
        if _state["said"]:
            return
        _state["said"] = True
    with contextlib.suppress(Exception):
        sys.stderr.write(message() + "\n")
        sys.stderr.flush()


def hard_stop() -> None:
    """The line, no worker left, exit 130 now (no atexit joins of a pool: they can hang)."""
    say()
    kill_workers()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(EXIT_INTERRUPTED)


def finish() -> None:
    """The CLI caught the KeyboardInterrupt: end the run as promised."""
    if _state["hard"] and installed():
        hard_stop()
    say()


def add_workers(pids) -> None:
    _workers.update(int(p) for p in pids if p)


def remove_workers(pids) -> None:
    _workers.difference_update(int(p) for p in pids if p)


def kill_workers() -> None:
    """SIGKILL every registered worker (safe from a signal handler or a thread)."""
    for pid in list(_workers):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def worker_init() -> None:
    """In each search worker: ignore SIGINT (the driver handles it), forget the driver's wakeup
    fd, and die with the driver (Linux)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            if os.getppid() == 1:  # the driver died before prctl: do not linger
                os._exit(0)


def entry() -> None:
    """The `mlso` console script: SIGINT handled before the heavy imports, then the CLI."""
    try:
        install(hard_exit=True)
        from mlso_cli.cli import main

        check()
        main()
    except KeyboardInterrupt:
        finish()
        raise SystemExit(EXIT_INTERRUPTED) from None
