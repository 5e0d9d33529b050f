"""Shard figures.

1. Planning the full DeepSeek-V3 (91,991 tensors) with `--ep 8 --tp 4`: from config.json alone and from the headers
   of a sparse 163-file checkpoint, in a fresh process (imports included), split into phases; then the CLI's
   `shard --dry-run` end to end (MindIE format, the default), best of 3 with its peak RSS: goal <= 2 s, <= 300 MB.
2. Weight bytes per card for `--ep 8 --tp 4` on 32 x 64 GB in FP8 (the published checkpoint), W8A8 (msModelSlim
   W8A8_DYNAMIC layout synthesised from the BF16 list: int8 weight + fp32 per-channel scale and offset) and BF16,
   against the reference's 24.9 / 48.5 GiB; the difference is itemised.
3. Writing: a ~1.3 GB synthetic DeepSeek-architecture checkpoint sharded `--ep 4 --tp 2` (8 ranks, the default
   MindIE layout) with `--workers 1` and the default worker count, against a user-space copy of the same files right
   before each run, with the driver's peak RSS and the largest tensor for scale; then `dsconv verify` of the output.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.cli_runner import ROOT, filesystem, run_cli_jobs
from benchmarks.common import run_measured, save, scratch

CONFIG = Path(__file__).resolve().parent.parent / "tests" / "data" / "deepseek_v3_config.json"
GiB = 2**30

# The child's own high-water mark. Not ru_maxrss: Linux carries ru_maxrss across exec, so a child forked from a
# parent holding 700 MB would report at least that (benchmarks.common.CHILD_PEAK has this flaw).
CHILD_PEAK = """
import json
def peak_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0
"""


# ------------------------------------------------------------------------------------------------ 1. planning
PLAN_CHILD = CHILD_PEAK + """
import sys, time
t0 = time.perf_counter()
from dsconv.checkpoint import Checkpoint, ConfigOnly
from dsconv.shard import plan as P
from dsconv.shard.layout import make_layout
from dsconv.shard.memory import FitSettings
from dsconv.shard.placement import iter_tensor_ranks
from dsconv.shard.table import build_table
from pathlib import Path
t_import = time.perf_counter() - t0
t = time.perf_counter()
src = ConfigOnly.open(Path(sys.argv[1])) if sys.argv[2] == "config" else Checkpoint.open(sys.argv[1])
t_open = time.perf_counter() - t
t = time.perf_counter()
table = build_table(src)
t_table = time.perf_counter() - t
t = time.perf_counter()
lay = make_layout(8, 4, is_moe=True)
opts = P.ShardOptions(fit=FitSettings("Ascend910B3", 64 * 2**30), num_groups=8)
plan = P.make_plan(table, lay, opts)
t_plan = time.perf_counter() - t
t = time.perf_counter()
alts = P.find_alternatives(table, lay, opts)
t_alts = time.perf_counter() - t
t = time.perf_counter()
n = sum(1 for _ in iter_tensor_ranks(table, plan.ev, plan.owners()))
t_materialise = time.perf_counter() - t
print(json.dumps({"tensors": len(table), "kinds": len(table.kinds), "import_s": t_import, "open_s": t_open,
                  "table_s": t_table, "plan_s": t_plan, "alternatives_s": t_alts, "alternatives": len(alts),
                  "materialise_s": t_materialise, "total_s": time.perf_counter() - t0, "ok": plan.ok,
                  "dry_run_path_s": t_import + t_open + t_table + t_plan,
                  "peak_rss_bytes": peak_rss_bytes()}))
