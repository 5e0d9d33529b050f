"""The source's tensors grouped into kinds (same role, param, dtype, shape), from headers or config.json alone.

Why "kinds": the 91,991 tensors of DeepSeek-V3 fall into a few dozen kinds (same role, param, dtype and shape), so a
layout is evaluated per kind plus one numpy matrix of expert bytes: planning and trying alternative layouts take
milliseconds after the tensor list is read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from dsconv.errors import UserError
from dsconv.families.roles import Category, Role, TensorRole
from dsconv.tensors import DTYPE_SIZES

EXPERT_ROLES = (Role.EXPERT_IN, Role.EXPERT_OUT)


@dataclass
class Kind:
    """Tensors that are placed alike: same role, param, dtype, shape (and the shape of the weight they follow)."""

    role: Role
    category: Category
    param: str
    dtype: str
    shape: tuple[int, ...]
    slot: str | None
    weight_shape: tuple[int, ...] | None  # the weight this tensor follows (aux, bias); None: it is the weight
    weight_dtype: str | None
    names: list[str] = field(default_factory=list)
    layers: list[int] = field(default_factory=list)   # experts only: MoE layer position
    experts: list[int] = field(default_factory=list)  # experts only: expert index
    weights: list[str | None] = field(default_factory=list)  # the weight name each tensor follows

    @property
    def is_expert(self) -> bool:
        return self.role in EXPERT_ROLES

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def describe(self) -> str:
        more = f" (and {len(self.names) - 1} more like it)" if len(self.names) > 1 else ""
        return f"{self.names[0]}{more}"


@dataclass
class TensorTable:
    """The source's tensors grouped into kinds (built once per input, reused by every layout tried)."""

    kinds: list[Kind]
    order: list[str]  # tensor names in source (file, offset) order: the write order
    where: dict[str, tuple[int, int]]  # name -> (kind index, position in the kind)
    facts: Any
    quant_group: int
    num_experts: int
    moe_layers: tuple[int, ...]
    total_bytes: int

    def __len__(self) -> int:
        return len(self.order)


def build_table(src: Any) -> TensorTable:
    """Group `src.tensors` (a Checkpoint or ConfigOnly) into kinds; one pass, dictionary work only."""
    facts = src.facts
    tensors = src.tensors
    roles: dict[str, TensorRole] = src.roles
    moe_pos = {layer: i for i, layer in enumerate(facts.moe_layers)}
    kinds: list[Kind] = []
    where: dict[str, tuple[int, int]] = {}
    total = 0
    infos = list(tensors.values())
    if infos and hasattr(infos[0], "start"):
        # file order by the object's id: hashing a Path runs Python code, and 163 files' objects serve 91,991 tensors
        objs = {id(f): f for f in map(attrgetter("file"), infos)}
        rank = {f: r for r, f in enumerate(sorted(set(objs.values())))}
        files = {k: rank[f] for k, f in objs.items()}
        infos.sort(key=lambda i: (files[id(i.file)], i.start))
    num_experts = facts.num_experts
    kind_of: dict[tuple, tuple] = {}  # key -> (index, names, weights, layers, experts): 91,991 passes, few kinds
    for info in infos:
        name = info.name
        r = roles[name]
        weight = wshape = wdtype = None
        if r.param != "weight":
            wname = r.module + ".weight"
            winfo = tensors.get(wname)
            if winfo is not None:
                weight, wshape, wdtype = wname, winfo.shape, winfo.dtype
        key = (r.role, r.category, r.param, info.dtype, info.shape, r.slot, wshape, wdtype)
        entry = kind_of.get(key)
        if entry is None:
            kind = Kind(r.role, r.category, r.param, info.dtype, info.shape, r.slot, wshape, wdtype)
            entry = kind_of[key] = (len(kinds), kind.names, kind.weights, kind.layers, kind.experts)
            kinds.append(kind)
        k, names, weights, layers, experts = entry
        where[name] = (k, len(names))
        names.append(name)
        weights.append(weight)
        if r.role in EXPERT_ROLES:
            pos = moe_pos.get(r.layer)
            if pos is None or r.expert is None or not 0 <= r.expert < num_experts:
                raise UserError(f"tensor {name}: expert {r.expert} of layer {r.layer} is outside the config's "
                                f"{num_experts} experts in MoE layers",
                                hint="the weights and config.json disagree")
            layers.append(pos)
            experts.append(r.expert)
        total += info.nbytes
    desc = getattr(src, "quant_description", None) or {}
    try:
        group = int(desc.get("group_size", 0) or 0)
    except (TypeError, ValueError):
        group = 0
    return TensorTable(kinds=kinds, order=[i.name for i in infos], where=where,
                       facts=facts, quant_group=group, num_experts=facts.num_experts if facts.is_moe else 0,
                       moe_layers=tuple(facts.moe_layers) if facts.is_moe else (), total_bytes=total)
