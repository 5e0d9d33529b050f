"""The one metrics path of `dsconv eval`: perplexity, KL, the logits error, top-1 and answer agreement.

Every evaluation, whether its models run whole in memory (`fidelity.compare`: small models, the fake-quant ONNX) or a
decoder layer at a time (`streamed`), pads its sequences the same way (`batches`, `padded`), hands both models'
logits to the same accumulator in blocks of vocabulary ids (`HeadStats`: online log-sum-exp, so no
[tokens, vocabulary] float64 tensor exists), keeps the same per-position record (`Positions`) and reads the same
figures off it (`text_metrics`; the answers' arg-max: `Positions.answer`). A figure cannot drift between the paths:
there is one place it is computed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch


# ------------------------------------------------------------------------------------------------ batches
def batches(seqs: list[list[int]], batch_tokens: int) -> list[list[int]]:
    """Sequences into padded batches: longest first, as many as fit in batch_tokens."""
    order = sorted(range(len(seqs)), key=lambda j: (-len(seqs[j]), j))
    out = []
    while order:
        per = max(1, batch_tokens // len(seqs[order[0]]))
        out.append(order[:per])
        order = order[per:]
    return out


def padded(seqs: list[list[int]], group: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, L] of the sequences in `group`, right-padded with 0, and the mask of real tokens. Right padding
    never reaches a real token under a causal mask, so real positions compute as unpadded ones."""
    L = max(len(seqs[j]) for j in group)
    ids = torch.zeros(len(group), L, dtype=torch.long)
    mask = torch.zeros(len(group), L, dtype=torch.bool)
    for r, j in enumerate(group):
        ids[r, : len(seqs[j])] = torch.tensor(seqs[j])
        mask[r, : len(seqs[j])] = True
    return ids, mask


@dataclass
class Rows:
    """Which real positions a padded batch holds, in mask order: sequence, position, the next token (-1: none)."""

    seq: torch.Tensor
    pos: torch.Tensor
    targets: torch.Tensor

    @staticmethod
    def of(group: list[int], ids: torch.Tensor, mask: torch.Tensor) -> "Rows":
        nxt = torch.full_like(ids, -1)
        nxt[:, :-1] = torch.where(mask[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], -1))
        r, c = torch.where(mask)
        return Rows(torch.tensor(group)[r], c, nxt[mask])

    @staticmethod
    def cat(parts: list["Rows"]) -> "Rows":
        return Rows(*(torch.cat([getattr(p, k) for p in parts]) for k in ("seq", "pos", "targets")))


