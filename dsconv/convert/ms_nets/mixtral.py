"""Mixtral: every layer MoE (softmax top-k, always renormalised), experts w1/w3/w2 found through the family's roles,
router at `block_sparse_moe.gate`, optional sliding window on every layer."""
from __future__ import annotations

from dsconv.convert.ms_nets.blocks import SoftmaxTopKRouter, SparseMoE
from dsconv.convert.ms_nets.build import causal_lm, decoder_layer, dense_experts, gqa_attention, layer_prefix
from dsconv.convert.ms_nets.config import require_silu, sliding_windows

MODEL_TYPES = ("mixtral",)


def build(ws, cfg, progress=None):
    require_silu(cfg, str(ws.ck.root / "config.json"))
    h, n_exp = cfg.hidden_size, cfg.num_local_experts

    def layer(i: int, mask_index: int):
        p = layer_prefix(i) + "block_sparse_moe"
        router = SoftmaxTopKRouter(ws.float_param(p + ".gate.weight", (n_exp, h), fp32=True),
                                   cfg.num_experts_per_tok, norm_topk_prob=True)
        mlp = SparseMoE(router, dense_experts(ws, i, n_exp, h, cfg.intermediate_size), h, ws.compute)
        return decoder_layer(ws, cfg, i, gqa_attention(ws, cfg, i, mask_index), mlp, mlp_name="block_sparse_moe")

    return causal_lm(ws, cfg, sliding_windows(cfg, all_layers_key=True), layer, progress)
