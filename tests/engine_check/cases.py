"""The cases both engines are checked on, shared by `make engine-check` (matrix.py) and the contract tests
(tests/engine_contract/): the tiny source models, the README's scheme rows as `dsconv quantize` options, and one
in-process `dsconv quantize`.

Runs in dsconv's environment."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe",
            "deepseek_v32", "kimi_k2", "qwen3_next", "qwen3_5_moe")
MOE = ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "deepseek_v32", "kimi_k2", "qwen3_next",
       "qwen3_5_moe")
# families whose checkpoints carry MTP layers, and the recipes their MTP layer differs in (FLOAT under --bits 8,
# W8A8_DYNAMIC under W4A8): layout "mtp" is the per-expert checkpoint with one MTP layer appended (tiny.add_mtp_layer)
MTP = ("deepseek_v3", "deepseek_v32", "glm4_moe", "qwen3_next", "qwen3_5_moe")
MTP_SCHEMES = ("bits8", "w4a8")
# MindIE builds an MTP layer for DeepSeek's code only (num_speculative_tokens > 0; GLM-4.5's model never reads one)
MINDIE_MTP = ("deepseek_v3",)
ENGINES = ("mindie", "vllm-ascend")
# layout "rotated": the tiny checkpoint through `dsconv rotate` (norms folded to ones, the residual stream rotated,
# the head untied), then quantized as any checkpoint: the engines load rotation's outputs as ordinary weights, and the
# source comparison holds them to the rotated float model (whose equivalence with the original tests/test_rotate.py
# proves)
ROTATED = ("llama", "qwen2", "qwen3_moe", "deepseek_v3")
ROTATED_SCHEMES = ("bits8", "w8a8_dynamic", "w4a4")
# dtype "fp32": the tiny checkpoint saved in float32 and quantized with `--dtype bf16` (MindIE runs bf16 and fp16 only:
# the one-step way), compared with its float32 source
CAST = ("llama", "qwen2", "qwen3_moe", "deepseek_v3")
CAST_SCHEMES = ("bits8",)
CAST_OPTIONS = ["--dtype", "bf16"]
# scheme label (a README row) -> `dsconv quantize` options. 4-bit rows round to nearest (--method rtn): the check
# then holds every weight to half a quantization step (GPTQ's integers move further, through the same layout).
# Groups of 64: MindIE runs W4A16 with group sizes 0, 64 and 128 only (docs/engine_rules.md).
SCHEMES = {
    "bits8": ["--bits", "8"],
    "w8a8": ["--scheme", "w8a8"],
    "w8a8_dynamic": ["--scheme", "w8a8_dynamic"],
    "w8a8_mix": ["--scheme", "w8a8_mix"],
    "w8a16": ["--scheme", "w8a16"],
    "w4a16": ["--scheme", "w4a16", "--group-size", "64", "--method", "rtn"],
    "w4a16_pc": ["--scheme", "w4a16", "--group-size", "0", "--method", "rtn"],
    "w4a8": ["--bits", "4", "--scheme", "w4a8_dynamic", "--method", "rtn"],
    "bits8_c8": ["--bits", "8", "--kv-cache", "int8"],
    "w8a8_dynamic_c8": ["--scheme", "w8a8_dynamic", "--kv-cache", "int8"],
    "w4a8_c8": ["--bits", "4", "--scheme", "w4a8_dynamic", "--method", "rtn", "--kv-cache", "int8"],
    "w4a4": ["--bits", "4", "--scheme", "w4a4_dynamic", "--method", "rtn"],
}
LABELS = {"bits8": "`--bits 8` (engine recipe)", "w4a16": "w4a16 `--group-size 64`",
          "w4a16_pc": "w4a16 `--group-size 0`", "w4a8": "w4a8_dynamic (MoE recipe)",
          "bits8_c8": "`--bits 8 --kv-cache int8`", "w8a8_dynamic_c8": "w8a8_dynamic `--kv-cache int8`",
          "w4a8_c8": "w4a8_dynamic `--kv-cache int8`", "w8a8_mix": "w8a8_mix (PD-mix)",
          "w4a4": "w4a4_dynamic (vLLM-Ascend recipe)"}
FAST = ["--calib-samples", "4", "--seq-len", "32"]
# Wider models for the rows where width matters (the rest stay at the tiny defaults: 64 wide, 16-wide heads,
# 32- to 128-wide MLPs, half the quantization time):
# - W4A16 per group: every row-parallel input (o_proj, down_proj) keeps at least two groups of 64 per rank at tp 2
#   (MindIE reads a rank's single group as per-channel int4: make engine-check showed it; `dsconv shard` refuses
#   that tp). Heads stay hidden / heads wide (vLLM's Qwen2 derives head_dim so).
# - DeepSeek's `--bits 8`, which is also sharded at ep 4 x tp 2: its shared expert is split over all 8 ranks, each
#   keeps 16 of 128 columns, still wide enough to tell rows apart.
_WIDE = {"hidden_size": 256, "intermediate_size": 256, "head_dim": 64}
WIDE = {"llama": _WIDE, "qwen2": _WIDE, "qwen3": _WIDE, "mixtral": _WIDE,
        "qwen2_moe": {**_WIDE, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256},
        "qwen3_moe": {**_WIDE, "moe_intermediate_size": 256},
        "deepseek_v3": {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128}}
WIDE_SCHEMES = {"deepseek_v3": ("bits8",)}  # other families: ("w4a16",)


def wide(family: str, scheme: str) -> bool:
    return scheme in WIDE_SCHEMES.get(family, ("w4a16",))


# special tokens real Qwen tokenizers carry and MindIE's Qwen-MoE router names (models/qwen2_moe/router_qwen2_moe.py:
# eos '<|endoftext|>', pad '<|extra_0|>'; a tokenizer without them gets new ids beyond the vocabulary)
QWEN_TOKENS = ["<|endoftext|>", "<|extra_0|>"]


def tokenizer() -> Any:
    from dsconv.bundled import calib_texts
    from dsconv.tiny import train_tokenizer

    tok = train_tokenizer(calib_texts(), vocab_size=384 - len(QWEN_TOKENS))
    tok.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    return tok  # 384 tokens: a multiple of 64, so vLLM's padded vocabulary is the checkpoint's


def source_name(family: str, dtype: str, layout: str, scheme: str | None = None, seed: int = 0) -> str:
    wide_ = scheme is not None and wide(family, scheme)
    return f"{family}-{dtype}-{layout}" + ("-wide" if wide_ else "") + ("" if seed == 0 else f"-s{seed}")


def build_source(root: Path, family: str, dtype: str, layout: str, tok: Any, scheme: str | None = None,
                 seed: int = 0) -> Path:
    """A tiny checkpoint of `family` for `scheme`'s rows (cached by its path): bf16 or fp16, per-expert or
    transformers' fused experts, wide where the scheme needs it (WIDE), with the special-token ids in config.json
    that real checkpoints carry (MindIE checks eos against the vocabulary)."""
    from dsconv.tiny import add_mtp_layer, make_tiny

    d = root / source_name(family, dtype, layout, scheme, seed)
    if not (d / "config.json").exists():
        ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
        shape = WIDE.get(family, {}) if scheme is not None and wide(family, scheme) else {}
        if layout == "rotated":
            from dsconv.quant.rotate import RotateRequest, run

            plain = build_source(root, family, dtype, "per-expert", tok, scheme, seed)
            run(RotateRequest(plain, d, seed=seed, progress=False))
            return d
        make_tiny(family, d, dtype=dtype, tokenizer=tok, fused=layout == "fused", seed=seed, **{**ids, **shape})
        if layout == "mtp":
            add_mtp_layer(d, seed=seed)
    return d


def quantize(src: Path, out: Path, engine: str, options: list[str]) -> tuple[int, str]:
    """`dsconv quantize` through its CLI entry point, in this process (imports paid once): (exit code, last line of
    what it printed to stderr)."""
    from dsconv.cli import main

    args = ["quantize", "-m", str(src), "-o", str(out), "--engine", engine, "--force", *options, *FAST]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(args)  # always ends in SystemExit with the CLI's exit code
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code, (err.getvalue().strip().splitlines() or [""])[-1]
