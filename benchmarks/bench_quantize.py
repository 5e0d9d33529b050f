"""Benchmarks of `dsconv quantize` / `dsconv eval` (figures printed, JSON written to bench-results/quantize.json).

1b. memory (weight-only at copy speed): `dsconv quantize --scheme w8a16 --method rtn` of DeepSeek-V3-shaped bf16
   checkpoints of ~2, ~5.7, ~6 and ~8 GB (the real 1.85 GB embedding and lm_head in 5.7 and 8; DeepSeek-V3's
   proportions in 6) beside `cp -r` of the same input, interleaved in one run, the process tree's peak RSS sampled.
   Goals: >= 1.0x cp's speed; peak RSS <= 1.0 GB and flat. `--reps N`, `--code DIR` (another checkout's dsconv),
   `--quiet L` (wait for a 1-minute load below L before each pair, up to `--wait` seconds).
1c. kernel: the rounding kernel alone on one DeepSeek expert-shaped weight (bf16 and float32, 8 and 4 bits), one
   thread, CPU ns per element, and the start-up a CLI run pays before it.
1. weight-only throughput and peak RSS: w8a16 round-to-nearest on synthetic Llama-like bf16 checkpoints of ~2 GB and
   ~8 GB (random data, deleted afterwards), against a plain copy of the same files; each run in a child process whose
   peak RSS is its own ru_maxrss. Goals: >= 0.7x the copy's throughput; peak RSS <= 1.5 GB and flat in model size.
2. calibration time: static W8A8 on a random Llama (hidden 1024, 6 layers) with the bundled calibration set, against
   a plain PyTorch forward of the same model (held in memory, float32) on the same padded batches. Goal <= 1.3x.
3. accuracy targets on the most realistic model this machine can make: a small Llama trained here for a few hundred
   steps on English text (Python's own docstrings) + the bundled set, evaluated on held-out text: W8A16 within 0.5%
   perplexity, W8A8 within 2%, W4A16 GPTQ clearly better than RTN at the same group size.

Run all: `python -m benchmarks.bench_quantize` (or `python -m benchmarks quantize`); one part: `... throughput`,
`... calibration`, `... targets`, `... memory`, `... kernel`. Sizes: `--sizes 2,8` (GB).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench-results"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _child(code: str, *args: str) -> dict[str, Any]:
    """Run `code` in a fresh interpreter; it prints one JSON object (we add its peak RSS)."""
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork + exec, so a child would report its parent's peak
    wrapped = code + "\nimport json as _j, re as _re\n_hwm = int(_re.search(r'VmHWM:\\s+(\\d+)', " \
                     "open('/proc/self/status').read()).group(1)) * 1024\n" \
                     "print('@@' + _j.dumps({**RESULT, 'peak_rss_bytes': _hwm}))\n"
    p = subprocess.run([sys.executable, "-c", wrapped, *args], capture_output=True, text=True, cwd=str(ROOT),
                       env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if p.returncode != 0:
        raise RuntimeError(f"child failed ({p.returncode}):\n{p.stderr[-3000:]}")
    line = next(x for x in p.stdout.splitlines() if x.startswith("@@"))
    return json.loads(line[2:])


# ------------------------------------------------------------------------------------------ 1. throughput
def llama_config(layers: int) -> dict[str, Any]:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
            "intermediate_size": 11008, "num_hidden_layers": layers, "num_attention_heads": 32,
            "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "torch_dtype": "bfloat16", "tie_word_embeddings": False, "hidden_act": "silu"}


def write_synthetic(out: Path, layers: int, seed: int = 0, cfg: dict[str, Any] | None = None) -> int:
    """A Llama-like (or `cfg`-shaped) bf16 checkpoint of random data in 4 GB parts (+ index), written through
    dsconv's writer."""
    import numpy as np

    from dsconv.families import family_for
    from dsconv.io.writer import OutputDir
    from dsconv.tensors import torch_dtype

    cfg = cfg or llama_config(layers)
    specs = family_for(cfg).synthesize(cfg)
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(1 << 25, dtype=np.float32) * 0.02).view(np.uint32) >> 16
    pool = pool.astype(np.uint16)  # bf16 bit patterns
    with OutputDir(out, stage="bench-synthetic", force=True) as od:
        ts = od.tensor_set(specs, prefix="model", max_shard_size=4 * 10**9)
        for j, s in enumerate(specs):
            n = int(np.prod(s.shape))
            start = (j * 7919) % (pool.size - 1)
            reps = -(-(n + start) // pool.size)
            data = np.tile(pool, reps)[start:start + n] if reps > 1 else pool[start:start + n]
            if s.dtype != "BF16":  # DeepSeek's float32 router bias
                import torch

                ts.write(s.name, torch.zeros(s.shape, dtype=torch_dtype(s.dtype)))
                continue
            if s.name.endswith("norm.weight"):
                data = np.full(n, 0x3F80, np.uint16)  # 1.0
            ts.write(s.name, _bf16(data.reshape(s.shape)))
        od.write_json("config.json", cfg)
    return sum(s.nbytes for s in specs)


def _bf16(a):
    """uint16 bf16 bit patterns -> a torch bfloat16 tensor (no copy)."""
    import numpy as np
    import torch

    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)

