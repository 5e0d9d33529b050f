"""The msModelSlim layout (docs/formats.md), both ways.

`LAYOUT` is the reference table as data: for each type, the tensors a linear `P` has (suffix, dtype, shape rule), in
a fixed order. Everything that lists a linear's tensors is generated from it: the output specs (`linear_layout`),
the staging of a static-W8A8 candidate (`STAGED`), the arrays written (`emit_linear`) and the description check
(`check_description`). Writing uses the reference dtypes (int8 weights, int4 packed two per byte along the output
dimension, float32 scales, int32 quant_bias, deq_scale float32 or - for fp16 models - int64 holding the float32 bit
pattern). Reading: `read_linear(ck, P)` gets a linear back (both int4 packings accepted by shape).
A FLOAT linear is not in the table: it is an ordinary tensor, written as it is (in the model dtype for FP8 input).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from dsconv.errors import UserError
from dsconv.qformat import C8, FA_QUANT, PACKED_INT4, STATIC_TYPES, W8A8_MIX, cache_tensors, scale_bias, scale_bias_sums
from dsconv.quant.algorithms.schemes import (deq_scale_as_int64, deq_scale_from_int64, dequant_weight, pack_int4,
                                             pack_int4_along_k, unpack_int4_by_shape)

LAYOUTS = ("msmodelslim", "mindie")
FLOAT = "FLOAT"
GLOBAL_KEYS = ("model_quant_type", "version", "group_size", "kv_quant_type", "kv_cache_type", "fa_quant_type",
               "reduce_quant_type", "metadata")
DESCRIPTION_VERSION = "1.0.0"

# ---------------------------------------------------------------------------------------------- the layout table
# A shape rule's symbols: n output rows, k input columns, groups = k / group_size (1 per channel), int4 packing below,
# chunks = scale_bias columns (W4A8: 1 for a column layer, 16 for a row layer, qformat.SCALE_BIAS_CHUNKS)
# Dtype DEQ is float32, or int64 bit patterns for fp16 models (QuantPlan.deq_dtype).
Component = tuple[str, str, tuple[Any, ...]]
DEQ = "DEQ"
_W8_WEIGHT_ONLY: tuple[Component, ...] = (
    ("weight", "I8", ("n", "k")), ("weight_scale", "F32", ("n", 1)), ("weight_offset", "F32", ("n", 1)))
_W4: tuple[Component, ...] = (
    ("weight", "I8", ("int4 rows", "int4 cols")), ("weight_scale", "F32", ("n", "groups")),
    ("weight_offset", "F32", ("n", "groups")))
LAYOUT: dict[str, tuple[Component, ...]] = {
    "W8A16": _W8_WEIGHT_ONLY,
    "W8A8_DYNAMIC": _W8_WEIGHT_ONLY,
    "W8A8": (("weight", "I8", ("n", "k")), ("input_scale", "F32", (1,)), ("input_offset", "F32", (1,)),
             ("deq_scale", DEQ, ("n",)), ("quant_bias", "I32", ("n",))),
    # PD-mix (docs/formats/w8a8_mix.md): static W8A8's tensors for a decode instance and W8A8_DYNAMIC's weight scale
    # for prefill, in one linear; the order msModelSlim writes them (ascendv1.py::AscendV1Saver.on_w8a8_pd_mix)
    "W8A8_MIX": (("weight", "I8", ("n", "k")), ("quant_bias", "I32", ("n",)), ("input_scale", "F32", (1,)),
                 ("input_offset", "F32", (1,)), ("deq_scale", DEQ, ("n",)), ("weight_scale", "F32", ("n", 1)),
                 ("weight_offset", "F32", ("n", 1))),
    "W4A16": _W4,
    # vLLM-Ascend's W4A4_DYNAMIC (docs/formats/w4a4.md): W8A8_DYNAMIC's tensors, the int8 weight holding int4 values
    "W4A4_DYNAMIC": _W8_WEIGHT_ONLY,
    # msModelSlim's current per-channel form (docs/formats/w4a8.md): int4 always packed along the output dim, and
    # scale_bias, 8 * scale * sum of the int4 values (per row, or per 16 k-chunks of a row layer)
    "W4A8_DYNAMIC": (("weight", "I8", ("n/2", "k")), ("weight_scale", "F32", ("n", 1)),
                     ("weight_offset", "F32", ("n", 1)), ("scale_bias", "F32", ("n", "chunks"))),
}
# appended to every type when the linear has a bias, in the bias's own dtype
BIAS: Component = ("bias", "BIAS", ("n",))
# A static-W8A8 candidate waiting for its unit's fallback decision keeps what W8A8 and both fallback types need
# (weight_offset is zeros, deq_scale stays float32 until the final type is known).
STAGED = "W8A8_STAGED"
STAGED_COMPONENTS: tuple[Component, ...] = (
    ("weight", "I8", ("n", "k")), ("weight_scale", "F32", ("n", 1)), ("input_scale", "F32", (1,)),
    ("input_offset", "F32", (1,)), ("deq_scale", "F32", ("n",)), ("quant_bias", "I32", ("n",)))
# KV-cache int8 (C8, docs/formats/kv_cache_c8.md): beside an attention layer's k and v projections P, one value per
# cached channel (n: P's output rows), typed C8 in the description; scales absmax/127, offsets zero
KV_CACHE_LAYOUT: tuple[Component, ...] = (("kv_cache_scale", "F32", ("n",)), ("kv_cache_offset", "F32", ("n",)))
# MLA FA quant (DeepSeek's latent cache in int8, docs/formats/kv_cache_c8.md): under an attention module A,
# A.fa_q (n = one scale per head), A.fa_k and A.fa_v (n = 1, the latent as one head): these two each, typed FAQuant;
# the description also says `A.quant_type` INT8 and, globally, fa_quant_type FAKQuant
FA_MODULES = ("fa_q", "fa_k", "fa_v")
FA_LAYOUT: tuple[Component, ...] = (("scale", "F32", ("n", 1)), ("offset", "I8", ("n", 1)))
LAYER_TYPE_KEY = ".quant_type"  # `<attn>.quant_type`: a layer's attention type, not a tensor
TYPES = (FLOAT, *LAYOUT)
LINEAR_AUX = tuple(dict.fromkeys(s for comps in LAYOUT.values() for s, _, _ in comps if s != "weight"))


def components(qtype: str) -> tuple[Component, ...]:
    if qtype == STAGED:
        return STAGED_COMPONENTS
    try:
        return LAYOUT[qtype]
    except KeyError:
        raise ValueError(f"unknown type {qtype}") from None


def _shape(rule: tuple[Any, ...], n: int, k: int, groups: int, chunks: int = 1) -> tuple[int, ...]:
    # int4 packing (MindIE-LLM atb/utils/quantize/w4a16.py::W4A16LinearStatic): per channel (one group) pairs
    # along k [n, k/2], per group pairs of output rows [n/2, k]; low nibble first
    dims = {"n": n, "k": k, "n/2": n // 2, "groups": groups, "int4 rows": n if groups == 1 else n // 2,
            "int4 cols": k // 2 if groups == 1 else k, "chunks": chunks}
    return tuple(dims[d] if isinstance(d, str) else d for d in rule)


def linear_layout(module: str, qtype: str, n: int, k: int, groups: int = 1, deq_dtype: str = "F32",
                  bias_dtype: str | None = None, chunks: int = 1) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor a linear of `qtype` has in the output, in order; the bias last when
    `bias_dtype` is given; `chunks` is the scale_bias width of a W4A8 linear."""
    comps = components(qtype) + ((BIAS,) if bias_dtype is not None else ())
    dtypes = {DEQ: deq_dtype, "BIAS": bias_dtype}
    return [(f"{module}.{s}", dtypes.get(dt, dt), _shape(rule, n, k, groups, chunks)) for s, dt, rule in comps]


