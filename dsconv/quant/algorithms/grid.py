"""Symmetric group scales chosen by a clip-ratio search instead of max |w|.

Why: ``scale = max|w| / qmax`` spends the 4-bit grid on the group's largest weight; shrinking the scale a little
(clipping that one weight) usually lowers the error of all the others by more than it costs. Each group (or row,
per channel) gets the ratio ``r`` of a fixed grid that minimises its squared rounding error, optionally weighted
per input column (the diagonal of the layer's Hessian: how much each column's error reaches the output). ``r = 1``
is on the grid and wins ties, so the search never increases a group's (weighted) error over round-to-nearest. With the
clamp at ``qmin = -8`` a ratio of 7/8 makes the group's most negative weight exactly ``-8 * scale``.
The written format does not change: one float scale per group, zero offsets.
"""
from __future__ import annotations

import numpy as np
import torch

from dsconv.quant.algorithms.scale_grid import absmax, quantize_rows

# 1.0 first (ties keep max|w|), then down to 0.5 in steps of 1/40 (0.875 = 7/8 is on it)
RATIOS = tuple(1.0 - i / 40 for i in range(21))
ROW_BLOCK_ELEMS = 1 << 22  # rows per pass: bounds the temporaries to a few times 16 MB


def search_scales(w: torch.Tensor, qmin: int, qmax: int, importance: torch.Tensor | None = None,
                  ratios: tuple[float, ...] = RATIOS) -> torch.Tensor:
    """Per-group scales of ``w [n, groups, g]`` (float32): ``max|w| / qmax * r`` with ``r`` minimising
    ``sum_j importance[group, j] * (w_j - q_j * scale)^2`` per group; ``importance [groups, g]`` (>= 0) or None
    (plain squared error). All-zero groups get 1.0, as in round-to-nearest (scale_grid.exact_scales)."""
    return search(w, qmin, qmax, importance, ratios=ratios)[0]


def search(w: torch.Tensor, qmin: int, qmax: int, importance: torch.Tensor | None = None,
           hblocks: torch.Tensor | None = None, ratios: tuple[float, ...] = RATIOS
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`search_scales` and the ratio each group chose (``[n, groups]``). The error is the importance-weighted
    squared error, or with ``hblocks [groups, g, g]`` (a Hessian block per group: awq's clip search) the output
    error ``d^T H_g d`` of the rounding error ``d``. The first ratio wins ties (list 1.0 first). Each ratio's scale
    is the engines' grid value next to ``max|w| / qmax * r`` that round-to-nearest would choose for that range
    (scale_grid.quantize_rows), so ratio 1.0 is exactly round-to-nearest's weight."""
    n, groups, g = w.shape
    out = torch.empty(n, groups, dtype=torch.float32)
    chosen = torch.empty(n, groups, dtype=torch.float32)
    imp = None if importance is None else importance.to(torch.float32).reshape(1, groups, g)
    step = max(1, ROW_BLOCK_ELEMS // max(1, groups * g))
    for s in range(0, n, step):
        blk = w[s:s + step].to(torch.float32).contiguous()
        b2 = blk.numpy().reshape(-1, g)
        amax = absmax(b2)
        q = np.empty(b2.shape, np.int8)
        best_scale = best_r = best_err = None
        for r in ratios:
            sc = torch.from_numpy(quantize_rows(b2, amax, qmin, qmax, q, r).reshape(-1, groups))
            d = torch.from_numpy(q).to(torch.float32).reshape(blk.shape).mul_(sc[..., None]).sub_(blk)
            if hblocks is not None:
                dt = d.transpose(0, 1)
                err = (torch.bmm(dt, hblocks) * dt).sum(dim=-1).transpose(0, 1)
            else:
                d.square_()
                err = (d if imp is None else d.mul_(imp)).sum(dim=2)
            if best_err is None:
                best_err, best_scale, best_r = err, sc, torch.full_like(sc, r)
                continue
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, sc, best_scale)
            best_r = torch.where(better, torch.full_like(best_r, r), best_r)
        out[s:s + step] = best_scale
        chosen[s:s + step] = best_r
    return out, chosen


def quantize_searched(w: torch.Tensor, group_size: int, qmin: int, qmax: int,
                      importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest with searched scales: ``(q int8 [n, k], scale float32 [n, groups])``; ``group_size`` 0 is
    one group per row. ``importance [k]`` weights the columns' errors (None: plain squared error). Works on row
    blocks, so a bf16 weight is never widened to float32 whole."""
    if not isinstance(w, torch.Tensor):
        w = torch.from_numpy(w)
    n, k = w.shape
    g = group_size if 0 < group_size < k else k
    groups = k // g
    imp = None if importance is None else importance.reshape(groups, g)
    q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, groups, dtype=torch.float32)
    step = max(1, ROW_BLOCK_ELEMS // max(1, k))
    for s in range(0, n, step):
        w3 = w[s:s + step].to(torch.float32).reshape(-1, groups, g)
        sc = search_scales(w3, qmin, qmax, imp)
        scale[s:s + step] = sc
        q[s:s + step] = torch.round(w3 / sc[..., None]).clamp_(qmin, qmax).to(torch.int8).reshape(-1, k)
    return q, scale
