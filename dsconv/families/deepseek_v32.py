"""DeepSeek-V3.2 (deepseek_v32): DeepSeek-V3 plus a lightning indexer in every layer's attention, which scores
the cached tokens for DeepSeek Sparse Attention: queries from the q latent (`wq_b`), one key per token from the
hidden state (`wk`, then a LayerNorm with a bias), a weight per indexer head (`weights_proj`). The indexer keeps
its own key cache (one index_head_dim key per token and layer, ModelFacts.indexer_bytes_per_token)."""
from dsconv.families.base import REQUIRED, TensorRow, register
from dsconv.families.rows import SELF_ATTN, embedding, final_norm_and_head, layer_norms, linear, norm
from dsconv.families.deepseek_v3 import DEEPSEEK_MOE, FA_QUANT, MLA, MTP_IN, MTP_OUT, DeepseekV3
from dsconv.families.roles import Category, Role

IDX = SELF_ATTN + "indexer."
INDEXER = (
    *linear(key="indexer.wq_b", module=IDX + "wq_b", role=Role.INDEXER, category=Category.INDEXER,
            shape=("index_q_size", "q_lora_rank")),
    *linear(key="indexer.wk", module=IDX + "wk", role=Role.INDEXER, category=Category.INDEXER,
            shape=("index_head_dim", "hidden_size")),
    *norm(key="indexer.k_norm", module=IDX + "k_norm", size="index_head_dim", category=Category.INDEXER),
    TensorRow(key="indexer.k_norm_bias", name=IDX + "k_norm.bias", role=Role.NORM, category=Category.INDEXER,
              shape=("index_head_dim",)),
    *linear(key="indexer.weights_proj", module=IDX + "weights_proj", role=Role.INDEXER, category=Category.INDEXER,
            shape=("index_n_heads", "hidden_size")),
)


@register
class DeepseekV32(DeepseekV3):
    name = "deepseek_v32"
    model_types = ("deepseek_v32",)
    # the indexer's queries come from the q latent: no V2-Lite-style q_proj here
    config_keys = {**DeepseekV3.config_keys, "q_lora_rank": REQUIRED, "index_n_heads": REQUIRED,
                   "index_head_dim": REQUIRED}
    table = (*embedding(), *MTP_IN, *layer_norms(), *MLA, *INDEXER, *FA_QUANT, *DEEPSEEK_MOE, *MTP_OUT,
             *final_norm_and_head())
    # DeepSeek's FP8 release stores the indexer's wq_b and wk in FP8 (its inference code builds them as the default
    # Linear, FP8 in an FP8 run) and weights_proj in BF16 (built with the default dtype)
    fp8_keys = ("indexer.wq_b", "indexer.wk")
    onnx_refused = mindir_refused = (
        "DeepSeek Sparse Attention masks the attention to the indexer's top-k tokens by scattering a boolean into "
        "a mask (transformers' DeepseekV32Attention: new_ones(...).scatter(-1, topk_indices, False)), which the "
        "ONNX tracer cannot record (aten::scatter with a bool value), and the top-k count min(index_topk, length) "
        "depends on the sequence length, so a traced graph would hold one length's k")
    # transformers 5.24 saves layer_types ["indexed_attention", ...]; the engine's transformers (vLLM-Ascend's 5.5.4)
    # rejects that layer type (StrictDataclassClassValidationError 'validate_layer_type'); DeepSeek's own
    # config.json has neither key
    engine_config_derived = ("layer_types", "mlp_layer_types")
    kv_int8_engines = {}
    engine_refused = {"mindie": (
        "its ATB model router (the default backend) takes a model_type only where atb_llm/models/ has a folder of "
        "that name, and it has no deepseek_v32 folder (NotImplementedError 'unsupported model type: deepseek_v32'); "
        "its torch runtime backend (backend_type \"torch\", mindie_llm/runtime/models/deepseek_v32, all of the "
        "indexer float, the MTP layer at index 61) is not run by dsconv's engine check, so dsconv does not claim it",
        "MindIE-LLM atb_llm/models/__init__.py::get_model; mindie_llm/runtime/models/__init__.py::get_router_ins")}
    offline_sharded = {}
    tiny = {**DeepseekV3.tiny, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 8}

    def _facts(self, c):
        f = super()._facts(c)
        f.index_n_heads = c["index_n_heads"]
        f.index_head_dim = c["index_head_dim"]
        return f