# ------------------------------------------------------------------------------------------------ the accumulator
@dataclass
class HeadStats:
    """What both models' logits give per position, accumulated over blocks of vocabulary ids."""

    n: int
    m: dict[str, torch.Tensor] = field(default_factory=dict)        # running max logit
    s: dict[str, torch.Tensor] = field(default_factory=dict)        # sum exp(logit - m)
    arg: dict[str, torch.Tensor] = field(default_factory=dict)      # arg-max so far (first of equals)
    target: dict[str, torch.Tensor] = field(default_factory=dict)   # logit of the next token
    t: torch.Tensor | None = None                                     # sum exp(lo - m_o) * (lo - lq)
    abs_sum: torch.Tensor | None = None                               # per position: sum |lq - lo|
    ref_abs_sum: torch.Tensor | None = None                           # sum |lo|
    abs_max: torch.Tensor | None = None                               # max |lq - lo|
    _buffers: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)

    def add(self, lo: torch.Tensor, lq: torch.Tensor, start: int, targets: torch.Tensor) -> None:
        """Logits of vocabulary ids [start, start + block) for both models; `targets` the next ids (-1: none).

        The exponentials and the KL's weighted sum are float64 (KL is a difference of log-sum-exps near 10: float32
        would leave it 1e-4 relative), the absolute errors float32 summed per block then carried in float64. Every
        step writes into buffers kept across blocks: fresh temporaries made this 9x the head's matmuls, in page
        faults more than in arithmetic."""
        d, work, w64, d64 = self._scratch(lo.shape)
        torch.sub(lq, lo, out=d)
        torch.abs(d, out=work)
        d_sum, d_max = work.sum(1).double(), work.amax(1)
        r_sum = torch.abs(lo, out=work).sum(1).double()
        if self.abs_sum is None:
            self.abs_sum, self.ref_abs_sum, self.abs_max = d_sum, r_sum, d_max
        else:
            self.abs_sum, self.ref_abs_sum = self.abs_sum + d_sum, self.ref_abs_sum + r_sum
            self.abs_max = torch.maximum(self.abs_max, d_max)
        old_m = self.m.get("o")
        rows = torch.where((targets >= start) & (targets < start + lo.shape[1]))[0]
        for key, logits in (("o", lo), ("q", lq)):
            bmax, barg = logits.max(dim=1)
            bmax64 = bmax.double()
            m = bmax64 if key not in self.m else torch.maximum(self.m[key], bmax64)
            e = w64.copy_(logits).sub_(m[:, None]).exp_()
            block_sum = e.sum(1)
            if key not in self.m:
                self.s[key] = block_sum
                self.arg[key] = barg + start
                self.target[key] = torch.full((self.n,), float("nan"), dtype=torch.float64)
            else:
                self.s[key] = self.s[key] * torch.exp(self.m[key] - m) + block_sum
                self.arg[key] = torch.where(bmax64 > self.m[key], barg + start, self.arg[key])
            self.m[key] = m
            self.target[key][rows] = logits[rows, targets[rows] - start].double()
            if key == "o":  # sum exp(lo - m_o) * (lo - lq), rescaled to the new running max
                part = -e.mul_(d64.copy_(d)).sum(1)
                self.t = part if self.t is None else self.t * torch.exp(old_m - m) + part

    def _scratch(self, shape: torch.Size) -> tuple[torch.Tensor, ...]:
        """Buffers of a block's shape (two float32, two float64: a mixed-dtype product costs 4x), kept across
        blocks."""
        if self._buffers is None or self._buffers[0].shape != shape:
            f64 = dict(dtype=torch.float64)
            self._buffers = (torch.empty(shape), torch.empty(shape), torch.empty(shape, **f64), torch.empty(shape, **f64))
        return self._buffers

    def add_blocks(self, lo: torch.Tensor, lq: torch.Tensor, targets: torch.Tensor, block: int) -> None:
        """Whole-vocabulary logits [N, V] of both models, taken `block` vocabulary ids at a time."""
        for start in range(0, lo.shape[1], block):
            self.add(lo[:, start:start + block], lq[:, start:start + block], start, targets)

    def lse(self, key: str) -> torch.Tensor:
        return self.m[key] + torch.log(self.s[key])

    def kl(self) -> torch.Tensor:
        """KL(original || quantized) per position: E_po[lo - lq] - lse_o + lse_q."""
        return self.t / self.s["o"] - self.lse("o") + self.lse("q")


