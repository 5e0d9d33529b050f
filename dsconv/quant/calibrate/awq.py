"""Activation-aware weight quantization for weight-only schemes (`--method awq`: W4A16, W8A16).

Why: round-to-nearest spends each group's grid on its largest weight, blind to which input channels carry large
activations. A few channels of a real model's norm outputs are 10-100x the rest, and their weights' rounding error
is multiplied by them. Scaling those weight columns up by s (and the activation down by s, folded exactly into the
producer) gives them finer effective steps at the cost of the others.

Per *site* (the quantized linears reading one input: a norm's consumers such as q/k/v or gate/up, or down_proj whose
input is up_proj's rows), on calibration rows:

1. scale search: s = mean|x|^alpha (normalised), alpha in `ALPHAS` (0 = off, plain rounding), keeping the alpha with
   the smallest relative output error of the consumers, weights fake-quantized exactly as written (group int4 or
   per-channel int8 round-to-nearest) and activations in float. For a norm, s is the one its rounded weight gives.
2. clip search (grouped widths only): each group's scale max|w|/qmax x r, r in `CLIP_RATIOS`, chosen per group by
   that group's output error d^T H_g d, H_g the group's block of X^T X over all (non-held-out) calibration tokens.
3. held-out check: every consumer's output error on held-out prompts (selection.py's split) against plain rounding
   of the original weight. The fold is applied only if *no* consumer is worse there; otherwise each consumer gets,
   unscaled, the better of clip-searched and plain rounding. So no linear is worse than round-to-nearest on tokens
   the searches did not see.

The fold: a norm's weight / s (offset-aware, Gemma's 1 + w; smoothing.norm_fold), consumers' columns x s; up_proj's
rows / s and down_proj's columns x s; v_proj's rows (and bias) / s and o_proj's columns x s, each v row's factor
repeated for the query heads that read it (GQA). All leave the float function unchanged. Linears of
routed experts and consumers of a norm that a router or a float linear also reads are never folded (clip only).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from dsconv.families.roles import Role
from dsconv.quant.algorithms import grid, selection
from dsconv.quant.algorithms import smoothing as sm
from dsconv.quant.algorithms.error_metrics import output_error
from dsconv.quant.algorithms.fake_quant import fake_quant_groups, groups_of
from dsconv.quant.algorithms.schemes import qrange
from dsconv.quant.calibrate.algorithm import Algorithm, LayerState
from dsconv.quant.calibrate.context import CalibContext, LayerActivations
from dsconv.quant.calibrate.hooks import FlowProbe, LinearHooks
from dsconv.runner.layers import install_forward
from dsconv.quant.calibrate.linear import WeightChoice
from dsconv.quant.plan.plan import BITS, LinearPlan
from dsconv.tensors import torch_dtype

ALPHAS = tuple(i / 10 for i in range(11))          # 0.0 = no scaling
CLIP_RATIOS = tuple(1.0 - i / 20 for i in range(11))  # 1.0 (max|w|, wins ties) .. 0.5
SEARCH_ROWS = 256
HELD_ROWS = 256
MAX_OUT_ROWS = 2048
ROW_BLOCK_ELEMS = 1 << 21
WEIGHT_ONLY = ("W8A16", "W4A16")  # activation-quantized linears are smoothed instead (smoothing.py)


class AwqStats:
    """One linear input during the probe: mean |x| and a row sample of search tokens, the group blocks of X^T X
    (grouped widths), and a row sample of held-out tokens."""

    def __init__(self, k: int, group: int, total_tokens: int, held: bool) -> None:
        self.k, self.g = k, group
        self.abs_sum = torch.zeros(k, dtype=torch.float64)
        self.count = 0
        self.search = sm.SiteSample(total_tokens, SEARCH_ROWS)
        self.held = sm.SiteSample(max(1, total_tokens // selection.HOLD_EVERY), HELD_ROWS) if held else None
        self.hblocks = torch.zeros(k // group, group, group) if 0 < group < k else None

    def update(self, x: torch.Tensor, held: torch.Tensor | None = None) -> None:
        x = x.reshape(-1, self.k).float()
        if self.held is not None and held is not None and bool(held.any()):
            self.held.update(x[held])
            x = x[~held]
        if x.shape[0] == 0:
            return
        self.abs_sum += x.abs().sum(dim=0, dtype=torch.float64)
        self.count += x.shape[0]
        self.search.update(x)
        if self.hblocks is not None:
            xg = x.reshape(x.shape[0], -1, self.g).transpose(0, 1)  # [G, t, g]
            self.hblocks += torch.bmm(xg.transpose(1, 2), xg)

    @property
    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / max(1, self.count)).float()


# ---- quantizers (what the written weight dequantizes to: algorithms/fake_quant.py) -----------------------------
def clip_search(w: torch.Tensor, hblocks: torch.Tensor | None, bits: int, g: int
                ) -> tuple[np.ndarray, np.ndarray, float]:
    """int8 q [n, k], float32 scales [n, groups] and the mean chosen ratio: each group's scale max|w|/qmax x r with
    r minimising d^T H_g d (its output error on the calibration tokens, grid.search); without blocks,
    round-to-nearest."""
    qmin, qmax = qrange(bits)
    n, k = w.shape
    G = groups_of(k, g)
    gs = k // G
    q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, G, dtype=torch.float32)
    ratio_sum = 0.0
    step = max(1, ROW_BLOCK_ELEMS // max(1, k))
    for s in range(0, n, step):
        w3 = w[s:s + step].float().reshape(-1, G, gs)
        best_sc, best_r = grid.search(w3, qmin, qmax, hblocks=hblocks, ratios=CLIP_RATIOS if hblocks is not None
                                      else (1.0,))
        scale[s:s + step] = best_sc
        ratio_sum += float(best_r.sum())
        q[s:s + step] = torch.round(w3 / best_sc[..., None]).clamp_(qmin, qmax).to(torch.int8).reshape(-1, k)
    return q.numpy(), scale.numpy(), ratio_sum / max(1, n * G)


def _dequant(q: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    n, k = q.shape
    G = scale.shape[1]
    return (torch.from_numpy(q).float().reshape(n, G, -1) * torch.from_numpy(scale)[..., None]).reshape(n, k)


class RowFold:
    """A producer linear whose output rows are the consumer's input channels (up_proj -> down_proj, exact for a
    gated MLP; v_proj -> o_proj, each v row read by `groups` query heads of `head_dim` channels under GQA): the
    consumer's factors are the producer's, repeated per group, so one factor per producer row."""

    def __init__(self, producer: nn.Linear, groups: int, head_dim: int) -> None:
        self.producer, self.groups, self.hd = producer, groups, head_dim

    def reduce(self, per_input: torch.Tensor) -> torch.Tensor:
        """Consumer-input statistics -> one value per producer row (the mean over the heads that read it)."""
        if self.groups == 1:
            return per_input
        return per_input.reshape(-1, self.groups, self.hd).mean(dim=1).reshape(-1)

    def expand(self, per_row: torch.Tensor) -> torch.Tensor:
        if self.groups == 1:
            return per_row
        return per_row.reshape(-1, 1, self.hd).expand(-1, self.groups, self.hd).reshape(-1)

    def fold(self, consumer: nn.Linear, s_in: torch.Tensor) -> None:
        """Producer rows (and bias) / s, consumer columns x s: the float function is unchanged."""
        s_row = s_in if self.groups == 1 else s_in.reshape(-1, self.groups, self.hd)[:, 0].reshape(-1)
        with torch.no_grad():
            self.producer.weight.div_(s_row[:, None])
            if self.producer.bias is not None:
                self.producer.bias.div_(s_row)
            consumer.weight.mul_(s_in)


# ---- the scale search -----------------------------------------------------------------------------------------
def candidate_scales(mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """mean|x|^alpha, normalised so max x min = 1 (int quantization is scale-free; this keeps the fold's values
    moderate)."""
    s = mean_abs.clamp(min=1e-5).pow(alpha)
    s = s / torch.sqrt(s.max() * s.min())
    return sm.scales_in_range(s)


def search_alpha(x: torch.Tensor, mean_abs: torch.Tensor, weights: list[torch.Tensor], bits: int, g: int,
                 effective=lambda s: s) -> tuple[float, torch.Tensor | None, dict[str, float]]:
    """(alpha, s or None for off, error by alpha): the smallest relative output error of the consumers with their
    weights scaled and quantized at the target width, activations x / s in float. `effective(s)` is the s a fold
    can realise (a norm's rounded weight)."""
    w_all = torch.cat([w.detach().float() for w in weights])
    w = w_all[:: max(1, w_all.shape[0] // MAX_OUT_ROWS)]
    tried: dict[str, float] = {}
    best = (float("inf"), 0.0, None)
    for a in ALPHAS:
        s = None if a == 0.0 else effective(candidate_scales(mean_abs, a))
        w_hat = fake_quant_groups(w, bits, g) if s is None else fake_quant_groups(w * s, bits, g) / s
        e = output_error(x, w, w_hat)
        tried[str(a)] = round(e, 6)
        if e < best[0]:
            best = (e, a, s)
    return best[1], best[2], tried


# ---- one layer ------------------------------------------------------------------------------------------------
Forward = Callable[[nn.Module, list[int], bool], None]  # (layer, samples, write outputs): one batch in the driver


@dataclass
class AwqLayer:
    """What the search did to a layer: float tensors it changed (folded norms), the weight chosen per linear module
    name, whether the probe already wrote the layer's outputs, and the per-site entries of quant_report.json's
    "awq" (None when the layer has no weight-only dense linear)."""

    modified: dict[str, torch.Tensor] = field(default_factory=dict)
    choices: dict[str, WeightChoice] = field(default_factory=dict)
    written: bool = False
    log: list[dict[str, Any]] | None = None


def run_layer(run: CalibContext, acts: LayerActivations, forward: Forward, i: int, layer: nn.Module,
              targets: dict[nn.Module, LinearPlan], lps: dict[str, LinearPlan], experts: nn.Module | None = None
              ) -> AwqLayer:
    """Probe, search, fold and choose the weights of the dense linears of layer i (module docstring).

    Without routed experts the probe's outputs are the layer's float outputs (every fold is exact), so they are
    propagated from it and the calibrator needs no second pass over the calibration tokens."""
    dense = {m: lp for m, lp in targets.items() if not lp.is_expert and lp.qtype in WEIGHT_ONLY}
    if not dense:
        return AwqLayer()
    if experts is not None:  # the experts run later, one at a time (calibration.py); not needed for this probe
        install_forward(experts, lambda h, idx, wts: torch.zeros_like(h))
    own = run.sk.own_weights(layer)
    hooks, flow = _probe(run, acts, forward, layer, dense, own, write=experts is None)
    sites: dict[int, list[nn.Module]] = {}
    stats: dict[int, AwqStats] = {}
    for mod, st in hooks.group.items():
        sites.setdefault(id(st), []).append(mod)
        stats[id(st)] = st
    producer = _producers(layer, dense, hooks, flow, sites)
    out = AwqLayer(written=experts is None, log=[])
    row_folded: set[nn.Module] = set()
    # up -> down and v -> o first: they rescale up_proj's / v_proj's rows, which a norm's site then quantizes
    order = sorted(sites, key=lambda key: 0 if producer.get(key, ("",))[0] == "rows" else 1)
    for key in order:
        _site(run, i, dense, own, sites[key], stats[key], producer.get(key, ("none", None)), row_folded, out)
    return out


def _probe(run: CalibContext, acts: LayerActivations, forward: Forward, layer: nn.Module,
           dense: dict[nn.Module, LinearPlan], own: dict[nn.Module, tuple[str, Any]], write: bool
           ) -> tuple[LinearHooks, FlowProbe]:
    """Every batch through the layer, gathering each dense input's AwqStats and which modules read each norm."""
    g = run.plan.group_size or 0
    norms = [m for m, (_, r) in own.items() if r == Role.NORM]
    readers = [m for m in layer.modules() if isinstance(m, nn.Linear) or (m in own and own[m][1] == Role.ROUTER)]
    held = acts.held_tokens is not None
    total = acts.tokens
    hooks = LinearHooks(dense, lambda lp: AwqStats(lp.k, g if BITS[lp.qtype] == 4 else 0, total, held), acts.rows)
    flow = FlowProbe(norms, readers, acts.rows)
    for samples in acts.batches:
        forward(layer, samples, write)
        hooks.end_batch()
        flow.end_batch()
    hooks.remove()
    flow.remove()
    return hooks, flow


def _producers(layer: nn.Module, dense: dict[nn.Module, LinearPlan], hooks: LinearHooks, flow: FlowProbe,
               sites: dict[int, list[nn.Module]]) -> dict[int, tuple[str, Any]]:
    """Per site (by its statistics' id), what can absorb its scales: ("norm", the norm), ("rows", RowFold) or
    ("blocked", why); a site missing here has no producer."""
    producer: dict[int, tuple[str, Any]] = {}
    for norm, cons in flow.consumers.items():
        mods = [c for c in cons if c in dense]
        if not mods:
            continue
        key = id(hooks.group[mods[0]])
        others = [c for c in cons if c not in dense]
        producer[key] = ("norm", norm) if not others else ("blocked", f"{len(others)} other reader(s) of the norm")
    ups = {lp.module.rsplit(".", 1)[0]: m for m, lp in dense.items() if lp.slot == "up"}
    for m, lp in dense.items():
        if lp.slot == "down":
            up = ups.get(lp.module.rsplit(".", 1)[0])
            if up is not None and len(sites[id(hooks.group[m])]) == 1:
                producer[id(hooks.group[m])] = ("rows", RowFold(up, 1, 1))
    for attn in layer.modules():  # v -> o: o_proj's input channels are v_proj's rows, repeated per GQA group
        v, o = getattr(attn, "v_proj", None), getattr(attn, "o_proj", None)
        groups, hd = getattr(attn, "num_key_value_groups", None), getattr(attn, "head_dim", None)
        if v in dense and o in dense and groups and hd and len(sites[id(hooks.group[o])]) == 1 \
                and v.weight.shape[0] * groups == o.weight.shape[1]:
            producer[id(hooks.group[o])] = ("rows", RowFold(v, int(groups), int(hd)))
    return producer


def _site(run: CalibContext, i: int, dense: dict[nn.Module, LinearPlan], own: dict[nn.Module, tuple[str, Any]],
          mods: list[nn.Module], st: AwqStats, prod: tuple[str, Any], row_folded: set[nn.Module],
          out: AwqLayer) -> None:
    """One site: the scale search, the fold where no consumer is worse on held-out rows, each consumer's weight
    choice (into `out`)."""
    ck, g = run.ck, run.plan.group_size or 0
    name = lambda m: dense[m].module  # noqa: E731
    kind, src = prod
    bits = BITS[dense[mods[0]].qtype]
    entry: dict[str, Any] = {"site": " ".join(name(m) for m in mods), "layer": i}
    x_search = st.search.x if st.search.rows else None
    x_held = st.held.x if st.held is not None and st.held.rows else x_search
    if x_search is None:
        entry.update(applied=False, reason="no calibration tokens")
        out.log.append(entry)
        return
    w_orig = {m: m.weight.detach().float().clone() for m in mods}
    rtn = {m: fake_quant_groups(w_orig[m], bits, g) for m in mods}
    err_rtn = {m: output_error(x_held, w_orig[m], rtn[m]) for m in mods}
    s = None
    effective = lambda s_: s_  # noqa: E731
    if kind == "norm":
        norm_name = own[src][0]
        n0 = src.weight.detach().clone()
        dt = torch_dtype(ck.info(norm_name).dtype)
        effective = lambda s_: sm.norm_fold(n0, ck.family.norm_offset, dt, s_)[1]  # noqa: E731
    mean_abs = st.mean_abs
    if kind == "rows":
        mean_abs, effective = src.reduce(mean_abs), src.expand
    if kind in ("norm", "rows"):
        alpha, s, entry["error_by_alpha"] = search_alpha(x_search, mean_abs, list(w_orig.values()), bits,
                                                         g, effective)
        entry["alpha"] = alpha
    else:
        entry["alpha"] = None
        entry["reason"] = f"not foldable ({src if kind == 'blocked' else 'no norm, up_proj or v_proj produces it'})"
    hb = st.hblocks
    chosen: dict[nn.Module, tuple] = {}
    if s is not None:
        hb_s = None if hb is None else hb / s.reshape(-1, 1, hb.shape[1]) / s.reshape(-1, hb.shape[1], 1)
        cand = {m: clip_search(w_orig[m] * s, hb_s, bits, g) for m in mods}
        err_awq = {m: output_error(x_held, w_orig[m], _dequant(*cand[m][:2]) / s) for m in mods}
        if all(err_awq[m] <= err_rtn[m] for m in mods):
            chosen = {m: ("awq", cand[m], err_awq[m]) for m in mods}
            if kind == "norm":
                n_new, s_eff = sm.norm_fold(src.weight.detach().clone(), ck.family.norm_offset, dt, s)
                src.weight.copy_(n_new)
                out.modified[own[src][0]] = n_new.to(dt)
                for m in mods:
                    m.weight.mul_(s_eff)
            else:
                src.fold(mods[0], s)
                row_folded.add(src.producer)
            entry.update(applied=True, max_scale=round(float(s.max()), 4), min_scale=round(float(s.min()), 4))
        else:
            worse = [name(m) for m in mods if err_awq[m] > err_rtn[m]]
            entry.update(applied=False, reason=f"held-out: scaled worse than rtn on {', '.join(worse)}")
        entry["held_out_scaled"] = {name(m): round(err_awq[m], 6) for m in mods}
    else:
        entry["applied"] = False
        entry.setdefault("reason", "alpha 0 (no scaling) has the smallest output error")
    if not chosen:  # unscaled: per linear, the better of clip-searched and plain rounding on held-out rows
        for m in mods:
            q, sc, r = clip_search(w_orig[m], hb, bits, g)
            e = output_error(x_held, w_orig[m], _dequant(q, sc))
            chosen[m] = ("clip", (q, sc, r), e) if e < err_rtn[m] else ("rtn", None, err_rtn[m])
    entry["held_out_rtn"] = {name(m): round(err_rtn[m], 6) for m in mods}
    entry["choice"] = {}
    for m in mods:
        how, res, e = chosen[m]
        entry["choice"][name(m)] = how
        info = {"held_out_awq": e, "held_out_rtn": err_rtn[m]}
        if res is not None:
            entry.setdefault("mean_clip", {})[name(m)] = round(res[2], 4)
        bias = None  # a producer folded above (v_proj's bias / s) writes its new bias, in the original dtype
        if m in row_folded and m.bias is not None:
            bias = m.bias.detach().to(torch_dtype(ck.info(dense[m].bias).dtype))
        out.choices[name(m)] = WeightChoice(None if res is None else res[:2], how, info, bias)
    out.log.append(entry)


class Awq(Algorithm):
    """--method awq as a calibration plug-in (algorithm.py): before the statistics forward, its own probe of the
    layer searches, folds and chooses the weight-only dense linears' weights (`run_layer`); a dense layer's outputs
    come from that probe, so no statistics forward follows (`st.written`)."""

    name = "awq"
    step = "awq"
    holds_out = True

    @classmethod
    def active(cls, run: CalibContext) -> bool:
        return run.plan.method == "awq"

    def before(self, st: LayerState) -> None:
        cal = self.cal
        with cal.clock(self.step):
            if st.observed and st.experts is None:  # the probe replaces the input rows with the outputs; the
                st.layer_input = cal.acts.h.clone()  # observers must see the input (steps.calibrate_layer)
            chosen = run_layer(self.run, cal.acts, cal.fwd.serial_batch, st.i, st.layer, st.targets, st.lps,
                               st.experts)
            st.modified.update(chosen.modified)
            st.choices, st.written = chosen.choices, chosen.written
            if chosen.log is not None:
                cal.decisions.setdefault("awq", []).extend(chosen.log)
            if not st.written:
                st.layer_input = None
