"""Qwen3: Llama with per-head q/k RMSNorm and an explicit head_dim."""
from dsconv.families.base import Family, register
from dsconv.families.rows import decoder, dense_mlp, gqa_attention, qk_norm


@register
class Qwen3(Family):
    name = "qwen3"
    model_types = ("qwen3",)
    kv_int8_engines = {"mindie": ("qwen3",), "vllm-ascend": ("qwen3",)}  # MindIE via Qwen2; vLLM patch_gqa_c8
    w8a8_mix_engines = {"mindie": ("qwen3",)}  # MindIE: Qwen3 routed to Qwen2's model
    table = decoder(attention=(*gqa_attention(), *qk_norm()), mlp=dense_mlp())
    tiny = {"head_dim": 16}
