"""`dsconv demo`: every stage on a seeded tiny DeepSeek-V3."""
from __future__ import annotations

from pathlib import Path

import click

from dsconv.commands.options import PATH


@click.command()
@click.argument("directory", type=PATH, default=Path("dsconv-demo"), required=False)
@click.option("--mtp", is_flag=True, help="Include DeepSeek's MTP layer in the tiny model.")
@click.option("--force", is_flag=True, help="Rebuild the tiny model even if DIR already has one.")
def demo(directory: Path, mtp: bool, force: bool) -> None:
    """Write a tiny DeepSeek-V3 into DIR (default ./dsconv-demo) and run the whole pipeline on it."""
    from dsconv.demo import run_demo

    run_demo(directory, click.get_current_context().find_root().command, mtp=mtp, force=force)
