"""Qwen3.5-MoE (qwen3_5_moe): Qwen3-Next's hybrid decoder (Gated DeltaNet in three of every four layers, gated full
attention in the fourth, MoE with a gated shared expert) published as a vision-language checkpoint
(`Qwen3_5MoeForConditionalGeneration`): the text model under model.language_model.*, a ViT tower under
model.visual.*, its MTP block as mtp.*, and config.json's text values under text_config. The DeltaNet input
projections are stored split (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; vLLM stacks them into Qwen3-Next's
in_proj_qkvz / in_proj_ba at load time) and the routed experts fused 3-D ([E, 2I, H] gate+up, [E, H, I] down).

dsconv quantizes the text model and carries the tower and the MTP block as they are, in float, as both vLLM-Ascend
recipes keep them (docs/engine_rules.md D.6)."""
from __future__ import annotations

from typing import Any

from dsconv.families.base import Family, register
from dsconv.families.facts import ModelFacts
from dsconv.families.qwen2_moe import QWEN_MOE_SHARED, moe_facts
from dsconv.families.qwen3_next import LIN, LINEAR_KEYS, MTP_BLOCK, Qwen3Next, linear_facts
from dsconv.families.qwen3_next import LINEAR_ATTENTION as NEXT_LINEAR_ATTENTION
from dsconv.families.roles import Category, Role
from dsconv.families.rows import decoder, gqa_attention, linear, qk_norm

ATTN = Category.ATTENTION
_SPLIT = (("in_qkv", "in_proj_qkv", "linear_qkv_size"), ("in_z", "in_proj_z", "linear_value_dim"),
          ("in_b", "in_proj_b", "linear_v_heads"), ("in_a", "in_proj_a", "linear_v_heads"))
#: Qwen3-Next's DeltaNet rows with its two input projections stored as four
LINEAR_ATTENTION = (
    *(r for r in NEXT_LINEAR_ATTENTION if r.slot not in ("qkvz", "ba")),
    *(row for slot, module, rows in _SPLIT
      for row in linear(key=f"linear.{slot}", module=LIN + module, role=Role.ATTN_IN, category=ATTN,
                        shape=(rows, "hidden_size"), slot=slot, when="linear_attention")),
)
#: the tiny model's vision tower (transformers' Qwen3_5MoeVisionConfig keys)
TINY_TOWER = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64}


@register
class Qwen3_5Moe(Family):
    name = "qwen3_5_moe"
    model_types = ("qwen3_5_moe",)
    layer_prefix = "model.language_model.layers."
    text_prefix = "model.language_model."
    config_section = "text_config"
    tower_prefixes = ("model.visual.",)
    checkpoint_class = "AutoModelForImageTextToText"
    table = decoder(attention=(*LINEAR_ATTENTION, *gqa_attention(qkv_bias=False, when="full_attention"),
                               *qk_norm(when="qk_norm")), mlp=QWEN_MOE_SHARED) + MTP_BLOCK
    other_params = Qwen3Next.other_params
    mtp_prefixes = Qwen3Next.mtp_prefixes
    norm_offset = Qwen3Next.norm_offset
    engine_refused = {"mindie": (
        "its model router takes a model_type only where atb_llm/models/ has a folder of that name, and it has no "
        "qwen3_5_moe folder (NotImplementedError 'unsupported model type: qwen3_5_moe')",
        "MindIE-LLM atb_llm/models/__init__.py::get_model")}
    onnx_refused = mindir_refused = Qwen3Next.onnx_refused
    # every layer MoE: its text_config has no intermediate_size
    config_keys = {**Qwen3Next.config_keys, **LINEAR_KEYS, "mtp_num_hidden_layers": 0, "intermediate_size": 0}
    # rotary over a quarter of the 16-wide heads, its M-RoPE sections summing to half of that: vLLM's config class
    # sets partial_rotary_factor 0.25 whatever rope_parameters say (vllm/transformers_utils/configs/qwen3_5_moe.py)
    # and its rotary asserts the sum (model_executor/layers/rotary_embedding/mrope.py)
    tiny = {**Qwen3Next.tiny, "mtp_num_hidden_layers": 0, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
        "mrope_interleaved": True}}

    def _facts(self, c):
        f = linear_facts(moe_facts(Family._facts(self, c), c), c)
        f.shared_intermediate_size = c["shared_expert_intermediate_size"]
        f.num_mtp_layers = c["mtp_num_hidden_layers"]  # its block is a MoE full-attention layer
        f.moe_layers = (*f.moe_layers, *range(f.num_layers, f.num_layers + f.num_mtp_layers))
        return f

    def nest_config(self, flat: dict[str, Any]) -> dict[str, Any]:
        """Flat keys into text_config beside a tiny vision_config (the tiny model's config)."""
        top = {"model_type", "tie_word_embeddings"}
        return {**{k: v for k, v in flat.items() if k in top}, "vision_config": {**TINY_TOWER, "out_hidden_size": flat[
            "hidden_size"]}, "text_config": {k: v for k, v in flat.items() if k not in top}}

    def tower_shapes(self, facts: ModelFacts) -> list[tuple[str, tuple[int, ...]]]:
        """The vision tower's tensors as transformers builds it from vision_config, on the meta device (no memory):
        its blocks, patch and position embeddings and merger are no rows of the text table."""
        import torch
        import transformers
        from huggingface_hub.errors import StrictDataclassError

        from dsconv.errors import UserError

        vision = facts.config.get("vision_config")
        try:
            cfg = transformers.Qwen3_5MoeVisionConfig(**{k: v for k, v in (vision or {}).items() if k != "model_type"})
        except (ValueError, TypeError, StrictDataclassError) as e:
            raise UserError(f"config.json: vision_config cannot be read as Qwen3.5's vision tower ({e})",
                            hint="compare it with the model's published config.json") from None
        with torch.device("meta"):
            tower = transformers.Qwen3_5MoeVisionModel._from_config(cfg)
        return [(self.tower_prefixes[0] + n, tuple(p.shape)) for n, p in tower.named_parameters()]
