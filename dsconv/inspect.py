"""`dsconv inspect`: what a model is and what it needs, from headers (or config.json) alone.

Parameters and bytes by category, dtypes, KV-cache bytes per token, and how many cards of each SoC the weights need
at BF16/FP16, INT8 and INT4, plain and with the field's 1.2-1.3 overhead factor. "parameters" counts each stored
model parameter once (tied embeddings once, FP8 scales and int8 auxiliaries excluded); DeepSeek's router
`e_score_correction_bias` counts, as in DeepSeek's own code and its 671B figure.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from dsconv.families.roles import Category
from dsconv.qformat import FA_QUANT, FA_QUANT_WHERE, cache_form, cache_tensors, int8_cache, PACKED_INT4, scale_bias_chunks
from dsconv.soc import soc_facts
from dsconv.tensors import human_bytes

# Bytes per parameter of a quantized linear at each precision, scales included (INT4: group 128, fp32 scale+offset).
PRECISIONS = {"bf16": None, "int8": 1.0 + 0.0, "int4": 0.5 + 8 / 128}
OVERHEADS = (1.2, 1.3)
NODE_SOC, NODE_CARDS = "Ascend910B", 8  # one Atlas 800I A2 server
SIZING_SOCS = ("Ascend910B", "Ascend910B4", "Ascend310P3")


def inspect_model(ck: Any) -> dict[str, Any]:
    """The whole report as one JSON-ready dict (`ck` is a Checkpoint or a ConfigOnly)."""
    facts = ck.facts
    cats: dict[str, dict[str, int]] = defaultdict(lambda: {"parameters": 0, "bytes": 0, "tensors": 0})
    dtypes: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0})
    total_bytes = elements = parameters = main_parameters = 0
    quantizable = other = 0  # parameters by whether the default quantization touches them
    w4a8 = 0  # bytes under `quantize --scheme w4a8_dynamic` (routed experts int4, other linears int8)
    mix = 0  # bytes under `quantize --scheme w8a8_mix` (PD-mix: both paths' scales beside each int8 weight)
    experts = False
    head, embed = ck.family.tensor("lm_head"), ck.family.tensor("embed")
    tied_dup = facts.tie_word_embeddings and head in ck.tensors and embed in ck.tensors
    cache = cache_tensors(getattr(ck, "quant_description", None))  # int8 KV-cache scales: no model parameters
    for name, info in ck.tensors.items():
        r = ck.roles[name]
        numel = math.prod(info.shape)
        c = cats[r.category.value]
        c["bytes"] += info.nbytes
        c["tensors"] += 1
        d = dtypes[info.dtype]
        d["tensors"] += 1
        d["bytes"] += info.nbytes
        total_bytes += info.nbytes
        elements += numel
        if r.is_aux or name in cache or (tied_dup and name == head):
            continue
        if info.dtype == "I8" and ck.is_quantized and _packed_int4(ck, name):
            numel *= 2  # two int4 values per byte
        c["parameters"] += numel
        parameters += numel
        if r.category is not Category.MTP:
            main_parameters += numel
        if r.role.quantized_by_default and r.param == "weight":
            quantizable += numel
        else:
            other += numel
        experts = experts or r.category is Category.ROUTED_EXPERTS
        w4a8 += _recipe_bytes(r, tuple(info.shape), numel, "w4a8")
        mix += _recipe_bytes(r, tuple(info.shape), numel, "w8a8_mix")
    report: dict[str, Any] = {
        "model_type": facts.model_type,
        "family": ck.family.name,
        "source": "config" if not getattr(ck, "files", None) else "checkpoint",
        "parameters": parameters,
        "main_parameters": main_parameters,
        "elements": elements,
        "bytes": total_bytes,
        "tensors": len(ck.tensors),
        "files": len(getattr(ck, "files", []) or []),
        "dtypes": dict(sorted(dtypes.items())),
        "categories": {k.value: dict(cats[k.value]) for k in Category if k.value in cats},
        "architecture": facts.as_dict(),
        "kv_cache_bytes_per_token": {"bf16": facts.kv_bytes_per_token(2), "int8": facts.kv_bytes_per_token(1)},
        # DeepSeek-V3.2's indexer keys (counted in the KV cache above); a hybrid model's linear-attention state
        **({"indexer_cache_bytes_per_token": facts.indexer_bytes_per_token()} if facts.index_head_dim else {}),
        **({"state_bytes_per_sequence": facts.state_bytes_per_sequence()} if facts.layer_kinds else {}),
        "quantized": bool(ck.is_quantized),
        # the cache this checkpoint runs with: int8 when quantized with --kv-cache int8 (description C8)
        "kv_cache": "int8" if int8_cache(getattr(ck, "quant_description", None)) else "bf16",
        "kv_cache_form": cache_form(getattr(ck, "quant_description", None)),
    }
    recipes_bytes = {} if ck.is_quantized else {"w8a8_mix": mix, **({"w4a8": w4a8} if experts else {})}
    report["cards"] = cards_needed(quantizable, other, recipes_bytes or None)
    if not ck.is_quantized and not ck.family.quantize_refused:
        from dsconv.engines import mix_engines, recipes, w4a8_recipe

        report["engine_recipes"] = recipes(ck)
        report["engines_refused"] = {e: f"{t} ({src})" for e, (t, src) in ck.family.engine_refused.items()}
        report["w8a8_mix"] = {"weight_bytes": mix, "engines": mix_engines(ck)}
        if experts:
            report["w4a8"] = {"layer_types": w4a8_recipe(ck), "weight_bytes": w4a8,
                              "node_cards": NODE_CARDS, "node_soc": NODE_SOC}
    return report


def _recipe_bytes(r: Any, shape: tuple[int, ...], numel: int, recipe: str) -> int:
    """One tensor's bytes in a recipe's output (quant.plan, engines.W4A8_RECIPE / W8A8_MIX_RECIPE; the MindIE-side
    float down_proj of w8a8_mix is not counted). w4a8: a routed expert's weight int4 + fp32 scale, offset and
    scale_bias (16 chunks for down) per row; other linears, the MTP layer's included, int8 + scale and offset.
    w8a8_mix: routed experts int8 + scale and offset (W8A8_DYNAMIC), other linears int8 + both paths' fp32 scale,
    offset, deq_scale and int32 quant_bias per row and the two per-tensor values. DeepSeek kv_b_proj and everything
    else in 16 bits."""
    from dsconv.engines import layer_kind

    if r.param != "weight" or not r.role.quantized_by_default or len(shape) != 2:
        return 2 * numel
    kind = layer_kind(r)
    if r.category is Category.MTP and r.slot != "kv_b":
        kind = "mtp" if recipe == "w4a8" else None  # W4A8's MTP layer: W8A8_DYNAMIC (engines.W4A8_MTP)
    n = shape[0]
    if kind in (None, "kv_b"):
        return 2 * numel
    if kind == "routed_experts":
        return numel // 2 + n * (8 + 4 * scale_bias_chunks(r.role.tp_dim)) if recipe == "w4a8" else numel + 8 * n
    return numel + 8 * n if recipe == "w4a8" else numel + 16 * n + 8


def _packed_int4(ck: Any, name: str) -> bool:
    desc = ck.quant_description or {}
    return str(desc.get(name, "")) in PACKED_INT4


def weight_bytes(quantizable: int, other: int, precision: str) -> int:
    """Weights at `precision`: the default-quantized linears at that precision, everything else in 16 bits."""
    per = PRECISIONS[precision]
    if per is None:
        return 2 * (quantizable + other)
    return int(quantizable * per) + 2 * other


def cards_needed(quantizable: int, other: int, recipes: dict[str, int] | None = None) -> dict[str, Any]:
    """Cards per SoC for the weights at each precision, and for `recipes` given as total bytes (W4A8)."""
    out: dict[str, Any] = {}
    for soc in SIZING_SOCS:
        facts = soc_facts(soc)
        mem = facts.device_memory_mb * 2**20
        per_soc: dict[str, Any] = {"memory_bytes": mem}
        sizes = {p: weight_bytes(quantizable, other, p) for p in PRECISIONS} | (recipes or {})
        for precision, b in sizes.items():
            label = "fp16" if not facts.bf16 and precision == "bf16" else precision  # no BF16: cast to FP16
            per_soc[label] = {"weight_bytes": b, "cards": max(1, math.ceil(b / mem)),
                              **{f"cards_x{o}": max(1, math.ceil(b * o / mem)) for o in OVERHEADS}}
        out[soc] = per_soc
    return out


def human_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def render(report: dict[str, Any]) -> str:
    """A terminal report: one table of categories, the facts, the card counts."""
    a = report["architecture"]
    lines = [f"{report['family']} (model_type {report['model_type']}) from {report['source']}: "
             f"{report['parameters']:,} parameters ({human_count(report['parameters'])}), "
             f"{human_bytes(report['bytes'])} in {report['tensors']:,} tensors, {report['files']} files"]
    if report["main_parameters"] != report["parameters"]:
        lines.append(f"main model without MTP: {report['main_parameters']:,} parameters")
    lines.append("")
    lines.append(f"{'category':<16}{'parameters':>22}{'bytes':>16}{'tensors':>10}")
    for cat, c in report["categories"].items():
        lines.append(f"{cat:<16}{c['parameters']:>22,}{human_bytes(c['bytes']):>16}{c['tensors']:>10,}")
    lines.append("")
    lines.append("dtypes: " + ", ".join(f"{k} {v['tensors']:,} tensors / {human_bytes(v['bytes'])}"
                                        for k, v in report["dtypes"].items()))
    geo = [f"layers {a['num_layers']}", f"hidden {a['hidden_size']}", f"heads {a['num_heads']}",
           f"kv heads {a['num_kv_heads']}", f"head dim {a['head_dim']}", f"vocab {a['vocab_size']}"]
    if a["num_experts"]:
        geo.append(f"experts {a['num_experts']} (top-{a['experts_per_tok']}) in {len(a['moe_layers'])} layers")
    if a["kv_lora_rank"]:
        geo.append(f"MLA kv_lora {a['kv_lora_rank']} + rope {a['qk_rope_head_dim']}")
    if a["num_mtp_layers"]:
        geo.append(f"MTP layers {a['num_mtp_layers']}")
    if a.get("index_n_heads"):
        geo.append(f"indexer {a['index_n_heads']} heads x {a['index_head_dim']}")
    lines.append("architecture: " + ", ".join(geo))
    kv = report["kv_cache_bytes_per_token"]
    lines.append(f"KV cache per token (all layers): {kv['bf16']:,} B in BF16/FP16, {kv['int8']:,} B in INT8"
                 + ("; this checkpoint's cache is INT8" if report.get("kv_cache") == "int8" else "")
                 + (f" (FA quant: {FA_QUANT_WHERE})" if report.get("kv_cache_form") == FA_QUANT else ""))
    if "indexer_cache_bytes_per_token" in report:
        lines.append(f"  of which the indexer's key cache: {report['indexer_cache_bytes_per_token']:,} B per token "
                     f"(16-bit in both)")
    if "state_bytes_per_sequence" in report:
        full = sum(k != "linear_attention" for k in a["layer_kinds"])
        lines.append(f"  KV cache in the {full} full-attention layers only; the {len(a['layer_kinds']) - full} "
                     f"linear-attention layers keep {report['state_bytes_per_sequence']:,} B of state per sequence "
                     f"(BF16, any length)")
    lines.append("")
    for eng, kinds in report.get("engine_recipes", {}).items():
        lines.append(f"quantize --bits 8 --engine {eng}: " + ", ".join(f"{k} {t}" for k, t in kinds.items()))
    for eng, why in report.get("engines_refused", {}).items():
        lines.append(f"--engine {eng}: refused: {why}")
    w4 = report.get("w4a8")
    if w4:
        cards = report["cards"][w4["node_soc"]]["w4a8"]
        fits = "fits" if cards["cards_x1.3"] <= w4["node_cards"] else "does not fit"
        lines.append("quantize --bits 4 --scheme w4a8_dynamic: " +
                     ", ".join(f"{k} {t}" for k, t in w4["layer_types"].items()))
        lines.append(f"  W4A8 weights {human_bytes(w4['weight_bytes'])}: {cards['cards']} x {w4['node_soc']} "
                     f"({cards['cards_x1.3']} with x1.3): {fits} one {w4['node_cards']}-card node")
    mix = report.get("w8a8_mix")
    if mix:
        lines.append(f"quantize --scheme w8a8_mix (PD-mix) {human_bytes(mix['weight_bytes'])}: " +
                     "; ".join(f"{e} {v}" for e, v in mix["engines"].items()))
    lines.append("")
    lines.append("cards for the weights (plain / x1.2 / x1.3 for KV cache and workspace):")
    for soc, per in report["cards"].items():
        cells = []
        for prec, v in per.items():
            if prec == "memory_bytes":
                continue
            cells.append(f"{prec.upper()} {v['cards']}/{v['cards_x1.2']}/{v['cards_x1.3']}")
        lines.append(f"  {soc:<12} ({human_bytes(per['memory_bytes'])}): " + "   ".join(cells))
    return "\n".join(lines)
