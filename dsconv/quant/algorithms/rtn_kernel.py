"""The round-to-nearest row kernel, compiled (numba): a row's two grid candidates scored in one pass over it.

Why compiled: scale_grid's rule quantizes every row (channel or group) against two scales and keeps the one with
the smaller error. In numpy that took nine passes over each tile (divide, round, cast, subtract, reduce, twice) plus
two bf16 widenings and two reductions for max |w|: 8.9 ns of CPU per weight element, which made the weight-only
quantize of a DeepSeek-shaped checkpoint CPU-bound at a third of `cp -r`'s speed. Here one vectorised loop per row
divides by both candidates, rounds, writes the integers and sums both errors while the row sits in L1; a second
loop rewrites the row only where the value above wins (a few percent of rows).

The arithmetic is the rule's: IEEE float32 ``w / s`` (never a reciprocal), round half to even, the same clamps.
The squared errors are summed in float32, and again in float64 for the rows where float32 cannot tell the two
candidates apart (see ``_row``), in the vectorised order of the host's instruction set (``reassoc`` is the only
fast-math flag), so a row could choose differently on another CPU only if its two errors agreed to float64's
precision.

bf16 rows are read as their bit patterns: max |w| is taken on the bits (non-negative floats order as their bit
patterns do) and each row is widened into an L1-sized scratch row just before it is quantized, so a bf16 weight is
never widened in memory.
"""
from __future__ import annotations

import numpy as np
from numba import njit

_FLAGS = {"nogil": True, "cache": True, "boundscheck": False, "fastmath": {"reassoc"}}


