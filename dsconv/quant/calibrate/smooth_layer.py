"""SmoothQuant for one layer, in the driver: the probes of the layer's forward (installed beside the statistics hooks,
so the statistics forward feeds the searches too: calibrate/steps.py), then per norm the strength (searched per
site, or the fixed --smooth-quant alpha) folded into the norm and its consumers (algorithms/smoothing.py has the
math). The folds leave the layer's float function unchanged, so the statistics gathered before them are rescaled
(`Smoothed.inputs`, `InputStats.rescale`) rather than gathered again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dsconv.families.roles import Role
from dsconv.quant.algorithms import smoothing as sm
from dsconv.quant.algorithms.schemes import smooth_scales
from dsconv.quant.calibrate.context import CalibContext, LayerActivations
from dsconv.quant.calibrate.hooks import FlowProbe
from dsconv.qformat import STATIC_TYPES
from dsconv.quant.plan.plan import ACT_QUANT, LinearPlan
from dsconv.tensors import torch_dtype


@dataclass
class SmoothProbes:
    """What the smoothing searches read from a layer's forward: which modules read each norm's output and its
    per-channel max |output| (`FlowProbe`), and a row sample with per-channel min/max of every searched site
    (`SiteProbe`: norm outputs, down_proj inputs). Installed beside the statistics hooks, so one forward feeds both."""

    probe: FlowProbe
    sites: sm.SiteProbe
    norms: list[nn.Module]
    consumers: list[nn.Module]
    pairs: list[tuple[nn.Module, nn.Module]]  # (up_proj, down_proj) searched for the up -> down fold
    own: dict[nn.Module, tuple[str, Role]]

    def remove(self) -> None:
        self.probe.remove()
        self.sites.remove()


@dataclass
class Smoothed:
    """What a layer's smoothing changed: the float tensors to write (norms, routers), the scale folded into the
    routed experts' gate/up columns (None: none), each linear whose input the folds divided (module -> s), and one
    entry per site for quant_report.json."""

    modified: dict[str, torch.Tensor] = field(default_factory=dict)
    col_scale: torch.Tensor | None = None
    inputs: dict[nn.Module, torch.Tensor] = field(default_factory=dict)
    log: list[dict[str, Any]] = field(default_factory=list)


def smoothing_probes(run: CalibContext, acts: LayerActivations, layer: nn.Module, targets: dict[nn.Module, LinearPlan],
                     experts: nn.Module | None, lps: dict[str, LinearPlan]) -> SmoothProbes:
    """The hooks of the smoothing searches on `layer` (remove them after the forward)."""
    sk = run.sk
    own = sk.own_weights(layer)  # module -> (ck param name, role) of its direct weight
    norms = [m for m, (_, r) in own.items() if r == Role.NORM]
    consumers = [m for m in layer.modules() if isinstance(m, nn.Linear) or
                 (m in own and own[m][1] == Role.ROUTER)]
    if experts is not None:
        consumers.append(experts)
    probe = FlowProbe(norms, consumers, acts.rows)
    auto = run.opts.smooth_alpha == "auto"
    by_name = {lp.module: mod for mod, lp in targets.items()}
    pairs = [(by_name[u], by_name[d]) for u, d in sm.up_down_pairs(lps) if u in by_name and d in by_name
             and lps[u].bias is None] if auto else []
    sites = sm.SiteProbe(norms if auto else [], [d for _, d in pairs], acts.tokens, acts.rows.channel_range)
    return SmoothProbes(probe, sites, norms, consumers, pairs, own)


def fold(run: CalibContext, i: int, probes: SmoothProbes, targets: dict[nn.Module, LinearPlan],
         experts: nn.Module | None, lps: dict[str, LinearPlan]) -> Smoothed:
    """SmoothQuant folded into the norms that feed quantized linears: s = act^a / w^(1-a) per input channel;
    norm weight / s (rounded to its dtype, then s re-derived from the rounded value so norm x weight is exact),
    consumer weights x s (and router weights, kept in float, x s). A norm with a consumer that stays in float or
    is weight-only is left alone (reported). Then the up -> down folds of the searched pairs."""
    sk, ck = run.sk, run.ck
    probe, sites, own = probes.probe, probes.sites, probes.own
    auto = run.opts.smooth_alpha == "auto"
    out = Smoothed()
    E = int(experts.gate_up_proj.shape[0]) if experts is not None else 0
    for norm, cons in probe.consumers.items():
        if not cons:
            continue
        norm_name = own[norm][0]
        entry: dict[str, Any] = {"norm": norm_name, "consumers": [], "applied": False}
        linears, routers, with_experts, reason = _consumers(sk, i, cons, own, targets, experts, E, lps,
                                                            entry["consumers"])
        if auto and (with_experts or not linears):  # the search judges the linears it can run, not experts
            reason = "auto: routed experts read it (not searched; give --smooth-quant ALPHA to smooth it)"
        if reason:
            entry["reason"] = reason
            out.log.append(entry)
            continue
        w_absmax = torch.zeros(norm.weight.shape[0])
        for c in linears:
            w_absmax = torch.maximum(w_absmax, c.weight.detach().abs().amax(dim=0))
        if with_experts:
            for e in range(E):
                names = sk.expert_weight_names(i, e)
                for slot in ("gate", "up"):
                    w_absmax = torch.maximum(w_absmax, sk.load(names[slot]).abs().amax(dim=0))
        if auto:
            static = any(targets[c].qtype in STATIC_TYPES for c in linears)
            s, entry["search"] = sm.search_scales(sites.sites[norm], [c.weight for c in linears], static)
            if s is None:
                entry["reason"] = "search: no smoothing has the smallest output error"
                out.log.append(entry)
                continue
        else:
            s = torch.from_numpy(smooth_scales(probe.absmax[norm].numpy(), w_absmax.numpy(),
                                               run.opts.smooth_alpha))
        dt = torch_dtype(ck.info(norm_name).dtype)
        n_new, s_eff = sm.norm_fold(norm.weight.detach().clone(), ck.family.norm_offset, dt, s)
        norm.weight.copy_(n_new)
        out.modified[norm_name] = n_new.to(dt)
        for c in linears:
            c.weight.mul_(s_eff)
            out.inputs[c] = s_eff
        for c in routers:
            rname = own[c][0]
            rdt = torch_dtype(ck.info(rname).dtype)
            new = (c.weight.detach() * s_eff).to(rdt)
            c.weight.copy_(new.float())
            out.modified[rname] = new
        if with_experts:
            out.col_scale = s_eff
        entry.update(applied=True, max_scale=round(float(s_eff.max()), 4), min_scale=round(float(s_eff.min()), 4))
        out.log.append(entry)
    log, downs = sm.smooth_up_down(probes.pairs, sites, lambda m: targets[m].qtype in STATIC_TYPES,
                                   lambda m: sk.ck_name(sk.module_names[m]))
    out.log += log
    out.inputs.update(downs)
    return out


def _consumers(sk: Any, i: int, cons: list[nn.Module], own: dict[nn.Module, tuple[str, Role]],
               targets: dict[nn.Module, LinearPlan], experts: nn.Module | None, E: int, lps: dict[str, LinearPlan],
               names: list[str]) -> tuple[list[nn.Module], list[nn.Module], bool, str | None]:
    """A norm's readers sorted out: the quantized linears, the routers, whether the routed experts read it, and
    the first reason it cannot be smoothed (None: it can); each reader's name is appended to `names`."""
    reason = None
    linears, routers, with_experts = [], [], False
    for c in cons:
        if c is experts:
            names.append(f"{sk.module_names[c]} ({E} experts)")
            for e in range(E):
                for slot in ("gate", "up"):
                    lp = lps.get(sk.expert_module_names(i, e)[slot])
                    if lp is None or lp.qtype not in ACT_QUANT:
                        reason = reason or f"expert {e} {slot} is not activation-quantized"
            with_experts = True
            continue
        cname = sk.ck_name(sk.module_names[c])
        names.append(cname)
        if c in targets:
            if targets[c].qtype not in ACT_QUANT:
                reason = reason or f"{cname} is weight-only ({targets[c].qtype})"
            linears.append(c)
        elif c in own and own[c][1] == Role.ROUTER:
            routers.append(c)
        else:
            reason = reason or f"{cname} stays in float"
    return linears, routers, with_experts, reason
