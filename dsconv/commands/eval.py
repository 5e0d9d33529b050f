"""`dsconv eval`: perplexity and logits of a quantized output against its original model."""
from __future__ import annotations

from pathlib import Path

import click

from dsconv import workspace
from dsconv.commands.options import (PATH, emit_json, exec_options, force_option, json_option, model_option,
                                     resolve_exec)
from dsconv.errors import UserError


@click.command(name="eval")
@model_option
@click.option("--quantized", "-q", type=PATH, default=None,
              help="Output of `dsconv quantize` (default: the workspace's quantize output).")
@click.option("--text", type=PATH, default=None,
              help="Evaluation text: plain text (paragraphs), or .jsonl/.json as for --calib. Default: the bundled "
                   "evaluation text (English and Chinese, about 9k tokens), which no calibration default uses; eval "
                   "notes it when the text is the calibration set the output was fitted on.")
@click.option("--seq-len", type=click.IntRange(min=2), default=512, show_default=True, help="Tokens per evaluated chunk.")
@click.option("--samples", type=click.IntRange(min=1), default=None, help="Evaluate the first N chunks only.")
@click.option("--max-ppl-increase", type=click.FloatRange(min=0), default=None, metavar="PCT",
              help="Fail (exit 3) when perplexity rises by more than PCT percent.")
@click.option("--qa", "qa", type=PATH, default=None, is_flag=False, flag_value=Path(""), metavar="[FILE]",
              help="Compare answers: question/answer JSONL (the calibration format). `--qa` alone uses the bundled "
                   "questions no calibration default uses.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Length of the float model's greedy answers (--qa).")
@click.option("--generate", is_flag=True, help="With --qa: also decode the quantized model's own greedy answers with "
                                               "a KV cache (both models in memory).")
@click.option("--max-answer-change", type=click.FloatRange(min=0), default=None, metavar="PCT",
              help="Fail (exit 3) when more than PCT percent of the answers change (--qa).")
@click.option("--dry-run", is_flag=True, help="Print the plan (windows, tokens, passes, questions, a time estimate "
                                              "from this host's measured matmul rate and memory bandwidth) and "
                                              "evaluate nothing.")
@click.option("--output", "-o", type=PATH, default=None,
              help="Write eval_report.json into this directory (default in a workspace: <root>/eval).")
@force_option
@exec_options(default_workers="1, one process (each job streams every weight itself, so on one host threads "
                              "beat processes)")
@json_option
def eval_cmd(model: Path | None, quantized: Path | None, text: Path | None, seq_len: int, samples: int | None,
             max_ppl_increase: float | None, qa: Path | None, max_new_tokens: int, generate: bool,
             max_answer_change: float | None, dry_run: bool, output: Path | None, force: bool, workers: int | None,
             executor: str | None, ray_address: str | None, as_json: bool) -> None:
    """Compare a quantized output with its original: perplexity, logits error, top-1 agreement, and answers.

    The quantized model is rebuilt from the written files and computed as the engine computes it (int8 activations
    of W8A8, the W4A8 kernel, the int8 KV cache). Both models run a decoder layer at a time with weights streamed
    from the two checkpoints, so any model the other stages take can be evaluated on a CPU host.
    """
    from dsconv.executor import ExecOptions
    from dsconv.quant.evaluate.fidelity import QAOptions
    from dsconv.quant.evaluate.stage import EvalRequest, run

    if qa is None and (generate or max_answer_change is not None):
        raise UserError("--generate and --max-answer-change compare answers", hint="add --qa [FILE]")
    execution = resolve_exec(workers, executor, ray_address)
    if execution.workers is None and execution.executor == "local":
        # one process by default: a job streams every weight itself, so on one host threads beat processes
        execution = ExecOptions("local", 1)
    qa_opts = None if qa is None else QAOptions(path=None if str(qa) in ("", ".") else qa,
                                                max_new_tokens=max_new_tokens, generate=generate)

    model = workspace.resolve_model(model)
    if quantized is None:
        quantized = workspace.previous_output("quantize")
        if quantized is None:
            raise UserError("no --quantized given and no quantize output in this workspace",
                            hint="run `dsconv quantize --bits 8` first, or pass --quantized DIR")
    if output is None and workspace.find() is not None:
        output = workspace.resolve_output("eval", None)
    result = run(EvalRequest(model, quantized, text=text, seq_len=seq_len, samples=samples,
                             max_ppl_increase=max_ppl_increase, qa=qa_opts,
                             max_answer_change=max_answer_change, output=None if dry_run else output,
                             execution=execution, force=force, progress=not as_json, dry_run=dry_run,
                             note=None if as_json else (lambda line: click.echo(line, err=True))))
    if as_json:
        emit_json(result.summary)
    else:
        click.echo(result.render())
