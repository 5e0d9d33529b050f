"""`dsconv export`: ONNX (checked against PyTorch), safetensors in another dtype (FP8 -> BF16), or MindIR."""
from __future__ import annotations

from pathlib import Path

import click

from dsconv import workspace
from dsconv.commands.options import (PATH, SIZE, emit_json, exec_options, json_option, model_option, output_option,
                                     resolve_exec)
from dsconv.convert.stage import FORMATS, QUANT_STAGE, STAGE_OF_FORMAT, ExportRequest, render, run
from dsconv.convert.tolerance import NOISE_FLOOR, NOISE_K


@click.command()
@model_option
@output_option
@click.option("--format", "fmt", type=click.Choice(list(FORMATS)), default="onnx",
              show_default=True,
              help="onnx -> <root>/onnx, safetensors -> <root>/safetensors, mindir -> <root>/mindir.")
@click.option("--quantized", type=PATH, default=None,
              help="A `dsconv quantize` output to export (W8A8, W8A8_DYNAMIC, W8A16) beside the float --model: "
                   "writes model_fakequant.onnx (onnxruntime, checked against dsconv's simulation) and "
                   "model_deploy.onnx + model_deploy.external (AMCT's AscendQuant/AscendDequant form, for "
                   "`dsconv atc`) into <root>/onnx_int8. --model may also be the quantize output itself.")
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default=None,
              help="Weights/compute dtype (default: fp32 for onnx and mindir, bf16 for safetensors).")
@click.option("--opset", type=int, default=None,
              help="ONNX opset, 11-18 (default 14, or 16 for bf16; ATC accepts 11-15 everywhere).")
@click.option("--with-past", is_flag=True,
              help="KV-cache inputs/outputs (past_key_values.N.key/.value -> present.N.key/.value); DeepSeek-V3 "
                   "carries the MLA latent cache.")
@click.option("--position-ids", is_flag=True,
              help="Add a position_ids input (default: derived from attention_mask inside the graph).")
@click.option("--atol", type=float, default=None,
              help="Largest allowed |exported - PyTorch| on logits (and cache outputs), absolute. Default: "
                   f"derived from the model's own float noise on the check inputs ({NOISE_K:g} x max |PyTorch - "
                   f"PyTorch in float64| + {NOISE_FLOOR:g} x max |logit|; docs/export.md); for a quantize output "
                   "2e-3.")
@click.option("--external-data-threshold", type=SIZE, default="2GB", show_default=True,
              help="ONNX weights at or above this size go to model.onnx_data beside model.onnx.")
@click.option("--allow-pickle", is_flag=True, help="Read .bin/.pt weights (weights-only unpickler).")
@click.option("--dry-run", is_flag=True, help="Print the plan (memory estimate, parts, dtypes) and write nothing.")
@click.option("--force", is_flag=True,
              help="Replace a previous dsconv output at --output; for onnx, also export when the RAM estimate "
                   "says it will not fit.")
@exec_options
@json_option
def export(model: Path | None, output: Path | None, fmt: str, quantized: Path | None, dtype: str | None,
           opset: int | None, with_past: bool, position_ids: bool, atol: float | None, external_data_threshold: int,
           allow_pickle: bool, dry_run: bool, force: bool, workers: int | None, executor: str | None,
           ray_address: str | None, as_json: bool) -> None:
    """Export the model: ONNX proven equal to PyTorch in onnxruntime, a safetensors dtype rewrite (FP8 weights
    dequantized, streamed), or MindIR. A quantize output becomes a fake-quant ONNX (checked against dsconv's
    simulation) and AMCT's INT8 deploy ONNX for ATC."""
    from dsconv.convert.quant_onnx import is_quantize_output

    model = workspace.resolve_model(model)
    int8 = fmt == "onnx" and (quantized is not None or is_quantize_output(model))
    load_source = None
    if int8:  # the quant stage reads its own output; the export stage traces what it is handed
        from dsconv.quant.evaluate.fakequant import load_source
    output = workspace.resolve_output(QUANT_STAGE if int8 else STAGE_OF_FORMAT[fmt], output)
    given = [f"--{n}" for n, v in (("workers", workers), ("executor", executor), ("ray-address", ray_address))
             if v is not None]
    if given and fmt != "safetensors":
        from dsconv.errors import warn

        warn(f"{'/'.join(given)} not used: --format {fmt} traces and checks one model in this process "
             f"(they fan out --format safetensors, quantize and shard)")
    result = run(ExportRequest(model=model, output=output, format=fmt, quantized=quantized, dtype=dtype, opset=opset,
                               with_past=with_past, position_ids=position_ids, atol=atol, external_data_threshold=external_data_threshold,
                               allow_pickle=allow_pickle, dry_run=dry_run, force=force,
                               quant_source=load_source, execution=resolve_exec(workers, executor, ray_address)))
    if as_json:
        emit_json(result.summary)
    else:
        click.echo(render(result))
