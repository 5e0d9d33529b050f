"""Calibration sets -> token samples: the formats msModelSlim users already have, read and validated line by line by
dsconv.runner.texts (which evaluation reads too). Each sample is tokenized on its own and truncated to `seq_len` (no packing across samples: every token sees only its
own sample, as at inference).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsconv.bundled import bundled_calib_path
from dsconv.errors import UserError
from dsconv.runner.texts import read_texts

DEFAULT_SEQ_LEN = 512


@dataclass
class CalibSet:
    """Token ids of every calibration sample (each at most seq_len long), and where they came from."""

    source: str
    samples: list[list[int]]
    seq_len: int
    truncated: int = 0  # samples cut at seq_len
    skipped: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.samples)

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "samples": len(self.samples), "tokens": self.tokens, "seq_len": self.seq_len,
                "truncated_samples": self.truncated}


def tokenize(texts: list[str], tokenizer: Any, seq_len: int, source: str) -> CalibSet:
    if seq_len < 2:
        raise UserError(f"--seq-len {seq_len} is too short", hint="use 256-2048")
    samples, truncated = [], 0
    for text in texts:
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
        if len(ids) > seq_len:
            ids, truncated = ids[:seq_len], truncated + 1
        if ids:
            samples.append([int(i) for i in ids])
    if not samples:
        raise UserError(f"{source}: the calibration texts tokenize to nothing", hint="check the file's content")
    return CalibSet(source=source, samples=samples, seq_len=seq_len, truncated=truncated)


def load_calib(path: Path | None, tokenizer: Any, samples: int | None = None,
               seq_len: int = DEFAULT_SEQ_LEN) -> CalibSet:
    """The calibration set to use: `path` or the bundled qa.jsonl; the first `samples` records (all by default)."""
    src = Path(path) if path is not None else bundled_calib_path()
    texts = read_texts(src, tokenizer)
    if samples is not None:
        if samples < 1:
            raise UserError(f"--calib-samples {samples} must be at least 1")
        texts = texts[:samples]
    label = str(src) if path is not None else f"bundled {src.name}"
    return tokenize(texts, tokenizer, seq_len, label)


def min_tokens_warning(calib: CalibSet, needs: dict[str, int]) -> str | None:
    """A warning when the set is too small for what the scheme estimates (ranges, Hessians)."""
    short = {what: n for what, n in needs.items() if calib.tokens < n}
    if not short:
        return None
    parts = ", ".join(f"{what} wants >= {n}" for what, n in short.items())
    return (f"calibration has only {calib.tokens} tokens ({len(calib.samples)} samples): {parts}; "
            "results may be poor - add samples or raise --seq-len")
