"""The `mlso` command: a click group, one module per command under commands/.

Every MlsoError becomes one line on stderr and its documented exit code; stdout carries data only.
Pipeline conventions (docs/cli-errors.md), kept here so that every command gets them:
  - every usage error is one line and exit 2 (click's own three-line form is not used);
  - `-v` and `-q` are accepted before or after the subcommand, and together are a usage error;
  - a closed stdout (`mlso inspect M --json | head -3`) ends the command quietly with exit 0;
  - Ctrl-C is one line and exit 130 (interrupt.py; the entry point installs it before imports).
Commands are imported on first use, so `mlso --help` and a Ctrl-C right after start stay fast.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys

import click

from mlso_cli import __version__, interrupt
from mlso_cli.console import error, set_verbosity
from mlso_cli.errors import ExitCode, MlsoError

_VERBOSE_HELP = "Print logs, tables and progress on stderr even when it is not a terminal."
_QUIET_HELP = "Print nothing on stderr but errors."
_flags: dict[str, str] = {}
"""The verbosity flags of this invocation (`-v` or `-q`, wherever they were given)."""


def _verbosity(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value:
        return
    name = "-v" if param.name == "verbose" else "-q"
    _flags[name] = name
    if len(_flags) > 1:
        raise click.UsageError("-q and -v contradict each other; pass one of them", ctx)
    set_verbosity(name == "-v")


def global_options(f):
    """-v/-q, on the group and on every subcommand (after the subcommand they work the same)."""
    f = click.option(
        "-q",
        "--quiet",
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=_verbosity,
        help=_QUIET_HELP,
    )(f)
    return click.option(
        "-v",
        "--verbose",
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=_verbosity,
        help=_VERBOSE_HELP,
    )(f)


def _quiet_stdout() -> None:
    """The reader went away: point stdout at /dev/null so the final flush cannot fail again."""
    with contextlib.suppress(Exception):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _one_line_usage(exc: click.ClickException) -> str:
    msg = " ".join(exc.format_message().split())
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, click.UsageError) and ctx is not None:
        end = "" if msg.endswith((".", "?", "!")) else "."
        msg = f"{msg}{end} Run '{ctx.command_path} --help' for usage"
    return msg


class _Group(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        _register()
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        _register()
        return super().get_command(ctx, cmd_name)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """click's main, with this CLI's one-line errors and exit codes (see the module doc)."""
        _flags.clear()
        set_verbosity(None)
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        code = int(ExitCode.OK)
        try:
            rv = super().main(args, prog_name or "mlso", complete_var, False, **extra)
            code = rv if isinstance(rv, int) else 0
            if interrupt.interrupted() and code != interrupt.EXIT_INTERRUPTED:
                interrupt.check()  # a swallowed interrupt still ends the run as one
        except click.exceptions.Abort:
            interrupt.finish()
            code = interrupt.EXIT_INTERRUPTED
        except KeyboardInterrupt:
            interrupt.finish()
            code = interrupt.EXIT_INTERRUPTED
        except click.ClickException as exc:
            error(_one_line_usage(exc))
            code = exc.exit_code
        except BrokenPipeError:
            _quiet_stdout()
            code = 0
        if interrupt.installed() and code != interrupt.EXIT_INTERRUPTED:
            # the command is over: a Ctrl-C now would only turn its result into a traceback
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.exit(code)

    def invoke(self, ctx: click.Context):
        try:
            return self._invoke(ctx)
        except (click.exceptions.Exit, click.ClickException):
            raise
        except BaseException:
            # after a Ctrl-C, whatever unwinds first (KeyboardInterrupt, or a pool whose workers
            # were just killed reporting itself broken) is the interrupt
            if interrupt.interrupted():
                interrupt.finish()
                ctx.exit(interrupt.EXIT_INTERRUPTED)
            raise

    def _invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except MlsoError as exc:
            error(exc.one_line())
            ctx.exit(int(exc.exit_code))
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                _quiet_stdout()  # `| head`: the reader has what it wanted
                ctx.exit(int(ExitCode.OK))
            if exc.errno == errno.ENOSPC:
                error(
                    f"no space left on device while writing {exc.filename or 'output'}. Free disk space or write elsewhere with -o."
                )
                ctx.exit(int(ExitCode.ERROR))
            raise
        except MemoryError:
            # the checks that estimate memory up front (load, verify's inputs) cannot see every
            # allocation: a tensor made on the way (random inputs, a reference) can still not fit
            error(
                "out of memory: the model's tensors at these shapes do not fit in this machine's "
                "memory. Use smaller --input-shape values or a machine with more memory; nothing "
                "was written"
            )
            ctx.exit(int(ExitCode.ERROR))
        except KeyboardInterrupt:
            interrupt.finish()
            ctx.exit(interrupt.EXIT_INTERRUPTED)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mlso")
@global_options
def main() -> None:
    """mlso: a multi-level superoptimizer for ONNX models."""


_registered: list[bool] = []


def _register() -> None:
    """Add the commands (their imports are the slow part of starting), each with -v/-q."""
    if _registered:
        return
    _registered.append(True)
    from mlso_cli.commands import COMMANDS

    interrupt.check()  # the imports above can swallow the KeyboardInterrupt of a Ctrl-C

    for cmd in COMMANDS:
        names = {p.name for p in cmd.params}
        if "verbose" not in names:
            global_options(cmd)
        main.add_command(cmd)


if __name__ == "__main__":  # pragma: no cover
    interrupt.entry()
