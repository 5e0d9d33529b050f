"""What the calibrated path costs against the work it must do: `dsconv quantize --bits 8` beside a plain float
forward of the same calibration tokens through transformers' own model, in ONE process with the same threads.

    python -m benchmarks calib_cost
    python -m benchmarks.bench_calib_cost [--model qwen,gemma|DIR] [--engines mindie,vllm-ascend]
                                          [--calib-samples N] [--repeat N] [--calib-precision bf16]

Per real fixture (benchmarks/real_models.py: Qwen2.5-Coder-0.5B, Gemma-3-270M; a directory works too):

* the floor: transformers' own decoder (`AutoModelForCausalLM` in float32, `get_decoder()`: no LM head, which
  dsconv's layer-by-layer forward never computes) over the calibration samples (the bundled set, tokenized and cut
  as dsconv cuts it), each on its own, in right-padded batches of 8 with an attention mask, and those batches with
  the linears through oneDNN as dsconv's float32 forward runs them; the fastest is the floor (beside them, the old
  one: each sample with the LM head);
* `dsconv quantize --bits 8` (the CLI, in this process) for each engine: wall and CPU seconds, the ratio to the
  floor, and the per-step seconds dsconv records in quant_report.json (`timings`: the statistics forward,
  the SmoothQuant and clip searches, GPTQ/AWQ, fallback checks, experts, writing; summed over layers: the driver's
  wall and CPU, the jobs' CPU).

The transformers and dsconv modules are imported before anything is timed, so neither side pays the imports. The
load average is recorded before and after each figure: on a shared host the figures are only valid when quiet.
Results: bench-results/calib_cost.json.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("mindie", "vllm-ascend")
TARGET, GOAL = 3.0, 2.0  # at most 3x the floor, 2x as the goal


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def calibration_samples(model_dir: Path, samples: int | None) -> list[list[int]]:
    """The token samples dsconv calibrates on by default (bundled set, its tokenizer, its cut)."""
    from dsconv.quant.calibrate.data import DEFAULT_SEQ_LEN, load_calib
    from dsconv.runner.texts import load_tokenizer

    return load_calib(None, load_tokenizer(model_dir), samples, DEFAULT_SEQ_LEN).samples


BATCH = 8  # samples per padded batch of the batched floor


def plain_forward(model_dir: Path, samples: list[list[int]], precision: str = "auto") -> dict[str, Any]:
    """transformers' model in float32 over the calibration samples, three ways, in this process: each sample on its
    own with the LM head (the old floor), the decoder alone (no LM head: dsconv's layer-by-layer forward never
    computes logits) each sample on its own, and the decoder alone on right-padded batches of BATCH samples with an
    attention mask, longest first (as dsconv batches). `floor_s` is the faster decoder-only figure. `precision`
    bf16: every forward under torch's CPU autocast to bf16, as `--calib-precision bf16` runs dsconv's (the floor a
    bf16 calibration is held to)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dsconv.quant.calibrate.context import onednn_available, onednn_linears
    from dsconv.runner.metrics import padded

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    decoder = model.get_decoder()
    order = sorted(range(len(samples)), key=lambda j: -len(samples[j]))
    batches = [(ids, mask.long()) for ids, mask in (padded(samples, order[i:i + BATCH])
                                                    for i in range(0, len(order), BATCH))]

    def timed(run) -> tuple[float, float]:
        t, c = time.perf_counter(), time.process_time()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            run()
        return time.perf_counter() - t, time.process_time() - c

    def batched_onednn() -> None:
        with onednn_linears():
            for i, m in batches:
                decoder(input_ids=i, attention_mask=m, use_cache=False)

    before = load()
    with_head = timed(lambda: [model(input_ids=torch.tensor([s]), use_cache=False) for s in samples])
    per_sample = timed(lambda: [decoder(input_ids=torch.tensor([s]), use_cache=False) for s in samples])
    batched = timed(lambda: [decoder(input_ids=i, attention_mask=m, use_cache=False) for i, m in batches])
    # the same batches with dsconv's float32 linears (oneDNN: on a non-Intel CPU MKL's sgemm is 2x slower), so the
    # floor is never a slower library than the one dsconv calls
    onednn = timed(batched_onednn) if precision != "bf16" and onednn_available() else None
    del model
    ways = {"per_sample": per_sample, "batched": batched, **({"batched_onednn": onednn} if onednn else {})}
    name = min(ways, key=lambda k: ways[k][0])
    floor = ways[name]
    return {"wall_s": round(floor[0], 2), "cpu_s": round(floor[1], 2), "floor": name, "batch": BATCH,
            "with_lm_head_per_sample_s": round(with_head[0], 2), "decoder_per_sample_s": round(per_sample[0], 2),
            "decoder_batched_s": round(batched[0], 2),
            "decoder_batched_onednn_s": round(onednn[0], 2) if onednn else None,
            "load_before": before, "load_after": load()}


def quantize(model_dir: Path, out: Path, engine: str, samples: int | None, precision: str = "auto") -> dict[str, Any]:
    """`dsconv quantize --bits 8 --engine ENGINE --calib-precision PRECISION` through the CLI, in this process."""
    from dsconv.cli import cli

    args = ["quantize", "-m", str(model_dir), "-o", str(out), "--bits", "8", "--engine", engine, "--force", "--json",
            "--calib-precision", precision]
    if samples:
        args += ["--calib-samples", str(samples)]
    before = load()
    buf = io.StringIO()
    t, c = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(buf):
        cli.main(args=args, prog_name="dsconv", standalone_mode=False)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    summary = json.loads(buf.getvalue())
    report = json.loads((out / "quant_report.json").read_text())
    t = report.get("timings") or {}
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "calibration_s": summary.get("calibration_seconds"),
            "steps_s": t.get("steps") or summary.get("timings") or {}, "steps_cpu_s": t.get("steps_cpu", {}),
            "in_jobs_cpu_s": t.get("in_jobs", {}), "finish_write_s": t.get("finish_write"),
            "tokens": (summary.get("calibration") or {}).get("tokens"), "static_linears": _static(out),
            "load_before": before, "load_after": load()}


