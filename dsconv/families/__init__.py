"""The registry of model families: `model_type` -> Family. The only place that knows tensor names.

A family is one file: a `Family` subclass decorated with `@register`, with its table (base.TensorRow rows, written
with keywords), its config keys (`config_keys`, `_facts`) and its tiny config. Every module of this package is
imported below, so the decorator registers the family: no list to keep. `family_for(config)` looks it up and lists
the supported types when a model_type is unknown.

Adding a family (everything else - classification, synthesis, inspect, quantize, shard, the torch builder, the
MindSpore network's weight lookup, the tiny test model - follows from these):
  1. `families/<name>.py`: an `@register` class with `model_types`; `table` from the row builders in rows.py
     (`decoder`, `gqa_attention`, `qk_norm`, `dense_mlp`, `experts`, `router`, `swiglu`, `linear`, `norm`, ...) plus
     `TensorRow(key=, name=, role=, category=, shape=, ...)` rows of its own, per-layer names starting with `LAYER`;
     `layer_prefix` when the checkpoint's layers are not under "model.layers."; `tiny` config keys; `config_keys`
     (every config.json key `_facts` reads, with its default or REQUIRED: checked when the config is read, fuzzed by
     benchmarks/fuzz.py) and `_facts` for those the base does not read (MoE counts, `router`, `sliding`, ...);
     optionally `fused_renames`. The table is checked when the class is defined (base.TableError);
  2. only for an op no family had: a MindSpore block in model/ms/ (as mla.py), chosen in model/ms/build.py.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from dsconv.errors import UserError
from dsconv.families.base import REGISTRY, Family, TensorRow, register, registered
from dsconv.families.facts import ModelFacts
from dsconv.families.roles import Category, Role, TensorRole

#: the modules of this package that define no family
NOT_FAMILIES = frozenset({"base", "facts", "roles", "rows"})


def supported_model_types() -> list[str]:
    return sorted(REGISTRY)


def families() -> list[Family]:
    """Every registered family once (registration order)."""
    return registered()


#: model types the field ships that dsconv knows of but does not take yet, and what is missing
NOT_YET = {
    "glm_moe_dsa": "GLM-5's DeepSeek-style sparse attention has no family here yet",
    "deepseek_v4": "DeepSeek-V4 has no family here yet",
    "minimax_m2": "MiniMax-M2 has no family here yet",
}


def family_for(config: dict[str, Any], where: str = "config.json") -> Family:
    model_type = config.get("model_type")
    if model_type not in REGISTRY:
        why = f" ({NOT_YET[model_type]})" if model_type in NOT_YET else ""
        raise UserError(f"{where}: model_type {model_type!r} is not supported{why}",
                        hint=f"dsconv supports {', '.join(supported_model_types())}")
    return REGISTRY[model_type]


def _import_family_modules() -> None:
    """Import every family module (by name order, the order of `families()`): each registers itself."""
    for name in sorted({m.name for m in pkgutil.iter_modules(__path__)} - NOT_FAMILIES):
        importlib.import_module(f"{__name__}.{name}")


_import_family_modules()

__all__ = ["Family", "ModelFacts", "TensorRow", "Role", "Category", "TensorRole", "family_for", "register",
           "supported_model_types"]