def layout_names(layout: str, model_quant_type: str) -> tuple[str, str]:
    """(weights file prefix, description file name) of a layout."""
    if layout == "mindie":
        t = model_quant_type.lower()
        return f"quant_model_weight_{t}", f"quant_model_description_{t}.json"
    return "quant_model_weights", "quant_model_description.json"


@dataclass
class LinearResult:
    """A quantized linear before it takes its final type: int8 values (unpacked), weight scales, and - for a W8A8
    candidate - the activation parameters with deq_scale and quant_bias."""

    q: np.ndarray                        # int8 [n, k] (int4 values in -8..7 for 4 bits)
    scale: np.ndarray                    # float32 [n, 1] or [n, groups]
    input_scale: np.float32 | None = None
    input_offset: np.float32 | None = None
    deq_scale: np.ndarray | None = None  # float32 [n]
    quant_bias: np.ndarray | None = None  # int32 [n]
    bias: Any = None                     # original-dtype bias tensor, or None
    sums: np.ndarray | None = None       # int64 [n, chunks]: W4A8 scale_bias sums, when q is not kept whole


def pack_weight_rows(module: str, qtype: str, q: np.ndarray, groups: int) -> np.ndarray:
    """The stored bytes of a block of whole rows of a linear's int8 values (even row count for int4 per group):
    int8 as is, int4 packed the way `_array` packs the whole weight, so blocks concatenate to the same bytes."""
    rule = components(qtype)[0][2]
    if rule[0] == "n/2":
        return pack_int4(q, module)
    if rule[0] != "int4 rows":
        return q
    return pack_int4_along_k(q, module) if groups == 1 else pack_int4(q, module)


