"""A whole shard plan: one layout evaluated end to end (placements, experts, bytes per card, balance, fit),
the valid alternatives of the same world size, and the --json / plan.json object.

layout.py says what the options mean, table.py groups the tensors into kinds, placement.py places each kind;
balance.py and memory.py judge the result.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dsconv.errors import UserError
from dsconv.shard.layout import Layout, divisors
from dsconv.shard.placement import LayoutEval, evaluate_layout
from dsconv.shard.table import TensorTable


@dataclass
class ShardOptions:
    """What the user asked of the plan beyond the layout."""

    placement: str = "contiguous"
    redundant: int = 0
    tolerance: float = 0.02
    fit: Any = None                     # memory.FitSettings
    load: np.ndarray | None = None      # [moe layers, experts] tokens, for eplb
    num_groups: int = 1                 # expert groups (DeepSeek n_group) for hierarchical EPLB
    group_rule: Any = None              # engines.profiles.GroupSplitRule: int4 groups a rank's split must hold


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

    ev = evaluate_layout(table, layout, opts.group_rule)
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
