"""Qwen2 / Qwen2.5: Llama with q/k/v biases."""
from dsconv.families import register
from dsconv.families.base import Family, llama_rules


@register
class Qwen2(Family):
    name = "qwen2"
    model_types = ("qwen2",)
    rules = llama_rules()

    def qkv_bias(self, f):
        return True
