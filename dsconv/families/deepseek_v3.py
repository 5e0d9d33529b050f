"""DeepSeek-V3 / R1: MLA attention, sigmoid noaux_tc routing over 256 experts + 1 shared, MTP stored as layer 61,
FP8 block-scaled weights (see reference/deepseek_v3.md)."""
from __future__ import annotations

import math

from dsconv.families import register
from dsconv.families.base import (Family, ModelFacts, Rule, dense_mlp, expert_rules, llama_rules, router_rule,
                                  shared_expert_rules)
from dsconv.families.roles import Category, Role
from dsconv.tensors import TensorSpec

L = "model.layers.{L}."
MLA_RULES = {
    L + "self_attn.q_proj": Rule(Role.ATTN_IN, Category.ATTENTION, "q"),  # q_lora_rank null (V2-Lite style)
    L + "self_attn.q_a_proj": Rule(Role.ATTN_LATENT, Category.ATTENTION, "q_a"),
    L + "self_attn.q_a_layernorm": Rule(Role.NORM, Category.NORMS),
    L + "self_attn.q_b_proj": Rule(Role.ATTN_IN, Category.ATTENTION, "q_b"),
    L + "self_attn.kv_a_proj_with_mqa": Rule(Role.ATTN_LATENT, Category.ATTENTION, "kv_a"),
    L + "self_attn.kv_a_layernorm": Rule(Role.NORM, Category.NORMS),
    L + "self_attn.kv_b_proj": Rule(Role.ATTN_IN, Category.ATTENTION, "kv_b"),
    L + "self_attn.o_proj": Rule(Role.ATTN_OUT, Category.ATTENTION, "o"),
}
MTP_RULES = {  # the multi-token-prediction module's own tensors (layer index >= num_hidden_layers)
    L + "enorm": Rule(Role.NORM, Category.MTP),
    L + "hnorm": Rule(Role.NORM, Category.MTP),
    L + "eh_proj": Rule(Role.MTP_PROJ, Category.MTP),
    L + "embed_tokens": Rule(Role.EMBED, Category.MTP),
    L + "shared_head.norm": Rule(Role.NORM, Category.MTP),
    L + "shared_head.head": Rule(Role.LM_HEAD, Category.MTP),
}
BASE = {k: v for k, v in llama_rules().items() if ".self_attn." not in k}


@register
class DeepseekV3(Family):
    name = "deepseek_v3"
    model_types = ("deepseek_v3",)
    rules = {**BASE, **MLA_RULES, **router_rule(), **expert_rules(), **shared_expert_rules("mlp.shared_experts"),
             **MTP_RULES}

    def _facts(self, c) -> ModelFacts:
        f = super()._facts(c)
        f.q_lora_rank = c.get("q_lora_rank")
        f.kv_lora_rank = c["kv_lora_rank"]
        f.qk_rope_head_dim = c["qk_rope_head_dim"]
        f.qk_nope_head_dim = c["qk_nope_head_dim"]
        f.head_dim = f.qk_nope_head_dim + f.qk_rope_head_dim
        f.v_head_dim = c["v_head_dim"]
        f.num_kv_heads = f.num_heads  # MLA decompresses to one K/V per head; the cache holds the latent
        f.num_experts = c.get("n_routed_experts") or 0
        f.experts_per_tok = c.get("num_experts_per_tok") or 0
        f.moe_intermediate_size = c.get("moe_intermediate_size") or 0
        f.shared_intermediate_size = f.moe_intermediate_size * (c.get("n_shared_experts") or 0)
        first_dense, freq = c.get("first_k_dense_replace", 0), c.get("moe_layer_freq", 1) or 1
        total = f.num_layers + (c.get("num_nextn_predict_layers") or 0)
        f.moe_layers = tuple(i for i in range(total) if f.num_experts and i >= first_dense and i % freq == 0)
        f.num_mtp_layers = c.get("num_nextn_predict_layers") or 0
        f.extra["noaux_tc"] = c.get("topk_method", "noaux_tc") == "noaux_tc"
        q = c.get("quantization_config") or {}
        if q.get("quant_method") == "fp8":
            f.fp8_block = tuple(q.get("weight_block_size") or (128, 128))
        return f

    def iter_shapes(self, f: ModelFacts):
        yield from super().iter_shapes(f)
        h = f.hidden_size
        for layer in range(f.num_layers, f.num_layers + f.num_mtp_layers):
            p = f"model.layers.{layer}."
            yield p + "embed_tokens.weight", (f.vocab_size, h)
            yield p + "enorm.weight", (h,)
            yield p + "hnorm.weight", (h,)
            yield p + "eh_proj.weight", (h, 2 * h)
            yield p + "input_layernorm.weight", (h,)
            yield p + "post_attention_layernorm.weight", (h,)
            for name, shape in self.attention_shapes(f, layer):
                yield p + name, shape
            for name, shape in self.mlp_shapes(f, layer):
                yield p + name, shape
            yield p + "shared_head.norm.weight", (h,)
            yield p + "shared_head.head.weight", (f.vocab_size, h)

    def attention_shapes(self, f: ModelFacts, layer: int):
        h, heads = f.hidden_size, f.num_heads
        if f.q_lora_rank:
            yield "self_attn.q_a_proj.weight", (f.q_lora_rank, h)
            yield "self_attn.q_a_layernorm.weight", (f.q_lora_rank,)
            yield "self_attn.q_b_proj.weight", (heads * f.head_dim, f.q_lora_rank)
        else:
            yield "self_attn.q_proj.weight", (heads * f.head_dim, h)
        yield "self_attn.kv_a_proj_with_mqa.weight", (f.kv_lora_rank + f.qk_rope_head_dim, h)
        yield "self_attn.kv_a_layernorm.weight", (f.kv_lora_rank,)
        yield "self_attn.kv_b_proj.weight", (heads * (f.qk_nope_head_dim + f.v_head_dim), f.kv_lora_rank)
        yield "self_attn.o_proj.weight", (h, heads * f.v_head_dim)

    def mlp_shapes(self, f: ModelFacts, layer: int):
        if layer not in f.moe_layers:
            yield from super().mlp_shapes(f, layer)
            return
        yield "mlp.gate.weight", (f.num_experts, f.hidden_size)
        if f.extra.get("noaux_tc"):
            yield "mlp.gate.e_score_correction_bias", (f.num_experts,)
        for e in range(f.num_experts):
            yield from dense_mlp(f"mlp.experts.{e}", f.hidden_size, f.moe_intermediate_size)
        if f.shared_intermediate_size:
            yield from dense_mlp("mlp.shared_experts", f.hidden_size, f.shared_intermediate_size)

    def synthesize(self, config) -> list[TensorSpec]:
        """As the published checkpoint: FP8 linear weights each followed by a float32 `weight_scale_inv`."""
        f = self.facts(config)
        out: list[TensorSpec] = []
        for name, shape in self.iter_shapes(f):
            if name.endswith("e_score_correction_bias"):
                out.append(TensorSpec(name, "F32", shape))
                continue
            role = self.classify(name, f).role
            if f.fp8_block and role.quantized_by_default and name.endswith(".weight"):
                out.append(TensorSpec(name, "F8_E4M3", shape))
                br, bc = f.fp8_block
                out.append(TensorSpec(name + "_scale_inv", "F32",
                                      (math.ceil(shape[0] / br), math.ceil(shape[1] / bc))))
            else:
                out.append(TensorSpec(name, f.dtype, shape))
        return out
