"""Timed CLI jobs in one warm process, each beside its copy anchor (shared by bench_shard and bench_scale).

Why one process: the figures are throughput, so the imports are paid once before the timed runs (`startup_s`), and
so is the forkserver that preloads torch for the worker pools (started by the first job, which callers time apart;
each CLI job still starts its own pool of workers from it). Every timed job starts from a synced page cache (dirty
pages of the last job written back, outside the timing; a label ending in "_cold" also has its input's pages dropped
from the cache, so that it reads them from the disk) and an absent output (a previous output is removed outside
the timing, as the copy's is); neither the copy nor the job syncs its own writes. `peak_rss_bytes[label]` is the
driver's own high-water mark during that job (reset before it; workers not included: with `--workers 1` the work
runs inline in the driver, with more it does not).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RUNNER = """
import json, os, shutil, subprocess, sys, threading, time
from pathlib import Path
t = time.perf_counter()
from dsconv.cli import main
from dsconv.io.digest import new_hash
import torch, tqdm
out = {"startup_s": time.perf_counter() - t}
mode, workers, jobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if mode == "ray":
    import ray
    t = time.perf_counter()
    ray.init(num_cpus=int(workers), include_dashboard=False, log_to_driver=False, configure_logging=False)
    out["ray_start_s"] = time.perf_counter() - t
extra = ["--workers", workers] + (["--executor", "ray"] if mode == "ray" else [])
COPIES = ("copy", "bcopy", "hcopy", "kcopy", "cp")


def copy(kind, src, dst):
    # the anchors. copy: user-space read + write in 16 MiB blocks, a new block per read (the simplest anchor);
    # bcopy: the same through one reused buffer; hcopy: bcopy hashing each file beside the writes (the manifest's
    # digest, dsconv/io/digest.py), as dsconv's writer does; kcopy: os.copy_file_range, the call dsconv's writer
    # uses (on ext4 a copy in the kernel; file systems that clone extents would make it no copy at all: see
    # "filesystem");
    # cp: coreutils `cp -r` of the directory (every file, which is copy_file_range too for coreutils >= 9)
    if kind == "cp":
        subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
        return
    dst.mkdir()
    buf = memoryview(bytearray(16 * 2**20))
    for f in sorted(src.glob("*.safetensors")):
        if kind == "kcopy":
            with open(f, "rb") as fi, open(dst / f.name, "wb") as fo:
                n, done = os.fstat(fi.fileno()).st_size, 0
                while done < n:
                    done += os.copy_file_range(fi.fileno(), fo.fileno(), n - done)
            continue
        with open(f, "rb", buffering=0) as fi, open(dst / f.name, "wb", buffering=0) as fo:
            if kind == "copy":
                while chunk := fi.read(16 * 2**20):
                    fo.write(chunk)
            elif kind == "bcopy":
                while n := fi.readinto(buf):
                    fo.write(buf[:n])
            else:
                h = new_hash()
                while n := fi.readinto(buf):
                    th = threading.Thread(target=h.update, args=(buf[:n],))
                    th.start()
                    fo.write(buf[:n])
                    th.join()
                h.hexdigest()


def peak_rss():
    with open("/proc/self/status") as f:  # VmHWM: this process's high-water mark since the last reset
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:"))


out["peak_rss_bytes"] = {}
for name, args in jobs:
    kind = next((k for k in COPIES if name.startswith(k)), None)
    dst = Path(args[1] if kind else args[args.index("-o") + 1])
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    if name.endswith("_cold"):  # the job's input out of the page cache (clean after the sync, so evictable)
        src = Path(args[0] if kind else args[args.index("-m") + 1])
        for f in src.rglob("*"):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    t = time.perf_counter()
    if kind:
        copy(kind, Path(args[0]), dst)
        out[name] = time.perf_counter() - t
        shutil.rmtree(dst)
        continue
    try:
        main(args + extra)
    except SystemExit as e:
        assert not e.code, (name, e.code)
    out[name] = time.perf_counter() - t
    out["peak_rss_bytes"][name] = peak_rss()
if mode == "ray":
    ray.shutdown()
out["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
print("@@" + json.dumps(out))
"""


def filesystem(path: Path) -> str:
    """The file system type `path` is on (/proc/mounts, longest mount point): copy_file_range clones on xfs/btrfs."""
    best, kind = "", "unknown"
    with open("/proc/mounts") as f:
        for line in f:
            mnt, fs = line.split()[1:3]
            if str(path.resolve()).startswith(mnt.rstrip("/") + "/") and len(mnt) > len(best):
                best, kind = mnt, fs
    return kind


def run_cli_jobs(mode: str, workers: int, jobs: list) -> dict[str, float]:
    """Run `jobs` ([label, argv] pairs; labels starting with "copy" / "bcopy" / "hcopy" / "kcopy" / "cp" are copy
    anchors [src_dir, dst_dir]) in one child with
    `--workers workers` (and `--executor ray` for mode "ray"); each label's seconds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, "-c", RUNNER, mode, str(workers), json.dumps(jobs)], capture_output=True,
                       text=True, env=env, cwd=str(ROOT))
    if p.returncode:
        raise RuntimeError(f"runner {mode} {workers} failed:\n{p.stderr[-3000:]}")
    return json.loads(next(x for x in p.stdout.splitlines() if x.startswith("@@"))[2:])
