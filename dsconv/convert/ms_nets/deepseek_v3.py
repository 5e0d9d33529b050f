"""DeepSeek-V3 / R1 (and V2-style configs without q_lora): Multi-head Latent Attention, `noaux_tc` group-limited
sigmoid routing with shared experts, the first `first_k_dense_replace` layers dense; as transformers 5 computes it
(interleaved rotary pairs on the rope part, yarn tables with mscale, softmax scale times mscale_all_dim^2).
MTP layers (stored as layer num_hidden_layers) are not part of the exported model, as in transformers."""
from __future__ import annotations

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from dsconv.convert.ms_nets.blocks import (GroupLimitedSigmoidRouter, Linear, RMSNorm, SparseMoE, apply_rope,
                                           apply_rope_interleaved, attend)
from dsconv.convert.ms_nets.build import (causal_lm, decoder_layer, dense_experts, layer_prefix, norm, swiglu)
from dsconv.convert.ms_nets.config import require_silu, yarn_softmax_scale

MODEL_TYPES = ("deepseek_v3",)
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use RMSNorm's default eps in transformers, not rms_norm_eps


class MLAttention(nn.Cell):
    """q = q_b(norm(q_a(x))) (or q_proj(x)); latent kv = norm(kv_a(x)[:r]), shared rope key kv_a(x)[r:];
    k/v per head from kv_b(latent); rotary on the rope parts only."""

    def __init__(self, q_proj: Linear | None, q_a: Linear | None, q_a_norm: RMSNorm | None, q_b: Linear | None,
                 kv_a: Linear, kv_a_norm: RMSNorm, kv_b: Linear, o: Linear, heads: int, nope: int, rope: int,
                 v_dim: int, kv_lora_rank: int, scaling: float, interleave: bool, mask_index: int) -> None:
        super().__init__()
        self.has_q_lora = q_proj is None
        if self.has_q_lora:
            self.q_a_proj, self.q_a_layernorm, self.q_b_proj = q_a, q_a_norm, q_b
        else:
            self.q_proj = q_proj
        self.kv_a_proj_with_mqa, self.kv_a_layernorm, self.kv_b_proj, self.o_proj = kv_a, kv_a_norm, kv_b, o
        self.heads, self.nope, self.rope, self.v_dim = int(heads), int(nope), int(rope), int(v_dim)
        self.rank = int(kv_lora_rank)
        self.scaling = float(scaling)
        self.interleave = bool(interleave)
        self.mask_index = int(mask_index)

    def construct(self, x, cos, sin, biases):
        b, s, _ = x.shape
        if self.has_q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.reshape(b, s, self.heads, self.nope + self.rope).transpose(0, 2, 1, 3)
        q_pass = q[..., :self.nope]
        q_rot = q[..., self.nope:]
        compressed = self.kv_a_proj_with_mqa(x)
        kv_latent = self.kv_a_layernorm(compressed[..., :self.rank])
        k_rot = compressed[..., self.rank:].reshape(b, 1, s, self.rope)
        cos = cos.expand_dims(1)
        sin = sin.expand_dims(1)
        if self.interleave:
            q_rot = apply_rope_interleaved(q_rot, cos, sin)
            k_rot = apply_rope_interleaved(k_rot, cos, sin)
        else:
            q_rot = apply_rope(q_rot, cos, sin)
            k_rot = apply_rope(k_rot, cos, sin)
        query = ops.cat((q_pass, q_rot), -1)
        kv = self.kv_b_proj(kv_latent).reshape(b, s, self.heads, self.nope + self.v_dim).transpose(0, 2, 1, 3)
        key = ops.cat((kv[..., :self.nope], ops.tile(k_rot, (1, self.heads, 1, 1))), -1)
        value = kv[..., self.nope:]
        out = attend(query, key, value, biases[self.mask_index], self.scaling)
        out = out.transpose(0, 2, 1, 3).reshape(b, s, self.heads * self.v_dim)
        return self.o_proj(out)


def mla(ws, cfg, layer: int, mask_index: int) -> MLAttention:
    p = layer_prefix(layer) + "self_attn."
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    nope, rope, v_dim, rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    qk = nope + rope
    q_proj = q_a = q_a_norm = q_b = None
    if cfg.q_lora_rank is None:
        q_proj = ws.linear(p + "q_proj", h, heads * qk)
    else:
        q_a = ws.linear(p + "q_a_proj", h, cfg.q_lora_rank)
        q_a_norm = norm(ws, p + "q_a_layernorm", cfg.q_lora_rank, LATENT_NORM_EPS)
        q_b = ws.linear(p + "q_b_proj", cfg.q_lora_rank, heads * qk)
    kv_a = ws.linear(p + "kv_a_proj_with_mqa", h, rank + rope)
    kv_a_norm = norm(ws, p + "kv_a_layernorm", rank, LATENT_NORM_EPS)
    kv_b = ws.linear(p + "kv_b_proj", rank, heads * (nope + v_dim))
    o = ws.linear(p + "o_proj", heads * v_dim, h)
    interleave = getattr(cfg, "rope_interleave", True)
    return MLAttention(q_proj, q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o, heads, nope, rope, v_dim, rank,
                       yarn_softmax_scale(cfg, qk), bool(interleave), mask_index)


def moe(ws, cfg, layer: int) -> SparseMoE:
    p = layer_prefix(layer) + "mlp"
    h, n_exp = cfg.hidden_size, cfg.n_routed_experts
    weight = ws.float_param(p + ".gate.weight", (n_exp, h), fp32=True)
    bias_name = p + ".gate.e_score_correction_bias"
    if ws.has(bias_name):
        bias = ws.float_param(bias_name, (n_exp,), fp32=True)
    else:  # transformers initialises the buffer to zeros when a checkpoint lacks it
        bias = Parameter(Tensor(np.zeros(n_exp, np.float32)), name=bias_name, requires_grad=False)
    router = GroupLimitedSigmoidRouter(weight, bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                                       cfg.norm_topk_prob, cfg.routed_scaling_factor)
    experts = dense_experts(ws, layer, n_exp, h, cfg.moe_intermediate_size)
    shared = None
    if cfg.n_shared_experts:
        shared = swiglu(ws, p + ".shared_experts", h, cfg.moe_intermediate_size * cfg.n_shared_experts)
    return SparseMoE(router, experts, h, ws.compute, shared=shared, shared_name="shared_experts")


def build(ws, cfg, progress=None):
    require_silu(cfg, str(ws.ck.root / "config.json"))
    moe_layers = set(ws.ck.facts.moe_layers)

    def layer(i: int, mask_index: int):
        if i in moe_layers:
            mlp = moe(ws, cfg, i)
        else:
            mlp = swiglu(ws, layer_prefix(i) + "mlp", cfg.hidden_size, cfg.intermediate_size)
        return decoder_layer(ws, cfg, i, mla(ws, cfg, i, mask_index), mlp)

    return causal_lm(ws, cfg, [0] * cfg.num_hidden_layers, layer, progress)
