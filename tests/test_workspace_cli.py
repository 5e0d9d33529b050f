"""The workspace: `dsconv init` once, then commands need no paths; without one, a one-line error says what to do."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cli


def test_init_then_commands_without_paths(run_cli, tiny_model, tmp_path):
    model = tiny_model("llama")
    r = run_cli(["init", "--model", model], cwd=tmp_path)
    assert r.code == 0, r.err
    toml = (tmp_path / "dsconv.toml").read_text()
    assert str(model) in toml and "dsconv-out" in toml
    r = run_cli(["inspect", "--json"], cwd=tmp_path)
    assert r.code == 0, r.err
    assert json.loads(r.out)["family"] == "llama"
    sub = tmp_path / "a" / "b"
    sub.mkdir(parents=True)
    assert run_cli(["inspect", "--json"], cwd=sub).code == 0  # found in a parent, like git
    r = run_cli(["init", "--model", model], cwd=tmp_path)
    assert r.code == 2 and "--force" in r.err


def test_no_workspace_no_model(run_cli, tmp_path):
    r = run_cli(["inspect"], cwd=tmp_path)
    assert r.code == 2
    assert r.err.count("\n") == 1 and "dsconv init --model" in r.err and "--model" in r.err


def test_init_rejects_non_model(run_cli, tmp_path):
    r = run_cli(["init", "--model", tmp_path], cwd=tmp_path)
    assert r.code == 2 and "config.json" in r.err


def test_module_entry_point_and_version():
    r = subprocess.run([sys.executable, "-m", "dsconv", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and "dsconv" in r.stdout


def test_usage_error_is_exit_2(run_cli):
    r = run_cli(["inspect", "--no-such-option"])
    assert r.code == 2


def test_json_output_is_stdout_only(run_cli, tiny_model):
    r = run_cli(["inspect", "--model", tiny_model("qwen3"), "--json"])
    assert r.code == 0
    json.loads(r.out)  # nothing else on stdout
