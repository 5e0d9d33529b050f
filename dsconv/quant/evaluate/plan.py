"""What `dsconv eval` will do, from headers and the tokenizer, before any weight is read: the text's windows and
tokens, the passes, the questions and their answer tokens, and an estimate at this host's measured rates
(`eval --dry-run` prints it; a run prints it first), so a user knows what an eval costs before it starts.

The streamed passes count 2 FLOPs per weight a token meets (every non-expert weight, the vocabulary projection, and
the routed experts a token is sent to: experts_per_tok of num_experts) at the host's matmul rate, and each position's
logits through the metrics accumulator at its measured rate (Gemma 3's 262k vocabulary makes that a third); the float answers,
decoded a token at a time, read every float32 weight a token meets per answer token at the host's matrix-vector
bandwidth, plus each layer's dispatch cost (FLOPs say little there: Gemma-3-270M's answers took 4x their FLOP
estimate). docs/performance.md
measures both against runs.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dsconv.checkpoint import Checkpoint
from dsconv.families.roles import Role
from dsconv.qformat import W8A8_MIX


def active_params(ck: Checkpoint) -> tuple[int, int]:
    """(all weights, the weights one token meets): routed experts counted at experts_per_tok / num_experts; an
    embedding is a lookup, not a matmul, except where it is also the vocabulary projection (tied: Gemma 3, where
    that projection is 63% of the model's weights)."""
    total = active = 0
    f = ck.facts
    share = f.experts_per_tok / f.num_experts if f.num_experts else 1.0
    head = any(ck.role(n).role == Role.LM_HEAD for n in ck.names())
    for name in ck.names():
        r, n = ck.role(name), ck.info(name).numel
        total += n
        if r.role in (Role.EXPERT_IN, Role.EXPERT_OUT):
            active += n * share
        elif r.role == Role.EMBED and not head and r.layer is None and not r.is_aux:
            active += n
        elif r.role not in (Role.EMBED, Role.TOWER) and not r.is_aux:
            active += n
    return total, int(active)


def _median_rate(work: Any, amount: float, seconds: float, trials: int = 5) -> float:
    """amount / seconds of `work()`, the median of `trials` runs of about seconds / trials each (one short run
    varied 2.7x between two calls on the same host)."""
    work()  # warm-up
    rates = []
    for _ in range(trials):
        n, t = 0, time.perf_counter()
        while n == 0 or time.perf_counter() - t < seconds / trials:
            work()
            n += 1
        rates.append(amount * n / (time.perf_counter() - t))
    return sorted(rates)[len(rates) // 2]


def host_rates(seconds: float = 0.5) -> tuple[float, float, float]:
    """This host's float32 matmul FLOP/s (a batch of tokens through a linear: the streamed passes), the bytes/s a
    matrix-vector product streams (one token through a linear: greedy decoding reads every weight per token), and the
    (position x vocabulary id) logits per second the metrics accumulator takes, with torch's threads, as eval runs."""
    import torch

    from dsconv.runner.metrics import HeadStats

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    w, x = torch.empty(8192, 8192).normal_(), torch.randn(8192)  # 256 MB, beyond any cache as a model's weights are
    # (a 128 MB matrix read at 41 GB/s here, a 512 MB one and Qwen's 544 MB head at 27-29)
    flops = _median_rate(lambda: a @ b, 2.0 * 1024 ** 3, seconds / 3)
    bandwidth = _median_rate(lambda: w @ x, 4.0 * w.numel(), seconds / 3)
    lo, targets = torch.randn(4096, 2048), torch.zeros(4096, dtype=torch.long)  # a block of a real pass's shape
    lq, stats = lo + 0.01, HeadStats(4096)
    return flops, bandwidth, _median_rate(lambda: stats.add(lo, lq, 0, targets), lo.numel(), seconds / 3)


def layer_overhead(family: str, steps: int = 8) -> float:
    """Seconds per decoder layer per decoded token beyond reading its weights: the layer's Python and small-kernel
    dispatch (norms, rotary, the cache, attention over few keys), timed on the family's own transformers code with
    tiny widths, all of its tiny layers against the first alone. On this 2-core host it is about 0.5 ms (Qwen2 0.45,
    Gemma 3 0.53): a tenth of a 0.5B model's decode step, which reading its float32 weights dominates."""
    from torch import nn
    from transformers import DynamicCache

    from dsconv.quant.evaluate.qa import greedy
    from dsconv.tiny import build_model

    model = build_model(family)
    layers = model.get_decoder().layers
    per = []
    for keep in (len(layers), 1):
        model.get_decoder().layers = nn.ModuleList(list(layers)[:keep])
        greedy(model, [1, 2, 3], 2, set(), DynamicCache(config=model.config))  # warm-up
        t = time.perf_counter()
        greedy(model, [1, 2, 3], steps, set(), DynamicCache(config=model.config))
        per.append((time.perf_counter() - t) / steps)
    return max(0.0, (per[0] - per[1]) / max(1, len(layers) - 1))


def eval_plan(model_dir: Path, quant_dir: Path, chunks: list[list[int]], source: str, questions: int,
              max_new_tokens: int, prompt_tokens: int) -> dict[str, Any]:
    """The plan of one eval: `chunks` the text's token windows, `questions` with `prompt_tokens` in all."""
    ck, qck = Checkpoint.open(model_dir), Checkpoint.open(quant_dir)
    total, active = active_params(ck)
    desc = qck.quant_description or {}
    paths = 2 if W8A8_MIX in set(desc.values()) else 1  # W8A8_MIX: both of its paths beside one float pass
    tokens = sum(len(c) for c in chunks)
    qa_tokens = prompt_tokens + questions * max_new_tokens  # teacher-forced answers in the streamed pass
    flops = 2.0 * active * (tokens + qa_tokens) * (1 + paths)
    rate, bandwidth, logits_rate = host_rates()
    vocab = int(ck.family.flat_config(ck.config).get("vocab_size") or 0)
    pass_s = flops / rate + paths * (tokens + qa_tokens) * vocab / logits_rate  # + the metrics of each quantized side
    # the float model's greedy answers: the prompts once, then every answer token reads each float32 weight it meets
    # (counted at full length: an answer that stops early costs less)
    answers_s = 0.0
    if questions:
        per_token = 4.0 * active / bandwidth + ck.facts.num_layers * layer_overhead(ck.family.name)
        answers_s = 2.0 * active * prompt_tokens / rate + questions * max_new_tokens * per_token
    return {"text": source, "windows": len(chunks), "tokens": tokens, "questions": questions,
            "answer_tokens": questions * max_new_tokens, "passes": 1 + paths, "params": total,
            "active_params": active, "tflop": round(flops / 1e12, 3), "host_gflops": round(rate / 1e9, 1),
            "host_gbps": round(bandwidth / 1e9, 1), "passes_s": round(pass_s, 3), "answers_s": round(answers_s, 3),
            "estimate_s": round(pass_s + answers_s, 3)}


def render_plan(p: dict[str, Any]) -> str:
    qa = f"; {p['questions']} questions x up to {p['answer_tokens'] // max(1, p['questions'])} answer tokens" \
        if p["questions"] else ""
    answers = f", float answers {p['answers_s']:.0f} s at {p['host_gbps']} GB/s" if p["questions"] else ""
    return (f"plan: {p['text']}: {p['windows']} windows, {p['tokens']} tokens{qa}; {p['passes']} streamed passes "
            f"(float + quantized) of {p['active_params'] / 1e6:.1f}M weights per token; about {p['estimate_s']:.0f} s "
            f"(passes: {p['tflop']} TFLOP, {p['passes_s']:.0f} s at this host's {p['host_gflops']} GFLOP/s{answers})")
