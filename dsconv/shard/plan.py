"""Placement of every tensor on every rank, from headers (or config.json) alone.

The layout (what `--ep/--tp/--world/--nodes/--dp-attention` mean):

* ranks 0..world-1 run node by node, card by card (the HCCL rank table's order);
* attention is split by `tp` inside groups of `tp` consecutive ranks, and replicated over the `dp = world / tp`
  groups (MindIE: tp x dp == worldSize) - the reference's "attention tp 4 / dp 8" for `--ep 8 --tp 4` on 32 cards;
* routed experts are placed whole on `ep` EP ranks (`moe_ep`); each EP rank is `moe_tp = world / ep` consecutive
  cards that split each of its experts like an MLP (expert-TP; MindIE: moe_ep x moe_tp == worldSize);
* embeddings, head, dense MLPs and shared experts follow attention (split by tp, replicated over dp), unless
  `--dp-attention`: then attention alone is data-parallel and those dense parts are split over all `world` cards
  (SGLang's DP-attention layout, vLLM-Ascend's lm-head/dense TP), which lowers their per-card bytes;
* norms, routers, latent projections (q_a, kv_a) and DeepSeek's MTP eh_proj are replicated.

Everything is decided by Role (DESIGN.md). Quantization auxiliaries and biases follow their weight: split on the same
dim at their own granularity (FP8 128-blocks, int4 groups, packed int4 rows), replicated where the weight's split
dim is not theirs (per-output-channel scales of a column-split weight), and `quant_bias`/`bias` of a column-split
(row-parallel) weight are kept whole on the first rank of the TP group and zero elsewhere: the all-reduce then adds
them exactly once, as TGI/MindIE's row-parallel loaders do (rank 0 holds the bias).

Why "kinds": the 91,991 tensors of DeepSeek-V3 fall into a few dozen kinds (same role, param, dtype and shape), so a
layout is evaluated per kind plus one numpy matrix of expert bytes: planning and trying alternative layouts take
milliseconds after the tensor list is read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np

from dsconv.errors import UserError
from dsconv.families.roles import Category, Role, TensorRole
from dsconv.tensors import DTYPE_SIZES

EXPERT_ROLES = (Role.EXPERT_IN, Role.EXPERT_OUT)
ATTN_SPLIT_ROLES = (Role.ATTN_IN, Role.ATTN_OUT)
DEFAULT_CARDS_PER_NODE = 8  # Atlas 800 A2 / 800I A2: 8 NPUs per server
FIRST_ONLY_PARAMS = ("quant_bias", "bias")  # added once after a row-parallel all-reduce


# ------------------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Layout:
    """The parallel layout: world size, attention tp, MoE ep, cluster shape."""

    world: int
    tp: int
    ep: int
    nodes: int
    cards_per_node: int
    dp_attention: bool = False

    @property
    def dp(self) -> int:
        return self.world // self.tp

    @property
    def moe_tp(self) -> int:
        return self.world // self.ep

    @property
    def dense_tp(self) -> int:
        """TP degree of embeddings, head, dense MLPs and shared experts."""
        return self.world if self.dp_attention else self.tp

    def node_of(self, rank: int) -> int:
        return rank // self.cards_per_node

    def device_of(self, rank: int) -> int:
        return rank % self.cards_per_node

    def ep_rank_of(self, rank: int) -> int:
        return rank // self.moe_tp

    def cards_of_ep_rank(self, ep_rank: int) -> range:
        return range(ep_rank * self.moe_tp, (ep_rank + 1) * self.moe_tp)

    @property
    def ep_nodes(self) -> int:
        """Nodes the EP ranks spread over in whole groups (for hierarchical EPLB), 1 when they do not."""
        per_node = self.cards_per_node // self.moe_tp if self.moe_tp <= self.cards_per_node else 0
        if self.nodes > 1 and per_node and self.ep % self.nodes == 0 and self.ep // self.nodes == per_node:
            return self.nodes
        return 1

    def as_dict(self) -> dict[str, Any]:
        return {"world": self.world, "nodes": self.nodes, "cards_per_node": self.cards_per_node, "tp": self.tp,
                "dp": self.dp, "ep": self.ep, "moe_tp": self.moe_tp, "dense_tp": self.dense_tp,
                "dp_attention": self.dp_attention}

    def label(self) -> str:
        s = f"ep {self.ep} x moe_tp {self.moe_tp}, tp {self.tp} x dp {self.dp}"
        return s + (" (dp-attention)" if self.dp_attention else "")


def make_layout(ep: int | None, tp: int | None, world: int | None = None, nodes: int | None = None,
                cards_per_node: int | None = None, dp_attention: bool = False, is_moe: bool = True,
                expert_tp: int | None = None) -> Layout:
    """The layout the options describe, or a one-line UserError when the options contradict each other.

    World size: `--world`, else nodes x cards-per-node, else ep x tp. Nodes: `--nodes`, else world / cards-per-node
    (8 by default) when that divides, else one node. Rule violations that depend on the model or on MindIE are
    checked later (they are plan rejections, exit 3, with alternatives).
    """
    for opt, v in (("--ep", ep), ("--tp", tp), ("--world", world), ("--nodes", nodes),
                   ("--cards-per-node", cards_per_node), ("--expert-tp", expert_tp)):
        if v is not None and v < 1:
            raise UserError(f"{opt} {v} must be a positive integer")
    tp = tp or 1
    if not is_moe and ep not in (None, 1):
        raise UserError(f"--ep {ep}: the model has no routed experts", hint="use --tp (and --world) for a dense model")
    if nodes is not None and cards_per_node is not None:
        nc = nodes * cards_per_node
        if world is not None and world != nc:
            raise UserError(f"--world {world} but --nodes {nodes} x --cards-per-node {cards_per_node} = {nc}",
                            hint="give one of them, or make them agree")
        world = nc
    elif world is None and nodes is not None:
        world = nodes * DEFAULT_CARDS_PER_NODE
    if world is None:
        world = (ep or 1) * tp
    if ep is None:
        if not is_moe:
            ep = 1
        elif expert_tp is not None:
            if world % expert_tp:
                raise UserError(f"--expert-tp {expert_tp} does not divide world size {world}")
            ep = world // expert_tp
        else:
            ep = world // tp if world % tp == 0 else world
    if is_moe and expert_tp is not None and ep * expert_tp != world:
        raise UserError(f"--ep {ep} x --expert-tp {expert_tp} = {ep * expert_tp}, not the world size {world}",
                        hint="MindIE requires moe_ep x moe_tp == worldSize; drop --expert-tp to derive it")
    if cards_per_node is None:
        if nodes is not None:
            if world % nodes:
                raise UserError(f"world size {world} is not a multiple of --nodes {nodes}",
                                hint="MindIE requires worldSize to be a multiple of the node count")
            cards_per_node = world // nodes
        elif world <= DEFAULT_CARDS_PER_NODE:
            cards_per_node = world
        elif world % DEFAULT_CARDS_PER_NODE == 0:
            cards_per_node = DEFAULT_CARDS_PER_NODE
        else:
            raise UserError(f"world size {world} does not fill nodes of {DEFAULT_CARDS_PER_NODE} cards",
                            hint="pass --nodes N --cards-per-node M")
    if nodes is None:
        if world % cards_per_node:
            raise UserError(f"world size {world} is not a multiple of --cards-per-node {cards_per_node}",
                            hint="MindIE requires worldSize to be a multiple of the node count")
        nodes = world // cards_per_node
    if nodes * cards_per_node != world:
        raise UserError(f"--nodes {nodes} x --cards-per-node {cards_per_node} != world size {world}")
    return Layout(world=world, tp=tp, ep=ep, nodes=nodes, cards_per_node=cards_per_node, dp_attention=dp_attention)


def layout_violations(layout: Layout, is_moe: bool) -> list[str]:
    """MindIE's parallel rules (cluster_config.md) and the grid's own: each a sentence naming the numbers."""
    out = []
    w = layout.world
    if w % layout.tp:
        out.append(f"tp {layout.tp} does not divide world size {w} (MindIE: tp x dp == worldSize)")
    if is_moe and w % layout.ep:
        out.append(f"ep {layout.ep} does not divide world size {w} (MindIE: moe_ep x moe_tp == worldSize)")
    if layout.tp > layout.cards_per_node and layout.tp != w:
        out.append(f"tp {layout.tp} exceeds the {layout.cards_per_node} cards per node and is not the world size "
                   f"{w} (MindIE: tp <= cards per node or == worldSize)")
    if is_moe and w % layout.ep == 0 and layout.moe_tp > layout.cards_per_node and layout.moe_tp != w:
        out.append(f"moe_tp {layout.moe_tp} (= world {w} / ep {layout.ep}) exceeds the {layout.cards_per_node} "
                   f"cards per node and is not the world size (MindIE: moe_tp <= cards per node or == worldSize)")
    if w % layout.nodes:
        out.append(f"world size {w} is not a multiple of the {layout.nodes} nodes (MindIE)")
    return out


# ------------------------------------------------------------------------------------------------- tensor kinds
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
    kind_index: dict[tuple, int] = {}
    kinds: list[Kind] = []
    where: dict[str, tuple[int, int]] = {}
    total = 0
    infos = list(tensors.values())
    if infos and hasattr(infos[0], "start"):
        files = {f: i for i, f in enumerate(sorted({i.file for i in infos}))}
        infos.sort(key=lambda i: (files[i.file], i.start))
    for info in infos:
        name = info.name
        r = roles[name]
        weight = None
        wshape = wdtype = None
        if r.param != "weight":
            wname = r.module + ".weight"
            winfo = tensors.get(wname)
            if winfo is not None:
                weight, wshape, wdtype = wname, winfo.shape, winfo.dtype
        key = (r.role, r.category, r.param, info.dtype, info.shape, r.slot, wshape, wdtype)
        k = kind_index.get(key)
        if k is None:
            k = len(kinds)
            kind_index[key] = k
            kinds.append(Kind(r.role, r.category, r.param, info.dtype, info.shape, r.slot, wshape, wdtype))
        kind = kinds[k]
        where[name] = (k, len(kind.names))
        kind.names.append(name)
        kind.weights.append(weight)
        if r.role in EXPERT_ROLES:
            pos = moe_pos.get(r.layer)
            if pos is None or r.expert is None or not 0 <= r.expert < facts.num_experts:
                raise UserError(f"tensor {name}: expert {r.expert} of layer {r.layer} is outside the config's "
                                f"{facts.num_experts} experts in MoE layers",
                                hint="the weights and config.json disagree")
            kind.layers.append(pos)
            kind.experts.append(r.expert)
        total += info.nbytes
    desc = getattr(src, "quant_description", None) or {}
    try:
        group = int(desc.get("group_size", 0) or 0)
    except (TypeError, ValueError):
        group = 0
    return TensorTable(kinds=kinds, order=[i.name for i in infos], where=where,
                       facts=facts, quant_group=group, num_experts=facts.num_experts if facts.is_moe else 0,
                       moe_layers=tuple(facts.moe_layers) if facts.is_moe else (), total_bytes=total)


# ---------------------------------------------------------------------------------------------------- placement
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


def place_kind(kind: Kind, layout: Layout, facts: Any, quant_group: int = 0) -> tuple[Placement, str]:
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
        if a % parts or w % parts or piece % block:
            wn = kind.weights[0] or kind.names[0]
            more = f" (and {len(kind.names) - 1} more like it)" if len(kind.names) > 1 else ""
            raise Rejected(f"{wn}{more}: {a} {what} along {'rows' if dim == 0 else 'columns'} cannot be split "
                           f"over {gname} {group} ({a} % {parts} != 0 or a piece of {w / parts:g} is not whole "
                           f"blocks)")
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


def evaluate_layout(table: TensorTable, layout: Layout) -> LayoutEval:
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
            p, note = place_kind(kind, layout, facts, table.quant_group)
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


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# --------------------------------------------------------------------------------------------- the whole plan
@dataclass
class ShardOptions:
    """What the user asked of the plan beyond the layout."""

    placement: str = "contiguous"
    redundant: int = 0
    tolerance: float = 0.02
    fit: Any = None                     # memory.FitSettings
    load: np.ndarray | None = None      # [moe layers, experts] tokens, for eplb
    num_groups: int = 1                 # expert groups (DeepSeek n_group) for hierarchical EPLB


@dataclass
class ShardPlan:
    """A layout evaluated end to end: placements, experts, per-card bytes, balance, fit, and why it is rejected."""

    table: TensorTable
    layout: Layout
    options: ShardOptions
    ev: LayoutEval
    experts: Any = None                 # balance.ExpertPlacement
    rank_bytes: np.ndarray | None = None
    balance: Any = None                 # balance.BalanceReport
    fit: Any = None                     # memory.FitReport
    rejections: list[str] = field(default_factory=list)   # divisibility / rules: whole-plan reasons
    alternatives: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.rejections and self.balance is not None and self.balance.ok and self.fit.ok

    def describe_ranks(self, ranks: list[int]) -> str:
        """'rank 5 (node 0, card 5)' or 'ranks 0-3, 8-11 (8 cards)' or 'all 32 cards'."""
        lay = self.layout
        if len(ranks) == 1:
            r = ranks[0]
            return f"rank {r} (node {lay.node_of(r)}, card {lay.device_of(r)})"
        if len(ranks) == lay.world:
            return f"all {lay.world} cards"
        runs, start = [], ranks[0]
        for a, b in zip(ranks, ranks[1:] + [None]):
            if b != a + 1:
                runs.append(f"{start}-{a}" if a > start else f"{a}")
                start = b
        return f"ranks {', '.join(runs)} ({len(ranks)} cards)"

    def reasons(self) -> list[str]:
        """Every reason the plan is rejected, per rank where it is about a rank."""
        out = list(self.rejections)
        if self.balance is not None and not self.balance.ok:
            out.append(f"weight bytes per card are unbalanced: max/mean = {1 + self.balance.imbalance:.4f} "
                       f"({self.balance.imbalance:+.2%}, tolerance {self.balance.tolerance:.1%})")
            e, ep = self.table.num_experts, self.layout.ep
            if e and e % ep and self.experts is not None and not self.experts.redundant:
                out.append(f"  {e} experts do not divide over ep {ep}: EP ranks hold {-(-e // ep)} or {e // ep} "
                           "experts per layer")
            out += ["  " + r for r in self.balance.reasons]
        if self.fit is not None and not self.fit.ok:
            out += self.fit.reasons
        return out

    def owners(self) -> list[list[list[int]]] | None:
        return self.experts.owners(self.table.num_experts) if self.experts is not None else None


def make_plan(table: TensorTable, layout: Layout, opts: ShardOptions, _expert_cache: dict | None = None) -> ShardPlan:
    """Evaluate one layout: placements (divisibility), expert placement, bytes per card, balance and fit."""
    from dsconv.shard.balance import check_balance, place_experts
    from dsconv.shard.memory import check_fit

    ev = evaluate_layout(table, layout)
    plan = ShardPlan(table, layout, opts, ev)
    e = table.num_experts
    plan.rejections = list(ev.rejections)
    if e and e + opts.redundant < layout.ep and layout.world % layout.ep == 0:
        empty = layout.ep - e - opts.redundant
        plan.rejections.append(f"{e} routed experts{f' + {opts.redundant} copies' if opts.redundant else ''} cannot "
                               f"fill {layout.ep} EP ranks: {empty} EP ranks ({empty * layout.moe_tp} cards) would "
                               f"hold no expert at all")
    if plan.rejections:
        return plan
    common = np.full(layout.world, ev.common_bytes, dtype=np.int64)
    if e:
        key = (opts.placement, layout.ep, layout.ep_nodes)
        cached = None if _expert_cache is None else _expert_cache.get(key)
        if cached is None:
            cached = place_experts(opts.placement, e, layout.ep, ev.expert_bytes, load=opts.load,
                                   redundant=opts.redundant, num_groups=opts.num_groups,
                                   num_nodes=layout.ep_nodes, moe_layers=table.moe_layers)
            if _expert_cache is not None:
                _expert_cache[key] = cached
        plan.experts = cached
        per_ep = cached.ep_bytes(ev.expert_bytes)
        common += per_ep[np.arange(layout.world) // layout.moe_tp]
    plan.rank_bytes = common
    plan.balance = check_balance(common, opts.tolerance, plan.describe_ranks)
    plan.fit = check_fit(common, table.facts, layout, opts.fit, plan.describe_ranks)
    return plan


def find_alternatives(table: TensorTable, layout: Layout, opts: ShardOptions, limit: int = 5) -> list[dict[str, Any]]:
    """Valid (ep, tp) layouts of the same world size and cluster, best first (most KV tokens on the fullest card)."""
    found = []
    cache: dict = {}
    eps = divisors(layout.world) if table.num_experts else [1]
    for tp in divisors(layout.world):
        for ep in eps:
            if (tp, ep) == (layout.tp, layout.ep):
                continue
            alt = Layout(layout.world, tp, ep, layout.nodes, layout.cards_per_node, layout.dp_attention)
            try:
                p = make_plan(table, alt, opts, cache)
            except UserError:
                continue
            if p.ok:
                found.append({"ep": ep, "tp": tp, "dp": alt.dp, "moe_tp": alt.moe_tp,
                              "max_weight_bytes": int(p.rank_bytes.max()),
                              "max_over_mean": 1 + p.balance.imbalance,
                              "min_kv_tokens": p.fit.min_kv_tokens,
                              "command": f"--ep {ep} --tp {tp}" + (" --dp-attention" if layout.dp_attention else "")})
    found.sort(key=lambda a: (-a["min_kv_tokens"], a["tp"] + a["moe_tp"]))
    return found[:limit]


def plan_json(plan: ShardPlan, source: dict[str, Any], mindie: dict[str, Any] | None = None) -> dict[str, Any]:
    """The --json object (and the head of plan.json): layout, balance, memory, one record per rank."""
    lay = plan.layout
    out: dict[str, Any] = {"ok": plan.ok, "source": source, "layout": lay.as_dict()}
    if mindie is not None:
        out["mindie"] = mindie
    out["tensor_count"] = len(plan.table)
    out["total_bytes"] = plan.table.total_bytes
    if plan.ev.notes:
        out["notes"] = plan.ev.notes
    if plan.experts is not None:
        ex = plan.experts
        out["experts"] = {"placement": ex.strategy, "redundant": ex.redundant, "hierarchical": ex.hierarchical,
                          "per_ep_rank": ex.experts_per_rank(),
                          "per_layer_min": min(len(s) for layer in ex.slots for s in layer),
                          "per_layer_max": max(len(s) for layer in ex.slots for s in layer), **({"load": ex.load_report} if ex.load_report else {})}
    if plan.rank_bytes is not None:
        out["balance"] = plan.balance.as_dict()
        out["memory"] = {**plan.fit.as_dict(), "soc": plan.options.fit.soc,
                         "card_bytes": plan.options.fit.card_bytes, "fraction": plan.options.fit.fraction,
                         "max_context": plan.options.fit.max_context, "batch": plan.options.fit.batch}
        out["common_bytes_by_category"] = plan.ev.common_by_category
        ranks = []
        for r, b in enumerate(plan.rank_bytes):
            f = plan.fit.ranks[r]
            rec = {"rank": r, "node": lay.node_of(r), "device": lay.device_of(r), "bytes": int(b),
                   "hbm_bytes": f["hbm"], "kv_bytes": f["kv"], "workspace_bytes": f["workspace"],
                   "free_bytes": f["free"], "kv_tokens_left": f["kv_tokens_left"]}
            if plan.experts is not None:
                rec["ep_rank"] = lay.ep_rank_of(r)
                rec["expert_bytes"] = int(b - plan.ev.common_bytes)
            ranks.append(rec)
        out["ranks"] = ranks
    if not plan.ok:
        out["rejections"] = plan.reasons()
        out["alternatives"] = plan.alternatives
    return out
