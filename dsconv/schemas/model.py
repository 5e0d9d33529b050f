"""What a model directory's metadata must be: safetensors headers, the index, config.json, and their agreement.

Why here and not in the families: a family turns a config into facts and tensor names; it trusts the types it is
given. This module is what makes them trustworthy, with bounds wide enough for any published model (DeepSeek-V3: 61
layers, 256 experts, 129,280 vocab) and narrow enough that a typo cannot ask for a terabyte of tensor names.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Collection, Iterable, Mapping

from dsconv.errors import UserError
from dsconv.schemas.core import MISSING, Fields, is_int, parse_json, show, type_name
from dsconv.tensors import DTYPE_SIZES

MAX_RANK = 8
MAX_DIM = 2**40
MAX_NAME = 1024
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2")
DAMAGED = "the file is damaged or not safetensors; re-download or re-copy it"


# ------------------------------------------------------------------------------------------- safetensors header
def safetensors_header(raw: bytes, where: str, data_len: int) -> dict[str, dict[str, Any]]:
    """{name: {"dtype", "shape", "data_offsets"}} of a header's JSON bytes, each entry checked against the data
    length: known dtype, bounded rank and dims, byte span = prod(shape) x item size, inside the data, no overlap.

    Two paths, one verdict: `_plain_header` accepts the header every writer produces (nothing but those three keys
    per entry, string metadata, no \\u escapes) with one bounded pass over it, and declines everything else, which the
    strict reader below then accepts or rejects with its message. A header `_plain_header` accepts passes every check
    of the strict reader: no key appears twice, the nesting is at most 2 levels by construction, strings without
    escapes cannot hold lone surrogates, and every integer is a bounded dim or offset."""
    header = _plain_header(raw, data_len)
    return header if header is not None else _strict_header(raw, where, data_len)


def _strict_header(raw: bytes, where: str, data_len: int) -> dict[str, dict[str, Any]]:
    """safetensors_header through the strict JSON reader: any header, every rejection with its message."""
    header = parse_json(raw, f"{where} header", DAMAGED)
    if not isinstance(header, dict):
        raise UserError(f"{where}: header is {type_name(header)}, not a JSON object", hint=DAMAGED)
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise UserError(f"{where}: __metadata__ must map strings to strings", hint=DAMAGED)
    spans = []
    for name, e in header.items():
        if not name or len(name) > MAX_NAME:
            raise UserError(f"{where}: a tensor name of {len(name)} characters", hint=DAMAGED)
        bad = _entry_problem(e)
        if bad:
            raise UserError(f"{where}: tensor {name} has a malformed header entry ({bad})", hint=DAMAGED)
        dtype, shape, (a, b) = e["dtype"], e["shape"], e["data_offsets"]
        need = math.prod(shape) * DTYPE_SIZES[dtype]
        if b - a != need:
            raise UserError(f"{where}: tensor {name} spans {b - a} bytes but {dtype}{shape} needs {need}",
                            hint=DAMAGED)
        if b > data_len:
            raise UserError(f"{where}: tensor {name} ends at data byte {b}, past the end of the file's "
                            f"{data_len} data bytes", hint="the file is truncated; re-download or re-copy it")
        spans.append((a, b, name))
    spans.sort()
    for (a1, b1, n1), (a2, b2, n2) in zip(spans, spans[1:]):
        if a2 < b1:
            raise UserError(f"{where}: tensors {n1} and {n2} overlap (bytes {a2}..{b1})",
                            hint="the file is damaged or crafted; do not use it")
    return header


def _plain_header(raw: bytes, data_len: int) -> dict[str, dict[str, Any]] | None:
    """The header when it is plain and valid (see safetensors_header), else None: no message, the strict path has it.

    Plain: every entry holds dtype, shape and data_offsets in that order (as safetensors, torch and dsconv write
    them), __metadata__ maps strings to strings, and no string has an escape. Objects are parsed as tuples of pairs
    (in C) and duplicate keys found by counting, so the 91,991 entries of DeepSeek-V3 cost one loop and no hook
    call each: the strict reader's tree walk and per-integer hook cost 1.6 s over its 163 headers."""
    import json

    if b"\\u" in raw:  # an escape may spell a lone surrogate: the strict reader checks every string
        return None
    try:
        pairs = json.loads(raw.decode("utf-8"), object_pairs_hook=tuple)
    except Exception:  # every parse failure is the strict reader's to report
        return None
    if type(pairs) is not tuple:
        return None
    header = dict(pairs)
    if len(header) != len(pairs):  # a name twice
        return None
    meta = header.pop("__metadata__", None)
    if meta is not None and not (type(meta) is tuple and len(dict(meta)) == len(meta)
                                 and all(type(v) is str for _, v in meta)):
        return None
    sizes = DTYPE_SIZES
    spans = []
    for name, e in header.items():
        if type(e) is not tuple or len(e) != 3 or not 0 < len(name) <= MAX_NAME:
            return None
        (k0, dtype), (k1, shape), (k2, offsets) = e
        if k0 != "dtype" or k1 != "shape" or k2 != "data_offsets":
            return None
        n = sizes.get(dtype) if type(dtype) is str else None
        if n is None or type(shape) is not list or len(shape) > MAX_RANK or type(offsets) is not list \
                or len(offsets) != 2:
            return None
        for d in shape:
            if type(d) is not int or not 0 <= d <= MAX_DIM:
                return None
            n *= d
        a, b = offsets
        if type(a) is not int or type(b) is not int or not 0 <= a <= b <= data_len or b - a != n:
            return None
        spans.append((a, b))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
    spans.sort()
    end = 0
    for a, b in spans:
        if a < end:
            return None
        end = b
    return header


