"""The registry of model families: `model_type` -> Family. The only place that knows tensor names.

A family registers itself with `@register`; `family_for(config)` looks it up and lists the supported types when a
model_type is unknown.
"""
from __future__ import annotations

from typing import Any

from dsconv.errors import UserError
from dsconv.families.base import Family, ModelFacts, Rule
from dsconv.families.roles import Category, Role, TensorRole

_REGISTRY: dict[str, Family] = {}


def register(cls: type[Family]) -> type[Family]:
    family = cls()
    for model_type in cls.model_types:
        _REGISTRY[model_type] = family
    return cls


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


def family_for(config: dict[str, Any], where: str = "config.json") -> Family:
    model_type = config.get("model_type")
    if model_type not in _REGISTRY:
        raise UserError(f"{where}: model_type {model_type!r} is not supported",
                        hint=f"dsconv supports {', '.join(supported_model_types())}")
    return _REGISTRY[model_type]


from dsconv.families import llama, qwen2, qwen3, qwen2_moe, qwen3_moe, mixtral, deepseek_v3  # noqa: E402,F401

__all__ = ["Family", "ModelFacts", "Rule", "Role", "Category", "TensorRole", "family_for", "register",
           "supported_model_types"]
