"""Weight scales on the engines' grid, each chosen by its own channel's (or group's) rounding error.

Why a grid: vLLM-Ascend and MindIE hold the weight-only and dynamic ``weight_scale`` (and ``input_scale``) in the
model dtype, bf16 or fp16 (docs/engine_rules.md, docs/engine_check.md). A float32 ``absmax / qmax`` would be
rounded on load and the engine would compute with another scale than the one the integers were made against. So
every scale dsconv writes is a value bf16, fp16 and float32 all hold exactly: 8 significant bits (bf16's), and below
2**-17, where bf16 is finer than fp16's subnormal step, a multiple of 2**-24.

Why chosen, not rounded up: rounding ``absmax / qmax`` up onto that grid moves the scale by up to 0.8% and turns
the rounding error of the whole channel into whatever that one step does to it; on a real 135M Llama, W8A16 rose
from +0.38% perplexity (exact float32 scales) to +0.92%. Instead each channel (or group) tries the grid values
next to ``absmax / qmax`` - two below and two above (``NEIGHBOURS``) - quantizes against each one
(``q = clamp(round(w / s), qmin, qmax)``, the value the engine then multiplies by exactly ``s``), and keeps the one
with the smallest squared error. A scale below ``absmax / qmax`` clamps the channel's largest weight by less than
one step; the search weighs that like any other error. The written format is unchanged: one float32 scale per
channel or group, zero offsets.

Everything works on one block of rows at a time (``[rows, groups, g]`` float32), so a bf16 weight is never widened
to float32 whole. Activation and KV-cache scales keep :func:`grid_ceil` (schemes.usable_scale): rounding them up
keeps every calibrated value inside the int8 range, and they have no weights to choose against.
"""
from __future__ import annotations

import numpy as np

# Smallest usable scale: below it 1/scale overflows float32. Rows (or groups) whose absmax gives a smaller scale are
# all (near) zero; they get scale 1.0 so dequantisation yields exact zeros and quant_bias = bias/deq_scale stays small.
MIN_SCALE = float(np.finfo(np.float32).tiny) * 16
FP16_SUBNORMAL_STEP = 2.0 ** -24
BF16_FINER_THAN_FP16 = 2.0 ** -17
# grid values tried on each side of absmax / qmax (the nearest below and above first)
NEIGHBOURS = 2
import os as _os  # EXPERIMENT ONLY
NEIGHBOURS = int(_os.environ.get("XP_NB", NEIGHBOURS))
XP_HALF = _os.environ.get("XP_HALF", "1") == "1"
XP_MODE = _os.environ.get("XP_MODE", "choose")


