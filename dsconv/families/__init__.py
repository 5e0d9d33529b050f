"""The registry of model families: `model_type` -> Family. The only place that knows tensor names.

A family is one file: a `Family` subclass with its table (base.T rows), its config keys (`config_keys`, `_facts`) and
its tiny config, registered in the list at the bottom of this module. `family_for(config)` looks it up and
lists the supported types when a model_type is unknown.

Adding a family (everything else - classification, synthesis, inspect, quantize, shard, the torch builder, the
MindSpore network's weight lookup, the tiny test model - follows from these):
  1. `families/<name>.py`: `model_types`; `table` from the row builders in base.py (`decoder`, `gqa_attention`,
     `qk_norm`, `dense_mlp`, `experts`, `router`, `swiglu`, `linear`, `norm`) plus rows of its own; `tiny` config
     keys; `config_keys` (every config.json key `_facts` reads, with its default or REQUIRED: checked when the
     config is read, fuzzed by benchmarks/fuzz.py) and `_facts` for those the base does not read (MoE counts,
     `router`, `sliding`, ...); optionally `fused_renames`;
  2. import and register it at the bottom of this module;
  3. only for an op no family had: a MindSpore block in model/ms/ (as mla.py), chosen in model/ms/build.py.
"""
from __future__ import annotations

from typing import Any

from dsconv.errors import UserError
from dsconv.families.base import Family, T
from dsconv.families.facts import ModelFacts
from dsconv.families.roles import Category, Role, TensorRole

_REGISTRY: dict[str, Family] = {}


def register(cls: type[Family]) -> type[Family]:
    family = cls()
    for model_type in cls.model_types:
        _REGISTRY[model_type] = family
    return cls


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


def families() -> list[Family]:
    """Every registered family once (registration order)."""
    return list({id(f): f for f in _REGISTRY.values()}.values())


def family_for(config: dict[str, Any], where: str = "config.json") -> Family:
    model_type = config.get("model_type")
    if model_type not in _REGISTRY:
        raise UserError(f"{where}: model_type {model_type!r} is not supported",
                        hint=f"dsconv supports {', '.join(supported_model_types())}")
    return _REGISTRY[model_type]


from dsconv.families.llama import Llama  # noqa: E402
from dsconv.families.qwen2 import Qwen2  # noqa: E402
from dsconv.families.qwen3 import Qwen3  # noqa: E402
from dsconv.families.qwen2_moe import Qwen2Moe  # noqa: E402
from dsconv.families.qwen3_moe import Qwen3Moe  # noqa: E402
from dsconv.families.mixtral import Mixtral  # noqa: E402
from dsconv.families.deepseek_v3 import DeepseekV3  # noqa: E402
from dsconv.families.gemma3 import Gemma3  # noqa: E402

#: every family, registered explicitly (no import side effects, no cycle): add a new one here
for _cls in (Llama, Qwen2, Qwen3, Qwen2Moe, Qwen3Moe, Mixtral, DeepseekV3, Gemma3):
    register(_cls)

__all__ = ["Family", "ModelFacts", "T", "Role", "Category", "TensorRole", "family_for", "register",
           "supported_model_types"]
