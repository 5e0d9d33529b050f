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
from dsconv.quant.algorithms.observers import MinMaxObserver
from dsconv.quant.calibrate.algorithm import Algorithm, JobEnv, LayerState, Observer
from dsconv.quant.calibrate.context import CalibContext, LayerActivations
from dsconv.quant.calibrate.hooks import FlowProbe
from dsconv.runner.layers import install_forward
from dsconv.quant.calibrate.stats import InputStats
from dsconv.quant.formats.msmodelslim import FA_QUANT
from dsconv.quant.plan.options import smoothing_of
from dsconv.qformat import STATIC_TYPES
from dsconv.quant.plan.plan import ACT_QUANT, LinearPlan
from dsconv.tensors import torch_dtype


class SmoothQuant(Algorithm):
    """SmoothQuant as a calibration plug-in (algorithm.py): observes the norms' outputs and their readers (riding on
    the statistics forward where its statistics can follow its folds, else a probe forward of its own first), then
    per norm folds the strength searched (or the fixed --smooth-quant alpha) into the norm and its readers."""

    name = "smoothquant"
    step = "smooth_search"

    @classmethod
    def active(cls, run: CalibContext) -> bool:
        return smoothing_of(run.opts, run.plan) is not None

    def folds_into_experts(self) -> bool:
        """A fixed alpha folds a scale into the routed experts' gate/up columns; auto never smooths a norm the
        experts read (fold), so their jobs may start right after the forward."""
        return self.run.opts.smooth_alpha != "auto"

    def before(self, st: LayerState) -> None:
        cal = self.cal
        self.obs = None
        if one_forward(self.run, st.i, st.lps):  # the searches' probes ride on the statistics forward
            self.obs = smoothing_probes(self.run, cal.acts, st.layer, st.targets, st.experts, st.lps)
            return
        if st.experts is not None:  # a probe forward of its own first (the attention runs before the MLP)
            install_forward(st.experts, lambda h, idx, wts: torch.zeros_like(h))
        first = smoothing_probes(self.run, cal.acts, st.layer, st.targets, st.experts, st.lps)
        with cal.clock("forward"):
            cal.fwd.observe_pass(st.i, st.layer, [first])
        first.remove()
        with cal.clock(self.step):
            self._keep(st, fold(self.run, st.i, first, st.targets, st.experts, st.lps))

    def observers(self, st: LayerState) -> list[Observer]:
        return [self.obs] if self.obs is not None else []

    def after(self, st: LayerState) -> None:
        if self.obs is None:
            return
        with self.cal.clock(self.step):
            smoothed = fold(self.run, st.i, self.obs, st.targets, st.experts, st.lps)
            rescale_inputs(st.hooks.group, smoothed.inputs)
            if smoothed.col_scale is not None and st.recorder is not None:
                st.recorder.rescale(smoothed.col_scale)
            self._keep(st, smoothed)

    def _keep(self, st: LayerState, smoothed: "Smoothed") -> None:
        st.modified.update(smoothed.modified)
        st.col_scale = smoothed.col_scale
        self.cal.smoothing += smoothed.log


def one_forward(run: CalibContext, i: int, lps: dict[str, LinearPlan]) -> bool:
    """Whether layer i's smoothing searches share its statistics forward (steps.py, step 3): not with a histogram
    observer, nor where FA quant's latent norm feeds an activation-quantized kv_b_proj (a norm that could be
    smoothed, which would change the latent FA quant measures per tensor)."""
    if run.static and run.observer_method != MinMaxObserver.method:
        return False
    kv = run.plan.kv.get(i)
    if kv is not None and kv.form == FA_QUANT:
        lp = lps.get(kv.measured[1])
        if lp is not None and lp.qtype in ACT_QUANT:
            return False
    return True


def rescale_inputs(group: dict[nn.Module, InputStats], inputs: dict[nn.Module, torch.Tensor]) -> None:
    """Each distinct input's statistics divided by the s its fold divided it by (shared inputs: once)."""
    done: set[int] = set()
    for mod, s in inputs.items():
        st = group.get(mod)
        if st is not None and id(st) not in done:
            done.add(id(st))
            st.rescale(s)


