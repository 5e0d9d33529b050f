"""Quantize-then-dequantize in float: what a tensor becomes once the engine has rounded it, so searches and reports
can measure the error of a choice without writing it. One function per rounding rule, shared by every caller, so
the calibration searches, the reported output errors, `dsconv eval` and the INT8 ONNX export all round alike.

Static per-tensor activations with stored (input_scale, input_offset) are `schemes.fake_quant_activation`, next to
the integer quantizer they dequantize.
"""
from __future__ import annotations

import numpy as np
import torch

from dsconv.quant.algorithms.scale_grid import choose_scales
from dsconv.quant.algorithms.schemes import activation_qparams, qrange


def int8_rows(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 (or int4) per row of the last dimension: (integer values in x's float dtype, in [-128, 127]
    or [-8, 7]; scale per row = max|row| / 127 or / 7, 1 for an all-zero row). Per token for activations
    (W8A8_DYNAMIC, W4A8_DYNAMIC's a8; W4A4_DYNAMIC's a4, as npu_dynamic_quant to quint4x2 scales them), per output
    channel for a weight [n, k]."""
    lo, hi = (-128, 127) if bits == 8 else (-8, 7)  # ints: the INT8 ONNX export traces these constants as written
    s = x.abs().amax(dim=-1, keepdim=True) / float(hi)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(x / s).clamp_(lo, hi), s


def fake_quant_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """`int8_rows` dequantized: per-token dynamic activations, or 8-bit per-channel round-to-nearest weights. The
    ops are traced into the INT8 ONNX export as written (abs, amax, div, where, div, round, clip, mul)."""
    q, s = int8_rows(x)
    return q * s


def fake_quant_static(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """Per-tensor asymmetric int8 over the range [lo, hi] (static W8A8 while its range is being searched), in x's
    dtype with Python-float scale and offset."""
    scale, offset = activation_qparams(lo, hi)
    sc, off = float(scale), float(offset)
    return (torch.round(x / sc + off).clamp_(-128, 127) - off) * sc


def fake_quant_groups(w: torch.Tensor, bits: int, g: int) -> torch.Tensor:
    """Symmetric round-to-nearest of a weight [n, k] at `bits`, per group of g along k (g 0 or k: per row), with the
    scales round-to-nearest writes (scale_grid.py): what a weight-only linear dequantizes to, in float32."""
    qmin, qmax = qrange(bits)
    n, k = w.shape
    q, sc = choose_scales(w.detach().reshape(n, groups_of(k, g), -1), qmin, qmax)
    return torch.from_numpy(q.astype(np.float32) * sc).reshape(n, k)


def groups_of(k: int, g: int) -> int:
    """Groups along k for group size g (0 or k: one group, per row)."""
    return k // g if 0 < g < k else 1
