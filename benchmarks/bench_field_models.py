"""The field's current models from their published config.json alone (tests/data/real_configs/): what `dsconv
inspect` and `dsconv shard` say of GLM-4.5 / 4.5-Air, DeepSeek-V3.2, Kimi-K2-Instruct and Qwen3-Next-80B-A3B.

Per model: parameters (dsconv, and transformers' own model built on the meta device: they must agree), the MTP block,
the KV / indexer cache per token and the linear-attention state per sequence, the 910B cards its weights need at
BF16 / INT8 / W4A8, the `--bits 8` recipe per engine (or why the engine refuses it), and one `shard` plan of the
size a team would deploy on 910B (64 GB) nodes, with its fit figures; the wall time of each CLI call.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from benchmarks.common import save

REAL = Path(__file__).resolve().parent.parent / "tests" / "data" / "real_configs"
# the deployment a team would try first: (shard options) on 910B nodes
PLANS = {"glm-4.5": ["--tp", "8", "--ep", "16", "--world", "16", "--scheme", "w8a8_dynamic"],
         "glm-4.5-air": ["--tp", "4", "--ep", "4", "--world", "4", "--scheme", "w8a8_dynamic"],
         "deepseek-v3.2": ["--tp", "4", "--ep", "32", "--world", "32", "--scheme", "w8a8_dynamic"],
         "kimi-k2-instruct": ["--tp", "4", "--ep", "32", "--world", "32", "--scheme", "w8a8_dynamic"],
         "qwen3-next-80b-a3b": ["--tp", "4", "--ep", "4", "--world", "4", "--scheme", "w8a8_dynamic",
                                "--batch", "64"],
         "qwen3.5-397b-a17b": ["--tp", "4", "--ep", "16", "--world", "16", "--scheme", "w8a8_dynamic",
                               "--batch", "64"]}


def _cli(args: list[str]) -> tuple[dict[str, Any], float]:
    import contextlib
    import io

    from dsconv.cli import main

    out = io.StringIO()
    t = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            main([*args, "--json"])
        except SystemExit as e:
            if e.code not in (0, None):
                raise RuntimeError(f"dsconv {' '.join(args)}: exit {e.code}") from None
    return json.loads(out.getvalue()), time.perf_counter() - t


def transformers_parameters(config: dict) -> int:
    """Parameters (and DeepSeek-style routing-bias buffers, which dsconv counts as DeepSeek does) of transformers'
    own model for `config`, built on the meta device (tests/test_new_families.py holds inspect to it too)."""
    import torch
    import transformers

    from dsconv.families import family_for
    from dsconv.families.facts import hf_config

    with torch.device("meta"):  # the whole checkpoint's model: a vision-language one with its tower
        model = getattr(transformers, family_for(config).checkpoint_class).from_config(hf_config(config))
    state = set(model.state_dict())
    return sum(p.numel() for p in model.parameters()) + sum(b.numel() for n, b in model.named_buffers() if n in state)


def main() -> None:
    figures: dict[str, Any] = {}
    for name, plan in PLANS.items():
        path = REAL / f"{name}.json"
        config = json.loads(path.read_text())
        report, inspect_s = _cli(["inspect", "--config", str(path)])
        shard, shard_s = _cli(["shard", "--config", str(path), "--engine", "vllm-ascend", *plan])
        cards = report["cards"]["Ascend910B"]
        mem = shard["memory"]
        figures[name] = {
            "family": report["family"], "parameters": report["parameters"],
            "main_parameters": report["main_parameters"], "transformers_parameters": transformers_parameters(config),
            "mtp_parameters": report["parameters"] - report["main_parameters"],
            "categories_B": {k: round(v["parameters"] / 1e9, 3) for k, v in report["categories"].items()},
            "kv_cache_bytes_per_token": report["kv_cache_bytes_per_token"],
            "indexer_cache_bytes_per_token": report.get("indexer_cache_bytes_per_token", 0),
            "state_bytes_per_sequence": report.get("state_bytes_per_sequence", 0),
            "cards_910b": {p: cards[p]["cards_x1.3"] for p in ("bf16", "int8", "w4a8") if p in cards},
            "bits8": report.get("engine_recipes", {}), "refused": report.get("engines_refused", {}),
            "plan": " ".join(plan), "plan_ok": shard["ok"], "weights_per_card_gib": round(
                shard["balance"]["max_bytes"] / 2**30, 2), "kv_tokens_per_card": mem["min_kv_tokens"],
            "inspect_s": round(inspect_s, 2), "shard_s": round(shard_s, 2)}
        assert figures[name]["main_parameters"] == figures[name]["transformers_parameters"], name
    save("field_models", figures)


if __name__ == "__main__":
    main()
