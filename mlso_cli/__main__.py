"""`python -m mlso_cli` runs the CLI, so the GPU machine can run from the source tree."""

from __future__ import annotations

from mlso_cli.cli import main

if __name__ == "__main__":
    main()
