"""Data shipped inside the package: the bundled calibration set (used by quantize and the demo's tokenizer) and the
default evaluation text (eval), which shares no passage with it (tests/test_eval_text.py).

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


#: the default evaluation text's files, English then Chinese (eval_data/NOTICE: where each comes from)
EVAL_FILES = ("eval_en.txt", "eval_zh.txt")


def eval_text_paths() -> list[Path]:
    return [Path(str(resources.files("dsconv") / "eval_data" / name)) for name in EVAL_FILES]


def eval_texts() -> list[str]:
    """The default evaluation text, one document per language: chunked into windows by the caller, so a window
    never mixes the two."""
    return [p.read_text(encoding="utf-8").strip() for p in eval_text_paths()]
