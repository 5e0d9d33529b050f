"""`dsconv eval` at DeepSeek-V3's layer shapes: peak memory and time per layer of the layer-streamed pass, and the
projection of a full DeepSeek-V3 eval of 2 x 512 tokens.

    python -m benchmarks eval              # ~5.7 GB checkpoint: 1 dense + 1 MoE layer (4 experts), vocab 129280
    python -m benchmarks.bench_eval --moe-layers 2 --experts 8
    python -m benchmarks.bench_eval mix    # W8A8_MIX on the Qwen fixture: both paths beside one float pass

The checkpoint is benchmarks/bench_quantize.py's synthetic DeepSeek-V3 (real hidden size, MLA, dense MLP 18432,
expert 2048, the real 1.85 GB embedding and lm_head) with a small trained tokenizer; the quantized side is
`dsconv quantize --scheme w8a16 --method rtn` of it (the streamed weight-only path; no calibration, which at these
shapes would need more memory than the eval). The eval runs in a child process
whose VmHWM (anonymous and mapped file pages) is the peak. Goal: <= 1.5 GB for 2 x 512 tokens.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_quantize import _child, _load, deepseek_config, write_synthetic

ROOT = Path(__file__).resolve().parent.parent
DEEPSEEK_V3 = {"layers": 61, "dense": 3, "experts": 256, "top_k": 8}

EVAL_CHILD = """
import sys, json
from pathlib import Path
from dsconv.quant.evaluate.fidelity import evaluate
r = evaluate(Path(sys.argv[1]), Path(sys.argv[2]), text=Path(sys.argv[3]), seq_len=512, samples=2, progress=False)
RESULT = {k: r[k] for k in ("tokens", "ppl_original", "ppl_quantized", "kl_divergence", "top1_agreement", "seconds",
                            "seconds_per_layer", "layer_seconds", "expert_seconds", "expert_runs")}
"""


def build(work: Path, moe_layers: int, experts: int) -> tuple[Path, Path, Path, int]:
    """The synthetic checkpoint with a tokenizer, its W8A16 output, and a text of a few thousand tokens."""
    from dsconv.bundled import calib_texts
    from dsconv.quant.plan.options import QuantOptions
    from dsconv.quant.stage import QuantRequest, run
    from dsconv.tiny import train_tokenizer

    model, out = work / "deepseek", work / "deepseek-w8a16"
    cfg = deepseek_config(129280, moe_layers, experts)
    nbytes = write_synthetic(model, 0, cfg=cfg)
    train_tokenizer(calib_texts(), vocab_size=384).save_pretrained(str(model))
    run(QuantRequest(model, out, QuantOptions(scheme="w8a16", method="rtn", ignore=("shared_expert",)), force=True,
                     progress=False))
    text = work / "eval.txt"
    text.write_text(" ".join(calib_texts())[:20000].replace("\n", " "))  # one paragraph: chunks of 512 tokens
    return model, out, text, nbytes


def project(r: dict[str, Any], moe_layers: int) -> dict[str, Any]:
    """Full DeepSeek-V3 (3 dense + 58 MoE layers, 256 experts, 8 per token) from the measured layers: a MoE layer is
    its measured time without its routed experts (attention, router, shared expert) plus 256 expert runs at the
    measured cost of one (both models), since 2 x 512 tokens x 8 routes reach every expert. The vocabulary
    projection and embedding are the rest of the measured time, once."""
    layer_s = r["layer_seconds"]
    dense = layer_s[0]
    per_expert = r["expert_seconds"] / max(1, r["expert_runs"]) * 2  # a run is one side's: both sides run each expert
    moe_rest = (sum(layer_s[1:]) - r["expert_seconds"]) / max(1, moe_layers)
    moe_full = moe_rest + per_expert * DEEPSEEK_V3["experts"]
    head = r["seconds"] - sum(layer_s)
    one = DEEPSEEK_V3["dense"] * dense + (DEEPSEEK_V3["layers"] - DEEPSEEK_V3["dense"]) * moe_full + head
    return {"dense_layer_s": round(dense, 2), "moe_layer_without_experts_s": round(moe_rest, 2),
            "expert_both_models_s": round(per_expert, 3), "full_moe_layer_s": round(moe_full, 1),
            "embedding_and_head_s": round(head, 1), "one_host_h": round(one / 3600, 2),
            "experts_share": round((DEEPSEEK_V3["layers"] - DEEPSEEK_V3["dense"]) * per_expert
                                   * DEEPSEEK_V3["experts"] / one, 3)}


REAL_CHILD = """
import sys, json, time
from pathlib import Path
from dsconv.checkpoint import Checkpoint
from dsconv.quant.evaluate.fidelity import eval_chunks, compare, load_original_model, load_quantized_model
from dsconv.quant.evaluate.streamed import StreamedModel, batch_tokens, run_pass
from dsconv.runner.metrics import text_metrics
ck, qck = Checkpoint.open(sys.argv[1]), Checkpoint.open(sys.argv[2])
chunks, _ = eval_chunks(ck, Path(sys.argv[3]), 512, 4)
t = time.perf_counter()
mem = compare(load_original_model(ck), load_quantized_model(qck)[0], chunks, progress=False)
t_mem = time.perf_counter() - t
t = time.perf_counter()
orig = StreamedModel(ck, False)
got = text_metrics(run_pass(orig, StreamedModel(qck, True), chunks, batch_tokens(orig.sk.config), progress=False))
RESULT = {"in_memory": mem, "streamed": got, "in_memory_s": round(t_mem, 1),
          "streamed_s": round(time.perf_counter() - t, 1)}
