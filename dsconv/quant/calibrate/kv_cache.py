"""The C8 cache scales from calibration: the keys and values a layer's attention would cache, as it caches them.

msModelSlim takes them where transformers hands them to the cache (`DynamicCache.update`, after rope and any k_norm;
MS processor/quant/attention.py), per channel over every KV head, and so does this: `KVCacheStats` is passed to the
decoder layer as its `cache`, so the attention calls `update(key_states, value_states, ...)` with exactly the
states a serving engine would write to its int8 cache; it keeps each channel's max |x| over the real (unpadded)
tokens and hands the states back unchanged (there is no cache: each batch attends to itself, as without one).
Max is order-free, so the forward jobs' partial statistics merge exactly (`merge`).

Scales are symmetric, as msModelSlim's `int8_per_channel_sym`: absmax / 127, offset 0; rounded up onto the model
dtype's grid (`schemes.usable_scale`), because vLLM-Ascend holds them in a parameter of the model dtype
(kv_c8.py::AscendC8KVCacheAttentionMethod.create_weights), so the stored float32 is the number the engine uses.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dsconv.errors import UserError
from dsconv.quant.algorithms.schemes import symmetric_scale
from dsconv.quant.calibrate.hooks import RowMask
from dsconv.quant.plan.kv_cache import OFFSET, SCALE, KVLayer


class KVCacheStats:
    """A stand-in for transformers' Cache during a statistics pass: per-channel max |key| and |value| of the states
    the attention would cache, real tokens only."""

    def __init__(self, rows: RowMask) -> None:
        self.rows = rows
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.tokens = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int | None = None,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._channels(key_states), self._channels(value_states)
        self.k = _max(self.k, k)
        self.v = _max(self.v, v)
        self.tokens += int(self.rows.count if self.rows.rows is None else self.rows.rows.sum())
        return key_states, value_states

    def _channels(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, heads, seq, head_dim] -> per channel (heads outermost, as k_proj writes its rows) max |x|."""
        b, h, s, d = x.shape
        flat = self.rows.apply(x.detach().transpose(1, 2).reshape(b * s, h * d), "the attention's cache states")
        return flat.abs().amax(dim=0).float() if flat.shape[0] else torch.zeros(h * d)

    def merge(self, other: "KVCacheStats | tuple | None") -> None:
        """Fold another pass's (or a job's `partial()`) maxima into these."""
        if other is None:
            return
        k, v, tokens = other.partial() if isinstance(other, KVCacheStats) else other
        self.k, self.v = _max(self.k, k), _max(self.v, v)
        self.tokens += tokens

    def partial(self) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """What a forward job returns: (key maxima, value maxima, tokens)."""
        return self.k, self.v, self.tokens

    def tensors(self, kv: KVLayer) -> dict[str, torch.Tensor]:
        """The layer's four C8 tensors: float32 scales absmax/127 on the model dtype's grid, zero offsets."""
        if self.k is None or self.v is None:
            raise UserError(f"layer {kv.layer}: the attention never handed keys and values to the cache, so "
                            "--kv-cache int8 has nothing to calibrate", hint="drop --kv-cache for this model")
        out = {}
        for module, absmax, width in ((kv.k_module, self.k, kv.k_width), (kv.v_module, self.v, kv.v_width)):
            if absmax.numel() != width:
                raise UserError(f"layer {kv.layer}: the cache receives {absmax.numel()} channels from {module}, "
                                f"which writes {width}", hint="this model's attention caches another form; drop "
                                "--kv-cache")
            scale = symmetric_scale(absmax.numpy(), 8, f"{module} cache states")
            out[f"{module}.{SCALE}"] = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32))
            out[f"{module}.{OFFSET}"] = torch.zeros(width, dtype=torch.float32)
        return out


def _max(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else torch.maximum(a, b)
