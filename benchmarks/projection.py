"""The FULL DeepSeek-V3 W8A8 job (`quantize --bits 8`: static attention calibrated, MLP and routed experts dynamic)
projected on 1, 8 and 32 nodes from costs and a parallel split MEASURED on this host (bench_scale part 2).

Measured here, on a medium DeepSeek-shaped model (random weights, the bundled calibration set), with `--workers 1`
and `--workers 2` (the calibrated path's jobs: dsconv/quant/calibrate/calib_jobs.py):
  * c_fwd  - seconds per FLOP of the calibration forward outside the routed experts (attention, dense and
             shared MLP, router), one single-threaded worker: its CPU seconds with `--workers 1` and one thread
             (`forward_cpu`),
             which the host's load does not inflate;
  * fwd_speedup - the forward split over the calibration batches (dsconv/quant/calibrate/forward_jobs.py; over local
             processes with DSCONV_FORWARD_SPLIT=1, as Ray workers on other nodes run it by default) on one node:
             `forward_cpu` with 1 worker over `forward_cpu_critical` with 2 (each pass's driver CPU plus its
             longest job's: the pass's wall on free cores, per-job overheads - layer materialised per job, input
             rows by file, results back - included). The wall ratio (`forward_wall`) is printed beside it: on a
             loaded shared host two workers do not get two cores;
  * c_lin  - seconds per (non-expert forward) FLOP of the per-linear jobs (statistics -> activation parameters,
             smoothing/range searches, output-error measurement, writing): `linear_jobs` wall with one worker;
  * c_exp  - seconds per FLOP of the routed-expert jobs (each expert's forward, statistics, quantization):
             `expert_jobs` wall with one worker;
  * job_speedup - the jobs' wall with 1 worker over 2 workers: what one node (this host) gains by running them
             in parallel, measured under whatever load the host has (printed);
  * the rest of the run as a fixed cost; checkpoint I/O per byte from bench_scale's weight-only quantize.
Scaled to the real shapes (61 layers, 3 dense, 256 experts top-8, hidden 7168, moe_intermediate 2048, MLA) with the
same calibration tokens (so the same calibration batches). On N nodes: a layer's forward splits over at most as many
jobs as there are batches (whole batches, in rounds); its input rows go to the jobs through shared storage, its
output rows back through the driver's link, and each job reads the layer's non-expert weights; a layer's linear jobs
spread over at most as many workers as the layer has linears, its experts over every worker (whole experts, in
rounds), routed activations go to the jobs and their outputs back through the driver's link, and the expert weights
are read by the jobs.
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


def _quantize(model: Path, out: Path, workers: int, env: dict) -> dict[str, Any]:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    p = subprocess.run([sys.executable, "-m", "dsconv", "quantize", "-m", str(model), "-o", str(out), "--bits", "8",
                        "--seq-len", str(SEQ), "--workers", str(workers), "--force", "--json"], env=env,
                       cwd=str(ROOT), capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    s = json.loads(p.stdout)
    s["load_before"], s["load_after"] = load, " ".join(f"{x:.2f}" for x in os.getloadavg())
    return s


def measure_costs() -> dict[str, Any]:
    root = scratch("dsconv-proj-")
    try:
        model = root / "medium"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
        subprocess.run([sys.executable, "-c", CHILD, str(model), json.dumps(MEDIUM)], check=True, env=env,
                       cwd=str(ROOT), capture_output=True)
        # one worker: the forward single-threaded (the rate per worker); two: the forward split over local processes,
        # which dsconv does only on request (DSCONV_FORWARD_SPLIT=1; Ray splits by default)
        runs = {1: _quantize(model, root / "q1", 1, {**env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}),
                2: _quantize(model, root / "q2", 2, {**env, "DSCONV_FORWARD_SPLIT": "1"})}
        same = all((root / "q1" / f.name).read_bytes() == f.read_bytes() for f in (root / "q2").glob("*.safetensors"))
        s = runs[1]
        cfg = {**json.loads((model / "config.json").read_text())}
        tokens = int(s["calibration"]["tokens"])
        f = flops(cfg, tokens, min(SEQ, max(1, tokens // max(1, s["calibration"]["samples"]))))
        w = weight_bytes(cfg)
        t, t2 = s["timings"], runs[2]["timings"]
        jobs1, jobs2 = t["linear_jobs"] + t["expert_jobs"], t2["linear_jobs"] + t2["expert_jobs"]
        rest = max(0.0, s["seconds"] - t["forward_wall"] - jobs1)  # start-up, reading, writing, saving job inputs
        moe, E = f["moe_layers"], cfg["n_routed_experts"]
        return {"load_before": s["load_before"], "medium_config": MEDIUM, "calib_tokens": tokens,
                "calib_samples": s["calibration"]["samples"],
                "workers_1": {"total_s": round(s["seconds"], 2), "timings_s": t, "load": s["load_before"]},
                "workers_2": {"total_s": round(runs[2]["seconds"], 2), "timings_s": t2,
                              "load": runs[2]["load_before"], "ran": runs[2].get("execution")},
                "bytes_identical_1_vs_2": same,
                "speedup_total_2_workers": round(s["seconds"] / runs[2]["seconds"], 2),
                "job_speedup": round(jobs1 / jobs2, 2) if jobs2 else 1.0,
                "forward_1_vs_2": {"wall_1_s": round(t["forward_wall"], 2), "wall_2_s": round(t2["forward_wall"], 2),
                                   "cpu_1_s": round(t["forward_cpu"], 2), "cpu_2_s": round(t2["forward_cpu"], 2),
                                   "cpu_critical_2_s": round(t2["forward_cpu_critical"], 2),
                                   "split": runs[2]["forward"]},
                "fwd_speedup_wall": round(t["forward_wall"] / t2["forward_wall"], 2) if t2["forward_wall"] else 1.0,
                "fwd_speedup": round(t["forward_cpu"] / t2["forward_cpu_critical"], 2),
                "fwd_cpu_overhead_2": round(t2["forward_cpu"] / t["forward_cpu"], 3),
                "batches": s["forward"]["batches"],
                "serial_fraction_1_worker": round(rest / s["seconds"], 3),
                "per_layer_s": round((t["forward_wall"] + t["linear_jobs"]) / cfg["num_hidden_layers"], 3),
                "per_expert_s": round(t["expert_jobs"] / max(1, moe * E), 4),
                "c_fwd_s_per_gflop": t["forward_cpu"] / f["other"] * 1e9,
                "c_lin_s_per_gflop": t["linear_jobs"] / f["other"] * 1e9,
                "c_exp_s_per_gflop": t["expert_jobs"] / f["experts"] * 1e9,
                "fixed_s": rest, "medium_weight_gb": round(w["total"] / 1e9, 3)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


WORKERS_PER_NODE = 2     # a node = this host: 2 cores, the measured job_speedup with 2 workers
LINEARS_PER_LAYER = 8    # DeepSeek-V3 MoE layer outside the experts: 5 attention + 3 shared-expert linears


def project(m: dict[str, Any], io_s_per_gb: float, nodes: tuple[int, ...] = (1, 8, 32)) -> dict[str, Any]:
    """Hours of the real job on each node count, from the measured rates and split (see the module docstring)."""
    tokens = m["calib_tokens"]
    seq = min(SEQ, max(1, tokens // max(1, m["calib_samples"])))
    f = flops(REAL, tokens, seq)
    w = weight_bytes(REAL)
    moe, E = f["moe_layers"], REAL["n_routed_experts"]
    layers = REAL["num_hidden_layers"]
    gain = max(1.0, m["job_speedup"])  # one node's job throughput, in single-worker units
    fgain = max(1.0, m["fwd_speedup"])  # one node's split forward, likewise
    nb = m["batches"]                   # calibration batches: the most jobs a layer's forward splits into
    layer_fwd = f["other"] / layers * m["c_fwd_s_per_gflop"] / 1e9     # one worker: the layer's forward
    layer_lin = f["other"] / layers * m["c_lin_s_per_gflop"] / 1e9     # the layer's linear jobs, one worker
    expert_s = f["experts"] / (moe * E) * m["c_exp_s_per_gflop"] / 1e9  # one expert's job, one worker
    expert_bytes = moe * E * w["per_expert"]
    dense_bytes = w["total"] - expert_bytes
    routed = 2 * tokens * REAL["num_experts_per_tok"] * REAL["hidden_size"] * 4  # rows to the jobs, outputs back
    h_bytes = tokens * REAL["hidden_size"] * 4  # a layer's input (and output) rows, float32
    layer_weights = (dense_bytes - 4 * REAL["vocab_size"] * REAL["hidden_size"]) / layers  # non-expert, per layer
    rows = []
    for n in nodes:
        workers = n * WORKERS_PER_NODE
        jobs = min(workers, nb)
        fwd = layer_fwd * math.ceil(nb / jobs) / nb * WORKERS_PER_NODE / fgain  # rounds of whole batches
        fwd_io = 0.0 if n == 1 else h_bytes / (STORAGE_GBPS * 1e9) + h_bytes / (NET_GBPS * 1e9) + \
            2 * jobs * layer_weights / (STORAGE_GBPS * 1e9)  # rows out and back; 2 passes of weights per job
        lin = layer_lin / min(n * gain, LINEARS_PER_LAYER)
        exp = math.ceil(E / workers) * expert_s * WORKERS_PER_NODE / gain  # rounds of whole experts
        io = dense_bytes * io_s_per_gb / 1e9 + max(expert_bytes * io_s_per_gb / 1e9 / n,
                                                   expert_bytes / (STORAGE_GBPS * 1e9) if n > 1 else 0.0)
        parts = {"forward_h": layers * (fwd + fwd_io), "linear_jobs_h": layers * lin, "expert_jobs_h": moe * exp,
                 "io_h": io, "routed_transfer_h": 0.0 if n == 1 else moe * routed / (NET_GBPS * 1e9),
                 "fixed_h": m["fixed_s"]}
        total = sum(parts.values())
        serial = total - parts["forward_h"] + layers * layer_fwd  # the same run with the forward serial
        rows.append({"nodes": n, "hours": round(total / 3600, 2), **{k: round(v / 3600, 3) for k, v in parts.items()},
                     "forward_jobs_per_layer": jobs, "hours_with_serial_forward": round(serial / 3600, 2)})
    for r in rows:
        r["speedup"] = round(rows[0]["hours"] / r["hours"], 1) if r["hours"] else None
    fw = m["forward_1_vs_2"]
    text = [f"DeepSeek-V3 W8A8 (--bits 8) projection; node = this host (2 cores) at the measured rates "
            f"(load {m['load_before']} before the 1-worker run, {m['workers_2']['load']} before the 2-worker run)",
            f"  measured on a medium DeepSeek-shaped model ({tokens} calibration tokens, {m['calib_samples']} samples): "
            f"--workers 1 {m['workers_1']['total_s']} s, --workers 2 {m['workers_2']['total_s']} s "
            f"({m['speedup_total_2_workers']}x; jobs alone {m['job_speedup']}x; bytes identical: "
            f"{m['bytes_identical_1_vs_2']}); serial share with 1 worker {m['serial_fraction_1_worker']:.0%}; "
            f"per layer {m['per_layer_s']} s (forward + linear jobs), per routed expert {m['per_expert_s']} s",
            f"  forward split over {m['forward_1_vs_2']['split']['jobs_per_pass']} jobs of its {nb} batches: "
            f"{m['fwd_speedup']}x on free cores (CPU s {fw['cpu_1_s']} with 1 worker -> critical path "
            f"{fw['cpu_critical_2_s']} with 2; all jobs {fw['cpu_2_s']}, {m['fwd_cpu_overhead_2']}x); wall here "
            f"{fw['wall_1_s']} -> {fw['wall_2_s']} s ({m['fwd_speedup_wall']}x at this load)",
            f"  rates: forward (one worker) {m['c_fwd_s_per_gflop']:.4f} s/GFLOP, linear jobs "
            f"{m['c_lin_s_per_gflop']:.4f} s/GFLOP, expert jobs {m['c_exp_s_per_gflop']:.4f} s/GFLOP; checkpoint I/O "
            f"{io_s_per_gb:.2f} s/GB",
            f"  real shapes: {w['total'] / 1e12:.2f} TB BF16; {layers} layers at {layer_fwd / 60:.1f} min of "
            f"forward (one worker) + {layer_lin / 60:.1f} min of linear jobs each; {moe} x {E} routed experts at "
            f"{expert_s:.1f} s of one worker each",
            "  scheme (what dsconv runs today): per layer, the calibration forward as jobs over the calibration "
            f"batches (at most {nb}), then the layer's linears and routed experts as jobs over every node's workers "
            "(--executor ray); routed "
            f"activations and expert outputs through the driver's {NET_GBPS} GB/s link; expert weights read by the "
            f"jobs from shared storage (up to {STORAGE_GBPS} GB/s), the rest by the driver."]
    text += [f"  {r['nodes']:>3} node(s): {r['hours']:8.2f} h  speedup {r['speedup']}x  (forward {r['forward_h']} h, "
             f"linear jobs {r['linear_jobs_h']} h, expert jobs {r['expert_jobs_h']} h, I/O {r['io_h']} h, "
             f"routed transfer {r['routed_transfer_h']} h; forward in {r['forward_jobs_per_layer']} jobs per pass); "
             f"with the forward serial (one worker): {r['hours_with_serial_forward']} h" for r in rows]
    return {"rows": rows, "per_layer_serial_s": round(layer_fwd, 1), "per_layer_linear_jobs_s": round(layer_lin, 1),
            "per_expert_s": round(expert_s, 2),
            "assumptions": {"net_gbps": NET_GBPS, "storage_gbps": STORAGE_GBPS, "seq": seq,
                            "workers_per_node": WORKERS_PER_NODE, "linears_per_layer": LINEARS_PER_LAYER,
                            "node": "this host (measured rates and 2-worker job speedup)"},
            "real_tb_bf16": round(w["total"] / 1e12, 3), "text": "\n".join(text)}


if __name__ == "__main__":  # the projection alone, with the I/O rate of the last bench_scale run (or 3.2 s/GB)
    from benchmarks.common import save

    costs = measure_costs()
    proj = project(costs, float(os.environ.get("DSCONV_IO_S_PER_GB", "3.2")))
    print(proj["text"], flush=True)
    save("projection", {"measured_costs": costs, "projection_deepseek_v3_w8a8":
                        {k: v for k, v in proj.items() if k != "text"}, "projection_text": proj["text"].splitlines()})