QUANT_CHILD = """
import sys, time
from pathlib import Path
from dsconv.quant.plan.options import QuantOptions
from dsconv.quant.stage import QuantRequest, run
t = time.perf_counter()
s = run(QuantRequest(Path(sys.argv[1]), Path(sys.argv[2]), QuantOptions(scheme="w8a16"), force=True,
                     progress=False)).summary
RESULT = {"seconds": time.perf_counter() - t, "linears": s["linears"]}
"""

COPY_CHILD = """
import sys, time, shutil
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir(parents=True, exist_ok=True)
t = time.perf_counter()
for f in sorted(src.iterdir()):
    if f.is_file():
        shutil.copyfile(f, dst / f.name)
RESULT = {"seconds": time.perf_counter() - t}
"""


USER_COPY_CHILD = """
import sys, time
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir(parents=True, exist_ok=True)
buf = bytearray(16 << 20)
view = memoryview(buf)
t = time.perf_counter()
for f in sorted(src.iterdir()):
    if f.is_file():
        with open(f, "rb", buffering=0) as a, open(dst / f.name, "wb", buffering=0) as b:
            while n := a.readinto(buf):
                b.write(view[:n])
RESULT = {"seconds": time.perf_counter() - t}
"""

DSCONV_COPY_CHILD = """
import sys, time
from pathlib import Path
from dsconv.checkpoint import Checkpoint
from dsconv.io.writer import OutputDir
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
t = time.perf_counter()
ck = Checkpoint.open(src)
with OutputDir(dst, stage="bench-copy", force=True) as out:
    ts = out.tensor_set([ck.info(n).spec for n in ck.names()], prefix="model")
    for n in ck.names():
        ts.write(n, ck.load(n))
RESULT = {"seconds": time.perf_counter() - t}
"""


def dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file())


