"""Errors of code generation and compilation, in the form `mlso_cli.errors` prints."""

from __future__ import annotations

from mlso_cli.errors import MlsoError


class CodegenError(MlsoError):
    """A μGraph construct code generation cannot lower (a bug or an unsupported corner)."""

    def __init__(self, what: str, fix: str | None = None) -> None:
        super().__init__(
            what, fix or "Report this graph (mlso inspect --json) as a code generation bug."
        )


class CompileError(MlsoError):
    """nvcc rejected generated code; the message carries the command and the kept source."""
