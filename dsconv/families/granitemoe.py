"""Granite-MoE (IBM Granite 3.x MoE): Llama attention and softmax top-k experts, stored as ONE 3-D tensor per layer
and projection on disk: `block_sparse_moe.input_linear.weight` [E, 2I, H] (gate rows, then up) and
`output_linear.weight` [E, H, I], the router under `block_sparse_moe.router.layer`. The table names each expert's
gate/up/down as the per-expert layout the stages work with; checkpoint.py presents the 3-D tensors as those byte
ranges (no copy), and transformers' in-memory names (`block_sparse_moe.experts.gate_up_proj`, `...router.weight`,
also what `save_pretrained(save_original_format=False)` writes) map onto them through `fused_experts` /
`fused_renames`.

Granite scales embeddings, residuals, attention and logits by config multipliers that transformers' own module
applies; the MindSpore builder has no such block (MindIR export refuses it), and no engine loader reads its experts
per expert (quantize refuses it).
"""
from dsconv.families.base import LAYER, Family, register
from dsconv.families.rows import decoder, experts, gqa_attention, router
from dsconv.families.mixtral import every_layer_moe


@register
class GraniteMoe(Family):
    name = "granitemoe"
    model_types = ("granitemoe",)
    table = decoder(attention=gqa_attention(),
                    mlp=(*router(module=LAYER + "block_sparse_moe.router.layer"),
                         *experts(module=LAYER + "block_sparse_moe.experts.{E}", inter="intermediate_size")))
    tiny = {"num_local_experts": 8, "num_experts_per_tok": 2}
    config_keys = {**Family.config_keys, "num_local_experts": 8, "num_experts_per_tok": 2}
    # Granite's own 3-D tensors (the layer -> the per-expert slots each holds, stacked along dim 1); transformers 5
    # keeps them as `block_sparse_moe.experts.gate_up_proj` / `down_proj` and the router one level up
    disk_fused_params = {"block_sparse_moe.input_linear.weight": ("gate", "up"),
                         "block_sparse_moe.output_linear.weight": ("down",)}
    fused_experts = "block_sparse_moe.experts"
    fused_renames = {"block_sparse_moe.router": "block_sparse_moe.router.layer"}
    quantize_refused = ("no engine loader reads Granite-MoE experts per expert: vLLM's GraniteMoe model loads the "
                        "3-D input_linear/output_linear tensors only (vllm model_executor/models/granitemoe.py), "
                        "and MindIE has no Granite-MoE model")
    mindir_refused = "the MindSpore builder has no Granite block (embedding, residual, attention and logits multipliers)"

    def _facts(self, c):
        return every_layer_moe(super()._facts(c), c)
