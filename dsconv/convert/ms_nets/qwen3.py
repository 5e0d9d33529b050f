"""Qwen3: Llama with per-head RMSNorm on q and k (before rotary) and an explicit head_dim."""
from __future__ import annotations

from dsconv.convert.ms_nets.build import causal_lm, decoder_layer, gqa_attention, layer_prefix, swiglu
from dsconv.convert.ms_nets.config import require_silu, sliding_windows

MODEL_TYPES = ("qwen3",)


def build(ws, cfg, progress=None):
    require_silu(cfg, str(ws.ck.root / "config.json"))
    h = cfg.hidden_size

    def layer(i: int, mask_index: int):
        mlp = swiglu(ws, layer_prefix(i) + "mlp", h, cfg.intermediate_size)
        return decoder_layer(ws, cfg, i, gqa_attention(ws, cfg, i, mask_index, qk_norm=True), mlp)

    return causal_lm(ws, cfg, sliding_windows(cfg, all_layers_key=False), layer, progress)