"""


def equivalence_real(work: Path) -> dict[str, Any]:
    """The streamed pass against the whole-model path on the real fixtures (W8A16 RTN outputs, 4 x 512 tokens of
    pydoc_data.topics): every figure equal to float rounding. Skipped where a fixture is not built."""
    import pydoc_data.topics as topics

    from benchmarks.bench_fidelity import fixture_dir
    from dsconv.quant.plan.options import QuantOptions
    from dsconv.quant.stage import QuantRequest, run

    text = work / "topics.txt"
    text.write_text(" ".join(topics.topics[k].strip().replace("\n", " ") for k in sorted(topics.topics)))
    out: dict[str, Any] = {}
    for name in ("qwen", "gemma"):
        model = fixture_dir(name)
        if not (model / "config.json").exists():
            print(f"[eval] no fixture {model}: build it with `python -m benchmarks.real_models` - skipped")
            continue
        q = work / f"{name}-w8a16"
        run(QuantRequest(model, q, QuantOptions(scheme="w8a16", method="rtn"), force=True, progress=False))
        r = _child(REAL_CHILD, str(model), str(q), str(text))
        worst = max(abs(r["streamed"][k] - v) / max(abs(v), 1e-12) for k, v in r["in_memory"].items() if v)
        out[name] = {**r, "max_relative_difference": worst}
        print(f"  => {name}: streamed vs whole-model, largest relative difference of any figure {worst:.2e}; ppl "
              f"change {r['in_memory']['ppl_change_pct']:+.4f}% vs {r['streamed']['ppl_change_pct']:+.4f}%; "
              f"{r['in_memory_s']} s vs {r['streamed_s']} s; peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB (both)",
              flush=True)
        shutil.rmtree(q, ignore_errors=True)
    return out


MIX_CHILD = """
import sys, time
from pathlib import Path
from dsconv.quant.evaluate.fidelity import evaluate
model, q, text = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
keep = ("ppl_original", "ppl_quantized", "kl_divergence", "top1_agreement")
t = time.perf_counter()
both = evaluate(model, q, text=text, seq_len=512, samples=4, progress=False)
t_both = time.perf_counter() - t
each, t = {}, time.perf_counter()
for path in ("static", "dynamic"):
    each[path] = evaluate(model, q, text=text, seq_len=512, samples=4, progress=False, mix_paths=(path,))
t_each = time.perf_counter() - t
RESULT = {"both_s": round(t_both, 1), "each_s": round(t_each, 1), "tokens": both["tokens"],
          "both": {p: {k: m[k] for k in keep} for p, m in both["paths"].items()},
          "each": {p: {k: r[k] for k in keep} for p, r in each.items()}}
