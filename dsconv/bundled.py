"""Data shipped inside the package: the bundled calibration set (used by quantize, eval and the demo's tokenizer).

Why a module of its own: the quantizer needs the path and the demo needs the texts; neither may import the other.
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path


def bundled_calib_path() -> Path:
    return Path(str(resources.files("dsconv") / "calib_data" / "qa.jsonl"))


def calib_texts() -> list[str]:
    """Each bundled question and its answer, as one text."""
    texts = []
    for line in bundled_calib_path().read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            texts.append(f"{row['question']}\n{row['answer']}")
    return texts
