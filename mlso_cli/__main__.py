"""`python -m mlso_cli` runs the CLI, so the GPU machine can run from the source tree.

Only the standard library is imported before the SIGINT handling is installed (interrupt.py):
a Ctrl-C during the CLI's own imports is one line and exit 130, not a traceback."""

from __future__ import annotations

from mlso_cli.interrupt import entry

if __name__ == "__main__":
    entry()
