"""Which EP rank holds which routed expert, and whether the cards end up with even weight bytes.

Three placements, per MoE layer:

* `contiguous`: EP rank i owns experts [i*E/ep, (i+1)*E/ep) - what engines do when given no expert map;
* `balanced`: experts packed by bytes, heaviest into the lightest EP rank (counting the bytes it already holds from
  earlier layers), each rank taking its share of experts - evens out experts of different sizes (e.g. experts a
  quantizer kept in BF16);
* `eplb`: DeepSeek's EPLB on measured load (`expert_load.json`, tokens routed to each expert per layer): replicate the
  hottest experts into `--redundant-experts` spare slots, then pack heaviest-into-lightest with equal slots per rank;
  hierarchical (expert groups -> nodes, then cards within a node) when the expert groups divide over the nodes, so
  most expert traffic stays inside a node.

Balancedness is mean/max of the token load per EP rank (1.0 = perfect), averaged over layers as DeepSeek reports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dsconv import schemas
from dsconv.errors import UserError

STRATEGIES = ("contiguous", "balanced", "eplb")


@dataclass
class ExpertPlacement:
    """slots[moe layer][ep rank] = the logical experts (physical slots, replicas included) that EP rank holds."""

    strategy: str
    slots: list[list[list[int]]]
    redundant: int = 0
    hierarchical: bool = False
    load_report: dict[str, Any] = field(default_factory=dict)

    def owners(self, num_experts: int) -> list[list[list[int]]]:
        """owners[moe layer][expert] = EP ranks holding a copy of it."""
        out = []
        for layer in self.slots:
            o: list[list[int]] = [[] for _ in range(num_experts)]
            for ep_rank, experts in enumerate(layer):
                for e in experts:
                    o[e].append(ep_rank)
            out.append(o)
        return out

    def ep_bytes(self, expert_bytes: np.ndarray) -> np.ndarray:
        """Bytes each EP rank holds per card: sum over layers of its experts' per-card bytes."""
        ep = len(self.slots[0]) if self.slots else 0
        out = np.zeros(ep, dtype=np.int64)
        for li, layer in enumerate(self.slots):
            for r, experts in enumerate(layer):
                if experts:
                    out[r] += int(expert_bytes[li, experts].sum())
        return out

    def experts_per_rank(self) -> list[int]:
        return [sum(len(layer[r]) for layer in self.slots) for r in range(len(self.slots[0]))] if self.slots else []


# ----------------------------------------------------------------------------------------------- load file
def read_expert_load(path: Path, num_experts: int, moe_layers: Sequence[int]) -> tuple[np.ndarray, list[int]]:
    """`{"layers": {"<layer>": [tokens per expert, ...]}}` (or the bare `{layer: [...]}` map) -> [moe layers, E].

    Layers are model layer indices (as `dsconv quantize` writes them). MoE layers the file lacks (e.g. an MTP layer
    never calibrated) get uniform load; they are returned so the caller can say so.
    """
    pos = {layer: i for i, layer in enumerate(moe_layers)}
    load = np.full((len(moe_layers), num_experts), np.nan)
    for layer, row in schemas.expert_load(Path(path)).items():
        if layer not in pos:
            raise UserError(f"{path}: layer {layer} is not a MoE layer of this model",
                            hint=f"MoE layers are {moe_layers[0]}..{moe_layers[-1]}" if moe_layers else None)
        if len(row) != num_experts:
            raise UserError(f"{path}: layer {layer} must list {num_experts} non-negative token counts",
                            hint="one number per routed expert, in expert order")
        load[pos[layer]] = row
    missing = [moe_layers[i] for i in range(len(moe_layers)) if np.isnan(load[i, 0])]
    for i in range(len(moe_layers)):
        if np.isnan(load[i, 0]):
            load[i] = 1.0
        elif load[i].sum() == 0:
            load[i] = 1.0  # a layer that saw no token: nothing to balance on
    return load, missing