def _array(module: str, suffix: str, dtype: str, rule: tuple[Any, ...], res: LinearResult, chunks: int) -> Any:
    """One component's array, made from the result in the table's dtype and shape."""
    n, k = res.q.shape
    shape = _shape(rule, n, k, res.scale.size // n, chunks)
    if suffix == "weight":
        if rule[0] == "n/2":
            return pack_int4(res.q, module)
        if rule[0] == "int4 rows":
            return pack_int4_along_k(res.q, module) if shape[0] == n else pack_int4(res.q, module)
        return res.q
    if suffix == "weight_offset":
        return np.zeros(shape, np.float32)
    if suffix == "scale_bias":
        return scale_bias(res.sums if res.sums is not None else scale_bias_sums(res.q, chunks), res.scale)
    if suffix == "deq_scale":
        if res.deq_scale is None:
            raise ValueError(f"{module}: W8A8 without activation parameters")
        deq = np.ascontiguousarray(res.deq_scale, np.float32).reshape(shape)
        return deq_scale_as_int64(deq) if dtype == "I64" else deq
    source = {"weight_scale": (res.scale, np.float32), "input_scale": (res.input_scale, np.float32),
              "input_offset": (res.input_offset, np.float32), "quant_bias": (res.quant_bias, np.int32)}
    value, np_dtype = source[suffix]
    return np.ascontiguousarray(np.asarray(value, np_dtype).reshape(shape))


def emit_linear(module: str, qtype: str, res: LinearResult, deq_dtype: str = "F32",
                skip_weight: bool = False, chunks: int = 1) -> Iterator[tuple[str, Any]]:
    """(name, array) pairs of one linear in `qtype` (or STAGED), in `linear_layout` order; `skip_weight` leaves
    out the weight (a row-block writer has streamed it already; `res.q` then only needs the right shape, and a
    W4A8 scale_bias comes from `res.sums`)."""
    for suffix, dtype, rule in components(qtype):
        if skip_weight and suffix == "weight":
            continue
        yield f"{module}.{suffix}", _array(module, suffix, deq_dtype if dtype == DEQ else dtype, rule, res, chunks)
    if res.bias is not None:
        yield f"{module}.bias", res.bias


# A fused MoE layer's type, `<moe>.experts.weight`, which vLLM-Ascend looks up for model types its packed-module
# table does not list (dsconv.engines.description_updates): a description key that names no tensor.
MOE_TYPE_KEY_SUFFIX = ".experts.weight"


def description_types(desc: dict[str, Any]) -> dict[str, str]:
    """tensor name -> type: global keys and MoE layer-type keys removed."""
    return {k: v for k, v in desc.items() if k not in GLOBAL_KEYS and not k.endswith((MOE_TYPE_KEY_SUFFIX,
                                                                                       LAYER_TYPE_KEY))}


# ----------------------------------------------------------------------------------------------- reading
@dataclass
class QuantLinear:
    """A linear as stored: enough to dequantize it or to run it the way the engine does."""

    module: str
    qtype: str
    q: np.ndarray                      # int8 [n, k], unpacked
    weight_scale: np.ndarray | None    # float32 [n, groups]
    weight_offset: np.ndarray | None
    input_scale: float | None = None
    input_offset: float | None = None
    deq_scale: np.ndarray | None = None  # float32 [n] (int64 bit patterns decoded)
    quant_bias: np.ndarray | None = None
    bias: np.ndarray | None = None
    scale_bias: np.ndarray | None = None  # float32 [n, chunks] (W4A8_DYNAMIC)

    def dequantized(self) -> np.ndarray:
        """float32 [n, k]: (q - offset) * scale; W8A8 static derives the weight scale from deq_scale / input_scale."""
        if self.weight_scale is not None:
            return dequant_weight(self.q, self.weight_scale, self.weight_offset)
        scale = (self.deq_scale.astype(np.float64) / float(self.input_scale)).astype(np.float32)
        return dequant_weight(self.q, scale.reshape(-1, 1))


def _np(ck: Any, name: str) -> np.ndarray:
    import torch

    t = ck.load(name)
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()


def read_linear(ck: Any, module: str, qtype: str) -> QuantLinear:
    """One quantized linear of a msModelSlim-layout directory opened as a Checkpoint."""
    P = module
    have = lambda s: (P + s) in ck  # noqa: E731
    if not have(".weight"):
        raise UserError(f"{ck.root}: {P}.weight is missing", hint="the quantized output is incomplete")
    raw = _np(ck, P + ".weight")
    if raw.dtype != np.int8:
        raise UserError(f"{P}.weight is {raw.dtype}, expected int8 for {qtype}")
    scale = _np(ck, P + ".weight_scale").astype(np.float32) if have(".weight_scale") else None
    offset = _np(ck, P + ".weight_offset").astype(np.float32) if have(".weight_offset") else None
    if qtype in PACKED_INT4:
        if scale is None:
            raise UserError(f"{P}: {qtype} needs weight_scale")
        n = scale.shape[0]
        k = raw.shape[1] * 2 if raw.shape[0] == n else raw.shape[1]
        q = unpack_int4_by_shape(raw, (n, k), P)
    else:
        q = raw
    ql = QuantLinear(P, qtype, q, scale, offset)
    if have(".bias"):
        ql.bias = _np(ck, P + ".bias").astype(np.float32)
    if qtype == "W4A8_DYNAMIC":
        if not have(".scale_bias"):
            raise UserError(f"{ck.root}: {P}.scale_bias is missing for a W4A8_DYNAMIC layer",
                            hint="the output is incomplete")
        ql.scale_bias = _np(ck, P + ".scale_bias").astype(np.float32)
    if qtype in STATIC_TYPES:
        for s in (f".{suffix}" for suffix, _, _ in LAYOUT[qtype] if suffix != "weight"):
            if not have(s):
                raise UserError(f"{ck.root}: {P}{s} is missing for a {qtype} layer", hint="the output is incomplete")
        ql.input_scale = float(_np(ck, P + ".input_scale").reshape(-1)[0])
        ql.input_offset = float(_np(ck, P + ".input_offset").reshape(-1)[0])
        deq = _np(ck, P + ".deq_scale")
        ql.deq_scale = deq_scale_from_int64(deq) if deq.dtype == np.int64 else deq.astype(np.float32)
        ql.quant_bias = _np(ck, P + ".quant_bias").astype(np.int64)
    elif scale is None:
        raise UserError(f"{ck.root}: {P}.weight_scale is missing for a {qtype} layer", hint="the output is incomplete")
    return ql


def quantized_modules(desc: dict[str, Any]) -> dict[str, str]:
    """module P -> type for every quantized linear named in a description."""
    out = {}
    for name, t in description_types(desc).items():
        if name.endswith(".weight") and t != FLOAT:
            out[name[: -len(".weight")]] = t
    return out


def cache_tensor_type(name: str) -> str | None:
    """C8 / FAQuant for a KV-cache tensor's name (by the layout table's suffixes), else None."""
    module, _, param = name.rpartition(".")
    if param in tuple(s for s, _, _ in KV_CACHE_LAYOUT):
        return C8
    if module.rpartition(".")[2] in FA_MODULES and param in tuple(s for s, _, _ in FA_LAYOUT):
        return FA_QUANT
    return None


def check_description(desc: dict[str, Any], tensors: dict[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """Problems with a description against the tensors {name: (dtype, shape)} actually stored (empty when sound)."""
    problems = []
    for key in ("model_quant_type", "version", "group_size"):
        if key not in desc:
            problems.append(f"description lacks the global key {key}")
    types = description_types(desc)
    for name, t in types.items():
        cache = cache_tensor_type(name)
        if t not in (*TYPES, C8, FA_QUANT):
            problems.append(f"{name}: unknown type {t!r}")
        elif (t in (C8, FA_QUANT) or cache is not None) and t != cache:
            problems.append(f"{name}: type {t!r}, but {cache or 'no cache type'} is this name's: C8 and FAQuant are "
                            "the types of the KV-cache tensors and of nothing else")
        if name not in tensors:
            problems.append(f"{name}: in the description but not in the weights")
    for name in tensors:
        if name not in types:
            problems.append(f"{name}: in the weights but not in the description")
    present = {t for t in types.values()}
    mqt = desc.get("model_quant_type")
    if mqt is not None and mqt not in present and not (mqt == FLOAT and not present - {FLOAT}):
        problems.append(f"model_quant_type {mqt} is not the type of any tensor")
    g = desc.get("group_size", 0)
    for P, t in quantized_modules(desc).items():
        w = tensors.get(P + ".weight")
        if w is None:
            continue
        if w[0] != "I8":
            problems.append(f"{P}.weight: {t} weight stored as {w[0]}, expected I8")
        # an unknown type (reported above) is checked as a weight-only one
        need = tuple(s for s, _, _ in LAYOUT.get(t, _W8_WEIGHT_ONLY) if s != "weight")
        for aux in need:
            name = f"{P}.{aux}"
            if name not in tensors:
                problems.append(f"{P}: {t} needs {aux}")
            elif types.get(name) != t:
                problems.append(f"{name}: type {types.get(name)} differs from its weight's {t}")
        for aux in LINEAR_AUX:
            name = f"{P}.{aux}"
            if aux not in need and name in tensors and types.get(name) != t:
                problems.append(f"{name}: type {types.get(name)} differs from its weight's {t}")
        if t in STATIC_TYPES and P + ".deq_scale" in tensors:
            n = w[1][0]
            if tensors[P + ".deq_scale"][1] != (n,) or tensors.get(P + ".quant_bias", ("", ()))[1] != (n,):
                problems.append(f"{P}: deq_scale/quant_bias shapes do not match {n} output channels")
        if t in PACKED_INT4 and P + ".weight_scale" in tensors:
            n, groups = tensors[P + ".weight_scale"][1]
            rows, cols = w[1]
            k = cols * 2 if rows == n else cols
            if rows * 2 != n and rows != n:
                problems.append(f"{P}.weight: packed shape {[rows, cols]} does not hold {n} rows")
            elif g and groups * g != k:
                problems.append(f"{P}.weight_scale: {groups} groups x {g} != input width {k}")
    return problems


def verify_output(directory: Any) -> list[str]:
    """`dsconv verify` for a quantize output: the layout reads back, and the description matches the weights."""
    from pathlib import Path

    from dsconv.checkpoint import Checkpoint

    directory = Path(directory)
    try:
        ck = Checkpoint.open(directory)
    except UserError as e:
        return [e.one_line()]
    if ck.quant_description is None:
        return [f"{directory}: no quant_model_description*.json"]
    if "quantization_config" in ck.config:
        return ["config.json still carries quantization_config"]
    tensors = {n: (i.dtype, tuple(i.shape)) for n, i in ck.tensors.items()}
    problems = check_description(ck.quant_description, tensors)
    return problems or check_scale_bias(ck) + check_cache_scales(ck) + check_mix_paths(ck)


def check_mix_paths(ck: Any) -> list[str]:
    """Every W8A8_MIX linear's two paths hold one weight: deq_scale = input_scale * weight_scale (float32), as the
    writer makes it. The engines load either side without looking at the other, and each instance reads only one: a
    decode instance with a stale deq_scale, or a prefill one with a wrong weight_scale, serves another model while
    the other instance looks fine."""
    problems = []
    for P, t in quantized_modules(ck.quant_description).items():
        if t != W8A8_MIX:
            continue
        # the scales only (check_description has seen every tensor present): never the int8 weight
        deq = _np(ck, P + ".deq_scale")
        deq = (deq_scale_from_int64(deq) if deq.dtype == np.int64 else deq.astype(np.float32)).reshape(-1)
        s_in = np.float32(_np(ck, P + ".input_scale").reshape(-1)[0])
        want = (s_in * _np(ck, P + ".weight_scale").astype(np.float32).reshape(-1)).astype(np.float32)
        if not np.array_equal(deq, want):
            problems.append(f"{P}: deq_scale (decode path) differs from input_scale * weight_scale (prefill path) in "
                            f"{int((deq != want).sum())} of {want.size} channels")
        if bool(np.any(_np(ck, P + ".weight_offset"))):
            problems.append(f"{P}.weight_offset: nonzero (W8A8_MIX weights are symmetric)")
    return problems


def check_scale_bias(ck: Any) -> list[str]:
    """Every W4A8 scale_bias against 8 * scale * sum(q) recomputed from the stored packed weight and scale: a wrong
    one loads without complaint and shifts every output of the kernel (the engines add it as the +8 term)."""
    problems = []
    for P, t in quantized_modules(ck.quant_description).items():
        if t != "W4A8_DYNAMIC":
            continue
        ql = read_linear(ck, P, t)
        want = scale_bias(scale_bias_sums(ql.q, ql.scale_bias.shape[1]), ql.weight_scale)
        if not np.allclose(ql.scale_bias, want, rtol=1e-6, atol=0):
            problems.append(f"{P}.scale_bias differs from 8 * weight_scale * sum(int4 weights) "
                            f"(max |diff| {float(np.abs(ql.scale_bias - want).max()):.3g})")
    return problems


def check_cache_scales(ck: Any) -> list[str]:
    """Every int8-cache tensor (C8, FA quant) as the engines need it: scales positive, finite and exact in the model
    dtype (both engines hold them there), offsets zero (symmetric: MindIE reads a C8 offset's float bits as an int8,
    so only 0 survives)."""
    import torch

    model_dtype = {"BF16": torch.bfloat16, "F16": torch.float16}.get(ck.facts.dtype)
    problems = []
    for name in sorted(cache_tensors(ck.quant_description)):
        x = ck.load(name).float()
        if name.rpartition(".")[2] in (KV_CACHE_LAYOUT[1][0], FA_LAYOUT[1][0]):
            if bool((x != 0).any()):
                problems.append(f"{name}: nonzero offsets (the int8 cache forms are symmetric)")
        elif not bool(torch.isfinite(x).all() and (x > 0).all()) or model_dtype is not None \
                and not torch.equal(x.to(model_dtype).float(), x):
            problems.append(f"{name}: scales must be positive, finite and exact in {ck.facts.dtype}")
    return problems
