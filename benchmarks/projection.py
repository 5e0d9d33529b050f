"""The FULL DeepSeek-V3 calibrated quantization projected on 1, 8 and 32 nodes from the per-step costs MEASURED on
this host, for five runs in one table:

* `--bits 8` (MindIE's recipe: attention static W8A8 - smoothing and clip searches -, MLP and routed experts
  W8A8_DYNAMIC, kv_b_proj float; the forward in float32, `--calib-precision auto`: through oneDNN where MKL runs
  its generic code - an x86 CPU not made by Intel -, else MKL; the runs record what it resolved to);
* `--bits 8 --calib-precision bf16` (the same, its calibration forward's matmuls in bf16: AMX);
* `--bits 8 --calib-precision fp32` (float32 through MKL on every host, the default before 2026-12-07);
* `--bits 8 --kv-cache int8` (FA quant's statistics in the same forward);
* the W4A8 recipe, `--bits 4 --scheme w4a8_dynamic --engine vllm-ascend --method rtn` (routed experts int4
  round-to-nearest, every other linear W8A8_DYNAMIC).

Measured: each run on a medium DeepSeek-shaped model (random weights, the bundled calibration set) with
`--workers 1` in one thread - every step's CPU seconds as quant_report.json records them (calibrate/steps.py:
the driver's `steps_cpu`, the jobs' `in_jobs`), the plan (every linear's type) and the smoothing sites searched -,
and `--bits 8` again with `--workers 2` and the forward split over local processes (DSCONV_FORWARD_SPLIT=1, as Ray
splits it), for what two workers buy one node.

Scaled per step, each by the work it does (the same formula for the medium and the real shapes, from the plan and
the config: `work()`), rate = medium seconds / medium work:
  forward         forward FLOPs outside the routed experts (attention, dense and shared MLPs, router)
  kv_cache        FA quant's absorbed query: tokens x heads x qk_nope x kv_lora (its share of the forward's CPU)
  smooth_search   per searched site, input width x the output rows scored (at most ~2048) x clips (3 static, 1)
  clip_search     per static input, input width x the output rows scored
  linear_jobs     the quantized non-expert weights (rounding; fallback checks on 128 rows per input)
  expert_forward  the routed experts' forward FLOPs
  expert_weights  the routed experts' weights (rounding, fallback checks; loading)
  io              reading the checkpoint and writing the output: the weight-only quantize's seconds per GB (the
                  driver's materialising, writing and job transport are I/O of this kind; the medium runs print
                  them)
Real shapes: 61 layers (3 dense), 256 experts top-8, hidden 7168, moe_intermediate 2048, MLA. Calibration tokens:
the bundled set through a real tokenizer (Qwen2.5's, from the real-model fixture, when present: about 18.7k
tokens; DeepSeek-V3's 128k vocabulary cuts text alike) - and, for comparison with the earlier projection, the
medium model's own toy tokenizer (384 tokens of vocabulary, about 2.7x as many tokens). The wide probe's
tokenizer (WIDE_VOCAB) cuts its samples as long as the real tokenizer does, so attention costs per token what it will
in the real run.

One node: the driver's forward and searches on torch's threads, at the speedup the wide probe measured with
`--workers 1` on every core (`thread_speedup`: one thread's CPU seconds over the threaded wall seconds).

On N nodes (WORKERS_PER_NODE workers each, Ray): a layer's forward splits over at most as many jobs as there are
calibration batches (whole batches, in rounds), and when there are fewer jobs than workers each job holds a node's
CPUs and threads (Executor.cpus_per_job), at the threaded speedup; with more nodes than batches, one job per node
over an equal share of the samples (parts of batches, forward_cuts); its input rows go to the jobs through shared
storage, its output rows back through the driver's link, and each job reads the layer's non-expert weights; the
searches run in the driver, on its node's threads; a layer's linear jobs spread over at most its linears' count of
workers, its experts over every worker (whole experts, in rounds); routed activations and expert outputs go through
the driver's link. A MoE layer's expert jobs start right after its forward (SmoothQuant.folds_into_experts: auto
smoothing never folds a scale into them) and every one may run ahead on Ray, so the driver's searches run while they
do: the layer takes the longer of the two, and the experts' term grows by the search's CPU seconds shared over the
workers (the driver's threads take its node's cores). On one node (local processes, 2 x workers ahead) nothing is hidden.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
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
# real DeepSeek-V3 widths, one MoE layer of 8 experts (every token to each): the step rates at the real widths
WIDE = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=1,
            first_k_dense_replace=0, n_routed_experts=8, num_experts_per_tok=8, n_group=1, topk_group=1,
            n_shared_experts=1, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, head_dim=64)
WIDE_SAMPLES = 64        # calibration samples of the wide probe (its forward is 70x the medium model's per token)
# the wide probe's tokenizer: a byte-level BPE of this many tokens trained on the bundled set cuts it as Qwen2.5's
# does (19,014 tokens against 18,741; mean sample 121 against 119, longest 254 against 250; the medium model's 384
# make 320 and 512). Attention's cost per token grows with the sample's length, so the probe's samples must be as
# long as the real run's: with the 384-token vocabulary, SDPA took a third of the probe's forward (oneDNN, py-spy,
# the host loaded); at the real lengths, 5.1 of 38 s on the math kernel (quiet).
WIDE_VOCAB = 4608
MEDIUM_VOCAB = 384
REAL = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
            first_k_dense_replace=3, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
            num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, head_dim=64, vocab_size=129280, n_group=8,
            topk_group=4)
NET_GBPS = 12.5          # assumed driver NIC: 100 Gb/s
STORAGE_GBPS = 10.0      # assumed shared storage aggregate bandwidth
SEQ = 512                # calibration sequence length (the CLI default)
BATCH_TOKENS = 4096      # padded tokens per calibration batch (QuantOptions.batch_tokens)
WORKERS_PER_NODE = 2     # a node = this host: 2 cores
TARGETS = {1: (4.0, 2.0), 8: (0.5, None)}  # hours: target, goal (issue 32)
# name -> (CLI arguments, the medium model's dtype: MindIE's FA quant wants float16 weights, as a user exports them)
RUNS = {"--bits 8": (["--bits", "8"], "bf16"),
        # the calibration forward's matmuls in bf16 (AMX; its accuracy: bench_fidelity's "--calib-precision bf16" rows)
        "--bits 8 --calib-precision bf16": (["--bits", "8", "--calib-precision", "bf16"], "bf16"),
        # float32 through MKL on every host (its generic code on a CPU not made by Intel): the default until auto
        "--bits 8 --calib-precision fp32": (["--bits", "8", "--calib-precision", "fp32"], "bf16"),
        "--bits 8 --kv-cache int8": (["--bits", "8", "--kv-cache", "int8"], "fp16"),
        "W4A8 recipe (RTN experts)": (["--bits", "4", "--scheme", "w4a8_dynamic", "--engine", "vllm-ascend",
                                       "--method", "rtn"], "bf16")}
SEARCH_OUT_ROWS = 2048   # smoothing.MAX_OUT_ROWS: output rows a search scores

CHILD = """
import json, sys
from pathlib import Path
from dsconv.bundled import calib_texts
from dsconv.tiny import make_tiny, train_tokenizer
tok = train_tokenizer(calib_texts(), vocab_size=int(sys.argv[4]))
make_tiny("deepseek_v3", Path(sys.argv[1]), dtype=sys.argv[3], tokenizer=tok, **json.loads(sys.argv[2]))
"""


# ------------------------------------------------------------------------------------------------ work per step
def padding(lengths: list[int]) -> dict[str, int]:
    """What the forward computes for samples of these lengths, batched as dsconv batches them
    (`context.forward_batches`): real tokens, padded tokens (every linear outside the routed experts runs on the
    padding too) and the attention's query-key pairs (each batch's samples x its length squared, halved: causal)."""
    from dsconv.quant.calibrate.context import forward_batches

    batches = [[lengths[j] for j in b] for b in forward_batches(lengths, BATCH_TOKENS)]
    return {"tokens": sum(lengths), "samples": len(lengths), "batches": len(batches),
            "padded": sum(len(b) * b[0] for b in batches), "pairs": sum(len(b) * b[0] ** 2 // 2 for b in batches)}


def flops(c: dict[str, Any], cut: dict[str, int]) -> dict[str, float]:
    """Forward FLOPs (2 per multiply-add) of the calibration samples (`padding`): outside the routed experts - on
    the padded tokens, attention on its query-key pairs - and in them (routed real tokens)."""
    h, H = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attn_params = (h * c["q_lora_rank"] + c["q_lora_rank"] * H * qk + h * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
                   + c["kv_lora_rank"] * H * (c["qk_nope_head_dim"] + c["v_head_dim"]) + H * c["v_head_dim"] * h)
    dense = c["first_k_dense_replace"]
    moe = c["num_hidden_layers"] - dense
    mi = c["moe_intermediate_size"]
    linears = (c["num_hidden_layers"] * attn_params + dense * 3 * h * c["intermediate_size"]
               + moe * (c["n_shared_experts"] * 3 * h * mi + h * c["n_routed_experts"]))
    scores = c["num_hidden_layers"] * H * (qk + c["v_head_dim"]) * cut["pairs"]
    experts = moe * c["num_experts_per_tok"] * 3 * h * mi
    return {"other": 2.0 * (linears * cut["padded"] + scores), "experts": 2.0 * experts * cut["tokens"],
            "attn_params": attn_params, "moe_layers": moe, "dense_layers": dense}


def weight_bytes(c: dict[str, Any]) -> dict[str, float]:
    """BF16 bytes of the quantized linears (attention, dense MLP, shared and routed experts) and of the whole model."""
    f = flops(c, {"tokens": 1, "padded": 1, "pairs": 1})
    h, mi = c["hidden_size"], c["moe_intermediate_size"]
    attn = c["num_hidden_layers"] * f["attn_params"]
    dense = f["dense_layers"] * 3 * h * c["intermediate_size"]
    expert = 3 * h * mi
    moe = f["moe_layers"] * (c["n_shared_experts"] + c["n_routed_experts"]) * expert
    emb = 2 * c.get("vocab_size", 384) * h
    return {"quantized": 2.0 * (attn + dense + moe), "total": 2.0 * (attn + dense + moe + emb),
            "per_expert": 2.0 * expert, "attn_per_layer": 2.0 * f["attn_params"]}


def _scored(n: int) -> int:
    """Output rows a search scores out of n (every step-th, smoothing.MAX_OUT_ROWS)."""
    return len(range(0, n, max(1, n // SEARCH_OUT_ROWS)))


def work(report: dict[str, Any], first_moe: int, config: dict[str, Any], cut: dict[str, int]) -> dict[str, float]:
    """Each step's work for `config`, from a medium run's plan and searches (`report`: its quant_report.json; its
    first MoE layer `first_moe`): its per-layer pattern - a dense layer's and a MoE layer's linears, types and
    searched sites - repeated over the config's layers, every shape from the config; `cut`: the calibration
    samples' `padding`."""
    from dsconv.checkpoint import ConfigOnly

    cfg_dir = scratch("dsconv-proj-cfg-")
    try:
        (cfg_dir / "config.json").write_text(json.dumps(config))
        ck = ConfigOnly.open(cfg_dir / "config.json")
    finally:
        shutil.rmtree(cfg_dir, ignore_errors=True)
    L, dense = config["num_hidden_layers"], config["first_k_dense_replace"]
    pattern = {"dense": (0, dense), "moe": (first_moe, L - dense)}   # (medium layer, layers of its kind)
    real_layer = {"dense": 0, "moe": dense}

    def shape(module: str, kind: str) -> tuple[int, int]:
        name = re.sub(r"\.layers\.\d+\.", f".layers.{real_layer[kind]}.", module) + ".weight"
        return tuple(ck.info(name).shape)

    types = {m: v.get("type", v.get("planned")) for m, v in report["linears"].items()}
    f = flops(config, cut)
    w = {"forward": f["other"], "expert_forward": f["experts"],
         "kv_cache": cut["tokens"] * L * config["num_attention_heads"] * config["qk_nope_head_dim"]
         * config["kv_lora_rank"],
         "smooth_search": 0.0, "clip_search": 0.0, "linear_jobs": 0.0, "expert_weights": 0.0}
    for kind, (med, count) in pattern.items():
        prefix = f".layers.{med}."
        for m, t in types.items():
            if prefix not in m or t in (None, "FLOAT"):
                continue
            n, k = shape(m, kind)
            w["expert_weights" if ".experts." in m and "shared" not in m else "linear_jobs"] += count * n * k
        groups = []
        for e in report.get("smoothing", []):
            if prefix not in e["norm"] or "search" not in e:
                continue
            shapes = [shape(c, kind) for c in e["consumers"]]
            static = any(types.get(c) == "W8A8" for c in e["consumers"])
            w["smooth_search"] += count * shapes[0][1] * _scored(sum(s[0] for s in shapes)) * (3 if static else 1)
            groups.append(e["consumers"])
        for first, c in report.get("clipping", {}).items():
            if prefix not in first:
                continue
            mods = next((g for g in groups if g[0] == first and len(g) == c["consumers"]), [first])
            shapes = [shape(m, kind) for m in mods]
            w["clip_search"] += count * shapes[0][1] * _scored(sum(s[0] for s in shapes))
    return w


