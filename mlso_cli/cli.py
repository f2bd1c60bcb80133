"""The `mlso` command: a click group, one module per command under commands/.

Every MlsoError becomes one line on stderr and its documented exit code; stdout carries data only.
"""

from __future__ import annotations

import errno
import sys

import click

from mlso_cli import __version__
from mlso_cli.console import error, set_verbosity
from mlso_cli.errors import ExitCode, MlsoError


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except MlsoError as exc:
            error(exc.one_line())
            ctx.exit(int(exc.exit_code))
        except OSError as exc:
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
            error("interrupted; nothing was written")
            ctx.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mlso")
@click.option(
    "-v",
    "--verbose",
    "verbose",
    flag_value=True,
    default=None,
    help="Print logs and tables on stderr even when it is not a terminal.",
)
@click.option(
    "-q", "--quiet", "verbose", flag_value=False, help="Print nothing on stderr but errors."
)
def main(verbose: bool | None) -> None:
    """mlso: a multi-level superoptimizer for ONNX models."""
    set_verbosity(verbose)


def _register() -> None:
    from mlso_cli.commands import COMMANDS

    for cmd in COMMANDS:
        main.add_command(cmd)


_register()

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
