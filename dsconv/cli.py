"""The `dsconv` command line: one click group; each command parses options, calls one stage, prints its summary.

Errors follow DESIGN.md: UserError -> exit 2 and CheckFailed -> exit 3, each one line on stderr with no traceback;
anything else is a bug -> exit 1 with the traceback and a request to report it. `--json` output goes to stdout alone.
"""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import click

from dsconv import __version__
from dsconv.errors import DsconvError, UserError

PATH = click.Path(path_type=Path)


def emit_json(obj: Any) -> None:
    """Print a --json summary: stdout alone, one object."""
    click.echo(json.dumps(obj, indent=2, ensure_ascii=False, default=str))


def warn(message: str) -> None:
    click.echo(f"warning: {message}", err=True)


PIPELINE_ORDER = ("init", "inspect", "export", "quantize", "eval", "shard", "atc", "verify", "demo")


class PipelineGroup(click.Group):
    """`dsconv --help` lists the commands in the order a user runs them, not alphabetically."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        known = [c for c in PIPELINE_ORDER if c in self.commands]
        return known + sorted(c for c in self.commands if c not in known)


@click.group(cls=PipelineGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="dsconv")
def cli() -> None:
    """Convert, quantize and shard HF LLM checkpoints for Ascend NPUs (910B, 310P3).

    Start with `dsconv init --model DIR`; then `dsconv inspect`, `dsconv export`, `dsconv quantize --bits 8`,
    `dsconv shard --ep 8 --tp 4` and `dsconv atc --soc Ascend910B` need no paths.
    """


def model_option(f):
    return click.option("--model", "-m", type=PATH, default=None,
                        help="HF model directory (default: the workspace's model from dsconv.toml).")(f)


def output_option(f):
    return click.option("--output", "-o", type=PATH, default=None,
                        help="Output directory (default: <workspace output>/<stage>).")(f)


def json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object on stdout.")(f)


def force_option(f):
    return click.option("--force", is_flag=True, help="Replace a previous dsconv output at --output.")(f)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script and `python -m dsconv`."""
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
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("interrupted: nothing was written", err=True)
        sys.exit(130)
    except Exception:  # a bug: show everything
        traceback.print_exc()
        click.echo(f"dsconv {__version__} hit a bug (exit 1); please report it with the traceback above.", err=True)
        sys.exit(1)
    sys.exit(0)


# The commands register themselves on `cli` when their modules import; keep this list in pipeline order.
from dsconv import commands  # noqa: E402,F401  (registers every command)