def _static(out: Path) -> int:
    """Linears written static W8A8 (the number the quality bar keeps)."""
    desc = next(iter(sorted(out.glob("quant_model_description*.json"))), None)
    if desc is None:
        return 0
    d = json.loads(desc.read_text())
    return sum(1 for k, v in d.items() if k.endswith(".weight") and v == "W8A8")


def run_model(name: str, model_dir: Path, engines: list[str], samples: int | None, repeat: int,
              work: Path, precision: str = "auto") -> dict[str, Any] | None:
    import torch

    if not (model_dir / "config.json").exists():
        print(f"calib_cost: no fixture at {model_dir}; build it with `python -m benchmarks.real_models "
              f"{model_dir.name}` - skipped", flush=True)
        return None
    toks = calibration_samples(model_dir, samples)
    fwd = min((plain_forward(model_dir, toks, precision) for _ in range(repeat)), key=lambda r: r["wall_s"])
    from dsconv.quant.calibrate.context import auto_precision

    ran = auto_precision() if precision == "auto" else precision
    res: dict[str, Any] = {"model": str(model_dir), "precision": precision, "ran": ran,
                           "threads": torch.get_num_threads(),
                           "samples": len(toks), "tokens": sum(len(s) for s in toks), "plain_forward": fwd,
                           "quantize": {}}
    print(f"{name} ({precision}): {len(toks)} samples, {res['tokens']} tokens, {res['threads']} threads; floor "
          f"(transformers' decoder, no LM head, {fwd['floor']}) {fwd['wall_s']} s wall ({fwd['cpu_s']} s CPU); "
          f"per sample {fwd['decoder_per_sample_s']} s, padded batches of {BATCH} {fwd['decoder_batched_s']} s "
          f"(oneDNN linears {fwd['decoder_batched_onednn_s']} s), "
          f"per sample with the LM head {fwd['with_lm_head_per_sample_s']} s; load {fwd['load_before']}", flush=True)
    for engine in engines:
        runs = []
        for _ in range(repeat):
            out = work / f"{name}-{engine}"
            runs.append(quantize(model_dir, out, engine, samples, precision))
            shutil.rmtree(out, ignore_errors=True)
        q = min(runs, key=lambda r: r["wall_s"])
        q["ratio"] = round(q["wall_s"] / fwd["wall_s"], 2)
        q["ratio_cpu"] = round(q["cpu_s"] / fwd["cpu_s"], 2)
        q["target"] = "met" if q["ratio"] <= TARGET else "MISSED"
        q["goal"] = "met" if q["ratio"] <= GOAL else "missed"
        res["quantize"][engine] = q
        steps = "; ".join(", ".join(f"{k} {v:.1f}" for k, v in q[part].items() if isinstance(v, (int, float)))
                          for part in ("steps_s", "steps_cpu_s", "in_jobs_cpu_s"))
        print(f"{name} --bits 8 --engine {engine}: {q['wall_s']} s wall ({q['cpu_s']} s CPU) = {q['ratio']}x the "
              f"floor (target <= {TARGET}x: {q['target']}; goal {GOAL}x: {q['goal']}); "
              f"{q['static_linears']} static linears; "
              f"load {q['load_before']} -> {q['load_after']}\n  steps (driver wall; driver CPU; jobs' CPU, s): "
              f"{steps}", flush=True)
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen,gemma", help="fixture names (qwen, gemma) or model directories")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--calib-samples", type=int, default=None, help="first N bundled samples (default: all)")
    ap.add_argument("--repeat", type=int, default=1, help="best of N for each figure")
    ap.add_argument("--calib-precision", choices=("fp32", "auto", "fp32-onednn", "bf16"), default="auto",
                    help="quantize --calib-precision (default: the CLI's, auto), and the floor's forward in the same "
                         "precision")
    a = ap.parse_args(argv if argv is not None else sys.argv[1:])
    sys.path.insert(0, str(ROOT))
    import torch  # noqa: F401  (imported before any timing: neither side pays it)
    import transformers  # noqa: F401

    import dsconv.quant.stage  # noqa: F401
    from benchmarks.bench_fidelity import FIXTURES, fixture_dir
    from benchmarks.common import save, scratch

    work = scratch("dsconv-calib-cost-")
    results: dict[str, Any] = {}
    try:
        for name in [m.strip() for m in a.model.split(",") if m.strip()]:
            model_dir = fixture_dir(name) if name in FIXTURES else Path(name)
            # the model's transformers classes too (dsconv's skeleton would otherwise import them inside its timing)
            from transformers import AutoConfig
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
            if (model_dir / "config.json").exists():
                MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model_dir))]
            r = run_model(name, model_dir, [e.strip() for e in a.engines.split(",") if e.strip()],
                          a.calib_samples, a.repeat, work, a.calib_precision)
            if r is not None:
                results[name if name in FIXTURES else model_dir.name] = r
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save("calib_cost" if a.calib_precision == "auto" else f"calib_cost_{a.calib_precision}",
         {"cpus": os.cpu_count(), "models": results}, quiet=True)


if __name__ == "__main__":
    main()
