"""Kimi-K2 (kimi_k2): DeepSeek-V3's tensors and code at about 1 T parameters (384 routed experts, no MTP layer).

Its config.json names `DeepseekV3ForCausalLM` with an `auto_map` to remote code; transformers has no kimi_k2 class
and dsconv never runs remote code: it builds transformers' own DeepSeek-V3 from the same config."""
from dsconv.families.base import register
from dsconv.families.deepseek_v3 import DeepseekV3


@register
class KimiK2(DeepseekV3):
    name = "kimi_k2"
    model_types = ("kimi_k2",)
    transformers_model_type = "deepseek_v3"
    # what Kimi-K2-Instruct's config.json carries besides DeepSeek-V3's keys
    tiny_saved = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
                  "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                               "AutoModel": "modeling_deepseek.DeepseekV3Model",
                               "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}}
    # both engines run Kimi-K2 with DeepSeek's model code, FA quant included (MindIE: Kimik2Router sets model_type
    # deepseekv2; vLLM: DeepseekV3ForCausalLM from `architectures`): make engine-check loads its int8 cache
    kv_int8_engines = {"mindie": ("kimi_k2",), "vllm-ascend": ("kimi_k2",)}
    tiny = {**DeepseekV3.tiny, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827}
