"""The weight rounding methods of `dsconv quantize --method` and the default per weight width (no imports: the CLI
reads these at start-up).

The defaults are measured end to end (benchmarks/bench_fidelity.py, docs/accuracy.md):
- 4 bits (W4A16 g64), perplexity increase against round-to-nearest's on three real models: GPTQ 0.21x on
  Gemma-3-270M, 0.78x on a held-out float model, 1.04x on Qwen2.5-Coder-0.5B (whose weights sit on a 4-bit grid,
  which favours plain rounding). No other method is close to never-worse on all three (AWQ 0.20x / 0.93x / 1.83x,
  searched scales 0.74x / 0.80x / 2.57x), so GPTQ, with its per-linear held-out check against round-to-nearest.
- 8 bits: round-to-nearest (W8A16 +0.05% on Qwen, no calibration; `--method gptq` reaches +0.07% on Gemma).
- W4A8_DYNAMIC's per-channel int4 experts: round-to-nearest (on the one-expert restatement of Qwen, GPTQ 1.65x and
  searched scales 1.51x RTN's increase; no other MoE evidence).
"""
from __future__ import annotations

METHODS = ("rtn", "mse", "gptq", "awq")
DEFAULT_METHOD = {8: "rtn", 4: "gptq"}
SCHEME_DEFAULT_METHOD = {"w4a8_dynamic": "rtn"}  # where a scheme's evidence differs from its bit width's
ACT_SEARCH = "search"  # --act-method default: min/max, then the clip ratio with the smallest output error (clipping.py)


def default_method(scheme: str, bits: int) -> str:
    return SCHEME_DEFAULT_METHOD.get(scheme, DEFAULT_METHOD[bits])


def smoothing_mode(value: float | str | None, act_quantized: bool) -> float | str | None:
    """None (off), "auto" (searched per site, smoothing.py) or a fixed alpha; weight-only schemes never smooth."""
    if not act_quantized or value in (None, "off"):
        return None
    return value
