"""What `quantize --kv-cache int8` adds to calibration at full-model sizes, per forward batch and layer, and what it
buys in `shard`'s KV budget.

    python -m benchmarks kv_cache

* FA quant (DeepSeek-V3/R1 MLA: 128 heads, qk_nope 128, rope 64, latent 512) on one batch of 4096 tokens: the
  absorbed query's per-head recall windows (two top-k per head, 16 heads at a time) and the latent's; seconds and
  the process's peak RSS (measured in a child, so the figure is this work's alone).
* C8 (Qwen3-32B attention: 8 KV heads x 128) on the same batch: the cache stand-in's per-channel maxima.
* The KV tokens one 910B card holds for DeepSeek-R1 W4A8 on one 8-card node (EP 8 x TP 8, 32k context, the shard
  planner from the config alone): BF16 cache against FA quant's int8 latent.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.common import run_measured, save

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import json, resource, sys, time
import torch
from torch import nn
from dsconv.quant.calibrate.hooks import RowMask
from dsconv.quant.calibrate.kv_cache import FAStats, KVCacheStats
from dsconv.quant.plan.kv_cache import KVLayer

torch.manual_seed(0)
kind, T = sys.argv[1], 4096
rows = RowMask()
rows.set(torch.ones(1, T, dtype=torch.bool))
best = float("inf")
if kind == "fa":
    H, nope, rope, C = 128, 128, 64, 512
    q_b, kv_b = nn.Linear(8, H * (nope + rope), bias=False), nn.Linear(C, H * (nope + 128), bias=False)
    norm = nn.Identity()
    kv = KVLayer(3, "FAQuant", (("a.fa_q", H), ("a.fa_k", 1), ("a.fa_v", 1)), "a", "n.weight", ("q", "kvb", "n"))
    q, c = torch.randn(1, T, H * (nope + rope)), torch.randn(1, T, C)
    for _ in range(3):
        st = FAStats(kv, {"q": q_b, "kvb": kv_b, "n": norm}, rows, H, nope)
        t = time.perf_counter()
        st._query(q_b, (None,), q)
        st._latent(norm, (None,), c)
        best = min(best, time.perf_counter() - t)
else:
    k, v = torch.randn(1, 8, T, 128), torch.randn(1, 8, T, 128)
    for _ in range(3):
        st = KVCacheStats(rows)
        t = time.perf_counter()
        st.update(k, v, 0)
        best = min(best, time.perf_counter() - t)
print(json.dumps({"seconds_per_batch_layer": round(best, 4),
                  "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))
'''


def shard_kv(kv_bits: str) -> dict:
    """`dsconv shard --config <DeepSeek-V3> --scheme w4a8_dynamic` on one 8-card node at 32k: the memory block."""
    import subprocess

    r = subprocess.run([sys.executable, "-m", "dsconv", "shard", "--config",
                        str(ROOT / "tests" / "data" / "deepseek_v3_config.json"), "--scheme", "w4a8_dynamic",
                        "--ep", "8", "--tp", "8", "--world", "8", "--max-context", "32768", "--kv-bits", kv_bits,
                        "--engine", "vllm-ascend", "--json"], capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    m = json.loads(r.stdout)["memory"]
    return {"kv_bytes_per_token": m["kv_bytes_per_token"], "kv_tokens_per_card": m["min_kv_tokens"]}


def main() -> None:
    figures = {"batch_tokens": 4096,
               "fa_quant_deepseek_v3": run_measured(CHILD, "fa"),
               "c8_qwen3_32b": run_measured(CHILD, "c8"),
               "deepseek_r1_w4a8_one_node_32k": {"bf16_cache": shard_kv("16"), "int8_latent": shard_kv("8")}}
    save("kv_cache", figures)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
