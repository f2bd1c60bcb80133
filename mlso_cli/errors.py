"""Errors that reach the user: what failed, why, and the fix, plus the documented exit code.

Every error mlso raises on purpose is an `MlsoError`. The CLI prints it as one line on stderr and
exits with its code; anything else is a bug and gets a traceback.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    ERROR = 1
    USAGE = 2
    VERIFICATION_FAILED = 3
    ENVIRONMENT = 4


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first non-empty line of a library's exception text (its type name when there is
    none), cut at `limit` characters: what an error of ours quotes of ONNX Runtime, nvcc or the
    emulator, whose messages run to many lines."""
    text = str(exc).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    return line[:limit]


class MlsoError(Exception):
    """A failure with a message a user can act on. `fix` says what to do about it."""

    exit_code: ExitCode = ExitCode.ERROR

    def __init__(self, what: str, fix: str | None = None) -> None:
        super().__init__(what)
        self.what = what
        self.fix = fix

    def one_line(self) -> str:
        text = self.what.rstrip(".")
        return f"{text}. {self.fix}" if self.fix else f"{text}."


class InputError(MlsoError):
    """The model or another input file is missing, empty, corrupt or unsupported (exit 1)."""


class Interrupted(MlsoError):
    """SIGTERM or SIGHUP stopped a write; its temp files were removed and nothing was placed (exit 1)."""


class UsageError(MlsoError):
    """The command line is incomplete or contradictory, e.g. an open dimension (exit 2)."""

    exit_code = ExitCode.USAGE


class VerificationFailed(MlsoError):
    """Two programs that should be equivalent are not (exit 3)."""

    exit_code = ExitCode.VERIFICATION_FAILED


class EnvironmentProblem(MlsoError):
    """The GPU, CUDA, nvcc or ONNX Runtime is missing or unusable (exit 4)."""

    exit_code = ExitCode.ENVIRONMENT
