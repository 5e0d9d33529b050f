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


def merge(name: str, key: str, value: Any, quiet: bool = False) -> Path:
    """One part's figures into the last `name`.json, the other parts kept (a benchmark's part run alone)."""
    previous = RESULTS / f"{name}.json"
    kept = json.loads(previous.read_text()) if previous.is_file() else {}
    kept.pop("benchmark", None)
    kept.pop("time", None)
    return save(name, {**kept, key: value}, quiet=quiet)


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


def _status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(line.split()[1]) * 1024
    return out


def _pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))


def run_tree_sampled(argv: list[str], every: float = 0.05, env: dict[str, str] | None = None,
                     cwd: str | None = None, pss: bool = True) -> dict[str, Any]:
    """Run `argv` and sample its whole process tree (driver, forkserver, pool workers, Ray's processes) every
    `every` s with psutil: each process's own peak (VmHWM, exact between samples while it lives), the largest
    worker's, and the peak of the tree's summed PSS (shared pages - torch's libraries in forked workers, a page
    cache mapping read by two processes - counted once, split between their users) and summed RSS (upper bound).
    Why: `peak_rss_bytes` inside a driver is the driver alone, and a pool's workers hold the tensors.
    `pss=False` skips the PSS (a walk of every mapping's page tables: CPU taken from a run being timed)."""
    import psutil

    t = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    root = psutil.Process(p.pid)
    hwm: dict[int, tuple[str, int]] = {}
    depth: dict[int, int] = {p.pid: 0}
    tree_pss = tree_rss = 0
    while p.poll() is None:
        try:
            kids = root.children(recursive=True)
        except psutil.Error:
            kids = []
        tot_pss = rss = 0
        for proc in [root, *kids]:
            try:
                st = _status(proc.pid)
                if proc.pid not in depth:
                    depth[proc.pid] = depth.get(proc.ppid(), 0) + 1
                name = hwm.get(proc.pid, (None, 0))[0] or " ".join(proc.cmdline()[:3])[:80]
                hwm[proc.pid] = (name, max(hwm.get(proc.pid, ("", 0))[1], st.get("VmHWM", 0)))
                rss += st.get("VmRSS", 0)
                tot_pss += _pss(proc.pid) if pss else 0
            except (OSError, psutil.Error, StopIteration):
                continue
        tree_pss, tree_rss = max(tree_pss, tot_pss), max(tree_rss, rss)
        time.sleep(every)
    out, err = p.communicate()
    if p.returncode != 0:
        raise RuntimeError(f"{argv[:4]} failed ({p.returncode}):\n{err[-3000:]}")
    driver = hwm.get(p.pid, ("", 0))[1]
    # workers: processes below the driver's own children (a pool's workers are the forkserver's children); the
    # forkserver, resource tracker and Ray's daemons are helpers
    workers = [v for pid, (_, v) in hwm.items() if depth.get(pid, 0) >= 2]
    helpers = [v for pid, (_, v) in hwm.items() if depth.get(pid, 0) == 1]
    return {"wall_s": round(time.perf_counter() - t, 2), "driver_peak_rss_bytes": driver,
            "largest_worker_peak_rss_bytes": max(workers, default=0), "workers_seen": len(workers),
            "largest_helper_peak_rss_bytes": max(helpers, default=0),
            "tree_peak_pss_bytes": tree_pss, "tree_peak_rss_bytes": tree_rss, "stdout": out[-2000:]}
