"""The parallel layout: what `--ep/--tp/--world/--nodes/--dp-attention` mean, and MindIE's rules on them.

* ranks 0..world-1 run node by node, card by card (the HCCL rank table's order);
* attention is split by `tp` inside groups of `tp` consecutive ranks, and replicated over the `dp = world / tp`
  groups (MindIE: tp x dp == worldSize) - the reference's "attention tp 4 / dp 8" for `--ep 8 --tp 4` on 32 cards;
* routed experts are placed whole on `ep` EP ranks (`moe_ep`); each EP rank is `moe_tp = world / ep` consecutive
  cards that split each of its experts like an MLP (expert-TP; MindIE: moe_ep x moe_tp == worldSize);
* embeddings, head, dense MLPs and shared experts follow attention (split by tp, replicated over dp), unless
  `--dp-attention`: then attention alone is data-parallel and those dense parts are split over all `world` cards
  (SGLang's DP-attention layout, vLLM-Ascend's lm-head/dense TP), which lowers their per-card bytes;
* norms, routers, latent projections (q_a, kv_a) and DeepSeek's MTP eh_proj are replicated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsconv.errors import UserError

DEFAULT_CARDS_PER_NODE = 8  # Atlas 800 A2 / 800I A2: 8 NPUs per server
MAX_WORLD = 65536  # ranks: far beyond any deployment of one model; a plan holds per-rank records for each


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
    if world > MAX_WORLD:
        raise UserError(f"world size {world} is more than {MAX_WORLD} cards",
                        hint="check --world, --nodes, --cards-per-node, --ep and --tp")
    return Layout(world=world, tp=tp, ep=ep, nodes=nodes, cards_per_node=cards_per_node, dp_attention=dp_attention)


def layout_violations(layout: Layout, is_moe: bool) -> list[str]:
    """MindIE's parallel rules (docs/engine_rules.md A.1) and the grid's own: each a sentence naming the numbers."""
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


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
