"""The stderr console: logs, tables and progress, quiet when stderr is not a terminal.

stdout is reserved for data (`--json` lines). Errors are always printed, TTY or not.
"""

from __future__ import annotations

import sys

from rich.console import Console

_state = {"verbose": None}


def set_verbosity(verbose: bool | None) -> None:
    """None: talk only on a TTY. True: always. False: never (except errors)."""
    _state["verbose"] = verbose


def chatty() -> bool:
    v = _state["verbose"]
    return sys.stderr.isatty() if v is None else bool(v)


def stderr() -> Console:
    """A console bound to the current sys.stderr (pytest and click swap it)."""
    return Console(
        file=sys.stderr, highlight=False, soft_wrap=True, width=None if sys.stderr.isatty() else 160
    )


def log(message: str) -> None:
    if chatty():
        stderr().print(message)


def error(message: str) -> None:
    print(f"mlso: error: {message}", file=sys.stderr)
