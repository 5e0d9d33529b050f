"""Engine profiles as data: what MindIE and vLLM-Ascend load, read from their loader source.

Every rule carries the source it was read from (docs/engine_rules.md; MindIE-LLM @8b4871ad, vllm-ascend
@182b75ea). Code elsewhere asks a profile; it never restates an engine fact. Layer *kinds* are dsconv's grouping of
linears (from the family's Role/Category table); each engine maps a kind to its own layer type ("linear" or "moe").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

FLOAT = "FLOAT"
# dsconv's layer kinds, in model order
KINDS = ("attention", "linear_attention", "kv_b", "dense_mlp", "shared_experts", "routed_experts")
ENGINE_LAYER_TYPE = {"attention": "linear", "linear_attention": "linear", "kv_b": "linear", "dense_mlp": "linear",
                     "shared_experts": "linear", "routed_experts": "moe"}
DEFAULT_ENGINE = "mindie"


@dataclass(frozen=True)
class Rule:
    """One loader fact and where it was read."""

    text: str
    source: str


@dataclass(frozen=True)
class KVCacheRule:
    """What an engine pairs an int8 KV-cache form with (None: any type it loads), and where that was read."""

    rule: Rule
    linear_types: frozenset[str] | None = None     # every quantized linear's type
    attention_types: frozenset[str] | None = None  # the attention linears' type (MLA: what its kernel reads)
    dtypes: frozenset[str] = frozenset({"BF16", "F16"})


@dataclass(frozen=True)
class GroupSplitRule:
    """How many int4 groups a rank's slice of a row-parallel (input-split) per-group weight must hold."""

    label: str
    min_groups: int
    rule: Rule


@dataclass(frozen=True)
class EngineProfile:
    name: str
    label: str
    # engine layer type -> quantized types the loader has a scheme for (msModelSlim layout as dsconv writes it)
    schemes: Mapping[str, frozenset[str]]
    why_not: Mapping[tuple[str, str], Rule]          # (type, layer type) -> why it does not load
    # kinds that must stay float, per family (family "*" = every family having that kind)
    float_only: Mapping[str, Rule]
    description_names: tuple[str, ...]               # description files the loader opens, in its order
    legacy_layout: bool                              # reads quant_model_description_{quantize}.json too
    config_keys: tuple[str, ...]                     # keys dsconv writes into config.json for it
    # config key -> kinds it governs (MindIE: one quantized type per region); {} = per-layer lookup; a family's
    # engine_regions replace it
    regions: Mapping[str, tuple[str, ...]]
    fallback_ok: bool                                # may one region mix quantized types (per-unit fallback)?
    moe_type_key: bool = False                       # description names each MoE layer's type `<moe>.experts.weight`
    rope_rows_packed_ok: bool = True                 # may rows the loader permutes for rope be int4-packed along n?
    # the types shared experts may have beside W4A8 routed experts (None: any the engine loads)
    w4a8_shared_types: frozenset[str] | None = None
    # int8 KV cache (--kv-cache int8) per form (C8, FAQuant): what the engine pairs it with; which model types load
    # it: Family.kv_int8_engines
    kv_int8: Mapping[str, "KVCacheRule"] = field(default_factory=dict)
    # model dtypes the loader runs (None: any), and the W4A16 group sizes it runs (None: any that divides k); the
    # rules "dtype" / "group_size" say where that was read
    dtypes: frozenset[str] | None = None
    group_sizes: frozenset[int] | None = None
    # tokenizer_config.json as its pinned transformers reads it ("tokenizer"): `tokenizer_class` values it cannot
    # resolve -> what it can; keys whose list value it reads under another name
    tokenizer_classes: Mapping[str, str] = field(default_factory=dict)
    tokenizer_list_keys: Mapping[str, str] = field(default_factory=dict)
    # what a rank's share of a row-parallel per-group int4 weight must hold (None: any whole number of groups)
    group_split: GroupSplitRule | None = None
    # W8A8_MIX (PD-mix) runs only in the model types a family names for this engine (Family.w8a8_mix_engines);
    # False: in any model the engine loads; rules["w8a8_mix"]
    mix_per_model: bool = False
    rules: Mapping[str, Rule] = field(default_factory=dict)

    def layer_type(self, kind: str) -> str:
        return ENGINE_LAYER_TYPE[kind]

    def loads(self, qtype: str, kind: str) -> bool:
        return qtype == FLOAT or qtype in self.schemes[self.layer_type(kind)]

    def region_map(self, family: Any) -> dict[str, tuple[str, ...]]:
        """config key -> the kinds it governs for this family (families.base.Family)."""
        return dict(family.engine_regions.get(self.name) or self.regions)


