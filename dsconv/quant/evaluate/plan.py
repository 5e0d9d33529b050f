"""What `dsconv eval` will do, from headers and the tokenizer, before any weight is read: the text's windows and
tokens, the passes, the questions and their answer tokens, and a compute estimate at this host's measured matmul
rate (`eval --dry-run` prints it; a run prints it first), so a user knows what an eval costs before it starts.

The estimate counts 2 FLOPs per weight a token meets: every non-expert weight, and the routed experts a token is
sent to (experts_per_tok of num_experts). It is a floor: the streamed pass also reads every weight from disk once
per pass and runs the quantized linears' activation quantization, which docs/performance.md measures against it.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dsconv.checkpoint import Checkpoint
from dsconv.families.roles import Role
from dsconv.qformat import W8A8_MIX


def active_params(ck: Checkpoint) -> tuple[int, int]:
    """(all weights, the weights one token meets): routed experts counted at experts_per_tok / num_experts."""
    total = active = 0
    f = ck.facts
    share = f.experts_per_tok / f.num_experts if f.num_experts else 1.0
    for name in ck.names():
        r, n = ck.role(name), ck.info(name).numel
        total += n
        if r.role in (Role.EXPERT_IN, Role.EXPERT_OUT):
            active += n * share
        elif r.role not in (Role.EMBED, Role.TOWER) and not r.is_aux:  # an embedding is a lookup, not a matmul
            active += n
    return total, int(active)


def host_rate(seconds: float = 0.2) -> float:
    """float32 matmul FLOP/s of this host, measured for about `seconds` (torch's threads, as eval runs)."""
    import torch

    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    a @ b  # warm-up
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        a @ b
        n += 1
    return 2.0 * 512 * 1024 * 1024 * n / (time.perf_counter() - t)


def eval_plan(model_dir: Path, quant_dir: Path, chunks: list[list[int]], source: str, questions: int,
              max_new_tokens: int, prompt_tokens: int) -> dict[str, Any]:
    """The plan of one eval: `chunks` the text's token windows, `questions` with `prompt_tokens` in all."""
    ck, qck = Checkpoint.open(model_dir), Checkpoint.open(quant_dir)
    total, active = active_params(ck)
    desc = qck.quant_description or {}
    paths = 2 if W8A8_MIX in set(desc.values()) else 1  # W8A8_MIX: both of its paths beside one float pass
    tokens = sum(len(c) for c in chunks)
    qa_tokens = prompt_tokens + questions * max_new_tokens  # teacher-forced answers in the streamed pass
    flops_pass = 2.0 * active * (tokens + qa_tokens)
    flops_answers = 2.0 * active * qa_tokens  # the float model's greedy answers (KV cache: each token once)
    rate = host_rate()
    flops = flops_pass * (1 + paths) + (flops_answers if questions else 0.0)
    return {"text": source, "windows": len(chunks), "tokens": tokens, "questions": questions,
            "answer_tokens": questions * max_new_tokens, "passes": 1 + paths, "params": total,
            "active_params": active, "tflop": round(flops / 1e12, 3), "host_gflops": round(rate / 1e9, 1),
            "estimate_s": round(flops / rate, 3)}


def render_plan(p: dict[str, Any]) -> str:
    qa = f"; {p['questions']} questions x up to {p['answer_tokens'] // max(1, p['questions'])} answer tokens" \
        if p["questions"] else ""
    return (f"plan: {p['text']}: {p['windows']} windows, {p['tokens']} tokens{qa}; {p['passes']} streamed passes "
            f"(float + quantized) of {p['active_params'] / 1e6:.1f}M weights per token; {p['tflop']} TFLOP, at least "
            f"{p['estimate_s']} s at this host's {p['host_gflops']} GFLOP/s")
