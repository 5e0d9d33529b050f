"""Read a quantized directory the way MindIE-LLM's ATB loader does, and list every difference.

Each check names the loader function it mirrors (Ascend/MindIE-LLM @8b4871ad, `atb/` =
examples/atb_models/atb_llm/)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.engine_contract.common import (EXPERT_RE, FLOAT_DTYPES, Problems, c8_problems, c8_tensors, fa_problems,
                                          fa_tensors, linear_modules, read_json, routing, tensor)

# atb/utils/quantize/quant_type.py::QuantType (lower-case values of config.json `quantize`)
QUANT_TYPES = ("float", "w4a16", "w8a8", "w8a16", "w8a8s", "w8a8sc", "w8a8_dynamic", "w8a8_pdmix", "w4a8_dynamic",
               "w8a8_mix", "w16a16s", "w16a16sc")
# fused groups whose W8A8 input_scale/offset must be equal (weights.py::get_per_tensor_sharded)
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))
# tensors a region type reads (weights.py::get_multi_weights_col / get_replicated_weights)
READS = {"w8a8": ("weight", "deq_scale", "quant_bias", "input_scale", "input_offset"),
         "w8a8_dynamic": ("weight", "weight_scale", "weight_offset"), "w8a16": ("weight", "weight_scale", "weight_offset"),
         "w4a16": ("weight", "weight_scale", "weight_offset"),
         # W4A8 branches of get_multi_weights_col/_row: weight, weight_scale, scale_bias (weight_offset unread)
         "w4a8_dynamic": ("weight", "weight_scale", "scale_bias")}


def config_quantize(cfg: dict, desc_root: Path, p: Problems) -> str | None:
    """atb/models/base/router.py::BaseRouter.config: `quantize` from config.json (else the description's
    model_quant_type); atb/utils/layers/linear/__init__.py::get_linear asserts it is a QuantType."""
    q = cfg.get("quantize")
    if q is None:
        d = desc_root / "quant_model_description.json"
        if d.is_file():
            q = read_json(d).get("model_quant_type", "").lower() or None
    if q is None:
        p.add("BaseRouter.config", "no `quantize` in config.json and no description to infer it: int8 weights "
              "would load as float")
        return None
    if q not in QUANT_TYPES:
        p.add("get_linear", f"quantize={q!r} is not implemented")
        return None
    return q


def description(d: Path, quantize: str, p: Problems) -> dict | None:
    """atb/utils/weights.py::Weights._set_quant_params: quant_model_description.json, else
    quant_model_description_{quantize}.json (w8a8_dynamic / w8a8_pdmix fall back to _w8a8.json)."""
    names = ["quant_model_description.json", f"quant_model_description_{quantize}.json"]
    if quantize in ("w8a8_dynamic", "w8a8_pdmix"):
        names.append("quant_model_description_w8a8.json")
    for n in names:
        if (d / n).is_file():
            return read_json(d / n)
    p.add("_set_quant_params", f"none of {names} exists (AssertionError)")
    return None


def region(cfg: dict, quantize: str, module: str, layer: int, model_type: str) -> str:
    """Which config key governs a linear: DeepSeek mla_quantize (attention; modeling_deepseekv2.py::
    FlashDeepseekV2Attention.__init__), moe_quantize (routed experts; modeling_deepseek.py::DeepseekMoE.init_experts),
    quantize for dense MLP and shared experts; other families: quantize."""
    if model_type == "deepseek_v3":
        if ".self_attn." in module:
            return cfg.get("mla_quantize", quantize)
        if EXPERT_RE.match(module):
            # the MTP layer's experts: `quantize`'s type once mtp_quantize is present (modeling_deepseekv2.py,
            # flash_causal_deepseekv2.py: presence only)
            if layer >= cfg.get("num_hidden_layers", layer + 1) and "mtp_quantize" in cfg:
                return quantize
            return cfg.get("moe_quantize", quantize)
    return quantize


def linear(route: dict, desc: dict, module: str, rq: str, shape: tuple[int, int], model_dtype: str, version: str,
           group_size: int, p: Problems) -> str | None:
    """atb/utils/weights.py::get_multi_weights_col/_row + atb/utils/quantize/pack_type.py::calc_linear_pack_type:
    the pack type needs desc[module.weight] (KeyError otherwise); a float weight on disk is FLOAT whatever the region;
    otherwise the region's tensors are read (a w8a8_dynamic region counts W8A8 and W8A8_DYNAMIC as quantized but reads
    the dynamic tensors)."""
    key = module + ".weight"
    if key not in desc:
        p.add("calc_linear_pack_type", f"KeyError {key}")
        return None
    _, dt, sh = route[key]
    n, k = shape
    if dt in FLOAT_DTYPES:
        if desc[key] != "FLOAT":
            p.add("calc_linear_pack_type", f"{key} is {dt} but described {desc[key]}")
        return "FLOAT"
    if dt != "I8":
        p.add("get_multi_weights_col", f"{key}: {dt}")
        return None
    ok_types = {"w8a8_dynamic": ("W8A8_DYNAMIC", "W8A8")}.get(rq, (rq.upper(),))
    if desc[key] not in ok_types:
        p.add("get_multi_weights_col", f"{module}: described {desc[key]} in a `{rq}` region (read with the {rq} "
              "recipe)")
    for param in READS.get(rq, ()):
        name = f"{module}.{param}"
        if name not in route:
            p.add("get_multi_weights_col", f"{name} missing for region {rq} (AssertionError 'weight ... does not "
                  "exist')")
            continue
        _, dt2, sh2 = route[name]
        want = _want(rq, param, n, k, model_dtype, version, group_size, route, module)
        if want is not None and (dt2 not in want[0] or sh2 != want[1]):
            p.add(f"{rq} module", f"{name}: {dt2}{list(sh2)}, wants {'/'.join(want[0])}{list(want[1])}")
        if param == "input_offset" and name in route:
            v = tensor(route, name)
            if not (np.all(v == np.rint(v)) and v.min() >= -128 and v.max() <= 127):
                p.add("W8A8LinearStatic.__init__", f"{name}={v} does not survive the int8 cast")
    return desc[key]


def _want(rq, param, n, k, model_dtype, version, group_size, route, module):
    """Shapes and dtypes the quant modules hold (atb/utils/quantize/w8a8.py::W8A8LinearStatic,
    w8a8_dynamic.py::W8A8LinearDynamic, w8a16.py, w4a16.py::W4A16LinearStatic; weights.py::correct_tensor_dtype)."""
    if rq == "w4a8_dynamic":  # atb/utils/quantize/w4a8.py::W4A8LinearDynamic (packed form, per channel)
        down = module.rsplit(".", 1)[1] in ("down_proj", "w2")
        return {"weight": (("I8",), (n // 2, k)), "weight_scale": (FLOAT_DTYPES, (n, 1)),
                "scale_bias": (("F32",), (n, 16 if down else 1))}.get(param)
    if param == "weight":
        if rq != "w4a16":
            return ("I8",), (n, k)
        scale = route.get(module + ".weight_scale")
        per_channel = scale is not None and scale[2][-1] == 1
        if version == "0.0.0":
            return ("I8",), (n, k)  # one int4 per byte; MindIE packs (low_bit_utils.py::int42int8)
        return ("I8",), ((n, k // 2) if per_channel else (n // 2, k))  # w4a16.py: pre-packed along the kernel dim
    if param == "deq_scale":  # kept float32 for bf16; fp16 accepts float32 or int64 bit patterns
        return (("F32",) if model_dtype == "BF16" else ("F32", "I64")), (n,)
    if param == "quant_bias":
        return ("I32",), (n,)
    if param in ("input_scale", "input_offset"):
        return FLOAT_DTYPES + ("I8",), (1,)
    if param in ("weight_scale", "weight_offset"):
        if rq == "w4a16":
            g = group_size or k
            return FLOAT_DTYPES, (n, k // g)
        return FLOAT_DTYPES, (n, 1)
    return None


def read(d: Path, src_shapes: dict[str, tuple[int, ...]], model_dtype: str, model_type: str,
         first_dense: int = 0) -> Problems:
    """Everything MindIE's loader does with a (non-sharded) quantized directory, as a list of problems."""
    p = Problems()
    cfg = read_json(d / "config.json")
    route = routing(d, p, d.name)
    quantize = config_quantize(cfg, d, p)
    if quantize is None:
        return p
    for key in ("mla_quantize", "moe_quantize"):
        if key in cfg and cfg[key] not in QUANT_TYPES:
            p.add("get_linear", f"{key}={cfg[key]!r} is not implemented")
    desc = description(d, quantize, p)
    if desc is None:
        return p
    version = desc.get("version", "0.0.0")  # weights.py::Weights.init_quant_params
    # weights.py W4A8 branch: `quant_desc.get("group_size") == 0` selects per channel; a missing key is per group
    # (weight_scale_second then required)
    if "moe_quantize" in cfg and cfg["moe_quantize"] == "w4a8_dynamic" or quantize == "w4a8_dynamic":
        if desc.get("group_size") != 0 or version != "1.0.0":
            p.add("get_multi_weights_col", f"W4A8 with group_size={desc.get('group_size')!r}, version={version!r}: "
                  "per channel needs group_size 0 written and the packed form 1.0.0")
    group_size = int(desc.get("group_size", 0) or 0)
    modules = linear_modules(route)
    types: dict[str, str | None] = {}
    for module, layer in sorted(modules.items()):
        rq = region(cfg, quantize, module, layer, model_type)
        types[module] = linear(route, desc, module, rq, tuple(src_shapes[module + ".weight"]), model_dtype, version,
                               group_size, p)
    # weights.py::get_per_tensor_sharded: fused W8A8 parts share input_scale/input_offset (ValueError otherwise)
    for module in modules:
        parent, _, leaf = module.rpartition(".")
        for group in FUSED:
            if leaf == group[0]:
                parts = [f"{parent}.{s}" for s in group if f"{parent}.{s}" in modules]
                if all(types.get(x) == "W8A8" for x in parts):
                    for aux in ("input_scale", "input_offset"):
                        vals = {float(tensor(route, f"{x}.{aux}").reshape(-1)[0]) for x in parts}
                        if len(vals) > 1:
                            p.add("get_per_tensor_sharded", f"{parent} `{aux}` are not equal: {sorted(vals)}")
    # modeling_deepseek.py::DeepseekMoE.init_experts: pack type from experts.0 up/gate; experts stacked
    # (TensorParallelColumnLinear.load_moe torch.stack) -> every expert of a layer has one type and shape
    bases: dict[str, set] = {}
    for module in modules:
        m = EXPERT_RE.match(module)
        if m:
            bases.setdefault(m.group(1), set()).add((types.get(module), m.group(3), route[module + ".weight"][2]))
    for base, seen in bases.items():
        for slot in {s for _, s, _ in seen}:
            kinds = {(t, sh) for t, s, sh in seen if s == slot}
            if len(kinds) > 1:
                p.add("load_moe", f"{base}.*.{slot}: experts differ {sorted(kinds, key=str)} (torch.stack)")
    # process_mla_linear.py::preprocess_kv_weights reshapes only the weight: kv_b_proj FLOAT
    if model_type == "deepseek_v3":
        for module in modules:
            if module.endswith("kv_b_proj") and types.get(module) != "FLOAT":
                p.add("preprocess_kv_weights", f"{module} is {types.get(module)}: only its weight is reshaped")
            # process_mla_linear.py::preprocess_linear_for_rope / trans_rope_weight: `weight.view(heads, q_head_dim,
            # -1)` then even/odd rope rows regrouped, on the tensor as stored: int4 packed along the output dim
            # ([n/2, k], two output rows per byte) moves half-rows and scrambles the rope rows without an error
            if module.endswith(("q_b_proj", "kv_a_proj_with_mqa")) and types.get(module) == "W4A16" \
                    and group_size > 0 and version != "0.0.0":
                p.add("preprocess_linear_for_rope", f"{module}: W4A16 per group is packed along n; the rope-row "
                                                    "permutation would move half-rows")
    kv_cache(cfg, desc, route, src_shapes, model_dtype, model_type, types, p)
    fa3(cfg, desc, route, model_dtype, model_type, p)
    config_keys(cfg, model_type, p)
    scales_in_model_dtype(route, model_dtype, p)
    return p