# MindIE reads one `quantize` region unless the family names others (Family.engine_regions: DeepSeek's
# mla_quantize / moe_quantize)
_MINDIE_REGIONS = {"quantize": KINDS}

MINDIE = EngineProfile(
    name="mindie",
    label="MindIE",
    schemes={"linear": frozenset({"W8A8", "W8A8_DYNAMIC", "W8A8_MIX", "W8A16", "W4A16"}),
             "moe": frozenset({"W8A8", "W8A8_DYNAMIC", "W8A16", "W4A16", "W4A8_DYNAMIC"})},
    why_not={("W8A8_MIX", "moe"): Rule(
        "routed experts load through load_moe, which holds five tensors per expert (a PD-mix linear has seven), and "
        "the new runtime's fused MoE has no W8A8_MIX method (it falls back to float with a warning); msModelSlim's "
        "PD-mix models give experts W8A8_DYNAMIC",
        "MindIE-LLM atb/utils/layers/linear/__init__.py::TensorParallelColumnLinear.load_moe; mindie_llm/runtime/"
        "layers/quantization/ms_model_slim/quantization_config.py (FusedMoE dispatch)"),
             ("W4A4_DYNAMIC", "linear"): Rule(
        "it has no W4A4 type (neither QuantType enum names one; no loader branch takes 4-bit activations)",
        "MindIE-LLM atb_llm/utils/quantize/quant_type.py::QuantType; mindie_llm/runtime/layers/quantization/"
        "ms_model_slim/quant_type.py::QuantType"),
             ("W4A4_DYNAMIC", "moe"): Rule(
        "it has no W4A4 type (neither QuantType enum names one; no loader branch takes 4-bit activations)",
        "MindIE-LLM atb_llm/utils/quantize/quant_type.py::QuantType; mindie_llm/runtime/layers/quantization/"
        "ms_model_slim/quant_type.py::QuantType"),
             ("W4A8_DYNAMIC", "linear"): Rule(
        "a W4A8 linear is read only in the per-group form (weight_scale_second); group_size 0 means per channel, "
        "which only its MoE path takes",
        "MindIE-LLM atb/utils/weights.py::Weights.get_multi_weights_col (W4A8 branch); "
        "mindie_llm/runtime/layers/quantization/ms_model_slim/w4a8.py (MoE only)")},
    float_only={"kv_b": Rule(
        "DeepSeek kv_b_proj is kept float: MindIE reshapes only its weight into k_b/v_b (scales are not), and "
        "Ascend's recipe disables it",
        "MindIE-LLM atb/utils/layers/attention/process_mla_linear.py::preprocess_kv_weights")},
    description_names=("quant_model_description.json",),
    legacy_layout=True,
    config_keys=("quantize", "mla_quantize", "moe_quantize", "mtp_quantize", "attn_quantize"),
    regions=_MINDIE_REGIONS,
    fallback_ok=False,
    rope_rows_packed_ok=False,
    kv_int8={
        "C8": KVCacheRule(Rule(
            "C8 scales are read by KvCache.load as <attn>.k_proj/v_proj.kv_cache_scale/_offset, per channel, "
            "sharded per KV head, the offset's float bits taken as int8 (so zero); switched on by kv_quant_type C8 "
            "(the description's globals are merged into quantization_config); only Llama and Qwen2/Qwen3 (dense) "
            "wire them into the attention (the MoE models load no cache scales); documented with W8A8 and W8A16 "
            "only (not with W4A8), fp16 or bf16 weights",
            "MindIE-LLM atb/utils/layers/attention/kv_cache.py::KvCache.load; atb/models/base/config.py::"
            "QuantizationConfig; atb/models/base/router.py::BaseRouter.config; atb/models/qwen2/"
            "flash_causal_qwen2.py, llama/flash_causal_llama.py (register_layer_kvquant); its user guide's feature "
            "pages KV Cache int8 and W8A16"), linear_types=frozenset({"W8A8", "W8A16"})),
        "FAQuant": KVCacheRule(Rule(
            "DeepSeek FA3: FA3.load_mla reads <attn>.fa_q.scale (inverted, sliced per attention TP rank) and "
            "fa_k.scale (fa_v and the offsets are not read), enabled by fa_quant_type FAKQuant/FAQuant; the query is "
            "quantized inside MLA preprocess, which needs mla_quantize w8a8 (static W8A8 attention) and float16; "
            "documented for DeepSeek-V3/R1 on A2/A3, with W8A8, float16 only",
            "MindIE-LLM atb/utils/layers/attention/fa3.py::FA3.load_mla; atb/models/deepseekv2/"
            "modeling_deepseekv2.py; flash_causal_deepseekv2.py (enableMlaPreprocess); atb/models/base/config.py "
            "(fa_quant_type); its user guide's feature page FA3 quantization"),
            attention_types=frozenset({"W8A8"}), dtypes=frozenset({"F16"})),
    },
    dtypes=frozenset({"BF16", "F16"}),
    group_sizes=frozenset({0, 64, 128, 256}),
    mix_per_model=True,
    tokenizer_classes={"TokenizersBackend": "PreTrainedTokenizerFast"},
    tokenizer_list_keys={"extra_special_tokens": "additional_special_tokens"},
    group_split=GroupSplitRule("MindIE", 2, Rule(
        "a row-parallel W4A16 layer's weight_scale is split along its groups, and a rank left with one group column "
        "[n, 1] is read as the per-channel form (packed along k), so its weights are misread (make engine-check: held "
        "weight and scale disagree)",
        "MindIE-LLM atb/utils/weights.py::Weights.get_multi_weights_row (W4A16 branch); atb/utils/quantize/"
        "w4a16.py::W4A16LinearStatic.__init__ (trans_flag from weight_scale.shape[-1] == 1)")),
    rules={
        "w8a8_mix": Rule(
            "W8A8_MIX is read as its older name w8a8_pdmix, which only the Llama and Qwen2 models run (Qwen3 through "
            "Qwen2's): they build the prefill graph from each linear's W8A8_DYNAMIC side and the decode graph from its "
            "W8A8 side; every other model asserts 'Quantization `w8a8_mix` is not implemented yet' (make engine-check)",
            "MindIE-LLM atb/models/base/router.py::BaseRouter.config (w8a8_mix -> w8a8_pdmix); atb/models/llama/"
            "flash_causal_llama.py, qwen2/flash_causal_qwen2.py::init_ascend_weight (decode_weight)"),
        "dtype": Rule("config.json torch_dtype must be float16 or bfloat16 (NotImplementedError otherwise)",
                      "MindIE-LLM atb/runner/model_runner.py::ModelRunner.__init__"),
        "group_size": Rule("W4A16 runs with group_size 0 (per channel), 64, 128 or 256 (NotImplementedError "
                           "otherwise)", "MindIE-LLM atb/models/base/config.py::BaseConfig.__check_group_size"),
        "tokenizer": Rule("the tokenizer is loaded by AutoTokenizer of its pinned transformers 4.x, which does not "
                          "know transformers 5's generic TokenizersBackend class (its PreTrainedTokenizerFast reads "
                          "the same tokenizer.json) and takes `extra_special_tokens` as a dict of named tokens, where "
                          "transformers 5 writes the list it used to call `additional_special_tokens` (AttributeError "
                          "'list' object has no attribute 'keys')",
                          "MindIE-LLM atb/models/base/model_utils.py::safe_get_tokenizer_from_pretrained; "
                          "atb/models/*/router_*.py::get_tokenizer"),
        "quantize": Rule("config.json `quantize` (lower case) selects the loader branch; without it int8 weights "
                         "are not read as quantized",
                         "MindIE-LLM atb/models/base/router.py::BaseRouter.config; atb/utils/layers/linear/"
                         "__init__.py::get_linear"),
        "regions": Rule("DeepSeek: mla_quantize (attention), moe_quantize (routed experts), quantize (dense MLP, "
                        "shared experts); one quantized type per region (tensors are read with the region's recipe)",
                        "MindIE-LLM atb/models/deepseekv2/modeling_deepseekv2.py::FlashDeepseekV2Attention.__init__; "
                        "atb/models/deepseek/modeling_deepseek.py::DeepseekMoE.init_experts; "
                        "atb/utils/weights.py::Weights.get_multi_weights_col"),
        "description": Rule("quant_model_description.json first, else quant_model_description_{quantize}.json",
                            "MindIE-LLM atb/utils/weights.py::Weights._set_quant_params; router.py::BaseRouter.config"),
        "rope_rows": Rule("MLA rope rows of q_b_proj / kv_a_proj_with_mqa are regrouped (even rows, then odd) on "
                          "the weight as stored, by `weight.view(heads, q_head_dim, -1)`: int4 packed along the "
                          "output dim holds two rows per byte, so the permutation would move half-rows and "
                          "scramble them silently",
                          "MindIE-LLM atb/utils/layers/attention/process_mla_linear.py::preprocess_linear_for_rope, "
                          "trans_rope_weight"),
        "w4a16": Rule("per-channel int4 packed along k [n, k/2], per-group along n [n/2, k]; low nibble first; "
                      "version != 0.0.0 means pre-packed",
                      "MindIE-LLM atb/utils/quantize/w4a16.py::W4A16LinearStatic.__init__; "
                      "atb/utils/quantize/low_bit_utils.py::int42int8"),
        "w4a8": Rule("W4A8 experts: weight int8 packed along n, gate/up rows sharded on dim 0, down on dim 1 with its "
                     "[H, 16] scale_bias; scale_bias read always, `group_size == 0` selects per channel (a missing "
                     "key means per group); the MoE bias is scale_bias summed over its chunks",
                     "MindIE-LLM atb/utils/weights.py::Weights.get_multi_weights_col, get_multi_weights_row (W4A8 "
                     "branches); atb/utils/quantize/w4a8.py::W4A8LinearDynamic"),
        "mtp": Rule("an MTP layer is read with `quantize`'s type for its experts when config.json has mtp_quantize "
                    "(presence only), else with moe_quantize's",
                    "MindIE-LLM atb/models/deepseekv2/modeling_deepseekv2.py (mtp_quantize); "
                    "flash_causal_deepseekv2.py"),
        "w4a8_regions": Rule("DeepSeek W4A8: routed experts are read with moe_quantize, attention with "
                             "mla_quantize, dense MLP and shared experts with quantize; msModelSlim writes all three",
                             "MindIE-LLM atb/models/deepseek/modeling_deepseek.py::DeepseekMoE.init_experts; "
                             "msmodelslim model/deepseek_v3/model_adapter.py::ascendv1_save_postprocess"),
    },
)

