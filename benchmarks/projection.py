"""The FULL DeepSeek-V3 W8A8 job (`quantize --bits 8`: static attention calibrated, MLP and routed experts dynamic)
projected on 1, 8 and 32 nodes from costs measured on this host (bench_scale part 2).

Measured here, on a medium DeepSeek-shaped model (random weights, the bundled calibration set):
  * c_fwd  - seconds per FLOP of the calibration forward outside the routed experts (attention, dense and shared MLP,
             router), from the Calibrator's `forward` timing;
  * c_exp  - seconds per FLOP of the routed-expert forward (`experts` timing);
  * c_q    - seconds per FLOP of quantizing the linears (`quantize` timing: smoothing and range searches measure
             output errors on the calibration rows, so it grows with tokens x parameters);
  * the rest of the run as a fixed cost; checkpoint I/O per byte from bench_scale's weight-only quantize.
Scaled to the real shapes (61 layers, 3 dense, 256 experts top-8, hidden 7168, moe_intermediate 2048, MLA) with the
same calibration tokens. The parallel scheme on N nodes (a node = this host) is printed with the figures.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import scratch

ROOT = Path(__file__).resolve().parent.parent
MEDIUM = dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, num_hidden_layers=3,
              first_k_dense_replace=1, n_routed_experts=32, num_experts_per_tok=8, n_group=4, topk_group=2,
              n_shared_experts=1, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=384, kv_lora_rank=256,
              qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, head_dim=32)
REAL = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
            first_k_dense_replace=3, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
            num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128, vocab_size=129280)
NET_GBPS = 12.5          # assumed driver NIC: 100 Gb/s
STORAGE_GBPS = 10.0      # assumed shared storage aggregate bandwidth
SEQ = 512                # calibration sequence length (the CLI default)

CHILD = """
import json, sys
from pathlib import Path
from dsconv.bundled import calib_texts
from dsconv.tiny import make_tiny, train_tokenizer
tok = train_tokenizer(calib_texts(), vocab_size=384)
make_tiny("deepseek_v3", Path(sys.argv[1]), dtype="bf16", tokenizer=tok, **json.loads(sys.argv[2]))
"""


def flops(c: dict[str, Any], tokens: int, seq: int) -> dict[str, float]:
    """Forward FLOPs (2 per multiply-add) of the calibration tokens: outside the routed experts, and in them."""
    h, H = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attn_params = (h * c["q_lora_rank"] + c["q_lora_rank"] * H * qk + h * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
                   + c["kv_lora_rank"] * H * (c["qk_nope_head_dim"] + c["v_head_dim"]) + H * c["v_head_dim"] * h)
    attn_scores = H * (qk + c["v_head_dim"]) * seq / 2  # causal: half the keys on average, per token
    dense = c["first_k_dense_replace"]
    moe = c["num_hidden_layers"] - dense
    mi = c["moe_intermediate_size"]
    other = (c["num_hidden_layers"] * (attn_params + attn_scores) + dense * 3 * h * c["intermediate_size"]
             + moe * (c["n_shared_experts"] * 3 * h * mi + h * c["n_routed_experts"]))
    experts = moe * c["num_experts_per_tok"] * 3 * h * mi
    return {"other": 2.0 * other * tokens, "experts": 2.0 * experts * tokens,
            "attn_params": attn_params, "moe_layers": moe, "dense_layers": dense}


def weight_bytes(c: dict[str, Any]) -> dict[str, float]:
    """BF16 bytes of the quantized linears (attention, dense MLP, shared and routed experts) and of the whole model."""
    f = flops(c, 1, 1)
    h, mi = c["hidden_size"], c["moe_intermediate_size"]
    attn = c["num_hidden_layers"] * f["attn_params"]
    dense = f["dense_layers"] * 3 * h * c["intermediate_size"]
    expert = 3 * h * mi
    moe = f["moe_layers"] * (c["n_shared_experts"] + c["n_routed_experts"]) * expert
    emb = 2 * c.get("vocab_size", 384) * h
    return {"quantized": 2.0 * (attn + dense + moe), "total": 2.0 * (attn + dense + moe + emb),
            "per_expert": 2.0 * expert, "attn_per_layer": 2.0 * f["attn_params"]}


def measure_costs() -> dict[str, Any]:
    root = scratch("dsconv-proj-")
    try:
        model = root / "medium"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
        subprocess.run([sys.executable, "-c", CHILD, str(model), json.dumps(MEDIUM)], check=True, env=env,
                       cwd=str(ROOT), capture_output=True)
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        p = subprocess.run([sys.executable, "-m", "dsconv", "quantize", "-m", str(model), "-o", str(root / "q"),
                            "--bits", "8", "--seq-len", str(SEQ), "--json"], env=env, cwd=str(ROOT),
                           capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(p.stderr[-3000:])
        s = json.loads(p.stdout)
        cfg = {**json.loads((model / "config.json").read_text())}
        tokens = int(s["calibration"]["tokens"])
        f = flops(cfg, tokens, min(SEQ, max(1, tokens // max(1, s["calibration"]["samples"]))))
        w = weight_bytes(cfg)
        t = s["timings"]
        rest = max(0.0, s["seconds"] - t["forward"] - t["experts"] - t["quantize"])  # start-up, reading, writing
        return {"load_before": load, "medium_config": MEDIUM, "calib_tokens": tokens,
                "calib_samples": s["calibration"]["samples"], "timings_s": t, "total_s": s["seconds"],
                "c_fwd_s_per_gflop": t["forward"] / f["other"] * 1e9,
                "c_exp_s_per_gflop": t["experts"] / f["experts"] * 1e9,
                # quantizing a calibrated linear measures its output error on the calibration rows: FLOP-bound
                "c_q_s_per_gflop": t["quantize"] / (f["other"] + f["experts"]) * 1e9,
                "fixed_s": rest, "medium_weight_gb": round(w["total"] / 1e9, 3)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def project(m: dict[str, Any], io_s_per_gb: float, nodes: tuple[int, ...] = (1, 8, 32)) -> dict[str, Any]:
    """Hours of the real job on each node count, from the measured rates (see the module docstring)."""
    tokens = m["calib_tokens"]
    seq = min(SEQ, max(1, tokens // max(1, m["calib_samples"])))
    f = flops(REAL, tokens, seq)
    w = weight_bytes(REAL)
    moe, E = f["moe_layers"], REAL["n_routed_experts"]
    layers = REAL["num_hidden_layers"]
    # per layer (attention, dense/shared MLP, router) and per routed expert, forward + measurement-based quantization
    layer_s = f["other"] / layers * (m["c_fwd_s_per_gflop"] + m["c_q_s_per_gflop"]) / 1e9
    expert_s = f["experts"] / (moe * E) * (m["c_exp_s_per_gflop"] + m["c_q_s_per_gflop"]) / 1e9
    io = w["total"] * io_s_per_gb / 1e9
    io_floor = w["total"] * 1.5 / (STORAGE_GBPS * 1e9)       # read BF16 + write ~half as much int8
    dense_bytes = w["total"] - moe * E * w["per_expert"]      # every node reads these for its samples
    rows = []
    for n in nodes:
        per_node = math.ceil(E / n) / E                        # whole experts per node: the fullest node
        a2a = 0.0 if n == 1 else moe * 2 * tokens * REAL["num_experts_per_tok"] * REAL["hidden_size"] * 2 \
            * (n - 1) / n / n / (NET_GBPS * 1e9)               # routed activations to and from expert nodes
        replicated = 0.0 if n == 1 else dense_bytes * n / (STORAGE_GBPS * 1e9)
        parts = {"layers_h": layers * layer_s / n, "experts_h": moe * E * expert_s * per_node,
                 "io_h": max(io / n, io_floor if n > 1 else 0.0) + replicated, "all_to_all_h": a2a,
                 "fixed_h": m["fixed_s"]}
        total = sum(parts.values())
        rows.append({"nodes": n, "hours": round(total / 3600, 2), **{k: round(v / 3600, 3) for k, v in parts.items()}})
    for r in rows:
        r["speedup"] = round(rows[0]["hours"] / r["hours"], 1) if r["hours"] else None
    text = [f"DeepSeek-V3 W8A8 (--bits 8) projection; node = this host at the measured rates (load {m['load_before']})",
            f"  measured on a medium DeepSeek-shaped model ({tokens} calibration tokens, {m['calib_samples']} samples): "
            f"forward {m['c_fwd_s_per_gflop']:.4f} s/GFLOP outside experts, {m['c_exp_s_per_gflop']:.4f} s/GFLOP in "
            f"experts, quantization with its error measurements {m['c_q_s_per_gflop']:.4f} s/GFLOP; checkpoint I/O "
            f"{io_s_per_gb:.2f} s/GB (weight-only quantize of the fan-out checkpoint, inline)",
            f"  real shapes: {w['total'] / 1e12:.2f} TB BF16; {layers} layers at {layer_s / 60:.1f} min each "
            f"(attention, dense/shared MLP, router: forward + quantize); {moe} x {E} routed experts at "
            f"{expert_s:.1f} s each",
            "  scheme: per layer, the forward is data-parallel over calibration samples (statistics merged), routed "
            "experts expert-parallel in whole experts (activations all-to-all over "
            f"{NET_GBPS} GB/s links), every linear's quantization its own job; I/O split up to "
            f"{STORAGE_GBPS} GB/s of shared storage, the non-expert weights read by every node. dsconv fans out "
            "weight-only parts, casts and shard ranks today; the calibrated layer loop is still one process."]
    text += [f"  {r['nodes']:>3} node(s): {r['hours']:8.2f} h  speedup {r['speedup']}x  (layers {r['layers_h']} h, "
             f"experts {r['experts_h']} h, I/O {r['io_h']} h, all-to-all {r['all_to_all_h']} h)" for r in rows]
    return {"rows": rows, "per_layer_s": round(layer_s, 1), "per_expert_s": round(expert_s, 2),
            "assumptions": {"net_gbps": NET_GBPS, "storage_gbps": STORAGE_GBPS, "seq": seq,
                            "node": "this host (measured rates)"},
            "real_tb_bf16": round(w["total"] / 1e12, 3), "text": "\n".join(text)}
