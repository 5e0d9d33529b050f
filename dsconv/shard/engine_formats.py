"""`dsconv shard --engine E --format F`: which output the engine loads, and the plan-only output.

mindie  MindIE's offline-sharded folders (DeepSeek-V3/R1; mindie_sharded.py, mindie_write.py)
ranks   dsconv's generic rank_XX/ directories (original names, sliced): for inspection, no engine reads them
plan    plan.json + cluster files, no weight copies: the engine shards this family itself at load time
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dsconv.engines.profiles import ENGINES, offline_sharded
from dsconv.errors import UserError

FORMATS = ("mindie", "ranks", "plan")


def resolve_format(engine: str, fmt: str | None, family: Any) -> tuple[str, str | None]:
    """(format, note for the user). Default: the engine's offline-sharded layout when it has one for the family,
    else plan only."""
    layout = offline_sharded(engine, family)
    if fmt == "mindie" and (engine != "mindie" or layout is None):
        from dsconv.families import families

        have = [f.name for f in families() if offline_sharded("mindie", f) is not None]
        raise UserError(f"--format mindie: MindIE's offline-sharded layout exists for {', '.join(have)} with "
                        f"--engine mindie, not {family.name} for {engine}",
                        hint="use --format plan (the engine shards at load time) or --format ranks")
    if fmt is not None:
        return fmt, None
    if layout is not None and engine in ENGINES:
        return engine, None
    return "plan", (f"{engine} shards {family.name} at load time: writing plan.json and the cluster files, no weight "
                    "copies (--format ranks writes per-rank copies for inspection)")


def write_plan_only(src: Any, output: Path, *, head: dict[str, Any], files: dict[str, Any], force: bool,
                    options: dict[str, Any]) -> dict[str, Any]:
    from dsconv.io.writer import OutputDir

    with OutputDir(output, stage="shard", inputs=[src.root], force=force, options=options,
                   input_identity=src.identity()) as out:
        out.write_text("plan.json", json.dumps({**head, "format": "plan"}, indent=1, ensure_ascii=False) + "\n")
        for rel, obj in files.items():
            out.write_json(rel, obj)
    return {"output": str(Path(output).absolute()), "ranks": 0, "bytes_written": 0, "format": "plan"}


def verify(directory: Path, manifest: dict[str, Any]) -> list[str]:
    """`dsconv verify` of a shard output, by the format its plan.json names."""
    from dsconv.schemas import shard_plan
    from dsconv.shard.write import verify_shard

    doc = shard_plan(Path(directory) / "plan.json")
    if doc.get("format") == "mindie":
        from dsconv.shard.mindie_verify import verify as verify_mindie

        return verify_mindie(Path(directory), manifest, doc)
    if doc.get("format") == "plan":
        return []  # no weights: the manifest's file hashes are all there is
    return verify_shard(directory, manifest, doc)
