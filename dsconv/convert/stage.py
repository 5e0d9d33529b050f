"""The `export` stage, `run(ExportRequest) -> ExportResult`: one request, dispatched by format.

onnx -> onnx.py (traced, checked against PyTorch in onnxruntime), safetensors -> fp8.py (dtype rewrite, FP8
dequantized, streamed), mindir -> mindir.py (checked against PyTorch in MindSpore). Options that mean nothing for the
chosen format are a UserError here, not silently ignored. Cheap to import: each exporter loads only when it runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsconv.errors import UserError

FORMATS = ("onnx", "safetensors", "mindir")
#: the workspace stage (and manifest stage) each format writes
STAGE_OF_FORMAT = {"onnx": "export", "safetensors": "safetensors", "mindir": "mindir"}
#: --dtype when none is given
DEFAULT_DTYPE = {"onnx": "fp32", "safetensors": "bf16", "mindir": "fp32"}


@dataclass
class ExportRequest:
    """Everything `dsconv export` was asked; None means "the format's default"."""

    model: Path
    output: Path
    format: str = "onnx"
    dtype: str | None = None
    opset: int | None = None
    with_past: bool = False
    position_ids: bool = False
    atol: float | None = None
    external_data_threshold: str = "2GB"  # a size (parsed for onnx only)
    allow_pickle: bool = False
    dry_run: bool = False
    force: bool = False
    progress: bool | None = None


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
                                     allow_pickle=req.allow_pickle, dry_run=req.dry_run, progress=req.progress)
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


def render(result: ExportResult) -> str:
    """The terminal text of each format's summary."""
    if result.format == "onnx":
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
