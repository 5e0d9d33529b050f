"""One linear's weight quantized, the same way on both paths (streamed or calibrated): each --method is a rounding
function registered in ROUNDING, chosen by name, never by branches at the call sites."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

from dsconv.qformat import scale_bias_sums
from dsconv.quant.algorithms.error_metrics import row_sq_errors, rows_error, sample_step
from dsconv.quant.algorithms.schemes import (iter_quantized_rows, qrange, quantize_weight_per_channel,
                                             quantize_weight_per_group)
from dsconv.quant.formats.msmodelslim import LinearResult, components, emit_linear, pack_weight_rows
from dsconv.quant.plan.plan import BITS, LinearPlan, QuantPlan
from dsconv.tensors import safetensors_dtype


if TYPE_CHECKING:  # GPTQ and the searched scales import torch when used: a weight-only run never loads it
    import torch

Weight = tuple[np.ndarray, np.ndarray]  # int8 values [n, k] and float32 scales [n, groups]


@dataclass(frozen=True)
class RoundingInput:
    """What a rounding method may use besides the weight: its width and group, GPTQ's Hessian of the input (None
    without calibration), its damping, and the weight --method awq's layer search already chose (None: none)."""

    bits: int
    group: int
    hessian: np.ndarray | None = None
    damp: float = 0.0
    chosen: Weight | None = None


def round_to_nearest(lp: LinearPlan, w: torch.Tensor, inp: RoundingInput) -> Weight:
    """max |w| scales, per output channel (8 bits) or per group (4 bits)."""
    if not isinstance(w, np.ndarray) and safetensors_dtype(w) == "F32":
        w = w.numpy()  # float32 tensors as their numpy view; bf16/fp16 tensors go as they are (schemes reads them)
    if inp.bits == 8:
        return quantize_weight_per_channel(w, 8, lp.module)
    q, scale, _ = quantize_weight_per_group(w, inp.group, 4, lp.module)
    return q, scale


def round_searched(lp: LinearPlan, w: torch.Tensor, inp: RoundingInput) -> Weight:
    """Scales searched for the smallest weight error (grid.py). Not a default: on the real fixture they lowered
    every group's error yet raised perplexity 2.6x over plain rounding (docs/accuracy.md)."""
    from dsconv.quant.algorithms import grid

    qmin, qmax = qrange(inp.bits)
    qt, st = grid.quantize_searched(w, inp.group, qmin, qmax)
    return qt.numpy(), st.numpy()


def round_gptq(lp: LinearPlan, w: torch.Tensor, inp: RoundingInput) -> Weight:
    """GPTQ with the input's Hessian (act order, static groups: the scales are round-to-nearest's); without one
    (a linear calibration never reached), round-to-nearest."""
    if inp.hessian is None:
        return round_to_nearest(lp, w, inp)
    from dsconv.quant.algorithms.gptq import gptq_quantize

    q, scale, _ = gptq_quantize(w, inp.hessian, bits=inp.bits, group_size=inp.group, damp=inp.damp, act_order=True,
                                name=lp.module)
    return q, scale


def round_awq(lp: LinearPlan, w: torch.Tensor, inp: RoundingInput) -> Weight:
    """The weight AWQ's layer search chose (calibrate/awq.py: scaled, clip-searched); round-to-nearest where it chose
    plain rounding or never ran (activation-quantized linears, routed experts)."""
    return inp.chosen if inp.chosen is not None else round_to_nearest(lp, w, inp)


# --method name -> how a weight is rounded (the names are algorithms/methods.py's METHODS, which the CLI reads
# without importing this module)
ROUNDING: dict[str, Callable[[LinearPlan, torch.Tensor, RoundingInput], Weight]] = {
    "rtn": round_to_nearest, "mse": round_searched, "gptq": round_gptq, "awq": round_awq}


def quantize_weight(lp: LinearPlan, w: torch.Tensor, plan: QuantPlan, hessian: np.ndarray | None,
                    damp: float, method: str | None = None, chosen: Weight | None = None) -> Weight:
    """int8 values [n, k] and float32 scales of one weight by `method` (default the plan's), through ROUNDING."""
    bits = BITS[lp.qtype]
    g = plan.group_size if bits == 4 else 0
    return ROUNDING[method or plan.method](lp, w, RoundingInput(bits, g, hessian, damp, chosen))


def rtn_linear_into(w: Any, lp: LinearPlan, qtype: str, group_size: int, deq_dtype: str, bias: Any,
                    write_chunks: Callable[[str, Iterable[Any]], None],
                    write: Callable[[str, Any], None], release: Callable[[int, int], None] | None = None) -> float:
    """Round-to-nearest of one linear weight `w` (a zero-copy view is fine), written one row block at a time:
    `write_chunks(name, chunks)` gets the (packed) int8 weight block by block while two threads compute
    the next blocks, then `write(name, array)` each small component (scales, offsets, bias) - the same tensors and
    bytes as `emit_linear(quantize_weight(...))`, with memory a few row blocks instead of the weight's int8 copy.
    `release(row_start, row_stop)` drops input rows once written. Sink-agnostic and per tensor, so a worker with its
    own part writer can call it. Returns the relative error from evenly spaced rows (error_metrics.sample_step)."""
    bits = BITS[lp.qtype]
    g = group_size if bits == 4 else 0
    n, k = lp.shape
    groups = 1 if g in (0, k) else k // g
    step = sample_step(n)
    sampled: list[np.ndarray] = []
    scale = np.ones((n, groups), np.float32)
    sb_chunks = lp.scale_bias_chunks
    sums = np.zeros((n, sb_chunks), np.int64) if any(c[0] == "scale_bias" for c in components(qtype)) else None

    def chunks():
        for s, e, q, sc in iter_quantized_rows(w, bits, g, lp.module, done=release):
            scale[s:e] = sc
            if sums is not None:
                sums[s:e] = scale_bias_sums(q, sb_chunks)
            first = -(-s // step) * step
            if first < e:  # the sampled rows' errors now, while the block's pages are mapped
                sampled.append(row_sq_errors(w[first:e:step], q[first - s:e - s:step], sc[first - s:e - s:step]))
            yield pack_weight_rows(lp.module, qtype, q, groups)

    write_chunks(f"{lp.module}.weight", chunks())  # the layout's first component, in every type
    res = LinearResult(q=np.broadcast_to(np.int8(0), (n, k)), scale=scale, bias=bias, sums=sums)
    for name, arr in emit_linear(lp.module, qtype, res, deq_dtype, skip_weight=True, chunks=sb_chunks):
        write(name, arr)
    return rows_error(np.concatenate(sampled) if sampled else np.zeros((0, 2)))

