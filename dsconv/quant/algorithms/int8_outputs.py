"""What a quantized linear outputs, computed in integers as the engine computes it: int8 activation codes times
int8 weight codes (int32 sums, exact), then the scales. The searches (smoothing.py's strengths, clipping.py's
ratios) score their candidates this way instead of dequantizing both sides and multiplying in float32: the same
figures to float rounding, a fraction of the cost (int8 matmuls, and int8 temporaries a quarter of the size).
"""
from __future__ import annotations

from typing import Sequence

import torch

from dsconv.quant.algorithms.fake_quant import int8_rows


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [m, k] @ b [n, k].T of int8 codes, as float32: torch's int8 matmul (int32 sums, exact), or a float32 matmul
    where this torch has none for the CPU."""
    try:
        return torch._int_mm(a, b.T).float()
    except (RuntimeError, AttributeError):
        return a.float() @ b.float().T


def static_outputs(x: torch.Tensor, qparams: Sequence[tuple[float, float]], qw: torch.Tensor,
                   sw: torch.Tensor) -> torch.Tensor:
    """x [m, k] quantized per tensor with each (scale, offset) pair of `qparams` (schemes.activation_qparams; static
    W8A8: clamp(round(x / scale + offset)), dequantized as (q - offset) * scale), through weight codes qw [n, k]
    (int8) with per-row scales sw [n]: [pairs, m, n]. The offset is taken out after the matmul, through each weight
    row's code sum."""
    (m, k), n, c = x.shape, qw.shape[0], len(qparams)
    sc = torch.tensor([float(a) for a, _ in qparams]).view(c, 1, 1)
    off = torch.tensor([float(b) for _, b in qparams]).view(c, 1, 1)
    qx = torch.round(x[None] / sc + off).clamp_(-128, 127).to(torch.int8)              # [pairs, m, k]
    y = int8_matmul(qx.view(-1, k), qw).view(c, m, n)
    both = sc * sw.float().view(1, 1, n)
    return y.mul_(both).sub_(off * qw.sum(dim=1, dtype=torch.int32).float() * both)


def dynamic_outputs(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """x [m, k] quantized per token (symmetric int8, W8A8_DYNAMIC) through weight codes qw [n, k] with per-row
    scales sw [n]: [m, n]."""
    qx, sx = int8_rows(x)
    return int8_matmul(qx.to(torch.int8), qw).mul_(sx).mul_(sw.float().view(1, -1))
