"""The `dsconv` command line: one click group; each command parses options, calls one stage, prints its summary.

Errors follow the README's exit codes: UserError -> exit 2 and CheckFailed -> exit 3, each one line on stderr with
no traceback; anything else is a bug -> exit 1 with the traceback and a request to report it. `--json` output goes
to stdout alone.
"""
from __future__ import annotations

import sys
import traceback

import click

from dsconv import __version__
from dsconv.commands.atc import atc
from dsconv.commands.demo import demo
from dsconv.commands.eval import eval_cmd
from dsconv.commands.export import export
from dsconv.commands.quantize import quantize, rotate
from dsconv.commands.shard import shard
from dsconv.commands.workspace_cmds import init, inspect, verify
from dsconv.errors import DsconvError, install_interrupt_flag


class PipelineGroup(click.Group):
    """`dsconv --help` lists the commands in the order they were added (the order a user runs them), not
    alphabetically."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)


@click.group(cls=PipelineGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="dsconv")
def cli() -> None:
    """Convert, quantize and shard HF LLM checkpoints for Ascend NPUs (910B, 310P3).

    Start with `dsconv init --model DIR`; then `dsconv inspect`, `dsconv export`, `dsconv quantize --bits 8`,
    `dsconv shard --ep 8 --tp 4` and `dsconv atc --soc Ascend910B` need no paths.
    """


# Every command, in pipeline order (`dsconv --help` lists them so).
for _command in (init, inspect, export, rotate, quantize, eval_cmd, shard, atc, verify, demo):
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script and `python -m dsconv`."""
    install_interrupt_flag()
    try:
        cli.main(args=argv, prog_name="dsconv", standalone_mode=False)
    except DsconvError as e:
        click.echo(f"error: {e.one_line()}", err=True)
        if e.details:
            click.echo(e.details, err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, click.exceptions.Abort):  # click turns Ctrl-C into Abort; outputs roll back
        click.echo("interrupted: nothing was written", err=True)
        sys.exit(130)
    except OSError as e:  # the environment, not dsconv: a full disk, a permission, a path that is a file
        click.echo(f"error: {e.filename or 'I/O'}: {(e.strerror or type(e).__name__).lower()}; check the path, its "
                   "permissions and the free space", err=True)
        sys.exit(2)
    except Exception:  # a bug: show everything
        traceback.print_exc()
        click.echo(f"dsconv {__version__} hit a bug (exit 1); please report it with the traceback above.", err=True)
        sys.exit(1)
    sys.exit(0)


class FiniteFloat(click.ParamType):
    """A float option that refuses nan and inf: click's FLOAT takes them, and `x < 0` is False for nan, so a range
    check downstream would let `--fallback-threshold nan` through."""

    def __init__(self, inner: click.ParamType) -> None:
        self.inner = inner
        self.name = inner.name

    def convert(self, value, param, ctx):
        import math

        out = self.inner.convert(value, param, ctx)
        if isinstance(out, float) and not math.isfinite(out):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return out

    def get_metavar(self, *args, **kwargs):
        return self.inner.get_metavar(*args, **kwargs)


def _finite_floats(group: click.Group) -> None:
    """Every float option of every command is finite (one rule here instead of one check per option)."""
    for command in group.commands.values():
        for param in command.params:
            if isinstance(param.type, click.types.FloatParamType):
                param.type = FiniteFloat(param.type)


_finite_floats(cli)
