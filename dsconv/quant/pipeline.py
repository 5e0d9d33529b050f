"""`dsconv quantize`: plan from headers, then quantize layer by layer (or tensor by tensor when no calibration is
needed), writing the msModelSlim layout through the one writer.

Two paths, one plan:
* weight-only round-to-nearest (w8a16, w4a16 rtn): nothing depends on activations, so tensors stream from the
  checkpoint straight into the output (one tensor in memory, the next one read ahead in a thread);
* everything else (static W8A8, GPTQ, smoothing, or an explicit --calib): the calibration tokens are embedded once,
  then each decoder layer is materialised from the checkpoint, all calibration activations are pushed through it
  with statistics streamed by hooks, its linears are quantized and written, and it is freed. Routed experts run one
  at a time after the rest of the layer (an `ExpertLoop`), each quantized as soon as its inputs are seen, so peak
  memory is one layer without its experts, one expert, and the activations ([tokens, hidden] float32, twice).

Activations propagate in float (each layer sees the float model's inputs), so statistics do not depend on the
order layers are quantized in, and the layer-by-layer results equal a whole-model forward with hooks.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from dsconv.checkpoint import Checkpoint, torch_dtype
from dsconv.errors import UserError
from dsconv.families.roles import Role
from dsconv.quant import report as rep
from dsconv.quant.calib import CalibSet, load_calib, load_tokenizer, min_tokens_warning
from dsconv.quant.formats.msmodelslim import LinearResult
from dsconv.quant.gptq import gptq_quantize
from dsconv.quant.layers import SLOTS, ExpertLoop, Skeleton, install_forward
from dsconv.quant.observers import ACT_METHODS, DEFAULT_ACT_METHOD
from dsconv.quant.output import QuantWriter
from dsconv.quant.plan import BITS, FALLBACK_TARGETS, SCHEMES, STATIC, LinearPlan, QuantPlan, make_plan
from dsconv.quant.schemes import (activation_qparams, dequant_weight, quantize_weight_per_channel,
                                  quantize_weight_per_group, relative_error, smooth_scales, w8a8_static_params)
from dsconv.quant.stats import InputStats, LinearRecord, output_errors
from dsconv.writer import DEFAULT_MAX_SHARD_SIZE, OutputDir

ACT_QUANT = ("W8A8", "W8A8_DYNAMIC")  # types whose activations are quantized: smoothing helps them
ERROR_SAMPLE_ROWS = 256  # weight-only path: rows used to estimate a big tensor's relative error


@dataclass
class QuantOptions:
    scheme: str = "w8a8"
    group_size: int | None = None
    method: str = "rtn"
    act_method: str = DEFAULT_ACT_METHOD
    smooth_alpha: float | None = None
    fallback: int | None = None
    fallback_threshold: float | None = None
    fallback_to: str = "w8a8_dynamic"
    ignore: tuple[str, ...] = ()
    calib: Path | None = None
    calib_samples: int | None = None
    seq_len: int = 512
    min_expert_tokens: int = 32
    all_experts: bool = False
    layout: str = "msmodelslim"
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    damp: float = 0.01
    batch_tokens: int = 4096   # padded tokens per forward batch
    sample_tokens: int = 128   # calibration rows kept per linear input to measure output error (fallbacks, report)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["calib"] = str(self.calib) if self.calib else None
        d["ignore"] = list(self.ignore)
        return d


def fallback_policy(opts: QuantOptions, plan: QuantPlan) -> tuple[str, float] | None:
    """('count', N) | ('threshold', X) for static W8A8; None when no type depends on measurements."""
    if opts.fallback is not None and opts.fallback < 0:
        raise UserError(f"--fallback {opts.fallback} must be >= 0")
    if opts.fallback_threshold is not None and opts.fallback_threshold < 0:
        raise UserError(f"--fallback-threshold {opts.fallback_threshold} must be >= 0")
    if plan.scheme != STATIC:
        if opts.fallback or opts.fallback_threshold is not None:
            raise UserError(f"--fallback/--fallback-threshold apply to static w8a8, not {plan.scheme.lower()}",
                            hint="drop them, or use --scheme w8a8")
        return None
    if opts.fallback is not None and opts.fallback_threshold is not None:
        raise UserError("--fallback N and --fallback-threshold X are alternatives", hint="give one of them")
    if opts.fallback is not None:
        return None if opts.fallback == 0 else ("count", float(opts.fallback))
    return ("threshold", rep.DEFAULT_FALLBACK_THRESHOLD if opts.fallback_threshold is None
            else opts.fallback_threshold)


def check_options(opts: QuantOptions, plan: QuantPlan) -> None:
    if opts.act_method not in ACT_METHODS:
        raise UserError(f"unknown --act-method {opts.act_method}", hint=f"choose one of {', '.join(ACT_METHODS)}")
    if opts.fallback_to not in FALLBACK_TARGETS:
        raise UserError(f"--fallback-to {opts.fallback_to} is not a fallback type",
                        hint=f"choose {' or '.join(FALLBACK_TARGETS)}")
    if opts.smooth_alpha is not None and plan.scheme not in ACT_QUANT:
        raise UserError(f"--smooth-quant applies to schemes with quantized activations, not {plan.scheme.lower()}",
                        hint="use it with --scheme w8a8 or w8a8_dynamic")
    if opts.method not in ("rtn", "gptq"):
        raise UserError(f"unknown --method {opts.method}", hint="use rtn or gptq")
    if opts.min_expert_tokens < 0:
        raise UserError("--min-expert-tokens must be >= 0")


def needs_calibration(opts: QuantOptions, plan: QuantPlan) -> bool:
    """Weight-only round-to-nearest needs no activations; an explicit --calib still runs (for expert load)."""
    return (plan.scheme == STATIC or opts.method == "gptq" or opts.smooth_alpha is not None
            or opts.calib is not None)


# --------------------------------------------------------------------------------------------- quantizing one
def quantize_weight(lp: LinearPlan, w: torch.Tensor, plan: QuantPlan, hessian: np.ndarray | None,
                    damp: float) -> tuple[np.ndarray, np.ndarray]:
    """int8 values [n, k] and float32 scales of one weight: GPTQ with a Hessian, round-to-nearest without."""
    bits = BITS[lp.qtype]
    g = plan.group_size if bits == 4 else 0
    if plan.method == "gptq" and hessian is not None:
        q, scale, _ = gptq_quantize(w, hessian, bits=bits, group_size=g, damp=damp, name=lp.module)
        return q, scale
    if bits == 8:
        return quantize_weight_per_channel(w if w.dtype != torch.float32 else w.numpy(), 8, lp.module)
    q, scale, _ = quantize_weight_per_group(w if w.dtype != torch.float32 else w.numpy(), g, 4, lp.module)
    return q, scale


def static_aux(lp: LinearPlan, q: np.ndarray, scale: np.ndarray, qparams: tuple[float, float],
               bias: torch.Tensor | None) -> dict[str, np.ndarray]:
    b = None if bias is None else bias.float().numpy()
    return w8a8_static_params(q, scale, qparams[0], qparams[1], b, name=lp.module)


# --------------------------------------------------------------------------------------------- hooks
def storage_key(x: torch.Tensor) -> tuple[int, int, int]:
    """Identity of a tensor's data (views of one tensor share it): how consumers of one input are recognised."""
    return (x.untyped_storage().data_ptr(), x.storage_offset(), x.numel())