def _flat32(s: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(s, dtype=np.float32).reshape(-1)  # (a 0-d input comes back 1-d from numpy)


def grid_ceil(s: np.ndarray) -> np.ndarray:
    """Positive float32 -> the smallest grid value >= s: 8 significant bits (bf16), below 2**-17 the next multiple
    of 2**-24 (fp16's subnormal step, which is then coarser than bf16's)."""
    shape = np.shape(s)
    s = _flat32(s)
    up = ((s.view(np.uint32).astype(np.uint64) + 0xFFFF) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    tiny = s < BF16_FINER_THAN_FP16
    if tiny.any():
        up = np.where(tiny, (np.ceil(s.astype(np.float64) / FP16_SUBNORMAL_STEP) * FP16_SUBNORMAL_STEP)
                      .astype(np.float32), up)
    return up.reshape(shape)


def grid_floor(s: np.ndarray) -> np.ndarray:
    """Positive float32 -> the largest grid value <= s (0 when s is below the grid's smallest value, 2**-24)."""
    shape = np.shape(s)
    s = _flat32(s)
    down = (s.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    tiny = s < BF16_FINER_THAN_FP16
    if tiny.any():
        down = np.where(tiny, (np.floor(s.astype(np.float64) / FP16_SUBNORMAL_STEP) * FP16_SUBNORMAL_STEP)
                        .astype(np.float32), down)
    return down.reshape(shape)


def grid_candidates(exact: np.ndarray, neighbours: int = NEIGHBOURS) -> list[np.ndarray]:
    """The grid values next to each exact scale, nearest first: [ceil, floor, next above, next below, ...]
    (``neighbours`` on each side; an exact scale on the grid is its own ceil and floor). Values the grid has no
    room for below (0) are replaced by the ceil, so every candidate is a usable scale."""
    hi = grid_ceil(exact)
    lo = grid_floor(exact)
    lo = np.where(lo > 0, lo, hi)
    out = [hi, lo]
    for _ in range(neighbours - 1):
        hi = grid_ceil(np.nextafter(hi, np.float32(np.inf)))
        nxt = grid_floor(np.nextafter(lo, np.float32(0)))
        lo = np.where(nxt > 0, nxt, lo)
        out += [hi, lo]
    return out


def absmax(blk: np.ndarray) -> np.ndarray:
    """max |x| along the last axis, kept as a length-1 axis, without materialising |x| (two reductions are cheaper
    than a full-size temporary)."""
    return np.maximum(blk.max(axis=-1, keepdims=True), -blk.min(axis=-1, keepdims=True))


def choose_scales(w3, qmin: int, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`quantize_block` of a small array ``[rows, groups, g]`` (numpy, or a CPU torch tensor) with buffers of
    its own: ``(q int8, scales float32 [rows, groups, 1])``. For GPTQ's and the searches' scales."""
    if hasattr(w3, "detach"):  # a torch tensor (of any float dtype)
        w3 = w3.detach().float().numpy()
    b = np.ascontiguousarray(w3, dtype=np.float32)
    q = np.empty(b.shape, np.int8)
    return q, quantize_block(b, absmax(b), qmin, qmax, q, np.empty_like(b), np.empty_like(b))


def exact_scales(absmax: np.ndarray, qmax: int) -> np.ndarray:
    """float32 ``absmax / qmax``, all-zero (or denormal) channels -> 1.0 (on the grid: dequantizes to exact zeros)."""
    s = np.asarray(absmax, np.float32) / np.float32(qmax)
    return np.where(s < MIN_SCALE, np.float32(1.0), s).astype(np.float32)


def quantize_block(blk: np.ndarray, absmax: np.ndarray, qmin: int, qmax: int, q_out: np.ndarray,
                   scratch: np.ndarray, scratch2: np.ndarray, ratio: float = 1.0, neighbours: int = NEIGHBOURS,
                   half_step: bool = XP_HALF) -> np.ndarray:
    """Round-to-nearest of ``blk [rows, groups, g]`` (float32, read only) against the grid scale each group prefers:
    writes the integers into ``q_out`` (int8, same shape) and returns the scales ``[rows, groups, 1]``. ``absmax``
    is max |blk| per group ``[rows, groups, 1]``; ``ratio`` < 1 clips the range to ``ratio * absmax`` (the clip
    searches); ``scratch``/``scratch2`` are float32 buffers of blk's shape.

    Each candidate costs one pass of divide, round, (clamp), subtract and a row reduction; the first candidate
    (absmax/qmax rounded up, the former rule) wins ties, so a group no candidate improves keeps its old bytes."""
    top = absmax * np.float32(ratio) if ratio != 1.0 else absmax
    exact = exact_scales(top, qmax)
    if XP_MODE != "choose":
        c = {"up": grid_ceil(exact), "exact": exact}[XP_MODE]
        t = np.divide(blk, c, out=scratch); np.rint(t, out=t); np.clip(t, qmin, qmax, out=t)
        np.copyto(q_out, t, casting="unsafe")
        return c
    best_err = None
    best = None
    first = None
    for c in grid_candidates(exact, neighbours):
        if first is None:
            first = c
        elif half_step:  # no weight of the range further than half a step from its value
            c = np.where(c * np.float32(qmax + 0.5) >= top, c, first)
        t = np.divide(blk, c, out=scratch)
        r = np.rint(t, out=scratch2)
        if (c * np.float32(qmax) < absmax).any():  # only a scale below absmax/qmax can take a weight past qmax
            np.clip(r, qmin, qmax, out=r)
        np.subtract(t, r, out=t)
        err = np.einsum("...j,...j->...", t, t)[..., None]
        err *= c * c
        if best_err is None:
            best_err, best = err, c
            np.copyto(q_out, r, casting="unsafe")
            continue
        better = err < best_err
        if better.any():
            np.copyto(q_out, r, casting="unsafe", where=better)
            best_err = np.where(better, err, best_err)
            best = np.where(better, c, best)
    return best