def _entry_problem(e: Any) -> str | None:
    if not isinstance(e, dict):
        return f"{type_name(e)} instead of an object"
    for key in ("dtype", "shape", "data_offsets"):
        if key not in e:
            return f"no {key}"
    dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        return f"dtype {show(dtype)} is not a safetensors dtype"
    if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(is_int(0, MAX_DIM)(d) for d in shape):
        return f"shape {show(shape)} is not a list of at most {MAX_RANK} sizes"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(0, 2**63)(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        return f"data_offsets {show(offsets)} is not [begin, end]"
    return None


# ------------------------------------------------------------------------------------------- index
def safetensors_index(data: Any, where: str) -> dict[str, str]:
    """The weight_map of a `*.safetensors.index.json`: tensor name -> relative part file name."""
    hint = "fix or re-download the index"
    f = Fields(data, where, hint)
    weight_map = f.obj("weight_map")
    f.obj("metadata", default={})
    checked: set[str] = set()  # 163 part names for 91,991 tensors: each checked once
    for name, part in weight_map.items():
        if not name or len(name) > MAX_NAME:
            raise UserError(f"{where}: a tensor name of {len(name)} characters in weight_map", hint=hint)
        if type(part) is str and part in checked:
            continue
        if not isinstance(part, str) or len(part) > 4096 or any(len(p) > 255 for p in part.split("/")):
            raise UserError(f"{where}: {name} points to {show(part)}, not a file name", hint=hint)
        if part.startswith(("/", "\\")) or ".." in part.replace("\\", "/").split("/"):
            raise UserError(f"{where}: {name} points to {part[:200]!r}, outside the model directory",
                            hint="the index is damaged or crafted; dsconv only reads files inside the model dir")
        if not part.endswith(".safetensors"):
            raise UserError(f"{where}: {name} points to {show(part)}, not a .safetensors file", hint=hint)
        checked.add(part)
    if not weight_map:
        raise UserError(f"{where}: weight_map is empty", hint=hint)
    return weight_map


# ------------------------------------------------------------------------------------------- config.json
CONFIG_HINT = "compare it with the model's published config.json"
REQUIRED: Any = MISSING  # a config key's "default" when a family cannot do without it
DIM = 2**20
_INTS = {  # key -> (lo, hi): every integer a family reads, with bounds no published model comes near
    "num_hidden_layers": (1, 1024), "hidden_size": (1, DIM), "vocab_size": (1, 2**24),
    "num_attention_heads": (1, 4096), "num_key_value_heads": (1, 4096), "head_dim": (1, 8192),
    "intermediate_size": (1, 2**22), "moe_intermediate_size": (0, 2**22),
    "shared_expert_intermediate_size": (0, 2**22), "n_routed_experts": (0, 4096), "num_experts": (0, 4096),
    "num_local_experts": (0, 4096), "num_experts_per_tok": (0, 4096), "n_shared_experts": (0, 64),
    "first_k_dense_replace": (0, 1024), "moe_layer_freq": (1, 1024), "decoder_sparse_step": (1, 1024),
    "num_nextn_predict_layers": (0, 16), "mtp_num_hidden_layers": (0, 16), "q_lora_rank": (1, DIM), "kv_lora_rank": (1, DIM),
    "qk_rope_head_dim": (1, 8192), "qk_nope_head_dim": (1, 8192), "v_head_dim": (1, 8192),
    "max_position_embeddings": (1, 2**31), "n_group": (1, 4096), "topk_group": (1, 4096),
    "pad_token_id": (-1, 2**24), "bos_token_id": (-1, 2**24),
    "index_n_heads": (1, 4096), "index_head_dim": (1, 8192), "linear_num_key_heads": (1, 4096),
    "linear_num_value_heads": (1, 4096), "linear_key_head_dim": (1, 8192), "linear_value_head_dim": (1, 8192),
    "linear_conv_kernel_dim": (1, 64), "full_attention_interval": (1, 1024),
}
_NUMBERS = {"rms_norm_eps": (0.0, 1.0), "rope_theta": (0.0, 1e12), "routed_scaling_factor": (0.0, 1e6),
            "initializer_range": (0.0, 1e3)}
_BOOLS = ("tie_word_embeddings", "attention_bias", "norm_topk_prob", "use_qk_norm")
LAYER_KINDS = ("full_attention", "linear_attention")
_STRS = {"model_type": 100, "torch_dtype": 64, "dtype": 64, "hidden_act": 64, "hidden_activation": 64,
         "topk_method": 64}  # key -> longest accepted
MAX_TENSORS = 4_000_000  # layers x experts x 3 beyond this is a typo, not a model (DeepSeek-V3: 91,991 tensors)


def config_fields(data: Any, where: str, keys: Mapping[str, Any]) -> dict[str, Any]:
    """{key: value} of the config keys a family reads (`Family.config_keys`: key -> its default, `REQUIRED` for
    none), each checked by its kind and bounds; null counts as absent (HF writes `"head_dim": null`), so an absent or
    null key is its default, or the one-line error `"key" is null` (or missing) when the family cannot do without it.

    Why here and not at each use: the families then compute with values of the promised types, so a null or a
    string in config.json is a UserError naming the key when the config is read, never a TypeError in a shape."""
    f = Fields(data, where, CONFIG_HINT, what="a JSON object (a HF config.json)")
    return {key: _field(f, key, default) for key, default in keys.items()}


def config_key_known(key: str) -> bool:
    """Whether `config_fields` can check `key` (a family declaring a key with no kind here is a bug)."""
    return key in _INTS or key in _NUMBERS or key in _BOOLS or key in _STRS or key in _OTHER


def _field(f: Fields, key: str, default: Any) -> Any:
    if key in _INTS:
        return f.int(key, *_INTS[key], default=default)
    if key in _NUMBERS:
        return f.number(key, *_NUMBERS[key], default=default)
    if key in _BOOLS:
        return f.bool(key, default=default)
    if key in _STRS:
        return f.str(key, default=default, max_len=_STRS[key])
    if key in _OTHER:
        return _OTHER[key](f, default)
    raise KeyError(f"config key {key!r} has no kind in dsconv.schemas.model: add it to _INTS, _NUMBERS, ...")


_OTHER: dict[str, Callable[[Fields, Any], Any]] = {
    "mlp_only_layers": lambda f, d: f.list("mlp_only_layers", is_int(0, _INTS["num_hidden_layers"][1]),
                                           "a list of layer numbers", default=d),
    "quantization_config": lambda f, d: f.obj("quantization_config", default=d),
    "layer_types": lambda f, d: f.list("layer_types", lambda v: v in LAYER_KINDS,
                                       f"a list of {' / '.join(LAYER_KINDS)}", default=d),
}


def config(data: Any, where: str = "config.json", supported: Collection[str] | None = None,
           not_yet: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A config.json's content with every field a family uses type- and range-checked, and the relations between
    them (heads divide the hidden size, KV heads divide heads, top-k within the experts)."""
    f = Fields(data, where, CONFIG_HINT, what="a JSON object (a HF config.json)")
    model_type = f.str("model_type", max_len=100)
    if supported is not None and model_type not in supported:
        why = f" ({not_yet[model_type]})" if not_yet and model_type in not_yet else ""
        raise UserError(f"{where}: model_type {model_type!r} is not supported{why}",
                        hint=f"dsconv supports {', '.join(sorted(supported))}")
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads"):
        f.int(key, *_INTS[key])
    for key, (lo, hi) in _INTS.items():
        f.int(key, lo, hi, default=None)
    for key, (lo, hi) in _NUMBERS.items():
        f.number(key, lo, hi, default=None)
    for key in _BOOLS:
        f.bool(key, default=None)
    for key, longest in _STRS.items():
        f.str(key, default=None, max_len=longest)
    c = data
    heads, hidden, layers = c["num_attention_heads"], c["hidden_size"], c["num_hidden_layers"]
    mla = c.get("kv_lora_rank") is not None
    all_moe = c.get("moe_intermediate_size") is not None and "intermediate_size" not in c and not c.get(
        "mlp_only_layers")  # no dense MLP anywhere (Qwen3.5-MoE's text_config has no intermediate_size)
    if not mla:
        if not all_moe:
            f.int("intermediate_size", *_INTS["intermediate_size"])
        if c.get("head_dim") is None and hidden % heads:
            raise f.fail("num_attention_heads", f"a divisor of hidden_size {hidden} (or give head_dim)", heads)
        kv = c.get("num_key_value_heads")
        if kv is not None and heads % kv:
            raise f.fail("num_key_value_heads", f"a divisor of num_attention_heads {heads}", kv)
    else:
        for key in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            f.int(key, *_INTS[key])
    experts = next((c[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if c.get(k)), 0)
    topk = c.get("num_experts_per_tok")
    if experts and topk is not None and not 1 <= topk <= experts:
        raise f.fail("num_experts_per_tok", f"in 1..{experts} (the routed experts)", topk)
    if experts:
        f.int("moe_intermediate_size" if c.get("moe_intermediate_size") is not None or mla else "intermediate_size",
              1, 2**22)
    if experts * layers * 3 > MAX_TENSORS:
        raise UserError(f"{where}: {layers} layers x {experts} experts is {experts * layers * 3:,} expert tensors "
                        f"(limit {MAX_TENSORS:,})", hint=CONFIG_HINT)
    f.list("mlp_only_layers", is_int(0, layers - 1), f"a list of layer numbers in 0..{layers - 1}", default=None)
    q = f.obj("quantization_config", default=None)
    if q is not None:
        qf = Fields(q, f"{where}: quantization_config", CONFIG_HINT)
        qf.list("weight_block_size", is_int(1, 8192), "a list of two block sizes", default=None, max_len=2)
        block = q.get("weight_block_size")
        if block is not None and len(block) != 2:
            raise qf.fail("weight_block_size", "a list of two block sizes", block)
        qf.str("quant_method", default=None, max_len=64)
    return data


# ------------------------------------------------------------------------------------------- agreement
def inventory(where: str, expected: Iterable[tuple[str, tuple[int, ...]]],
              actual: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Every tensor the config implies is on disk with the config's shape (float tensors; int8/packed quantized
    weights keep their own shapes), so a weight-only path cannot write a model no engine loads."""
    missing: list[str] = []
    wrong: list[str] = []
    for name, shape in expected:
        got = actual.get(name)
        if got is None:
            missing.append(name)
        elif got[0] in FLOAT_DTYPES and tuple(got[1]) != tuple(shape):
            wrong.append(f"{name} has shape {list(got[1])} but config.json implies {list(shape)}")
    if wrong:
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise UserError(f"{where}: {wrong[0]}{more}", hint="config.json does not describe these weights; fix "
                        "the config or use the weights it belongs to")
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f"{where}: tensor {missing[0]} is missing{more}",
                        hint="the checkpoint is incomplete or config.json describes another model; copy every part "
                        "or fix the config")