class RowMask:
    """The real (non-padding) rows of the current batch, flattened [B * L]; None when there is no padding."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.count = 0

    def set(self, mask: torch.Tensor) -> None:
        flat = mask.reshape(-1)
        self.count = flat.numel()
        self.rows = None if bool(flat.all()) else flat

    def apply(self, x: torch.Tensor, what: str) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] != self.count:
            raise RuntimeError(f"{what}: {x2.shape[0]} input rows do not match the batch's {self.count} tokens")
        return x2 if self.rows is None else x2[self.rows]


class LinearHooks:
    """Forward pre-hooks on the layer's quantized nn.Linear modules: statistics of each distinct input, shared by
    every linear that reads it."""

    def __init__(self, targets: dict[nn.Module, LinearPlan], make_stats: Callable[[LinearPlan], InputStats],
                 rows: RowMask) -> None:
        self.targets = targets
        self.make_stats = make_stats
        self.rows = rows
        self.group: dict[nn.Module, InputStats] = {}
        self._batch: dict[tuple, tuple[torch.Tensor, InputStats]] = {}
        self.handles = [m.register_forward_pre_hook(self._pre) for m in targets]

    def _pre(self, mod: nn.Module, args: tuple) -> None:
        x = args[0]
        key = storage_key(x) + (x.shape[-1],)
        hit = self._batch.get(key)
        if hit is not None:  # same input as an earlier linear of this batch: already counted
            self.group.setdefault(mod, hit[1])
            return
        st = self.group.get(mod)
        if st is None:
            st = self.group[mod] = self.make_stats(self.targets[mod])
        st.update(self.rows.apply(x.detach(), self.targets[mod].module).float())
        self._batch[key] = (x, st)  # holding x keeps its storage from being reused within the batch

    def end_batch(self) -> None:
        self._batch = {}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self._batch = {}


class ExpertRecorder:
    """Stands in for the experts during the layer's forward: keeps the routed tokens (real ones only) and their
    routing, returns zeros; the experts run afterwards on all calibration tokens at once (then their outputs are
    added to the residual stream - the MoE output enters it linearly in every supported family)."""

    def __init__(self, rows: RowMask) -> None:
        self.rows = rows
        self.flat_index: torch.Tensor | None = None
        self.parts: list[tuple[torch.Tensor, ...]] = []

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        keep = self.rows.rows
        pos = self.flat_index if keep is None else self.flat_index[keep]
        sel = (lambda t: t) if keep is None else (lambda t: t[keep])
        self.parts.append((sel(hidden).detach().clone(), sel(top_k_index).clone(), sel(top_k_weights).detach()
                           .clone(), pos.clone()))
        return torch.zeros_like(hidden)

    def take(self) -> tuple[torch.Tensor, ...]:
        out = tuple(torch.cat(p) for p in zip(*self.parts))
        self.parts = []
        return out


class FlowProbe:
    """Which modules consume each norm's output (by data identity, not by name), and each norm's per-channel
    max |output| over real tokens: what SmoothQuant needs before the statistics pass."""

    def __init__(self, norms: list[nn.Module], consumers: list[nn.Module], rows: RowMask) -> None:
        self.rows = rows
        self.record = True
        self.absmax: dict[nn.Module, torch.Tensor] = {}
        self.consumers: dict[nn.Module, list[nn.Module]] = {n: [] for n in norms}
        self._out: dict[tuple, tuple[torch.Tensor, nn.Module]] = {}
        self.handles = [n.register_forward_hook(self._norm) for n in norms]
        self.handles += [c.register_forward_pre_hook(self._consumer) for c in consumers]

    def _norm(self, mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
        a = self.rows.apply(out.detach(), "norm").abs().amax(dim=0).float()
        prev = self.absmax.get(mod)
        self.absmax[mod] = a if prev is None else torch.maximum(prev, a)
        if self.record:
            self._out[storage_key(out)] = (out, mod)

    def _consumer(self, mod: nn.Module, args: tuple) -> None:
        if not self.record or not args:
            return
        hit = self._out.get(storage_key(args[0]))
        if hit is not None and mod not in self.consumers[hit[1]]:
            self.consumers[hit[1]].append(mod)

    def end_batch(self) -> None:
        self.record = False
        self._out = {}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# --------------------------------------------------------------------------------------------- calibrated path
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
                 progress: bool = True) -> None:
        self.ck, self.plan, self.opts, self.calib, self.qw = ck, plan, opts, calib, qw
        self.progress = progress
        self.sk = Skeleton(ck)
        lengths = [len(s) for s in calib.samples]
        self.lengths = lengths
        self.starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        ids = torch.tensor([t for s in calib.samples for t in s], dtype=torch.long)
        if int(ids.max()) >= ck.facts.vocab_size or int(ids.min()) < 0:
            raise UserError(f"calibration token id {int(ids.max())} is outside the model's vocabulary "
                            f"({ck.facts.vocab_size})", hint="the tokenizer does not belong to this model")
        self.h = self.sk.embed(ids)
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
        # seconds: forward passes with statistics hooks, expert loops, quantizing + measuring + writing linears
        self.timings = {"forward": 0.0, "experts": 0.0, "quantize": 0.0}

    # ---- batches --------------------------------------------------------------------------------------------
    def _batch(self, samples: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        L = max(self.lengths[j] for j in samples)
        idx = torch.full((len(samples), L), -1, dtype=torch.long)
        for r, j in enumerate(samples):
            idx[r, : self.lengths[j]] = torch.arange(int(self.starts[j]), int(self.starts[j]) + self.lengths[j])
        mask = idx >= 0
        x = self.h[idx.clamp(min=0)]
        x[~mask] = 0.0
        return x, idx, mask

    def _forward(self, layer: nn.Module, samples: list[int], write: bool,
                 recorder: ExpertRecorder | None = None) -> None:
        t = time.perf_counter()
        x, idx, mask = self._batch(samples)
        self.rows.set(mask)
        if recorder is not None:
            recorder.flat_index = idx.reshape(-1)
        y = layer(x, **self.sk.layer_inputs(x))
        y = y[0] if isinstance(y, tuple) else y
        if write:
            self.h[idx[mask]] = y[mask]
        self.timings["forward"] += time.perf_counter() - t

    # ---- the run --------------------------------------------------------------------------------------------
    def run(self) -> None:
        from tqdm import tqdm

        with torch.no_grad():
            for i in tqdm(range(self.sk.num_layers), desc="quantize", unit="layer", disable=None if self.progress
                          else True, leave=False):
                self.layer(i)

    def _stats(self, k: int, name: str) -> InputStats:
        return InputStats(k, name, self.opts.act_method if self.static else None,
                          hessian=self.plan.method == "gptq", sample_tokens=self.opts.sample_tokens)

    def layer(self, i: int) -> None:
        sk, plan, qw = self.sk, self.plan, self.qw
        layer = sk.materialise(i)
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
        if self.opts.smooth_alpha is not None:
            modified, col_scale = self.smooth(i, layer, targets, experts, lps)

        hooks = LinearHooks(targets, lambda lp: self._stats(lp.k, lp.module), self.rows)
        recorder = ExpertRecorder(self.rows) if experts is not None else None
        if experts is not None:
            install_forward(experts, recorder)
        for samples in self.batches:
            self._forward(layer, samples, write=True, recorder=recorder)
            hooks.end_batch()
        hooks.remove()
        for mod, lp in sorted(targets.items(), key=lambda kv: list(lps).index(kv[1].module)):
            st = hooks.group.get(mod)
            self._quantize(lp, mod.weight.detach(), st)
        for st in set(hooks.group.values()):
            st.free()
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
                  qparams: tuple[float, float] | None = None, range_source: str | None = None) -> None:
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

    def _prepare(self, lp: LinearPlan, w: torch.Tensor, st: InputStats | None) -> "Pending":
        """The weight part: int8 values and scales (GPTQ with the input's Hessian), and what measuring the output
        error later needs (a few calibration rows and their float outputs) - never the float weight itself."""
        bias = self._bias(lp)
        hess = st.hessian.hessian() if st is not None and st.hessian is not None and st.hessian.tokens else None
        q, scale = quantize_weight(lp, w, self.plan, hess, self.opts.damp)
        rec = LinearRecord(lp.module, lp.qtype, relative_error(w, dequant_weight(q, scale)),
                           tokens=st.tokens if st is not None else 0)
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
        sk, opts = self.sk, self.opts
        hidden, index, weights, pos = recorder.take()
        E = int(experts.gate_up_proj.shape[0])
        counts = torch.bincount(index.reshape(-1), minlength=E)[:E]
        self.expert_counts[i] = [int(c) for c in counts]

        def load(e: int) -> dict[str, torch.Tensor]:
            names = sk.expert_weight_names(i, e)
            w = {s: sk.load(names[s]) for s in SLOTS}
            if col_scale is not None:
                w["gate"].mul_(col_scale)
                w["up"].mul_(col_scale)
            return w

        plans = [{s: lps.get(n) for s, n in sk.expert_module_names(i, e).items()} for e in range(E)]
        deferred: list[tuple[int, dict[str, tuple[Pending, tuple[float, float] | None]]]] = []
        never: list[int] = []
        down_ranges: list[tuple[float, float]] = []

        def observe(e: int, x, act, rows, w) -> None:
            routed = int(counts[e])
            if x is None:
                never.append(e)
                return
            st = {"in": self._stats(x.shape[-1], f"layer {i} expert {e} gate/up"),
                  "down": self._stats(act.shape[-1], f"layer {i} expert {e} down")}
            st["in"].update(x)
            st["down"].update(act)
            under = self.static and routed < opts.min_expert_tokens and not opts.all_experts
            if self.static and st["down"].clip_range() is not None:
                down_ranges.append(st["down"].clip_range())
            held = {}
            for slot in SLOTS:
                lp = plans[e][slot]
                if lp is None:
                    continue
                s = st["in"] if slot != "down" else st["down"]
                if under:  # weights now (then freed), activation parameters once the layer's ranges are known
                    held[slot] = (self._prepare(lp, w[slot], s), s.clip_range())
                else:
                    self._quantize(lp, w[slot], s)
                    self.records[lp.module].tokens = routed
            if under:
                deferred.append((e, held))
            for s in st.values():
                s.free()

        loop = ExpertLoop(experts, E, load, observe=observe, all_tokens=opts.all_experts)
        t0, q0 = time.perf_counter(), self.timings["quantize"]
        out = loop(hidden, index, weights)
        self.timings["experts"] += time.perf_counter() - t0 - (self.timings["quantize"] - q0)
        self.h.index_add_(0, pos, out)
        if not (deferred or never):
            return
        union_in = None
        if self.static:  # gate/up of every expert read the same tensor: its range over all MoE tokens
            st = InputStats(hidden.shape[-1], f"layer {i} MoE input", self.opts.act_method, False, 0)
            st.update(hidden)
            union_in = st.clip_range()
        union_down = (min(r[0] for r in down_ranges), max(r[1] for r in down_ranges)) if down_ranges else None
        for e in never:  # no token at all: weights only (RTN), and for static W8A8 the layer's ranges
            w = load(e)
            for slot in SLOTS:
                lp = plans[e][slot]
                if lp is not None:
                    deferred.append((e, {slot: (self._prepare(lp, w[slot], None), None)}))
            del w
        for e, held in sorted(deferred, key=lambda d: d[0]):
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
        own = {}  # module -> (ck param name, role) of its direct weight
        for mod in layer.modules():
            if "weight" in dict(mod.named_parameters(recurse=False)):
                name = sk.ck_name(sk.module_names[mod] + ".weight")
                if name in ck:
                    own[mod] = (name, ck.role(name).role)
        norms = [m for m, (_, r) in own.items() if r == Role.NORM]
        consumers = [m for m in layer.modules() if isinstance(m, nn.Linear) or
                     (m in own and own[m][1] == Role.ROUTER)]
        if experts is not None:
            consumers.append(experts)
            install_forward(experts, lambda h, idx, wts: torch.zeros_like(h))
        probe = FlowProbe(norms, consumers, self.rows)
        for samples in self.batches:
            self._forward(layer, samples, write=False)
            probe.end_batch()
        probe.remove()
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
            s = torch.from_numpy(smooth_scales(probe.absmax[norm].numpy(), w_absmax.numpy(), self.opts.smooth_alpha))
            n = norm.weight.detach().clone()
            dt = torch_dtype(ck.info(norm_name).dtype)
            n_new = (n / s).to(dt).float()
            ok = (n_new != 0) & torch.isfinite(n_new)
            n_new = torch.where(ok, n_new, n)
            s_eff = torch.where(ok, n / torch.where(ok, n_new, torch.ones_like(n_new)), torch.ones_like(n))
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
        return modified, col_scale


def _union(a: tuple[float, float] | None, b: tuple[float, float] | None) -> tuple[float, float] | None:
    if a is None:
        return b
    if b is None:
        return a
    return (min(a[0], b[0]), max(a[1], b[1]))


# --------------------------------------------------------------------------------------------- weight-only path
def weight_only(ck: Checkpoint, plan: QuantPlan, qw: QuantWriter, progress: bool = True) -> dict[str, LinearRecord]:
    """Round-to-nearest without activations: tensors stream in output order, quantized straight from the page cache
    (`Checkpoint.view`) while the previous tensor is written (pwrite + sha256, both outside the GIL) and the next one is
    read ahead by the kernel. At most two tensors' outputs are alive at once."""
    from tqdm import tqdm

    weights = {lp.weight: lp for lp in plan.linears.values()}
    order = [n for n in ck.names() if n in weights or n in plan.floats]
    records: dict[str, LinearRecord] = {}
    total = sum(ck.info(n).nbytes for n in order)
    with ThreadPoolExecutor(1) as writer, tqdm(total=total, unit="B", unit_scale=True, desc="quantize",
                                                disable=None if progress else True, leave=False) as bar:
        pending = None
        done: list[str] = []
        for j, name in enumerate(order):
            if j + 1 < len(order):
                ck.prefetch(order[j + 1])
            t = ck.view(name)
            lp = weights.get(name)
            if lp is None:
                job = (qw.float, name, t)
            else:
                q, scale = quantize_weight(lp, t, plan, None, 0.0)
                records[lp.module] = LinearRecord(lp.module, lp.qtype, _sampled_error(t, q, scale))
                job = (qw.linear, lp, LinearResult(q=q, scale=scale, bias=ck.load(lp.bias) if lp.bias else None))
            if pending is not None:
                pending.result()  # one write in flight: bounded memory, output in order
                for n in done:
                    ck.release(n)
                done = []
            pending = writer.submit(*job)
            done.append(name)
            bar.update(ck.info(name).nbytes)
            del t, job
        if pending is not None:
            pending.result()
        for n in done:
            ck.release(n)
    return records


def _sampled_error(w: torch.Tensor, q: np.ndarray, scale: np.ndarray) -> float:
    """Relative Frobenius error, from evenly spaced rows for big tensors (the estimate is within a few percent of
    the exact figure; the exact one would cost a second bf16 widening of the whole tensor)."""
    n = w.shape[0]
    step = max(1, n // ERROR_SAMPLE_ROWS)
    rows = slice(0, n, step)
    return relative_error(w[rows], dequant_weight(q[rows], scale[rows]))


# --------------------------------------------------------------------------------------------- entry point
def quantize_model(model_dir: Path, output: Path, opts: QuantOptions, force: bool = False, progress: bool = True,
                   warn: Callable[[str], None] = lambda m: None, dry_run: bool = False) -> dict[str, Any]:
    """Run `dsconv quantize`; returns the summary (also the --json output)."""
    t0 = time.perf_counter()
    if opts.scheme not in SCHEMES:
        raise UserError(f"unknown scheme {opts.scheme}", hint=f"choose one of {', '.join(SCHEMES)}")
    ck = Checkpoint.open(model_dir)
    if ck.is_quantized:
        raise UserError(f"{model_dir} is already quantized (it has a quant_model_description)",
                        hint="quantize the original float checkpoint")
    plan = make_plan(ck, opts.scheme, opts.group_size, opts.method, opts.ignore)
    check_options(opts, plan)
    policy = fallback_policy(opts, plan)
    calibrate = needs_calibration(opts, plan)
    if dry_run:
        return rep.plan_summary(ck, plan, opts, policy, calibrate)
    calib = None
    if calibrate:
        calib = load_calib(opts.calib, load_tokenizer(ck.root), opts.calib_samples, opts.seq_len)
        needs = {}
        if plan.scheme == STATIC:
            needs["static activation ranges"] = 512
        if plan.method == "gptq":
            needs["GPTQ Hessians"] = max(lp.k for lp in plan.linears.values())
        w = min_tokens_warning(calib, needs)
        if w:
            warn(w)
    with OutputDir(output, stage="quantize", inputs=[model_dir], force=force, options=opts.as_dict(),
                   input_identity=ck.identity()) as out:
        qw = QuantWriter(out, ck, plan, opts.layout, opts.max_shard_size, staged=policy is not None)
        cal = None
        t_cal = time.perf_counter()
        if calib is not None:
            cal = Calibrator(ck, plan, opts, calib, qw, progress)
            cal.run()
            records = cal.records
        else:
            records = weight_only(ck, plan, qw, progress)
        t_cal = time.perf_counter() - t_cal
        decision = rep.decide(plan, records, policy, SCHEMES[opts.fallback_to])
        desc = qw.finish(decision.types)
        out.write_json(qw.description_name, desc)
        config = {k: v for k, v in ck.config.items() if k != "quantization_config"}
        if ck.facts.fp8_block:  # weights arrive dequantized: the unquantized ones are written in the model dtype
            config["torch_dtype"] = config.get("torch_dtype") or "bfloat16"
        for f in ck.copy_files():
            if f.name != "config.json":
                out.copy_in(f)
        out.write_text("config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        report = rep.build_report(ck, plan, opts, records, decision, policy, cal, calib)
        out.write_json(rep.REPORT_FILE, report)
        if cal is not None and cal.expert_counts:
            out.write_json(rep.EXPERT_LOAD_FILE, {"layers": {str(k): v for k, v in sorted(cal.expert_counts.items())}})
        files = sorted(p.relative_to(out.path).as_posix() for p in out.path.rglob("*") if p.is_file())
    result = rep.summary(ck, plan, opts, report, decision, output, files + ["dsconv_manifest.json"],
                         seconds=time.perf_counter() - t0, calibration_seconds=t_cal)
    if cal is not None:
        result["timings"] = {k: round(v, 3) for k, v in cal.timings.items()}
    return result
