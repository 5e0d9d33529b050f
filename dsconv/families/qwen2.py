"""Qwen2 / Qwen2.5: Llama with q/k/v biases, sliding windows where `layer_types` says."""
from dsconv.families.base import Family, register
from dsconv.families.rows import decoder, dense_mlp, gqa_attention


@register
class Qwen2(Family):
    name = "qwen2"
    model_types = ("qwen2",)
    kv_int8_engines = {"mindie": ("qwen2",)}  # MindIE flash_causal_qwen2.py; vLLM-Ascend: KeyError
    w8a8_mix_engines = {"mindie": ("qwen2",)}  # MindIE flash_causal_qwen2.py
    table = decoder(attention=gqa_attention(), mlp=dense_mlp())
    tiny = {}

    def _facts(self, c):
        f = super()._facts(c)
        f.qkv_bias = True
        return f
