"""Where each kind lies on the ranks of a layout (split, whole, or first-only), decided by Role (docs/architecture.md).

Quantization auxiliaries and biases follow their weight: split on the same
dim at their own granularity (FP8 128-blocks, int4 groups, packed int4 rows), replicated where the weight's split
dim is not theirs (per-output-channel scales of a column-split weight), and `quant_bias`/`bias` of a column-split
(row-parallel) weight are kept whole on the first rank of the TP group and zero elsewhere: the all-reduce then adds
them exactly once, as TGI/MindIE's row-parallel loaders do (rank 0 holds the bias).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np

from dsconv.families.roles import Role
from dsconv.shard.layout import Layout, layout_violations
from dsconv.shard.table import EXPERT_ROLES, Kind, TensorTable

ATTN_SPLIT_ROLES = (Role.ATTN_IN, Role.ATTN_OUT)
FIRST_ONLY_PARAMS = ("quant_bias", "bias")  # added once after a row-parallel all-reduce


@dataclass(frozen=True)
class Placement:
    """How one kind lies on the ranks.

    scope "all": every rank holds a piece; scope "experts": the cards of the EP ranks that own the expert.
    mode "whole": the full tensor; "split": piece (rank % group) // rep of `parts` equal pieces along `dim`;
    "first": the full tensor on the ranks holding piece 0 of the weight, zeros on the others (row-parallel bias).
    """

    scope: str
    mode: str
    dim: int | None = None
    parts: int = 1
    rep: int = 1
    group: int = 1
    group_name: str = ""

    def piece(self, rank: int) -> int:
        return (rank % self.group) // self.rep

    def slice_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.mode != "split":
            return shape
        s = list(shape)
        s[self.dim] //= self.parts
        return tuple(s)

    def bounds(self, shape: tuple[int, ...], rank: int) -> tuple[int, int]:
        size = shape[self.dim] // self.parts
        p = self.piece(rank)
        return p * size, (p + 1) * size

    def card_bytes(self, nbytes: int) -> int:
        return nbytes // self.parts if self.mode == "split" else nbytes

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"scope": self.scope, "mode": self.mode}
        if self.mode != "whole":
            d.update(dim=self.dim, parts=self.parts, rep=self.rep, group=self.group, group_name=self.group_name)
        return d


class Rejected(Exception):
    """A kind that cannot be placed on this layout; the message names the tensor."""


def _weight_split(kind: Kind, layout: Layout, facts: Any) -> tuple[str, int | None, int, int, int, str, str]:
    """(scope, dim, parts, rep, group, group_name, note) of the weight a kind belongs to."""
    role = kind.role
    wshape = kind.weight_shape if kind.weight_shape is not None else kind.shape
    if role in EXPERT_ROLES:
        scope, group, gname = "experts", layout.moe_tp, "moe_tp"
    elif role.tp_dim is None:
        return "all", None, 1, 1, 1, "", ""
    elif role in ATTN_SPLIT_ROLES:
        scope, group, gname = "all", layout.tp, "tp"
    else:
        scope, group, gname = "all", layout.dense_tp, "dense_tp" if layout.dp_attention else "tp"
    dim = role.tp_dim
    if group == 1 or len(wshape) <= dim:
        return scope, None, 1, 1, group, gname, ""
    wname = kind.describe()
    size = wshape[dim]
    if role in ATTN_SPLIT_ROLES:
        kv = kind.slot in ("k", "v")
        heads = facts.num_kv_heads if kv else facts.num_heads
        if size % heads:
            raise Rejected(f"{wname}: {size} {'rows' if dim == 0 else 'columns'} are not a whole number of "
                           f"{heads} heads")
        if heads % group == 0:
            return scope, dim, group, 1, group, gname, ""
        if kv and group % heads == 0:
            return (scope, dim, heads, group // heads, group, gname,
                    f"tp {group} > {heads} KV heads: each KV head (k_proj/v_proj) is replicated on {group // heads} "
                    f"cards of its TP group")
        what = "KV heads" if kv else "attention heads"
        raise Rejected(f"{wname}: {heads} {what} cannot be split over {gname} {group} "
                       f"({what} % tp != 0{' and tp % KV heads != 0' if kv else ''})")
    if size % group:
        what = {Role.EMBED: "vocab rows", Role.LM_HEAD: "vocab rows"}.get(role, "rows" if dim == 0 else "columns")
        raise Rejected(f"{wname}: {size} {what} cannot be split evenly over {gname} {group}")
    return scope, dim, group, 1, group, gname, ""


def place_kind(kind: Kind, layout: Layout, facts: Any, quant_group: int = 0, group_rule: Any = None
               ) -> tuple[Placement, str]:
    """The placement of one kind on a layout, and a note worth telling the user ('' if none); Rejected if none.

    A follower (scale, offset, bias) whose weight cannot be split raises an empty Rejected: the weight's own kind
    already says why, once.
    """
    try:
        scope, dim, parts, rep, group, gname, note = _weight_split(kind, layout, facts)
    except Rejected:
        if kind.weight_shape is not None:
            raise Rejected("") from None
        raise
    if dim is None:
        return Placement(scope, "whole"), note
    shape = kind.shape
    if kind.weight_shape is None:  # the weight itself
        return Placement(scope, "split", dim, parts, rep, group, gname), note
    wshape = kind.weight_shape
    ndim = len(shape)
    if ndim == 0 or (ndim == 1 and shape[0] == 1 and wshape[0] != 1):
        return Placement(scope, "whole"), note  # per-tensor input_scale / input_offset
    if ndim == 1:
        if dim == 0:
            if shape[0] % parts:
                raise Rejected(f"{kind.describe()}: {shape[0]} values cannot follow their weight's split over "
                               f"{gname} {group}")
            return Placement(scope, "split", 0, parts, rep, group, gname), note
        if kind.param in FIRST_ONLY_PARAMS:
            return Placement(scope, "first", dim, parts, rep, group, gname), note
        return Placement(scope, "whole"), note  # per-output-channel values of a column-split weight
    if dim >= ndim or (shape[dim] == 1 and kind.param != "weight_scale_inv"):
        return Placement(scope, "whole"), note  # per-channel [n, 1] of a column-split weight
    a, w = shape[dim], wshape[dim]
    if a < w:  # coarser than the weight: FP8 blocks or int4 groups
        if kind.param == "weight_scale_inv":
            block = (getattr(facts, "fp8_block", None) or (128, 128))[dim]
            what = f"FP8 {block}-blocks"
        elif dim == 1 and quant_group:
            block, what = quant_group, f"groups of {quant_group}"
        else:
            block, what = math.ceil(w / a), f"blocks of {math.ceil(w / a)}"
        piece = w // parts
        wn = kind.weights[0] or kind.names[0]
        more = f" (and {len(kind.names) - 1} more like it)" if len(kind.names) > 1 else ""
        if a % parts or w % parts or piece % block:
            raise Rejected(f"{wn}{more}: {a} {what} along {'rows' if dim == 0 else 'columns'} cannot be split "
                           f"over {gname} {group} ({a} % {parts} != 0 or a piece of {w / parts:g} is not whole "
                           f"blocks)")
        if group_rule is not None and dim == 1 and quant_group and a // parts < group_rule.min_groups:
            raise Rejected(f"{wn}{more}: {gname} {group} leaves each rank {a // parts} of its {a} {what}: "
                           f"{group_rule.label}: {group_rule.rule.text} ({group_rule.rule.source})")
    elif a % parts:
        raise Rejected(f"{kind.describe()}: {a} along dim {dim} cannot follow its weight's split over {gname} {group}")
    return Placement(scope, "split", dim, parts, rep, group, gname), note


@dataclass
class LayoutEval:
    """A layout evaluated on a table: per-kind placements, per-card bytes, and the reasons it is rejected."""

    layout: Layout
    placements: list[Placement | None]
    notes: list[str]
    rejections: list[str]
    common_bytes: int                       # bytes every card holds (everything but routed experts)
    common_by_category: dict[str, int]
    expert_bytes: np.ndarray                # [moe layers, experts] bytes per card of one copy of each expert


def evaluate_layout(table: TensorTable, layout: Layout, group_rule: Any = None) -> LayoutEval:
    facts = table.facts
    placements: list[Placement | None] = []
    notes: list[str] = []
    rejections = list(layout_violations(layout, bool(table.num_experts)))
    common = 0
    by_cat: dict[str, int] = {}
    ebytes = np.zeros((len(table.moe_layers), max(table.num_experts, 1)), dtype=np.int64)
    if rejections:
        return LayoutEval(layout, [None] * len(table.kinds), notes, rejections, 0, {}, ebytes)
    for kind in table.kinds:
        try:
            p, note = place_kind(kind, layout, facts, table.quant_group, group_rule)
        except Rejected as e:
            if str(e):
                rejections.append(str(e))
            placements.append(None)
            continue
        placements.append(p)
        if note and note not in notes:
            notes.append(note)
        b = p.card_bytes(kind.nbytes)
        if kind.is_expert:
            np.add.at(ebytes, (np.asarray(kind.layers), np.asarray(kind.experts)), b)
        else:
            common += b * len(kind.names)
            by_cat[kind.category.value] = by_cat.get(kind.category.value, 0) + b * len(kind.names)
    return LayoutEval(layout, placements, notes, rejections, common, by_cat, ebytes)


# ------------------------------------------------------------------------------------ per-tensor materialisation
def holders(p: Placement, owners: Iterable[int] | None, layout: Layout) -> list[int]:
    """Card ranks that hold a tensor: all, or the cards of its EP owners."""
    if p.scope == "all":
        return list(range(layout.world))
    return [c for e in sorted(set(owners or ())) for c in layout.cards_of_ep_rank(e)]


def iter_tensor_ranks(table: TensorTable, ev: LayoutEval, owners: list[list[list[int]]] | None
                      ) -> Iterator[tuple[str, Kind, Placement, list[int]]]:
    """(name, kind, placement, holding ranks) for every tensor, in source order.

    `owners[moe_layer][expert]` lists the EP ranks holding a copy of that expert (more than one with redundancy).
    """
    all_ranks = list(range(ev.layout.world))
    for name in table.order:
        k, i = table.where[name]
        kind = table.kinds[k]
        p = ev.placements[k]
        if p.scope == "all":
            yield name, kind, p, all_ranks
        else:
            yield name, kind, p, holders(p, owners[kind.layers[i]][kind.experts[i]], ev.layout)


def tensor_entry(kind: Kind, p: Placement, ranks: list[int], world: int) -> dict[str, Any]:
    """plan.json's record of one tensor: its shape and where each rank's slice comes from."""
    d: dict[str, Any] = {"dtype": kind.dtype, "shape": list(kind.shape), **p.as_dict()}
    d["ranks"] = "all" if len(ranks) == world else ranks
    return d


def slice_for_rank(entry: dict[str, Any], rank: int) -> tuple[int | None, int, int]:
    """(dim, start, stop) of `rank`'s slice of a tensor from its plan.json entry (dim None: the whole tensor)."""
    if entry["mode"] != "split":
        return None, 0, 0
    dim, parts, rep, group = entry["dim"], entry["parts"], entry["rep"], entry["group"]
    size = entry["shape"][dim] // parts
    piece = (rank % group) // rep
    return dim, piece * size, (piece + 1) * size


def is_first_holder(entry: dict[str, Any], rank: int) -> bool:
    """For mode "first": does `rank` hold the real values (the others hold zeros)?"""
    return (rank % entry["group"]) // entry["rep"] == 0
