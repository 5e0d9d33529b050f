"""GLM-4.5 / 4.6 (glm4_moe): GQA attention with partial rotary, optional q/k norms and q/k/v biases; the first
`first_k_dense_replace` layers dense, then DeepSeek-V3's MoE (sigmoid top-k routing with a correction bias, groups,
routed_scaling_factor, shared experts); `num_nextn_predict_layers` MTP layers stored after the decoder layers, which
share the main model's embedding and LM head."""
from dsconv.families.base import Family, register
from dsconv.families.rows import embedding, final_norm_and_head, gqa_attention, layer_norms, mtp_block, qk_norm
from dsconv.families.deepseek_v3 import DEEPSEEK_MOE, DEEPSEEK_MOE_KEYS, deepseek_moe_facts

MTP_IN, MTP_OUT = mtp_block()


@register
class Glm4Moe(Family):
    name = "glm4_moe"
    model_types = ("glm4_moe",)
    config_keys = {**Family.config_keys, **DEEPSEEK_MOE_KEYS, "use_qk_norm": False, "first_k_dense_replace": 1,
                   "n_shared_experts": 1, "num_nextn_predict_layers": 1}  # Glm4MoeConfig's defaults
    table = (*embedding(), *MTP_IN, *layer_norms(), *gqa_attention(), *qk_norm(when="qk_norm"), *DEEPSEEK_MOE,
             *MTP_OUT, *final_norm_and_head())
    # transformers' Glm4Moe routes with sigmoid scores and the correction bias, as DeepSeek-V3 (noaux_tc)
    engine_config_defaults = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    tiny_router_std = 0.15
    tiny = {"num_hidden_layers": 3, "head_dim": 16, "first_k_dense_replace": 1, "n_routed_experts": 16,
            "n_shared_experts": 1, "num_experts_per_tok": 4, "moe_intermediate_size": 32, "n_group": 4,
            "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "attention_bias": True,
            "use_qk_norm": True, "num_nextn_predict_layers": 0}

    def _facts(self, c):
        f = deepseek_moe_facts(super()._facts(c), c)
        f.qk_norm = c["use_qk_norm"]
        f.mtp_own_head = False
        return f
