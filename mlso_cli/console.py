"""The stderr console: logs, tables and progress, quiet when stderr is not a terminal.

stdout is reserved for data (`--json` lines). Errors are always printed, TTY or not. When stderr
is not a terminal (a batch job, a pipe, a log file) and neither -v nor -q was given, each command
still prints one plain summary line (`summary`), so a log never ends up empty. rich is imported
on first use: the CLI's start stays short (interrupt.py explains why that matters).
"""

from __future__ import annotations

import contextlib
import sys

_state = {"verbose": None}


def set_verbosity(verbose: bool | None) -> None:
    """None: talk only on a TTY. True: always. False: never (except errors)."""
    _state["verbose"] = verbose


def chatty() -> bool:
    v = _state["verbose"]
    return sys.stderr.isatty() if v is None else bool(v)


def quiet() -> bool:
    """-q was given."""
    return _state["verbose"] is False


def plain() -> bool:
    """Progress as plain lines, not rich's live display: with -v, or whenever stderr is not a
    terminal (a live display there would be one unreadable blob at the end)."""
    return not quiet() and (_state["verbose"] is True or not sys.stderr.isatty())


def stderr():
    """A console bound to the current sys.stderr (pytest and click swap it)."""
    from rich.console import Console

    return Console(
        file=sys.stderr, highlight=False, soft_wrap=True, width=None if sys.stderr.isatty() else 160
    )


def log(message: str) -> None:
    if chatty():
        stderr().print(message)


def line(message: str) -> None:
    """One plain line on stderr, flushed at once (progress in a batch log must not wait)."""
    with contextlib.suppress(OSError, ValueError):  # stderr gone: progress is not worth a failure
        print(message, file=sys.stderr, flush=True)


def summary(message: str) -> None:
    """A command's one-line summary: printed when stderr is not a terminal and no -v/-q was
    given (with -v the full report is printed instead; on a terminal, the rich display)."""
    if _state["verbose"] is None and not sys.stderr.isatty():
        line(f"mlso: {message}")


def error(message: str) -> None:
    print(f"mlso: error: {message}", file=sys.stderr, flush=True)
