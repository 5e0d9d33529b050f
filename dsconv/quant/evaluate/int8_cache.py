"""`dsconv eval` of an output with an int8 KV cache (`--kv-cache int8`): what the cache holds passes through int8 as
the engines store it.

C8 (GQA): vLLM-Ascend quantizes what it writes to the cache as `clamp(round(x / scale + offset), -128, 127)` per
channel (attention/attention_v1.py::AscendC8AttentionBackendImpl._quantize_kv) and attends to `(q - offset) * scale`;
MindIE the same with its per-channel quant/dequant ops. The simulation does both on every state transformers hands
its cache - a DynamicCache whose `update` fake-quantizes first.

FA quant (DeepSeek MLA): the latent (kv_a_layernorm's output) is cached in int8 with fa_k's scale and read back with
it for keys and values alike (MindIE fa3.py: fa3_v_scale is fa_k's; vLLM-Ascend kv_c8.py uses fa_k only); the
simulation rounds the latent norm's output. The query's own int8 step (fa_q, after absorption) is not simulated:
transformers' attention does not absorb, and the absorbed query has no preimage to round through.

Every query then attends to int8-rounded keys and values, as every decode step does (a prefill kernel may use the
float states of its own chunk: the figure is the decode view, the conservative one).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsconv.qformat import FA_QUANT, cache_form, cache_tensors  # noqa: F401  (cache_form: read here by eval)


def cache_scales(qck: Any) -> dict[int, dict[str, torch.Tensor]]:
    """layer -> {"k_kv_cache_scale" | "fa_k_scale" ...: float32 tensor} of an int8-cache output ({} if none)."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for name in sorted(cache_tensors(qck.quant_description)):
        r = qck.role(name)
        out.setdefault(r.layer, {})[f"{r.slot}_{r.param}"] = qck.load(name).float()
    return out


def fake_quant(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, seq, head_dim] through int8 per channel (channels heads-outermost, as stored)."""
    b, h, s, d = x.shape
    sc = scale.to(x.dtype).view(1, h, 1, d)
    off = offset.to(x.dtype).view(1, h, 1, d)
    q = torch.clamp(torch.round(x / sc + off), -128, 127)
    return (q - off) * sc


def c8_states(scales: dict[int, dict[str, torch.Tensor]], layer: int | None, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s keys and values as the C8 cache holds them (unchanged for a layer without cache scales)."""
    s = scales.get(layer)
    if s is None:
        return k, v
    return (fake_quant(k, s["k_kv_cache_scale"], s["k_kv_cache_offset"]),
            fake_quant(v, s["v_kv_cache_scale"], s["v_kv_cache_offset"]))


def install(model: nn.Module, sk: Any, form: str, scales: dict[int, dict[str, torch.Tensor]]) -> None:
    """Every forward of `model` runs with its cache through int8 (C8: a fake-quantizing cache; FA quant: the latent
    norm's output rounded)."""
    if form == FA_QUANT:
        for i in scales:
            fa_round(sk, i, scales)
        return
    forward = model.forward

    def with_cache(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cache") is None and kwargs.get("past_key_values") is None:  # a caller's cache is its own
            kwargs["cache"] = new_cache(model.config, form, scales)
            kwargs["use_cache"] = True
        return forward(*args, **kwargs)

    model.forward = with_cache  # type: ignore[method-assign]


def new_cache(config: Any, form: str | None, scales: dict[int, dict[str, torch.Tensor]]) -> Any:
    """A cache for one forward or one generation: C8 fake-quantizes every state it is handed before it stores it
    (so decoding attends to int8-rounded keys and values, as the engines' decode does); else a plain DynamicCache
    (FA quant rounds the latent norm's output instead: `install`)."""
    from transformers import DynamicCache

    if form is None or form == FA_QUANT:
        return DynamicCache(config=config)

    class C8Cache(DynamicCache):
        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
                   **kwargs: Any) -> Any:
            key_states, value_states = c8_states(scales, layer_idx, key_states, value_states)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return C8Cache(config=config)


def fa_round(sk: Any, layer: int, scales: dict[int, dict[str, torch.Tensor]]) -> Any:
    """FA quant: layer `layer`'s latent (its MLA latent norm's output) rounded through int8 with fa_k's scale, as the
    cache holds it. Returns the hook's handle."""
    scale = float(scales[layer]["fa_k_scale"].reshape(-1)[0])
    return _latent_norm(sk, layer).register_forward_hook(
        lambda mod, args, out: torch.clamp(torch.round(out / scale), -128, 127) * scale)


def _latent_norm(sk: Any, layer: int) -> nn.Module:
    """Layer `layer`'s MLA latent norm, found by its role (slot kv_a_norm), not by its name."""
    for mod, name in sk.module_names.items():
        ck_name = sk.ck_name(name + ".weight")
        if ck_name in sk.ck and sk.ck.role(ck_name).slot == "kv_a_norm" and sk.ck.role(ck_name).layer == layer:
            return mod
    raise KeyError(f"layer {layer} has no MLA latent norm")
