"""The evaluation pass, one decoder layer at a time: any checkpoint the other stages take can be evaluated.

The hidden states of every evaluated token advance through the float and the quantized model side by side: layer i of
the float model (weights from the source checkpoint) and layer i of the quantized model (weights from the quantize
output, computed as the engine computes them) are the only layers in memory, and neither is ever whole in float32:
- a linear streams its output rows in blocks (`engine_linear.row_blocks`): float rows from the memory-mapped source,
  their pages dropped after use; a quantized linear holds its int8 weight (1 byte a parameter) while it runs;
- routed experts run one at a time (`ExpertLoop`), their weights read when the expert runs;
- the embedding gathers the rows of the evaluated tokens from the mapped table;
- the vocabulary projection runs in blocks of rows with online log-sum-exp, so perplexity, KL, the logits error,
  top-1 and each position's arg-max come out without a [tokens, vocabulary] tensor.
Padding, batching and every figure are dsconv.runner.metrics', which the in-memory path (`fidelity.compare`) uses too,
so both compute the same rows: the only difference is the order of float additions in a blocked matmul.

The int8 KV cache of a `--kv-cache int8` output is applied on the quantized side as in-memory evaluation does: C8 by a
cache stand-in that hands the attention its states through int8 (nothing is stored), FA quant by rounding the MLA
latent norm's output.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from dsconv.families.roles import Role
from dsconv.qformat import FA_QUANT
from dsconv.quant.evaluate import engine_linear
from dsconv.quant.evaluate import int8_cache as int8_cache_sim
from dsconv.quant.evaluate.engine_linear import EngineLinear, row_blocks
from dsconv.quant.formats.msmodelslim import quantized_modules, read_linear
from dsconv.runner.layers import ExpertLoop, Skeleton, install_forward
from dsconv.runner.metrics import HeadStats, Positions, Rows, padded_batches


# ------------------------------------------------------------------------------------------------ linears
class FloatRows:
    """A float linear read in blocks of output rows from the mapped checkpoint (pages dropped after each block)."""

    def __init__(self, ck: Any, weight: str, bias: str | None) -> None:
        self.ck, self.name = ck, weight
        self.n, self.k = ck.info(weight).shape
        self.bias = None if bias is None else ck.load(bias).float()

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        w = self.ck.view(self.name)[lo:hi].float()
        self.ck.release_rows(self.name, lo, hi)
        return w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        out = torch.empty(x2.shape[0], self.n, dtype=torch.float32)
        for lo, hi in row_blocks(self.n, self.k):
            out[:, lo:hi] = x2 @ self.rows(lo, hi).T
        if self.bias is not None:
            out += self.bias
        return out.reshape(*shape[:-1], self.n).to(x.dtype)


class LazyEngineLinear:
    """A quantized linear read when it runs and dropped after: one linear's int8 weight in memory at a time."""

    def __init__(self, ck: Any, module: str, qtype: str, path: str | None = None) -> None:
        self.ck, self.module, self.qtype, self.path = ck, module, qtype, path

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return EngineLinear(read_linear(self.ck, self.module, self.qtype), self.path)(x)


class C8PassThrough:
    """A stand-in for the attention's cache that hands back what it is given through int8, storing nothing: every
    query of a teacher-forced pass attends to int8-rounded keys and values, as a decode step does."""

    def __init__(self, scales: dict[int, dict[str, torch.Tensor]]) -> None:
        self.scales = scales

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int | None = None,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return int8_cache_sim.c8_states(self.scales, layer_idx, key_states, value_states)