class SmoothObserver(Observer):
    """What the smoothing searches read from a layer's forward: which modules read each norm's output and its
    per-channel max |output| (`FlowProbe`, readers recorded from batch 0), and a row sample with per-channel min/max
    of every searched site (`SiteProbe`: norm outputs, down_proj inputs). Rides on the statistics forward, or on a
    probe forward of its own (`one_forward`); rebuilt by name in a forward job (algorithm.py)."""

    key = "smoothing"

    def __init__(self, probe: FlowProbe, sites: sm.SiteProbe, norms: list[nn.Module], consumers: list[nn.Module],
                 pairs: list[tuple[nn.Module, nn.Module]] = (), own: dict | None = None, first: int = 0) -> None:
        self.probe, self.sites, self.norms, self.consumers = probe, sites, norms, consumers
        self.pairs = list(pairs)  # (up_proj, down_proj) searched for the up -> down fold
        self.own = own or {}
        self.first = first

    def spec(self, names: dict[nn.Module, str]) -> dict[str, list[str]]:
        norms = set(self.norms)
        return {"norms": [names[m] for m in self.norms], "consumers": [names[c] for c in self.consumers],
                "site_out": [names[m] for m in self.sites.sites if m in norms],
                "site_in": [names[m] for m in self.sites.sites if m not in norms]}

    @classmethod
    def install(cls, spec: dict[str, list[str]], env: JobEnv) -> "SmoothObserver":
        mods = env.modules
        norms, consumers = [mods[m] for m in spec["norms"]], [mods[m] for m in spec["consumers"]]
        probe = FlowProbe(norms, consumers, env.rows)
        probe.record = env.first == 0
        sites = sm.SiteProbe([mods[m] for m in spec["site_out"]], [mods[m] for m in spec["site_in"]], env.tokens,
                             env.rows.channel_range)
        for s in sites.sites.values():
            s.sampler.start_at(env.offset)
        return cls(probe, sites, norms, consumers, first=env.first)

    def end_batch(self) -> None:
        self.probe.end_batch()

    def remove(self) -> None:
        self.probe.remove()
        self.sites.remove()

    def partial(self, names: dict[nn.Module, str]) -> dict[str, Any]:
        p = self.probe
        return {"absmax": {names[m]: a for m, a in p.absmax.items()},
                "consumers": {names[m]: [names[c] for c in cs] for m, cs in p.consumers.items()}
                if self.first == 0 else {},
                "sites": {names[m]: s for m, s in self.sites.sites.items()}}

    def merge(self, part: dict[str, Any], offset: int, by_name: dict[str, nn.Module]) -> None:
        """A job's norm maxima, readers (from the job holding batch 0) and site samples, in batch order."""
        probe = self.probe
        for n, a in part["absmax"].items():
            prev = probe.absmax.get(by_name[n])
            probe.absmax[by_name[n]] = a if prev is None else torch.maximum(prev, a)
        for n, cs in part["consumers"].items():
            probe.consumers[by_name[n]] = [by_name[c] for c in cs]
        for n, b in part["sites"].items():
            merge_site(self.sites.sites[by_name[n]], b, offset)


def merge_site(a: sm.SiteSample, b: sm.SiteSample, offset: int) -> None:
    """Fold a job's SiteSample (started at token `offset`) into the driver's, in batch order."""
    if b.cmin is None:
        return
    a.sampler.extend(b.sampler, offset, "a smoothing site")
    a.cmin = b.cmin if a.cmin is None else torch.minimum(a.cmin, b.cmin)
    a.cmax = b.cmax if a.cmax is None else torch.maximum(a.cmax, b.cmax)


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
                     experts: nn.Module | None, lps: dict[str, LinearPlan]) -> SmoothObserver:
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
    return SmoothObserver(probe, sites, norms, consumers, pairs, own)


def fold(run: CalibContext, i: int, probes: SmoothObserver, targets: dict[nn.Module, LinearPlan],
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
