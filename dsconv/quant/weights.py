"""One linear's weight quantized, the same way on both paths (streamed or calibrated)."""
from __future__ import annotations

import numpy as np
import torch

from dsconv.quant import grid
from dsconv.quant.gptq import gptq_quantize
from dsconv.quant.plan import BITS, LinearPlan, QuantPlan
from dsconv.quant.schemes import qrange, quantize_weight_per_channel, quantize_weight_per_group


def quantize_weight(lp: LinearPlan, w: torch.Tensor, plan: QuantPlan, hessian: np.ndarray | None,
                    damp: float, method: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """int8 values [n, k] and float32 scales of one weight by `method` (default the plan's): GPTQ with a Hessian
    (act order, static groups: the scales are round-to-nearest's), else round-to-nearest with max |w| scales.

    Scales searched for the smallest weight error (grid.py, ``mse``) are not used by default: on the real fixture
    they lowered every group's error yet raised perplexity 2.6x over plain rounding (README, issue 10)."""
    bits = BITS[lp.qtype]
    g = plan.group_size if bits == 4 else 0
    method = method or plan.method
    if method == "gptq" and hessian is not None:
        q, scale, _ = gptq_quantize(w, hessian, bits=bits, group_size=g, damp=damp, act_order=True, name=lp.module)
        return q, scale
    if method == "mse":
        qmin, qmax = qrange(bits)
        qt, st = grid.quantize_searched(w, g, qmin, qmax)
        return qt.numpy(), st.numpy()
    if bits == 8:
        return quantize_weight_per_channel(w if w.dtype != torch.float32 else w.numpy(), 8, lp.module)
    q, scale, _ = quantize_weight_per_group(w if w.dtype != torch.float32 else w.numpy(), g, 4, lp.module)
    return q, scale
