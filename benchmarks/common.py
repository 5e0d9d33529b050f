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


def save(name: str, figures: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    figures = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **figures}
    path.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    return path


def scratch(prefix: str) -> Path:
    """A scratch directory on the work disk (not tmpfs), removed by the caller."""
    base = Path(os.environ.get("DSCONV_BENCH_DIR", tempfile.gettempdir()))
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def run_measured(code: str, *args: str) -> dict[str, Any]:
    """Run `python -c code args...` in a child; return its wall time, peak RSS (ru_maxrss) and JSON stdout."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"benchmark child failed ({p.returncode}):\n{p.stderr[-3000:]}")
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out = json.loads(p.stdout.strip().splitlines()[-1]) if p.stdout.strip() else {}
    # ru_maxrss of children is the max over all children so far: run the biggest last or read the child's own figure
    out.setdefault("peak_rss_bytes", max(peak_kib, before) * 1024)
    out["wall_s"] = wall
    return out


CHILD_PEAK = """
import resource, json
def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
"""


def drop_page_cache(path: Path) -> None:
    """Best effort: evict a file from the page cache so a read measures the disk (needs no root: fadvise)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    except OSError:
        pass
