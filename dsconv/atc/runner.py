"""Running the generated atc.sh where CANN's `atc` exists: streamed log, spinner, stored atc.log, error-code fixes.

Why run the script and not an argv of our own: the script is what the user reruns by hand, so the run proves it.
`ATC_BIN` tells the script which atc to call; the rest of the environment passes through unchanged (CANN needs the
variables `set_env.sh` exports), and the ASCEND_* ones are recorded in run.json so a failure can be reproduced.
The exit status is atc's. Known error codes map to a one-line fix (CANN error code reference + field reports).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dsconv.errors import DsconvError, UserError

ERROR_CODE = re.compile(r"\b(E[0-9A-Z][0-9]{4})\b")
# code -> (what it means, the fix); wording of the meaning follows CANN's error code reference
KNOWN_ERRORS: dict[str, tuple[str, str]] = {
    "E10001": ("an option value is invalid (often a -1 in --input_shape without gears, or a bad --soc_version)",
               "regenerate with dsconv atc (every -1 gets --dynamic_dims gears) and check --soc_version against "
               "`npu-smi info`"),
    "E10003": ("an option value is invalid", "run `atc -h`; check the option named in atc.log against profile.json"),
    "E10014": ("an option value is invalid", "run `atc -h`; check the option named in atc.log against profile.json"),
    "E10015": ("an option value is invalid", "run `atc -h`; check the option named in atc.log against profile.json"),
    "E10054": ("a required option is empty or a value is not quoted",
               "run the generated atc.sh as is (it quotes every value)"),
    "E89999": ("internal error; in the field mostly int32/int64 inputs mixed in one elementwise op",
               "export the index math in one integer type (see the mixed-int and topk-indices preflight rules)"),
    "EZ3003": ("no kernel for an operator type on this SoC",
               "replace the operator before export, lower the opset, or install the OPP package matching this CANN"),
    "EZ3002": ("an operator's specification (dtype/shape) is unsupported", "change the op's dtype or remove it"),
    "E13003": ("no kernel for an operator type on this SoC",
               "replace the operator before export, lower the opset, or install the matching OPP package"),
    "E19010": ("the ONNX parser has no parser for an operator type",
               "rewrite the operator with supported ONNX ops (see onnx_ops in the profile) and re-export"),
    "EZ9010": ("the ONNX parser has no parser for an operator type",
               "rewrite the operator with supported ONNX ops (see onnx_ops in the profile) and re-export"),
}


class AtcFailed(DsconvError):
    """atc ran and failed: the one-line fix, and the process exits with atc's own status."""

    def __init__(self, result: "RunResult") -> None:
        super().__init__(f"atc failed (exit {result.returncode}): {result.fix_line}")
        self.exit_code = result.returncode
        self.result = result


@dataclass
class RunResult:
    returncode: int
    log: Path
    seconds: float
    codes: list[str] = field(default_factory=list)
    atc: str = ""
    ascend_env: dict[str, str] = field(default_factory=dict)

    @property
    def fix_line(self) -> str:
        """One line: the first known error code's meaning and fix, else where to look."""
        for code in self.codes:
            if code in KNOWN_ERRORS:
                what, fix = KNOWN_ERRORS[code]
                return f"{code}: {what}; {fix} (log: {self.log})"
        if self.codes:
            return f"{self.codes[0]}: see the CANN error code reference and {self.log}"
        return f"see {self.log}"

    def to_json(self) -> dict:
        return {"returncode": self.returncode, "seconds": round(self.seconds, 2), "error_codes": self.codes,
                "atc": self.atc, "log": self.log.name, "ascend_env": self.ascend_env}


def find_atc(atc_bin: Path | None) -> str:
    """The atc executable to run: --atc-bin, else `atc` on PATH; a clear UserError when there is none."""
    if atc_bin is not None:
        p = Path(atc_bin)
        if not p.is_file() or not os.access(p, os.X_OK):
            raise UserError(f"--atc-bin {atc_bin} is not an executable file",
                            hint="point it at CANN's atc (e.g. $ASCEND_TOOLKIT_HOME/bin/atc)")
        return str(p.absolute())
    found = shutil.which("atc")
    if found is None:
        raise UserError("--run needs CANN's atc, and there is no atc on PATH",
                        hint="source CANN's set_env.sh, or pass --atc-bin PATH, or drop --run and copy the "
                             "generated atc.sh to a machine with CANN")
    return found


def run_script(script: Path, atc: str, log: Path, *, echo: Callable[[str], None] | None = None,
               spinner: bool | None = None) -> RunResult:
    """Run `bash script` with ATC_BIN=atc in the script's directory; stream and store its output."""
    env = dict(os.environ)
    env["ATC_BIN"] = atc
    ascend = {k: v for k, v in sorted(env.items()) if k.startswith("ASCEND_")}
    codes: list[str] = []
    start = time.monotonic()
    from tqdm import tqdm

    bar = tqdm(desc=f"atc {script.parent.name}", unit=" lines", file=sys.stderr, leave=False,
               disable=(not sys.stderr.isatty()) if spinner is None else not spinner,
               bar_format="{desc}: {n_fmt}{unit} {elapsed} {postfix}")
    with open(log, "w", encoding="utf-8", errors="replace") as logf:
        proc = subprocess.Popen(["bash", str(script.name)], cwd=script.parent, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                logf.write(line)
                logf.flush()
                for code in ERROR_CODE.findall(line):
                    if code not in codes:
                        codes.append(code)
                if echo is not None:
                    if bar.disable:
                        echo(line.rstrip("\n"))
                    else:
                        bar.write(line.rstrip("\n"), file=sys.stderr)
                bar.update(1)
                bar.set_postfix_str(line.strip()[:60], refresh=False)
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            raise
        finally:
            bar.close()
    return RunResult(rc, log, time.monotonic() - start, codes, atc, ascend)
