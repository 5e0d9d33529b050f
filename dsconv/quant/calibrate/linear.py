"""Quantizing one linear from its calibration statistics: a pure function of (plan, weight, statistics, options) to
the tensors to write (`LinearResult`) and what was measured (`LinearRecord`). The layer runner calls it in the
driver and the jobs call it in workers (calib_jobs.py), so the two cannot drift apart.

Two halves, because an under-covered routed expert's weight is rounded in its job while its activation range is
only known once the driver has seen the whole layer: `prepare_linear` (the weight: int8 values, scales, the
GPTQ-or-rounding choice, and the rows to measure output error on) and `finish_linear` (activation parameters,
static auxiliaries, output errors). `quantize_linear` is both, with the statistics' own range.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dsconv.checkpoint import Checkpoint
from dsconv.errors import UserError
from dsconv.quant.algorithms import selection
from dsconv.quant.algorithms.error_metrics import sampled_weight_error
from dsconv.quant.algorithms.schemes import activation_qparams, w8a8_static_params
from dsconv.quant.calibrate.stats import InputStats, output_errors
from dsconv.quant.formats.msmodelslim import LinearResult
from dsconv.quant.plan.options import QuantOptions
from dsconv.qformat import STATIC_TYPES
from dsconv.quant.plan.plan import LinearPlan, QuantPlan
from dsconv.quant.plan.report import LinearRecord
from dsconv.quant.weights import quantize_weight


@dataclass(frozen=True)
class WeightChoice:
    """A weight chosen before the statistics pass (--method awq's layer search): the int8 values and scales, or
    None for plain rounding; how it was chosen; its held-out errors; and the linear's new bias where a fold changed
    it (v_proj's bias / s), else None."""

    weight: tuple[np.ndarray, np.ndarray] | None
    how: str
    errors: dict[str, float] = field(default_factory=dict)
    bias: torch.Tensor | None = None


@dataclass
class PreparedLinear:
    """A quantized weight waiting for its activation parameters (and the rows to measure its output error on)."""

    lp: LinearPlan
    q: np.ndarray
    scale: np.ndarray
    bias: torch.Tensor | None
    record: LinearRecord
    x: torch.Tensor | None
    y_ref: torch.Tensor | None
    decisions: dict[str, dict[str, str]] = field(default_factory=dict)  # for quant_report.json (gptq_or_rtn)
    seconds: dict[str, float] = field(default_factory=dict)  # CPU per step (calibrate/steps.py JOB_STEPS)


@dataclass
class QuantizedLinear:
    """One linear, ready to write: its tensors and its record."""

    lp: LinearPlan
    result: LinearResult
    record: LinearRecord
    seconds: dict[str, float] = field(default_factory=dict)  # CPU per step (calibrate/steps.py JOB_STEPS)


def load_bias(ck: Checkpoint, lp: LinearPlan, choice: WeightChoice | None = None) -> torch.Tensor | None:
    """The bias to write: the one a fold changed, else the checkpoint's (None without one)."""
    if choice is not None and choice.bias is not None:
        return choice.bias
    return ck.load(lp.bias) if lp.bias else None


def static_aux(lp: LinearPlan, q: np.ndarray, scale: np.ndarray, qparams: tuple[float, float],
               bias: torch.Tensor | None) -> dict[str, np.ndarray]:
    b = None if bias is None else bias.float().numpy()
    return w8a8_static_params(q, scale, qparams[0], qparams[1], b, name=lp.module)


def prepare_linear(plan: QuantPlan, lp: LinearPlan, w: torch.Tensor, st: InputStats | None, opts: QuantOptions,
                   bias: torch.Tensor | None, choice: WeightChoice | None = None,
                   y_ref: torch.Tensor | None = None) -> PreparedLinear:
    """The weight part: int8 values and scales by the plan's method (GPTQ with the input's Hessian), and what
    measuring the output error later needs (a few calibration rows and their float outputs) - never the float weight
    itself. `y_ref`: the sampled rows' float outputs (bias excluded) when the caller's forward already computed them
    (a routed expert's job), else they are computed here."""
    t = time.process_time()
    hess = st.hessian.hessian() if st is not None and st.hessian is not None and st.hessian.tokens else None
    q, scale = quantize_weight(lp, w, plan, hess, opts.damp, chosen=None if choice is None else choice.weight)
    decisions: dict[str, dict[str, str]] = {}
    picked_errors = None
    x_held = st.held.x if st is not None and st.held is not None else None
    if hess is not None and x_held is not None:  # GPTQ kept only where it beats rounding on held-out prompts
        cands = {"gptq": (q, scale), "rtn": quantize_weight(lp, w, plan, None, 0.0, method="rtn")}
        (q, scale), picked, picked_errors = selection.choose(x_held, w, cands)
        decisions["gptq_or_rtn"] = {lp.module: picked}
    seconds = {"gptq" if hess is not None else "quantize": time.process_time() - t}
    t = time.process_time()
    rec = LinearRecord(lp.module, lp.qtype, sampled_weight_error(w, q, scale), tokens=st.tokens if st is not None else 0)
    if picked_errors is not None:
        rec.errors.update(picked_errors)
        rec.note = f"{picked} (smaller error on held-out prompts)"
    if choice is not None:
        rec.errors.update(choice.errors)
        rec.note = f"awq: {choice.how} (held-out prompts)"
    x = st.sample if st is not None else None
    if x is not None and x.shape[0]:
        y_ref = x @ w.float().T if y_ref is None else y_ref
        if bias is not None:
            y_ref = y_ref + bias.float()
    else:
        x = y_ref = None
    seconds["fallback_check"] = time.process_time() - t  # the weight error and the rows' float outputs
    return PreparedLinear(lp, q, scale, bias, rec, x, y_ref, decisions, seconds)


def finish_linear(p: PreparedLinear, qparams: tuple[float, float] | None, staged: bool,
                  range_source: str | None = None) -> QuantizedLinear:
    """The activation part: static W8A8's input_scale/offset (`qparams`), deq_scale and quant_bias, and the output
    errors on the sampled rows. A quant_bias overflowing int32 fails, unless the writer stages (`staged`): then the
    unit is marked to fall back and placeholders stand in, never written."""
    lp, rec = p.lp, p.record
    seconds = dict(p.seconds)
    t = time.process_time()
    rec.range_source = range_source
    res = LinearResult(q=p.q, scale=p.scale, bias=p.bias)
    if lp.qtype in STATIC_TYPES:
        try:
            aux = static_aux(lp, p.q, p.scale, qparams, p.bias)
        except UserError:
            if not staged:
                raise
            aux = None
            rec.note = "quant_bias overflows int32: static W8A8 impossible"
            rec.errors["static"] = float("inf")
        res.input_scale, res.input_offset = np.float32(qparams[0]), np.float32(qparams[1])
        if aux is not None:
            res.deq_scale, res.quant_bias = aux["deq_scale"], aux["quant_bias"]
        else:
            res.deq_scale = np.ones(lp.n, np.float32)
            res.quant_bias = np.zeros(lp.n, np.int32)
    seconds["quantize"] = seconds.get("quantize", 0.0) + time.process_time() - t
    t = time.process_time()
    if p.x is not None:
        b = None if p.bias is None else p.bias.float()
        errs = output_errors(p.x, p.y_ref, p.q, p.scale, b, (res.input_scale, res.input_offset)
                             if lp.qtype in STATIC_TYPES else None)
        rec.errors.update({k: v for k, v in errs.items() if k not in rec.errors})
    seconds["fallback_check"] = seconds.get("fallback_check", 0.0) + time.process_time() - t
    return QuantizedLinear(lp, res, rec, seconds)


def quantize_linear(plan: QuantPlan, lp: LinearPlan, w: torch.Tensor, st: InputStats | None, opts: QuantOptions,
                    bias: torch.Tensor | None, staged: bool, choice: WeightChoice | None = None,
                    y_ref: torch.Tensor | None = None) -> tuple[QuantizedLinear, dict[str, Any]]:
    """One linear with its input statistics, static activations over the statistics' own range. Returns the linear
    and the decisions it made (for quant_report.json)."""
    p = prepare_linear(plan, lp, w, st, opts, bias, choice, y_ref)
    qparams = None
    if lp.qtype in STATIC_TYPES:
        rng = st.clip_range() if st is not None else None
        if rng is None:
            raise UserError(f"layer {lp.module}: calibration never reached it (0 tokens)",
                            hint="use more calibration text, or --all-experts for MoE models")
        qparams = activation_qparams(*rng)
    return finish_linear(p, qparams, staged), p.decisions
