"""Tiny models of every family, quantized once per (family, scheme, engine) for the contract tests."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3")
MOE = ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3")
ENGINES = ("mindie", "vllm-ascend")
# scheme label -> QuantOptions keywords ("bits8" = `--bits 8`: the engine's recipe)
SCHEMES = {
    "bits8": dict(scheme="w8a8", bits_default=True),
    "w8a8": dict(scheme="w8a8"),
    "w8a8_dynamic": dict(scheme="w8a8_dynamic"),
    "w8a16": dict(scheme="w8a16"),
    "w4a16": dict(scheme="w4a16", group_size=16, method="rtn"),  # 16 divides every tiny width (48 included)
    "w4a16_pc": dict(scheme="w4a16", group_size=0, method="rtn"),
    "w4a8": dict(scheme="w4a8_dynamic", method="rtn"),
    "bits8_c8": dict(scheme="w8a8", bits_default=True, kv_cache="int8"),  # the recipe + int8 KV cache
    "w8a8_dynamic_c8": dict(scheme="w8a8_dynamic", kv_cache="int8"),
    "w4a8_c8": dict(scheme="w4a8_dynamic", method="rtn", kv_cache="int8"),
}
FAST = dict(calib_samples=4, seq_len=32)


@dataclass
class Produced:
    family: str
    scheme: str
    engine: str
    out: Path | None          # None: refused
    refusal: str | None
    src: Path


@pytest.fixture(scope="session")
def contract_models(tmp_path_factory) -> dict[str, Path]:
    from dsconv.demo import calib_texts
    from dsconv.tiny import make_tiny, train_tokenizer

    root = tmp_path_factory.mktemp("contract_models")
    tok = train_tokenizer(calib_texts(), vocab_size=384)
    out = {f: make_tiny(f, root / f, dtype="bf16", tokenizer=tok) for f in FAMILIES}
    out["deepseek_v3_fp16"] = make_tiny("deepseek_v3", root / "ds16", dtype="fp16", tokenizer=tok, seed=1)
    return out


@pytest.fixture(scope="session")
def produce(contract_models, tmp_path_factory):
    from dsconv.errors import UserError
    from dsconv.quant.plan.options import QuantOptions
    from dsconv.quant.stage import QuantRequest, run

    root = tmp_path_factory.mktemp("contract_out")
    cache: dict[tuple, Produced] = {}

    def go(family: str, scheme: str, engine: str) -> Produced:
        key = (family, scheme, engine)
        if key not in cache:
            src = contract_models[family]
            out = root / f"{family}-{scheme}-{engine}"
            try:
                run(QuantRequest(src, out, QuantOptions(**{**FAST, **SCHEMES[scheme], "engine": engine}),
                                 progress=False))
                cache[key] = Produced(family, scheme, engine, out, None, src)
            except UserError as e:
                assert not out.exists(), "a refused combination must write nothing"
                cache[key] = Produced(family, scheme, engine, None, e.one_line(), src)
        return cache[key]

    return go
