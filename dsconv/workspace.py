"""`dsconv.toml`: lets users type `dsconv quantize --bits 8` with no paths.

`dsconv init --model DIR` writes it in the current directory; every command looks for it in the current directory
and its parents (like git), uses its model when `--model` is absent, and puts each stage's output under the output
root (`<root>/<stage>`), so each stage finds the previous stage's output by default.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from dsconv import schemas
from dsconv.errors import UserError
from dsconv.io.writer import MANIFEST

FILENAME = "dsconv.toml"
STAGE_DIRS = {"export": "onnx", "export_int8": "onnx_int8", "safetensors": "safetensors", "mindir": "mindir", "quantize": "quant",
              "shard": "shard", "atc": "atc", "eval": "eval"}


@dataclass
class Workspace:
    path: Path  # the dsconv.toml file
    model: Path
    output: Path
    defaults: dict[str, Any] = field(default_factory=dict)

    def stage_dir(self, stage: str) -> Path:
        return self.output / STAGE_DIRS.get(stage, stage)


def find(start: Path | None = None) -> Workspace | None:
    """The nearest dsconv.toml from `start` (default: cwd) upwards, or None."""
    here = (start or Path.cwd()).absolute()
    for d in (here, *here.parents):
        f = d / FILENAME
        if f.is_file():
            return load(f)
    return None


def load(path: Path) -> Workspace:
    data = schemas.workspace_toml(path)
    ws = data["workspace"]
    base = path.parent
    return Workspace(path=path, model=(base / ws["model"]).absolute(),
                     output=(base / (ws.get("output") or "dsconv-out")).absolute(),
                     defaults=data.get("defaults") or {})


def init(model: Path, output: Path, directory: Path | None = None, force: bool = False,
         defaults: dict[str, Any] | None = None) -> Workspace:
    directory = (directory or Path.cwd()).absolute()
    path = directory / FILENAME
    if path.exists() and not force:
        raise UserError(f"{path} exists", hint="pass --force to overwrite it")
    model = model.absolute()
    if not (model / "config.json").is_file():
        raise UserError(f"{model} has no config.json", hint="point --model at a HuggingFace model directory")
    doc = {"workspace": {"model": str(model), "output": str(output)}, "defaults": defaults or {}}
    path.write_text("# dsconv workspace: commands run here use this model and output root\n" + tomli_w.dumps(doc))
    return load(path)


def resolve_model(model: Path | None) -> Path:
    """--model if given, else the workspace's model, else a one-line error saying what to do."""
    if model is not None:
        return Path(model)
    ws = find()
    if ws is None:
        raise UserError("no --model given and no dsconv.toml here",
                        hint="pass --model DIR or run `dsconv init --model DIR` first")
    return ws.model


def resolve_output(stage: str, output: Path | None) -> Path:
    """--output if given, else `<workspace output root>/<stage>`."""
    if output is not None:
        return Path(output)
    ws = find()
    if ws is None:
        raise UserError(f"no --output given for {stage} and no dsconv.toml here",
                        hint="pass --output DIR or run `dsconv init --model DIR` first")
    return ws.stage_dir(stage)


def previous_output(stage: str) -> Path | None:
    """A finished output of an earlier stage in this workspace (it has a manifest), or None."""
    ws = find()
    if ws is None:
        return None
    d = ws.stage_dir(stage)
    return d if (d / MANIFEST).is_file() else None
