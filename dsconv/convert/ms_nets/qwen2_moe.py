"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): softmax top-k experts plus a shared expert behind a sigmoid gate;
dense MLP layers where `mlp_only_layers`/`decoder_sparse_step` say so. Qwen3-MoE is the same network with q/k norm
and no shared expert."""
from __future__ import annotations

from dsconv.convert.ms_nets.blocks import SoftmaxTopKRouter, SparseMoE
from dsconv.convert.ms_nets.build import (causal_lm, decoder_layer, dense_experts, gqa_attention, layer_prefix,
                                          swiglu)
from dsconv.convert.ms_nets.config import require_silu, sliding_windows

MODEL_TYPES = ("qwen2_moe",)


def build(ws, cfg, progress=None, qk_norm: bool = False, shared_expert: bool = True):
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
            experts = dense_experts(ws, i, n_exp, h, cfg.moe_intermediate_size)
            if shared_expert:
                shared = swiglu(ws, p + ".shared_expert", h, cfg.shared_expert_intermediate_size)
                mlp = SparseMoE(router, experts, h, ws.compute, shared=shared,
                                shared_gate=ws.linear(p + ".shared_expert_gate", h, 1))
            else:
                mlp = SparseMoE(router, experts, h, ws.compute)
        return decoder_layer(ws, cfg, i, gqa_attention(ws, cfg, i, mask_index, qk_norm=qk_norm), mlp)

    return causal_lm(ws, cfg, sliding_windows(cfg, all_layers_key=qk_norm), layer, progress)
