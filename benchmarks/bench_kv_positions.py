"""Does the int8 KV cache (C8) hold at positions calibration never saw? Perplexity of a real fixture with FLOAT
weights and its keys and values passed through int8 as the engine stores them, at 512- and 2,048-token windows of
the same held-out text, against the float cache.

    python -m benchmarks.bench_kv_positions [--model qwen|gemma|DIR] [--baseline-code DIR] [--tokens 4096]

The cache scales come from `dsconv quantize --scheme w8a16 --method rtn --kv-cache int8 --engine mindie` on the
bundled calibration set (samples of 13-500 tokens, each run on its own); only its `kv_cache_scale/offset` tensors
are used, on transformers' float model (bench_fidelity's Int8Cache), so the figure is the cache's alone.
`--baseline-code`: another checkout's dsconv writes a second set of scales (a before/after on the same inputs).
Part of `make bench-fidelity`. Results: bench-results/kv_positions.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WINDOWS = (512, 2048)


def cache_scales(model_dir: Path, out: Path, code: Path) -> tuple[dict[str, Any], dict[str, Any], float]:
    """The C8 scales one checkout's dsconv writes for `model_dir`: (description, tensors, seconds)."""
    from safetensors.torch import load_file

    env = {**os.environ, "PYTHONPATH": str(code), "TOKENIZERS_PARALLELISM": "false"}
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dsconv", "quantize", "-m", str(model_dir), "-o", str(out), "--force",
                    "--scheme", "w8a16", "--method", "rtn", "--kv-cache", "int8", "--engine", "mindie"],
                   check=True, env=env, cwd=str(out.parent), stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - t
    desc = json.loads((out / "quant_model_description.json").read_text())
    tensors: dict[str, Any] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update({k: v for k, v in load_file(str(f)).items() if ".kv_cache_" in k})
    return desc, tensors, seconds


def float_model(model_dir: Path, cache: tuple[dict[str, Any], dict[str, Any]] | None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.bench_fidelity import _int8_cache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if cache is not None:
        _int8_cache(model, *cache)
    return model


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen", help="fixture name (qwen, gemma) or a model directory")
    ap.add_argument("--baseline-code", type=Path, default=None, help="another checkout whose scales to compare")
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens per window length")
    a = ap.parse_args(argv if argv is not None else sys.argv[1:])
    import torch
    from transformers import AutoTokenizer

    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_fidelity import FIXTURES, eval_chunks, fixture_dir, perplexity
    from benchmarks.common import RESULTS, save

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model_dir = fixture_dir(a.model) if a.model in FIXTURES else Path(a.model)
    if not (model_dir / "config.json").exists():
        print(f"kv_positions: {model_dir} missing (python -m benchmarks.real_models builds it); skipped")
        return {}
    tok = AutoTokenizer.from_pretrained(model_dir)
    chunks = {w: eval_chunks(tok, a.tokens // w, seq=w) for w in WINDOWS}
    codes = {"now": ROOT, **({"baseline": a.baseline_code.resolve()} if a.baseline_code else {})}
    result: dict[str, Any] = {"model": str(model_dir), "load_before": os.getloadavg()[0], "windows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        scales = {}
        for label, code in codes.items():
            desc, tensors, secs = cache_scales(model_dir, Path(tmp) / label, code)
            scales[label] = (desc, tensors)
            result[f"quantize_s_{label}"] = round(secs, 1)
        for w, cs in chunks.items():
            row: dict[str, Any] = {"chunks": len(cs), "tokens": sum(len(c) for c in cs)}
            row["float_cache"] = perplexity(float_model(model_dir, None), cs)
            for label, sc in scales.items():
                ppl = perplexity(float_model(model_dir, sc), cs)
                row[f"int8_{label}"] = ppl
                row[f"increase_{label}_pct"] = round(100 * (ppl / row["float_cache"] - 1), 3)
            result["windows"][str(w)] = row
            print(f"kv_positions {a.model}: {len(cs)} x {w} tokens: float cache {row['float_cache']:.4f}; "
                  + "; ".join(f"int8 ({k}) {row[f'int8_{k}']:.4f} = {row[f'increase_{k}_pct']:+.2f}%"
                              for k in scales), flush=True)
    result["load_after"] = os.getloadavg()[0]
    saved = RESULTS / "kv_positions.json"
    models = json.loads(saved.read_text()).get("models", {}) if saved.exists() else {}
    save("kv_positions", {"models": {**models, a.model: result}}, quiet=True)  # other fixtures' rows stay
    return result


if __name__ == "__main__":
    main()
