"""Does each card fit: weights + KV cache + workspace + communication buffers vs HBM x fraction.

The budget per card is the SoC's usable memory (dsconv/atc_profiles, via `dsconv.soc.soc_facts`) x `--memory-fraction`
(MindIE's NPU_MEMORY_FRACTION, default 0.8). What goes in it:

* weights: the plan's bytes on that card;
* KV cache: `--batch` sequences of `--max-context` tokens per attention DP group. MLA (DeepSeek) caches the latent,
  replicated on every TP rank, and DeepSeek-V3.2 its indexer's keys beside it; MHA/GQA caches K and V split by tp
  while tp <= KV heads, in the full-attention layers only (ModelFacts.kv_bytes_per_token); a hybrid model's
  linear-attention layers keep a constant state per sequence instead, split by tp with the heads
  (ModelFacts.state_bytes_per_sequence: `--batch` of them);
* workspace (an estimate, `--workspace-gb` replaces it): 1 GiB of runtime reserve (CANN context, operator binaries,
  the ATB workspace pool) + activations of one prefill chunk (min(max_context x batch, 8192) tokens, MindIE's default
  maxPrefillTokens): 6 hidden-size vectors per token (residual, norm, attention in/out, MoE in/out), 3 local MLP
  intermediates (gate, up, act) for the widest MLP on the card, the tokens all-gathered from the other DP groups
  before the MoE (EP with AllGather, MindIE ep_level 1), and the float32 logits of the batch;
* communication buffers: HCCL allocates HCCL_BUFFSIZE (default 200 MiB) for input and output per communicator;
  a card joins one per parallel group of size > 1 (attention tp, dense tp, moe_ep, moe_tp, the world for dp > 1).

"KV tokens left" is how many more cached tokens the card holds after the requested ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

GiB = 2**30
MiB = 2**20
RUNTIME_RESERVE = 1 * GiB
HCCL_BUFFSIZE = 200 * MiB
PREFILL_TOKENS = 8192
ACT_BYTES = 2


@dataclass(frozen=True)
class FitSettings:
    soc: str
    card_bytes: int            # usable device memory of the SoC
    fraction: float = 0.8
    max_context: int = 4096
    batch: int = 1
    kv_bytes: int = 2          # bytes per cached element (2: BF16/FP16, 1: int8 C8)
    workspace_bytes: int | None = None  # override of the estimate (runtime + activations)

    @property
    def budget(self) -> int:
        return int(self.card_bytes * self.fraction)


def workspace_estimate(facts: Any, layout: Any, s: FitSettings) -> dict[str, int]:
    """Runtime reserve + activations + HCCL buffers per card (see the module docstring for what each counts)."""
    tokens = min(s.max_context * s.batch, PREFILL_TOKENS)
    h = facts.hidden_size
    dense_i = facts.intermediate_size // max(layout.dense_tp, 1) if facts.intermediate_size else 0
    moe_i = 0
    if facts.is_moe:
        moe_i = facts.shared_intermediate_size // max(layout.dense_tp, 1) + \
            facts.experts_per_tok * facts.moe_intermediate_size // max(layout.moe_tp, 1)
    inter = max(dense_i, moe_i)
    act = tokens * ACT_BYTES * (6 * h + 3 * inter)
    if facts.is_moe and layout.dp > 1:
        act += tokens * layout.dp * h * ACT_BYTES
    act += s.batch * (facts.vocab_size // max(layout.dense_tp, 1)) * 4
    groups = [layout.tp, layout.dense_tp if layout.dense_tp != layout.tp else 1]
    if facts.is_moe:
        groups += [layout.ep, layout.moe_tp if layout.moe_tp not in (layout.tp,) else 1]
    if layout.dp > 1:
        groups.append(layout.world)
    comm = sum(2 * HCCL_BUFFSIZE for g in groups if g > 1)
    if s.workspace_bytes is not None:
        return {"runtime": 0, "activations": int(s.workspace_bytes), "comm": comm}
    return {"runtime": RUNTIME_RESERVE, "activations": int(act), "comm": comm}


@dataclass
class FitReport:
    budget: int
    kv_per_token: int
    kv_requested: int
    workspace: dict[str, int]
    state_bytes: int = 0  # linear-attention state of the batch (included in kv_requested)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.reasons

    @property
    def min_kv_tokens(self) -> int:
        return min((r["kv_tokens_max"] for r in self.ranks), default=0)

    def as_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget, "kv_bytes_per_token": self.kv_per_token,
                "kv_requested_bytes": self.kv_requested, "workspace": self.workspace, "ok": self.ok,
                **({"state_bytes": self.state_bytes} if self.state_bytes else {}),
                "min_kv_tokens": self.min_kv_tokens}


def check_fit(rank_bytes: np.ndarray, facts: Any, layout: Any, s: FitSettings, describe_ranks) -> FitReport:
    kv_tok = facts.kv_bytes_per_token(s.kv_bytes, layout.tp)
    requested_tokens = s.max_context * s.batch
    state = facts.state_bytes_per_sequence(ACT_BYTES, layout.tp) * s.batch
    kv_req = kv_tok * requested_tokens + state
    ws = workspace_estimate(facts, layout, s)
    ws_total = sum(ws.values())
    rep = FitReport(s.budget, kv_tok, kv_req, ws, state_bytes=state)
    over: dict[int, list[int]] = {}
    for r, w in enumerate(rank_bytes):
        w = int(w)
        room = s.budget - w - ws_total - state
        tokens_max = max(room, 0) // kv_tok if kv_tok else 0
        hbm = w + kv_req + ws_total
        free = s.budget - hbm
        rep.ranks.append({"weights": w, "kv": kv_req, "workspace": ws_total, "hbm": hbm, "free": free,
                          "kv_tokens_max": int(tokens_max), "kv_tokens_left": int(tokens_max - requested_tokens)})
        if free < 0:
            over.setdefault(w, []).append(r)
    gib = 1 / GiB
    for w, ranks in sorted(over.items(), reverse=True):
        f = rep.ranks[ranks[0]]
        rep.reasons.append(
            f"{describe_ranks(ranks)}: needs {f['hbm'] * gib:.2f} GiB (weights {w * gib:.2f} + KV {kv_req * gib:.2f} + "
            f"workspace {ws_total * gib:.2f}) > {s.budget * gib:.2f} GiB ({s.fraction:g} of {s.soc}'s "
            f"{s.card_bytes * gib:.0f} GiB); room for {f['kv_tokens_max']:,} of the {requested_tokens:,} KV tokens "
            f"asked")
    return rep
