"""`dsconv eval`: perplexity and logits of a quantized output against its original model."""
from __future__ import annotations

from pathlib import Path

import click

from dsconv import workspace
from dsconv.commands.options import PATH, emit_json, force_option, json_option, model_option
from dsconv.errors import CheckFailed, UserError


@click.command(name="eval")
@model_option
@click.option("--quantized", "-q", type=PATH, default=None,
              help="Output of `dsconv quantize` (default: the workspace's quantize output).")
@click.option("--text", type=PATH, default=None,
              help="Evaluation text: plain text (paragraphs), or .jsonl/.json as for --calib. Default: the answers "
                   "of the bundled calibration set.")
@click.option("--seq-len", type=int, default=512, show_default=True, help="Tokens per evaluated chunk.")
@click.option("--samples", type=int, default=None, help="Evaluate the first N chunks only.")
@click.option("--max-ppl-increase", type=float, default=None, metavar="PCT",
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
    from dsconv.quant.evaluate import evaluate, render
    from dsconv.writer import OutputDir

    model = workspace.resolve_model(model)
    if quantized is None:
        quantized = workspace.previous_output("quantize")
        if quantized is None:
            raise UserError("no --quantized given and no quantize output in this workspace",
                            hint="run `dsconv quantize --bits 8` first, or pass --quantized DIR")
    if output is None and workspace.find() is not None:
        output = workspace.resolve_output("eval", None)
    result = evaluate(model, quantized, text=text, seq_len=seq_len, samples=samples, progress=not as_json)
    if max_ppl_increase is not None and result["ppl_change_pct"] > max_ppl_increase:
        raise CheckFailed(f"perplexity rose {result['ppl_change_pct']:.3f}% (limit {max_ppl_increase}%)",
                          details=render(result))
    if output is not None:
        with OutputDir(output, stage="eval", inputs=[model, quantized], force=True if output_is_eval(output)
                       else force, options={"text": str(text) if text else None, "seq_len": seq_len,
                                            "samples": samples}) as out:
            out.write_json("eval_report.json", result)
        result["report"] = str(Path(output) / "eval_report.json")
    if as_json:
        emit_json(result)
    else:
        click.echo(render(result))


def output_is_eval(path: Path) -> bool:
    """A previous eval report may be replaced without --force (evaluations are cheap to redo)."""
    import json

    from dsconv.writer import MANIFEST

    m = Path(path) / MANIFEST
    try:
        return json.loads(m.read_text()).get("stage") == "eval"
    except (OSError, ValueError):
        return False