"""


def bench_planning() -> dict:
    from benchmarks.bench_foundation import write_sparse_deepseek

    out = {}
    r = min((run_measured(PLAN_CHILD, str(CONFIG), "config") for _ in range(3)), key=lambda x: x["dry_run_path_s"])
    out["from_config"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
    root = scratch("dsconv-ds-sparse-")
    try:
        write_sparse_deepseek(root)
        r = min((run_measured(PLAN_CHILD, str(root), "headers") for _ in range(3)),
                key=lambda x: x["dry_run_path_s"])
        out["from_headers_163_files"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
        for label, args in (("config", ["--config", str(CONFIG)]), ("headers", ["-m", str(root), "--dry-run"])):
            runs = [cli_dry_run(args) for _ in range(3)]  # the CLI end to end: process start, click, plan, JSON
            out[f"cli_dry_run_from_{label}_s"] = round(min(r["wall_s"] for r in runs), 3)
            if label == "headers":
                out["cli_dry_run_from_headers"] = dry_run_figures(runs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


DRY_RUN_GOAL_S, DRY_RUN_GOAL_MIB = 2.0, 300  # issue #25 point 4: `shard --dry-run --ep 8 --tp 4` of DeepSeek-V3
# `python -m dsconv` with the process's own peak (VmHWM) reported at exit, after the CLI's sys.exit
CLI_CHILD = """
import atexit, os, sys
def _peak():
    with open("/proc/self/status") as f:
        hwm = next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:"))
    os.write(2, ("\\n@@peak_rss_bytes %d\\n" % hwm).encode())
