"""Relative errors, the one yardstick of every search, choice and report in quantization.

Each variant keeps the exact arithmetic its callers have always had, because these numbers pick weights and
fallbacks and are written to quant_report.json: the accumulation dtype and what a zero reference gives are
parameters, never silently unified.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dsconv.quant.algorithms.schemes import to_float32

if TYPE_CHECKING:  # the weight errors are numpy: a weight-only run never loads torch (its start-up is copy speed)
    import torch

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


# Rows a big tensor's reported error is estimated from (evenly spaced; within a few percent of the exact figure, which
# would cost a second widening of the whole weight).
ERROR_SAMPLE_ROWS = 256


def sample_step(n: int) -> int:
    """The stride of the reported rows: rows 0, step, 2 * step, ... of an ``n``-row weight."""
    return max(1, n // ERROR_SAMPLE_ROWS)


def row_sq_errors(w_rows: Any, q_rows: np.ndarray, scale_rows: np.ndarray) -> np.ndarray:
    """``[m, 2]`` float64 per row: the squared error of the dequantized row ``q * scale`` against ``w`` and the squared
    norm of ``w`` (compiled, one pass, bf16 rows read as their bit patterns; summed by :func:`rows_error`)."""
    from dsconv.quant.algorithms.rtn_kernel import row_sq_errors as kernel
    from dsconv.quant.algorithms.schemes import bf16_bits

    bits = bf16_bits(w_rows)
    x = to_float32(w_rows) if bits is None else bits
    out = np.empty((len(x), 2), np.float64)
    if len(x):
        kernel(x, bits is not None, np.asarray(q_rows, dtype=np.int8),
               np.asarray(scale_rows, np.float32).reshape(len(x), -1), out)
    return out


def rows_error(rows: np.ndarray) -> float:
    """``||w - w_hat|| / ||w||`` from :func:`row_sq_errors` rows; 0/0 -> 0, x/0 -> inf."""
    num, den = float(np.sqrt(rows[:, 0].sum())), float(np.sqrt(rows[:, 1].sum()))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def sampled_weight_error(w: Any, q: np.ndarray, scale: np.ndarray) -> float:
    """The reported relative error of a quantized weight, from its evenly spaced rows (:func:`sample_step`)."""
    rows = slice(0, w.shape[0], sample_step(w.shape[0]))
    return rows_error(row_sq_errors(w[rows], q[rows], scale[rows]))


def relative_error(approx: torch.Tensor, ref: torch.Tensor, float64: bool = False, zero_ref: str = "zero") -> float:
    """``||approx - ref|| / ||ref||`` of torch tensors. `float64`: the norms accumulate in float64 (the reported
    output errors) rather than in the tensors' dtype (the searches). `zero_ref` (ZERO_REF) when ||ref|| is 0:
    "zero" -> 0 (the searches: nothing to lose), "inf" -> 0 for 0/0 else inf (the reported errors: a nonzero output
    where none belongs is infinitely wrong), "absolute" -> ||approx - ref|| (the clip search, which divides by 1)."""
    import torch

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
    import torch

    den = float(torch.linalg.vector_norm(x @ w.T))
    num = float(torch.linalg.vector_norm(x @ (w_hat - w).T))
    return num / den if den else 0.0
