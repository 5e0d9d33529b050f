"""`dsconv eval --qa`: do the float and the quantized model give the same answers?

Perplexity averages over every token; a user deploying INT8 asks whether answers change. For each question the float
model's greedy answer (`--max-new-tokens`) is the reference, and the quantized model is compared with it two ways:
- teacher-forced: question + float answer go through both models in the layer-streamed pass; at every answer
  position, does the quantized model pick the float answer's next token? The first position where it does not is
  where its own answer would have left the float one (everything before is the same text).
- free-running (`--generate`, models that fit in memory): the quantized model's own greedy answer, decoded with a
  KV cache (through int8 where the output has an int8 cache), against the float answer.
The float answers are generated in memory with a KV cache where the float model fits; a model that does not fit
(DeepSeek-V3: 64 streamed passes over 1.3 TB per answer) is teacher-forced on the file's reference answers instead,
and the two models' arg-max are compared at every answer position (the report says which).
"""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsconv import schemas
from dsconv.errors import UserError
from dsconv.runner.texts import read_utf8

DEFAULT_MAX_NEW_TOKENS = 64
SHORT_ANSWER_TOKENS = 16   # reference answers up to this long are scored by exact match
SHOWN = 3                  # changed answers printed; eval_report.json holds all


def bundled_qa_path() -> Path:
    """The bundled questions no calibration default uses (quantize calibrates on qa.jsonl)."""
    from importlib import resources

    return Path(str(resources.files("dsconv") / "calib_data" / "qa_heldout.jsonl"))


@dataclass
class Question:
    where: str                 # file:line, for errors and the report
    text: str
    reference: str | None      # the file's answer, if it has one


def read_questions(path: Path | None) -> tuple[list[Question], str]:
    """Questions of a QA file in the calibration format (JSONL of {"question", "answer"?}; "prompt" and a
    "messages" list whose last turn is the user's also work); errors name the file and line."""
    src = Path(path) if path is not None else bundled_qa_path()
    raw = read_utf8(src, "QA file", "pass a .jsonl file of {\"question\": ..., \"answer\": ...} lines with --qa")
    out = []
    for where, row in schemas.calibration_rows(src, raw):
        out.append(_question(where, row))
    if not out:
        raise UserError(f"{src}: no questions", hint="one {\"question\": ..., \"answer\": ...} object per line")
    return out, (str(src) if path is not None else f"bundled {src.name} (questions no calibration default uses)")


def _question(where: str, row: Any) -> Question:
    hint = "write each line as {\"question\": \"...\", \"answer\": \"...\"} (answer optional)"
    if isinstance(row, str):
        row = {"question": row}
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}", hint=hint)
    if "messages" in row and "question" not in row:
        msgs = row["messages"]
        if not (isinstance(msgs, list) and msgs and isinstance(msgs[-1], dict) and msgs[-1].get("role") == "user"
                and isinstance(msgs[-1].get("content"), str)):
            raise UserError(f"{where}: \"messages\" must end with a user turn {{\"role\": \"user\", \"content\"}}",
                            hint=hint)
        row = {"question": msgs[-1]["content"], "answer": row.get("answer")}
    q = row.get("question", row.get("prompt"))
    a = row.get("answer")
    if not isinstance(q, str) or not q.strip():
        raise UserError(f"{where}: no question (a non-empty string under \"question\" or \"prompt\")", hint=hint)
    if a is not None and not isinstance(a, str):
        raise UserError(f"{where}: \"answer\" must be a string, got {type(a).__name__}", hint=hint)
    return Question(where, q, a if a and a.strip() else None)


# ------------------------------------------------------------------------------------------------ tokens
def prompt_ids(tokenizer: Any, question: str) -> tuple[list[int], bool]:
    """The prompt as the model is served it: the chat template with the generation prompt where the tokenizer has
    one (True), else the question and a newline (False)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids], True
    return [int(i) for i in tokenizer(question + "\n", add_special_tokens=True)["input_ids"]], False


def stop_ids(tokenizer: Any, config: dict[str, Any]) -> set[int]:
    """Token ids that end an answer: the tokenizer's eos and config.json's eos_token_id (an int or a list)."""
    out: set[int] = set()
    for v in (getattr(tokenizer, "eos_token_id", None), config.get("eos_token_id")):
        for x in (v if isinstance(v, list) else [v]):
            if isinstance(x, int):
                out.add(x)
    return out


def greedy(model: torch.nn.Module, prompt: list[int], max_new: int, stop: set[int], cache: Any) -> list[int]:
    """Greedy decoding with a KV cache (`cache`: a transformers Cache, or the int8-cache simulation's)."""
    out: list[int] = []
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]
        for _ in range(max_new):
            t = int(logits.argmax())
            out.append(t)
            if t in stop or len(out) == max_new:
                break
            logits = model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1]
    return out


def check_lengths(questions: list[Question], prompts: list[list[int]], max_new: int, seq_len: int,
                  context: int | None) -> None:
    """A prompt and its answer must fit in --seq-len and the model's context: the error names the question."""
    limit = min(seq_len, context) if context else seq_len
    for q, p in zip(questions, prompts):
        if len(p) + max_new > limit:
            what = "--seq-len" if limit == seq_len else "the model's context (max_position_embeddings)"
            raise UserError(f"{q.where}: the prompt is {len(p)} tokens; with --max-new-tokens {max_new} it exceeds "
                            f"{what} ({limit})", hint="shorten the question, or raise --seq-len / lower "
                                                      "--max-new-tokens")


