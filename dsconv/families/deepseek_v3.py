"""DeepSeek-V3 / R1: MLA attention, sigmoid noaux_tc routing over 256 experts + 1 shared, MTP stored as layer 61,
FP8 block-scaled weights (see docs/formats.md)."""
from dsconv.families.base import (REQUIRED, L, T, Family, dense_mlp, experts, linear, norm, router, swiglu)
from dsconv.families.roles import Category, Role

A, ATT, LAT = L + "self_attn.", Category.ATTENTION, Role.ATTN_LATENT
MLA = (
    *linear("attn.q_a", A + "q_a_proj", LAT, ATT, "q_lora_rank", "hidden_size", "q_a", "q_lora"),
    *norm("attn.q_a_norm", A + "q_a_layernorm", "q_lora_rank", when="q_lora"),
    *linear("attn.q_b", A + "q_b_proj", Role.ATTN_IN, ATT, "q_size", "q_lora_rank", "q_b", "q_lora"),
    *linear("attn.q", A + "q_proj", Role.ATTN_IN, ATT, "q_size", "hidden_size", "q", "no_q_lora"),  # V2-Lite style
    *linear("attn.kv_a", A + "kv_a_proj_with_mqa", LAT, ATT, "kv_a_size", "hidden_size", "kv_a"),
    *norm("attn.kv_a_norm", A + "kv_a_layernorm", "kv_lora_rank"),
    *linear("attn.kv_b", A + "kv_b_proj", Role.ATTN_IN, ATT, "kv_b_size", "kv_lora_rank", "kv_b"),
    *linear("attn.o", A + "o_proj", Role.ATTN_OUT, ATT, "hidden_size", "attn_out_size", "o"),
)
MOE = (
    *dense_mlp("dense"), *router(),
    T("router.bias", L + "mlp.gate.e_score_correction_bias", Role.ROUTER, Category.ROUTER, ("num_experts",),
      when="noaux_tc", dtype="F32"),
    *experts(),
    *swiglu(L + "mlp.shared_experts", Category.SHARED_EXPERTS, "shared_intermediate_size", "shared", "shared"),
)
M = Category.MTP  # the multi-token-prediction module's own tensors (layer index >= num_hidden_layers)
MTP_IN = (
    *linear("mtp.embed", L + "embed_tokens", Role.EMBED, M, "vocab_size", "hidden_size", when="mtp"),
    *norm("mtp.enorm", L + "enorm", category=M, when="mtp"), *norm("mtp.hnorm", L + "hnorm", category=M, when="mtp"),
    *linear("mtp.eh_proj", L + "eh_proj", Role.MTP_PROJ, M, "hidden_size", "mtp_in_size", when="mtp"),
)
MTP_OUT = (*norm("mtp.norm", L + "shared_head.norm", category=M, when="mtp"),
           *linear("mtp.head", L + "shared_head.head", Role.LM_HEAD, M, "vocab_size", "hidden_size", when="mtp"))