# ----------------------------------------------------------------------------------------------- algorithms
def balanced_packing(weight: np.ndarray, num_packs: int, base: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Heaviest item into the lightest pack that still has room; packs take ceil(n / packs) items at most.

    Returns (pack of each item, its position inside the pack). `base` is weight the packs already carry.
    """
    n = len(weight)
    cap = -(-n // num_packs)
    load = np.zeros(num_packs) if base is None else np.asarray(base, dtype=float).copy()
    count = np.zeros(num_packs, dtype=np.int64)
    pack = np.empty(n, dtype=np.int64)
    rank = np.empty(n, dtype=np.int64)
    for i in np.argsort(-np.asarray(weight, dtype=float), kind="stable"):
        open_ = np.flatnonzero(count < cap)
        p = open_[np.argmin(load[open_])]
        pack[i], rank[i] = p, count[p]
        load[p] += weight[i]
        count[p] += 1
    return pack, rank


def replicate_experts(weight: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's replication: each spare slot goes to the expert with the highest load per copy.

    Returns (logical expert of each physical slot, copies of each logical expert).
    """
    n = len(weight)
    phy2log = list(range(n))
    count = np.ones(n, dtype=np.int64)
    for _ in range(n, num_physical):
        j = int(np.argmax(weight / count))
        phy2log.append(j)
        count[j] += 1
    return np.asarray(phy2log, dtype=np.int64), count


def eplb_layer(weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
               ) -> list[list[int]]:
    """DeepSeek's hierarchical EPLB for one layer: groups -> nodes, replicate within a node, pack onto its ranks.

    With num_groups = num_nodes = 1 it is the global policy. Returns the logical experts of each EP rank.
    """
    n = len(weight)
    group_size = n // num_groups
    groups_per_node = num_groups // num_nodes
    ranks_per_node = num_ranks // num_nodes
    per_node_log = n // num_nodes
    # 1. expert groups onto nodes, balancing their summed load
    gpack, grank = balanced_packing(weight.reshape(num_groups, group_size).sum(1), num_nodes)
    mlog2log = np.empty(n, dtype=np.int64)  # node-major "middle" order -> logical expert
    for g in range(num_groups):
        base = (gpack[g] * groups_per_node + grank[g]) * group_size
        mlog2log[base:base + group_size] = np.arange(g * group_size, (g + 1) * group_size)
    slots: list[list[int]] = [[] for _ in range(num_ranks)]
    for node in range(num_nodes):
        members = mlog2log[node * per_node_log:(node + 1) * per_node_log]
        w = weight[members]
        # 2. replicate the hottest experts of this node into its spare slots
        phy2m, count = replicate_experts(w, num_physical // num_nodes)
        # 3. pack the physical experts (load shared by their copies) onto the node's ranks
        pack, pos = balanced_packing((w / count)[phy2m], ranks_per_node)
        for p in np.lexsort((pos, pack)):
            slots[node * ranks_per_node + int(pack[p])].append(int(members[phy2m[p]]))
    return slots


def rank_loads(weight: np.ndarray, slots: list[list[int]]) -> np.ndarray:
    """Token load per EP rank: each copy of an expert takes an equal share of its tokens."""
    count = np.zeros(len(weight))
    for experts in slots:
        for e in experts:
            count[e] += 1
    share = np.divide(weight, count, out=np.zeros(len(weight)), where=count > 0)
    return np.array([share[experts].sum() if experts else 0.0 for experts in slots])


def contiguous_slots(num_experts: int, ep: int) -> list[list[int]]:
    return [list(map(int, part)) for part in np.array_split(np.arange(num_experts), ep)]


def load_figures(load: np.ndarray, placements: list[list[list[int]]]) -> dict[str, float]:
    """Mean and max token load per EP rank (per layer, averaged over layers) and balancedness = mean/max."""
    means, maxes, bal = [], [], []
    for li, slots in enumerate(placements):
        r = rank_loads(load[li], slots)
        means.append(r.mean())
        maxes.append(r.max())
        bal.append(r.mean() / r.max() if r.max() > 0 else 1.0)
    return {"mean_load": float(np.mean(means)), "max_load": float(np.mean(maxes)),
            "balancedness": float(np.mean(bal)), "worst_layer_balancedness": float(np.min(bal))}


# ----------------------------------------------------------------------------------------------- entry point
def place_experts(strategy: str, num_experts: int, ep: int, expert_bytes: np.ndarray, *, load: np.ndarray | None,
                  redundant: int = 0, num_groups: int = 1, num_nodes: int = 1,
                  moe_layers: Sequence[int] = ()) -> ExpertPlacement:
    """Expert placement for every MoE layer (UserError for options that cannot work on this model)."""
    layers = expert_bytes.shape[0]
    if strategy not in STRATEGIES:
        raise UserError(f"--placement {strategy!r} is unknown", hint=f"use one of {', '.join(STRATEGIES)}")
    if redundant and strategy != "eplb":
        raise UserError("--redundant-experts needs --placement eplb", hint="add --placement eplb --expert-load FILE")
    if strategy == "eplb" and load is None:
        raise UserError("--placement eplb needs --expert-load FILE",
                        hint="pass the expert_load.json that `dsconv quantize` wrote next to its output")
    before = [contiguous_slots(num_experts, ep) for _ in range(layers)]
    if strategy == "contiguous":
        slots = before
        hier = False
    elif strategy == "balanced":
        slots, running = [], np.zeros(ep)
        for li in range(layers):
            pack, pos = balanced_packing(expert_bytes[li].astype(float), ep, base=running)
            layer: list[list[int]] = [[] for _ in range(ep)]
            for e in np.lexsort((pos, pack)):
                layer[int(pack[e])].append(int(e))
            running += np.array([expert_bytes[li, s].sum() for s in layer])
            slots.append(layer)
        hier = False
    else:
        most = num_experts * max(ep - 1, 0)  # a copy of every expert on every other EP rank
        if redundant > most:  # a typo, and EPLB's packing would run for hours
            raise UserError(f"--redundant-experts {redundant} is more copies than {num_experts} experts on each of "
                            f"the other {ep - 1} EP ranks", hint=f"use at most {most} (DeepSeek: 32 for 256 experts)")
        physical = num_experts + redundant
        if physical % ep:
            raise UserError(f"--redundant-experts {redundant}: {num_experts} experts + {redundant} copies = {physical} "
                            f"slots do not divide over {ep} EP ranks",
                            hint=f"use a multiple of {ep} minus {num_experts % ep} (e.g. "
                                 f"{(-num_experts) % ep or ep}) so every EP rank gets the same number of slots")
        hier = (num_nodes > 1 and num_groups % num_nodes == 0 and num_experts % num_groups == 0
                and physical % num_nodes == 0 and ep % num_nodes == 0)
        g, n = (num_groups, num_nodes) if hier else (1, 1)
        slots = [eplb_layer(load[li].astype(float), physical, g, n, ep) for li in range(layers)]
    placement = ExpertPlacement(strategy, slots, redundant, hier)
    if load is not None:
        placement.load_report = {"before": load_figures(load, before), "after": load_figures(load, slots)}
    return placement


def expert_map(placement: ExpertPlacement) -> dict[str, Any]:
    """vLLM-Ascend's static expert map (docs/engine_rules.md): layer_id counts MoE layers from 0, device_id EP ranks."""
    return {"moe_layer_count": len(placement.slots),
            "layer_list": [{"layer_id": li, "device_count": len(layer),
                            "device_list": [{"device_id": d, "device_expert": list(experts)}
                                            for d, experts in enumerate(layer)]}
                           for li, layer in enumerate(placement.slots)]}


# ----------------------------------------------------------------------------------------------- balance check
@dataclass
class BalanceReport:
    mean_bytes: float
    max_bytes: int
    min_bytes: int
    imbalance: float  # max/mean - 1
    tolerance: float
    ok: bool
    reasons: list[str]

    def as_dict(self) -> dict[str, Any]:
        return {"mean_bytes": self.mean_bytes, "max_bytes": self.max_bytes, "min_bytes": self.min_bytes,
                "max_over_mean": 1.0 + self.imbalance, "imbalance": self.imbalance, "tolerance": self.tolerance,
                "ok": self.ok}


def check_balance(rank_bytes: np.ndarray, tolerance: float, describe_ranks) -> BalanceReport:
    """Weight bytes per card: reject when max/mean - 1 exceeds the tolerance; one reason per group of cards out of
    line (cards with the same bytes share a line)."""
    mean = float(rank_bytes.mean()) if len(rank_bytes) else 0.0
    mx = int(rank_bytes.max()) if len(rank_bytes) else 0
    mn = int(rank_bytes.min()) if len(rank_bytes) else 0
    imb = mx / mean - 1.0 if mean > 0 else 0.0
    ok = imb <= tolerance + 1e-12
    reasons = []
    if not ok:
        groups: dict[int, list[int]] = {}
        for r, b in enumerate(rank_bytes):
            if abs(b / mean - 1.0) > tolerance:
                groups.setdefault(int(b), []).append(r)
        for b, ranks in sorted(groups.items(), reverse=True):
            reasons.append(f"{describe_ranks(ranks)}: {b / 2**30:.2f} GiB of weights, {b / mean - 1.0:+.1%} vs the "
                           f"mean {mean / 2**30:.2f} GiB")
    return BalanceReport(mean, mx, mn, imb, tolerance, ok, reasons)
