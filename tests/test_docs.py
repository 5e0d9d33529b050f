"""The documentation stays true to the code.

Each docs/commands/<command>.md carries that command's real `--help` between `<!-- help -->` markers, as
`dsconv <command> --help` prints it on an 80-column terminal; after changing an option, regenerate them with

    DSCONV_UPDATE_DOCS=1 .venv/bin/python -m pytest tests/test_docs.py

Every relative link in README.md and docs/ must point at a file of the repository, and the README stays short
enough to read in five minutes (the details live in docs/).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import click
import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("inspect", "export", "rotate", "quantize", "eval", "shard", "atc", "verify", "demo")
HELP_BLOCK = re.compile(r"<!-- help -->\n(.*?)<!-- /help -->", re.S)
README_MAX_LINES = 150


def help_text(name: str) -> str:
    """`dsconv NAME --help` as an 80-column terminal shows it (click wraps at the width minus 2)."""
    from dsconv.cli import cli

    parent = click.Context(cli, info_name="dsconv", **{**cli.context_settings, "terminal_width": 78})
    command = cli.commands[name]
    return command.get_help(click.Context(command, info_name=name, parent=parent))


def help_block(name: str) -> str:
    return f"<!-- help -->\n```text\n{help_text(name)}\n```\n<!-- /help -->"


@pytest.mark.parametrize("name", COMMANDS)
def test_command_page_has_the_real_help(name):
    page = ROOT / "docs" / "commands" / f"{name}.md"
    text = page.read_text(encoding="utf-8")
    m = HELP_BLOCK.search(text)
    assert m is not None, f"{page.relative_to(ROOT)} lacks the <!-- help --> ... <!-- /help --> block"
    want = help_block(name)
    if os.environ.get("DSCONV_UPDATE_DOCS"):
        page.write_text(text[:m.start()] + want + text[m.end():], encoding="utf-8")
        return
    assert m.group(0) == want, (f"{page.relative_to(ROOT)}: the options differ from `dsconv {name} --help`; "
                                "regenerate with DSCONV_UPDATE_DOCS=1")


def test_every_command_has_a_page():
    from dsconv.cli import cli

    missing = [n for n in cli.commands if n != "init" and n not in COMMANDS]
    assert not missing, f"commands without a docs/commands page: {missing}"  # init is the README's quickstart


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "dsconv").rglob("*.md"))]


def test_relative_links_resolve():
    bad = []
    for md in _markdown_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", md.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address or an anchor on the same page
            path = (md.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                bad.append(f"{md.relative_to(ROOT)}: {target}")
    assert not bad, "links to files that do not exist:\n" + "\n".join(bad)


def test_readme_is_short_and_keeps_the_two_commands_first():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (limit {README_MAX_LINES}): move " \
                                           "details into docs/"
    first_screen = "\n".join(lines[:25])
    assert "make demo" in first_screen and "make test" in first_screen
