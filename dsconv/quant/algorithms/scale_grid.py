"""Weight scales on the engines' grid, each chosen by its own channel's (or group's) rounding error.

Why a grid: vLLM-Ascend and MindIE hold the weight-only and dynamic ``weight_scale`` (and ``input_scale``) in the
model dtype, bf16 or fp16 (docs/engine_rules.md, docs/engine_check.md). A float32 ``absmax / qmax`` would be
rounded on load and the engine would compute with another scale than the one the integers were made against. So
every scale dsconv writes is a value bf16, fp16 and float32 all hold exactly: 8 significant bits (bf16's), and below
2**-17, where bf16 is finer than fp16's subnormal step, a multiple of 2**-24.

Why chosen, not rounded up: rounding ``absmax / qmax`` up onto that grid moves the scale by up to 0.8% and turns
the rounding error of the whole channel into whatever that one step does to it; on a real 135M Llama, W8A16 rose
from +0.38% perplexity (exact float32 scales) to +0.92%. Instead each channel (or group) is quantized against
the grid values on both sides of ``absmax / qmax`` (``q = round(w / s)``, what the engine then multiplies by
exactly ``s``) and keeps the one with the smaller squared error. The value below is tried only where it keeps the
channel's largest weight within half a step, so every weight stays within half a step of its value, as with plain
round-to-nearest: a lower error without clipping the outliers (wider searches that clipped them lowered the
squared error further but not the output's divergence from the float model, docs/accuracy.md). The written format
is unchanged: one float32 scale per channel or group, zero offsets.

Everything works on one block of rows at a time (``[channels or groups, g]``, float32 or bf16 bit patterns), so a
bf16 weight is never widened to float32 whole; the rows go through the compiled kernel (rtn_kernel.py), which
scores both candidates in one pass over each row. Activation and KV-cache scales keep :func:`grid_ceil` (schemes.usable_scale): rounding them up
keeps every calibrated value inside the int8 range, and they have no weights to choose against.
"""
from __future__ import annotations

import numpy as np

# Smallest usable scale: below it 1/scale overflows float32. Rows (or groups) whose absmax gives a smaller scale are
# all (near) zero; they get scale 1.0 so dequantisation yields exact zeros and quant_bias = bias/deq_scale stays small.
MIN_SCALE = float(np.finfo(np.float32).tiny) * 16
FP16_SUBNORMAL_STEP = 2.0 ** -24
BF16_FINER_THAN_FP16 = 2.0 ** -17