# ------------------------------------------------------------------------------------------------ measuring
def _quantize(model: Path, out: Path, args: list[str], workers: int, env: dict) -> dict[str, Any]:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    p = subprocess.run([sys.executable, "-m", "dsconv", "quantize", "-m", str(model), "-o", str(out), *args,
                        "--seq-len", str(SEQ), "--workers", str(workers), "--force", "--json"], env=env,
                       cwd=str(ROOT), capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    s = json.loads(p.stdout)
    s["report"] = json.loads((out / "quant_report.json").read_text())
    options = json.loads((out / "dsconv_manifest.json").read_text())["options"]
    s["precision"] = options.get("calib_precision") or "fp32"  # what --calib-precision auto resolved to
    s["_files"] = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(out.glob("*.safetensors"))}
    shutil.rmtree(out, ignore_errors=True)
    s["load_before"], s["load_after"] = load, " ".join(f"{x:.2f}" for x in os.getloadavg())
    return s


def sample_lengths(tokenizer: Any, samples: int | None = None) -> list[int]:
    """The bundled calibration set's sample lengths as dsconv cuts it with `tokenizer` (its first `samples`)."""
    from dsconv.quant.calibrate.data import DEFAULT_SEQ_LEN, load_calib

    return [len(s) for s in load_calib(None, tokenizer, samples, DEFAULT_SEQ_LEN).samples]


