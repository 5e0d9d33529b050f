"""The arithmetic of quantization in the msModelSlim layout: scales, offsets, groups, int4 packing, W8A8 auxiliaries.

Everything here is pure (arrays in, arrays out) and numpy-first, because numpy's per-row int8 quantization is
1.5-2x faster than torch on CPU (measured on a 2-core VM). Torch tensors are accepted where checkpoints hand them to us
(bf16, fp8): they are widened to float32 one block of rows at a time, so the peak extra memory is one block, not
one float32 copy of the tensor. Conventions (docs/formats.md):

* weights: symmetric, per output channel (``scale [n, 1]``) or per group along k (``scale [n, k/group]``); the
  format still stores ``weight_offset``, always zeros;
* activations (W8A8 static): per tensor, asymmetric int8, ``x_q = clamp(round(x / scale + offset), -128, 127)``;
* rounding is half to even everywhere (``np.rint``, like ``torch.round``), so dsconv and the engine agree.
"""
from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import numpy as np

from dsconv.errors import UserError
# the stored format's math lives below the stages (readers need it too); re-exported for the quantizer
from dsconv.qformat import (deq_scale_as_int64, deq_scale_from_int64, dequant_weight, pack_int4,  # noqa: F401
                            pack_int4_along_k, unpack_int4, unpack_int4_along_k, unpack_int4_by_shape)

# Elements of float32 per row block: 4 M elements = 16 MB, large enough to amortise numpy's per-call overhead,
# small enough that the bf16 -> fp32 widening never costs more than a few blocks of extra RAM.
BLOCK_ELEMS = 1 << 22
# Tensors larger than this are split across threads (numpy ufuncs release the GIL; 2 threads ~ 2x, see notes).
THREAD_MIN_ELEMS = 1 << 24
INT8_MIN, INT8_MAX = -128, 127
# Smallest usable scale: below it 1/scale overflows float32. Rows (or groups) whose absmax gives a smaller scale are
# all (near) zero; they get scale 1.0 so dequantisation yields exact zeros and quant_bias = bias/deq_scale stays small.
_MIN_SCALE = float(np.finfo(np.float32).tiny) * 16
# Scales are written as float32, but vLLM-Ascend loads input_scale and the W8A8_DYNAMIC / W8A16 weight_scale into
# parameters of the model dtype (bf16 or fp16; w8a8_static.py::get_pertensor_param, w8a8_dynamic.py), so a float32
# value that dtype cannot hold would be rounded by the engine and it would compute with another scale than the one
# the weights were quantized with. Every scale is therefore rounded UP onto a grid all three dtypes hold exactly:
# bf16's 8 significant bits, and below 2**-17 (where bf16 is finer than fp16's subnormal step) multiples of 2**-24.
# Rounding up keeps every weight and calibrated activation inside the int range; it costs < 0.8% of scale.
_FP16_SUBNORMAL_STEP = 2.0 ** -24
_BF16_FINER_THAN_FP16 = 2.0 ** -17


