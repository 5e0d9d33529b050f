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
    # transformers' Glm4Moe routes with sigmoid scores and the correction bias, as DeepSeek-V3 (noaux_tc); MindIE's
    # Glm4moeConfig takes rope_scaling as a required argument (TypeError without the key; null is fine:
    # atb_llm/models/glm4_moe/config_glm4_moe.py)
    engine_config_defaults = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "rope_scaling": None}
    # Ascend's recipe for both engines, as DeepSeek's: attention static W8A8 (MindIE's only quantized attention here),
    # every MLP W8A8_DYNAMIC
    bits8_recipe = {"attention": "W8A8", "dense_mlp": "W8A8_DYNAMIC", "shared_experts": "W8A8_DYNAMIC",
                    "routed_experts": "W8A8_DYNAMIC"}
    # MindIE reads attn_quantize for the attention and `quantize` for every MLP: its routed experts are registered
    # with `quantize`'s type whatever moe_quantize says (flash_causal_glm4_moe.py::get_weights; a moe_quantize other
    # than quantize fails in init_ascend_weight)
    engine_regions = {"mindie": {"attn_quantize": ("attention",),
                                 "quantize": ("dense_mlp", "shared_experts", "routed_experts")}}
    engine_explicit_keys = {"mindie": ("attn_quantize",)}
    # vLLM-Ascend maps C8 scale names for Glm4MoeForCausalLM (patch/worker/patch_gqa_c8.py): make engine-check
    kv_int8_engines = {"vllm-ascend": ("glm4_moe",)}
    engine_kind_types = {"mindie": {"attention": (
        frozenset({"FLOAT", "W8A8"}),
        "GLM-4.5's attention is registered with the static W8A8 layout whatever attn_quantize says (W8A8_DYNAMIC: "
        "AttributeError 'W8A8LinearDynamic' object has no attribute 'quant_bias'; W8A16 and W4A16 likewise fail in "
        "init_ascend_weight, make engine-check)",
        "MindIE-LLM atb_llm/models/glm4_moe/flash_causal_glm4_moe.py::FlashGlm4moeForCausalLM.get_weights "
        "(attn_quantize_type=_W8A8)")}}
    # MindIE builds layers range(num_hidden_layers) only: the MTP layer is never read there
    # (modeling_glm4_moe.py::Glm4moeModel.__init__); vLLM-Ascend's glm4_moe_mtp.py loads it
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