def real_lengths() -> list[int] | None:
    """The sample lengths through a real tokenizer (the Qwen2.5 fixture's), if built."""
    from benchmarks.bench_fidelity import fixture_dir

    d = fixture_dir("qwen")
    if not (d / "tokenizer.json").exists():
        return None
    from dsconv.runner.texts import load_tokenizer

    return sample_lengths(load_tokenizer(d))


def probe_lengths(vocab: int, samples: int) -> list[int]:
    """A probe's sample lengths: its BPE of `vocab` tokens (CHILD's), its first `samples` samples."""
    from dsconv.bundled import calib_texts
    from dsconv.tiny import train_tokenizer

    return sample_lengths(train_tokenizer(calib_texts(), vocab_size=vocab), samples)


def _probe_cut(config: dict[str, Any], run: dict[str, Any]) -> dict[str, int]:
    """A measured run's `padding`: its model's BPE (vocab_size) over the samples it calibrated on."""
    cut = padding(_lengths(int(config.get("vocab_size", MEDIUM_VOCAB)), int(run["report"]["calibration"]["samples"])))
    if cut["tokens"] != run["tokens"]:
        raise RuntimeError(f"the probe's samples come to {cut['tokens']} tokens here, {run['tokens']} when measured")
    return cut


_LENGTHS: dict[tuple[int, int], list[int]] = {}


