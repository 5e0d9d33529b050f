"""MindIR export figures: wall time (build / export / load / PyTorch reference) and peak RSS against model bytes,
from the tiny demo DeepSeek-V3 to a 0.6B-parameter Llama (1.24 GB in fp32: above MindSpore's ~1 GiB split into
model_graph.mindir + model_variables/, and above ISOLATE_ABOVE_BYTES, so MindSpore runs in child processes).

Each export runs in its own process (`run_measured`) from bf16 checkpoints (how models ship); the peak RSS figure
is the export's own (the largest of the dsconv process and its MindSpore children). Set DSCONV_BENCH_DIR to put
the models on a large disk; `python -m benchmarks mindir`.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from benchmarks.common import run_measured, save, scratch

# name -> (family, config overrides); all saved in bf16
MODELS = {
    "tiny-deepseek_v3": ("deepseek_v3", {}),
    "llama-56M": ("llama", dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                num_attention_heads=8, num_key_value_heads=4)),
    "qwen2_moe-94M": ("qwen2_moe", dict(vocab_size=32000, hidden_size=512, intermediate_size=1376,
                                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=512,
                                        shared_expert_intermediate_size=1024,
                                        layer_types=["full_attention"] * 4)),  # set after the config is built
    "llama-0.6B": ("llama", dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=26,
                                 num_attention_heads=16, num_key_value_heads=8)),
}
RUNS = [("tiny-deepseek_v3", "fp32"), ("llama-56M", "fp32"), ("llama-56M", "bf16"), ("llama-56M", "fp16"),
        ("qwen2_moe-94M", "fp32"), ("llama-0.6B", "bf16"), ("llama-0.6B", "fp32")]

CHILD = """
import json, sys, time
from pathlib import Path
from dsconv.convert.mindir import export_mindir
t = time.perf_counter()
s = export_mindir(Path(sys.argv[1]), Path(sys.argv[2]), dtype=sys.argv[3], force=True)
c = s["check"]
print(json.dumps({"wall_in_process_s": time.perf_counter() - t, "seconds": s["seconds"],
                  "input_bytes": s["input_bytes"], "mindir_bytes": s["mindir_bytes"], "files": sorted(s["files"]),
                  "parameter_bytes": s["parameter_bytes"], "peak_rss_bytes_export": s["peak_rss_bytes"],
                  "peak_rss_by_step": s["peak_rss_by_step"],
                  "child_processes": s["mindspore_in_child_process"], "max_abs_err": c["max_abs_err"],
                  "tolerance_min": min(x["tolerance"] for x in c["shapes"]),
                  "max_abs_err_vs_unrounded": c.get("max_abs_err_vs_unrounded"),
                  "ref_max_abs": max(x["ref_max_abs"] for x in c["shapes"]),
                  "top1_agreement_min": min(x["top1_agreement"] for x in c["shapes"]),
                  "experts_hit": c.get("experts_hit")}))
"""


MAKE = """
import json, sys
from pathlib import Path
from dsconv.tiny import make_tiny
family, overrides = sys.argv[2], json.loads(sys.argv[3])
make_tiny(family, Path(sys.argv[1]), dtype="bf16", **overrides)
"""


def make_models(root: Path) -> dict[str, Path]:
    """Each model is built by transformers in its own process: this one stays small, so the export children it
    starts do not begin life with a large inherited high-water mark."""
    import json
    import subprocess
    import sys

    out = {}
    for name, (family, overrides) in MODELS.items():
        d = root / name
        subprocess.run([sys.executable, "-c", MAKE, str(d), family, json.dumps(overrides)], check=True,
                       capture_output=True)
        out[name] = d
    return out


def main() -> None:
    root = scratch("dsconv-bench-mindir-")
    try:
        models = make_models(root)
        rows = []
        for name, dtype in RUNS:
            r = run_measured(CHILD, str(models[name]), str(root / "out" / f"{name}-{dtype}"), dtype)
            peak = r["peak_rss_bytes_export"]
            row = {"model": name, "dtype": dtype, **{k: v for k, v in r.items() if k != "peak_rss_bytes"},
                   "peak_rss_gib": round(peak / 2**30, 3),
                   "peak_rss_over_mindir_bytes": round(peak / r["mindir_bytes"], 2),
                   "mindir_mb_per_s": round(r["mindir_bytes"] / 1e6 / r["seconds"]["total"], 2)}
            rows.append(row)
            shutil.rmtree(root / "out" / f"{name}-{dtype}", ignore_errors=True)
            print(f"{name:>18} {dtype}: input {r['input_bytes'] / 1e6:8.1f} MB -> "
                  f"MindIR {r['mindir_bytes'] / 1e6:8.1f} MB "
                  f"({', '.join(r['files'][:3])}...), {r['seconds']['total']:.1f}s "
                  f"(build {r['seconds']['build']:.1f}, export {r['seconds']['export']:.1f}, load "
                  f"{r['seconds']['load']:.1f}, reference {r['seconds']['reference_and_compare']:.1f}), "
                  f"peak RSS {peak / 2**30:.2f} GiB = {row['peak_rss_over_mindir_bytes']}x MindIR, "
                  f"max |err| {r['max_abs_err']:.2g} (tolerance {r['tolerance_min']:.2g})", flush=True)
        baseline = rows[0]["peak_rss_gib"]  # the tiny model: the libraries' own size (torch, transformers, MindSpore)
        for row in rows:
            row["peak_rss_above_tiny_gib"] = round(row["peak_rss_gib"] - baseline, 3)
        save("mindir", {"runs": rows, "baseline_peak_rss_gib": baseline,
                        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
                        "note": "input = bf16 checkpoint bytes; peak RSS = VmHWM of the largest process of the export "
                                "(dsconv, or its MindSpore children above 256 MiB of input); the tiny model's peak "
                                "is the fixed cost of the libraries"})
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
