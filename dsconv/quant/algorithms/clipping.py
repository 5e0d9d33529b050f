"""Static activation ranges clipped by measured output error, not by the activation's own statistics.

Min/max keeps the rare extreme token exact and spends the 256 levels of every other token on it. Percentile/MSE
clipping (observers.py) judge a range by element counts, blind to which channels matter downstream. Here each
static input (shared by every linear that reads it: q/k/v, gate/up) tries the min/max range scaled by the ratios in
`CLIPS` and keeps the one with the smallest relative output error of its consumers - int8 weights, fake-quantized
activations, against float - on the calibration rows the statistics pass sampled (spread over all prompts). 1.0
(min/max) is always a candidate and wins ties, so clipping is only applied where it measurably helps.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsconv.qformat import STATIC_TYPES
from dsconv.quant.algorithms.fake_quant import int8_rows
from dsconv.quant.algorithms.int8_outputs import static_outputs
from dsconv.quant.algorithms.methods import ACT_SEARCH
from dsconv.quant.algorithms.schemes import activation_qparams
from dsconv.quant.algorithms.smoothing import MAX_OUT_ROWS

CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.4)


def best_clip(x: torch.Tensor, lo: float, hi: float, weights: list[torch.Tensor]) -> tuple[float, float, float]:
    """(ratio, error at ratio, error at 1.0) for rows x [m, k], the unclipped range and the consumers' weights.
    Every ratio's rows are quantized at once and go through one int8 matmul (int8_outputs.py)."""
    w = torch.cat([t.detach().float() for t in weights])
    w = w[:: max(1, w.shape[0] // MAX_OUT_ROWS)]
    ref = x @ w.T
    qw, sw = int8_rows(w)
    y = static_outputs(x, [activation_qparams(lo * c, hi * c) for c in CLIPS], qw.to(torch.int8), sw.view(-1))
    den = float(torch.linalg.vector_norm(ref))
    num = torch.linalg.vector_norm(y.sub_(ref), dim=(1, 2)).tolist()
    errs = {c: e / den if den else e for c, e in zip(CLIPS, num)}  # a zero reference: the absolute error
    ratio = min(CLIPS, key=lambda c: errs[c])
    if errs[ratio] >= errs[1.0] * 0.995:
        ratio = 1.0
    return ratio, errs[ratio], errs[1.0]


def observer_method(act_method: str) -> str:
    """The streaming observer behind an --act-method ("search" starts from min/max)."""
    return "minmax" if act_method == ACT_SEARCH else act_method


def choose_clips(group: dict[nn.Module, Any], targets: dict[nn.Module, Any], log: dict[str, Any]) -> None:
    """Set `clip_ratio` on each static input's statistics (InputStats) and log {first consumer: [ratio, err, err
    at min/max]}."""
    seen: dict[int, list[nn.Module]] = {}
    stats: dict[int, Any] = {}
    for mod, st in group.items():
        if targets[mod].qtype in STATIC_TYPES and st.observer is not None and st.observer.tokens and st.sample is not None:
            seen.setdefault(id(st), []).append(mod)
            stats[id(st)] = st
    for key, mods in seen.items():
        st = stats[key]
        lo, hi = st.observer.clip_range()
        ratio, err, err_minmax = best_clip(st.sample, lo, hi, [m.weight for m in mods])
        st.clip_ratio = ratio
        log[targets[mods[0]].module] = {"ratio": ratio, "error": round(err, 6), "error_minmax": round(err_minmax, 6),
                                        "consumers": len(mods)}
