"""The eval stage: `run(EvalRequest) -> EvalResult` - measure a quantized output against its original, check the
perplexity limit, and write eval_report.json."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsconv.errors import CheckFailed, UserError
from dsconv.executor import ExecOptions
from dsconv.io.writer import MANIFEST, OutputDir, read_manifest
from dsconv.quant.evaluate.fidelity import DEFAULT_SEQ_LEN, QAOptions, evaluate, render
from dsconv.quant.evaluate.qa import changed_fraction

REPORT_FILE = "eval_report.json"


@dataclass
class EvalRequest:
    """What `dsconv eval` was asked: the original model, the quantized output, the text and the limit."""

    model: Path
    quantized: Path
    text: Path | None = None
    seq_len: int = DEFAULT_SEQ_LEN
    samples: int | None = None
    max_ppl_increase: float | None = None   # percent; exceeding it fails the run (exit 3)
    qa: QAOptions | None = None             # compare answers too
    max_answer_change: float | None = None  # percent of answers that may change (exit 3 beyond)
    execution: ExecOptions | None = None     # --workers / Ray: runs of sequences per job (None: this process)
    output: Path | None = None              # directory for eval_report.json; None writes nothing
    force: bool = False
    progress: bool = True
    dry_run: bool = False                   # the plan (tokens, passes, estimate) only
    note: Callable[[str], None] | None = None  # where the plan line goes before a run (the CLI: stderr)


@dataclass
class EvalResult:
    """The metrics (the --json output); `report` names the written eval_report.json, if any."""

    summary: dict[str, Any]

    def render(self) -> str:
        if self.summary.get("dry_run"):
            from dsconv.quant.evaluate.plan import render_plan

            return render_plan(self.summary["plan"])
        return render(self.summary)


def output_is_eval(path: Path) -> bool:
    """A previous eval report may be replaced without --force (evaluations are cheap to redo)."""
    try:
        return (Path(path) / MANIFEST).is_file() and read_manifest(Path(path))["stage"] == "eval"
    except UserError:  # not a sound manifest: not a previous eval report to replace silently
        return False


def ppl_failures(result: dict[str, Any], limit: float | None) -> list[str]:
    """--max-ppl-increase: every path an instance may run must pass (W8A8_MIX: static on decode instances, dynamic on
    prefill ones), not only the headline."""
    if limit is None:
        return []
    return [f"perplexity rose {m['ppl_change_pct']:.3f}%" + (f" on the {path} path" if path else "") +
            f" (limit {limit}%)" for path, m in (result.get("paths") or {None: result}).items()
            if m["ppl_change_pct"] > limit]


def plan(req: EvalRequest) -> tuple[dict[str, Any], tuple[list[list[int]], str]]:
    """The eval's plan (evaluate/plan.py), from headers and the tokenizer, and the text's windows it counted (the run
    scores those, tokenized once)."""
    from dsconv.checkpoint import Checkpoint
    from dsconv.runner.texts import load_tokenizer
    from dsconv.quant.evaluate.fidelity import eval_chunks
    from dsconv.quant.evaluate.plan import eval_plan
    from dsconv.quant.evaluate.qa import check_lengths, prompt_ids, read_questions

    ck = Checkpoint.open(req.model)
    chunks, source = eval_chunks(ck, req.text, req.seq_len, req.samples)
    questions, prompt_tokens = [], 0
    if req.qa is not None:
        tokenizer = load_tokenizer(ck.root)
        questions, _ = read_questions(req.qa.path)
        prompts = [prompt_ids(tokenizer, q.text)[0] for q in questions]
        check_lengths(questions, prompts, req.qa.max_new_tokens, req.seq_len,  # the run's own refusal, first
                      ck.family.flat_config(ck.config).get("max_position_embeddings"))
        prompt_tokens = sum(len(p) for p in prompts)
    return eval_plan(req.model, req.quantized, chunks, source, len(questions),
                     req.qa.max_new_tokens if req.qa else 0, prompt_tokens), (chunks, source)


def run(req: EvalRequest) -> EvalResult:
    """Run `dsconv eval`: its plan first (alone with `dry_run`)."""
    windows = None
    if req.dry_run or req.note is not None:
        from dsconv.quant.evaluate.plan import render_plan

        p, windows = plan(req)
        if req.dry_run:
            return EvalResult({"dry_run": True, "plan": p})
        req.note(render_plan(p))
    result = evaluate(req.model, req.quantized, text=req.text, seq_len=req.seq_len, samples=req.samples,
                      progress=req.progress, qa=req.qa, execution=req.execution, windows=windows)
    failed = ppl_failures(result, req.max_ppl_increase)
    if req.max_answer_change is not None and changed_fraction(result["qa"]) > req.max_answer_change:
        failed.append(f"{changed_fraction(result['qa']):.1f}% of the answers changed (limit "
                      f"{req.max_answer_change}%)")
    if failed:  # nothing is written: a failed check leaves no report to mistake for a passed one
        raise CheckFailed("; ".join(failed), details=render(result))
    if req.output is not None:
        with OutputDir(req.output, stage="eval", inputs=[req.model, req.quantized],
                       force=True if output_is_eval(req.output) else req.force,
                       options={"text": str(req.text) if req.text else None, "seq_len": req.seq_len,
                                "samples": req.samples,
                                "qa": None if req.qa is None else {"file": str(req.qa.path) if req.qa.path else None,
                                                                   "max_new_tokens": req.qa.max_new_tokens,
                                                                   "generate": req.qa.generate}}) as out:
            out.write_json(REPORT_FILE, result)
        result["report"] = str(Path(req.output) / REPORT_FILE)
    return EvalResult(result)