def _lengths(vocab: int, samples: int) -> list[int]:
    if (vocab, samples) not in _LENGTHS:  # a tokenizer trained per call takes a second
        _LENGTHS[vocab, samples] = probe_lengths(vocab, samples)
    return _LENGTHS[vocab, samples]


def _build(root: Path, name: str, config: dict[str, Any], dtype: str, env: dict, vocab: int = MEDIUM_VOCAB) -> Path:
    subprocess.run([sys.executable, "-c", CHILD, str(root / name), json.dumps(config), dtype, str(vocab)],
                   check=True, env=env, cwd=str(ROOT), capture_output=True)
    return root / name


def _kept(r: dict[str, Any]) -> dict[str, Any]:
    """What a run keeps for the projection (a run that needs no calibration - the W4A8 recipe with RTN experts -
    streams the weights: no timings)."""
    return {"seconds": round(r["seconds"], 2), "timings": r.get("timings"), "report": r["report"],
            "calibrated": "timings" in r, "tokens": (r.get("calibration") or {}).get("tokens"),
            "precision": r.get("precision"),
            "load_before": r["load_before"], "load_after": r["load_after"]}


def measure_costs() -> dict[str, Any]:
    """The medium model's runs (the per-layer pattern, what two workers buy) and the wide probe's (each step's rate
    at the real widths), every calibrated one with --workers 1 in one thread."""
    root = scratch("dsconv-proj-")
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
        one = {**env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        medium = _build(root, "medium", MEDIUM, "bf16", env)
        runs = {name: _quantize(medium, root / "q", args, 1, one)
                for name, (args, dtype) in RUNS.items() if dtype == "bf16"}
        split = _quantize(medium, root / "q", RUNS["--bits 8"][0], 2, {**env, "DSCONV_FORWARD_SPLIT": "1"})
        base = runs["--bits 8"]
        same = base["report"]["linears"] == split["report"]["linears"] and base["_files"] == split["_files"]
        wide, threaded = {}, None
        for dtype in sorted({d for _, d in RUNS.values()}):  # the same seed: the same weights, rounded to dtype
            model = _build(root, f"wide-{dtype}", WIDE, dtype, env, WIDE_VOCAB)
            wide_vocab = json.loads((model / "config.json").read_text())["vocab_size"]
            for name, (args, want) in RUNS.items():
                if want == dtype and name != "W4A8 recipe (RTN experts)":
                    wide[name] = _quantize(model, root / "q", [*args, "--calib-samples", str(WIDE_SAMPLES)], 1, one)
            if dtype == RUNS["--bits 8"][1]:  # the driver's steps on a whole node: torch's threads on every core
                threaded = _quantize(model, root / "q", [*RUNS["--bits 8"][0], "--calib-samples", str(WIDE_SAMPLES)],
                                     1, env)
            shutil.rmtree(model, ignore_errors=True)
        cfg = json.loads((medium / "config.json").read_text())
        t1, t2 = base["timings"], split["timings"]
        jobs1, jobs2 = t1["linear_jobs"] + t1["expert_jobs"], t2["linear_jobs"] + t2["expert_jobs"]
        return {"medium_config": cfg, "wide_config": {**cfg, **WIDE, "vocab_size": wide_vocab},
                "calib_tokens": int(base["calibration"]["tokens"]),
                "calib_samples": base["calibration"]["samples"], "batches": base["forward"]["batches"],
                "runs": {k: _kept(r) for k, r in runs.items()}, "wide_runs": {k: _kept(r) for k, r in wide.items()},
                "split_2_workers": {"seconds": round(split["seconds"], 2), "timings": t2, "forward": split["forward"],
                                    "load_before": split["load_before"]},
                "bytes_identical_1_vs_2": same,
                "job_speedup": round(jobs1 / jobs2, 2) if jobs2 else 1.0,
                "fwd_speedup": round(t1["forward_cpu"] / t2["forward_cpu_critical"], 2),
                "fwd_speedup_wall": round(t1["forward_wall"] / t2["forward_wall"], 2) if t2["forward_wall"] else 1.0,
                "thread_speedup": _thread_speedup(wide["--bits 8"], threaded),
                "wide_threaded": _kept(threaded), "real_lengths": real_lengths()}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _thread_speedup(one: dict[str, Any], threaded: dict[str, Any]) -> dict[str, float]:
    """What a whole node's threads buy the driver's steps on the wide probe: one thread's CPU seconds over the
    threaded run's wall seconds, for the forward and for the searches (smoothing strength and clipping)."""
    cpu, wall = one["report"]["timings"]["steps_cpu"], threaded["report"]["timings"]["steps"]
    searches = ("smooth_search", "clip_search")

    def ratio(a: float, b: float) -> float:
        return round(a / b, 2) if b > 0 else 1.0

    return {"forward": ratio(cpu.get("forward", 0.0), wall.get("forward", 0.0)),
            "searches": ratio(sum(cpu.get(k, 0.0) for k in searches), sum(wall.get(k, 0.0) for k in searches)),
            "threads": os.cpu_count() or 1}


# ------------------------------------------------------------------------------------------------ projecting
def rates(m: dict[str, Any], name: str, io_s_per_gb: float, probe: str = "wide") -> dict[str, float]:
    """Seconds per unit of work of each step for run `name`: CPU seconds, one thread, of the wide probe (`probe`
    "wide": the real widths) or of the medium model ("medium"). A run without calibration streams the weights: I/O
    alone, at the weight-only quantize's rate."""
    runs = m["wide_runs"] if probe == "wide" else m["runs"]
    config = m["wide_config"] if probe == "wide" else m["medium_config"]
    r = runs.get(name)
    if r is None or not r["calibrated"]:  # the weight-only path's rate (a small model times start-up)
        return {"io_s_per_gb": io_s_per_gb}
    t = r["report"]["timings"]
    cpu, jobs = t["steps_cpu"], t["in_jobs"]
    w = work(r["report"], config["first_k_dense_replace"], config, _probe_cut(config, r))
    fwd = cpu.get("forward", 0.0)
    if name.endswith("--kv-cache int8"):  # FA quant's statistics: what the forward took beyond --bits 8's
        plain = runs["--bits 8"]["report"]["timings"]["steps_cpu"].get("forward", 0.0)
        kv, fwd = max(0.0, fwd - plain), plain
    else:
        kv = 0.0

    def per(seconds: float, units: float) -> float:
        return seconds / units if units else 0.0

    expert_weights = sum(v for k, v in jobs.items() if k.startswith("expert_") and k != "expert_forward")
    return {"forward": per(fwd, w["forward"]), "kv_cache": per(kv, w["kv_cache"]),
            "smooth_search": per(cpu.get("smooth_search", 0.0), w["smooth_search"]),
            "clip_search": per(cpu.get("clip_search", 0.0), w["clip_search"]),
            "linear_jobs": per(sum(jobs.get(k, 0.0) for k in ("quantize", "gptq", "fallback_check")),
                               w["linear_jobs"]),
            "expert_forward": per(jobs.get("expert_forward", 0.0), w["expert_forward"]),
            "expert_weights": per(expert_weights, w["expert_weights"]), "io_s_per_gb": io_s_per_gb}


def project(m: dict[str, Any], io_s_per_gb: float, nodes: tuple[int, ...] = (1, 8, 32)) -> dict[str, Any]:
    """Hours of each run on each node count - at a real tokenizer's calibration tokens (and, for comparison with the
    earlier projection, the medium model's), at the wide probe's rates (and, for comparison, the medium model's)."""
    rows = []
    bases = {"medium tokenizer": _probe_cut(m["medium_config"], m["runs"]["--bits 8"])}
    real = m.get("real_lengths") or (real_lengths() if m.get("real_tokens") else None)  # older files: tokens only
    if real:
        bases = {"real tokenizer": padding(real), **bases}
    # two workers do at most twice one's work: a higher measured ratio is load noise in the one-worker run
    fgain, gain = (min(float(WORKERS_PER_NODE), max(1.0, m[k])) for k in ("fwd_speedup", "job_speedup"))
    # a saved measurement from before the threaded run: the driver's forward as two split processes, searches as one
    tg = m.get("thread_speedup") or {"forward": fgain, "searches": 1.0}
    tgain = {"forward": max(1.0, tg["forward"]), "searches": max(1.0, tg["searches"])}
    pattern = m["runs"]["--bits 8"]["report"]  # the per-layer pattern: both layer kinds' linears and searches
    for name in RUNS:
        if name not in m["runs"] and name not in m["wide_runs"]:  # a saved measurement from before the run existed
            continue
        calibrated = m["runs"][name]["calibrated"] if name in m["runs"] else True
        for probe in ("wide", "medium"):
            if probe == "medium" and name not in m["runs"]:
                continue
            rate = rates(m, name, io_s_per_gb, probe)
            for basis, cut in bases.items():
                if probe == "medium" and basis != "medium tokenizer":
                    continue
                w = work(pattern, m["medium_config"]["first_k_dense_replace"], {**m["medium_config"], **REAL},
                         cut) if calibrated else {}
                for n in nodes:
                    rows.append({"run": name, "rates": probe, "tokens": basis, "calib_tokens": cut["tokens"],
                                 "padded_tokens": cut["padded"], "nodes": n,
                                 **_hours(rate, w, cut["tokens"], cut["batches"], n, fgain, gain, tgain,
                                          cut["samples"])})
    text = _text(m, rows, io_s_per_gb)
    return {"rows": rows, "assumptions": {"net_gbps": NET_GBPS, "storage_gbps": STORAGE_GBPS, "seq": SEQ,
                                          "workers_per_node": WORKERS_PER_NODE,
                                          "node": "this host (measured rates and 2-worker speedups)"},
            "real_tb_bf16": round(weight_bytes(REAL)["total"] / 1e12, 3), "text": "\n".join(text)}


def _hours(rate: dict[str, float], w: dict[str, float], tokens: int, nb: int, n: int, fgain: float,
           gain: float, tgain: dict[str, float], samples: int) -> dict[str, Any]:
    """One run on n nodes: hours per term (see the module docstring). `fgain`: two single-threaded jobs on one node
    against one thread; `tgain`: a whole node's threads against one, for the forward and the driver's searches."""
    layers, moe, E = REAL["num_hidden_layers"], REAL["num_hidden_layers"] - REAL["first_k_dense_replace"], \
        REAL["n_routed_experts"]
    wb = weight_bytes(REAL)
    workers = n * WORKERS_PER_NODE
    # forward_cuts.cut_jobs: one job per node over an equal share of the samples once there are more nodes than batches
    # (parts of batches; no GPTQ in these runs), else runs of whole batches, at most one per worker
    parts = n > nb and samples > nb
    jobs = min(n, samples) if parts else min(workers, nb)
    threads = max(1, min(WORKERS_PER_NODE, workers // jobs))  # Executor.cpus_per_job
    rate = {k: rate.get(k, 0.0) for k in ("forward", "kv_cache", "smooth_search", "clip_search", "linear_jobs",
                                         "expert_forward", "expert_weights", "io_s_per_gb")}
    w = {k: w.get(k, 0.0) for k in rate}
    layer_fwd = (rate["forward"] * w["forward"] + rate["kv_cache"] * w["kv_cache"]) / layers  # one worker
    if n == 1:  # one node: the driver's threads on each batch (dsconv's default on one host)
        fwd = layer_fwd / tgain["forward"]
    elif parts:  # each job a node's threads over 1/jobs of the padded tokens
        fwd = layer_fwd / jobs / tgain["forward"]
    elif threads >= WORKERS_PER_NODE:  # fewer jobs than workers: each job a node's threads (Executor.cpus_per_job)
        fwd = layer_fwd * math.ceil(nb / jobs) / nb / tgain["forward"]
    else:  # split over single-threaded jobs of whole batches, in rounds, two to a node
        fwd = layer_fwd * math.ceil(nb / jobs) / nb * WORKERS_PER_NODE / fgain
    h_bytes = tokens * REAL["hidden_size"] * 4
    layer_weights = (wb["total"] - moe * E * wb["per_expert"] - 4 * REAL["vocab_size"] * REAL["hidden_size"]) / layers
    fwd_io = 0.0 if n == 1 or not w["forward"] else h_bytes / (STORAGE_GBPS * 1e9) + \
        h_bytes / (NET_GBPS * 1e9) + jobs * layer_weights / (STORAGE_GBPS * 1e9)
    search_cpu = rate["smooth_search"] * w["smooth_search"] + rate["clip_search"] * w["clip_search"]
    searches = search_cpu / tgain["searches"]  # in the driver, on its node's threads
    lin = rate["linear_jobs"] * w["linear_jobs"] / layers / min(n * gain, 8)
    expert_s = (rate["expert_forward"] * w["expert_forward"] + rate["expert_weights"] * w["expert_weights"]) / \
        (moe * E)
    exp = moe * math.ceil(E / workers) * expert_s * WORKERS_PER_NODE / gain
    hidden = 0.0
    if n > 1 and exp:  # SmoothQuant.folds_into_experts: a MoE layer's searches run while its experts do; the driver's search
        # threads take their CPU seconds from the workers (its node's two), spread over all by Ray's scheduling
        per_layer = searches / layers
        exp += moe * search_cpu / layers / workers
        hidden = moe * min(per_layer, exp / moe)
        searches -= hidden
    expert_bytes = moe * E * wb["per_expert"]
    io = (wb["total"] - expert_bytes) * rate["io_s_per_gb"] / 1e9 + max(
        expert_bytes * rate["io_s_per_gb"] / 1e9 / n, expert_bytes / (STORAGE_GBPS * 1e9) if n > 1 else 0.0)
    routed = 0.0 if n == 1 else moe * 2 * tokens * REAL["num_experts_per_tok"] * REAL["hidden_size"] * 4 / \
        (NET_GBPS * 1e9)
    parts = {"forward": layers * (fwd + fwd_io), "searches": searches, "linear_jobs": layers * lin,
             "experts": exp, "io": io, "routed_transfer": routed}
    total = sum(parts.values())
    hours = {f"{k}_h": round(v / 3600, 3) for k, v in parts.items()}
    target, goal = TARGETS.get(n, (None, None))
    return {"hours": round(total / 3600, 2), **hours, "searches_hidden_h": round(hidden / 3600, 3),
            "dominant": max(parts, key=parts.get),
            "forward_jobs_per_layer": jobs, "forward_threads_per_job": threads if n > 1 else None, "batches": nb,
            "target_h": target, "met": None if target is None else total / 3600 <= target,
            "goal_h": goal, "goal_met": None if goal is None else total / 3600 <= goal}


def _text(m: dict[str, Any], rows: list[dict[str, Any]], io_s_per_gb: float) -> list[str]:
    text = [f"DeepSeek-V3 projection; node = this host ({WORKERS_PER_NODE} cores); checkpoint I/O {io_s_per_gb:.2f} "
            f"s/GB; the per-layer pattern from a medium DeepSeek-shaped model ({m['calib_tokens']} calibration tokens "
            f"of its toy tokenizer, {m['calib_samples']} samples, {m['batches']} batches), each step's rate from the "
            f"wide probe (DeepSeek-V3's widths, one MoE layer, {WIDE_SAMPLES} samples, cut by a BPE of "
            f"{m['wide_config'].get('vocab_size', MEDIUM_VOCAB)} tokens)",
            "  runs with --workers 1 in one thread (CPU s per step, from quant_report.json):"]
    for probe, runs in (("medium", m["runs"]), ("wide", m["wide_runs"])):
        for name, r in runs.items():
            if not r["calibrated"]:
                text.append(f"    {probe} {name}: {r['seconds']} s wall (load {r['load_before']}); no calibration: "
                            "the weights stream (the weight-only path), I/O alone")
                continue
            t = r["report"]["timings"]
            steps = ", ".join(f"{k} {v:.1f}" for k, v in {**t["steps_cpu"], **t["in_jobs"]}.items() if v >= 0.05)
            ran = f" (ran {r['precision']})" if r.get("precision") and r["precision"] not in name else ""
            text.append(f"    {probe} {name}{ran}: {r['tokens']} tokens, {r['seconds']} s wall (load "
                        f"{r['load_before']}); {steps}")
    text.append(f"  medium --workers 2, forward split: {m['split_2_workers']['seconds']} s; forward {m['fwd_speedup']}x "
                f"on free cores ({m['fwd_speedup_wall']}x wall here), jobs {m['job_speedup']}x; bytes identical to "
                f"--workers 1: {m['bytes_identical_1_vs_2']}")
    tg = m.get("thread_speedup")
    if tg:
        wt = m["wide_threaded"]
        text.append(f"  wide --bits 8 --workers 1 on {tg['threads']} threads: {wt['seconds']} s wall (load "
                    f"{wt['load_before']}); against one thread's CPU s: forward {tg['forward']}x, searches "
                    f"{tg['searches']}x")
    text.append("  | run | rates | calibration tokens | nodes | hours | forward | searches | linear jobs | experts | "
                "I/O | routed transfer | dominant | target |")
    for r in rows:
        tgt = "" if r["target_h"] is None else (f"<= {r['target_h']} h: {'met' if r['met'] else 'MISSED'}" +
                                                ("" if r["goal_h"] is None else
                                                 f"; goal {r['goal_h']} h: {'met' if r['goal_met'] else 'missed'}"))
        text.append(f"  | {r['run']} | {r['rates']} | {r['calib_tokens']} ({r['padded_tokens']} padded; "
                    f"{r['tokens']}) | {r['nodes']} | {r['hours']} | {r['forward_h']} | {r['searches_h']}{_hidden(r)} | {r['linear_jobs_h']} | "
                    f"{r['experts_h']} | {r['io_h']} | {r['routed_transfer_h']} | {r['dominant']} | {tgt} |")
    return text


def _hidden(row: dict[str, Any]) -> str:
    h = row.get("searches_hidden_h") or 0.0
    return f" (+{h} under the experts)" if h else ""


def main(argv: list[str] | None = None) -> None:
    """Measure and project; `--from FILE` projects a saved measurement again (bench-results/projection.json)."""
    import argparse

    from benchmarks.common import RESULTS, save

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="source", type=Path, default=None, help="a saved projection.json to re-project")
    ap.add_argument("--io-s-per-gb", type=float, default=None,
                    help="checkpoint I/O seconds per GB (default: the last scale.json's weight-only quantize, else 3.2)")
    a = ap.parse_args(argv)
    io = a.io_s_per_gb
    scale = RESULTS / "scale.json"
    if io is None and scale.is_file():
        fan = json.loads(scale.read_text()).get("fanout_2p5gb_deepseek_shaped") or {}
        if fan.get("source_gb"):
            io = fan["workers_1"]["quantize_s"] / fan["source_gb"]
    io = io if io is not None else float(os.environ.get("DSCONV_IO_S_PER_GB", "3.2"))
    costs = json.loads(a.source.read_text())["measured_costs"] if a.source else measure_costs()
    proj = project(costs, io)
    print(proj["text"], flush=True)
    save("projection", {"measured_costs": costs, "io_s_per_gb": io,
                        "projection_deepseek_v3": {k: v for k, v in proj.items() if k != "text"},
                        "projection_text": proj["text"].splitlines()}, quiet=True)


if __name__ == "__main__":
    main(sys.argv[1:])
