"""One module per command. A command is listed here only once it really works."""

from __future__ import annotations

from mlso_cli.commands.bench import bench_cmd
from mlso_cli.commands.inspect import inspect_cmd
from mlso_cli.commands.optimize import optimize_cmd
from mlso_cli.commands.verify import verify_cmd

COMMANDS = [inspect_cmd, optimize_cmd, verify_cmd, bench_cmd]
