"""The stored format of quantized tensors (msModelSlim): int4 packing in both layouts, the int64 deq_scale bit
pattern, dequantization.

Why here, below the stages: the quantizer WRITES this format, but readers (MindIR export of a quantized directory,
eval, verify) must READ it without importing the quantizer; so the format math sits beside the reader (layer 1) and
quant/algorithms/schemes.py builds on it.
"""
from __future__ import annotations

import numpy as np

from dsconv.errors import UserError


# int4 packing
def _check_int4(q: np.ndarray) -> np.ndarray:
    q = np.asarray(q)
    if q.dtype != np.int8:
        raise ValueError(f"int4 packing expects int8 values, got {q.dtype}")
    if q.size and (q.min() < -8 or q.max() > 7):
        raise ValueError("int4 packing: values outside -8..7")
    return q


def pack_int4(q: np.ndarray, name: str = "weight") -> np.ndarray:
    """Pack int4 values ``[n, k]`` into int8 ``[n/2, k]`` along the OUTPUT dimension (the msModelSlim W4 layout):
    row 2i goes to the low nibble, row 2i+1 to the high nibble. E.g. column (1, -2) -> 0xE1 (int8 -31)."""
    q = _check_int4(q)
    if q.ndim != 2 or q.shape[0] % 2:
        raise UserError(
            f"layer {name}: int4 packing needs an even number of output rows, got shape {list(q.shape)}",
            hint="leave this layer in 8 bits or unquantized",
        )
    u = q.view(np.uint8)
    packed = (u[0::2] & np.uint8(0x0F)) | (u[1::2] << np.uint8(4))
    return packed.view(np.int8)


def _nibbles(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) signed nibbles of int8 bytes: arithmetic shifts sign-extend."""
    p = np.asarray(packed)
    if p.dtype == np.uint8:
        p = p.view(np.int8)
    if p.dtype != np.int8:
        raise ValueError(f"packed int4 must be int8, got {p.dtype}")
    low = np.left_shift(p, 4).astype(np.int8, copy=False) >> np.int8(4)
    high = p >> np.int8(4)
    return low, high


def unpack_int4(packed: np.ndarray, n: int) -> np.ndarray:
    """Inverse of :func:`pack_int4`: int8 ``[n/2, k]`` -> int8 ``[n, k]`` in -8..7."""
    if packed.ndim != 2 or packed.shape[0] * 2 != n:
        raise UserError(f"packed int4 shape {list(packed.shape)} does not hold {n} output rows")
    low, high = _nibbles(packed)
    out = np.empty((n, packed.shape[1]), dtype=np.int8)
    out[0::2], out[1::2] = low, high
    return out


def pack_int4_along_k(q: np.ndarray, name: str = "weight") -> np.ndarray:
    """The older per-channel int4 layout ``[n, k/2]``: column 2j in the low nibble, 2j+1 in the high nibble."""
    q = _check_int4(q)
    if q.ndim != 2 or q.shape[1] % 2:
        raise UserError(f"layer {name}: int4 packing along k needs an even input width, got {list(q.shape)}")
    u = q.view(np.uint8)
    return ((u[:, 0::2] & np.uint8(0x0F)) | (u[:, 1::2] << np.uint8(4))).view(np.int8)


def unpack_int4_along_k(packed: np.ndarray, k: int) -> np.ndarray:
    """Inverse of :func:`pack_int4_along_k`: int8 ``[n, k/2]`` -> int8 ``[n, k]``."""
    if packed.ndim != 2 or packed.shape[1] * 2 != k:
        raise UserError(f"packed int4 shape {list(packed.shape)} does not hold {k} input columns")
    low, high = _nibbles(packed)
    out = np.empty((packed.shape[0], k), dtype=np.int8)
    out[:, 0::2], out[:, 1::2] = low, high
    return out


def unpack_int4_by_shape(packed: np.ndarray, shape: tuple[int, int], name: str = "weight") -> np.ndarray:
    """Readers accept both int4 layouts: ``[n/2, k]`` (pairs of output rows) or ``[n, k/2]`` (pairs along k)."""
    n, k = shape
    if tuple(packed.shape) == (n // 2, k) and n % 2 == 0:
        return unpack_int4(packed, n)
    if tuple(packed.shape) == (n, k // 2) and k % 2 == 0:
        return unpack_int4_along_k(packed, k)
    raise UserError(
        f"tensor {name}: packed int4 shape {list(packed.shape)} matches neither [n/2, k] nor [n, k/2] "
        f"for a [{n}, {k}] layer"
    )


# W4A8_DYNAMIC's scale_bias
SCALE_BIAS_CHUNKS = 16  # a row layer's k range cut in 16 contiguous chunks: TP degrees 1..16 each sum their own


def scale_bias_chunks(tp_dim: int | None) -> int:
    """A W4A8 scale_bias's columns for a linear whose TP split is `tp_dim` (families.roles.Role.tp_dim): 16 k-chunks
    where TP splits the input dim (row layers: down_proj, o_proj, w2), else 1."""
    return SCALE_BIAS_CHUNKS if tp_dim == 1 else 1


def scale_bias_sums(q: np.ndarray, chunks: int) -> np.ndarray:
    """int64 ``[n, chunks]``: the sum of each output row's int4 values over ``chunks`` contiguous k ranges (1 for a
    column layer). Per row, so row blocks of a weight give the rows of the whole."""
    n, k = q.shape
    if k % chunks:
        raise UserError(f"scale_bias: input width {k} is not divisible by {chunks} chunks")
    return q.reshape(n, chunks, k // chunks).sum(axis=-1, dtype=np.int64)


def scale_bias(sums: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32 ``[n, chunks]`` = 8 * scale * (sum of the int4 values), per chunk (scale_bias_sums).

    Why: the engines' A8W4 kernel splits each int8 activation x into two int4 halves, x = 16*hi + lo + 8, and
    multiplies both by the signed int4 weights; the ``+8`` term, 8 * s * sum_k q, comes from this tensor (summed over
    the chunks a rank holds). Computed in float64 from the exact integer sums, rounded once."""
    sums = np.asarray(sums, np.int64)
    s = np.asarray(scale, np.float32).reshape(sums.shape[0], 1).astype(np.float64)
    return (8.0 * s * sums.astype(np.float64)).astype(np.float32)


