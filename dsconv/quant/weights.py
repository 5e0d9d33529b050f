"""One linear's weight quantized, the same way on both paths (streamed or calibrated)."""
from __future__ import annotations

import numpy as np
import torch

from dsconv.quant.gptq import gptq_quantize
from dsconv.quant.plan import BITS, LinearPlan, QuantPlan
from dsconv.quant.schemes import quantize_weight_per_channel, quantize_weight_per_group


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