"""


def mix_real(work: Path) -> dict[str, Any]:
    """`dsconv eval` of a W8A8_MIX output (the Qwen fixture, `--engine vllm-ascend`, 32 calibration pairs: the eval's
    cost does not depend on them) over 4 x 512 tokens of pydoc_data.topics: both paths in one run - one float pass
    beside the two quantized ones - against each path evaluated on its own (a float pass each, as before
    2026-12-03 late), in one child process. The figures must be the same."""
    import pydoc_data.topics as topics

    from benchmarks.bench_fidelity import fixture_dir
    from dsconv.quant.plan.options import QuantOptions
    from dsconv.quant.stage import QuantRequest, run

    model = fixture_dir("qwen")
    if not (model / "config.json").exists():
        print(f"[eval] no fixture {model}: build it with `python -m benchmarks.real_models` - skipped")
        return {}
    text = work / "topics.txt"
    text.write_text(" ".join(topics.topics[k].strip().replace("\n", " ") for k in sorted(topics.topics)))
    q = work / "qwen-w8a8-mix"
    run(QuantRequest(model, q, QuantOptions(scheme="w8a8_mix", engine="vllm-ascend", calib_samples=32), force=True,
                     progress=False))
    load0 = _load()
    r = _child(MIX_CHILD, str(model), str(q), str(text))
    r.update(load_before=load0, load_after=_load(), saved=round(1 - r["both_s"] / r["each_s"], 3),
             same_figures=r["both"] == r["each"])
    print(f"  => W8A8_MIX eval of {r['tokens']} tokens, Qwen2.5-Coder-0.5B: both paths in one run {r['both_s']} s, "
          f"each on its own {r['each_s']} s ({r['saved']:.0%} less); the same figures: {r['same_figures']}; "
          f"load {load0}", flush=True)
    shutil.rmtree(q, ignore_errors=True)
    return r


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(argv if argv is not None else sys.argv[1:])
    if argv[:1] == ["mix"]:  # the W8A8_MIX pair alone, merged into the last eval.json
        from benchmarks.common import merge

        work = Path("/tmp/dsconv-bench-eval-mix")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        r = mix_real(work)
        merge("eval", "w8a8_mix_real", r, quiet=True)
        shutil.rmtree(work, ignore_errors=True)
        return r
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moe-layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--work", type=Path, default=Path("/tmp/dsconv-bench-eval"))
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import save

    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    t = time.perf_counter()
    model, out, text, nbytes = build(a.work, a.moe_layers, a.experts)
    print(f"[eval] DeepSeek-V3-shaped bf16 checkpoint of {nbytes / 1e9:.2f} GB (1 dense + {a.moe_layers} MoE layers "
          f"of {a.experts} experts, vocab 129280) and its W8A16 output in {time.perf_counter() - t:.0f}s; "
          f"load {_load()}", flush=True)
    load0 = _load()
    r = _child(EVAL_CHILD, str(model), str(out), str(text))
    res = {"checkpoint_bytes": nbytes, "moe_layers": a.moe_layers, "experts": a.experts, **r,
           "peak_rss_gb": round(r["peak_rss_bytes"] / 1e9, 3), "load_before": load0, "load_after": _load(),
           "date": time.strftime("%Y-%m-%d"), "projection": project(r, a.moe_layers)}
    print(f"  => eval of {r['tokens']} tokens: peak RSS {res['peak_rss_gb']:.2f} GB (goal <= 1.5), {r['seconds']:.1f}s "
          f"({', '.join(f'{s:.1f}' for s in r['layer_seconds'])} s per layer); load {load0} -> {_load()}", flush=True)
    p = res["projection"]
    print(f"  => full DeepSeek-V3 (61 layers, 256 experts), 2 x 512 tokens, one host: {p['one_host_h']} h "
          f"(dense layer {p['dense_layer_s']} s, MoE layer {p['full_moe_layer_s']} s)", flush=True)
    res["real_fixtures"] = equivalence_real(a.work)
    res["w8a8_mix_real"] = mix_real(a.work)
    save("eval", res, quiet=True)
    shutil.rmtree(a.work, ignore_errors=True)
    return res


if __name__ == "__main__":
    main()