# model types whose flash_causal model registers the C8 cache (register_layer_kvquant: atb/models/llama/
# flash_causal_llama.py, atb/models/qwen2/flash_causal_qwen2.py, which Qwen3 routes to); the MoE models (qwen2_moe,
# which Qwen3-MoE routes to; mixtral) load no cache scales, DeepSeek none at all
C8_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# MindIE-LLM's user guide, feature pages "KV Cache int8" (only with W8A8) and "W8A16" (combines with KV cache int8)
C8_LINEAR_TYPES = ("W8A8", "W8A16", "FLOAT")


def quantization_config(cfg: dict, desc: dict, key: str) -> str | None:
    """atb/models/base/router.py::BaseRouter.config merges the description's keys into config.json's
    quantization_config, the description winning: one key of the result."""
    return desc.get(key, (cfg.get("quantization_config") or {}).get(key))


def kv_cache(cfg: dict, desc: dict, route: dict, src_shapes: dict, model_dtype: str, model_type: str,
             types: dict[str, str | None], p: Problems) -> None:
    """C8: atb/models/base/router.py::BaseRouter.config merges the description's globals into config.json's
    quantization_config (the description wins); atb/models/base/config.py::QuantizationConfig takes kv_quant_type
    ("only supported for type C8"); then every attention layer calls atb/utils/layers/attention/kv_cache.py::
    KvCache.load(<attn>.k_proj, <attn>.v_proj): get_sharded of the four tensors (missing -> error), cast to the model
    dtype (weights.py::correct_tensor_dtype), the offset's float32 bits read as int32 then int8; fp16/bf16 only."""
    kvq = quantization_config(cfg, desc, "kv_quant_type")
    layers = c8_tensors(route)
    if kvq is None:
        if layers:
            p.add("QuantizationConfig", "C8 cache tensors but no kv_quant_type: the cache stays float, scales unread")
        return
    if kvq != "C8":
        p.add("QuantizationConfig", f"kv_quant_type={kvq!r} ('only supported for type C8')")
        return
    if model_type not in C8_MODEL_TYPES:
        p.add("register_layer_kvquant", f"{model_type}: its model does not wire C8 cache scales into attention")
    if model_dtype not in ("F16", "BF16"):
        p.add("KvCache.__init__", f"model dtype {model_dtype}: 'The weight type must be FP16 or BF16.'")
    bad = sorted({t for t in types.values() if t not in C8_LINEAR_TYPES and t is not None})
    if bad:
        p.add("user guide: KV Cache int8", f"C8 beside {', '.join(bad)} linears (documented with W8A8 / W8A16 only)")
    attn_layers = {layer for m, layer in linear_modules(route).items() if m.endswith("self_attn.k_proj")}
    for layer in sorted(attn_layers - set(layers)):
        p.add("KvCache.load", f"layer {layer}: no kv_cache_scale/offset for its k_proj/v_proj (get_sharded fails)")
    widths = {m: src_shapes[m + ".weight"][0] for m in (n.rsplit(".", 1)[0] for l in layers.values()
                                                        for n in l.values())}
    c8_problems(route, layers, widths, model_dtype, "KvCache.load", p)


