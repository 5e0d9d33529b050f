"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3 attention, softmax top-k experts, no shared expert."""
from dsconv.families import register
from dsconv.families.base import Family, expert_rules, llama_rules, router_rule
from dsconv.families.qwen2_moe import moe_facts, routed_shapes
from dsconv.families.qwen3 import QK_NORM, qk_norm_shapes


@register
class Qwen3Moe(Family):
    name = "qwen3_moe"
    model_types = ("qwen3_moe",)
    rules = {**llama_rules(), **QK_NORM, **expert_rules(), **router_rule()}

    def _facts(self, c):
        f = moe_facts(super()._facts(c), c)
        f.extra["attention_bias"] = bool(c.get("attention_bias", False))
        return f

    def attention_shapes(self, f, layer):
        yield from super().attention_shapes(f, layer)
        yield from qk_norm_shapes(f)

    def mlp_shapes(self, f, layer):
        if layer not in f.moe_layers:
            yield from super().mlp_shapes(f, layer)
            return
        yield from routed_shapes(f)
