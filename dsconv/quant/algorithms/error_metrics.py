"""Relative errors, the one yardstick of every search, choice and report in quantization.

Each variant keeps the exact arithmetic its callers have always had, because these numbers pick weights and
fallbacks and are written to quant_report.json: the accumulation dtype and what a zero reference gives are
parameters, never silently unified.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dsconv.quant.algorithms.schemes import to_float32

ZERO_REF = ("zero", "inf", "absolute")  # what ||ref|| = 0 gives: 0; 0 for 0/0 else inf; the absolute error


def weight_error(w: Any, w_hat: Any) -> float:
    """``||w - w_hat|| / ||w||`` of a weight (numpy or torch) in float64 with numpy's pairwise sums, not a BLAS dot,
    whose result depends on its thread count (a report must not change with the executor's workers); 0/0 -> 0,
    x/0 -> inf."""
    a, b = to_float32(w).astype(np.float64), to_float32(w_hat).astype(np.float64)
    num, den = float(np.sqrt(np.square(a - b).sum())), float(np.sqrt(np.square(a).sum()))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def relative_error(approx: torch.Tensor, ref: torch.Tensor, float64: bool = False, zero_ref: str = "zero") -> float:
    """``||approx - ref|| / ||ref||`` of torch tensors. `float64`: the norms accumulate in float64 (the reported
    output errors) rather than in the tensors' dtype (the searches). `zero_ref` (ZERO_REF) when ||ref|| is 0:
    "zero" -> 0 (the searches: nothing to lose), "inf" -> 0 for 0/0 else inf (the reported errors: a nonzero output
    where none belongs is infinitely wrong), "absolute" -> ||approx - ref|| (the clip search, which divides by 1)."""
    dtype = torch.float64 if float64 else None
    den = float(torch.linalg.vector_norm(ref, dtype=dtype))
    num = float(torch.linalg.vector_norm(approx - ref, dtype=dtype))
    if den:
        return num / den
    if zero_ref == "zero":
        return 0.0
    if zero_ref == "inf":
        return 0.0 if num == 0.0 else float("inf")
    if zero_ref == "absolute":
        return num / 1.0
    raise ValueError(f"zero_ref {zero_ref!r} is not one of {ZERO_REF}")


def output_error(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """A weight's relative output error on rows x, ``||x (W_hat - W)^T|| / ||x W^T||`` (the difference taken on the
    weights, then multiplied), in x's dtype; 0 when x W^T is 0. What AWQ's searches and the GPTQ-or-rounding choice
    compare candidates by."""
    den = float(torch.linalg.vector_norm(x @ w.T))
    num = float(torch.linalg.vector_norm(x @ (w_hat - w).T))
    return num / den if den else 0.0
