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


class Size(click.ParamType):
    """A byte size ('4GB', '500MB', '2GiB', '1000') read when the options are parsed, so a bad one is refused up front
    naming its option (dsconv.tensors.parse_size says what it accepts)."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from dsconv.errors import UserError
        from dsconv.tensors import parse_size

        try:
            return parse_size(value)
        except UserError as e:
            self.fail(f"{e.message}; write a positive size like 4GB, 500MB or 2GiB", param, ctx)


SIZE = Size()


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


def exec_options(f=None, *, default_workers: str = "the CPU count"):
    """--workers, --executor, --ray-address: how a stage runs its independent jobs (dsconv.executor);
    `default_workers` says what the command runs without --workers."""
    if f is None:
        return lambda g: exec_options(g, default_workers=default_workers)
    f = click.option("--ray-address", default=None, metavar="ADDR",
                     help="Ray cluster to run on (e.g. auto after `ray start --head`); without it --executor ray "
                          "starts a local Ray instance.")(f)
    f = click.option("--executor", type=click.Choice(["local", "ray"]), default=None,
                     help="local: processes on this host (default); ray: tasks on a Ray cluster "
                          "(pip install 'dsconv[ray]'). Outputs are byte-identical either way.")(f)
    from dsconv.executor import MAX_WORKERS

    f = click.option("--workers", type=click.IntRange(1, MAX_WORKERS), default=None, metavar="N",
                     help=f"Parallel jobs (output parts, ranks): 1 runs inline; default: {default_workers} "
                          "(`workers` under [defaults] in dsconv.toml).")(f)
    return f


def resolve_exec(workers: int | None, executor: str | None, ray_address: str | None):
    """The ExecOptions of a command: its options, else `workers` / `executor` / `ray_address` under [defaults] in
    dsconv.toml, else local processes on every CPU."""
    from dsconv import workspace
    from dsconv.errors import UserError
    from dsconv.executor import EXECUTORS, MAX_WORKERS, ExecOptions

    ws = workspace.find()
    d = (ws.defaults or {}) if ws is not None else {}
    if workers is None and "workers" in d:
        workers = d["workers"]
        if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= MAX_WORKERS:
            raise UserError(f"{ws.path}: workers = {workers!r} is not an integer in 1..{MAX_WORKERS}",
                            hint="e.g. workers = 8")
    if executor is None and "executor" in d:
        executor = d["executor"]
        if executor not in EXECUTORS:
            raise UserError(f"{ws.path}: executor = {executor!r} is not one of {', '.join(EXECUTORS)}")
    if ray_address is None and "ray_address" in d:
        ray_address = d["ray_address"]
        if not isinstance(ray_address, str) or not ray_address:
            raise UserError(f"{ws.path}: ray_address = {ray_address!r} is not an address", hint='e.g. "auto"')
    opts = ExecOptions(executor or "local", workers, ray_address)
    from dsconv.executor import check_options

    check_options(opts)
    return opts
