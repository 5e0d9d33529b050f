"""Per-linear calibration state: streaming statistics of a linear's input, and what quantizing it measured.

One `InputStats` serves every linear that reads the same tensor (q/k/v, gate/up): the activation observer, the GPTQ
Hessian and a small sample of input rows (for measuring output error after quantization) are computed once per input,
not once per consumer. Memory is O(channels) for the observer, k^2 for a Hessian (only with GPTQ) and
`sample_tokens x k` for the sample: activations themselves are never stored.
"""
from __future__ import annotations

import numpy as np
import torch

from dsconv.quant.algorithms.gptq import HessianAccumulator
from dsconv.quant.algorithms.observers import MinMaxObserver, make_observer
from dsconv.quant.algorithms.error_metrics import relative_error
from dsconv.quant.algorithms.fake_quant import fake_quant_int8_rows
from dsconv.quant.algorithms.sampling import RowSampler
from dsconv.quant.algorithms.schemes import dequant_weight, fake_quant_activation

HESSIAN_F64_MAX_K = 8192  # wider inputs accumulate in float32 (k^2 x 8 bytes would be 2.7 GB for k = 18432)


class InputStats:
    """Streaming statistics of one linear input [tokens, k]."""

    def __init__(self, k: int, name: str, act_method: str | None, hessian: bool, sample_tokens: int,
                 stride: int = 1, held_out: bool = False) -> None:
        self.k = k
        self.name = name
        self.observer: MinMaxObserver | None = make_observer(act_method, name=name) if act_method else None
        self.hessian = HessianAccumulator(k, torch.float64 if k <= HESSIAN_F64_MAX_K else torch.float32) \
            if hessian else None
        self.sampler = RowSampler(stride, sample_tokens)
        self.clip_ratio = 1.0  # static range x ratio, chosen by output error (clipping.py)
        # held-out tokens (whole calibration prompts) are kept out of the Hessian to compare GPTQ with RTN on them
        # (selection.py): their first rows, capped
        self.held: RowSampler | None = RowSampler(1, sample_tokens * 2) if held_out and hessian else None

    def update(self, x: torch.Tensor, held: torch.Tensor | None = None,
               channel_range: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Fold in rows [t, k] (real tokens only); `held` marks rows of held-out prompts; `channel_range`: the
        rows' per-channel (min, max) when the caller has them (hooks.RowMask: once per tensor and batch)."""
        t = x.shape[0]
        if t == 0:
            return
        if self.observer is not None:
            self.observer.update(x, channel_range)
        if self.hessian is not None:
            if self.held is not None and held is not None and bool(held.any()):
                self.held.update(x[held])
                self.hessian.update(x[~held])
            else:
                self.hessian.update(x)
        self.sampler.update(x)

    @property
    def tokens(self) -> int:
        """Real tokens seen (the sampler counts every row it is shown)."""
        return self.sampler.seen

    @property
    def sample(self) -> torch.Tensor | None:
        return self.sampler.x

    def clip_range(self) -> tuple[float, float] | None:
        if self.observer is None or self.observer.tokens == 0:
            return None
        lo, hi = self.observer.clip_range()
        return lo * self.clip_ratio, hi * self.clip_ratio

    def rescale(self, s: torch.Tensor) -> None:
        """These statistics as if the input had been divided by `s` [k] (s > 0) per channel: what a smoothing fold
        decided after the statistics forward makes the linears read (the fold divides the producer's output by s).
        Min/max, sampled rows and X^T X all scale per channel, so this equals a second forward over the smoothed
        layer up to float rounding (never a second pass: calibrate/steps.py)."""
        s = s.float()
        if self.observer is not None:
            self.observer.rescale(s.numpy())
        if self.hessian is not None:
            d = s.to(self.hessian.sum.dtype)
            self.hessian.sum.div_(d[:, None] * d[None, :])
        self.sampler.rows = [r / s for r in self.sampler.rows]
        if self.held is not None:
            self.held.rows = [r / s for r in self.held.rows]

    def free(self) -> None:
        self.hessian = None
        self.held = None
        self.sampler.rows = []


def output_errors(x: torch.Tensor, y_ref: torch.Tensor, q: np.ndarray, scale: np.ndarray,
                  bias: torch.Tensor | None, qparams: tuple[float, float] | None) -> dict[str, float]:
    """Relative output error on calibration rows x (float outputs y_ref): weight-only, per-token dynamic
    activations, and - given (input_scale, input_offset) - static per-tensor activations."""
    w_hat = torch.from_numpy(dequant_weight(q, scale))
    b = 0 if bias is None else bias
    names, rows = ["weight_only", "dynamic"], [x, fake_quant_int8_rows(x)]
    if qparams is not None:
        names.append("static")
        rows.append(fake_quant_activation(x, float(qparams[0]), float(qparams[1])))
    y = (torch.cat(rows) @ w_hat.T + b).view(len(rows), *y_ref.shape)  # the variants' rows in one matmul
    return {name: _rel(y[j], y_ref) for j, name in enumerate(names)}


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return relative_error(y, ref, float64=True, zero_ref="inf")
