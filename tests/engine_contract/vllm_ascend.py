"""Read a quantized directory the way vLLM-Ascend's ModelSlim path does, and list every difference.

Each check names the loader function it mirrors (vllm-project/vllm-ascend @182b75ea, `va/` = vllm_ascend/)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.engine_contract.common import (EXPERT_RE, FLOAT_DTYPES, Problems, c8_problems, c8_tensors, fa_problems,
                                          fa_tensors, linear_modules, read_json, routing, tensor)

# va/quantization/methods/* @register_scheme, A2/A3 registry (docs/engine_rules.md C.3)
REGISTRY = {"linear": {"W8A8", "W8A8_DYNAMIC", "W8A16", "W8A8_MIX", "W4A4_DYNAMIC"},
            "moe": {"W8A8_DYNAMIC", "W4A8_DYNAMIC", "W4A16"}}
# va/quantization/modelslim_config.py::packed_modules_model_mapping (fused vLLM layer -> checkpoint shards)
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}
EXPERT_SLOTS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
DESCRIPTION = "quant_model_description.json"
# va/patch/worker/patch_gqa_c8.py: the model classes whose load_weights maps C8 scale names through
# AscendModelSlimConfig.get_cache_scale (Qwen3ForCausalLM, Glm4MoeForCausalLM, MiniMaxM2ForCausalLM)
C8_MODEL_TYPES = ("qwen3", "glm4_moe", "minimax_m2")
C8_PARAMS = ("kv_cache_scale", "kv_cache_offset")
# patch_weight_utils.py patches vllm.model_executor.models.deepseek_v2 only, whose DeepseekV3ForCausalLM also runs
# Kimi-K2 (its config.json's architectures)
FA_MODEL_TYPES = ("deepseek_v3", "kimi_k2")


def description_file(d: Path, cfg: dict, p: Problems) -> dict | None:
    """va/quantization/modelslim_config.py::AscendModelSlimConfig.maybe_update_config: only
    quant_model_description.json; upstream get_quant_config + from_config: a config.json quantization_config is
    used instead of the file (then every per-layer lookup KeyErrors)."""
    if "quantization_config" in cfg:
        p.add("maybe_update_config", "config.json has quantization_config: the description file would be ignored")
    if not (d / DESCRIPTION).is_file():
        p.add("maybe_update_config", f"no {DESCRIPTION} ('ModelSlim Quantization Config Not Found')")
        return None
    return read_json(d / DESCRIPTION)


def global_keys(desc: dict, p: Problems) -> None:
    """va/quantization/modelslim_config.py::_add_kvcache_quant_metadata: presence of indexer_quant_type enables
    indexer quant (a null counts); fa_quant_type is checked with its tensors (fa_quant)."""
    if "indexer_quant_type" in desc:
        p.add("_add_kvcache_quant_metadata", f"description has indexer_quant_type={desc['indexer_quant_type']!r}")


def fa_quant(desc: dict, route: dict, cfg: dict, model_dtype: str, model_type: str, p: Problems) -> None:
    """MLA FA quant. _add_kvcache_quant_metadata: a non-empty fa_quant_type enables it (a null counts as present)
    for the layers with a key containing `fa_k.scale`; their attention gets methods/kv_c8.py::
    AscendFAQuantAttentionMethod (fa_q.scale [num_heads, 1], fa_k / fa_v [1, 1] in the default dtype, int8 offsets,
    split per TP rank on dim 0 by _fa_quant_weight_loader); the checkpoint names reach them through
    patch/worker/patch_weight_utils.py (DeepSeek only: `<attn>.fa_*` -> `<attn>.mla_attn.mla_attn.fa_*`). On a
    decode instance the fused MLA path (attention/mla_v1.py::_process_weights_for_fused_fa_quant) reads q_proj's
    and fused_qkv_a_proj's weight_scale: W8A8_DYNAMIC attention."""
    layers = fa_tensors(route)
    if not layers:
        if "fa_quant_type" in desc:
            p.add("_add_kvcache_quant_metadata", f"fa_quant_type={desc['fa_quant_type']!r} enables FA quant, but "
                  "no layer has fa_k.scale")
        return
    if not desc.get("fa_quant_type"):
        p.add("load_weights", "FA-quant tensors without fa_quant_type: no parameter takes them")
        return
    if model_type not in FA_MODEL_TYPES:
        p.add("patch_weight_utils", f"{model_type}: FA-quant names are remapped for DeepSeek only")
    for layer in layers.values():
        for name in layer.values():
            if desc.get(name) is None:
                p.add("_add_kvcache_quant_metadata", f"{name} is not in the description")
    for module in linear_modules(route):
        if module.endswith(("q_b_proj", "q_a_proj", "kv_a_proj_with_mqa")) and \
                desc.get(module + ".weight") != "W8A8_DYNAMIC":
            p.add("_process_weights_for_fused_fa_quant", f"{module} is {desc.get(module + '.weight')}: the fused "
                  "FA-quant MLA path reads its weight_scale (W8A8_DYNAMIC)")
    fa_problems(route, layers, int(cfg["num_attention_heads"]), model_dtype, "AscendFAQuantAttentionMethod", p)


