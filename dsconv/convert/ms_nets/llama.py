"""Llama (and Mistral, a Llama with a sliding window): GQA attention, SwiGLU MLP; biases when the config asks."""
from __future__ import annotations

from dsconv.convert.ms_nets.build import causal_lm, decoder_layer, gqa_attention, layer_prefix, swiglu
from dsconv.convert.ms_nets.config import require_silu, sliding_windows

MODEL_TYPES = ("llama", "mistral")


def build(ws, cfg, progress=None):
    require_silu(cfg, str(ws.ck.root / "config.json"))
    windows = sliding_windows(cfg, all_layers_key=cfg.model_type == "mistral")
    h = cfg.hidden_size

    def layer(i: int, mask_index: int):
        mlp = swiglu(ws, layer_prefix(i) + "mlp", h, cfg.intermediate_size)
        return decoder_layer(ws, cfg, i, gqa_attention(ws, cfg, i, mask_index), mlp)

    return causal_lm(ws, cfg, windows, layer, progress)