def _flat32(s: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(s, dtype=np.float32).reshape(-1)  # (a 0-d input comes back 1-d from numpy)


def _to_grid(s: np.ndarray, up: bool) -> np.ndarray:
    """Positive float32 -> the nearest grid value above (`up`) or below: bf16's 8 significant bits by bit masking,
    below 2**-17 multiples of 2**-24 (fp16's subnormal step, which is then coarser than bf16's)."""
    shape = np.shape(s)
    s = _flat32(s)
    if up:
        g = ((s.view(np.uint32).astype(np.uint64) + 0xFFFF) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    else:
        g = (s.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    tiny = s < BF16_FINER_THAN_FP16
    if tiny.any():
        steps = (np.ceil if up else np.floor)(s.astype(np.float64) / FP16_SUBNORMAL_STEP)
        g = np.where(tiny, (steps * FP16_SUBNORMAL_STEP).astype(np.float32), g)
    return g.reshape(shape)


def grid_ceil(s: np.ndarray) -> np.ndarray:
    """Positive float32 -> the smallest grid value >= s."""
    return _to_grid(s, up=True)


def grid_floor(s: np.ndarray) -> np.ndarray:
    """Positive float32 -> the largest grid value <= s (0 when s is below the grid's smallest value, 2**-24)."""
    return _to_grid(s, up=False)


def absmax(blk: np.ndarray) -> np.ndarray:
    """max |x| along the last axis, kept as a length-1 axis, without materialising |x| (two reductions are cheaper
    than a full-size temporary)."""
    return np.maximum(blk.max(axis=-1, keepdims=True), -blk.min(axis=-1, keepdims=True))


def choose_scales(w3, qmin: int, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`quantize_rows` of a small array ``[rows, groups, g]`` (numpy, or a CPU torch tensor) with buffers of
    its own: ``(q int8, scales float32 [rows, groups, 1])``. For GPTQ's and the searches' scales."""
    if hasattr(w3, "detach"):  # a torch tensor (of any float dtype)
        w3 = w3.detach().float().numpy()
    b = np.ascontiguousarray(w3, dtype=np.float32)
    q = np.empty(b.shape, np.int8)
    b2, q2 = b.reshape(-1, b.shape[-1]), q.reshape(-1, b.shape[-1])
    sc = quantize_rows(b2, absmax(b2), qmin, qmax, q2)
    return q, sc.reshape(*b.shape[:-1], 1)


def exact_scales(absmax: np.ndarray, qmax: int) -> np.ndarray:
    """float32 ``absmax / qmax``, all-zero (or denormal) channels -> 1.0 (on the grid: dequantizes to exact zeros)."""
    s = np.asarray(absmax, np.float32) / np.float32(qmax)
    return np.where(s < MIN_SCALE, np.float32(1.0), s).astype(np.float32)


def grid_neighbours(exact: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(:func:`grid_ceil`, :func:`grid_floor`) of float32 ``exact`` in a few vector operations on the bit patterns:
    they run once per tile of rows, where numpy's per-call cost is the price, not the arithmetic."""
    exact = np.ascontiguousarray(exact, dtype=np.float32)
    if exact.size == 0 or exact.min() < BF16_FINER_THAN_FP16:
        return grid_ceil(exact), grid_floor(exact)
    bits = exact.view(np.uint32)
    lo = bits & np.uint32(0xFFFF0000)
    hi = np.where(lo != bits, lo + np.uint32(0x10000), lo)
    return hi.view(np.float32), lo.view(np.float32)


class RowPlan:
    """The two candidate scales of every row (channel or group) of a block and what their quantization needs,
    worked out once per block from the rows' max |w| (numpy's per-call cost is paid per block, not per row); the
    rows themselves go through the compiled kernel (rtn_kernel), in any number of calls."""

    def __init__(self, absmax: np.ndarray, qmin: int, qmax: int, ratio: float = 1.0) -> None:
        self.qmin, self.qmax, self.clipped = qmin, qmax, ratio != 1.0
        top = absmax * np.float32(ratio) if ratio != 1.0 else absmax
        hi, lo = grid_neighbours(exact_scales(top, qmax))
        # the value below, where it is one and keeps the range's largest weight within half a step (no extra
        # clipping)
        self.lo = np.where((lo > 0) & (lo * np.float32(qmax + 0.5) >= top), lo, hi)
        self.hi = hi
        # rows where w / lo can round to qmax + 1 (the largest weight exactly half a step above qmax: rint goes to
        # even); below, -qmax - 1.5 < w / lo always rounds into range. A clipped range clamps everything.
        self.over = np.zeros(len(absmax), np.bool_) if self.clipped else \
            np.divide(absmax[:, 0], self.lo[:, 0]) >= np.float32(qmax + 0.5)
        self.two = bool((self.lo < hi).any())
        self.keep: list[np.ndarray] = []

    def tile(self, a: int, blk: np.ndarray, q_out: np.ndarray) -> None:
        """Quantize rows a .. a + len(blk) into ``q_out`` (int8, blk's shape): ``blk`` float32 rows, or uint16 rows
        of bf16 bit patterns (read only either way)."""
        from dsconv.quant.algorithms import rtn_kernel

        b = a + len(blk)
        kernel = rtn_kernel.quantize_bf16 if blk.dtype == np.uint16 else rtn_kernel.quantize_f32
        keep = np.empty(b - a, np.int64)
        nk = kernel(blk, self.lo[a:b], self.hi[a:b], self.clipped, self.over[a:b], self.two, self.qmin, self.qmax,
                    q_out, keep)
        self.keep.append(keep[:nk] + a)

    def scales(self) -> np.ndarray:
        """The chosen scale of every row ``[R, 1]``, once every tile is done."""
        keep_hi = np.concatenate(self.keep) if self.keep else np.empty(0, np.int64)
        if keep_hi.size == 0:
            return self.lo
        out = self.lo.copy()
        out[keep_hi] = self.hi[keep_hi]
        return out


def absmax_bf16(bits: np.ndarray) -> np.ndarray:
    """:func:`absmax` of rows of bf16 bit patterns (uint16 ``[R, g]``) as float32 ``[R, 1]``, without widening."""
    from dsconv.quant.algorithms import rtn_kernel

    out = np.empty((len(bits), 1), np.float32)
    rtn_kernel.absmax_bf16(bits, out)
    return out


def quantize_rows(blk: np.ndarray, absmax: np.ndarray, qmin: int, qmax: int, q_out: np.ndarray,
                  ratio: float = 1.0) -> np.ndarray:
    """Round-to-nearest of ``blk [R, g]`` (float32, or uint16 bf16 bit patterns; read only; one channel or group per
    row) against the grid scale each row prefers: writes the integers into ``q_out`` (int8 ``[R, g]``) and returns
    the scales ``[R, 1]``. ``absmax`` is max |row| ``[R, 1]``; ``ratio`` < 1 clips the range to ``ratio * absmax``
    (the clip searches).

    Each row is quantized against the grid value below ``absmax / qmax`` where that keeps every weight within half
    a step (on real weights nearly every row), else the one above, and its error summed; then against the value
    above, which it keeps where the error is not larger (ties: the value above)."""
    plan = RowPlan(absmax, qmin, qmax, ratio)
    plan.tile(0, blk, q_out)
    return plan.scales()
