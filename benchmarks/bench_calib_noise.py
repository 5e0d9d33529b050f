"""How far a fidelity row moves under changes that should not matter, and whether a calibration precision moves it
by more than that.

    python -m benchmarks.bench_calib_noise [--model gemma] [--row vllm] [--subsets 8] [--precisions fp32,fp32-onednn]
    python -m benchmarks calib_noise

Why: `make bench-fidelity` gives one perplexity per row, and a change to the default may move a row by 0.1 points.
On Gemma-3-270M's `--bits 8 --engine vllm-ascend` row, calibrating on the first 155 of the 157 bundled pairs instead
of all of them moved it from +1.40% to +1.61%, and oneDNN's float32 sums instead of MKL's (7,042 of 268M output
values differ, every search decision the same) from +1.40% to +1.82%. One run cannot tell a precision's effect
from that noise. This benchmark quantizes the row on K calibration subsets - the first 157, 156, ... pairs: each
a calibration set a user could have brought - with every precision, evaluates each output with bench_fidelity's
independent reader on the same text, and reports per precision the mean, spread and extremes, and against float32
(MKL) the paired difference of each subset and its mean with a standard error. A precision whose mean paired
difference is within two standard errors of zero and under the spread of float32 itself moves the row by no more
than a user's choice of calibration text does.

Outputs are evaluated and deleted one at a time (Gemma's is 437 MB); each figure is kept in the work directory
(`<row>_<precision>_<pairs>.json`, with the arguments that made it), so an interrupted run resumes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_fidelity import eval_chunks, fixture_dir, float_perplexity, load_quantized, perplexity, quantize
from benchmarks.common import merge

ROWS = {"vllm": ["--bits", "8", "--engine", "vllm-ascend"], "mindie": ["--bits", "8"],
        "allstatic": ["--bits", "8", "--recipe", "uniform", "--fallback", "0"]}
PAIRS = 157  # the bundled qa.jsonl
REFERENCE = "fp32"


def one(model_dir: Path, args: list[str], chunks: list[list[int]], ppl_float: float, out: Path) -> dict[str, Any]:
    """Quantize with `args`, evaluate, delete the output; the figure kept in out/../<name>.json for a rerun."""
    kept = out.with_suffix(".json")
    if kept.exists() and json.loads(kept.read_text()).get("args") == args:
        return json.loads(kept.read_text())
    secs, cpu, _ = quantize(model_dir, out, args)
    model, counts = load_quantized(out)
    ppl = perplexity(model, chunks)
    del model
    report = json.loads((out / "quant_report.json").read_text())
    alphas = [(s.get("search") or {}).get("alpha") for s in report.get("smoothing", [])]
    res = {"args": args, "ppl": ppl, "increase_pct": (ppl / ppl_float - 1) * 100, "types": counts,
           "quantize_s": round(secs, 1), "alphas": alphas}
    shutil.rmtree(out, ignore_errors=True)
    kept.write_text(json.dumps(res))
    return res


def summarize(runs: dict[str, list[float]]) -> dict[str, Any]:
    """Per precision: mean / sd / min / max over the subsets; against REFERENCE: the paired differences."""
    out: dict[str, Any] = {}
    ref = runs.get(REFERENCE)
    for prec, xs in runs.items():
        row: dict[str, Any] = {"n": len(xs), "mean": statistics.fmean(xs), "min": min(xs), "max": max(xs),
                               "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0}
        if ref is not None and prec != REFERENCE and len(ref) == len(xs) and len(xs) > 1:
            d = [b - a for a, b in zip(ref, xs)]
            sd = statistics.stdev(d)
            row["paired"] = {"mean": statistics.fmean(d), "sd": sd, "se": sd / math.sqrt(len(d)),
                             "min": min(d), "max": max(d)}
        out[prec] = row
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma", help="qwen | gemma | a model directory")
    ap.add_argument("--row", default="vllm", choices=sorted(ROWS))
    ap.add_argument("--subsets", type=int, default=8, help="calibrate on the first 157, 156, ... pairs (default 8)")
    ap.add_argument("--precisions", default="fp32,fp32-onednn,bf16")
    ap.add_argument("--chunks", type=int, default=6, help="evaluation windows of 512 tokens (bench_fidelity's)")
    ap.add_argument("--work", type=Path, default=None)
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    model_dir = fixture_dir(a.model)
    work = (a.work or Path(os.environ.get("DSCONV_BENCH_DIR", "/tmp")) / "dsconv-noise") / model_dir.name
    work.mkdir(parents=True, exist_ok=True)
    chunks = eval_chunks(AutoTokenizer.from_pretrained(model_dir), a.chunks)
    ppl_float = float_perplexity(model_dir, chunks, work)
    precisions = a.precisions.split(",")
    t0, load0 = time.time(), os.getloadavg()[0]
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in precisions}
    for n in range(PAIRS, PAIRS - a.subsets, -1):
        for prec in precisions:
            args = [*ROWS[a.row], "--calib-samples", str(n), "--calib-precision", prec]
            r = one(model_dir, args, chunks, ppl_float, work / f"{a.row}_{prec}_{n}")
            runs[prec].append({"pairs": n, **{k: r[k] for k in ("increase_pct", "types", "quantize_s", "alphas")}})
            print(f"{model_dir.name} {a.row} {prec:12s} {n} pairs: {r['increase_pct']:+.3f}%", flush=True)
    for prec, rs in runs.items():  # the same SmoothQuant strength at every site as float32 (MKL) on that subset
        for r, ref in zip(rs, runs.get(REFERENCE, [])):
            r["alphas_as_fp32"] = r["alphas"] == ref["alphas"]
    for rs in runs.values():
        for r in rs:
            r.pop("alphas")
    summary = summarize({p: [r["increase_pct"] for r in rs] for p, rs in runs.items()})
    figures = {"model": str(model_dir), "row": ROWS[a.row], "float_ppl": ppl_float, "eval_tokens": a.chunks * 512,
               "subsets": [PAIRS - j for j in range(a.subsets)], "runs": runs, "summary": summary,
               "minutes": round((time.time() - t0) / 60, 1), "load_start": round(load0, 2),
               "load_end": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
               "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    merge("calib_noise", f"{model_dir.name} {a.row}", figures, quiet=True)
    print(f"\n{model_dir.name} `{' '.join(ROWS[a.row])}`, {a.subsets} calibration subsets "
          f"({len(chunks)} x 512 tokens):")
    for prec, s in summary.items():
        p = s.get("paired")
        vs = f"; vs {REFERENCE}: {p['mean']:+.3f} +- {p['se']:.3f} (SE), {p['min']:+.3f}..{p['max']:+.3f}" if p else ""
        print(f"  {prec:12s} mean {s['mean']:+.3f}%  sd {s['sd']:.3f}  {s['min']:+.3f}..{s['max']:+.3f}{vs}")


if __name__ == "__main__":
    main()
