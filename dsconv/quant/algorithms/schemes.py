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
from typing import Any, Callable, Iterator

import numpy as np

from dsconv.errors import UserError
# the stored format's math lives below the stages (readers need it too); re-exported for the quantizer
from dsconv.quant.algorithms.scale_grid import MIN_SCALE, RowPlan, absmax, absmax_bf16, grid_ceil
from dsconv.qformat import (deq_scale_as_int64, deq_scale_from_int64, dequant_weight, pack_int4,  # noqa: F401
                            pack_int4_along_k, unpack_int4, unpack_int4_along_k, unpack_int4_by_shape)

# Elements of float32 per row block: 4 M elements = 16 MB, large enough to amortise numpy's per-call overhead,
# small enough that the bf16 -> fp32 widening never costs more than a few blocks of extra RAM.
BLOCK_ELEMS = 1 << 22
# Tensors larger than this are split across threads (numpy ufuncs release the GIL; 2 threads ~ 2x, see notes).
THREAD_MIN_ELEMS = 1 << 24
INT8_MIN, INT8_MAX = -128, 127


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


# float32 elements per tile of the widening path (128 K: the widened rows stay in a core's L2 cache between the
# max |w| pass and the quantizing one)
TILE_ELEMS = 1 << 17


def bf16_bits(w: Any, contiguous: bool = False) -> np.ndarray | None:
    """The bit patterns of a CPU bf16 torch tensor or numpy (ml_dtypes) bfloat16 array as a zero-copy uint16 numpy
    view (strided like the input; with `contiguous`, only for a contiguous input), else None."""
    if isinstance(w, np.ndarray):
        if w.dtype.name != "bfloat16" or (contiguous and not w.flags.c_contiguous):
            return None
        return w.view(np.uint16)
    if not is_torch(w):
        return None
    import torch

    if w.dtype != torch.bfloat16 or w.device.type != "cpu" or (contiguous and not w.is_contiguous()):
        return None
    return w.detach().view(torch.int16).numpy().view(np.uint16)


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
    """An activation or KV-cache scale as written (numpy or torch float32, same kind as given): values too small to
    invert (all-zero ranges) become 1.0, the rest are rounded up onto the grid bf16, fp16 and float32 all hold
    exactly (scale_grid.grid_ceil), so every engine computes with the value the activations are quantized with and
    every calibrated value stays inside the int8 range. Weight scales are chosen on the same grid by their own
    rounding error instead (:func:`quantize_weight_per_group`)."""
    if is_torch(scale):
        import torch

        s = scale.to(torch.float32)
        s = torch.where(s < MIN_SCALE, torch.ones_like(s), s)
        return torch.from_numpy(grid_ceil(s.numpy()))
    s = np.asarray(scale, dtype=np.float32)
    return grid_ceil(np.where(s < MIN_SCALE, np.float32(1.0), s).astype(np.float32))


def symmetric_scale(absmax: np.ndarray, bits: int, name: str = "weight") -> np.ndarray:
    """float32 ``absmax / qmax`` as a usable_scale (KV-cache scales); NaN/Inf is an error."""
    return usable_scale(_finite(absmax, name) / np.float32(qrange(bits)[1]))


def _finite(absmax: Any, name: str) -> np.ndarray:
    absmax = np.asarray(absmax, dtype=np.float32)
    if not np.isfinite(absmax).all():
        raise UserError(f"tensor {name} contains NaN or Inf values", hint="check the checkpoint (dsconv inspect)")
    return absmax


def quantize_weight_per_channel(w: Any, bits: int = 8, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel round-to-nearest: ``q int8 [n, k]`` and ``scale float32 [n, 1]``, the grid
    value next to ``absmax / qmax`` with the channel's smallest rounding error (scale_grid.py).

    The offset the format stores is zeros (``np.zeros_like(scale)``). Works in row blocks (see module docstring).
    """
    q, scale, _ = quantize_weight_per_group(w, 0, bits, name)
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
    """Symmetric per-group round-to-nearest along k: ``q int8 [n, k]`` (in -8..7 for 4 bits), ``scale`` and zero
    ``offset`` float32 ``[n, k / group_size]``. ``group_size == 0`` is per channel (``[n, 1]``). Each group's scale
    is the grid value next to ``absmax / qmax`` with its smallest rounding error (scale_grid.py)."""
    n, k = _shape2d(w, name)
    check_group_size(k, group_size, name)
    groups = k // group_size if group_size not in (0, k) else 1
    q = np.empty((n, k), dtype=np.int8)
    scale = np.ones((n, groups), dtype=np.float32)
    for s, e, _, sc in _quantized_rows(w, bits, group_size, name, out=q):
        scale[s:e] = sc
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
    yield from _quantized_rows(w, bits, group_size, name, done=done)


def _quantized_rows(w: Any, bits: int, group_size: int, name: str, out: np.ndarray | None = None,
                    done: Callable[[int, int], None] | None = None
                    ) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
    """:func:`iter_quantized_rows` writing into ``out`` (int8 [n, k]) when given, else into a new array per block."""
    n, k = w.shape
    if n == 0 or k == 0:
        return
    groups = k // group_size if group_size not in (0, k) else 1
    qmin, qmax = qrange(bits)
    step = max(2, _rows_per_block(n, k) // 2 * 2)
    threads = min(2, os.cpu_count() or 1) if n * k >= THREAD_MIN_ELEMS else 1
    local = threading.local()

    rows = max(1, min(step, TILE_ELEMS // k))  # a tile: the rows widened and quantized while in the core's cache
    g = k // groups
    bits = bf16_bits(w, contiguous=True)

    def job(s: int) -> tuple[int, int, np.ndarray, np.ndarray]:
        e = min(n, s + step)
        q = np.empty((e - s, k), np.int8) if out is None else out[s:e]
        if bits is not None:  # bf16: max |w| on the bit patterns, each row widened in the kernel, never in memory
            blk = bits[s:e].reshape(-1, g)
            plan = RowPlan(_finite(absmax_bf16(blk), name), qmin, qmax)
            plan.tile(0, blk, q.reshape(-1, g))
            return s, e, q, plan.scales().reshape(e - s, groups)
        if not hasattr(local, "buf"):
            local.buf = np.empty((rows, k), np.float32)
        amax = np.empty(((e - s) * groups, 1), np.float32)
        for a in range(s, e, rows):  # every tile's max |w| first: the candidates are worked out once per block
            b = min(e, a + rows)
            amax[(a - s) * groups:(b - s) * groups] = absmax(_fill_float32(local.buf[: b - a], w[a:b]).reshape(-1, g))
        plan = RowPlan(_finite(amax, name), qmin, qmax)
        for a in range(s, e, rows):  # widened again: cheaper than reading back a block-sized float32 copy
            b = min(e, a + rows)
            plan.tile((a - s) * groups, _fill_float32(local.buf[: b - a], w[a:b]).reshape(-1, g),
                      q[a - s:b - s].reshape(-1, g))
        return s, e, q, plan.scales().reshape(e - s, groups)

    from dsconv.runtime.threads import ordered_map

    for res in ordered_map(job, range(0, n, step), threads):
        yield res
        if done is not None:
            done(res[0], res[1])


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
