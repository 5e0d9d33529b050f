"""Choosing the SmoothQuant strength per site by measured output error, and the up -> down fold.

Why a search: one fixed alpha is wrong for most layers of a real model. Where a norm output has a few huge channels
(Qwen2.5's q/k/v inputs), alpha 0.5 leaves the per-tensor int8 range dominated by them; where it has none, any alpha
only moves error into the weights. So each smoothing *site* (a norm and the quantized linears that read it, or the
activation between up_proj and down_proj) gets the candidate with the smallest relative output error of its
consumers on calibration rows, "off" included, computed the way the engine will run it:

* weights smoothed (columns x s), then per-channel int8 round-to-nearest with the scales that will be written
  (scale_grid.py's choice between grid neighbours, not float absmax / 127: scoring alphas against weights other than
  the written ones cost W8A8_DYNAMIC on Gemma-3-270M 0.54 perplexity points, docs/accuracy.md);
* activations x / s, then per-tensor static int8 over the range of *all* calibration tokens (exact without a second
  pass: the per-channel min/max of x are kept, and min/max of x / s is min/max over channels of min_j / s_j), with
  the best of a few clip ratios (the clip itself is chosen again, finer, when the linear is quantized: clipping.py);
  or per-token dynamic int8 for W8A8_DYNAMIC.

Rows: `SiteSample` keeps every stride-th calibration token (stride from the total token count, so the sample spreads
over all prompts, attention-sink tokens included) up to `SAMPLE_ROWS`. Output rows of wide consumers are subsampled
to `MAX_OUT_ROWS` for the error (an unbiased estimate); the smoothing scales themselves use every weight row.

The up -> down fold is exact for gated MLPs (act = f(gate) * up): dividing up_proj's output rows by s divides act's
channel j by s_j, and down_proj's columns take s. up_proj is quantized per output row, so its own error is unchanged.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from dsconv.qformat import ACT_QUANT
from dsconv.quant.algorithms.int8_outputs import dynamic_outputs, static_outputs
from dsconv.quant.algorithms.scale_grid import choose_scales
from dsconv.quant.algorithms.sampling import RowSampler
from dsconv.quant.algorithms.schemes import activation_qparams, qrange, smooth_scales
from dsconv.runtime.threads import ordered_map

ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)   # candidates besides "off" (s = 1)
SEARCH_CLIPS = (1.0, 0.85, 0.7)                 # clip ratios tried with each alpha for static sites
MIN_GAIN = 0.98                                  # applied only if it cuts the error by at least 2%
SAMPLE_ROWS = 256
MAX_OUT_ROWS = 2048


class SiteSample:
    """Per-channel min/max of one activation over all real calibration tokens, and an evenly spread row sample."""

    def __init__(self, total_tokens: int, cap: int = SAMPLE_ROWS) -> None:
        self.sampler = RowSampler(max(1, total_tokens // max(cap, 1)), cap)
        self.cmin: torch.Tensor | None = None
        self.cmax: torch.Tensor | None = None

    def update(self, x: torch.Tensor, channel_range: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Fold in rows [t, k]; `channel_range`: their per-channel (min, max), when the caller has them."""
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if x.shape[0] == 0:
            return
        lo, hi = (x.amin(dim=0), x.amax(dim=0)) if channel_range is None else \
            (channel_range[0].float(), channel_range[1].float())
        self.cmin = lo if self.cmin is None else torch.minimum(self.cmin, lo)
        self.cmax = hi if self.cmax is None else torch.maximum(self.cmax, hi)
        self.sampler.update(x)

    @property
    def absmax(self) -> torch.Tensor:
        return torch.maximum(-self.cmin, self.cmax)

    @property
    def rows(self) -> list[torch.Tensor]:
        return self.sampler.rows

    @property
    def x(self) -> torch.Tensor:
        return torch.cat(self.rows)