def vocab_block(n: int, budget_bytes: int) -> int:
    """Vocabulary ids per `HeadStats.add` so that a block's float64 temporaries of n positions stay near budget."""
    return max(1, budget_bytes // (8 * max(1, n)))


# ------------------------------------------------------------------------------------------------ per position
@dataclass
class Positions:
    """Per evaluated position (real tokens only, batch order): both models' arg-max and next-token NLL, the KL."""

    seq: np.ndarray          # which sequence
    pos: np.ndarray          # position within it
    arg_o: np.ndarray
    arg_q: np.ndarray
    nll_o: np.ndarray        # NaN where the position has no next token
    nll_q: np.ndarray
    kl: np.ndarray
    abs_sum: np.ndarray      # per position: sum over the vocabulary of |lq - lo|
    ref_abs_sum: np.ndarray  # sum of |lo|
    abs_max: np.ndarray      # max |lq - lo|
    vocab: int
    layer_seconds: list[float] = field(default_factory=list)
    expert_seconds: float = 0.0
    expert_runs: int = 0

    @staticmethod
    def of(st: HeadStats, rows: Rows, vocab: int, **timing: Any) -> "Positions":
        has = rows.targets >= 0
        nll = {k: torch.where(has, st.lse(k) - st.target[k], torch.full_like(st.m[k], math.nan)) for k in ("o", "q")}
        return Positions(seq=rows.seq.numpy(), pos=rows.pos.numpy(), arg_o=st.arg["o"].numpy(),
                         arg_q=st.arg["q"].numpy(), nll_o=nll["o"].numpy(), nll_q=nll["q"].numpy(),
                         kl=st.kl().numpy(), abs_sum=st.abs_sum.numpy(), ref_abs_sum=st.ref_abs_sum.numpy(),
                         abs_max=st.abs_max.numpy(), vocab=vocab, **timing)

    @staticmethod
    def concat(parts: list["Positions"], offsets: list[int]) -> "Positions":
        """The positions of parts that each evaluated a run of sequences (sequence ids from `offsets`)."""
        cat = lambda key: np.concatenate([getattr(p, key) for p in parts])  # noqa: E731
        return Positions(seq=np.concatenate([p.seq + o for p, o in zip(parts, offsets)]), pos=cat("pos"),
                         arg_o=cat("arg_o"), arg_q=cat("arg_q"), nll_o=cat("nll_o"), nll_q=cat("nll_q"), kl=cat("kl"),
                         abs_sum=cat("abs_sum"), ref_abs_sum=cat("ref_abs_sum"), abs_max=cat("abs_max"),
                         vocab=parts[0].vocab,
                         layer_seconds=[sum(x) for x in zip(*(p.layer_seconds for p in parts))],
                         expert_seconds=sum(p.expert_seconds for p in parts),
                         expert_runs=sum(p.expert_runs for p in parts))

    def answer(self, seq: int, start: int, length: int) -> tuple[list[int], list[int]]:
        """Both models' arg-max at positions [start, start + length) of sequence `seq` (a teacher-forced answer:
        start is the prompt's last position): (quantized, float)."""
        rows = np.where(self.seq == seq)[0]
        at = rows[np.argsort(self.pos[rows])][start:start + length]
        return self.arg_q[at].tolist(), self.arg_o[at].tolist()


def text_metrics(p: Positions, seq_ids: set[int] | None = None) -> dict[str, Any]:
    """Perplexity of both models and its change, the logits error, KL(original || quantized) and top-1 agreement over
    the positions of `seq_ids` (all by default)."""
    keep = np.ones(len(p.seq), bool) if seq_ids is None else np.isin(p.seq, sorted(seq_ids))
    has = keep & ~np.isnan(p.nll_o)
    predicted = int(has.sum())
    positions = int(keep.sum())
    ppl_o = math.exp(float(p.nll_o[has].sum()) / predicted)
    ppl_q = math.exp(float(p.nll_q[has].sum()) / predicted)
    abs_sum, ref_abs_sum = float(p.abs_sum[keep].sum()), float(p.ref_abs_sum[keep].sum())
    return {"tokens": positions, "predicted_tokens": predicted, "ppl_original": round(ppl_o, 4),
            "ppl_quantized": round(ppl_q, 4), "ppl_change_pct": round((ppl_q / ppl_o - 1.0) * 100.0, 4),
            "logits_mean_abs_error": round(abs_sum / (positions * p.vocab), 6),
            "logits_relative_error": round(abs_sum / ref_abs_sum, 6) if ref_abs_sum else 0.0,
            "logits_max_abs_error": round(float(p.abs_max[keep].max()), 6),
            "kl_divergence": round(float(p.kl[keep].sum()) / positions, 6),
            "top1_agreement": round(float((p.arg_o[keep] == p.arg_q[keep]).sum()) / positions, 6)}


def padded_batches(seqs: list[list[int]], batch_tokens: int) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """(group, ids, mask) of each padded batch, in `batches` order."""
    for group in batches(seqs, batch_tokens):
        yield (group, *padded(seqs, group))