FA_QUANT_TYPES = ("FAQuant", "FAKQuant")  # atb/models/base/config.py::__check_fa_quant_type


def fa3(cfg: dict, desc: dict, route: dict, model_dtype: str, model_type: str, p: Problems) -> None:
    """MLA FA quant: the description's fa_quant_type reaches quantization_config (router.py merge) and must be
    FAQuant/FAKQuant (config.py::__check_fa_quant_type); atb/models/deepseekv2/modeling_deepseekv2.py calls
    atb/utils/layers/attention/fa3.py::FA3.load_mla(<attn>.fa_q, <attn>.fa_k, <attn>.fa_v) per layer: fa_q.scale
    reshaped to one row per head (inverted, sliced per TP rank), fa_k.scale one value (fa_v and the offsets are not
    read), cast to the model dtype. The query is quantized in MLA preprocess only with mla_quantize w8a8 and float16
    (flash_causal_deepseekv2.py enableMlaPreprocess; the user guide's FA3 page: float16 and W8A8 only)."""
    fa = quantization_config(cfg, desc, "fa_quant_type")
    layers = fa_tensors(route)
    if fa is None:
        if layers:
            p.add("QuantizationConfig", "FA-quant tensors but no fa_quant_type: the latent cache stays float")
        return
    if fa not in FA_QUANT_TYPES:
        p.add("__check_fa_quant_type", f"fa_quant_type={fa!r}")
        return
    if model_type != "deepseek_v3":
        p.add("FA3.load_mla", f"{model_type}: only DeepSeek's MLA attention loads FA3 scales")
    if model_dtype != "F16" or cfg.get("mla_quantize") != "w8a8":
        p.add("enableMlaPreprocess", f"FA3 with {model_dtype} and mla_quantize={cfg.get('mla_quantize')!r}: the "
              "query is quantized only for float16 with mla_quantize w8a8")
    fa_problems(route, layers, int(cfg["num_attention_heads"]), model_dtype, "FA3.load_mla", p)