def search_scales(site: SiteSample, weights: list[torch.Tensor], static: bool,
                  alphas: tuple[float, ...] = ALPHAS) -> tuple[torch.Tensor | None, dict[str, Any]]:
    """The smoothing factors s [k] with the smallest output error of the consumers (None: smoothing off is best),
    and what was measured (for quant_report.json). Every candidate (off, each alpha; with each clip for static
    sites) is scored in integers, as the engine computes (`candidate_errors`)."""
    x = site.x
    w_all = torch.cat([w.detach().float() for w in weights])
    w_absmax = w_all.abs().amax(dim=0)
    step = max(1, w_all.shape[0] // MAX_OUT_ROWS)
    w = w_all[::step]
    scales = [torch.from_numpy(smooth_scales(site.absmax.numpy(), w_absmax.numpy(), a)) for a in alphas]
    errs = candidate_errors(x, w, torch.stack([torch.ones_like(w_absmax), *scales]), site.cmin, site.cmax, static)
    base = errs[0]
    tried: dict[str, float] = {"off": round(base, 6)}
    best_err, best_alpha, best_s = float("inf"), None, None
    for a, s, e in zip(alphas, scales, errs[1:]):
        tried[str(a)] = round(e, 6)
        if e < best_err:
            best_err, best_alpha, best_s = e, a, s
    if not best_err < base * MIN_GAIN:  # smoothing must earn its fold: "off" unless clearly better
        best_err, best_alpha, best_s = base, None, None
    return best_s, {"alpha": best_alpha, "error": round(best_err, 6), "error_off": round(base, 6),
                    "error_by_alpha": tried, "rows": int(x.shape[0])}


def candidate_errors(x: torch.Tensor, w: torch.Tensor, S: torch.Tensor, cmin: torch.Tensor, cmax: torch.Tensor,
                     static: bool) -> list[float]:
    """Relative output error of each candidate s (rows of S [C, k]; ones = off) on rows x [m, k] against x @ w.T:
    weights w * s rounded per channel, activations x / s rounded per token (dynamic) or per tensor over the range of
    every calibration token (static: [min/max of cmin / s, cmax / s], the smallest error over `SEARCH_CLIPS`).

    Computed as the engine computes it, in integers (int8_outputs.py): the codes of x / s (every clip) times the
    codes of w * s in one int8 matmul per candidate, then the scales. The same figures as dequantizing both and
    multiplying in float32 (to float rounding: a test holds it), at a third of the cost: the float matmuls of every
    candidate at once (and their 70 MB temporaries) were 22 of the 51 s a calibrated --bits 8 of Qwen2.5-0.5B took
    on 36 pairs. Each candidate is scored on its own, two side by side, so each one's temporaries stay a few MB."""
    C, (m, k), n = S.shape[0], x.shape, w.shape[0]
    ref = x @ w.T
    den = float(torch.linalg.vector_norm(ref))
    if static:
        lo, hi = (cmin[None] / S).amin(dim=1).tolist(), (cmax[None] / S).amax(dim=1).tolist()

    def error(c: int) -> float:
        s = S[c]
        qw, sw = choose_scales((w * s).numpy()[:, None], *qrange(8))  # the written weights
        qw, sw = torch.from_numpy(qw[:, 0]), torch.from_numpy(sw.reshape(n))
        xs = x / s
        if static:
            y = static_outputs(xs, [activation_qparams(lo[c] * r, hi[c] * r) for r in SEARCH_CLIPS], qw, sw)
        else:
            y = dynamic_outputs(xs, qw, sw)[None]
        num = torch.linalg.vector_norm(y.sub_(ref), dim=(1, 2)).tolist()
        return min(e / den if den else 0.0 for e in num)                          # the candidate's best clip

    # the candidates side by side on torch's threads, each on one (ordered_map's threads run torch serially)
    return list(ordered_map(error, range(C), torch.get_num_threads()))


def up_down_pairs(lps: dict[str, Any]) -> list[tuple[str, str]]:
    """(up module, down module) of each gated MLP of a layer whose down_proj is activation-quantized (dense or
    shared experts; routed experts are separate linears per expert and are not folded)."""
    ups = {lp.module.rsplit(".", 1)[0]: lp.module for lp in lps.values()
           if lp.slot == "up" and not lp.is_expert}
    out = []
    for lp in lps.values():
        if lp.slot == "down" and not lp.is_expert and lp.qtype in ACT_QUANT:
            up = ups.get(lp.module.rsplit(".", 1)[0])
            if up is not None:
                out.append((up, lp.module))
    return out


def smooth_up_down(pairs: list[tuple[torch.nn.Module, torch.nn.Module]], probe: "SiteProbe",
                   is_static: Callable[[torch.nn.Module], bool], name: Callable[[torch.nn.Module], str]
                   ) -> tuple[list[dict[str, Any]], dict[torch.nn.Module, torch.Tensor]]:
    """Search and fold each (up_proj, down_proj) pair; the report entries (same shape as the norms') and the s each
    folded down_proj's input is now divided by."""
    out = []
    folded = {}
    for up, down in pairs:
        s, info = search_scales(probe.sites[down], [down.weight], is_static(down))
        entry: dict[str, Any] = {"norm": f"{name(up)} -> {name(down)}", "consumers": [name(down)],
                                 "applied": s is not None, "search": info}
        if s is None:
            entry["reason"] = "search: no smoothing has the smallest output error"
        else:
            fold_up_down(up, down, s)
            folded[down] = s
            entry.update(max_scale=round(float(s.max()), 4), min_scale=round(float(s.min()), 4))
        out.append(entry)
    return out, folded


def fold_up_down(up: torch.nn.Linear, down: torch.nn.Linear, s: torch.Tensor) -> None:
    """act_j / s_j through up_proj's rows (and bias), down_proj's columns x s: the MLP's output is unchanged."""
    with torch.no_grad():
        up.weight.div_(s[:, None])
        if up.bias is not None:
            up.bias.div_(s)
        down.weight.mul_(s)


def norm_fold(n: torch.Tensor, off: float, dt: torch.dtype, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A norm weight divided by s, as it will be stored: (new weight as float, rounded to dtype `dt`; the factor s
    it actually realises). The norm computes x * (off + n) (Gemma: off 1), so the new weight is (off + n) / s - off;
    rounding is undone by re-deriving s from the rounded value, so norm x consumer weight stays exact. A channel
    whose rounded weight would be 0 (or not finite) keeps its weight and s = 1."""
    n_new = ((off + n) / s - off).to(dt).float()
    ok = (off + n_new != 0) & torch.isfinite(n_new)
    n_new = torch.where(ok, n_new, n)
    s_eff = torch.where(ok, (off + n) / torch.where(ok, off + n_new, torch.ones_like(n_new)), torch.ones_like(n))
    return n_new, s_eff


def scales_in_range(s: torch.Tensor) -> torch.Tensor:
    """Factors kept finite and away from 0 (np.clip in smooth_scales already bounds them; belt and braces)."""
    return torch.nan_to_num(s, nan=1.0, posinf=1.0, neginf=1.0).clamp_(1e-4, 1e4)


class SiteProbe:
    """Hooks that fill a `SiteSample` per site during the smoothing probe's forward: a norm's output, or a
    linear's input (down_proj). `rows(x, what)` gives (real rows, per-channel min, per-channel max) without the
    padding (the calibrator's RowMask.channel_range, shared with the other hooks)."""

    def __init__(self, outputs_of: list[torch.nn.Module], inputs_of: list[torch.nn.Module], total_tokens: int,
                 rows: Callable[[torch.Tensor, str], tuple[torch.Tensor, Any, Any]]) -> None:
        self.sites: dict[torch.nn.Module, SiteSample] = {m: SiteSample(total_tokens) for m in outputs_of + inputs_of}
        self.handles = [m.register_forward_hook(lambda mod, a, out: self._add(mod, out)) for m in outputs_of]
        self.handles += [m.register_forward_pre_hook(lambda mod, a: self._add(mod, a[0])) for m in inputs_of]
        self._rows = rows

    def _add(self, mod: torch.nn.Module, x: torch.Tensor) -> None:
        try:
            rows, lo, hi = self._rows(x.detach(), "smoothing site")
        except RuntimeError:  # not one row per token (per-head q/k norms): never a smoothing site
            return
        self.sites[mod].update(rows, None if lo is None else (lo, hi))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
