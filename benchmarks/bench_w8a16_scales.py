"""W8A16's stored weight scales: which rule, by perplexity AND KL against the float model, on both real fixtures.

Four candidates for one channel's scale, each with the int8 values round-to-nearest makes against it and the scale
the engine then multiplies by (vLLM-Ascend and MindIE hold a W8A16 `weight_scale` in the model dtype, bf16 here):
- `grid`      dsconv's rule (quant/algorithms/scale_grid.py): the grid value (one bf16, fp16 and float32 all hold)
              on either side of absmax/127 with the smaller squared error of the channel; the engine holds it exactly;
- `exact`     float32 absmax/127, as if the engine computed with it (no engine does: the reference);
- `bf16`      absmax/127 rounded to the nearest bf16, the integers made against that value;
- `cast`      the integers made against float32 absmax/127, the scale written in float32 and cast to bf16 by the
              engine's loader on its own (round to nearest even): what a writer that ignores the engine's dtype gets.
Every other tensor is the float model's. The `grid` weights are checked against `dsconv quantize --scheme w8a16
--method rtn`'s output (its dequantized weights must be equal), so the bench measures the rule dsconv writes.

    python -m benchmarks.bench_w8a16_scales [--models qwen,gemma] [--chunks 16]

Text: `pydoc_data.topics` windows of 512 tokens (bench_fidelity's text, never seen by calibration), 16 windows =
8,176 predicted tokens per model. Result: bench-results/w8a16_scales.json.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_fidelity import eval_chunks, fixture_dir
from benchmarks.common import save, scratch

CANDIDATES = ("grid", "exact", "bf16", "cast")


def _bf16_nearest(s: np.ndarray) -> np.ndarray:
    import torch

    return torch.from_numpy(np.ascontiguousarray(s, np.float32)).to(torch.bfloat16).float().numpy()


def candidate_weight(w: np.ndarray, rule: str) -> np.ndarray:
    """The weight [n, k] the engine computes with under `rule` (float32)."""
    from dsconv.quant.algorithms.scale_grid import choose_scales, exact_scales

    if rule == "grid":
        q, sc = choose_scales(w[:, None, :], -128, 127)
        return q[:, 0, :].astype(np.float32) * sc[:, 0, :]
    amax = np.abs(w).max(axis=1, keepdims=True)
    exact = exact_scales(amax, 127)
    made = _bf16_nearest(exact) if rule == "bf16" else exact
    q = np.clip(np.rint(w / made), -128, 127)
    held = _bf16_nearest(exact) if rule == "cast" else made
    return (q * held).astype(np.float32)


def quantized_modules(model: Any) -> dict[str, Any]:
    """The nn.Linear modules `quantize --scheme w8a16` quantizes (decoder layers' projections; not the LM head)."""
    import torch

    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}


def dsconv_grid_matches(model_dir: Path, grid: dict[str, np.ndarray]) -> int:
    """`dsconv quantize --scheme w8a16 --method rtn` run on the fixture; its dequantized weights equal to the
    bench's `grid` candidate for every quantized linear (else AssertionError). Returns how many were compared."""
    from dsconv.checkpoint import Checkpoint
    from dsconv.cli import main
    from dsconv.quant.formats.msmodelslim import quantized_modules as described, read_linear

    out = scratch("w8a16-scales") / "q"
    try:
        main(["quantize", "-m", str(model_dir), "-o", str(out), "--scheme", "w8a16", "--method", "rtn", "--force"])
    except SystemExit as e:
        if e.code:
            raise
    ck = Checkpoint.open(out)
    types = described(ck.quant_description)
    n = 0
    for module, qtype in types.items():
        if module not in grid:
            continue
        got = read_linear(ck, module, qtype).dequantized()
        assert np.array_equal(got, grid[module]), f"{module}: dsconv's written weight differs from the grid rule"
        n += 1
    assert n == len(grid), f"compared {n} of {len(grid)} linears with dsconv's output"
    return n


def measure(name: str, chunks_n: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = fixture_dir(name)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    chunks = eval_chunks(tok, chunks_n)
    mods = quantized_modules(model)
    orig = {n: m.weight.detach().clone() for n, m in mods.items()}
    t0 = time.perf_counter()
    weights = {r: {n: candidate_weight(w.numpy(), r) for n, w in orig.items()} for r in CANDIDATES}
    compared = dsconv_grid_matches(model_dir, weights["grid"])
    build = time.perf_counter() - t0
    nll = {r: 0.0 for r in ("float", *CANDIDATES)}
    kl = {r: 0.0 for r in CANDIDATES}
    top1 = {r: 0 for r in CANDIDATES}
    count = 0
    with torch.no_grad():
        for c in chunks:
            ids = torch.tensor([c])
            target = ids[0, 1:]
            for n, m in mods.items():
                m.weight.copy_(orig[n])
            ref = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            nll["float"] += float(torch.nn.functional.nll_loss(ref, target, reduction="sum"))
            for r in CANDIDATES:
                for n, m in mods.items():
                    m.weight.copy_(torch.from_numpy(weights[r][n]))
                lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
                nll[r] += float(torch.nn.functional.nll_loss(lp, target, reduction="sum"))
                kl[r] += float((ref.exp() * (ref - lp)).sum())
                top1[r] += int((lp.argmax(-1) == ref.argmax(-1)).sum())
            count += len(c) - 1
    ppl = {r: math.exp(v / count) for r, v in nll.items()}
    out = {"tokens": count, "windows": len(chunks), "float_ppl": round(ppl["float"], 4), "linears": len(mods),
           "dsconv_output_equals_grid": compared, "seconds": round(time.perf_counter() - t0, 1),
           "build_seconds": round(build, 1), "candidates": {}}
    for r in CANDIDATES:
        out["candidates"][r] = {"ppl": round(ppl[r], 4), "ppl_change_pct": round(100 * (ppl[r] / ppl["float"] - 1), 3),
                                "kl_per_token": round(kl[r] / count, 7), "top1_pct": round(100 * top1[r] / count, 2)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen,gemma")
    ap.add_argument("--chunks", type=int, default=16)
    a = ap.parse_args(argv)
    results = {}
    for name in a.models.split(","):
        r = measure(name, a.chunks)
        results[name] = r
        best_ppl = min(CANDIDATES, key=lambda c: r["candidates"][c]["ppl"])
        best_kl = min(CANDIDATES, key=lambda c: r["candidates"][c]["kl_per_token"])
        print(f"{name}: float ppl {r['float_ppl']} over {r['tokens']} tokens; best by ppl {best_ppl}, by KL {best_kl}")
        for c, v in r["candidates"].items():
            print(f"  {c:6s} ppl {v['ppl']:.4f} ({v['ppl_change_pct']:+.3f}%)  KL {v['kl_per_token']:.6f}  "
                  f"top-1 {v['top1_pct']:.2f}%")
        print(json.dumps({"checked": r["dsconv_output_equals_grid"]}))
    save("w8a16_scales", {"date": time.strftime("%Y-%m-%d %H:%M"), "models": results,
                          "text": "pydoc_data.topics windows of 512 tokens"})


if __name__ == "__main__":
    main()
