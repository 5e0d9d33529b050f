"""The `export` stage, `run(ExportRequest) -> ExportResult`: one request, dispatched by format.

onnx -> onnx.py (traced, checked against PyTorch in onnxruntime), safetensors -> fp8.py (dtype rewrite, FP8
dequantized, streamed), mindir -> mindir.py (checked against PyTorch in MindSpore). Options that mean nothing for the
chosen format are a UserError here, not silently ignored. Cheap to import: each exporter loads only when it runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsconv.errors import UserError

FORMATS = ("onnx", "safetensors", "mindir")
#: the workspace stage (and manifest stage) each format writes
STAGE_OF_FORMAT = {"onnx": "export", "safetensors": "safetensors", "mindir": "mindir"}
#: the stage of an ONNX export of a quantize output (fake-quant + AMCT deploy model)
QUANT_STAGE = "export_int8"
#: --dtype when none is given
DEFAULT_DTYPE = {"onnx": "fp32", "safetensors": "bf16", "mindir": "fp32"}


@dataclass
class ExportRequest:
    """Everything `dsconv export` was asked; None means "the format's default"."""

    model: Path
    output: Path
    format: str = "onnx"
    quantized: Path | None = None  # a `dsconv quantize` output beside the float model (or model itself is one)
    #: reads a quantize output for the export (dsconv.quant.evaluate.fakequant.load_source); the command layer hands it
    #: in because stages do not import each other
    quant_source: Callable[[Any], Any] | None = None
    dtype: str | None = None
    opset: int | None = None
    with_past: bool = False
    position_ids: bool = False
    atol: float | None = None
    external_data_threshold: str | int = "2GB"  # a size: bytes, or text parse_size reads (onnx only)
    allow_pickle: bool = False
    dry_run: bool = False
    force: bool = False
    progress: bool | None = None
    execution: Any = None  # dsconv.executor.ExecOptions: how safetensors parts run (default inline)


@dataclass
class ExportResult:
    format: str
    summary: dict[str, Any]  # the --json object


def run(req: ExportRequest) -> ExportResult:
    """Export `req.model` to `req.output` in `req.format`; CheckFailed (exit 3) when the parity check fails."""
    fmt = req.format
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt} is not an export format", hint=f"use one of {', '.join(FORMATS)}")
    dtype = req.dtype or DEFAULT_DTYPE[fmt]
    if req.quantized is not None and fmt != "onnx":
        raise UserError(f"--quantized goes with --format onnx, not {fmt}",
                        hint="--format onnx writes the fake-quant and AMCT deploy models; other formats take the "
                             "quantize output as --model")
    quant_dir = quantized_input(req) if fmt == "onnx" else None
    if quant_dir is not None:
        if req.dtype not in (None, "fp32"):
            raise UserError(f"--dtype {req.dtype}: the quantized ONNX export is fp32 (ATC's precision mode chooses "
                            "the device float type)", hint="drop --dtype")
        from dsconv.convert.quant_onnx import export_quantized_onnx
        from dsconv.tensors import parse_size

        if req.quant_source is None:
            raise RuntimeError("exporting a quantize output needs ExportRequest.quant_source "
                               "(dsconv.quant.evaluate.fakequant.load_source)")
        summary = export_quantized_onnx(
            quant_dir, req.output, req.quant_source, model_dir=req.model if req.quantized is not None else None, opset=req.opset,
            with_past=req.with_past, position_ids=req.position_ids, atol=req.atol,
            external_data_threshold=parse_size(req.external_data_threshold), force=req.force, dry_run=req.dry_run,
            progress=req.progress)
        return ExportResult("onnx-int8", summary)
    if fmt in ("onnx", "mindir") and not req.dry_run:
        _check_space(req, dtype)
    if fmt == "onnx":
        from dsconv.convert.onnx import export_onnx
        from dsconv.tensors import parse_size

        summary = export_onnx(req.model, req.output, dtype=dtype, opset=req.opset, with_past=req.with_past,
                              position_ids=req.position_ids, atol=req.atol,
                              external_data_threshold=parse_size(req.external_data_threshold), force=req.force,
                              allow_pickle=req.allow_pickle, dry_run=req.dry_run, progress=req.progress)
    elif fmt == "safetensors":
        _refuse(fmt, opset=req.opset, with_past=req.with_past, position_ids=req.position_ids, atol=req.atol)
        from dsconv.convert.fp8 import export_safetensors

        summary = export_safetensors(req.model, req.output, dtype=dtype, force=req.force,
                                     allow_pickle=req.allow_pickle, dry_run=req.dry_run, progress=req.progress,
                                     execution=req.execution)
    else:
        _refuse(fmt, opset=req.opset, position_ids=req.position_ids, dry_run=req.dry_run)
        try:
            from dsconv.convert.mindir import export_mindir
        except ImportError as e:
            raise UserError(f"MindIR export is unavailable in this build ({e})",
                            hint="use --format onnx, or install dsconv with the mindir extra") from None
        summary = export_mindir(req.model, req.output, dtype=dtype, with_past=req.with_past, atol=req.atol,
                                force=req.force, allow_pickle=req.allow_pickle)
    return ExportResult(fmt, summary)


def _check_space(req: ExportRequest, dtype: str) -> None:
    """Refuse before building the model when the weights alone (at the output dtype, sized from the checkpoint headers)
    cannot fit where the output goes: the export would otherwise fail with ENOSPC after minutes of tracing."""
    import math

    from dsconv.checkpoint import Checkpoint
    from dsconv.io.writer import check_free_space

    itemsize = 4 if dtype == "fp32" else 2
    ck = Checkpoint.open(req.model, allow_pickle=req.allow_pickle)
    try:
        planned = sum(math.prod(i.shape) * itemsize for i in ck.tensors.values())
    finally:
        ck.close()
    where = Path(req.output).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    check_free_space(where, planned, Path(req.output))


def quantized_input(req: ExportRequest) -> Path | None:
    """The quantize output to export: --quantized DIR, or --model when it is one (quant_model_description.json)."""
    from dsconv.convert.quant_onnx import is_quantize_output

    if req.quantized is not None:
        if not is_quantize_output(req.quantized):
            raise UserError(f"--quantized {req.quantized} is not a dsconv quantize output (no "
                            "quant_model_description.json)", hint="pass the directory `dsconv quantize` wrote")
        return Path(req.quantized)
    return Path(req.model) if is_quantize_output(req.model) else None


def render(result: ExportResult) -> str:
    """The terminal text of each format's summary."""
    if result.format == "onnx-int8":
        from dsconv.convert.quant_onnx import render as text
    elif result.format == "onnx":
        from dsconv.convert.onnx import render as text
    elif result.format == "safetensors":
        from dsconv.convert.fp8 import render as text
    else:
        from dsconv.convert.mindir import render as text
    return text(result.summary)


def _refuse(fmt: str, **given: Any) -> None:
    """Options that mean nothing for `fmt` are an error, not silently ignored."""
    for name, value in given.items():
        if value not in (None, False):
            raise UserError(f"--{name.replace('_', '-')} does not apply to --format {fmt}",
                            hint="drop it, or choose --format onnx")