# ------------------------------------------------------------------------------------------------ one model
class StreamedModel:
    """One side of the evaluation (the float source, or a quantize output) run a decoder layer at a time."""

    def __init__(self, ck: Any, quantized: bool, path: str | None = None) -> None:
        self.ck = ck
        self.path = path  # a W8A8_MIX linear's path (engine_linear.MIX_PATHS)
        self.sk = Skeleton(ck)
        self.types = quantized_modules(ck.quant_description) if quantized else {}
        self.form = int8_cache_sim.cache_form(ck.quant_description) if quantized else None
        self.cache_scales = int8_cache_sim.cache_scales(ck) if self.form else {}
        head = self._head_name()
        self.head = self._linear(head)
        self.vocab = int(ck.info(head + ".weight").shape[0])
        self.softcap = getattr(self.sk.config, "final_logit_softcapping", None)
        norm = self.sk.base.norm
        self.sk.mat.fill(norm)
        self.norm = norm
        self.expert_seconds = 0.0   # time in routed experts, and how many expert runs (benchmarks' projection)
        self.expert_runs = 0

    def _head_name(self) -> str:
        """The vocabulary projection's module name: lm_head, or the embedding where the two are tied."""
        head = next((n for n, r in self.ck.roles.items() if r.role == Role.LM_HEAD and r.layer is None
                     and r.param == "weight"), None)
        return (head or self.sk.embed_name)[: -len(".weight")]

    def _linear(self, module: str) -> Callable[[torch.Tensor], torch.Tensor]:
        t = self.types.get(module)
        if t is not None:
            return LazyEngineLinear(self.ck, module, t, self.path)
        bias = module + ".bias"
        return FloatRows(self.ck, module + ".weight", bias if bias in self.ck else None)

    def head_rows(self, lo: int, hi: int) -> torch.Tensor:
        if isinstance(self.head, FloatRows):
            return self.head.rows(lo, hi)
        return EngineLinear(read_linear(self.ck, self.head.module, self.head.qtype), self.path).rows(lo, hi)

    # ---- the pass ------------------------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of `ids` gathered from the mapped table (never loaded whole), times Gemma's constant."""
        name = self.sk.embed_name
        table = self.ck.view(name)
        out = table[ids.reshape(-1)].float().reshape(*ids.shape, -1)
        self.ck.release(name)
        scale = getattr(self.sk.model.get_input_embeddings(), "scalar_embed_scale", None)
        return out if scale is None else out * torch.tensor(scale, dtype=torch.float32)

    @contextlib.contextmanager
    def layer(self, i: int) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """Layer i with real storage for its norms and routers, its linears and experts streamed; released after."""
        sk = self.sk
        layer = sk.layers[i]
        experts = sk.experts_module(i)
        linears = {m: sk.ck_name(sk.module_names[m]) for m in layer.modules()
                   if isinstance(m, nn.Linear) and sk.ck_name(sk.module_names[m]) + ".weight" in self.ck}
        sk.mat.fill(layer, lambda m: m is experts or m in linears)
        for m, name in linears.items():
            install_forward(m, self._linear(name))
        if experts is not None:
            install_forward(experts, self._experts(i, experts))
        hooks = []
        if self.form == FA_QUANT and i in self.cache_scales:
            hooks.append(int8_cache_sim.fa_round(sk, i, self.cache_scales))
        cache = C8PassThrough(self.cache_scales) if self.form and self.form != FA_QUANT else None

        def run(x: torch.Tensor) -> torch.Tensor:
            y = layer(x, **sk.layer_inputs(x, layer, cache))
            return y[0] if isinstance(y, tuple) else y

        try:
            with torch.no_grad():
                yield run
        finally:
            for h in hooks:
                h.remove()
            for m in [*linears, *([experts] if experts is not None else [])]:
                m.__dict__.pop("forward", None)
            sk.release(i)

    def _experts(self, i: int, experts: nn.Module) -> Callable[..., torch.Tensor]:
        """The routed experts one at a time: a float expert's weights read when it runs, a quantized one's linears
        computed as the engine does; timed, as the projection to 256 experts needs the cost of one."""
        E = int(experts.gate_up_proj.shape[0])

        def names(e: int) -> dict[str, str]:
            return self.sk.expert_weight_names(i, e)

        def linear(e: int, slot: str, x: torch.Tensor, name: str) -> torch.Tensor:
            return self._linear(name[: -len(".weight")])(x)

        loop = ExpertLoop(experts, E, names, linear=linear)

        def timed(*args: Any) -> torch.Tensor:
            started, before = time.perf_counter(), loop.counts.clone()
            out = loop(*args)
            self.expert_seconds += time.perf_counter() - started
            self.expert_runs += int((loop.counts > before).sum())
            return out

        return timed

    def final(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.norm(h)


# ------------------------------------------------------------------------------------------------ logits
def head_pass(orig: StreamedModel, quant: StreamedModel, ho: torch.Tensor, hq: torch.Tensor,
              targets: torch.Tensor) -> HeadStats:
    """Both vocabulary projections over final hidden rows [N, H], in blocks of vocabulary rows."""
    V, H = orig.vocab, ho.shape[1]
    stats = HeadStats(ho.shape[0])
    # a block's logits (two models, float64 temporaries) stay near BLOCK_BYTES
    budget = max(1, engine_linear.BLOCK_BYTES // (8 * max(1, ho.shape[0]))) * 4 * H
    for lo, hi in row_blocks(V, H, budget):
        lo_logits = ho @ orig.head_rows(lo, hi).T
        lq_logits = hq @ quant.head_rows(lo, hi).T
        for side, logits in ((orig, lo_logits), (quant, lq_logits)):
            if side.softcap:
                logits.div_(side.softcap).tanh_().mul_(side.softcap)
        stats.add(lo_logits, lq_logits, lo, targets)
    return stats


# ------------------------------------------------------------------------------------------------ the pass
ACTIVATION_BUDGET = 512 * 2**20  # float32 activations of one batch inside a layer


def batch_tokens(config: Any) -> int:
    """Tokens per batch through a layer, from the widest activation a token makes (the MLP's intermediate, or all
    heads' q/k/v): DeepSeek-V3's 128 MLA heads make 40,960 floats a token, so 2 x 512 tokens in one batch would
    hold 1.8 GB of temporaries; in batches of ~800 the pass stays near 1.2 GB. Small models keep 4096."""
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    if getattr(config, "qk_nope_head_dim", None):  # MLA: q and k (nope + rope) and v per head
        per_head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    else:
        per_head = 3 * int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    width = max(int(getattr(config, "intermediate_size", 0) or 0), heads * per_head, config.hidden_size)
    return int(min(4096, max(64, ACTIVATION_BUDGET // (16 * width))))


@dataclass(frozen=True)
class EvalJob:
    """A run of sequences for one worker (`--workers`, Ray): paths and token ids, nothing of the driver's memory."""

    model: str
    quantized: str
    seqs: list[list[int]]
    paths: tuple[str | None, ...] = (None,)  # W8A8_MIX: the paths the quantized side runs, one Positions each


def eval_job(job: EvalJob) -> list[Positions]:
    """One job: both checkpoints opened by path, the job's sequences through the streamed pass (per path)."""
    from dsconv.checkpoint import Checkpoint

    orig = StreamedModel(Checkpoint.open(job.model), False)
    qck = Checkpoint.open(job.quantized)
    return run_passes(orig, [StreamedModel(qck, True, p) for p in job.paths], job.seqs, batch_tokens(orig.sk.config),
                      progress=False)


def split(seqs: list[list[int]], parts: int) -> list[int]:
    """Start index of each of `parts` contiguous runs of sequences with about equal token counts."""
    total, starts, acc = sum(len(x) for x in seqs), [0], 0
    for j, x in enumerate(seqs):
        if acc >= total * len(starts) / parts and j > starts[-1] and len(starts) < parts:
            starts.append(j)
        acc += len(x)
    return starts


def run_pass(orig: StreamedModel, quant: StreamedModel, seqs: list[list[int]], batch_tokens: int,
             progress: bool = True) -> Positions:
    """Every sequence through both models a layer at a time; the per-position results of the vocabulary projection."""
    return run_passes(orig, [quant], seqs, batch_tokens, progress)[0]


def run_passes(orig: StreamedModel, quants: Sequence[StreamedModel], seqs: list[list[int]], batch_tokens: int,
               progress: bool = True) -> list[Positions]:
    """`run_pass` against several quantized sides at once (W8A8_MIX's two paths): the float model's layers are read
    and run once, not once per side (at DeepSeek-V3's size, reading the weights is most of an eval). One side's layer
    at a time."""
    from tqdm import tqdm

    groups, ids, masks = zip(*padded_batches(seqs, batch_tokens))
    ho = [orig.embed(t) for t in ids]
    hqs = [[quant.embed(t) for t in ids] for quant in quants]
    n_layers = orig.sk.num_layers
    layer_seconds = []
    for i in tqdm(range(n_layers), desc="eval", unit="layer", disable=None if progress else True, leave=False):
        started = time.perf_counter()
        for side, hs in ((orig, ho), *zip(quants, hqs)):
            with side.layer(i) as run:
                for b in range(len(hs)):
                    hs[b] = run(hs[b])
        layer_seconds.append(time.perf_counter() - started)
    rows, fo = [], []
    fqs: list[list[torch.Tensor]] = [[] for _ in quants]
    for k, (g, t, m, xo) in enumerate(zip(groups, ids, masks, ho)):
        rows.append(Rows.of(g, t, m))
        fo.append(orig.final(xo)[m])
        for quant, hq, fq in zip(quants, hqs, fqs):
            fq.append(quant.final(hq[k])[m])
    every, fo_all = Rows.cat(rows), torch.cat(fo).float()
    out = []
    for quant, fq in zip(quants, fqs):
        with torch.no_grad():
            st = head_pass(orig, quant, fo_all, torch.cat(fq).float(), every.targets)
        out.append(Positions.of(st, every, orig.vocab, layer_seconds=layer_seconds,
                                expert_seconds=orig.expert_seconds + quant.expert_seconds,
                                expert_runs=orig.expert_runs + quant.expert_runs))
    return out
