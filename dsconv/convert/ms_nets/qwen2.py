"""Qwen2 / Qwen2.5: Llama with q/k/v biases (taken from the checkpoint) and per-layer sliding windows; with
`qk_norm` it is Qwen3 (per-head RMSNorm on q and k before rotary, explicit head_dim)."""
from __future__ import annotations

from dsconv.convert.ms_nets.build import causal_lm, decoder_layer, gqa_attention, layer_prefix, swiglu
from dsconv.convert.ms_nets.config import require_silu, sliding_windows

MODEL_TYPES = ("qwen2",)


def build(ws, cfg, progress=None, qk_norm: bool = False):
    require_silu(cfg, str(ws.ck.root / "config.json"))
    h = cfg.hidden_size

    def layer(i: int, mask_index: int):
        mlp = swiglu(ws, layer_prefix(i) + "mlp", h, cfg.intermediate_size)
        return decoder_layer(ws, cfg, i, gqa_attention(ws, cfg, i, mask_index, qk_norm=qk_norm), mlp)

    return causal_lm(ws, cfg, sliding_windows(cfg, all_layers_key=False), layer, progress)
