"""FP8 e4m3 block-scaled weights to bfloat16, float16 or float32 by table lookup, compiled (numba).

Why a table: a block of 128 x 128 codes shares one scale, and an e4m3 code has 256 values, so each block column of a
block row can produce only 256 results. They are computed once (256 multiplies and roundings per 16,384 elements),
and every element is then one byte load, one table load from L1 and one store. The numpy form of the arithmetic made
five passes over each stripe (sign-extend to int32, shift, mask, multiply, round), 14 bytes of memory traffic per
1-byte input element: 3.1 ns per element on one core against 0.7 ns here, and it held FP8 -> BF16 at 0.39x `cp -r`.

The results are the reference's exactly (`fp8.to(float32) * scale`, rounded once to the target dtype), since each
table entry is that computation:
- a code's sign, 4 exponent and 3 mantissa bits move into float32 position with integer ops
  (`(int32(code) << 20) & 0x87F00000`), which is the value / 2^120 exactly, subnormals included; the 2^120 is folded
  into the block scale, which requires every scale to be finite and below 2^7 (`fits`; callers fall back to the
  reference loop otherwise);
- one float32 multiply, then one round to nearest even into the target (numpy's and ml_dtypes' casts).
NaN codes (0x7F, 0xFF) have table entries too (meaningless ones): callers refuse them before.
"""
from __future__ import annotations

import numpy as np
from numba import njit

_FLAGS = {"nogil": True, "cache": True, "boundscheck": False}
REBIAS = 2.0 ** 120  # e4m3 exponent bias 7 -> float32 bias 127
_MASK = np.array(0x87F00000, dtype=np.uint32).view(np.int32)
# every code's value / 2^120, as float32
_VALUES = ((np.arange(256, dtype=np.uint8).view(np.int8).astype(np.int32) << 20) & _MASK).view(np.float32)


@njit(**_FLAGS)
def rows_by_table(codes: np.ndarray, table: np.ndarray, b1: int, out: np.ndarray) -> None:  # pragma: no cover
    """out[i, j] = table[j // b1, codes[i, j]]: codes uint8 [r, c] (rows of one block row), table [ceil(c / b1), 256],
    out [r, c] of the table's dtype (2-byte floats as uint16 bit patterns)."""
    r, c = codes.shape
    for i in range(r):
        for jb in range(0, c, b1):
            t = table[jb // b1]
            for j in range(jb, min(c, jb + b1)):
                out[i, j] = t[codes[i, j]]


def nan_codes(codes: np.ndarray) -> bool:
    """Whether any e4m3fn NaN code (0x7F, 0xFF) is among `codes` (uint8): two reductions, no temporary."""
    return bool(codes.size) and (codes.max() == 0xFF or codes.view(np.int8).max() == 0x7F)


def fits(scale: np.ndarray) -> bool:
    """Whether the exact table path holds for these scales: some, every one finite and below 2^7."""
    return scale.size > 0 and bool(np.all(np.abs(scale) < 2.0 ** 7))


def tables(scale_row: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Every result one block row can produce: [ceil(c / b1), 256], code k in block column b -> value(k) * scale[b]
    rounded once into `dtype` (2-byte dtypes returned as their uint16 bit patterns)."""
    f = _VALUES[None, :] * (scale_row.astype(np.float32) * np.float32(REBIAS))[:, None]
    out = np.ascontiguousarray(f.astype(dtype))
    return out.view(np.uint16) if out.dtype.itemsize == 2 else out


def dequantize_rows(codes: np.ndarray, scale: np.ndarray, block: tuple[int, int], row0: int, out: np.ndarray) -> None:
    """Rows [row0, row0 + len(codes)) of an FP8 weight (int8 or uint8 codes [n, c]) with its scales
    [ceil(R / b0), ceil(c / b1)] into `out` ([n, c] of the target dtype), one block row at a time."""
    b0, b1 = block
    codes = codes.view(np.uint8)
    dst = out.view(np.uint16) if out.dtype.itemsize == 2 else out
    n = codes.shape[0]
    i = 0
    while i < n:
        br = (row0 + i) // b0
        stop = min(n, (br + 1) * b0 - row0)
        rows_by_table(codes[i:stop], tables(scale[br], out.dtype), b1, dst[i:stop])
        i = stop
