"""`dsconv eval`: perplexity and logits of a quantized output against its original model."""
from __future__ import annotations

from pathlib import Path

import click

from dsconv import workspace
from dsconv.commands.options import PATH, emit_json, force_option, json_option, model_option
from dsconv.errors import UserError


@click.command(name="eval")
@model_option
@click.option("--quantized", "-q", type=PATH, default=None,
              help="Output of `dsconv quantize` (default: the workspace's quantize output).")
@click.option("--text", type=PATH, default=None,
              help="Evaluation text: plain text (paragraphs), or .jsonl/.json as for --calib. Default: the answers "
                   "of the bundled calibration set.")
@click.option("--seq-len", type=click.IntRange(min=2), default=512, show_default=True, help="Tokens per evaluated chunk.")
@click.option("--samples", type=click.IntRange(min=1), default=None, help="Evaluate the first N chunks only.")
@click.option("--max-ppl-increase", type=click.FloatRange(min=0), default=None, metavar="PCT",
              help="Fail (exit 3) when perplexity rises by more than PCT percent.")
@click.option("--output", "-o", type=PATH, default=None,
              help="Write eval_report.json into this directory (default in a workspace: <root>/eval).")
@force_option
@json_option
def eval_cmd(model: Path | None, quantized: Path | None, text: Path | None, seq_len: int, samples: int | None,
             max_ppl_increase: float | None, output: Path | None, force: bool, as_json: bool) -> None:
    """Compare a quantized output with its original: perplexity, logits error, top-1 agreement.

    The quantized model is rebuilt from the written files (dequantized weights, activations quantized as the engine
    does for W8A8). Both models are held in memory: an evaluation tool for small models.
    """
    from dsconv.quant.evaluate.stage import EvalRequest, run

    model = workspace.resolve_model(model)
    if quantized is None:
        quantized = workspace.previous_output("quantize")
        if quantized is None:
            raise UserError("no --quantized given and no quantize output in this workspace",
                            hint="run `dsconv quantize --bits 8` first, or pass --quantized DIR")
    if output is None and workspace.find() is not None:
        output = workspace.resolve_output("eval", None)
    result = run(EvalRequest(model, quantized, text=text, seq_len=seq_len, samples=samples,
                             max_ppl_increase=max_ppl_increase, output=output, force=force, progress=not as_json))
    if as_json:
        emit_json(result.summary)
    else:
        click.echo(result.render())
