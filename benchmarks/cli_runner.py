"""Timed CLI jobs in one warm process, each beside its copy anchor (shared by bench_shard and bench_scale).

Why one process: the figures are throughput, so imports and the worker pool's start-up are paid once, before the
timed runs, and reported apart (`startup_s`, the first job). Every timed job starts from a synced page cache (dirty
pages of the last job written back, outside the timing) and an absent output (a previous output is removed outside
the timing, as the copy's is); neither the copy nor the job syncs its own writes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RUNNER = """
import json, os, shutil, sys, time
from pathlib import Path
t = time.perf_counter()
from dsconv.cli import main
import torch, tqdm
out = {"startup_s": time.perf_counter() - t}
mode, workers, jobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if mode == "ray":
    import ray
    t = time.perf_counter()
    ray.init(num_cpus=int(workers), include_dashboard=False, log_to_driver=False, configure_logging=False)
    out["ray_start_s"] = time.perf_counter() - t
extra = ["--workers", workers] + (["--executor", "ray"] if mode == "ray" else [])
for name, args in jobs:
    if name.startswith(("copy", "kcopy")):  # anchors: user-space read + write in 16 MiB blocks; kernel copy
        dst = Path(args[1])
    else:
        dst = Path(args[args.index("-o") + 1])
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    t = time.perf_counter()
    if name.startswith("copy"):
        dst.mkdir()
        for f in sorted(Path(args[0]).glob("*.safetensors")):
            with open(f, "rb") as fi, open(dst / f.name, "wb") as fo:
                while chunk := fi.read(16 * 2**20):
                    fo.write(chunk)
        out[name] = time.perf_counter() - t
        shutil.rmtree(dst)
        continue
    if name.startswith("kcopy"):
        dst.mkdir()
        for f in sorted(Path(args[0]).glob("*.safetensors")):
            shutil.copyfile(f, dst / f.name)  # copy_file_range / sendfile: no user-space buffer
        out[name] = time.perf_counter() - t
        shutil.rmtree(dst)
        continue
    try:
        main(args + extra)
    except SystemExit as e:
        assert not e.code, (name, e.code)
    out[name] = time.perf_counter() - t
if mode == "ray":
    ray.shutdown()
with open("/proc/self/status") as f:  # the driver's own high-water mark (VmHWM), workers not included
    out["driver_peak_rss_bytes"] = next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:"))
out["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
print("@@" + json.dumps(out))
"""


def run_cli_jobs(mode: str, workers: int, jobs: list) -> dict[str, float]:
    """Run `jobs` ([label, argv] pairs; labels starting with "copy" / "kcopy" are user-space / kernel copy anchors
    [src_dir, dst_dir]) in one child with
    `--workers workers` (and `--executor ray` for mode "ray"); each label's seconds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, "-c", RUNNER, mode, str(workers), json.dumps(jobs)], capture_output=True,
                       text=True, env=env, cwd=str(ROOT))
    if p.returncode:
        raise RuntimeError(f"runner {mode} {workers} failed:\n{p.stderr[-3000:]}")
    return json.loads(next(x for x in p.stdout.splitlines() if x.startswith("@@"))[2:])
