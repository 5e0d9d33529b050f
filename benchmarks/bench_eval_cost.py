"""What `dsconv eval` costs against plain transformers on the real fixtures, and how its plan's estimate compares.

    python -m benchmarks eval_cost                 # both fixtures (make bench-fidelity builds them)
    python -m benchmarks.bench_eval_cost --questions 32 --windows 8

For each real fixture (Qwen2.5-Coder-0.5B, Gemma-3-270M) and its W8A16 RTN output, in one child process each:
1. **Float answers**: eval's greedy decoding of the float model (`qa.greedy` on `load_original_model`, the cache
   eval uses) against `model.generate(do_sample=False)` of transformers' own model, loaded by
   `AutoModelForCausalLM.from_pretrained` in float32, on the same prompts (the bundled held-out questions) and the same
   stop tokens. Goal: <= 1.5x, the same tokens.
2. **Streamed pass**: eval's layer-at-a-time pass of both models (`fidelity.streamed_positions`) over the default eval
   text's windows, against a plain transformers forward (logits) of the float model run twice - the cost of both
   models in plain transformers, since a dequantized model costs what the float one does - over the same padded
   batches. Goal: <= 2x.
3. **Plan**: `eval --dry-run`'s estimate (passes: 2 FLOPs per weight a token meets at the host's matmul rate;
   answers: every float32 weight read per answer token at the host's matrix-vector bandwidth, all answers at full
   length) against the measured times of 2 and 1 (what `dsconv eval --qa` runs).
Timings depend on load: the child records the load average before and after.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from benchmarks.bench_quantize import _child, _load

CHILD = """
import sys, time, torch
from pathlib import Path
from dsconv.checkpoint import Checkpoint
from dsconv.quant.evaluate import int8_cache
from dsconv.quant.evaluate.fidelity import eval_chunks, load_original_model, streamed_positions
from dsconv.quant.evaluate.plan import eval_plan
from dsconv.quant.evaluate.qa import greedy, prompt_ids, read_questions, stop_ids
from dsconv.quant.evaluate.streamed import batch_tokens
from dsconv.runner.metrics import padded_batches, text_metrics
from dsconv.runner.texts import load_tokenizer
from transformers import AutoModelForCausalLM

model, quant, n_q, n_w, max_new = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), 64
ck, qck = Checkpoint.open(model), Checkpoint.open(quant)
tok = load_tokenizer(model)
questions, _ = read_questions(None)
prompts = [prompt_ids(tok, q.text)[0] for q in questions[:n_q]]
stop = stop_ids(tok, ck.family.flat_config(ck.config))
chunks, source = eval_chunks(ck, None, 512, n_w)

def timed(f):
    t = time.perf_counter()
    out = f()
    return out, time.perf_counter() - t

ours_model, t_load_ours = timed(lambda: load_original_model(ck))
ours, t_ours = timed(lambda: [greedy(ours_model, p, max_new, stop, int8_cache.new_cache(ours_model.config, None, {}))
                              for p in prompts])
del ours_model
pos, t_streamed = timed(lambda: streamed_positions(ck, qck, chunks, None, False)[0])
hf, t_load_hf = timed(lambda: AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval())
ends = sorted(stop)

def generate():
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, eos_token_id=ends,
                            pad_token_id=ends[0])[0, len(p):].tolist() for p in prompts]

theirs, t_generate = timed(generate)

def forward_twice():
    with torch.no_grad():
        for _ in range(2):
            for group, ids, mask in padded_batches(chunks, batch_tokens(hf.config)):
                hf(input_ids=ids, attention_mask=mask.long()).logits
theirs_fw, t_forward = timed(forward_twice)
plan = eval_plan(model, quant, chunks, source, len(prompts), max_new, sum(len(p) for p in prompts))
RESULT = {"questions": len(prompts), "answer_tokens": sum(map(len, ours)), "same_answers": sum(a == b for a, b in zip(ours, theirs)),
          "answers_s": round(t_ours, 2), "generate_s": round(t_generate, 2), "answers_ratio": round(t_ours / t_generate, 3),
          "load_s": round(t_load_ours, 2), "hf_load_s": round(t_load_hf, 2),
          "windows": len(chunks), "tokens": sum(map(len, chunks)), "streamed_s": round(t_streamed, 2),
          "streamed_layers_s": round(sum(pos.layer_seconds), 2), "forward_twice_s": round(t_forward, 2),
          "streamed_ratio": round(t_streamed / t_forward, 3), "ppl_change_pct": text_metrics(pos)["ppl_change_pct"],
          "plan": {k: plan[k] for k in ("estimate_s", "passes_s", "answers_s", "host_gflops", "host_gbps")},
          "measured_s": round(t_ours + t_streamed, 2), "measured_over_estimate": round((t_ours + t_streamed) / plan["estimate_s"], 2),
          "passes_over_estimate": round(t_streamed / plan["passes_s"], 2), "answers_over_estimate": round(t_ours / plan["answers_s"], 2)}
"""

GOALS = {"answers_ratio": 1.5, "streamed_ratio": 2.0}


def measure(name: str, work: Path, questions: int, windows: int) -> dict[str, Any] | None:
    from benchmarks.bench_fidelity import fixture_dir
    from dsconv.quant.plan.options import QuantOptions
    from dsconv.quant.stage import QuantRequest, run

    model = fixture_dir(name)
    if not (model / "config.json").exists():
        print(f"[eval_cost] no fixture {model}: build it with `python -m benchmarks.real_models` - skipped")
        return None
    q = work / f"{name}-w8a16"
    run(QuantRequest(model, q, QuantOptions(scheme="w8a16", method="rtn", engine="vllm-ascend"), force=True,
                     progress=False))
    load0 = _load()
    r = _child(CHILD, str(model), str(q), str(questions), str(windows))
    r.update(load_before=load0, load_after=_load(),
             met={k: r[k] <= goal for k, goal in GOALS.items()})
    print(f"  => {name}: float answers {r['answers_s']} s vs model.generate {r['generate_s']} s "
          f"({r['answers_ratio']}x, goal <= 1.5; {r['same_answers']}/{r['questions']} answers the same); streamed pass "
          f"{r['streamed_s']} s vs plain forward x2 {r['forward_twice_s']} s ({r['streamed_ratio']}x, goal <= 2) over "
          f"{r['tokens']} tokens; plan estimate {r['plan']['estimate_s']} s vs {r['measured_s']} s measured "
          f"({r['measured_over_estimate']}x: passes {r['passes_over_estimate']}x, answers {r['answers_over_estimate']}x "
          f"of an upper bound); load {load0} -> {r['load_after']}", flush=True)
    shutil.rmtree(q, ignore_errors=True)
    return r


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=8, help="bundled held-out questions answered (64 tokens each)")
    ap.add_argument("--windows", type=int, default=8, help="512-token windows of the default eval text")
    ap.add_argument("--work", type=Path, default=Path("/tmp/dsconv-bench-eval-cost"))
    a = ap.parse_args(argv if argv is not None else sys.argv[1:])
    from benchmarks.common import save

    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    out = {name: r for name in ("qwen", "gemma") if (r := measure(name, a.work, a.questions, a.windows))}
    save("eval_cost", {"questions": a.questions, "windows": a.windows, "fixtures": out}, quiet=True)
    shutil.rmtree(a.work, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
