"""Helpers shared by the benchmarks: peak RSS of a child process, result files, scratch space."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"


def save(name: str, figures: dict[str, Any], quiet: bool = False) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    figures = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **figures}
    path.write_text(json.dumps(figures, indent=2) + "\n")
    if not quiet:
        print(json.dumps(figures, indent=2))
    return path


def scratch(prefix: str) -> Path:
    """A scratch directory on the work disk (not tmpfs), removed by the caller."""
    base = Path(os.environ.get("DSCONV_BENCH_DIR", tempfile.gettempdir()))
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def run_measured(code: str, *args: str) -> dict[str, Any]:
    """Run `python -c code args...` in a child; return its JSON stdout (which should carry its own peak RSS from
    CHILD_PEAK's peak_rss_bytes()) plus the wall time."""
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"benchmark child failed ({p.returncode}):\n{p.stderr[-3000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1]) if p.stdout.strip() else {}
    out["wall_s"] = wall  # the child reports its own peak (VmHWM) as peak_rss_bytes
    return out


CHILD_PEAK = """
import json
def peak_rss_bytes():
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a child of a big parent would report the parent's
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
"""


def drop_page_cache(path: Path) -> None:
    """Best effort: evict a file from the page cache so a read measures the disk (needs no root: fadvise)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    except OSError:
        pass
