"""The MindIE part of `make engine-check`, timed after its setup: `python -m benchmarks engine_check`.

Needs MINDIE_LLM_SRC (a MindIE-LLM checkout, an installation's atb_llm, or its source archive). The environment is
set up first (not timed: cached after the first run); then `python -m tests.engine_check.matrix --engine mindie`
runs once in a fresh process, and the wall time, its split (quantize and shard / engine loads: each case is loaded
twice, the float source first, as the expected layout), the controls and the load average before and after are
printed. The target (docs/engine_check.md): at most 5 minutes on 2 cores.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    if not os.environ.get("MINDIE_LLM_SRC"):
        print("engine_check: MINDIE_LLM_SRC is not set (a MindIE-LLM checkout or source archive); skipped")
        return
    subprocess.run(["bash", str(ROOT / "dsconv/engine_check/mindie_setup.sh")], check=True, stdout=subprocess.DEVNULL)
    before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-engine-check-") as out:
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "tests.engine_check.matrix", "--engine", "mindie", "--out", out],
                           cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t
    split = re.search(r"^MindIE: quantize and shard (\d+) s, engine (\d+) s for (.*)$", p.stdout, re.M)
    summary = re.search(r"^engine-check mindie: .*$", p.stdout, re.M)
    print(f"MindIE part of make engine-check: {wall:.0f} s wall (load average {before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after; exit {p.returncode})")
    if split:
        print(f"  quantize and shard {split.group(1)} s, MindIE's loader and the comparison {split.group(2)} s "
              f"({split.group(3)})")
    if summary:
        print(f"  {summary.group(0)}")
    caught = len(re.findall(r"^control \S+: (caught|loaded clean)", p.stdout, re.M))
    missed = len(re.findall(r"^FAIL control", p.stdout, re.M))
    print(f"  controls: {caught} as required (each broken copy caught, the reference-packed one loaded clean), "
          f"{missed} not; `dsconv verify --engine mindie` runs: "
          f"{len(re.findall(r'^dsconv verify --engine mindie', p.stdout, re.M))}")