atexit.register(_peak)
from dsconv.cli import main
main(sys.argv[1:])
"""


def cli_dry_run(args: list[str]) -> dict[str, Any]:
    """One `dsconv shard ARGS --ep 8 --tp 4 --json` in a fresh process: wall time (process start included), the
    process's peak RSS, CPU time (user + sys, which the load of a shared machine inflates less than the wall time),
    and the load average before it."""
    load = os.getloadavg()[0]
    before = os.times()
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CLI_CHILD, "shard", *args, "--ep", "8", "--tp", "4", "--json"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t
    after = os.times()
    assert p.returncode == 0, p.stderr
    peak = int(next(x for x in p.stderr.splitlines() if x.startswith("@@peak_rss_bytes")).split()[1])
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_bytes": peak, "load_before": load}


def dry_run_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    best = min(runs, key=lambda r: r["wall_s"])
    peak = max(r["peak_rss_bytes"] for r in runs) / 2**20
    return {"wall_s_best_of_3": round(best["wall_s"], 3), "wall_s_runs": [round(r["wall_s"], 3) for r in runs],
            "cpu_s_runs": [round(r["cpu_s"], 3) for r in runs], "peak_rss_mib": round(peak, 1),
            "load_avg_1min_before_runs": [round(r["load_before"], 2) for r in runs],
            "goal_wall_s": DRY_RUN_GOAL_S, "goal_peak_rss_mib": DRY_RUN_GOAL_MIB,
            "meets_wall_goal": best["wall_s"] <= DRY_RUN_GOAL_S, "meets_rss_goal": peak <= DRY_RUN_GOAL_MIB}


# ------------------------------------------------------------------------------------------------ 2. bytes per card
class SpecSource:
    """A headers-only source from (name, dtype, shape) triples (what a W8A8 output of the full model would list)."""

    def __init__(self, config: dict, specs: list, quant: dict | None) -> None:
        from dsconv.families import family_for
        from dsconv.io.tensorfile import TensorInfo

        self.config, self.family = config, family_for(config)
        self.facts = self.family.facts(config)
        self.quant_description = quant
        self.root = Path(".")
        self.tensors = {n: TensorInfo(n, d, tuple(s), Path("x"), 0, math.prod(s) * _size(d), n) for n, d, s in specs}
        self.roles = {n: self.family.classify(n, self.facts) for n in self.tensors}


def _size(dtype: str) -> int:
    from dsconv.tensors import DTYPE_SIZES

    return DTYPE_SIZES[dtype]


def w8a8_specs(config: dict) -> list:
    """msModelSlim W8A8_DYNAMIC of DeepSeek-V3: every default-quantized linear int8 + [n,1] fp32 scale and offset;
    embeddings, head, norms, routers and the MTP eh_proj stay BF16 (FLOAT)."""
    from dsconv.families import family_for

    fam = family_for(config)
    facts = fam.facts(config)
    out = []
    for s in fam.synthesize(config):
        r = fam.classify(s.name, facts)
        if r.role.quantized_by_default and r.param == "weight":
            p = r.module
            out += [(p + ".weight", "I8", s.shape), (p + ".weight_scale", "F32", (s.shape[0], 1)),
                    (p + ".weight_offset", "F32", (s.shape[0], 1))]
        else:
            out.append((s.name, s.dtype, s.shape))
    return out


def bench_per_card() -> dict:
    from dsconv.checkpoint import ConfigOnly
    from dsconv.shard import plan as P
    from dsconv.shard.layout import make_layout
    from dsconv.shard.memory import FitSettings
    from dsconv.shard.table import build_table

    cfg = json.loads(CONFIG.read_text())
    bf16_cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    root = scratch("dsconv-cfg-")
    try:
        (root / "config.json").write_text(json.dumps(bf16_cfg))
        sources = {"FP8 (published checkpoint)": ConfigOnly.open(CONFIG),
                   "W8A8_DYNAMIC (msModelSlim layout)": SpecSource(bf16_cfg, w8a8_specs(bf16_cfg),
                                                                   {"model_quant_type": "W8A8_DYNAMIC"}),
                   "BF16": ConfigOnly.open(root / "config.json")}
        reference = {"FP8 (published checkpoint)": 24.9, "W8A8_DYNAMIC (msModelSlim layout)": 24.9, "BF16": 48.5}
        mtp_copies = 2 * 129280 * 7168 * 2 / 4 / GiB  # MTP's own embed_tokens + shared_head.head, split by tp 4
        out = {}
        for label, src in sources.items():
            table = build_table(src)
            plan = P.make_plan(table, make_layout(8, 4, is_moe=True),
                               P.ShardOptions(fit=FitSettings("Ascend910B3", 64 * GiB), num_groups=8))
            card = plan.rank_bytes.max() / GiB
            experts = (plan.rank_bytes.max() - plan.ev.common_bytes) / GiB
            out[label] = {"per_card_gib": round(card, 3), "routed_experts_gib": round(experts, 3),
                          "other_gib": round(card - experts, 3),
                          "by_category_gib": {k: round(v / GiB, 3) for k, v in plan.ev.common_by_category.items()},
                          "mtp_embed_and_head_copies_gib": round(mtp_copies, 3),
                          "per_card_without_mtp_copies_gib": round(card - mtp_copies, 3),
                          "reference_gib": reference[label], "fits_64gb_x0.8": bool(plan.fit.ok),
                          "kv_tokens_per_card": plan.fit.min_kv_tokens, "max_over_mean": 1 + plan.balance.imbalance}
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ 3. writing
SYNTH = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 32000,
         "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408, "num_hidden_layers": 4,
         "num_nextn_predict_layers": 0, "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 1,
         "n_routed_experts": 16, "kv_lora_rank": 256, "q_lora_rank": 512, "qk_rope_head_dim": 64, "v_head_dim": 128,
         "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4,
         "moe_layer_freq": 1, "first_k_dense_replace": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
         "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000}


def write_synthetic(root: Path, config: dict[str, Any] = SYNTH, normal: bool = False) -> tuple[int, int]:
    """A BF16 checkpoint of `config` through dsconv's writer (500 MB parts + index): random bytes (sharding copies
    them), or with `normal` bf16 of float32 normals x 0.02, never NaN/Inf (for stages that compute on them)."""
    import numpy as np
    import torch

    from dsconv.families import family_for
    from dsconv.io.writer import OutputDir

    specs = family_for(config).synthesize(config)
    rng = np.random.default_rng(0)
    with OutputDir(root, stage="bench", force=True) as out:
        ts = out.tensor_set(specs, prefix="model", max_shard_size=500 * 10**6)
        for s in specs:
            if s.dtype == "BF16" and normal:
                x = torch.from_numpy(rng.standard_normal(math.prod(s.shape), dtype=np.float32) * 0.02)
                ts.write(s.name, x.to(torch.bfloat16).reshape(s.shape))
            elif s.dtype == "BF16":
                bits = rng.integers(0, 2**16, size=math.prod(s.shape), dtype=np.uint16).view(np.int16)
                ts.write(s.name, torch.from_numpy(bits).view(torch.bfloat16).reshape(s.shape))
            else:
                ts.write(s.name, rng.random(s.shape, dtype=np.float32))
        out.write_json("config.json", config)
    return sum(s.nbytes for s in specs), max(s.nbytes for s in specs)


VERIFY_CHILD = CHILD_PEAK + """
import sys, time
from pathlib import Path
from dsconv.stages import verify
import dsconv.shard.stage
t = time.perf_counter()
_, problems = verify(Path(sys.argv[1]))
print(json.dumps({"verify_s": time.perf_counter() - t, "problems": len(problems), "peak_rss_bytes": peak_rss_bytes()}))
"""


# the stronger anchors beside the simplest one (a new 16 MiB block per read): benchmarks.cli_runner.RUNNER's copy()
ROUNDS = (1, 2, 3)  # interleaved (anchors, shard) rounds, best of each: this VM's I/O varies 2-20x between runs
ANCHORS = {"bcopy": "reused_buffer_copy", "hcopy": "reused_buffer_copy_with_digest",
           "kcopy": "copy_file_range_copy"}


def bench_write() -> dict:
    """`dsconv shard --ep 4 --tp 2` (the default, MindIE layout) with `--workers 1` and the default (the CPU count),
    each timed three times beside copies of the same files right before it (benchmarks.cli_runner: one warm
    process per worker count, synced page cache and absent output before each timed run, best of three). The
    first shard run of each process is timed apart: it pays torch's import in the worker pool's start-up."""
    root = scratch("dsconv-shard-w-")
    try:
        src = root / "src"
        # normal values: random bits hold NaNs whose payloads a float cast (MindIE's router transform) does not keep,
        # so verify would report the bench's own data as differing (3 routers did)
        total, largest = write_synthetic(src, normal=True)
        for f in sorted(src.glob("*.safetensors")):
            f.read_bytes()  # page cache warm for every run alike
        shard = ["shard", "-m", str(src), "-o", str(root / "out"), "--ep", "4", "--tp", "2"]
        copy = [str(src), str(root / "copy")]
        jobs = [["first", shard], *[[f"{k}{i}", copy if k != "shard" else shard] for i in ROUNDS
                                    for k in ("copy", "bcopy", "hcopy", "kcopy", "shard")]]
        out: dict[str, Any] = {"source_gb": round(total / 1e9, 3), "largest_tensor_mib": round(largest / 2**20, 1)}
        written = 0
        for label, workers in (("workers_1", 1), ("workers_default", os.cpu_count() or 1)):
            r = run_cli_jobs("local", workers, jobs)
            written = sum(p.stat().st_size for p in (root / "out").rglob("*.safetensors"))
            best = {k: min(r[f"{k}{i}"] for i in ROUNDS) for k in ("copy", "bcopy", "hcopy", "kcopy", "shard")}
            copy_s, shard_s = best["copy"], best["shard"]
            out[label] = {"workers": workers, "startup_s": round(r["startup_s"], 2),
                          "first_run_s": round(r["first"], 2), "shard_s": round(shard_s, 2),
                          "userspace_copy_s": round(copy_s, 2),
                          "userspace_copy_gbps": round(total / copy_s / 1e9, 3),
                          "shard_write_gbps": round(written / shard_s / 1e9, 3),
                          "shard_vs_userspace_copy_write_ratio": round(written / shard_s / (total / copy_s), 2),
                          "first_run_vs_copy_write_ratio": round(written / r["first"] / (total / copy_s), 2),
                          **{f"{label}_gbps": round(total / best[k] / 1e9, 3) for k, label in ANCHORS.items()},
                          **{f"shard_vs_{label}_write_ratio": round(written / shard_s / (total / best[k]), 2)
                             for k, label in ANCHORS.items()},
                          "driver_peak_rss_mib": round(max(r["peak_rss_bytes"][f"shard{i}"] for i in ROUNDS)
                                                       / 2**20, 1),
                          "load_after": r["load_after"]}
        out["shard_written_gb"] = round(written / 1e9, 3)
        out["filesystem"] = filesystem(root)
        out["driver_peak_rss_note"] = "the driver only, during the timed shard runs; --workers 1 runs inline in it"
        v = run_measured(VERIFY_CHILD, str(root / "out"))
        out.update({"verify_s": round(v["verify_s"], 2), "verify_problems": v["problems"],
                    "verify_peak_rss_mib": round(v["peak_rss_bytes"] / 2**20, 1)})
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    if sys.argv[1:] == ["planning"]:  # `python -m benchmarks.bench_shard planning`: the planning figures alone
        save("shard_planning", {"planning_deepseek_v3": bench_planning()})
        return
    figures = {"planning_deepseek_v3": bench_planning(), "per_card_ep8_tp4_32x64GB": bench_per_card(),
               "write_ep4_tp2": bench_write()}
    save("shard", figures)


if __name__ == "__main__":
    main()
