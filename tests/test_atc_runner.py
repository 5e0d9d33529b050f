"""Running atc: command, environment, stored log, error-code fix and exit status plumbing.

CANN's atc is not installable here. These tests use STAND-IN executables written by the test
(`fake_atc_standin.sh`): they only record the arguments and environment they were given and print a line or create
`model.om`. They check dsconv's plumbing around atc, never a compile.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from dsconv.atc.options import parse_script
from dsconv.atc.runner import KNOWN_ERRORS
from dsconv.atc.samples import tiny_lm
from dsconv.cli import main

pytestmark = pytest.mark.cli

FAILING_STANDIN = """#!/usr/bin/env bash
# STAND-IN for CANN's atc (test only): prints an ATC-style failure and exits {code}
echo "ATC start working now, please wait for a moment."
echo "E10001: Value [-1] for parameter [--input_shape] is invalid. Reason: no gears."
echo "ATC run failed, Please check the detail log, Try 'atc --help' for more information"
exit {code}
"""

PASSING_STANDIN = """#!/usr/bin/env bash
# STAND-IN for CANN's atc (test only): records argv and ASCEND_* env, creates <output>.om, exits 0
printf '%s\\n' "$@" > argv.txt
env | grep '^ASCEND_' | sort > env.txt
pwd > cwd.txt
for a in "$@"; do case "$a" in --output=*) out="${{a#--output=}}";; esac; done
echo "fake om" > "$out.om"
echo "ATC run success, welcome to the next use."
"""


def standin(tmp_path: Path, text: str, name: str = "fake_atc_standin.sh") -> Path:
    p = tmp_path / "bin" / name
    p.parent.mkdir(exist_ok=True)
    p.write_text(text)
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return p


def run(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_success_runs_the_script_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", "/opt/fake-ascend")
    atc = standin(tmp_path, PASSING_STANDIN.format())
    onnx = tiny_lm(tmp_path / "m.onnx")
    out = tmp_path / "out"
    code, stdout, err = run(["atc", "--onnx", str(onnx), "--soc", "Ascend310P3", "-o", str(out),
                             "--atc-bin", str(atc)], capsys)
    assert code == 0, err
    sd = out / "Ascend310P3"
    script_opts = parse_script((sd / "atc.sh").read_text())
    # the stand-in received exactly the command in atc.sh, in the SoC directory, with the environment
    assert (sd / "argv.txt").read_text().splitlines() == script_opts.argv()
    assert (sd / "cwd.txt").read_text().strip().endswith("Ascend310P3")  # ran inside the (temporary) SoC dir
    assert "ASCEND_TOOLKIT_HOME=/opt/fake-ascend" in (sd / "env.txt").read_text()
    assert (sd / "model.om").read_text() == "fake om\n"
    assert "ATC run success" in (sd / "atc.log").read_text()
    runj = json.loads((sd / "run.json").read_text())
    assert runj["returncode"] == 0 and runj["ascend_env"] == {"ASCEND_TOOLKIT_HOME": "/opt/fake-ascend"}
    assert runj["atc"] == str(atc)
    manifest = json.loads((out / "dsconv_manifest.json").read_text())
    assert {"Ascend310P3/model.om", "Ascend310P3/atc.log", "Ascend310P3/run.json"} <= set(manifest["files"])
    assert "atc done" in stdout and "ATC run success" in err  # the log is streamed to stderr


@pytest.mark.parametrize("code", [1, 7])
def test_failure_maps_the_code_and_exit_status_follows_atc(tmp_path, capsys, code):
    atc = standin(tmp_path, FAILING_STANDIN.format(code=code))
    onnx = tiny_lm(tmp_path / "m.onnx")
    out = tmp_path / "out"
    rc, stdout, err = run(["atc", "--onnx", str(onnx), "--soc", "Ascend910B", "-o", str(out), "--atc-bin",
                           str(atc)], capsys)
    assert rc == code
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: atc failed (exit {code}): E10001: ")
    assert KNOWN_ERRORS["E10001"][1] in last and str(out / "Ascend910B3" / "atc.log") in last
    log = (out / "Ascend910B3" / "atc.log").read_text()  # kept for the user, with the profile
    assert "E10001: Value [-1]" in log
    runj = json.loads((out / "Ascend910B3" / "run.json").read_text())
    assert runj["returncode"] == code and runj["error_codes"] == ["E10001"]


def test_run_uses_atc_on_path(tmp_path, capsys, monkeypatch):
    target = standin(tmp_path, PASSING_STANDIN.format())
    os.symlink(target, tmp_path / "bin" / "atc")  # `atc` on PATH is the stand-in
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    onnx = tiny_lm(tmp_path / "m.onnx")
    code, _, err = run(["atc", "--onnx", str(onnx), "--soc", "Ascend910B4", "-o", str(tmp_path / "o"), "--run",
                        "--json"], capsys)
    assert code == 0, err
    assert (tmp_path / "o" / "Ascend910B4" / "model.om").is_file()


def test_run_without_atc_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    onnx = tiny_lm(tmp_path / "m.onnx")
    code, out, err = run(["atc", "--onnx", str(onnx), "--soc", "Ascend910B", "-o", str(tmp_path / "o"), "--run"],
                         capsys)
    assert code == 2 and "no atc on PATH" in err and "--atc-bin" in err and out == ""
    assert not (tmp_path / "o").exists()


def test_atc_bin_must_be_executable(tmp_path, capsys):
    f = tmp_path / "atc"
    f.write_text("not executable")
    onnx = tiny_lm(tmp_path / "m.onnx")
    code, _, err = run(["atc", "--onnx", str(onnx), "--soc", "Ascend910B", "-o", str(tmp_path / "o"), "--atc-bin",
                        str(f)], capsys)
    assert code == 2 and "is not an executable file" in err


@pytest.mark.parametrize("code", ["E10001", "E89999", "EZ3003", "E19010"])
def test_known_codes_have_a_fix(code):
    what, fix = KNOWN_ERRORS[code]
    assert what and fix and "\n" not in what + fix
