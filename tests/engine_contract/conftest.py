"""Tiny models of every family, quantized once per (family, scheme, engine) for the contract tests: the same sources
and `dsconv quantize` options as `make engine-check` (tests/engine_check/cases.py), so what these tests see dsconv
write or refuse is what the engines' own loaders were run on."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.engine_check.cases import ENGINES, FAMILIES, MOE, SCHEMES, build_source, quantize, tokenizer

__all__ = ["ENGINES", "FAMILIES", "MOE", "SCHEMES", "Produced"]


@dataclass
class Produced:
    family: str
    scheme: str
    engine: str
    out: Path | None          # None: refused
    refusal: str | None
    src: Path


@pytest.fixture(scope="session")
def contract_models(tmp_path_factory):
    """(family, scheme) -> the bf16 per-expert source make engine-check quantizes for that row (cached);
    contract_models("deepseek_v3_fp16") -> a float16 DeepSeek-V3."""
    root = tmp_path_factory.mktemp("contract_models")
    tok = tokenizer()

    def get(family: str, scheme: str | None = None) -> Path:
        if family == "deepseek_v3_fp16":
            return build_source(root, "deepseek_v3", "fp16", "per-expert", tok, seed=1)
        return build_source(root, family, "bf16", "per-expert", tok, scheme)

    return get


@pytest.fixture(scope="session")
def produce(contract_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("contract_out")
    cache: dict[tuple, Produced] = {}

    def go(family: str, scheme: str, engine: str) -> Produced:
        key = (family, scheme, engine)
        if key not in cache:
            src = contract_models(family, scheme)
            out = root / f"{family}-{scheme}-{engine}"
            code, last = quantize(src, out, engine, SCHEMES[scheme])
            assert code in (0, 2), f"{family} {scheme} {engine}: exit {code}: {last}"
            if code == 2:
                assert not out.exists(), "a refused combination must write nothing"
            cache[key] = Produced(family, scheme, engine, out if code == 0 else None, last if code else None, src)
        return cache[key]

    return go
