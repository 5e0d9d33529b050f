"""Scale-out figures, each beside its anchor from the same run.

1. A synthetic DeepSeek-architecture BF16 checkpoint of ~2.5 GB (random normals): a plain user-space copy of its
   files (read + write in 16 MiB blocks; again right before each shard run, best of two pairs), then
   `quantize --scheme w8a16 --engine vllm-ascend --moe-scheme w8a8_dynamic`, `shard --ep 4 --tp 2 --format ranks`
   and the default `shard --ep 4 --tp 2` (MindIE layout) with `--workers 1`, `--workers 2` (local processes) and
   `--executor ray` on a local Ray with 2 CPUs (started once, its start-up reported apart), in one warm process
   each (benchmarks.cli_runner; a first quantize run, timed apart, starts the worker pools' forkserver). Speedups
   are against `--workers 1`; shard throughput (bytes written per second) is against the user-space copy at the
   start of the same pair.
2. The calibrated `quantize --bits 8` of a medium DeepSeek-shaped MoE model with `--workers 1` and `--workers 2`
   (wall time, the jobs' speedup, the calibration forward's split over its batches - forward wall with 1 and 2
   workers -, per-layer and per-expert cost, whether the outputs are byte-identical), and from
   those costs and that parallel split a projection of the FULL DeepSeek-V3 W8A8 job on 1, 8 and 32 nodes, scaled by
   FLOPs and bytes to the real shapes (61 layers, 256 experts, hidden 7168, moe_intermediate 2048); the model and its
   assumptions are printed with it (benchmarks/projection.py).

`python -m benchmarks scale` (`DSCONV_BENCH_DIR` chooses the scratch disk); `python -m benchmarks.bench_scale fanout`
or `memory` runs one part and merges it into the last scale.json.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from benchmarks import bench_shard, worker_memory
from benchmarks.bench_quantize import QUANTIZE_ARGS
from benchmarks.cli_runner import run_cli_jobs
from benchmarks.common import merge, save, scratch

ROOT = Path(__file__).resolve().parent.parent
SYNTH = {**bench_shard.SYNTH, "num_hidden_layers": 8}  # 2.5 GB


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ------------------------------------------------------------------------------------------------ 1. fan-out
def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*.safetensors"))


def bench_fanout() -> dict[str, Any]:
    root = scratch("dsconv-scale-")
    try:
        src = root / "src"
        total, largest = bench_shard.write_synthetic(src, SYNTH, normal=True)
        for f in sorted(src.glob("*.safetensors")):
            f.read_bytes()  # page cache warm for every run alike
        # (the weight-only recipe both engines take for DeepSeek: MindIE refuses W8A16 shared experts, vLLM-Ascend
        # has no W8A16 MoE method; bench_quantize's memory pairs run the same)
        quantize = ["quantize", "-m", str(src), "-o", str(root / "q"), *QUANTIZE_ARGS]
        jobs = [["first", quantize], ["quantize", quantize],  # the first pays the pool's start-up: timed apart
                *[job for i in (1, 2) for job in (  # two (anchor, shard) pairs: the best of each, load is noisy
                    [f"copy{i}", [str(src), str(root / "copy")]],
                    [f"shard{i}", ["shard", "-m", str(src), "-o", str(root / "sh"), "--ep", "4", "--tp", "2",
                                   "--format", "ranks"]],
                    [f"mindie{i}", ["shard", "-m", str(src), "-o", str(root / "shm"), "--ep", "4", "--tp", "2"]])]]
        runs = {}
        for label, mode, w in (("workers_1", "local", 1), ("workers_2", "local", 2), ("ray_2", "ray", 2)):
            load = _load()
            r = run_cli_jobs(mode, w, jobs)
            r["load_before"] = load
            r["copy"], r["shard"] = min(r["copy1"], r["copy2"]), min(r["shard1"], r["shard2"])
            r["mindie"] = min(r["mindie1"], r["mindie2"])
            runs[label] = r
        q_out, sh_out, shm_out = _dir_bytes(root / "q"), _dir_bytes(root / "sh"), _dir_bytes(root / "shm")
        shutil.rmtree(root / "shm", ignore_errors=True)
        shutil.rmtree(root / "q", ignore_errors=True)
        shutil.rmtree(root / "sh", ignore_errors=True)
        memory = worker_memory.measure(src, root)
        base = runs["workers_1"]
        res: dict[str, Any] = {
            "source_gb": round(total / 1e9, 3), "largest_tensor_mib": round(largest / 2**20, 1),
            "userspace_copy_s": round(base["copy"], 2), "userspace_copy_gbps": round(total / base["copy"] / 1e9, 3),
            "quantize_out_gb": round(q_out / 1e9, 3), "shard_out_gb": round(sh_out / 1e9, 3),
            "mindie_shard_out_gb": round(shm_out / 1e9, 3)}
        for label, r in runs.items():
            res[label] = {
                "quantize_s": round(r["quantize"], 2), "quantize_speedup": round(base["quantize"] / r["quantize"], 2),
                "first_quantize_s": round(r["first"], 2),
                "quantize_vs_copy_by_input": round(total / r["quantize"] / (total / r["copy"]), 2),
                "load_after": r["load_after"],
                "shard_s": round(r["shard"], 2), "shard_speedup": round(base["shard"] / r["shard"], 2),
                "shard_write_gbps": round(sh_out / r["shard"] / 1e9, 3),
                "userspace_copy_gbps_just_before": round(total / r["copy"] / 1e9, 3),
                "shard_vs_userspace_copy": round(sh_out / r["shard"] / (total / r["copy"]), 2),
                "mindie_shard_s": round(r["mindie"], 2), "mindie_shard_speedup": round(base["mindie"] / r["mindie"], 2),
                "mindie_shard_write_gbps": round(shm_out / r["mindie"] / 1e9, 3),
                "mindie_shard_vs_userspace_copy": round(shm_out / r["mindie"] / (total / r["copy"]), 2),
                "load_before": r["load_before"], **({"ray_start_s": round(r["ray_start_s"], 1)}
                                                    if "ray_start_s" in r else {})}
        res["worker_memory"] = memory
        return res
    finally:
        shutil.rmtree(root, ignore_errors=True)


def bench_memory_only(code: Path) -> dict[str, Any]:
    """The worker-memory part alone (`python -m benchmarks.bench_scale memory [--code DIR]`)."""
    root = scratch("dsconv-scale-mem-")
    try:
        src = root / "src"
        bench_shard.write_synthetic(src, SYNTH, normal=True)
        return worker_memory.measure(src, root, code=code)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ 2. projection
from benchmarks.projection import measure_costs, project  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["memory"]:  # worker memory alone, merged into the last scale.json
        code = Path(argv[argv.index("--code") + 1]) if "--code" in argv else ROOT
        print(f"load average before: {_load()}", flush=True)
        mem = bench_memory_only(code)
        merge("scale", "worker_memory" if code == ROOT else "worker_memory_of_" + code.name,
              {**mem, "load_after": _load()})
        return
    if argv[:1] == ["fanout"]:  # the fan-out alone, merged into the last scale.json
        print(f"load average before: {_load()}", flush=True)
        merge("scale", "fanout_2p5gb_deepseek_shaped", bench_fanout())
        return
    print(f"load average before: {_load()}", flush=True)
    fan = bench_fanout()
    print(json.dumps(fan, indent=2), flush=True)
    costs = measure_costs()
    io_s_per_gb = fan["workers_1"]["quantize_s"] / fan["source_gb"]
    proj = project(costs, io_s_per_gb)
    print(proj["text"], flush=True)
    save("scale", {"load_before": _load(), "fanout_2p5gb_deepseek_shaped": fan, "measured_costs": costs,
                   "projection_deepseek_v3": {k: v for k, v in proj.items() if k != "text"},
                   "projection_text": proj["text"].splitlines()})


if __name__ == "__main__":
    main()