def config_keys(cfg: dict, model_type: str, p: Problems) -> None:
    """Keys MindIE reads from config.json with no default, under its pinned transformers 4.x (which maps neither
    `dtype` -> torch_dtype nor `rope_parameters` -> rope_theta/rope_scaling):
    atb/runner/model_runner.py::ModelRunner.__init__ `self.config.torch_dtype` (NotImplementedError unless
    float16/bfloat16); deepseekv2/config_deepseekv2.py `__init__(self, rope_scaling, **kwargs)` (TypeError when the
    key is missing; null allowed); router_deepseekv2.py `topk_method` (greedy / group_limited_greedy / noaux_tc);
    config_qwen2.py / flash_causal_llama.py `rope_theta` (defaults to 10000: silently wrong for Qwen2's 1e6)."""
    if cfg.get("torch_dtype") not in ("float16", "bfloat16"):
        p.add("ModelRunner.__init__", f"config.json torch_dtype={cfg.get('torch_dtype')!r}")
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" in rp and cfg.get("rope_theta") != rp["rope_theta"]:
        p.add("config rope_theta", f"rope_theta={cfg.get('rope_theta')!r}, the model's is {rp['rope_theta']}")
    if model_type == "deepseek_v3":
        if "rope_scaling" not in cfg:
            p.add("DeepseekV2Config.__init__", "config.json lacks rope_scaling (TypeError)")
        if cfg.get("topk_method") not in ("greedy", "group_limited_greedy", "noaux_tc"):
            p.add("router_deepseekv2", f"topk_method={cfg.get('topk_method')!r}")