class DeepseekV3(Family):
    name = "deepseek_v3"
    config_keys = {**Family.config_keys, "kv_lora_rank": REQUIRED, "qk_rope_head_dim": REQUIRED,
                   "qk_nope_head_dim": REQUIRED, "v_head_dim": REQUIRED, "q_lora_rank": None, "n_routed_experts": 0,
                   "num_experts_per_tok": 0, "moe_intermediate_size": 0, "n_shared_experts": 0,
                   "first_k_dense_replace": 0, "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
                   "topk_method": "noaux_tc", "quantization_config": None}
    model_types = ("deepseek_v3",)
    # transformers' DeepseekV3 always routes with sigmoid scores and the correction bias (noaux_tc); its saved
    # config omits both keys, and vLLM then builds softmax routing without the bias parameter
    # (vllm/model_executor/models/deepseek_v2.py: getattr(config, "topk_method", None) == "noaux_tc",
    # getattr(config, "scoring_func", "softmax"))
    engine_config_defaults = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    # MindIE-LLM atb_llm/utils/layers/attention/process_mla_linear.py::preprocess_linear_for_rope
    rope_permuted_slots = ("q_b", "q", "kv_a")
    # Ascend's own recipe for both engines: MLA static W8A8, dense MLP / shared / routed experts W8A8_DYNAMIC
    # (MindIE-LLM examples/atb_models/examples/models/deepseek-v3/README.md "W8A8 mixed"; msModelSlim's DeepSeek
    # W8A8 script)
    bits8_recipe = {"attention": "W8A8", "dense_mlp": "W8A8_DYNAMIC", "shared_experts": "W8A8_DYNAMIC",
                    "routed_experts": "W8A8_DYNAMIC"}
    # MindIE: mla_quantize (attention, default = quantize), moe_quantize (routed experts, default = quantize);
    # dense MLP and shared experts read quantize
    engine_regions = {"mindie": {"mla_quantize": ("attention", "kv_b"), "quantize": ("dense_mlp", "shared_experts"),
                                 "moe_quantize": ("routed_experts",)}}
    offline_sharded = {"mindie": (
        "MindIE loads DeepSeek-V3/R1 from per-rank folders when model_sharded_metadata.json exists",
        "MindIE-LLM atb/utils/weights.py::Weights.__init__; atb/models/base/model_utils.py::BaseModel.save_sharded")}
    # ep_level 1 (AllGather EP) runs on any interconnect; 2 (AllToAll) needs a switch between servers
    mindie_ep_section = "deepseekv2"
    # small enough that the sigmoid scores do not saturate at 1.0, where fp16 cannot tell experts apart
    tiny_router_std = 0.15
    table = (
        *linear("embed", "model.embed_tokens", Role.EMBED, Category.EMBEDDING, "vocab_size", "hidden_size"),
        *MTP_IN, *norm("norm.input", L + "input_layernorm"), *norm("norm.post", L + "post_attention_layernorm"),
        *MLA, *MOE, *MTP_OUT,
        *norm("norm.final", "model.norm"),
        *linear("lm_head", "lm_head", Role.LM_HEAD, Category.LM_HEAD, "vocab_size", "hidden_size", when="untied"),
    )
    tiny = {"num_hidden_layers": 3, "num_key_value_heads": 4, "first_k_dense_replace": 1, "n_routed_experts": 16,
            "n_shared_experts": 1, "num_experts_per_tok": 4, "moe_intermediate_size": 32, "n_group": 4,
            "topk_group": 2, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
            "v_head_dim": 16, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "num_nextn_predict_layers": 0}

    def _facts(self, c):
        f = super()._facts(c)
        f.q_lora_rank = c["q_lora_rank"]
        f.kv_lora_rank = c["kv_lora_rank"]
        f.qk_rope_head_dim = c["qk_rope_head_dim"]
        f.qk_nope_head_dim = c["qk_nope_head_dim"]
        f.head_dim = f.qk_nope_head_dim + f.qk_rope_head_dim
        f.v_head_dim = c["v_head_dim"]
        f.num_kv_heads = f.num_heads  # MLA decompresses to one K/V per head; the cache holds the latent
        f.num_experts = c["n_routed_experts"]
        f.experts_per_tok = c["num_experts_per_tok"]
        f.moe_intermediate_size = c["moe_intermediate_size"]
        f.shared_intermediate_size = f.moe_intermediate_size * c["n_shared_experts"]
        first_dense, freq = c["first_k_dense_replace"], c["moe_layer_freq"]
        total = f.num_layers + c["num_nextn_predict_layers"]
        f.moe_layers = tuple(i for i in range(total) if f.num_experts and i >= first_dense and i % freq == 0)
        f.num_mtp_layers = c["num_nextn_predict_layers"]
        f.router = "sigmoid_group" if c["topk_method"] == "noaux_tc" else "softmax"
        f.extra["noaux_tc"] = f.router == "sigmoid_group"
        q = c["quantization_config"] or {}
        if q.get("quant_method") == "fp8":
            f.fp8_block = tuple(q.get("weight_block_size") or (128, 128))
        return f