VLLM_ASCEND = EngineProfile(
    name="vllm-ascend",
    label="vLLM-Ascend",
    schemes={"linear": frozenset({"W8A8", "W8A8_DYNAMIC", "W8A8_MIX", "W8A16", "W4A4_DYNAMIC"}),
             "moe": frozenset({"W8A8_DYNAMIC", "W4A8_DYNAMIC"})},
    why_not={
        ("W8A8_MIX", "moe"): Rule(
            "its W8A8_MIX MoE method is the dynamic one (experts are per-token dynamic on every instance) and has no "
            "per-expert input_scale / quant_bias parameter, which DeepSeek's load_weights looks up without a check "
            "(KeyError); W8A8_DYNAMIC experts compute the same",
            "vllm-ascend vllm_ascend/quantization/methods/w8a8_pdmix.py::AscendW8A8PDMixFusedMoeMethod; "
            "vllm/model_executor/models/deepseek_v2.py::load_weights"),
        ("W4A16", "linear"): Rule("no W4A16 linear scheme is registered",
                                  "vllm-ascend vllm_ascend/quantization/methods/registry.py::get_scheme_class"),
        ("W4A16", "moe"): Rule("its W4A16 MoE scheme reads only the LLM-Compressor int32 layout (weight_packed), "
                               "not msModelSlim's int8-packed one",
                               "vllm-ascend vllm_ascend/quantization/methods/w4a16.py::AscendW4A16FusedMoEMethod"),
        ("W4A4_DYNAMIC", "moe"): Rule("W4A4_DYNAMIC is registered for linear layers only",
                                      "vllm-ascend vllm_ascend/quantization/methods/w4a4_laos_dynamic.py "
                                      "(@register_scheme(\"W4A4_DYNAMIC\", \"linear\"))"),
        ("W8A16", "moe"): Rule("no W8A16 MoE scheme is registered",
                               "vllm-ascend vllm_ascend/quantization/methods/registry.py::get_scheme_class"),
        ("W8A8", "moe"): Rule("no static W8A8 MoE scheme since 2025-12-19 (NotImplementedError)",
                              "vllm-ascend vllm_ascend/quantization/modelslim_config.py::create_scheme_for_layer"),
        ("W4A8_DYNAMIC", "linear"): Rule(
            "its W4A8 linear divides by group_size (ZeroDivisionError for the per-channel form, group_size 0) and "
            "runs as W4A16 anyway; group_size is global, so a per-channel W4A8 MoE file holds no W4A8 linear",
            "vllm-ascend vllm_ascend/quantization/methods/w4a8.py::AscendW4A8DynamicLinearMethod.get_pergroup_param"),
    },
    float_only={"kv_b": Rule(
        "DeepSeek kv_b_proj must be unquantized (assert isinstance(kv_b_proj.quant_method, UnquantizedLinearMethod))",
        "vllm-ascend vllm_ascend/attention/mla_v1.py::process_weights_after_loading")},
    description_names=("quant_model_description.json",),
    legacy_layout=False,
    config_keys=(),
    regions={},
    fallback_ok=True,
    moe_type_key=True,
    w4a8_shared_types=frozenset({"W8A8_DYNAMIC", FLOAT}),
    kv_int8={
        "C8": KVCacheRule(Rule(
            "C8 scales are mapped to attn.k_cache_scale/_offset, attn.v_cache_scale/_offset (a [1] parameter in the "
            "model dtype, replaced by the loaded per-channel tensor) only by the model classes its patch routes "
            "through get_cache_scale - Qwen3ForCausalLM among dsconv's families; elsewhere the names reach the "
            "model's own loader: KeyError for Llama and Qwen2 (qkv_proj.kv_cache_offset), and Qwen3-MoE loads with "
            "the scales left unset (make engine-check)",
            "vllm-ascend vllm_ascend/patch/worker/patch_gqa_c8.py; vllm_ascend/quantization/modelslim_config.py::"
            "get_cache_scale, is_c8_quant_layer; quantization/methods/kv_c8.py::AscendC8KVCacheAttentionMethod")),
        "FAQuant": KVCacheRule(Rule(
            "DeepSeek FA quant: <attn>.fa_q/fa_k/fa_v.scale/offset are remapped to the MLA attention's parameters "
            "(mla_attn.mla_attn.fa_*) for the layers whose fa_k.scale the description lists; on A2/A3 the int8 "
            "latent cache is used on a PD-disaggregated decode instance, whose fused MLA path reads q_b_proj's and "
            "the fused q_a/kv_a projection's weight_scale: W8A8_DYNAMIC attention",
            "vllm-ascend vllm_ascend/patch/worker/patch_weight_utils.py::patch_deepseek; quantization/"
            "modelslim_config.py::_add_kvcache_quant_metadata, enabling_fa_quant; quantization/methods/kv_c8.py::"
            "AscendFAQuantAttentionMethod; attention/mla_v1.py::_process_weights_for_fused_fa_quant"),
            attention_types=frozenset({"W8A8_DYNAMIC"})),
    },
    rules={
        "description": Rule("only quant_model_description.json; a quantization_config in config.json replaces it",
                            "vllm-ascend vllm_ascend/quantization/modelslim_config.py::AscendModelSlimConfig."
                            "maybe_update_config"),
        "fused": Rule("fused layers (qkv, gate_up, fused_qkv_a, experts) need one type across shards; MoE type "
                      "from experts.0",
                      "vllm-ascend vllm_ascend/quantization/modelslim_config.py::get_linear_quant_type"),
        "w4a8": Rule("W4A8 MoE per channel iff version 1.0.0 and group_size 0: w13 [E, I, H] / w2 [E, H/2, I] int8 "
                     "packed along n, fp32 scales [E, 2I, 1] / [E, H, 1], scale_bias [E, 2I, 1] / [E, H, 16/tp]; "
                     "quantized shared experts must be W8A8_DYNAMIC (their int8 path reads weight_scale_fp32)",
                     "vllm-ascend vllm_ascend/quantization/methods/w4a8.py::AscendW4A8DynamicFusedMoEMethod; "
                     "vllm_ascend/ops/fused_moe/fused_moe.py (shared experts)"),
        "w4a4": Rule("W4A4_DYNAMIC linear: weight int8 [n, k] holding int4 values, weight_scale and weight_offset "
                     "float32 [n, 1] (the offset is loaded, never used: symmetric); activations quantized to int4 per "
                     "token (npu_dynamic_quant to quint4x2), int4 x int4 matmul scaled by weight_scale x the token's "
                     "scale, output float16 then the model dtype",
                     "vllm-ascend vllm_ascend/quantization/methods/w4a4_laos_dynamic.py::"
                     "AscendW4A4LaosDynamicLinearMethod"),
        "moe_key": Rule("a fused MoE layer's type is looked up as `<prefix>.experts.weight` unless the model type's "
                        "packed_modules_model_mapping lists its experts (qwen2_moe and mixtral are not listed: "
                        "KeyError without the key)",
                        "vllm-ascend vllm_ascend/quantization/modelslim_config.py::get_linear_quant_type"),
    },
)

ENGINES: dict[str, EngineProfile] = {p.name: p for p in (MINDIE, VLLM_ASCEND)}


def offline_sharded(engine: str, family: Any) -> Rule | None:
    """The offline-sharded layout `engine`'s loader reads for `family` (Family.offline_sharded), None when the
    engine shards the family itself at load time."""
    fact = family.offline_sharded.get(engine)
    return Rule(*fact) if fact else None