def scales_in_model_dtype(route: dict, model_dtype: str, p: Problems) -> None:
    """weights.py::correct_tensor_dtype casts every float tensor but a bf16 model's deq_scale to the model dtype
    (input_scale, weight_scale): a float32 value the model dtype cannot hold is rounded, and the kernel then
    computes with another scale than the one deq_scale, quant_bias and the int weights were derived from."""
    import torch

    want = {"BF16": torch.bfloat16, "F16": torch.float16}.get(model_dtype)
    if want is None:
        return
    for name, (_, dtype, _) in route.items():
        if dtype == "F32" and name.endswith((".input_scale", ".weight_scale")):
            t = torch.from_numpy(tensor(route, name))
            if not torch.equal(t.to(want).float(), t):
                p.add("correct_tensor_dtype", f"{name}: float32 values change when cast to {model_dtype}")


def int4_nibbles_match(route: dict, module: str, w: np.ndarray, tol: float = 0.25) -> bool:
    """Unpack the pre-packed int4 weight with MindIE's nibble order (low_bit_utils.py::int42int8: even element in
    the low nibble, odd in the high, along the kernel's last dim: k for per-channel [n, k/2], n for per-group [n/2, k])
    and compare the dequantized weight to the float one: a swapped order or axis gives an error near 1.4."""
    packed = tensor(route, module + ".weight").astype(np.int8)
    scale = tensor(route, module + ".weight_scale").astype(np.float32)
    low = ((packed.view(np.uint8) & 0x0F) ^ 8).astype(np.int16) - 8
    high = ((packed.view(np.uint8) >> 4) ^ 8).astype(np.int16) - 8
    n, k = w.shape
    q = np.empty((n, k), np.float32)
    if scale.shape[1] == 1:
        q[:, 0::2], q[:, 1::2] = low, high
    else:
        q[0::2], q[1::2] = low, high
    g = k // scale.shape[1]
    deq = (q.reshape(n, scale.shape[1], g) * scale[..., None]).reshape(n, k)
    return float(np.linalg.norm(deq - w) / max(np.linalg.norm(w), 1e-12)) < tol
