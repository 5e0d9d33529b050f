"""A quantized linear computed as the engine computes its stored type, one block of output rows at a time.

W8A8 static layers compute `(x_q @ w_q^T + quant_bias) * deq_scale` from the stored input_scale/input_offset/
deq_scale/quant_bias (so a wrong auxiliary shows up in eval), W8A8_DYNAMIC layers quantize each token to int8,
W8A8_MIX layers compute one of the two as asked (`path`: "static" as a decode instance does, "dynamic" as prefill),
W4A8_DYNAMIC layers run the A8W4 kernel's arithmetic with the stored scale_bias, W4A4_DYNAMIC layers quantize each
token to int4 (vLLM-Ascend's w4a4_laos_dynamic.py), weight-only types multiply by the
dequantized weight. The activation step is per token, so it is done once and every block of output rows reuses it:
a linear is never widened to float32 whole (DeepSeek-V3's o_proj is 470 MB in float32, its dense MLP 1.6 GB).
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from dsconv.qformat import W4A4, W8A8_MIX, dequant_weight
from dsconv.quant.algorithms.fake_quant import fake_quant_int8_rows, int8_rows
from dsconv.quant.algorithms.schemes import quantize_activation
from dsconv.quant.formats.msmodelslim import QuantLinear

BLOCK_BYTES = 64 * 2**20  # float32 weight rows per block: bounds the temporaries whatever the layer's size


def row_blocks(n: int, k: int, budget: int | None = None) -> Iterator[tuple[int, int]]:
    """[lo, hi) ranges of output rows whose float32 rows fit in `budget` bytes."""
    step = max(1, (BLOCK_BYTES if budget is None else budget) // max(1, 4 * k))
    for lo in range(0, n, step):
        yield lo, min(n, lo + step)


# a W8A8_MIX linear's two paths, as the type whose arithmetic each one is (docs/formats/w8a8_mix.md)
MIX_PATHS = {"static": "W8A8", "dynamic": "W8A8_DYNAMIC"}
DEFAULT_MIX_PATH = "dynamic"  # what an instance without a KV-transfer role (prefill, or PD colocated) runs


#: the stored types whose activations the engine quantizes (per tensor or per token): EngineLinear replaces the
#: float forward of these; weight-only types compute with their dequantized weight
ACT_TYPES = ("W8A8", "W8A8_DYNAMIC", "W4A8_DYNAMIC", W4A4)


class EngineLinear:
    """`y = linear(x)` as the engine computes the stored type `ql.qtype` (bias included); a W8A8_MIX linear as its
    `path` ("static" or "dynamic")."""

    def __init__(self, ql: QuantLinear, path: str | None = None) -> None:
        self.ql = ql
        self.qtype = MIX_PATHS[path or DEFAULT_MIX_PATH] if ql.qtype == W8A8_MIX else ql.qtype
        self.n, self.k = ql.q.shape
        self.bias = None if ql.bias is None else torch.from_numpy(ql.bias)
        if ql.qtype == "W4A8_DYNAMIC":
            self.s = torch.from_numpy(ql.weight_scale.astype(np.float32).reshape(-1))
            self.sb = torch.from_numpy(ql.scale_bias.astype(np.float64).sum(-1).astype(np.float32))

    @property
    def w(self) -> torch.Tensor:
        """The whole dequantized weight (in-memory evaluation of small models)."""
        return self.rows(0, self.n)

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """Dequantized float32 rows [lo, hi); static W8A8 derives the weight scale from deq_scale / input_scale."""
        ql = self.ql
        if ql.weight_scale is not None and self.qtype != "W8A8":
            off = None if ql.weight_offset is None else ql.weight_offset[lo:hi]
            return torch.from_numpy(dequant_weight(ql.q[lo:hi], ql.weight_scale[lo:hi], off))
        scale = (ql.deq_scale[lo:hi].astype(np.float64) / float(ql.input_scale)).astype(np.float32)
        return torch.from_numpy(dequant_weight(ql.q[lo:hi], scale.reshape(-1, 1)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        a = self.activation(x2)
        out = torch.empty(x2.shape[0], self.n, dtype=torch.float32)
        for lo, hi in row_blocks(self.n, self.k):
            out[:, lo:hi] = self.block(a, lo, hi)
        return out.reshape(*shape[:-1], self.n).to(x.dtype)

    # ---- the kernel's arithmetic --------------------------------------------------------------------------------
    def activation(self, x: torch.Tensor) -> Any:
        """What the kernel makes of the tokens before the matmul (the same for every block of rows)."""
        if self.qtype == "W8A8":
            return quantize_activation(x, self.ql.input_scale, self.ql.input_offset).float()
        if self.qtype == "W8A8_DYNAMIC":
            return fake_quant_int8_rows(x.float())
        if self.qtype == W4A4:  # npu_dynamic_quant to int4 per token, then the int4 x int4 matmul
            q, s = int8_rows(x.float(), bits=4)
            return q * s
        if self.qtype == "W4A8_DYNAMIC":
            # the A8W4 kernel (grouped_matmul a8w4 "MSD"): per-token int8 x split as 16*hi + lo + 8 (hi, lo int4)
            xq, a = int8_rows(x.float())
            hi = torch.floor(xq / 16)
            return 16 * hi, xq - 16 * hi - 8, a
        return x.float()

    def block(self, a: Any, lo: int, hi: int) -> torch.Tensor:
        """Output rows [lo, hi) of the linear for activations `a` from `activation`."""
        ql = self.ql
        if self.qtype == "W8A8":
            wq = torch.from_numpy(ql.q[lo:hi].astype(np.float32))
            qb = torch.from_numpy(ql.quant_bias[lo:hi].astype(np.float32))
            deq = torch.from_numpy(ql.deq_scale[lo:hi].astype(np.float32))
            return (a @ wq.T + qb) * deq  # quant_bias already holds the bias
        if self.qtype == "W4A8_DYNAMIC":
            # two int4 x int4 products scaled per channel, plus the stored scale_bias for the +8 term, times the
            # token's scale: equals a8 x w4 exactly when scale_bias is right; a wrong one shows here
            h16, low, s_tok = a
            wq = torch.from_numpy(ql.q[lo:hi].astype(np.float32))
            y = (h16 @ wq.T + low @ wq.T) * self.s[lo:hi] + self.sb[lo:hi]
            y = y * s_tok
        else:
            y = a @ self.rows(lo, hi).T
        return y if self.bias is None else y + self.bias[lo:hi]
