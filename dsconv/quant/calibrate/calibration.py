"""The calibrated path of `dsconv quantize` (static W8A8, GPTQ, smoothing, or an explicit --calib).

The calibration tokens are embedded once, then each decoder layer is materialised from the checkpoint, all
calibration activations are pushed through it with statistics streamed by hooks (as jobs over runs of the
calibration batches where the run allows: forward_jobs.py), its linears are quantized and written, and it is freed.
Routed experts run after the rest of the layer, each as its own job (calib_jobs.py: its forward, statistics and
quantization), as do the quantization of the layer's other linears once their statistics are
in; the jobs run on the executor (`--workers`, `--executor ray`), the driver writes their results in order, so peak
driver memory is one layer without its experts, the jobs in flight, and the activations ([tokens, hidden] float32,
twice).

Activations propagate in float (each layer sees the float model's inputs), so statistics do not depend on the
order layers are quantized in, and the layer-by-layer results equal a whole-model forward with hooks. GPTQ is the
exception (as in its paper): a dense layer's outputs are recomputed with its quantized weights before the next layer
calibrates, so each Hessian describes the inputs the quantized model will actually produce (one extra forward per
layer; MoE layers still pass on float outputs).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from dsconv.checkpoint import Checkpoint
from dsconv.errors import UserError
from dsconv.executor import Executor
from dsconv.families.roles import Role
from dsconv.quant.algorithms import clipping, selection
from dsconv.quant.algorithms import smoothing as sm
from dsconv.quant.algorithms.schemes import (activation_qparams, dequant_weight, relative_error, smooth_scales,
                                             w8a8_static_params)
from dsconv.quant.calibrate import awq, calib_jobs, forward_jobs
from dsconv.quant.calibrate.data import CalibSet
from dsconv.quant.calibrate.hooks import ExpertRecorder, FlowProbe, LinearHooks, RowMask
from dsconv.quant.calibrate.layers import Skeleton, install_forward
from dsconv.quant.calibrate.stats import InputStats, LinearRecord, output_errors
from dsconv.quant.formats.msmodelslim import LinearResult
from dsconv.quant.formats.output import QuantWriter
from dsconv.quant.plan.options import QuantOptions, smoothing_of
from dsconv.quant.plan.plan import ACT_QUANT, STATIC, LinearPlan, QuantPlan
from dsconv.quant.weights import quantize_weight
from dsconv.tensors import torch_dtype


def static_aux(lp: LinearPlan, q: np.ndarray, scale: np.ndarray, qparams: tuple[float, float],
               bias: torch.Tensor | None) -> dict[str, np.ndarray]:
    b = None if bias is None else bias.float().numpy()
    return w8a8_static_params(q, scale, qparams[0], qparams[1], b, name=lp.module)


@dataclass
class Pending:
    """A quantized weight waiting for its activation parameters (and the rows to measure its output error on)."""

    lp: LinearPlan
    q: np.ndarray
    scale: np.ndarray
    bias: torch.Tensor | None
    rec: LinearRecord
    x: torch.Tensor | None
    y_ref: torch.Tensor | None


class Calibrator:
    """Layer-by-layer calibration and quantization (see the module docstring)."""

    def __init__(self, ck: Checkpoint, plan: QuantPlan, opts: QuantOptions, calib: CalibSet, qw: QuantWriter,
                 progress: bool = True, executor: Executor | None = None) -> None:
        self.ck, self.plan, self.opts, self.calib, self.qw = ck, plan, opts, calib, qw
        self.progress, self.executor = progress, executor
        self.sk = Skeleton(ck)
        lengths = [len(s) for s in calib.samples]
        self.lengths = lengths
        self.starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        ids = torch.tensor([t for s in calib.samples for t in s], dtype=torch.long)
        if int(ids.max()) >= ck.facts.vocab_size or int(ids.min()) < 0:
            raise UserError(f"calibration token id {int(ids.max())} is outside the model's vocabulary "
                            f"({ck.facts.vocab_size})", hint="the tokenizer does not belong to this model")
        self.h = self.sk.embed(ids)
        held = selection.held_out_prompts(len(lengths)) if plan.method in ("gptq", "awq") else None
        self.held_tokens = None if held is None else torch.repeat_interleave(held, torch.tensor(lengths))
        self.decisions: dict[str, Any] = {}  # searches and choices, for quant_report.json (clipping, W4 choice)
        self.preset: dict[str, tuple] = {}   # --method awq: weights chosen per linear before the statistics pass
        order = sorted(range(len(lengths)), key=lambda j: (-lengths[j], j))
        self.batches: list[list[int]] = []
        while order:
            per = max(1, opts.batch_tokens // lengths[order[0]])
            self.batches.append(order[:per])
            order = order[per:]
        self.rows = RowMask()
        self.records: dict[str, LinearRecord] = {}
        self.expert_counts: dict[int, list[int]] = {}
        self.smoothing: list[dict[str, Any]] = []
        self.by_layer = plan.by_layer()
        self.static = plan.scheme == STATIC
        self.observer_method = clipping.observer_method(opts.act_method)
        # seconds: the driver's forward passes with statistics hooks; summed over jobs, the routed experts' forward
        # and quantizing + measuring linears; after run(), the driver's wall time in linear and expert jobs
        self.timings = {"forward": 0.0, "experts": 0.0, "quantize": 0.0}

    # ---- batches --------------------------------------------------------------------------------------------
    def _batch(self, samples: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return forward_jobs.padded_batch(self.h, samples, self.lengths, self.starts)

    def _forward(self, layer: nn.Module, samples: list[int], write: bool,
                 recorder: ExpertRecorder | None = None) -> None:
        t = time.perf_counter()
        x, idx, mask = self._batch(samples)
        self.rows.set(mask)
        self.rows.held = None if self.held_tokens is None else self.held_tokens[idx[mask]]
        if recorder is not None:
            recorder.flat_index = idx.reshape(-1)
        y = layer(x, **self.sk.layer_inputs(x, layer))
        y = y[0] if isinstance(y, tuple) else y
        if write:
            self.h[idx[mask]] = y[mask]
        self.timings["forward"] += time.perf_counter() - t

    # ---- the run --------------------------------------------------------------------------------------------
    def run(self) -> None:
        from tqdm import tqdm

        self.jobs = calib_jobs.Dispatch(self, self.executor, self.qw.out.path)  # linears and experts as jobs
        self.fwd = forward_jobs.Forward(self, self.jobs)  # the layer forward over batches as jobs, where it splits
        try:
            with torch.no_grad():
                for i in tqdm(range(self.sk.num_layers), desc="quantize", unit="layer", disable=None if self.progress
                              else True, leave=False):
                    self.layer(i)
        finally:
            self.jobs.close()
        self.timings.update(self.jobs.wall, jobs_wall=sum(self.jobs.wall.values()), forward_wall=self.fwd.wall,
                            forward_cpu=self.fwd.cpu, forward_cpu_critical=self.fwd.cpu_critical)

    def _stats(self, k: int, name: str) -> InputStats:
        return InputStats(k, name, self.observer_method if self.static else None,
                          hessian=self.plan.method == "gptq", sample_tokens=self.opts.sample_tokens,
                          stride=int(self.h.shape[0]) // max(1, self.opts.sample_tokens),
                          held_out=self.held_tokens is not None)

    def layer(self, i: int) -> None:
        sk, plan, qw = self.sk, self.plan, self.qw
        layer = sk.materialise(i)
        self.fwd.begin(i, layer)
        lps = {lp.module: lp for lp in self.by_layer.get(i, [])}
        floats = [fp for fp in plan.floats.values() if fp.layer == i]
        qw.open_layer(i, list(lps.values()), floats)
        experts = sk.experts_module(i)
        targets: dict[nn.Module, LinearPlan] = {}
        for mod in layer.modules():
            if isinstance(mod, nn.Linear):
                lp = lps.get(sk.ck_name(sk.module_names[mod]))
                if lp is not None:
                    targets[mod] = lp
        modified: dict[str, torch.Tensor] = {}
        col_scale = None
        if smoothing_of(self.opts, plan) is not None:
            modified, col_scale = self.smooth(i, layer, targets, experts, lps)
        written = False  # --method awq: scales folded, weights chosen, outputs propagated by its probe (awq.py)
        if plan.method == "awq":
            folded, self.preset, written = awq.run_layer(self, i, layer, targets, lps, experts)
            modified.update(folded)

        hooks = LinearHooks(targets, lambda lp: self._stats(lp.k, lp.module), self.rows)
        recorder = ExpertRecorder(self.rows) if experts is not None else None
        if experts is not None:
            install_forward(experts, recorder)
        propagate = self.plan.method == "gptq" and experts is None and bool(targets)
        if not written:
            self.fwd.stats_pass(i, layer, hooks, recorder, write=not propagate)
        hooks.remove()
        if self.static and self.opts.act_method == clipping.METHOD:
            clipping.choose_clips(hooks.group, targets, self.decisions.setdefault("clipping", {}))
        order = sorted(targets.items(), key=lambda kv: list(lps).index(kv[1].module))
        for mod, res in self.jobs.linears(i, order, hooks.group):
            if propagate:
                mod.weight.copy_(torch.from_numpy(dequant_weight(res.q, res.scale)))  # versioned: jobs see it
        if propagate:  # the next layer calibrates on what this quantized layer outputs
            self.fwd.plain_pass(i, layer)
        if experts is not None:
            self.run_experts(i, experts, recorder, lps, col_scale)
        for fp in floats:
            t = modified.get(fp.name)
            qw.float(fp.name, t if t is not None else self.ck.load(fp.name, dequantize=True))
        qw.close_layer(i)
        sk.release(i)

    # ---- quantizing -----------------------------------------------------------------------------------------
    def _bias(self, lp: LinearPlan) -> torch.Tensor | None:
        return self.ck.load(lp.bias) if lp.bias else None

    def _quantize(self, lp: LinearPlan, w: torch.Tensor, st: InputStats | None,
                  qparams: tuple[float, float] | None = None, range_source: str | None = None) -> "Pending":
        """Quantize one linear with its input statistics and write it."""
        t = time.perf_counter()
        pending = self._prepare(lp, w, st)
        if lp.qtype == STATIC and qparams is None:
            rng = st.clip_range() if st is not None else None
            if rng is None:
                raise UserError(f"layer {lp.module}: calibration never reached it (0 tokens)",
                                hint="use more calibration text, or --all-experts for MoE models")
            qparams = activation_qparams(*rng)
        self._finish(pending, qparams, range_source)
        self.timings["quantize"] += time.perf_counter() - t
        return pending

    def _prepare(self, lp: LinearPlan, w: torch.Tensor, st: InputStats | None) -> "Pending":
        """The weight part: int8 values and scales (GPTQ with the input's Hessian), and what measuring the output
        error later needs (a few calibration rows and their float outputs) - never the float weight itself."""
        preset = self.preset.pop(lp.module, None)
        bias = preset[3] if preset is not None and preset[3] is not None else self._bias(lp)
        hess = st.hessian.hessian() if st is not None and st.hessian is not None and st.hessian.tokens else None
        q, scale = preset[0] if preset is not None and preset[0] is not None else \
            quantize_weight(lp, w, self.plan, hess, self.opts.damp, method="rtn" if preset else None)
        choice = None
        x_held = st.held.x if st is not None and st.held is not None else None
        if hess is not None and x_held is not None:  # GPTQ kept only where it beats rounding on held-out prompts
            cands = {"gptq": (q, scale), "rtn": quantize_weight(lp, w, self.plan, None, 0.0, method="rtn")}
            (q, scale), picked, choice = selection.choose(x_held, w, cands)
            self.decisions.setdefault("gptq_or_rtn", {})[lp.module] = picked
        rec = LinearRecord(lp.module, lp.qtype, relative_error(w, dequant_weight(q, scale)),
                           tokens=st.tokens if st is not None else 0)
        if choice is not None:
            rec.errors.update(choice)
            rec.note = f"{picked} (smaller error on held-out prompts)"
        if preset is not None:
            rec.errors.update(preset[2])
            rec.note = f"awq: {preset[1]} (held-out prompts)"
        x = st.sample if st is not None else None
        y_ref = None
        if x is not None and x.shape[0]:
            y_ref = x @ w.float().T
            if bias is not None:
                y_ref = y_ref + bias.float()
        else:
            x = None
        return Pending(lp, q, scale, bias, rec, x, y_ref)

    def _finish(self, p: "Pending", qparams: tuple[float, float] | None, range_source: str | None = None) -> None:
        lp, rec = p.lp, p.rec
        rec.range_source = range_source
        res = LinearResult(q=p.q, scale=p.scale, bias=p.bias)
        if lp.qtype == STATIC:
            try:
                aux = static_aux(lp, p.q, p.scale, qparams, p.bias)
            except UserError:
                if not self.qw.staged:
                    raise
                aux = None
                rec.note = "quant_bias overflows int32: static W8A8 impossible"
                rec.errors["static"] = float("inf")
            res.input_scale, res.input_offset = np.float32(qparams[0]), np.float32(qparams[1])
            if aux is not None:
                res.deq_scale, res.quant_bias = aux["deq_scale"], aux["quant_bias"]
            else:  # placeholders: the unit is forced to fall back, so these are never written
                res.deq_scale = np.ones(lp.n, np.float32)
                res.quant_bias = np.zeros(lp.n, np.int32)
        if p.x is not None:
            b = None if p.bias is None else p.bias.float()
            errs = output_errors(p.x, p.y_ref, p.q, p.scale, b, (res.input_scale, res.input_offset)
                                 if lp.qtype == STATIC else None)
            rec.errors.update({k: v for k, v in errs.items() if k not in rec.errors})
        self.records[lp.module] = rec
        self.qw.linear(lp, res)

    # ---- experts --------------------------------------------------------------------------------------------
    def run_experts(self, i: int, experts: nn.Module, recorder: ExpertRecorder, lps: dict[str, LinearPlan],
                    col_scale: torch.Tensor | None) -> None:
        sk = self.sk
        hidden, index, weights, pos = recorder.take()
        E = int(experts.gate_up_proj.shape[0])
        counts = torch.bincount(index.reshape(-1), minlength=E)[:E]
        self.expert_counts[i] = [int(c) for c in counts]

        names = [sk.expert_weight_names(i, e) for e in range(E)]
        plans = [{s: lps.get(n) for s, n in sk.expert_module_names(i, e).items()} for e in range(E)]
        out, deferred, down_ranges = self.jobs.experts(i, hidden, index, weights, names, plans, col_scale)
        self.h.index_add_(0, pos, out)
        if not deferred:
            return
        union_in = None
        if self.static:  # gate/up of every expert read the same tensor: its range over all MoE tokens
            st = InputStats(hidden.shape[-1], f"layer {i} MoE input", self.observer_method, False, 0)
            st.update(hidden)
            union_in = st.clip_range()
        union_down = (min(r[0] for r in down_ranges), max(r[1] for r in down_ranges)) if down_ranges else None
        for e, held in deferred:  # under-covered (and never-routed) experts, in expert order
            for slot, (p, own) in held.items():
                qparams, source = None, None
                if self.static:
                    rng = _union(own, union_in if slot != "down" else union_down)
                    if rng is None:
                        raise UserError(f"layer {i}: no calibration token reached any expert's {slot} projection",
                                        hint="use more calibration text or --all-experts")
                    qparams, source = activation_qparams(*rng), "borrowed"
                self._finish(p, qparams, source)
                self.records[p.lp.module].tokens = int(counts[e])

    # ---- smoothing ------------------------------------------------------------------------------------------
    def smooth(self, i: int, layer: nn.Module, targets: dict[nn.Module, LinearPlan], experts: nn.Module | None,
               lps: dict[str, LinearPlan]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """SmoothQuant folded into the norms that feed quantized linears: s = act^a / w^(1-a) per input channel;
        norm weight / s (rounded to its dtype, then s re-derived from the rounded value so norm x weight is exact),
        consumer weights x s (and router weights, kept in float, x s). A norm with a consumer that stays in float or
        is weight-only is left alone (reported)."""
        sk, ck = self.sk, self.ck
        own = sk.own_weights(layer)  # module -> (ck param name, role) of its direct weight
        norms = [m for m, (_, r) in own.items() if r == Role.NORM]
        consumers = [m for m in layer.modules() if isinstance(m, nn.Linear) or
                     (m in own and own[m][1] == Role.ROUTER)]
        if experts is not None:
            consumers.append(experts)
            install_forward(experts, lambda h, idx, wts: torch.zeros_like(h))
        probe = FlowProbe(norms, consumers, self.rows)
        auto = self.opts.smooth_alpha == "auto"
        by_name = {lp.module: mod for mod, lp in targets.items()}
        pairs = [(by_name[u], by_name[d]) for u, d in sm.up_down_pairs(lps) if u in by_name and d in by_name
                 and lps[u].bias is None] if auto else []
        sites = sm.SiteProbe(norms if auto else [], [d for _, d in pairs], int(self.h.shape[0]), self.rows.apply)
        self.fwd.smooth_pass(i, layer, probe, sites, norms, consumers)
        probe.remove()
        sites.remove()
        modified: dict[str, torch.Tensor] = {}
        col_scale = None
        E = int(experts.gate_up_proj.shape[0]) if experts is not None else 0
        for norm, cons in probe.consumers.items():
            if not cons:
                continue
            norm_name = own[norm][0]
            entry: dict[str, Any] = {"norm": norm_name, "consumers": [], "applied": False}
            reason = None
            linears, routers, with_experts = [], [], False
            for c in cons:
                if c is experts:
                    entry["consumers"].append(f"{sk.module_names[c]} ({E} experts)")
                    for e in range(E):
                        for slot in ("gate", "up"):
                            lp = lps.get(sk.expert_module_names(i, e)[slot])
                            if lp is None or lp.qtype not in ACT_QUANT:
                                reason = reason or f"expert {e} {slot} is not activation-quantized"
                    with_experts = True
                    continue
                cname = sk.ck_name(sk.module_names[c])
                entry["consumers"].append(cname)
                if c in targets:
                    if targets[c].qtype not in ACT_QUANT:
                        reason = reason or f"{cname} is weight-only ({targets[c].qtype})"
                    linears.append(c)
                elif c in own and own[c][1] == Role.ROUTER:
                    routers.append(c)
                else:
                    reason = reason or f"{cname} stays in float"
            if auto and (with_experts or not linears):  # the search judges the linears it can run, not experts
                reason = "auto: routed experts read it (not searched; give --smooth-quant ALPHA to smooth it)"
            if reason:
                entry["reason"] = reason
                self.smoothing.append(entry)
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
                static = any(targets[c].qtype == STATIC for c in linears)
                s, entry["search"] = sm.search_scales(sites.sites[norm], [c.weight for c in linears], static)
                if s is None:
                    entry["reason"] = "search: no smoothing has the smallest output error"
                    self.smoothing.append(entry)
                    continue
            else:
                s = torch.from_numpy(smooth_scales(probe.absmax[norm].numpy(), w_absmax.numpy(),
                                                   self.opts.smooth_alpha))
            dt = torch_dtype(ck.info(norm_name).dtype)
            n_new, s_eff = sm.norm_fold(norm.weight.detach().clone(), ck.family.norm_offset, dt, s)
            norm.weight.copy_(n_new)
            modified[norm_name] = n_new.to(dt)
            for c in linears:
                c.weight.mul_(s_eff)
            for c in routers:
                rname = own[c][0]
                rdt = torch_dtype(ck.info(rname).dtype)
                new = (c.weight.detach() * s_eff).to(rdt)
                c.weight.copy_(new.float())
                modified[rname] = new
            if with_experts:
                col_scale = s_eff
            entry.update(applied=True, max_scale=round(float(s_eff.max()), 4), min_scale=round(float(s_eff.min()), 4))
            self.smoothing.append(entry)
        self.smoothing += sm.smooth_up_down(pairs, sites, lambda m: targets[m].qtype == STATIC,
                                            lambda m: sk.ck_name(sk.module_names[m]))
        return modified, col_scale


def _union(a: tuple[float, float] | None, b: tuple[float, float] | None) -> tuple[float, float] | None:
    if a is None:
        return b
    if b is None:
        return a
    return (min(a[0], b[0]), max(a[1], b[1]))
