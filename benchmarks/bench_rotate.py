"""What rotation costs (dsconv/quant/rotate.py): `dsconv rotate` of the real Qwen2.5-Coder-0.5B fixture (wall time and
peak RSS of a child process, against a plain `cp` of the same weights), and the fast Hadamard transform of one
DeepSeek-V3 expert matrix (2048 x 7168) against the dense product, from which the whole of DeepSeek-R1 is estimated.

Needs the fixture (`python -m benchmarks.real_models qwen2.5-coder-0.5b`); without it only the matrix figures run.
"""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.common import CHILD_PEAK, run_measured, save, scratch

ROTATE = CHILD_PEAK + """
import sys, json, time
from pathlib import Path
from dsconv.quant.rotate import RotateRequest, run
t = time.perf_counter()
r = run(RotateRequest(Path(sys.argv[1]), Path(sys.argv[2]), progress=False))
print(json.dumps({**r.summary, "peak_rss_bytes": peak_rss_bytes(), "in_process_s": time.perf_counter() - t}))
"""


def _matrix(width: int = 7168, rows: int = 2048) -> dict[str, Any]:
    import torch

    from dsconv.quant.algorithms.hadamard import Rotation

    torch.set_num_threads(1)
    r = Rotation(width, seed=0)
    x = torch.randn(rows, width)
    best = min(_timed(lambda: r.right(x)) for _ in range(3))
    q = r.matrix()
    dense = min(_timed(lambda: x @ q) for _ in range(3))
    # DeepSeek-R1: 58 MoE layers x 256 experts x 3 matrices of 2048 x 7168 (gate/up read, down written), + 3 dense
    # layers' and the shared experts' and attention's, which are < 2% of the rows
    experts = 58 * 256 * 3
    return {"width": width, "rows": rows, "kind": r.kind, "fast_s": round(best, 3), "dense_s": round(dense, 3),
            "deepseek_r1_expert_matrices": experts, "deepseek_r1_estimate_h_one_core": round(experts * best / 3600, 1)}


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def main() -> None:
    from benchmarks.bench_fidelity import fixture_dir

    figures: dict[str, Any] = {"matrix": _matrix()}
    src = fixture_dir("qwen")
    if (src / "config.json").is_file():
        work = scratch("dsconv-bench-rotate-")
        try:
            out = run_measured(ROTATE, str(src), str(work / "rot"))
            t = time.perf_counter()
            subprocess.run(["cp", "-r", str(src), str(work / "copy")], check=True)
            cp = time.perf_counter() - t
            figures["qwen2.5-coder-0.5b"] = {"wall_s": round(out["wall_s"], 2), "in_process_s": round(
                out["in_process_s"], 2), "peak_rss_mib": round(out["peak_rss_bytes"] / 2**20), "cp_s": round(cp, 2),
                "tensors": out["tensors"], "rotation": out["rotation"], "untied": out["untied"]}
        finally:
            shutil.rmtree(work, ignore_errors=True)
    save("rotate", figures)


if __name__ == "__main__":
    main()
