"""Qwen3: Llama with per-head q/k RMSNorm and an explicit head_dim."""
from dsconv.families import register
from dsconv.families.base import Family, Rule, llama_rules
from dsconv.families.roles import Category, Role

QK_NORM = {"model.layers.{L}.self_attn.q_norm": Rule(Role.NORM, Category.NORMS),
           "model.layers.{L}.self_attn.k_norm": Rule(Role.NORM, Category.NORMS)}


def qk_norm_shapes(f):
    yield "self_attn.q_norm.weight", (f.head_dim,)
    yield "self_attn.k_norm.weight", (f.head_dim,)


@register
class Qwen3(Family):
    name = "qwen3"
    model_types = ("qwen3",)
    rules = {**llama_rules(), **QK_NORM}

    def _facts(self, c):
        f = super()._facts(c)
        f.extra["attention_bias"] = bool(c.get("attention_bias", False))
        return f

    def attention_shapes(self, f, layer):
        yield from super().attention_shapes(f, layer)
        yield from qk_norm_shapes(f)
