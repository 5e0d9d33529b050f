"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): softmax top-k experts plus a shared expert behind a sigmoid gate."""
from dsconv.families.base import LAYER, Family, cfg_get, register
from dsconv.families.rows import decoder, dense_mlp, experts, gqa_attention, router, swiglu
from dsconv.families.roles import Category

MOE_TINY = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
#: the config keys of Qwen's MoE layers (see Family.config_keys); num_experts None: num_local_experts, else none
# MindIE (both Qwen MoE model types route to its qwen2_moe model): attention reads its own region `attn_quantize`; when
# the key is absent a w8a8_dynamic model's attention is read as static w8a8 (atb_llm/models/qwen2/modeling_qwen2.py
# FlashQwenAttention.__init__, models/qwen2_moe/flash_causal_qwen2_moe.py), so dsconv always writes it
MINDIE_MOE_REGIONS = {"mindie": {"attn_quantize": ("attention",),
                                 "quantize": ("dense_mlp", "shared_experts", "routed_experts")}}
MINDIE_EXPLICIT = {"mindie": ("attn_quantize",)}
# MindIE's Qwen2MoeConfig reads num_experts (default 60: models/qwen2_moe/configuration_qwen2_moe.py); transformers 5
# writes num_local_experts for Qwen3-MoE
NUM_EXPERTS_ALIAS = {"num_experts": "num_local_experts"}
# MindIE's Qwen-MoE layers build only these MLP packs (AssertionError "mlp.pack_type: PackType.ALL_W4A8 not supported")
MINDIE_MOE_EXPERT_TYPES = (
    frozenset({"FLOAT", "W8A8", "W8A8_DYNAMIC", "W8A16", "W4A16"}),
    "its Qwen-MoE decoder layer builds W8A8, W8A8_DYNAMIC, W8A16 and W4A16 MLP packs only (AssertionError "
    "'mlp.pack_type: PackType.ALL_W4A8 not supported')",
    "MindIE-LLM atb/models/qwen2_moe/modeling_qwen2_moe.py::FlashQwenLayer.__init__")
MOE_KEYS = {"num_experts": None, "num_local_experts": None, "num_experts_per_tok": 0, "moe_intermediate_size": 0,
            "decoder_sparse_step": 1, "mlp_only_layers": ()}


def sparse_layers(c, n_layers):
    """Qwen-MoE's rule: MoE where (layer+1) % decoder_sparse_step == 0 and the layer is not in mlp_only_layers."""
    step = c["decoder_sparse_step"]
    dense = set(c["mlp_only_layers"])
    if not num_experts(c):
        return ()
    return tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)


def num_experts(c) -> int:
    """Hub configs say num_experts; transformers 5 writes num_local_experts for Qwen3-MoE."""
    return cfg_get(c, "num_experts", "num_local_experts", default=0)


def moe_facts(f, c):
    f.num_experts = num_experts(c)
    f.experts_per_tok = c["num_experts_per_tok"]
    f.moe_intermediate_size = c["moe_intermediate_size"]
    f.moe_layers = sparse_layers(c, f.num_layers)
    return f


#: Qwen's MoE block: a dense MLP where mlp_only_layers say, else the router, the experts and a shared expert behind a
#: sigmoid gate (Qwen2-MoE, Qwen3-Next)
QWEN_MOE_SHARED = (
    *dense_mlp(when="dense"), *router(), *experts(),
    *swiglu(module=LAYER + "mlp.shared_expert", category=Category.SHARED_EXPERTS, inter="shared_intermediate_size",
            key="shared", when="moe"),
    *router(module=LAYER + "mlp.shared_expert_gate", key="shared_gate", out=1, when="moe"))


@register
class Qwen2Moe(Family):
    name = "qwen2_moe"
    model_types = ("qwen2_moe",)
    table = decoder(attention=gqa_attention(), mlp=QWEN_MOE_SHARED)
    tiny = {**MOE_TINY, "shared_expert_intermediate_size": 48}
    config_keys = {**Family.config_keys, **MOE_KEYS, "shared_expert_intermediate_size": 0}
    engine_regions = MINDIE_MOE_REGIONS
    engine_explicit_keys = MINDIE_EXPLICIT
    engine_config_aliases = NUM_EXPERTS_ALIAS
    engine_kind_types = {"mindie": {"routed_experts": MINDIE_MOE_EXPERT_TYPES}}
    # MindIE hands its graph only the shared expert's weight tensors (no scales): it runs them in float
    engine_float_kinds = {"mindie": {"shared_experts": (
        "MindIE's Qwen2-MoE graph is given only the shared expert's gate_up/down weight tensors, no scale or offset, "
        "so a quantized shared expert would run its int8 weights as if float (make engine-check: the scales are "
        "not among the tensors handed to the ATB graph)",
        "MindIE-LLM atb/models/qwen2_moe/flash_causal_qwen2_moe.py::FlashQwen2moeForCausalLM.register_layer_weights")}}

    def _facts(self, c):
        f = moe_facts(super()._facts(c), c)
        f.shared_intermediate_size = c["shared_expert_intermediate_size"]
        f.qkv_bias = True
        return f