def bench_throughput(sizes: list[int], work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for gb in sizes:
        layers = max(1, round((gb * 1e9 - 2 * 32000 * 4096 * 2) / (202e6 * 2)))
        model = work / f"llama-{gb}gb"
        t = time.perf_counter()
        nbytes = write_synthetic(model, layers)
        print(f"[throughput] synthetic {gb} GB Llama ({layers} layers, {nbytes / 1e9:.2f} GB) written in "
              f"{time.perf_counter() - t:.0f}s; load {_load()}", flush=True)
        kinds = (("copy", USER_COPY_CHILD), ("cp", COPY_CHILD), ("dsconv_copy", DSCONV_COPY_CHILD),
                 ("quantize", QUANT_CHILD))
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k, _ in kinds}
        for rep in range(2):
            for kind, code in kinds:
                dst = work / f"{kind}-{gb}"
                shutil.rmtree(dst, ignore_errors=True)
                r = _child(code, str(model), str(dst))
                r["output_bytes"] = dir_bytes(dst)
                r["throughput_gbps"] = nbytes / r["seconds"] / 1e9
                runs[kind].append(r)
                shutil.rmtree(dst, ignore_errors=True)
                print(f"  {kind:11s} run {rep}: {r['seconds']:.1f}s, {r['throughput_gbps']:.3f} GB/s of input, "
                      f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB; load {_load()}", flush=True)
        best = {k: max(v, key=lambda r: r["throughput_gbps"]) for k, v in runs.items()}
        ratio = best["quantize"]["throughput_gbps"] / best["copy"]["throughput_gbps"]
        out[f"{gb}GB"] = {"input_bytes": nbytes, "layers": layers, "runs": runs,
                          "quantize_gbps": best["quantize"]["throughput_gbps"],
                          "copy_gbps": best["copy"]["throughput_gbps"], "ratio_vs_copy": ratio,
                          "cp_gbps": best["cp"]["throughput_gbps"],
                          "ratio_vs_cp": best["quantize"]["throughput_gbps"] / best["cp"]["throughput_gbps"],
                          "dsconv_copy_gbps": best["dsconv_copy"]["throughput_gbps"],
                          "ratio_vs_dsconv_copy": best["quantize"]["throughput_gbps"]
                          / best["dsconv_copy"]["throughput_gbps"],
                          "quantize_peak_rss_gib": max(r["peak_rss_bytes"] for r in runs["quantize"]) / 2**30,
                          "copy_peak_rss_gib": max(r["peak_rss_bytes"] for r in runs["copy"]) / 2**30}
        print(f"  => {gb} GB: quantize {ratio:.2f}x a read/write copy (goal >= 0.7), "
              f"{out[f'{gb}GB']['ratio_vs_cp']:.2f}x cp (copy_file_range), "
              f"{out[f'{gb}GB']['ratio_vs_dsconv_copy']:.2f}x dsconv's own streaming copy; peak RSS "
              f"{out[f'{gb}GB']['quantize_peak_rss_gib']:.2f} GiB (goal <= 1.5)", flush=True)
        shutil.rmtree(model, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------------ 1b. memory
def deepseek_config(vocab: int, moe_layers: int, experts: int = 4) -> dict[str, Any]:
    """DeepSeek-V3's real dimensions (hidden 7168, MLA, dense MLP 18432, experts 2048) with one dense layer, a few
    MoE layers of `experts` routed experts, and `vocab` (129280 is the real one: 1.85 GB embedding and lm_head)."""
    cfg = json.loads((ROOT / "tests" / "data" / "deepseek_v3_config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg.update(vocab_size=vocab, num_hidden_layers=1 + moe_layers, first_k_dense_replace=1, n_routed_experts=experts,
               num_experts_per_tok=2, n_group=1, topk_group=1, num_nextn_predict_layers=0)
    return cfg


# label: (vocab, MoE layers, routed experts). "6GB" has DeepSeek-V3's proportions (the linears are most of the bytes,
# so a weight-only output is about half the input); the others carry the real 1.85 GB embedding and lm_head.
MEMORY_SIZES = {"2GB": (32000, 0, 4), "5.7GB": (129280, 1, 4), "6GB": (32000, 3, 8), "8GB": (129280, 4, 4)}
# `dsconv quantize` as a user runs it (default --workers: the CPU count); every linear int8 by round-to-nearest:
# vLLM-Ascend has no W8A16 MoE scheme, so the routed experts are W8A8_DYNAMIC, the same int8 weights and scales
QUANTIZE_ARGS = ["--scheme", "w8a16", "--method", "rtn", "--engine", "vllm-ascend", "--moe-scheme", "w8a8_dynamic"]


def _quiet(limit: float, wait_s: float) -> float:
    """Wait (up to wait_s) for the 1-minute load average to fall below `limit`; return it."""
    end = time.time() + wait_s
    while os.getloadavg()[0] > limit and time.time() < end:
        time.sleep(15)
    return os.getloadavg()[0]


def _drop_caches() -> bool:
    """Empty the page cache (root only): what a checkpoint larger than the host's RAM always meets."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _evict(root: Path) -> None:
    """Drop one directory's files from the page cache (posix_fadvise DONTNEED after a sync; no root needed): a cold
    input while the interpreter, numba and dsconv's own files stay cached, as on a host that runs dsconv daily."""
    os.sync()
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _cold_pair(model: Path, dst: Path, out: Path, env: dict, work: Path, extra: list[str] | None,
               everything: bool = True) -> dict[str, Any] | None:
    """`cp -r` then `quantize`, each with its input out of the page cache and timed until its output is on disk
    (sync): the comparison at DeepSeek scale, where 1.3 TB never sits in the page cache. `everything`: the whole
    page cache dropped (programs and libraries too; root only, else None), else only the input's files."""
    def cold() -> bool:
        if everything:
            return _drop_caches()
        _evict(model)
        return True

    shutil.rmtree(dst, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    if not cold():
        return None
    t = time.perf_counter()
    subprocess.run(["cp", "-r", str(model), str(dst)], check=True)
    os.sync()
    cp_s = time.perf_counter() - t
    shutil.rmtree(dst, ignore_errors=True)
    cold()
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dsconv", "quantize", "-m", str(model), "-o", str(out), "--force",
                    *QUANTIZE_ARGS, *(extra or [])], env=env, cwd=str(work), check=True, capture_output=True)
    os.sync()
    q_s = time.perf_counter() - t
    return {"cp_r_s": round(cp_s, 2), "quantize_s": round(q_s, 2), "ratio_vs_cp": round(cp_s / q_s, 3)}


def copy_vs_quantize(model: Path, work: Path, reps: int, code: Path = ROOT, extra: list[str] | None = None,
                     quiet: float = 1.5, wait_s: float = 0.0) -> list[dict[str, Any]]:
    """`reps` pairs, each `cp -r` of the checkpoint then `dsconv quantize` of it (a CLI child, its process tree's
    memory sampled), the input in the page cache for both (a first untimed `cp -r` reads it in), the outputs synced
    and deleted between runs; the 1-minute load before and after each pair."""
    from benchmarks.common import run_tree_sampled

    env = {**os.environ, "PYTHONPATH": str(code), "TOKENIZERS_PARALLELISM": "false"}
    dst, out = work / "cp-copy", work / "rtn-out"
    runs = []
    for rep in range(reps + 1):
        shutil.rmtree(dst, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
        load0 = _quiet(quiet, wait_s) if rep else os.getloadavg()[0]
        t = time.perf_counter()
        subprocess.run(["cp", "-r", str(model), str(dst)], check=True)
        cp_s = time.perf_counter() - t
        shutil.rmtree(dst, ignore_errors=True)
        os.sync()
        if not rep:
            continue  # the warm-up: the input is now in the page cache
        q = run_tree_sampled([sys.executable, "-m", "dsconv", "quantize", "-m", str(model), "-o", str(out), "--force",
                              *QUANTIZE_ARGS, *(extra or [])], every=0.1, env=env, cwd=str(work), pss=False)
        r = {"cp_r_s": round(cp_s, 2), "quantize_s": q["wall_s"], "ratio_vs_cp": round(cp_s / q["wall_s"], 3),
             "output_bytes": dir_bytes(out), "tree_peak_rss_bytes": q["tree_peak_rss_bytes"],
             "driver_peak_rss_bytes": q["driver_peak_rss_bytes"],
             "largest_worker_peak_rss_bytes": q["largest_worker_peak_rss_bytes"],
             "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2)}
        cold = _cold_pair(model, dst, out, env, work, extra)
        if cold is not None:
            r["cold"] = cold
        r["cold_input"] = cold_in = _cold_pair(model, dst, out, env, work, extra, everything=False)
        runs.append(r)
        print(f"  run {rep}: cp -r {cp_s:.2f} s, quantize {q['wall_s']:.2f} s = {r['ratio_vs_cp']:.2f}x cp's speed; "
              f"process tree's peak RSS {q['tree_peak_rss_bytes'] / 1e9:.2f} GB; "
              f"load {r['load_before']} -> {r['load_after']}" + (
                  f"; cold, synced: cp -r {cold['cp_r_s']:.2f} s, quantize {cold['quantize_s']:.2f} s = "
                  f"{cold['ratio_vs_cp']:.2f}x" if cold else "") +
              f"; input cold: cp -r {cold_in['cp_r_s']:.2f} s, quantize {cold_in['quantize_s']:.2f} s = "
              f"{cold_in['ratio_vs_cp']:.2f}x", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return runs


def bench_memory(work: Path, labels: list[str] | None = None, reps: int = 3, code: Path = ROOT,
                 quiet: float = 1.5, wait_s: float = 0.0) -> dict[str, Any]:
    """Weight-only at copy speed (issue 32): `quantize --scheme w8a16 --method rtn` of DeepSeek-V3-shaped bf16
    checkpoints beside `cp -r` of the same directory, interleaved in one run (`copy_vs_quantize`). Goals: >= 1.0x
    cp's speed, the quantized linears written in half their bytes, the process tree's peak RSS <= 1 GB and flat in
    size (a whole-tensor pass-through of the 1.85 GB embedding would reach 2.26 GB). `code`: another checkout's
    dsconv, for a before/after pair on the same inputs."""
    out: dict[str, Any] = {}
    for label in labels or list(MEMORY_SIZES):
        vocab, moe, experts = MEMORY_SIZES[label]
        model = work / f"deepseek-{label}"
        t = time.perf_counter()
        nbytes = write_synthetic(model, 0, cfg=deepseek_config(vocab, moe, experts))
        floats = 2 * 2 * vocab * 7168  # embedding and lm_head stay bf16 (norms and the router are negligible)
        print(f"[memory] synthetic DeepSeek-V3-shaped {label} (vocab {vocab}, 1 dense + {moe} MoE layers of "
              f"{experts} experts, {nbytes / 1e9:.2f} GB) written in {time.perf_counter() - t:.0f}s; load {_load()}",
              flush=True)
        runs = copy_vs_quantize(model, work, reps, code, quiet=quiet, wait_s=wait_s)
        shutil.rmtree(model, ignore_errors=True)
        best = max(runs, key=lambda r: r["ratio_vs_cp"])
        q_bytes = best["output_bytes"]
        out[label] = {"input_bytes": nbytes, "output_bytes": q_bytes, "output_over_input": round(q_bytes / nbytes, 3),
                      "linears_output_over_input": round((q_bytes - floats) / (nbytes - floats), 3),
                      "largest_tensor_bytes": 2 * vocab * 7168, "runs": runs, "best_ratio_vs_cp": best["ratio_vs_cp"],
                      "peak_rss_bytes": max(r["tree_peak_rss_bytes"] for r in runs),
                      "peak_rss_gb": round(max(r["tree_peak_rss_bytes"] for r in runs) / 1e9, 3)}
        for key in ("cold", "cold_input"):
            ratios = [r[key]["ratio_vs_cp"] for r in runs if r.get(key)]
            if ratios:
                out[label][f"{key}_ratio_vs_cp"] = [min(ratios), max(ratios)]
                print(f"  => {label}, {key.replace('_', ' ')}: {min(ratios):.2f}-{max(ratios):.2f}x cp -r", flush=True)
        print(f"  => {label}: best {best['ratio_vs_cp']:.2f}x cp -r (goal >= 1.0; load {best['load_before']} -> "
              f"{best['load_after']}); writes {q_bytes / nbytes:.2f} of the bytes it reads ("
              f"{out[label]['linears_output_over_input']:.2f} of the linears'); tree peak RSS "
              f"{out[label]['peak_rss_gb']:.2f} GB (goal <= 1.0)", flush=True)
    peaks = [v["peak_rss_bytes"] for v in out.values()]
    out["peak_rss_spread_gb"] = round((max(peaks) - min(peaks)) / 1e9, 3)
    print(f"  => peak RSS from {min(peaks) / 1e9:.2f} to {max(peaks) / 1e9:.2f} GB across "
          f"{', '.join(k for k in out if k in MEMORY_SIZES)}", flush=True)
    return out


# ------------------------------------------------------------------------------------------ 1c. kernel
KERNEL_CHILD = """
import sys, time, json
t0 = time.perf_counter()
import numpy as np, torch
from dsconv.quant.algorithms.schemes import quantize_weight_per_group
from dsconv.quant.algorithms.error_metrics import sampled_weight_error
imports = time.perf_counter() - t0
torch.set_num_threads(1)
gen = torch.Generator().manual_seed(0)
out = {"imports_s": round(imports, 3)}
for name, (n, k, g, bits) in {"expert 2048x7168 w8 per channel": (2048, 7168, 0, 8),
                              "expert 2048x7168 w4 group 128": (2048, 7168, 128, 4)}.items():
    w = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
    for src, x in (("bf16", w), ("float32", w.float())):
        t = time.perf_counter(); quantize_weight_per_group(x, g, bits); first = time.perf_counter() - t
        best = 1e9
        for _ in range(3):
            c = time.process_time(); q, sc, _ = quantize_weight_per_group(x, g, bits); best = min(best, time.process_time() - c)
        sampled_weight_error(x, q, sc)  # its kernel loaded (or compiled) before the timing
        err = 1e9
        for _ in range(3):
            c = time.process_time(); sampled_weight_error(x, q, sc); err = min(err, time.process_time() - c)
        out[f"{name}, {src}"] = {"ns_per_element_cpu": round(best / (n * k) * 1e9, 3),
                                 "first_call_s": round(first, 3), "report_error_ns_per_element": round(err / (n * k) * 1e9, 3)}
RESULT = out
"""


def bench_kernel() -> dict[str, Any]:
    """The rounding kernel alone (scale_grid + rtn_kernel: max |w|, both grid candidates, the integers) on one
    DeepSeek expert-shaped weight, one thread, CPU ns per element; the first call includes loading (or compiling)
    the kernel, `imports_s` the start-up every CLI run pays. Before the compiled kernel, the numpy rule cost 8.9 ns
    per element on the same shape (docs/performance.md)."""
    r = _child(KERNEL_CHILD)
    for k, v in r.items():
        if isinstance(v, dict):
            print(f"[kernel] {k}: {v['ns_per_element_cpu']:.2f} ns/element CPU (first call {v['first_call_s']:.2f} s; "
                  f"report error {v['report_error_ns_per_element']:.2f} ns/element)", flush=True)
    print(f"[kernel] imports {r['imports_s']:.2f} s; peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB", flush=True)
    return r


# ------------------------------------------------------------------------------------------ 2. calibration time
CALIB_CHILD = """
import sys, time, torch
from pathlib import Path
from dsconv.checkpoint import Checkpoint
from dsconv.io.writer import OutputDir
from dsconv.quant.calibrate.calibration import Calibrator
from dsconv.quant.calibrate.data import load_calib
from dsconv.runner.texts import load_tokenizer
from dsconv.runner.layers import load_full_model
from dsconv.quant.formats.output import QuantWriter
from dsconv.quant.plan.options import QuantOptions
from dsconv.quant.plan.plan import make_plan
model_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
ck = Checkpoint.open(model_dir)
cs = load_calib(None, load_tokenizer(model_dir))
model, sk = load_full_model(ck)
lengths = [len(s) for s in cs.samples]

def plain():  # the same padded batches as the calibrator (4096 padded tokens), decoder only
    order = sorted(range(len(lengths)), key=lambda j: (-lengths[j], j))
    t = time.perf_counter()
    with torch.no_grad():
        while order:
            per = max(1, 4096 // lengths[order[0]])
            batch, order = order[:per], order[per:]
            L = max(lengths[j] for j in batch)
            ids = torch.zeros(len(batch), L, dtype=torch.long)
            for r, j in enumerate(batch):
                ids[r, :lengths[j]] = torch.tensor(cs.samples[j])
            model.model(ids)
    return time.perf_counter() - t

def calibrate():
    opts = QuantOptions(scheme="w8a8")
    plan = make_plan(ck, "w8a8")
    t = time.perf_counter()
    with OutputDir(out_dir, stage="quantize", force=True) as out:
        qw = QuantWriter(out, ck, plan, "msmodelslim", 4 * 10**9, staged=True)
        c = Calibrator(ck, plan, opts, cs, qw, progress=False)
        c.run()
        qw.finish()
    return time.perf_counter() - t, c.timings

runs = []
for _ in range(3):  # interleaved in one process, so load drift hits both alike
    p = plain()
    total, timings = calibrate()
    runs.append({"plain": p, "total": total, **timings})
RESULT = {"tokens": cs.tokens, "samples": len(cs.samples), "runs": runs}
"""


def random_llama(out: Path, tok: Any, hidden: int = 1024, layers: int = 6) -> Path:
    from dsconv.tiny import make_tiny

    return make_tiny("llama", out, dtype="bf16", tokenizer=tok, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                     num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64)


def bench_calibration(work: Path) -> dict[str, Any]:
    from dsconv.bundled import calib_texts
    from dsconv.tiny import train_tokenizer

    tok = train_tokenizer(calib_texts(), vocab_size=2048)
    model = work / "llama-1024"
    if not (model / "config.json").is_file():
        random_llama(model, tok)
    r = _child(CALIB_CHILD, str(model), str(work / "cal-out"))
    runs = r["runs"]
    f = min(x["plain"] for x in runs)
    stats = min(x["forward"] for x in runs)
    total = min(x["total"] for x in runs)
    quant = min(x["quantize"] for x in runs)
    res = {"model": "llama hidden 1024, 6 layers, random bf16", "tokens": r["tokens"], "samples": r["samples"],
           "plain_forward_seconds": f, "statistics_pass_seconds": stats, "total_seconds": total,
           "quantize_measure_write_seconds": quant, "statistics_pass_ratio": stats / f, "total_ratio": total / f,
           "runs": runs, "peak_rss_gib": r["peak_rss_bytes"] / 2**30}
    print(f"[calibration] {r['tokens']} tokens, 3 interleaved runs (best of each): plain forward {f:.2f}s; dsconv "
          f"statistics pass (layer-by-layer forward + hooks) {stats:.2f}s = {res['statistics_pass_ratio']:.2f}x "
          f"(goal <= 1.3); whole W8A8 run (load layers, statistics, quantize, measure, write) {total:.2f}s = "
          f"{res['total_ratio']:.2f}x; load {_load()}", flush=True)
    shutil.rmtree(work / "cal-out", ignore_errors=True)
    return res


# ------------------------------------------------------------------------------------------ 3. accuracy targets
def docstrings(limit_chars: int = 3_000_000) -> list[str]:
    """English paragraphs from the standard library's docstrings (on every machine, no download)."""
    import sysconfig

    paras: list[str] = []
    total = 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    for p in doc.split("\n\n"):
                        p = " ".join(p.split())
                        if len(p) > 60:
                            paras.append(p)
                            total += len(p)
        if total > limit_chars:
            break
    return paras


def train_small_llama(out: Path, steps: int, seed: int = 0) -> dict[str, Any]:
    import torch
    import transformers

    from dsconv.bundled import calib_texts
    from dsconv.tiny import train_tokenizer

    torch.manual_seed(seed)
    random.seed(seed)
    paras = docstrings()
    random.shuffle(paras)
    n_eval = len(paras) // 20
    eval_paras, calib_paras, train_paras = paras[:n_eval], paras[n_eval:n_eval + 128], paras[n_eval:]
    train_texts = train_paras + calib_texts()
    tok = train_tokenizer(train_texts, vocab_size=2048)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    ids: list[int] = []
    for t in train_texts:
        ids += tok(t)["input_ids"] + [tok.eos_token_id]
    data = torch.tensor(ids)
    seq, batch = 128, 16
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    model.train()
    t0 = time.perf_counter()
    losses = []
    for step in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,))
        x = torch.stack([data[s:s + seq] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step}: loss {loss.item():.3f} ({time.perf_counter() - t0:.0f}s)", flush=True)
    model.eval()
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    (out / "eval.txt").write_text("\n\n".join(eval_paras), encoding="utf-8")
    with open(out / "calib.jsonl", "w", encoding="utf-8") as f:
        for p in calib_paras:
            f.write(json.dumps({"text": p}) + "\n")
    return {"params": sum(p.numel() for p in model.parameters()), "train_tokens": int(data.numel()), "steps": steps,
            "final_loss": sum(losses[-20:]) / 20, "train_seconds": time.perf_counter() - t0,
            "eval_paragraphs": len(eval_paras)}


def bench_targets(work: Path, steps: int) -> dict[str, Any]:
    from dsconv.quant.evaluate.fidelity import evaluate
    from dsconv.quant.plan.options import QuantOptions
    from dsconv.quant.stage import QuantRequest, run

    model = work / "trained-llama"
    info = train_small_llama(model, steps)
    print(f"[targets] trained a {info['params'] / 1e6:.1f}M-parameter Llama on {info['train_tokens']} tokens, "
          f"{steps} steps, final loss {info['final_loss']:.3f} ({info['train_seconds']:.0f}s)", flush=True)
    calib = model / "calib.jsonl"
    runs = {
        "w8a16": QuantOptions(scheme="w8a16"),
        "w8a8": QuantOptions(scheme="w8a8", calib=calib),
        "w8a8_no_fallback": QuantOptions(scheme="w8a8", calib=calib, fallback=0),
        "w8a8_smooth0.5": QuantOptions(scheme="w8a8", calib=calib, smooth_alpha=0.5),
        "w8a8_bundled_calib": QuantOptions(scheme="w8a8"),
        "w8a8_dynamic": QuantOptions(scheme="w8a8_dynamic"),
        "w4a16_gptq_g128": QuantOptions(scheme="w4a16", group_size=128, method="gptq", calib=calib),
        "w4a16_rtn_g128": QuantOptions(scheme="w4a16", group_size=128, method="rtn"),
        "w4a16_gptq_g0": QuantOptions(scheme="w4a16", group_size=0, method="gptq", calib=calib),
        "w4a16_rtn_g0": QuantOptions(scheme="w4a16", group_size=0, method="rtn"),
    }
    results: dict[str, Any] = {"model": info}
    for name, opts in runs.items():
        out = work / f"q-{name}"
        s = run(QuantRequest(model, out, opts, force=True, progress=False)).summary
        e = evaluate(model, out, text=model / "eval.txt", seq_len=256, progress=False)
        results[name] = {"linears": s["linears"], "fell_back": s["fallback"]["fell_back"],
                         "worst_units": [u for u in s["fallback"]["units"] if u["error"] is not None][:4],
                         **{k: e[k] for k in ("ppl_original", "ppl_quantized", "ppl_change_pct", "top1_agreement",
                                              "logits_relative_error", "kl_divergence", "tokens")}}
        print(f"  {name:20s} ppl {e['ppl_original']:.3f} -> {e['ppl_quantized']:.3f} ({e['ppl_change_pct']:+.3f}%), "
              f"top-1 {e['top1_agreement'] * 100:.2f}%, KL {e['kl_divergence']:.5f}; fallbacks "
              f"{s['fallback']['fell_back'] or 'none'}", flush=True)
        shutil.rmtree(out, ignore_errors=True)
    results["targets_met"] = {
        "w8a16_within_0.5pct": abs(results["w8a16"]["ppl_change_pct"]) <= 0.5,
        "w8a8_within_2pct": abs(results["w8a8"]["ppl_change_pct"]) <= 2.0,
        "w4a16_gptq_better_than_rtn_g128": results["w4a16_gptq_g128"]["ppl_change_pct"]
        < results["w4a16_rtn_g128"]["ppl_change_pct"],
    }
    print(f"  targets: {results['targets_met']}", flush=True)
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_quantize")
    ap.add_argument("parts", nargs="*", default=["memory", "kernel", "throughput", "calibration", "targets"])
    ap.add_argument("--sizes", default="2,8", help="synthetic model sizes in GB")
    ap.add_argument("--memory-sizes", default=None, help="of 2GB,5.7GB,6GB,8GB (default: all)")
    ap.add_argument("--reps", type=int, default=3, help="cp -r / quantize pairs per size (memory)")
    ap.add_argument("--code", type=Path, default=ROOT, help="the checkout whose dsconv quantizes (memory)")
    ap.add_argument("--quiet", type=float, default=1.5, help="load below which a pair starts (memory)")
    ap.add_argument("--wait", type=float, default=0.0, help="seconds to wait for that load (memory)")
    ap.add_argument("--steps", type=int, default=400, help="training steps of the small model")
    ap.add_argument("--work", default=None, help="scratch directory (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    known = ("memory", "kernel", "throughput", "calibration", "targets")
    args.parts = [p for p in args.parts if p in known] or list(known)  # `python -m benchmarks quantize`: all
    RESULTS.mkdir(exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="dsconv-bench-quant-"))
    work.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "quantize.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    results["machine"] = {"cpus": os.cpu_count(), "load_at_start": _load()}
    try:
        if "memory" in args.parts:
            results["memory"] = bench_memory(work, args.memory_sizes.split(",") if args.memory_sizes else None,
                                             args.reps, args.code, args.quiet, args.wait)
        if "kernel" in args.parts:
            results["kernel"] = bench_kernel()
        if "throughput" in args.parts:
            results["throughput"] = bench_throughput([int(x) for x in args.sizes.split(",")], work)
        if "calibration" in args.parts:
            results["calibration"] = bench_calibration(work)
        if "targets" in args.parts:
            results["targets"] = bench_targets(work, args.steps)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"results: {path}")
    return results


if __name__ == "__main__":
    main()
