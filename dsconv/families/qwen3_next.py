"""Qwen3-Next (qwen3_next): hybrid layers. Three of every four run Gated DeltaNet linear attention (`linear_attn`:
one projection for q, k, v and the output gate z, one for the write strength b and the decay a, a causal depthwise
conv over q/k/v, A_log and dt_bias per value head, a gated RMSNorm, out_proj) and keep a constant-size recurrent
state per sequence instead of a KV cache (ModelFacts.state_bytes_per_sequence); the fourth runs full attention
whose q_proj also writes a sigmoid gate per head, with q/k norms and partial rotary. Every layer's MLP is Qwen's
MoE with a gated shared expert."""
from dsconv.families.base import LAYER, Family, TensorRow, register
from dsconv.families.rows import decoder, gqa_attention, linear, norm, qk_norm
from dsconv.families.qwen2_moe import MOE_KEYS, QWEN_MOE_SHARED, moe_facts
from dsconv.families.roles import OTHER_PARAMS, Category, Role

LIN = LAYER + "linear_attn."
ATTN = Category.ATTENTION
LINEAR_ATTENTION = (
    *linear(key="linear.qkvz", module=LIN + "in_proj_qkvz", role=Role.ATTN_IN, category=ATTN,
            shape=("linear_qkvz_size", "hidden_size"), slot="qkvz", when="linear_attention"),
    *linear(key="linear.ba", module=LIN + "in_proj_ba", role=Role.ATTN_IN, category=ATTN,
            shape=("linear_ba_size", "hidden_size"), slot="ba", when="linear_attention"),
    TensorRow(key="linear.conv1d", name=LIN + "conv1d.weight", role=Role.MIXER, category=ATTN,
              shape=("linear_qkv_size", 1, "linear_conv_kernel"), when="linear_attention"),
    TensorRow(key="linear.dt_bias", name=LIN + "dt_bias", role=Role.MIXER, category=ATTN,
              shape=("linear_v_heads",), when="linear_attention"),
    TensorRow(key="linear.A_log", name=LIN + "A_log", role=Role.MIXER, category=ATTN,
              shape=("linear_v_heads",), when="linear_attention"),
    *norm(key="linear.norm", module=LIN + "norm", size="linear_v_head_dim", when="linear_attention"),
    *linear(key="linear.out", module=LIN + "out_proj", role=Role.ATTN_OUT, category=ATTN,
            shape=("hidden_size", "linear_value_dim"), slot="out", when="linear_attention"),
)
#: an MTP block stored apart (`mtp_prefixes`): fc over [embedding; hidden], their two norms, its decoder layers
#: (mtp.layers.K.*, from the layer rows: Family.iter_shapes) and its final norm (vLLM qwen3_next_mtp.py)
MTP_BLOCK = (
    *linear(key="mtp.fc", module="mtp.fc", role=Role.MTP_PROJ, category=Category.MTP,
            shape=("hidden_size", "mtp_in_size"), when="mtp_block"),
    *(norm(key=f"mtp.{n}", module=f"mtp.{n}", category=Category.MTP, when="mtp_block")[0]
      for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")))
#: the keys of the linear-attention geometry (Qwen3NextConfig's defaults)
LINEAR_KEYS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
               "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "layer_types": None,
               "full_attention_interval": 4}


def linear_facts(f, c):
    """Layer kinds (config's layer_types, else every full_attention_interval-th layer full) and the DeltaNet
    geometry; full attention gates its output."""
    kinds = c["layer_types"] or ["full_attention" if (i + 1) % c["full_attention_interval"] == 0
                                 else "linear_attention" for i in range(f.num_layers)]
    f.layer_kinds = tuple(kinds[:f.num_layers])
    f.linear_k_heads, f.linear_v_heads = c["linear_num_key_heads"], c["linear_num_value_heads"]
    f.linear_k_head_dim, f.linear_v_head_dim = c["linear_key_head_dim"], c["linear_value_head_dim"]
    f.linear_conv_kernel = c["linear_conv_kernel_dim"]
    f.attn_output_gate = True
    return f


@register
class Qwen3Next(Family):
    name = "qwen3_next"
    model_types = ("qwen3_next",)
    table = decoder(attention=(*LINEAR_ATTENTION, *gqa_attention(qkv_bias=False, when="full_attention"),
                               *qk_norm(when="qk_norm")), mlp=QWEN_MOE_SHARED) + MTP_BLOCK
    other_params = (*OTHER_PARAMS, "A_log", "dt_bias")
    # the published checkpoint carries its MTP block as mtp.fc, mtp.pre_fc_norm_{embedding,hidden}, mtp.layers.0.* (a
    # full-attention MoE layer) and mtp.norm, which vLLM's Qwen3NextMTP loads as model.* (qwen3_next_mtp.py
    # load_weights); transformers builds none of it
    mtp_prefixes = ("mtp.",)
    # its RMSNorm multiplies by (1 + weight), as Gemma's (transformers' Qwen3NextRMSNorm; vLLM imports GemmaRMSNorm as
    # Qwen3NextRMSNorm): SmoothQuant scales the effective weight (the gated norm inside linear_attn is plain)
    norm_offset = 1.0
    engine_refused = {"mindie": (
        "its model router takes a model_type only where atb_llm/models/ has a folder of that name, and it has no "
        "qwen3_next folder (NotImplementedError 'unsupported model type: qwen3_next')",
        "MindIE-LLM atb_llm/models/__init__.py::get_model")}
    onnx_refused = mindir_refused = (
        "its linear-attention layers run the gated delta rule as a chunked scan whose within-chunk step solves a "
        "triangular system (torch.linalg.solve_triangular in transformers' torch_chunk_gated_delta_rule), which "
        "no ONNX opset (11..18) and no MindSpore block here expresses; the recurrent state it carries between "
        "chunks is no KV cache an ONNX graph could take either")
    config_keys = {**Family.config_keys, **MOE_KEYS, **LINEAR_KEYS, "shared_expert_intermediate_size": 0}
    # DeltaNet heads of 32: vLLM-Ascend pages the recurrent state and the KV cache together and needs the state
    # (4 x 32 x 32) to fill whole 128-token attention blocks (patch/platform/patch_mamba_config.py)
    tiny = {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 32, "linear_value_head_dim": 32, "layer_types": ["linear_attention",
                                                                                   "full_attention"]}

    def _facts(self, c):
        f = linear_facts(moe_facts(super()._facts(c), c), c)
        f.shared_intermediate_size = c["shared_expert_intermediate_size"]
        return f
