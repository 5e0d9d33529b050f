"""Llama (and Mistral, a Llama with a sliding window on every layer): GQA attention, SwiGLU MLP."""
from dsconv.families.base import Family, register
from dsconv.families.rows import decoder, dense_mlp, gqa_attention


@register
class Llama(Family):
    name = "llama"
    model_types = ("llama", "mistral")
    kv_int8_engines = {"mindie": ("llama",)}  # MindIE flash_causal_llama.py; vLLM-Ascend: KeyError
    w8a8_mix_engines = {"mindie": ("llama",)}  # MindIE flash_causal_llama.py (not Mistral's model)
    table = decoder(attention=gqa_attention(), mlp=dense_mlp())
    tiny = {}

    def _facts(self, c):
        f = super()._facts(c)
        f.sliding = "all" if c["model_type"] == "mistral" else "layer_types"
        return f
