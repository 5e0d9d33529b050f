"""Worker memory: peak RSS of the whole process tree - the driver AND its pool workers - for the jobs that
fan out, beside the `--workers 1` figure of the same job in the same run.

`peak_rss_bytes` in a stage's summary is the driver's alone; with `--workers 2` the tensors are held by the pool's
workers, so a driver figure says nothing about what the host needs. Each run here is a `dsconv` CLI child whose tree
is sampled (benchmarks/common.run_tree_sampled): the driver's peak, the largest worker's peak, and the peak of the
tree's summed PSS (what the host holds, shared pages counted once). Jobs:
  * `quantize --scheme w8a16` (round to nearest, per-part jobs) on bench_scale's 2.5 GB DeepSeek-shaped BF16
    checkpoint;
  * `export --format safetensors` (FP8 -> BF16, per-part cast jobs) on a 2-layer DeepSeek-V3-shaped FP8 checkpoint
    of ~2.1 GB (bench_export.write_synthetic_fp8: 7168 x 18432 FP8 MLP weights of 132 MB, a 0.46 GB bf16 embedding).
`python -m benchmarks.bench_scale memory [--code DIR]` runs this part alone (`--code`: another checkout's dsconv, for
a before/after pair on the same inputs).
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import run_tree_sampled

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9


def _row(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if k != "stdout"}


def _text(label: str, r: dict[str, Any]) -> str:
    return (f"driver {r['driver_peak_rss_bytes'] / GB:.2f} GB, largest worker "
            f"{r['largest_worker_peak_rss_bytes'] / GB:.2f} GB ({r['workers_seen']} seen), tree PSS "
            f"{r['tree_peak_pss_bytes'] / GB:.2f} GB, {r['wall_s']:.1f} s")


def measure(bf16_src: Path, work: Path, code: Path = ROOT, fp8_layers: int = 2) -> dict[str, Any]:
    """Tree peaks of quantize and the FP8 cast with --workers 1 and 2 (scratch under `work`, removed after)."""
    from benchmarks.bench_export import SYNTH, write_synthetic_fp8

    env = {**os.environ, "PYTHONPATH": str(code), "TOKENIZERS_PARALLELISM": "false"}
    fp8_src = work / "fp8"
    info = write_synthetic_fp8(fp8_src, {**SYNTH, "num_hidden_layers": fp8_layers,
                                         "first_k_dense_replace": fp8_layers})
    from benchmarks.bench_quantize import QUANTIZE_ARGS  # the weight-only recipe both engines take for DeepSeek

    jobs = {"quantize_w8a16": ["quantize", "-m", str(bf16_src), "-o", str(work / "out"), *QUANTIZE_ARGS],
            "fp8_to_bf16": ["export", "--format", "safetensors", "-m", str(fp8_src), "-o", str(work / "out")]}
    out: dict[str, Any] = {"code": str(code), "fp8_checkpoint": info,
                           "bf16_checkpoint_gb": round(sum(p.stat().st_size for p in bf16_src.glob("*.safetensors"))
                                                       / GB, 3)}
    try:
        for job, args in jobs.items():
            rows = {}
            for workers in (1, 2):
                load = " ".join(f"{x:.2f}" for x in os.getloadavg())
                r = run_tree_sampled([sys.executable, "-m", "dsconv", *args, "--workers", str(workers), "--force"],
                                     env=env, cwd=str(code))  # cwd first on sys.path for -m
                shutil.rmtree(work / "out", ignore_errors=True)
                rows[f"workers_{workers}"] = {**_row(r), "load_before": load}
                print(f"[worker memory] {job} --workers {workers}: {_text(job, r)}; load {load}", flush=True)
            one, two = rows["workers_1"], rows["workers_2"]
            rows["workers_2_worker_over_workers_1_driver"] = round(
                two["largest_worker_peak_rss_bytes"] / max(1, one["driver_peak_rss_bytes"]), 2)
            rows["workers_2_tree_pss_over_workers_1_tree_pss"] = round(
                two["tree_peak_pss_bytes"] / max(1, one["tree_peak_pss_bytes"]), 2)
            print(f"  => {job}: --workers 2 largest worker {two['largest_worker_peak_rss_bytes'] / GB:.2f} GB, whole "
                  f"tree {two['tree_peak_pss_bytes'] / GB:.2f} GB PSS, beside --workers 1 "
                  f"{one['driver_peak_rss_bytes'] / GB:.2f} GB (one process)", flush=True)
            out[job] = rows
    finally:
        shutil.rmtree(fp8_src, ignore_errors=True)
        shutil.rmtree(work / "out", ignore_errors=True)
    return out
