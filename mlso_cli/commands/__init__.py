"""One module per command. A command is listed here only once it really works."""

from __future__ import annotations

from mlso_cli.commands.inspect import inspect_cmd

COMMANDS = [inspect_cmd]
