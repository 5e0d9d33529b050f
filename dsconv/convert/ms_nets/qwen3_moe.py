"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen2-MoE's network with Qwen3 attention (q/k norm) and no shared expert."""
from __future__ import annotations

from functools import partial

from dsconv.convert.ms_nets.qwen2_moe import build as qwen2_moe_build

MODEL_TYPES = ("qwen3_moe",)

build = partial(qwen2_moe_build, qk_norm=True, shared_expert=False)