def quant_type(desc: dict, prefix: str, p: Problems) -> str | None:
    """va/quantization/modelslim_config.py::get_linear_quant_type for a non-fused layer: plain dict indexing."""
    key = prefix + ".weight"
    if key not in desc:
        p.add("get_linear_quant_type", f"KeyError {key}")
        return None
    return desc[key]


def fused_type(desc: dict, prefix: str, shards: list[str], p: Problems) -> str | None:
    """va/quantization/modelslim_config.py::get_linear_quant_type (fused) + is_layer_skipped_ascend: every shard the
    same type ('Not all shards of {prefix} are quantized with same quant type')."""
    types = [quant_type(desc, s, p) for s in shards]
    if None in types:
        return None
    if len(set(types)) > 1:
        p.add("get_linear_quant_type", f"shards of {prefix} differ: {dict(zip(shards, types))}")
        return None
    return types[0]


def layer_tensors(route: dict, module: str, qtype: str, n: int, k: int, model_dtype: str, p: Problems) -> None:
    """va/quantization/methods/w8a8_static.py::AscendW8A8LinearMethod.get_weight/get_pertensor_param/
    get_perchannel_param; w8a8_dynamic.py; w8a16.py: the parameters a scheme creates, which disk tensors must fill
    (the strict 'not initialized' check is off for quantized models: a missing aux stays garbage, so absence is an
    error here; an extra tensor has no parameter)."""
    want: dict[str, tuple[tuple[str, ...], tuple[int, ...]]]
    if qtype == "FLOAT":
        want = {"weight": (FLOAT_DTYPES, (n, k))}
    elif qtype in ("W8A8", "W8A8_MIX"):
        deq = ("F32",) if model_dtype == "BF16" else ("I64",)
        want = {"weight": (("I8",), (n, k)), "input_scale": (FLOAT_DTYPES, (1,)), "input_offset": (FLOAT_DTYPES + ("I8",), (1,)),
                "quant_bias": (("I32",), (n,)), "deq_scale": (deq, (n,))}
        if qtype == "W8A8_MIX":  # methods/w8a8_pdmix.py: static's parameters + the dynamic path's [n, 1] scales
            want.update({"weight_scale": (FLOAT_DTYPES, (n, 1)), "weight_offset": (FLOAT_DTYPES, (n, 1))})
    elif qtype in ("W8A8_DYNAMIC", "W8A16"):
        want = {"weight": (("I8",), (n, k)), "weight_scale": (FLOAT_DTYPES, (n, 1)),
                "weight_offset": (FLOAT_DTYPES, (n, 1))}
    elif qtype == "W4A4_DYNAMIC":
        # methods/w4a4_laos_dynamic.py::AscendW4A4LaosDynamicLinearMethod: int8 [n, k] (int4 values, packed at load),
        # float32 weight_scale / weight_offset [n, 1]
        want = {"weight": (("I8",), (n, k)), "weight_scale": (("F32",), (n, 1)), "weight_offset": (("F32",), (n, 1))}
    elif qtype == "W4A8_DYNAMIC":
        # methods/w4a8.py::AscendW4A8DynamicFusedMoEMethod, per-channel 1.0.0 path (get_weight_modelslim,
        # get_dynamic_quant_param_modelslim): w13 [E, I, H] / w2 [E, H/2, I] int8 (packed along n), fp32 scales and
        # offsets [.., 1], scale_bias [E, 2I, 1] (gate/up) / [E, H, 16/tp] (down, narrowed on dim 1 by _load_w2)
        down = module.rsplit(".", 1)[1] in ("down_proj", "w2")
        want = {"weight": (("I8",), (n // 2, k)), "weight_scale": (("F32",), (n, 1)),
                "weight_offset": (("F32",), (n, 1)), "scale_bias": (("F32",), (n, 16 if down else 1))}
    else:
        p.add("create_scheme_for_layer", f"{module}: no scheme for {qtype}")
        return
    for param, (dtypes, shape) in want.items():
        name = f"{module}.{param}"
        if name not in route:
            p.add("get_weight", f"{name} missing for {qtype}")
            continue
        _, dt, sh = route[name]
        if dt not in dtypes or sh != shape:
            p.add("get_weight", f"{name}: {dt}{list(sh)}, {qtype} needs {'/'.join(dtypes)}{list(shape)}")
    for name in route:
        if name.startswith(module + ".") and name.rsplit(".", 1)[1] not in (*want, "bias", *C8_PARAMS) \
                and name.count(".") == module.count(".") + 1:  # C8 cache tensors: checked by kv_cache()
            p.add("load_weights", f"{name}: no {qtype} parameter takes it")


def kv_cache(desc: dict, route: dict, src_shapes: dict, model_dtype: str, model_type: str, p: Problems) -> None:
    """C8 cache scales. va/quantization/modelslim_config.py::_add_kvcache_quant_metadata: C8 is on iff the
    description says kv_cache_type C8, for the layers with a key containing `k_proj.kv_cache_scale`
    (is_c8_quant_layer: their attention gets methods/kv_c8.py::AscendC8KVCacheAttentionMethod, whose [1] parameters
    _c8_kv_scale_weight_loader replaces with the loaded tensor). Only the model classes of patch_gqa_c8.py map the
    names (get_cache_scale -> attn.k_cache_scale ...): elsewhere they reach the model's loader (Llama, Qwen2:
    KeyError on qkv_proj.kv_cache_offset; Qwen3-MoE: dropped, the parameters keep their initial values)."""
    layers = c8_tensors(route)
    on = desc.get("kv_cache_type") == "C8"
    if not layers:
        if on:
            p.add("_add_kvcache_quant_metadata", "kv_cache_type C8 but no k_proj.kv_cache_scale: no layer is C8")
        return
    if not on:
        p.add("load_weights", "C8 cache tensors without kv_cache_type C8: they reach the model loader unmapped")
        return
    if model_type not in C8_MODEL_TYPES:
        p.add("patch_gqa_c8", f"{model_type}: its loader does not map k_proj.kv_cache_scale to attn.k_cache_scale")
    for layer in layers.values():
        for name in layer.values():
            if desc.get(name) is None:
                p.add("_add_kvcache_quant_metadata", f"{name} is not in the description (its layer is not C8)")
    widths = {m: src_shapes[m + ".weight"][0] for m in (n.rsplit(".", 1)[0] for l in layers.values()
                                                        for n in l.values())}
    c8_problems(route, layers, widths, model_dtype, "_c8_kv_scale_weight_loader", p)


def read(d: Path, src_shapes: dict[str, tuple[int, ...]], model_dtype: str, model_type: str) -> Problems:
    """Everything vLLM-Ascend does with the directory before the first forward, as a list of problems."""
    p = Problems()
    cfg = read_json(d / "config.json")
    desc = description_file(d, cfg, p)
    route = routing(d, p, d.name)
    if desc is None:
        return p
    global_keys(desc, p)
    kv_cache(desc, route, src_shapes, model_dtype, model_type, p)
    fa_quant(desc, route, cfg, model_dtype, model_type, p)
    # methods/w4a8.py::AscendW4A8DynamicFusedMoEMethod.__init__: per channel iff group_size == 0 (the default is
    # 256, per group: its *_second params would stay unfilled), packed iff version "1.0.0"; and
    # AscendW4A8DynamicLinearMethod.get_pergroup_param divides by group_size: no W4A8 linear in a per-channel file
    if "W4A8_DYNAMIC" in desc.values():
        if desc.get("group_size") != 0 or desc.get("version") != "1.0.0":
            p.add("AscendW4A8DynamicFusedMoEMethod", f"group_size={desc.get('group_size')!r}, "
                  f"version={desc.get('version')!r}: the per-channel packed path needs 0 and '1.0.0'")
    # va/quantization/modelslim_config.py::get_quant_method (VocabParallelEmbedding / ParallelLMHead lookups)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in route and desc.get(name) != "FLOAT":
            p.add("get_quant_method", f"{name}: description says {desc.get(name)!r}, needs FLOAT")
    modules = linear_modules(route)
    done: set[str] = set()
    for module in sorted(modules):
        if module in done:
            continue
        m = EXPERT_RE.match(module)
        if m:  # FusedMoE: type from experts.0.* only (get_quant_method -> create_scheme_for_layer("moe"))
            base = m.group(1)
            slots = next(s for s in EXPERT_SLOTS if m.group(3) in s)
            shards = [f"{base}.0.{s}" for s in slots]
            t = fused_type(desc, base, shards, p)
            members = sorted(x for x in modules if x.startswith(base + "."))
            done.update(members)
            if t is None:
                continue
            if t != "FLOAT" and t not in REGISTRY["moe"]:
                p.add("create_scheme_for_layer", f"{base}: NotImplementedError quant_type={t} layer_type=moe")
            for x in members:  # experts 1..N are never looked up: they must hold what experts.0 says
                if desc.get(x + ".weight") != t:
                    p.add("get_quant_method", f"{x}: {desc.get(x + '.weight')} but {base} is loaded as {t}")
                n, k = src_shapes[x + ".weight"]
                layer_tensors(route, x, t, n, k, model_dtype, p)
            continue
        parent, _, leaf = module.rpartition(".")
        group = next(((f, s) for f, s in PACKED.items() if leaf in s), None)
        shards = [module]
        if group is not None:
            shards = [f"{parent}.{s}" for s in group[1] if f"{parent}.{s}.weight" in route]
        t = fused_type(desc, f"{parent}.{group[0]}" if group else module, shards, p) if len(shards) > 1 \
            else quant_type(desc, module, p)
        done.update(shards)
        if t is None:
            continue
        if t != "FLOAT" and t not in REGISTRY["linear"]:
            p.add("create_scheme_for_layer", f"{module}: NotImplementedError quant_type={t} layer_type=linear")
            continue
        for s in shards:
            n, k = src_shapes[s + ".weight"]
            layer_tensors(route, s, t, n, k, model_dtype, p)
        if t in ("W8A8", "W8A8_MIX") and len(shards) > 1:
            # va/quantization/method_adapters.py::AscendLinearMethod.create_weights: one [1] input_scale slot per
            # fused layer, each shard overwrites it -> shards must agree
            for aux in ("input_scale", "input_offset"):
                vals = {float(tensor(route, f"{s}.{aux}").reshape(-1)[0]) for s in shards if f"{s}.{aux}" in route}
                if len(vals) > 1:
                    p.add("create_weights", f"{parent} {aux} differs across fused shards {sorted(vals)}")
    # va/attention/mla_v1.py::process_weights_after_loading: kv_b_proj unquantized, [heads*(nope+v), kv_lora]
    if model_type == "deepseek_v3":
        for module in modules:
            if module.endswith("kv_b_proj"):
                if desc.get(module + ".weight") != "FLOAT" or route[module + ".weight"][1] not in FLOAT_DTYPES:
                    p.add("process_weights_after_loading", f"{module} is quantized ('We currently do not support "
                          "quant kv_b_proj')")
                elif route[module + ".weight"][2] != tuple(src_shapes[module + ".weight"]):
                    p.add("process_weights_after_loading", f"{module} shape {route[module + '.weight'][2]}")
    return p


def dequant_close(route: dict, module: str, w: np.ndarray, tol: float) -> bool:
    q = tensor(route, module + ".weight").astype(np.float32)
    s = tensor(route, module + ".weight_scale").astype(np.float32)
    err = np.linalg.norm(q * s - w) / max(np.linalg.norm(w), 1e-12)
    return err < tol