# deq_scale as stored
def deq_scale_as_int64(deq_scale: np.ndarray) -> np.ndarray:
    """fp16 models store deq_scale as int64 holding the float32 bit pattern (1.0 -> 1065353216)."""
    return np.ascontiguousarray(deq_scale, dtype=np.float32).view(np.int32).astype(np.int64)


def deq_scale_from_int64(stored: np.ndarray) -> np.ndarray:
    """Inverse of :func:`deq_scale_as_int64` (for readers and verification)."""
    s = np.asarray(stored)
    info = np.iinfo(np.int32)
    if s.size and (s.min() < info.min or s.max() > info.max):
        raise UserError("int64 deq_scale holds values outside int32: not a float32 bit pattern")
    return np.ascontiguousarray(s.astype(np.int32)).view(np.float32)


# dequantization
def dequant_weight(
    q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None = None, group_size: int = 0
) -> np.ndarray:
    """W8A16-style dequantization ``w = (w_q - offset) * scale`` -> float32 ``[n, k]``. A grouped ``scale
    [n, k/g]`` is broadcast along k; the group size is inferred from the shapes and checked against
    ``group_size`` when that is non-zero."""
    n, k = q.shape
    scale = np.asarray(scale, np.float32).reshape(n, -1)
    groups = scale.shape[1]
    if k % groups or (group_size and groups * group_size != k):
        raise UserError(f"scale shape {list(scale.shape)} does not fit weight {[n, k]} with group {group_size}")
    g = k // groups
    w = q.astype(np.float32).reshape(n, groups, g)
    if offset is not None:
        w -= np.asarray(offset, np.float32).reshape(n, groups, 1)
    w *= scale[..., None]
    return w.reshape(n, k)


# the types with a static activation range (input_scale, input_offset, deq_scale, quant_bias): W8A8, and PD-mix's
# W8A8_MIX, whose decode path is static W8A8 over the same int8 weight (docs/formats/w8a8_mix.md)
W8A8_MIX = "W8A8_MIX"
STATIC_TYPES = ("W8A8", W8A8_MIX)
# vLLM-Ascend's W4A4_DYNAMIC (docs/formats/w4a4.md): int4 values stored one per int8, unpacked (its loader packs them)
W4A4 = "W4A4_DYNAMIC"
# the types whose int4 values are stored two per byte (W4A4_DYNAMIC's are not)
PACKED_INT4 = ("W4A16", "W4A8_DYNAMIC")
# the types whose activations are quantized (static or per token): smoothing helps them
ACT_QUANT = (*STATIC_TYPES, "W8A8_DYNAMIC")


# the description types of the int8 KV-cache tensors (`quantize --kv-cache int8`; their layout rows are in
# quant/formats/msmodelslim.py): C8 for GQA caches, FAQuant for DeepSeek's MLA latent
C8 = "C8"
FA_QUANT = "FAQuant"
# vLLM-Ascend reads FA quant's int8 cache only on a disaggregated decode instance or on A5 (its quantization/utils.py,
# modelslim_config.py, mla_v1.py; docs/formats/kv_cache_c8.md)
FA_QUANT_WHERE = ("vLLM-Ascend uses it only on a disaggregated decode instance (kv_consumer) on A2/A3 or on A5; "
                  "elsewhere its tensors load and the cache stays bf16")


# who runs which side of a W8A8_MIX linear (docs/formats/w8a8_mix.md)
MIX_WHERE = ("static W8A8 on decode instances (vLLM-Ascend: kv_role kv_consumer or kv_both; MindIE: its decode "
             "graph), per-token dynamic on prefill and PD-colocated instances")


def int8_cache(desc: dict | None) -> bool:
    """Whether a quantize output's description says its KV cache is int8: C8 (kv_cache_type / kv_quant_type) or
    FA quant for MLA (fa_quant_type) - what inspect reports and shard budgets."""
    desc = desc or {}
    return desc.get("kv_cache_type") == C8 or desc.get("kv_quant_type") == C8 or bool(desc.get("fa_quant_type"))


def cache_form(desc: dict | None) -> str | None:
    """C8 / FAQuant: the int8-cache form of a quantize output's description (None without one), from the types of
    its cache tensors."""
    return next((desc[name] for name in sorted(cache_tensors(desc))), None)


def cache_tensors(desc: dict | None) -> set[str]:
    """The names a description types as int8 KV-cache tensors (C8 / FAQuant): scales for the serving engine's
    cache, which a graph export (ONNX, MindIR) has no place for."""
    return {k for k, v in (desc or {}).items() if v in (C8, FA_QUANT)} - {"kv_cache_type", "kv_quant_type"}
