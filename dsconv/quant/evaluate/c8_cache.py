"""`dsconv eval` of a C8 output: keys and values pass through the int8 cache as the engines store them.

vLLM-Ascend quantizes what it writes to the cache as `clamp(round(x / scale + offset), -128, 127)` per channel
(attention/attention_v1.py::AscendC8AttentionBackendImpl._quantize_kv) and attends to `(q - offset) * scale`; MindIE
the same with its per-channel quant/dequant ops. The simulation does both on every state transformers hands its
cache - a DynamicCache whose `update` fake-quantizes first - so every query attends to int8-rounded keys and values,
as every decode step does (a prefill kernel may use the float states of its own chunk: the figure is the decode
view, the conservative one).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsconv.quant.formats.msmodelslim import C8, description_types


def cache_scales(qck: Any) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """layer -> (k scale, k offset, v scale, v offset), float32 per channel, from a C8 output ({} otherwise)."""
    desc = qck.quant_description or {}
    if desc.get("kv_cache_type") != C8 and desc.get("kv_quant_type") != C8:
        return {}
    out: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in description_types(desc).items():  # tensors only: the globals say C8 too
        if t != C8:
            continue
        r = qck.role(name)
        out.setdefault(r.layer, {})[f"{r.slot}_{r.param}"] = qck.load(name).float()
    return {i: (p["k_kv_cache_scale"], p["k_kv_cache_offset"], p["v_kv_cache_scale"], p["v_kv_cache_offset"])
            for i, p in out.items()}


def fake_quant(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, seq, head_dim] through int8 per channel (channels heads-outermost, as stored)."""
    b, h, s, d = x.shape
    sc = scale.to(x.dtype).view(1, h, 1, d)
    off = offset.to(x.dtype).view(1, h, 1, d)
    q = torch.clamp(torch.round(x / sc + off), -128, 127)
    return (q - off) * sc


def install(model: nn.Module, scales: dict[int, tuple[torch.Tensor, ...]]) -> None:
    """Every forward of `model` runs with a cache that fake-quantizes what the attention stores."""
    from transformers import DynamicCache

    class C8Cache(DynamicCache):
        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
                   **kwargs: Any) -> Any:
            s = scales.get(layer_idx)
            if s is not None:
                key_states, value_states = fake_quant(key_states, s[0], s[1]), fake_quant(value_states, s[2], s[3])
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    forward = model.forward

    def with_cache(*args: Any, **kwargs: Any) -> Any:
        kwargs["cache"] = C8Cache(config=model.config)
        kwargs["use_cache"] = True
        return forward(*args, **kwargs)

    model.forward = with_cache  # type: ignore[method-assign]