# ------------------------------------------------------------------------------------------------ scoring
def divergence(reference: list[int], got: list[int]) -> int | None:
    """Index of the first token where `got` leaves `reference` (None: identical to the end)."""
    for j, t in enumerate(reference):
        if j >= len(got) or got[j] != t:
            return j
    return None if len(got) == len(reference) else len(reference)


def normalise(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).lower()
    return re.sub(r"[\s\W_]+", " ", text).strip()


def exact_match(reference: str, answer: str) -> bool:
    """The normalised reference answer appears in the answer's first non-empty line (models answer in sentences)."""
    line = next((x for x in answer.splitlines() if x.strip()), "")
    ref = normalise(reference)
    return bool(ref) and f" {ref} " in f" {normalise(line)} "


@dataclass
class QAItem:
    question: Question
    prompt: list[int]
    answer: list[int]                  # the float model's greedy answer, or the reference answer's tokens
    forced_q: list[int] | None = None  # the quantized model's arg-max at each answer position (teacher-forced)
    forced_o: list[int] | None = None  # the float model's
    free_q: list[int] | None = None    # the quantized model's own greedy answer (--generate)


def score(items: list[QAItem], tokenizer: Any, answers_from: str, templated: bool, source: str,
          max_new: int) -> dict[str, Any]:
    """The QA summary (the --json `qa` object; `changed` lists every changed answer)."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    forced, free, changed = [], [], []
    for it in items:
        ref = it.answer if answers_from == "float" else it.forced_o
        d = divergence(ref, it.forced_q)
        forced.append(len(ref) if d is None else d)
        row: dict[str, Any] = {"question": it.question.text, "where": it.question.where,
                               "original": decode(it.answer), "teacher_forced_divergence": d}
        if d is not None:
            row["quantized_next_token"] = decode([it.forced_q[d]])
            row["original_next_token"] = decode([ref[d]])
        if it.free_q is not None:
            fd = divergence(it.answer, it.free_q)
            free.append((fd, len(it.answer)))
            row["quantized"] = decode(it.free_q)
            row["free_running_divergence"] = fd
        if d is not None or (it.free_q is not None and row["free_running_divergence"] is not None):
            changed.append(row)
    M = len(items)
    out: dict[str, Any] = {
        "source": source, "questions": M, "chat_template": templated, "max_new_tokens": max_new,
        "answers": "float model's greedy answers" if answers_from == "float"
        else "the file's reference answers, teacher-forced (the float model does not fit in memory to generate)",
        "teacher_forced": {"identical": sum(1 for it, n in zip(items, forced) if n == len(
            it.answer if answers_from == "float" else it.forced_o)), "of": M,
            "mean_tokens_to_divergence": round(float(np.mean(forced)), 2),
            "mean_answer_tokens": round(float(np.mean([len(it.answer) for it in items])), 2)}}
    if free:
        out["free_running"] = {"identical": sum(1 for fd, _ in free if fd is None), "of": M,
                               "mean_tokens_to_divergence": round(float(np.mean(
                                   [n if fd is None else fd for fd, n in free])), 2)}
    short = [it for it in items if it.question.reference is not None
             and len(tokenizer(it.question.reference, add_special_tokens=False)["input_ids"]) <= SHORT_ANSWER_TOKENS]
    if short and answers_from == "float":
        em = {"questions": len(short),
              "original": sum(exact_match(it.question.reference, decode(it.answer)) for it in short)}
        if all(it.free_q is not None for it in short):
            em["quantized"] = sum(exact_match(it.question.reference, decode(it.free_q)) for it in short)
        out["exact_match"] = em
    out["changed"] = changed
    return out


def changed_fraction(qa: dict[str, Any]) -> float:
    """Percent of answers that changed: free-running where it ran, else teacher-forced."""
    part = qa.get("free_running") or qa["teacher_forced"]
    return 100.0 * (part["of"] - part["identical"]) / max(1, part["of"])


def render(qa: dict[str, Any]) -> list[str]:
    tf = qa["teacher_forced"]
    lines = [f"answers: {qa['questions']} questions from {qa['source']}"
             f"{'' if qa['chat_template'] else ' (no chat template: question + newline)'}; {qa['answers']}, "
             f"at most {qa['max_new_tokens']} tokens",
             f"  teacher-forced: {tf['identical']}/{tf['of']} identical to the end; mean "
             f"{tf['mean_tokens_to_divergence']:.1f} of {tf['mean_answer_tokens']:.1f} tokens before the first "
             f"divergence"]
    if "free_running" in qa:
        fr = qa["free_running"]
        lines.append(f"  free-running:   {fr['identical']}/{fr['of']} identical; mean "
                     f"{fr['mean_tokens_to_divergence']:.1f} tokens before the first divergence")
    if "exact_match" in qa:
        em = qa["exact_match"]
        lines.append(f"  exact match on {em['questions']} short reference answers: original {em['original']}"
                     + (f", quantized {em['quantized']}" if "quantized" in em else " (quantized: with --generate)"))
    for row in qa["changed"][:SHOWN]:
        lines.append(f"  changed: {row['question'][:70]!r} ({row['where']})")
        lines.append(f"    original:  {row['original'][:160]!r}")
        if "quantized" in row:
            lines.append(f"    quantized: {row['quantized'][:160]!r}")
        if row["teacher_forced_divergence"] is not None:
            lines.append(f"    teacher-forced: at token {row['teacher_forced_divergence']} the quantized model "
                         f"picks {row['quantized_next_token']!r} for {row['original_next_token']!r}")
    if len(qa["changed"]) > SHOWN:
        lines.append(f"  ... {len(qa['changed']) - SHOWN} more in eval_report.json")
    return lines
