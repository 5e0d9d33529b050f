"""The stages by the name their manifests record, and the deeper check `dsconv verify` runs on each one's output.

`dsconv verify DIR` first re-checks every file's digest and size against the manifest, then, when those match, the
stage's own check (e.g. shard: every original tensor reassembles bit-exactly from the ranks). The table is explicit
and lives at the top, so whether `verify` knows a stage never depends on which modules happen to have been imported
(a check that registered itself on import would). Each entry imports its stage only when it runs (the CLI starts fast).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from dsconv.io.writer import read_manifest, verify_files

Check = Callable[[Path, dict], "list[str]"]


def _export(directory: Path, manifest: dict) -> list[str]:
    from dsconv.convert.checks import verify_onnx

    return verify_onnx(directory, manifest)


def _export_int8(directory: Path, manifest: dict) -> list[str]:
    from dsconv.convert.checks import verify_onnx_int8

    return verify_onnx_int8(directory, manifest)


def _safetensors(directory: Path, manifest: dict) -> list[str]:
    from dsconv.convert.checks import verify_safetensors

    return verify_safetensors(directory, manifest)


def _mindir(directory: Path, manifest: dict) -> list[str]:
    from dsconv.convert.mindir import verify_mindir

    return verify_mindir(directory, manifest)


def _quantize(directory: Path, manifest: dict) -> list[str]:
    from dsconv.quant.formats.msmodelslim import verify_output

    return verify_output(directory)


def _shard(directory: Path, manifest: dict) -> list[str]:
    from dsconv.shard.engine_formats import verify

    return verify(directory, manifest)


#: manifest "stage" -> the check of that stage's output (eval and atc outputs have only their file hashes checked)
CHECKS: dict[str, Check] = {
    "export": _export, "export_int8": _export_int8, "safetensors": _safetensors, "mindir": _mindir, "quantize": _quantize, "shard": _shard,
}


def has_check(stage: str) -> bool:
    return stage in CHECKS


def verify(directory: Path) -> tuple[dict, list[str]]:
    """(manifest, problems): the file hashes, then the stage's check when they all match."""
    manifest = read_manifest(directory)
    problems = verify_files(directory)
    check = CHECKS.get(manifest.get("stage", ""))
    if not problems and check is not None:
        problems = check(Path(directory), manifest)
    return manifest, problems
