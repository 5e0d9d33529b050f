"""DeepSeek-V3 / R1: MLA attention, sigmoid noaux_tc routing over 256 experts + 1 shared, MTP stored as layer 61,
FP8 block-scaled weights (see docs/formats.md)."""
from dsconv.families.base import LAYER, REQUIRED, Family, TensorRow, register
from dsconv.families.rows import (SELF_ATTN, dense_mlp, embedding, experts, final_norm_and_head, layer_norms, linear,
                                  mtp_block, norm, router, swiglu)
from dsconv.families.roles import OTHER_PARAMS, Category, Role

ATTENTION = Category.ATTENTION
MLA = (
    *linear(key="attn.q_a", module=SELF_ATTN + "q_a_proj", role=Role.ATTN_LATENT, category=ATTENTION,
            shape=("q_lora_rank", "hidden_size"), slot="q_a", when="q_lora"),
    *norm(key="attn.q_a_norm", module=SELF_ATTN + "q_a_layernorm", size="q_lora_rank", when="q_lora"),
    *linear(key="attn.q_b", module=SELF_ATTN + "q_b_proj", role=Role.ATTN_IN, category=ATTENTION,
            shape=("q_size", "q_lora_rank"), slot="q_b", when="q_lora"),
    *linear(key="attn.q", module=SELF_ATTN + "q_proj", role=Role.ATTN_IN, category=ATTENTION,  # V2-Lite style
            shape=("q_size", "hidden_size"), slot="q", when="no_q_lora"),
    *linear(key="attn.kv_a", module=SELF_ATTN + "kv_a_proj_with_mqa", role=Role.ATTN_LATENT, category=ATTENTION,
            shape=("kv_a_size", "hidden_size"), slot="kv_a"),
    # its output is the latent MLA caches (what FA quant's fa_k / fa_v measure)
    *norm(key="attn.kv_a_norm", module=SELF_ATTN + "kv_a_layernorm", size="kv_lora_rank", slot="kv_a_norm"),
    *linear(key="attn.kv_b", module=SELF_ATTN + "kv_b_proj", role=Role.ATTN_IN, category=ATTENTION,
            shape=("kv_b_size", "kv_lora_rank"), slot="kv_b"),
    *linear(key="attn.o", module=SELF_ATTN + "o_proj", role=Role.ATTN_OUT, category=ATTENTION,
            shape=("hidden_size", "attn_out_size"), slot="o"),
)
# FA quant (`quantize --kv-cache int8`, docs/formats/kv_cache_c8.md): the int8 latent cache's scales under the
# attention; fa_q per head (split with the heads by TP), fa_k / fa_v one for the latent (replicated)
FA_QUANT = tuple(
    TensorRow(key=f"attn.{m}.{p}", name=SELF_ATTN + f"{m}.{p}", role=role, category=ATTENTION, shape=(heads, 1),
              slot=m, when="quantized_output", dtype=dtype)
    for m, role, heads in (("fa_q", Role.ATTN_IN, "num_heads"), ("fa_k", Role.ATTN_LATENT, 1),
                           ("fa_v", Role.ATTN_LATENT, 1))
    for p, dtype in (("scale", "F32"), ("offset", "I8")))
#: DeepSeek-V3's MoE block (also GLM-4.5's): dense MLP in the first layers, router with its correction bias, routed
#: experts, shared experts
DEEPSEEK_MOE = (
    *dense_mlp(when="dense"), *router(),
    TensorRow(key="router.bias", name=LAYER + "mlp.gate.e_score_correction_bias", role=Role.ROUTER,
              category=Category.ROUTER, shape=("num_experts",), when="noaux_tc", dtype="F32"),
    *experts(),
    *swiglu(module=LAYER + "mlp.shared_experts", category=Category.SHARED_EXPERTS, inter="shared_intermediate_size",
            key="shared", when="shared"),
)
MTP_IN, MTP_OUT = mtp_block()
#: the config keys of DeepSeek-style MoE layers (DeepSeek-V3, GLM-4.5): routed + shared experts after the first dense
#: layers, sigmoid top-k routing with a correction bias, MTP layers stored after the decoder layers
DEEPSEEK_MOE_KEYS = {"n_routed_experts": 0, "num_experts_per_tok": 0, "moe_intermediate_size": 0,
                     "n_shared_experts": 0, "first_k_dense_replace": 0, "moe_layer_freq": 1,
                     "num_nextn_predict_layers": 0, "topk_method": "noaux_tc"}


def deepseek_moe_facts(f, c):
    """Experts, MoE layers (MTP layers included: they are MoE layers too), routing and MTP count."""
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
    return f


@register
class DeepseekV3(Family):
    name = "deepseek_v3"
    config_keys = {**Family.config_keys, "kv_lora_rank": REQUIRED, "qk_rope_head_dim": REQUIRED,
                   "qk_nope_head_dim": REQUIRED, "v_head_dim": REQUIRED, "q_lora_rank": None, **DEEPSEEK_MOE_KEYS,
                   "quantization_config": None}
    model_types = ("deepseek_v3",)
    # --kv-cache int8 is FA quant here (MindIE fa3.py::FA3.load_mla; vLLM-Ascend patch_weight_utils.py remaps it)
    kv_int8_engines = {"mindie": ("deepseek_v3",), "vllm-ascend": ("deepseek_v3",)}
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
    # MindIE builds DeepSeek's shared experts after looking their type up in its weight loader's type list, which
    # has no weight-only type (KeyError 'W8A16' / 'W4A16')
    engine_kind_types = {"mindie": {"shared_experts": (
        frozenset({"FLOAT", "W8A8", "W8A8_DYNAMIC", "W4A8_DYNAMIC"}),
        "DeepSeek's shared experts are built after their type is looked up in the weight loader's type list "
        "(FLOAT16, BFLOAT16, W8A8, W8A8_DYNAMIC, W8A8_MIX, W4A8_DYNAMIC): a weight-only type is a KeyError",
        "MindIE-LLM atb/models/deepseek/modeling_deepseek.py::DeepseekMoE.__init__; atb/utils/loader/"
        "weight_loader.py::get_linear_quant_type; atb/layers/__init__.py::QuantTypeV3")}}
    offline_sharded = {"mindie": (
        "MindIE loads DeepSeek-V3/R1 from per-rank folders when model_sharded_metadata.json exists",
        "MindIE-LLM atb/utils/weights.py::Weights.__init__; atb/models/base/model_utils.py::BaseModel.save_sharded")}
    # ep_level 1 (AllGather EP) runs on any interconnect; 2 (AllToAll) needs a switch between servers
    mindie_ep_section = "deepseekv2"
    # small enough that the sigmoid scores do not saturate at 1.0, where fp16 cannot tell experts apart
    tiny_router_std = 0.15
    table = (*embedding(), *MTP_IN, *layer_norms(), *MLA, *FA_QUANT, *DEEPSEEK_MOE, *MTP_OUT, *final_norm_and_head())
    other_params = (*OTHER_PARAMS, "scale", "offset")  # FA_QUANT's
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
        deepseek_moe_facts(f, c)
        q = c["quantization_config"] or {}
        if q.get("quant_method") == "fp8":
            f.fp8_block = tuple(q.get("weight_block_size") or (128, 128))
        return f
