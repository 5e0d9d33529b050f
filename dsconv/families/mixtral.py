"""Mixtral: every layer MoE (softmax top-k, always renormalised), experts named block_sparse_moe.experts.E.w1/w2/w3 on
disk (w1 gate, w3 up, w2 down), a sliding window on every layer when set."""
from dsconv.families.base import LAYER, Family, register
from dsconv.families.rows import decoder, experts, gqa_attention, router


@register
class Mixtral(Family):
    name = "mixtral"
    model_types = ("mixtral",)
    _gate, _up, _down = experts(module=LAYER + "block_sparse_moe.experts.{E}", names=("w1", "w3", "w2"),
                                inter="intermediate_size")
    table = decoder(attention=gqa_attention(),
                    mlp=(*router(module=LAYER + "block_sparse_moe.gate"), _gate, _down, _up))  # on disk: w1, w2, w3
    tiny = {"num_local_experts": 8, "num_experts_per_tok": 2}
    fused_renames = {"mlp.gate": "block_sparse_moe.gate"}
    config_keys = {**Family.config_keys, "num_local_experts": 8, "num_experts_per_tok": 2}  # MixtralConfig's
    engine_dtypes = {"mindie": ("F16", "MindIE runs Mixtral in float16 whatever config.json says, and casts a float "
                                       "deq_scale to it (an fp16 W8A8 kernel reads deq_scale as the int64 word)",
                                "MindIE-LLM atb/models/mixtral/config_mixtral.py (torch_dtype); atb/utils/weights.py::"
                                "correct_tensor_dtype; atb/utils/quantize/w8a8.py::W8A8LinearStatic")}

    def _facts(self, c):
        f = every_layer_moe(super()._facts(c), c)
        f.sliding = "all"
        return f


def every_layer_moe(f, c):
    """MoE on every layer with `num_local_experts` experts as wide as `intermediate_size`, top-k renormalised."""
    f.num_experts = c["num_local_experts"]
    f.experts_per_tok = c["num_experts_per_tok"]
    f.moe_intermediate_size = f.intermediate_size
    f.moe_layers = tuple(range(f.num_layers))
    f.norm_topk_prob = True
    return f
