"""What every command shares: path type, the common options, JSON output, warnings.

Why not in cli.py: cli.py imports the commands to add them to the group, so the commands must not import cli.py
(that was a 15-module import cycle); they import this module instead.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from dsconv.errors import warn  # noqa: F401  (re-exported: the commands' warnings)

PATH = click.Path(path_type=Path)


def emit_json(obj: Any) -> None:
    """Print a --json summary: stdout alone, one object."""
    click.echo(json.dumps(obj, indent=2, ensure_ascii=False, default=str))


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
