"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3 attention (q/k norm), softmax top-k experts, no shared expert."""
from __future__ import annotations

from dsconv.convert.ms_nets.blocks import SoftmaxTopKRouter, SparseMoE
from dsconv.convert.ms_nets.build import (causal_lm, decoder_layer, dense_experts, gqa_attention, layer_prefix,
                                          swiglu)
from dsconv.convert.ms_nets.config import require_silu, sliding_windows

MODEL_TYPES = ("qwen3_moe",)


def build(ws, cfg, progress=None):
    require_silu(cfg, str(ws.ck.root / "config.json"))
    h, n_exp = cfg.hidden_size, cfg.num_experts
    moe_layers = set(ws.ck.facts.moe_layers)

    def layer(i: int, mask_index: int):
        p = layer_prefix(i) + "mlp"
        if i not in moe_layers:
            mlp = swiglu(ws, p, h, cfg.intermediate_size)
        else:
            router = SoftmaxTopKRouter(ws.float_param(p + ".gate.weight", (n_exp, h), fp32=True),
                                       cfg.num_experts_per_tok, cfg.norm_topk_prob)
            mlp = SparseMoE(router, dense_experts(ws, i, n_exp, h, cfg.moe_intermediate_size), h, ws.compute)
        return decoder_layer(ws, cfg, i, gqa_attention(ws, cfg, i, mask_index, qk_norm=True), mlp)

    return causal_lm(ws, cfg, sliding_windows(cfg, all_layers_key=True), layer, progress)