@njit(**_FLAGS)
def absmax_bf16(bits: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover (compiled)
    """max |w| of every row of bf16 bit patterns ``bits`` (uint16 [R, g]) into ``out`` (float32 [R, 1]). A NaN
    row's maximum is NaN, an Inf row's Inf (the caller rejects both)."""
    n, g = bits.shape
    tmp = np.empty(1, np.uint32)
    as_f32 = tmp.view(np.float32)
    for i in range(n):
        m = np.uint16(0)
        for j in range(g):  # kept in 16 bits (numba widens `&` to 64): 16 lanes per vector instead of 4
            m = max(m, np.uint16(bits[i, j] & np.uint16(0x7FFF)))
        tmp[0] = np.uint32(m) << np.uint32(16)
        out[i, 0] = as_f32[0]


@njit(inline="always", **_FLAGS)
def _errors64(x, s_lo, s_hi, cap_lo, low, cap_hi_all):  # pragma: no cover (compiled)
    """Both candidates' squared errors of one row, summed in float64 (each float32 square exact)."""
    e_lo = 0.0
    e_hi = 0.0
    for j in range(x.shape[0]):
        t = x[j] / s_lo
        d = np.float64(t - min(max(np.rint(t), low), cap_lo))
        e_lo += d * d
        t2 = x[j] / s_hi
        d2 = np.float64(t2 - min(max(np.rint(t2), low), cap_hi_all))
        e_hi += d2 * d2
    return e_lo, e_hi


@njit(inline="always", **_FLAGS)
def _row(x, q, s_lo, s_hi, cap_lo, low, cap_hi_all, two, l2, h2):  # pragma: no cover (compiled)
    """One row: integers against s_lo into q; True where s_hi's error is no larger (q then holds s_hi's).

    The errors are summed in float32 (twice the vector lanes of float64, a third less time per element); where the
    two candidates come within ``(g + 2) * 2**-22`` of each other (relative: four times the error bound of squaring
    and summing g float32 terms in any order, about 2**-24 each), the row is summed again in float64 and decided on
    that, so every row makes the float64 choice. On random DeepSeek-shaped bf16 weights a float32-only decision
    changed 1 row in 483,584."""
    e_lo = np.float32(0.0)
    e_hi = np.float32(0.0)
    g = x.shape[0]
    for j in range(g):
        w = x[j]
        t = w / s_lo
        r = min(max(np.rint(t), low), cap_lo)
        q[j] = np.int8(r)
        d = t - r
        e_lo += d * d
        t2 = w / s_hi
        r2 = min(max(np.rint(t2), low), cap_hi_all)
        d2 = t2 - r2
        e_hi += d2 * d2
    if not (two and s_lo < s_hi):
        return False
    a, b = np.float64(e_hi) * h2, np.float64(e_lo) * l2
    if abs(a - b) <= (g + 2) * 2.0 ** -22 * max(a, b):
        e64_lo, e64_hi = _errors64(x, s_lo, s_hi, cap_lo, low, cap_hi_all)
        a, b = e64_hi * h2, e64_lo * l2
    if not a <= b:
        return False
    for j in range(g):
        q[j] = np.int8(min(max(np.rint(x[j] / s_hi), low), cap_hi_all))
    return True


@njit(**_FLAGS)
def quantize_f32(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, clamp_all: bool, over: np.ndarray, two: bool,
                 qmin: int, qmax: int, q_out: np.ndarray, keep: np.ndarray) -> int:  # pragma: no cover (compiled)
    """Rows of float32 ``x [R, g]`` into int8 ``q_out [R, g]``: against ``lo`` (clamped at qmax on the ``over`` rows;
    every value into [qmin, qmax] when ``clamp_all``, a clipped range), then, where ``two``, against ``hi``, kept where
    its squared error (in units of the weight) is no larger. Writes the kept rows' indices into ``keep``, returns
    their count."""
    fmin, fmax, inf = np.float32(qmin), np.float32(qmax), np.float32(np.inf)
    low = fmin if clamp_all else -inf
    cap_all = fmax if clamp_all else inf
    nk = 0
    for i in range(x.shape[0]):
        s_lo, s_hi = lo[i, 0], hi[i, 0]
        cap = fmax if (clamp_all or over[i]) else inf
        if _row(x[i], q_out[i], s_lo, s_hi, cap, low, cap_all, two, np.float64(s_lo) * s_lo,
                np.float64(s_hi) * s_hi):
            keep[nk] = i
            nk += 1
    return nk


@njit(**_FLAGS)
def quantize_bf16(bits: np.ndarray, lo: np.ndarray, hi: np.ndarray, clamp_all: bool, over: np.ndarray, two: bool,
                  qmin: int, qmax: int, q_out: np.ndarray, keep: np.ndarray) -> int:  # pragma: no cover (compiled)
    """:func:`quantize_f32` of bf16 bit patterns ``bits`` (uint16 [R, g]), each row widened into a scratch row."""
    fmin, fmax, inf = np.float32(qmin), np.float32(qmax), np.float32(np.inf)
    low = fmin if clamp_all else -inf
    cap_all = fmax if clamp_all else inf
    g = bits.shape[1]
    wide = np.empty(g, np.uint32)
    x = wide.view(np.float32)
    nk = 0
    for i in range(bits.shape[0]):
        for j in range(g):
            wide[j] = np.uint32(bits[i, j]) << np.uint32(16)
        s_lo, s_hi = lo[i, 0], hi[i, 0]
        cap = fmax if (clamp_all or over[i]) else inf
        if _row(x, q_out[i], s_lo, s_hi, cap, low, cap_all, two, np.float64(s_lo) * s_lo,
                np.float64(s_hi) * s_hi):
            keep[nk] = i
            nk += 1
    return nk


@njit(**_FLAGS)
def row_sq_errors(x: np.ndarray, bits: bool, q: np.ndarray, scale: np.ndarray,
                  out: np.ndarray) -> None:  # pragma: no cover (compiled)
    """Per row of ``x [m, k]`` (float32, or with ``bits`` uint16 bf16 bit patterns; rows may be strided) against
    int8 ``q`` and float32 ``scale [m, groups]``: ``out[i] = (sum of (w - q * s)^2, sum of w^2)`` in float64 (the report's error
    figure; vectorised sums, so its last digits may differ between CPUs)."""
    m, k = x.shape
    groups = scale.shape[1]
    g = k // groups
    wide = np.empty(k, np.uint32)
    xf = wide.view(np.float32)
    for i in range(m):
        if bits:
            for j in range(k):
                wide[j] = np.uint32(x[i, j]) << np.uint32(16)
        else:
            for j in range(k):
                xf[j] = x[i, j]
        e = 0.0
        nrm = 0.0
        for c in range(groups):
            s = np.float64(scale[i, c])
            for j in range(c * g, c * g + g):
                w = np.float64(xf[j])
                d = w - np.float64(q[i, j]) * s
                e += d * d
                nrm += w * w
        out[i, 0] = e
        out[i, 1] = nrm
