"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3 attention, softmax top-k experts, no shared expert."""
from dsconv.families.base import Family, register
from dsconv.families.rows import decoder, dense_mlp, experts, gqa_attention, qk_norm, router
from dsconv.families.qwen2_moe import (MINDIE_EXPLICIT, MINDIE_MOE_EXPERT_TYPES, MINDIE_MOE_REGIONS, MOE_KEYS,
                                       MOE_TINY, NUM_EXPERTS_ALIAS, moe_facts)


@register
class Qwen3Moe(Family):
    name = "qwen3_moe"
    model_types = ("qwen3_moe",)
    table = decoder(attention=(*gqa_attention(), *qk_norm()), mlp=(*dense_mlp(when="dense"), *router(), *experts()))
    tiny = {**MOE_TINY, "head_dim": 16}
    config_keys = {**Family.config_keys, **MOE_KEYS}
    engine_regions = MINDIE_MOE_REGIONS
    engine_explicit_keys = MINDIE_EXPLICIT
    engine_config_aliases = NUM_EXPERTS_ALIAS
    engine_kind_types = {"mindie": {"routed_experts": MINDIE_MOE_EXPERT_TYPES}}

    def _facts(self, c):
        f = moe_facts(super()._facts(c), c)
        f.sliding = "all"
        return f
