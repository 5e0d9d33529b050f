"""Qwen3: Qwen2's network with per-head RMSNorm on q and k (before rotary) and an explicit head_dim."""
from __future__ import annotations

from functools import partial

from dsconv.convert.ms_nets.qwen2 import build as qwen2_build

MODEL_TYPES = ("qwen3",)

build = partial(qwen2_build, qk_norm=True)