# ----------------------------------------------------------------------------------------------- input helpers
def is_torch(x: Any) -> bool:
    """True for a torch.Tensor, without importing torch (the CLI's planning paths never need it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _shape2d(w: Any, name: str) -> tuple[int, int]:
    shape = tuple(w.shape)
    if len(shape) != 2:
        raise UserError(f"tensor {name}: expected a 2-D weight [out, in], got shape {list(shape)}")
    return shape[0], shape[1]


def to_float32(x: Any) -> np.ndarray:
    """Whole tensor as float32 numpy (no copy when it already is). For small tensors and tests; big weights go
    through :func:`iter_row_blocks`."""
    if is_torch(x):
        return x.detach().to("cpu").float().numpy()
    a = np.asarray(x)
    return a if a.dtype == np.float32 else a.astype(np.float32)


def _rows_per_block(n: int, k: int) -> int:
    return max(1, min(n, BLOCK_ELEMS // max(k, 1)))


def iter_row_blocks(w: Any, rows: int | None = None) -> Iterator[tuple[int, int, np.ndarray]]:
    """Yield ``(start, stop, float32 block)`` over the rows of a 2-D tensor (numpy of any float dtype, or torch
    bf16/fp16/fp8/fp32). The block may share memory with ``w`` when it already is float32: never write into it."""
    n, k = w.shape
    step = rows or _rows_per_block(n, k)
    for s in range(0, n, step):
        e = min(n, s + step)
        yield s, e, to_float32(w[s:e])


def _fill_float32(out: np.ndarray, src: Any) -> np.ndarray:
    """Widen ``src`` (rows of a tensor) into the preallocated float32 ``out``; a float32 numpy source is returned
    as is (a read-only view). Reusing buffers avoids page-faulting fresh memory for every block."""
    if is_torch(src):
        import torch

        if src.dtype == torch.float32 and src.device.type == "cpu":
            return src.detach().numpy()
        torch.from_numpy(out).copy_(src.detach())
        return out
    a = np.asarray(src)
    if a.dtype == np.float32:
        return a
    np.copyto(out, a, casting="unsafe")
    return out


def _map_row_blocks(w: Any, fn: Callable[[int, int, np.ndarray, np.ndarray], None]) -> None:
    """Call ``fn(start, stop, block, scratch)`` for every row block: ``block`` is the rows as float32 (read only),
    ``scratch`` a float32 buffer of the same shape the function may overwrite. Two threads for large tensors."""
    n, k = w.shape
    step = _rows_per_block(n, k)
    threads = min(2, os.cpu_count() or 1) if n * k >= THREAD_MIN_ELEMS else 1
    local = threading.local()

    def job(s: int) -> None:
        if not hasattr(local, "buf"):
            local.buf = np.empty((step, k), np.float32)
            local.scratch = np.empty((step, k), np.float32)
        e = min(n, s + step)
        blk = _fill_float32(local.buf[: e - s], w[s:e])
        fn(s, e, blk, local.scratch[: e - s])

    if threads == 1:
        for s in range(0, n, step):
            job(s)
        return
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(job, range(0, n, step)))


# ----------------------------------------------------------------------------------------------- weight scales
def qrange(bits: int) -> tuple[int, int]:
    """(qmin, qmax) of signed ``bits``-bit integers; the scale uses qmax so the grid is symmetric (-7..7 for int4,
    -8 being reachable only by GPTQ's error feedback)."""
    if bits == 8:
        return INT8_MIN, INT8_MAX
    if bits == 4:
        return -8, 7
    raise UserError(f"unsupported weight bit width {bits}", hint="use 8 or 4")


def usable_scale(scale: Any) -> Any:
    """The scale as written (numpy or torch float32, same kind as given): values too small to invert (all-zero
    rows/groups) become 1.0, the rest are rounded up onto the grid bf16, fp16 and float32 all hold exactly (see
    _FP16_SUBNORMAL_STEP), so every engine computes with the value the weights were quantized with."""
    if is_torch(scale):
        import torch

        s = scale.to(torch.float32)
        s = torch.where(s < _MIN_SCALE, torch.ones_like(s), s)
        return torch.from_numpy(_onto_grid(s.numpy()))
    s = np.asarray(scale, dtype=np.float32)
    return _onto_grid(np.where(s < _MIN_SCALE, np.float32(1.0), s).astype(np.float32))


def _onto_grid(s: np.ndarray) -> np.ndarray:
    """Positive float32 -> the next value up with 8 significant bits (bf16); below 2**-17 the next multiple of
    2**-24 (fp16's subnormal step, which is then coarser than bf16's)."""
    shape = np.shape(s)
    s = np.ascontiguousarray(s, dtype=np.float32).reshape(-1)  # (a 0-d input comes back 1-d from numpy)
    bits = s.view(np.uint32).astype(np.uint64)
    up = ((bits + 0xFFFF) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    tiny = s < _BF16_FINER_THAN_FP16
    if tiny.any():
        up = np.where(tiny, (np.ceil(s.astype(np.float64) / _FP16_SUBNORMAL_STEP) * _FP16_SUBNORMAL_STEP)
                      .astype(np.float32), up)
    return up.reshape(shape)


def symmetric_scale(absmax: np.ndarray, bits: int, name: str = "weight") -> np.ndarray:
    """float32 ``absmax / qmax`` as a usable_scale; NaN/Inf is an error."""
    absmax = np.asarray(absmax, dtype=np.float32)
    if not np.isfinite(absmax).all():
        raise UserError(f"tensor {name} contains NaN or Inf values", hint="check the checkpoint (dsconv inspect)")
    return usable_scale(absmax / np.float32(qrange(bits)[1]))


def _absmax_rows(blk: np.ndarray, axis: int = -1) -> np.ndarray:
    """max(|x|) along ``axis`` without materialising |x| (two reductions are cheaper than a full-size temporary)."""
    return np.maximum(blk.max(axis=axis, keepdims=True), -blk.min(axis=axis, keepdims=True))


def _round_clip_into(
    out: np.ndarray, blk: np.ndarray, scale: np.ndarray, qmin: int, qmax: int, scratch: np.ndarray
) -> None:
    """out[...] = clamp(rint(blk / scale), qmin, qmax), computed in ``scratch`` (no allocation). The clamp is
    redundant for absmax scales (|w / scale| rounds to at most qmax) but cheap insurance for the int8 cast."""
    t = np.divide(blk, scale, out=scratch)
    np.rint(t, out=t)
    np.clip(t, qmin, qmax, out=t)
    np.copyto(out, t, casting="unsafe")


def quantize_weight_per_channel(w: Any, bits: int = 8, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel quantization: ``q int8 [n, k]``, ``scale float32 [n, 1] = absmax / qmax``.

    The offset the format stores is zeros (``np.zeros_like(scale)``). Works in row blocks (see module docstring).
    """
    n, k = _shape2d(w, name)
    qmin, qmax = qrange(bits)
    q = np.empty((n, k), dtype=np.int8)
    scale = np.ones((n, 1), dtype=np.float32)
    if n == 0 or k == 0:
        return q, scale

    def block(s: int, e: int, blk: np.ndarray, scratch: np.ndarray) -> None:
        sc = symmetric_scale(_absmax_rows(blk), bits, name)
        scale[s:e] = sc
        _round_clip_into(q[s:e], blk, sc, qmin, qmax, scratch)

    _map_row_blocks(w, block)
    return q, scale


def valid_group_sizes(k: int) -> list[int]:
    """Group sizes that divide an input width ``k``: powers of two from 32 up to k, then 0 (per channel)."""
    sizes, g = [], 32
    while g <= k:
        if k % g == 0:
            sizes.append(g)
        g *= 2
    return sizes + [0]


def check_group_size(k: int, group_size: int, name: str = "weight") -> None:
    """UserError naming the layer and the sizes that would work when ``group_size`` does not divide ``k``."""
    if group_size < 0 or (group_size > 0 and k % group_size != 0):
        ok = ", ".join(str(g) if g else "0 (per channel)" for g in valid_group_sizes(k))
        raise UserError(
            f"layer {name}: group size {group_size} does not divide its input width {k}",
            hint=f"valid group sizes for this layer: {ok}; or leave the layer unquantized",
        )


def quantize_weight_per_group(
    w: Any, group_size: int, bits: int = 4, name: str = "weight"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric per-group quantization along k: ``q int8 [n, k]`` (in -8..7 for 4 bits), ``scale`` and zero
    ``offset`` float32 ``[n, k / group_size]``. ``group_size == 0`` is per channel (``[n, 1]``)."""
    n, k = _shape2d(w, name)
    check_group_size(k, group_size, name)
    if group_size == 0 or group_size == k or n == 0:
        q, scale = quantize_weight_per_channel(w, bits, name)
        return q, scale, np.zeros_like(scale)
    qmin, qmax = qrange(bits)
    groups = k // group_size
    q = np.empty((n, k), dtype=np.int8)
    scale = np.empty((n, groups), dtype=np.float32)

    def block(s: int, e: int, blk: np.ndarray, scratch: np.ndarray) -> None:
        shape3 = (e - s, groups, group_size)
        b3 = blk.reshape(shape3)
        sc = symmetric_scale(_absmax_rows(b3), bits, name)  # [rows, groups, 1]
        scale[s:e] = sc[..., 0]
        _round_clip_into(q[s:e].reshape(shape3), b3, sc, qmin, qmax, scratch.reshape(shape3))

    _map_row_blocks(w, block)
    return q, scale, np.zeros_like(scale)


def iter_quantized_rows(
    w: Any, bits: int, group_size: int = 0, name: str = "weight",
    done: Callable[[int, int], None] | None = None,
) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
    """Round-to-nearest one row block at a time, in row order: ``(start, stop, q int8 [rows, k], scale float32
    [rows, groups])``, the same values as :func:`quantize_weight_per_group` (per channel for ``group_size`` 0 or k):
    every row is quantized on its own, so blocking cannot change a byte. Why: a streaming writer puts each block's
    bytes into the output while the next blocks are computed, so memory is a few blocks, not the tensor's int8 copy.

    Large tensors use two threads, at most three blocks ahead of the consumer; ``done(start, stop)`` is called once
    the consumer has taken a block (to drop its input pages). Blocks hold an even number of rows (but the last):
    int4 packs pairs of output rows."""
    n, k = _shape2d(w, name)
    check_group_size(k, group_size, name)
    if n == 0 or k == 0:
        return
    per_group = group_size not in (0, k)
    groups = k // group_size if per_group else 1
    qmin, qmax = qrange(bits)
    step = max(2, _rows_per_block(n, k) // 2 * 2)
    threads = min(2, os.cpu_count() or 1) if n * k >= THREAD_MIN_ELEMS else 1
    local = threading.local()

    def job(s: int) -> tuple[int, int, np.ndarray, np.ndarray]:
        if not hasattr(local, "buf"):
            local.buf = np.empty((step, k), np.float32)
            local.scratch = np.empty((step, k), np.float32)
        e = min(n, s + step)
        blk = _fill_float32(local.buf[: e - s], w[s:e])
        q = np.empty((e - s, k), np.int8)
        if per_group:
            shape3 = (e - s, groups, group_size)
            b3 = blk.reshape(shape3)
            sc = symmetric_scale(_absmax_rows(b3), bits, name)
            _round_clip_into(q.reshape(shape3), b3, sc, qmin, qmax, local.scratch[: e - s].reshape(shape3))
            return s, e, q, sc[..., 0]
        sc = symmetric_scale(_absmax_rows(blk), bits, name)
        _round_clip_into(q, blk, sc, qmin, qmax, local.scratch[: e - s])
        return s, e, q, sc

    from dsconv.runtime.threads import ordered_map

    for out in ordered_map(job, range(0, n, step), threads):
        yield out
        if done is not None:
            done(out[0], out[1])


# ----------------------------------------------------------------------------------------------- activations
def activation_qparams(min_val: float, max_val: float) -> tuple[np.float32, np.float32]:
    """Per-tensor asymmetric int8 parameters ``(input_scale, input_offset)`` for a calibrated range.

    The range is widened to include 0 (so 0 is exactly representable: padding and ReLU zeros stay exact);
    ``scale = (max - min) / 255`` as a usable_scale (the engines keep input_scale in the model dtype);
    ``offset = round(-128 - min / scale)`` so min -> -128 and max -> 127. A degenerate range (all zeros) gets
    scale 1.0, never 0.
    """
    lo, hi = float(min(min_val, 0.0)), float(max(max_val, 0.0))
    if not (np.isfinite(lo) and np.isfinite(hi)):
        raise UserError(f"activation range [{min_val}, {max_val}] is not finite", hint="check the calibration data")
    scale = np.float32(usable_scale(np.float32((hi - lo) / 255.0)))
    offset = np.clip(np.rint(-128.0 - lo / float(scale)), INT8_MIN, INT8_MAX)
    return scale, np.float32(offset)


def quantize_activation(x: Any, input_scale: float, input_offset: float) -> Any:
    """``x_q = clamp(round(x / scale + offset), -128, 127)`` as int8 (numpy or torch, same kind as ``x``)."""
    if is_torch(x):
        import torch

        t = torch.round(x.float() / float(input_scale) + float(input_offset))
        return t.clamp_(INT8_MIN, INT8_MAX).to(torch.int8)
    t = np.rint(to_float32(x) / np.float32(input_scale) + np.float32(input_offset))
    return np.clip(t, INT8_MIN, INT8_MAX, out=t).astype(np.int8)


def fake_quant_activation(x: Any, input_scale: float, input_offset: float) -> Any:
    """Quantize then dequantize activations (``(x_q - offset) * scale``) to evaluate W8A8 in float."""
    xq = quantize_activation(x, input_scale, input_offset)
    if is_torch(x):
        return ((xq.float() - float(input_offset)) * float(input_scale)).to(x.dtype)
    return (xq.astype(np.float32) - np.float32(input_offset)) * np.float32(input_scale)


# ----------------------------------------------------------------------------------------------- W8A8 auxiliaries
def w8a8_static_params(
    w_q: np.ndarray,
    weight_scale: np.ndarray,
    input_scale: float,
    input_offset: float,
    bias: np.ndarray | None = None,
    name: str = "weight",
) -> dict[str, np.ndarray]:
    """``deq_scale float32 [n] = input_scale * weight_scale``;
    ``quant_bias int32 [n] = round(bias / deq_scale - sum_k(w_q) * input_offset)``.

    The offset term folds the activation zero point into the bias so the engine computes
    ``y = (x_q @ w_q^T + quant_bias) * deq_scale``. Sums in int64, the rest in float64, from the float32 deq_scale
    that is stored (so the engine and this formula see the same number). An int32 overflow is an error, not a wrap.
    """
    n = w_q.shape[0]
    deq = (np.float32(input_scale) * np.asarray(weight_scale, np.float32).reshape(n)).astype(np.float32)
    row_sum = w_q.sum(axis=1, dtype=np.int64).astype(np.float64)
    b = np.zeros(n, np.float64) if bias is None else to_float32(bias).reshape(n).astype(np.float64)
    qb = np.rint(b / deq.astype(np.float64) - row_sum * float(input_offset))
    info = np.iinfo(np.int32)
    if not np.isfinite(qb).all() or qb.min(initial=0) < info.min or qb.max(initial=0) > info.max:
        raise UserError(
            f"layer {name}: quant_bias overflows int32 (bias too large for its deq_scale)",
            hint="leave this layer out of W8A8 static (use W8A8_DYNAMIC or W8A16 for it)",
        )
    return {"deq_scale": deq, "quant_bias": qb.astype(np.int32)}


# ----------------------------------------------------------------------------------------------- smoothing
def smooth_scales(
    act_absmax: np.ndarray,
    weight_absmax: np.ndarray,
    alpha: float = 0.5,
    clip: tuple[float, float] = (1e-4, 1e4),
) -> np.ndarray:
    """SmoothQuant per-input-channel factors ``s = act^alpha / w^(1 - alpha)`` (float32 ``[k]``).

    The caller divides the preceding norm weight by ``s`` and multiplies the linear's input columns by ``s``: the
    product is unchanged while activation outliers move into the (per-channel quantized) weights. Channels never
    seen active or with all-zero weights get 1.0 (no smoothing: a tiny s would blow up the norm weight for
    inputs the calibration never saw); the rest is clipped to ``clip`` so bf16 norm weights stay finite.
    ``weight_absmax`` is the max over output rows (and over every linear sharing the input) of ``|W[:, j]|``.
    """
    if not 0.0 <= alpha <= 1.0:
        raise UserError(f"smoothing alpha {alpha} is outside [0, 1]", hint="0.5 is the usual value; 0.75-0.85 for "
                        "models with strong activation outliers")
    a = np.asarray(act_absmax, np.float64).reshape(-1)
    w = np.asarray(weight_absmax, np.float64).reshape(-1)
    if a.shape != w.shape:
        raise UserError(f"smoothing: {a.size} activation channels vs {w.size} weight input channels")
    ok = (a > 0) & (w > 0) & np.isfinite(a) & np.isfinite(w)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = np.power(a, alpha) / np.power(w, 1.0 - alpha)
    s = np.where(ok, np.clip(s, clip[0], clip[1]), 1.0)
    return s.astype(np.float32)
