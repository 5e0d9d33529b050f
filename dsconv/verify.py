"""`dsconv verify DIR`: re-check an output against its manifest, then run the stage's own deeper check.

Stages register a deeper check for their outputs (e.g. shard: every original tensor reassembles bit-exactly).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from dsconv.writer import read_manifest, verify_files

_STAGE_CHECKS: dict[str, Callable[[Path, dict], list[str]]] = {}


def register_check(stage: str):
    """Decorator: `fn(directory, manifest) -> problems` runs after the file hashes match."""

    def deco(fn: Callable[[Path, dict], list[str]]):
        _STAGE_CHECKS[stage] = fn
        return fn

    return deco


def has_check(stage: str) -> bool:
    return stage in _STAGE_CHECKS


def verify(directory: Path) -> tuple[dict, list[str]]:
    manifest = read_manifest(directory)
    problems = verify_files(directory)
    check = _STAGE_CHECKS.get(manifest.get("stage", ""))
    if not problems and check is not None:
        problems = check(Path(directory), manifest)
    return manifest, problems
