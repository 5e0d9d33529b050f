"""A tensor copied from a checkpoint into a planned output in bounded chunks, unchanged or cast, optionally checked
for NaN/Inf on the way.

Why not `ts.write(name, ck.load(name))`: a pass-through tensor can be the largest of the model (DeepSeek-V3's
embedding and lm_head are 1.85 GB each in bf16) and a whole-tensor copy makes peak memory grow with it. Here
resident memory is one chunk (`tensorfile.COPY_CHUNK`, 64 MiB): unchanged bytes go straight from the input's page
cache to the output file (pwrite from the mmap, hashed on the way, pages dropped after each chunk); a dtype change
casts one chunk of elements at a time (the same per-element rounding as a whole-tensor `.to()`, so the bytes are
identical).

`copy_tensor(write_chunks, ck, name, out_dtype)` is per tensor and needs only the checkpoint and a sink taking
`(name, chunks)` (TensorSetWriter.write_chunks, or a worker's own part writer).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from dsconv.errors import UserError
from dsconv.io import tensorfile
from dsconv.tensors import DTYPE_SIZES, torch_dtype

WriteChunks = Callable[[str, Iterable[Any]], None]
#: safetensors float dtype -> (unsigned view, magnitude mask, exponent all-ones): x is NaN/Inf iff (x & mask) >= inf
_NONFINITE = {"BF16": (np.uint16, 0x7FFF, 0x7F80), "F16": (np.uint16, 0x7FFF, 0x7C00),
              "F32": (np.uint32, 0x7FFFFFFF, 0x7F800000),
              "F64": (np.uint64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000)}


def first_nonfinite(data: Any, st_dtype: str) -> int | None:
    """Index of the first NaN/Inf element of `data` (a buffer or array holding `st_dtype` elements), else None.
    On the bit patterns (an AND and a max): ~10x faster than torch.isfinite on bf16, which made the check cost more
    than the FP8 dequantization it guarded."""
    utype, mask, inf = _NONFINITE[st_dtype]
    bits = np.frombuffer(data, dtype=utype) if not isinstance(data, np.ndarray) else data.reshape(-1).view(utype)
    if bits.size == 0:
        return None
    # NaN/Inf: the magnitude bits >= inf's. Positive ones are the largest signed values, negative ones the largest
    # unsigned: two reductions, no temporary (a 64 MiB AND result per chunk cost more in page faults than the check)
    signed = bits.view(np.dtype(utype).str.replace("u", "i"))
    if signed.max() < inf and bits.max() < utype(mask + 1 + inf):
        return None
    m = np.bitwise_and(bits, utype(mask))
    return int(np.argmax(m >= inf))


def nonfinite_error(where: Any, name: str, index: int, value: float) -> UserError:
    return UserError(f"{where}: tensor {name} holds {value} at element {index}",
                     hint="the checkpoint is damaged (NaN/Inf weights); re-download it or fix its source")


def copy_tensor(write_chunks: WriteChunks, ck: Any, name: str, out_dtype: str, chunk: int | None = None,
                check: Path | str | None = None) -> None:
    """Write checkpoint tensor `name` as `out_dtype` through `write_chunks(name, chunks)`, never holding more than
    `chunk` bytes of it; with `check` (the input's path, for the message) a NaN/Inf element is a UserError.
    Pickled tensors and casts from a dtype without a zero-copy view take the whole-tensor path."""
    chunk = chunk or tensorfile.COPY_CHUNK
    info = ck.info(name)
    floating = out_dtype in _NONFINITE
    if not ck.readable_by_path or (info.dtype != out_dtype and info.dtype not in ck.VIEWABLE):
        t = ck.load(name, dequantize=True)
        want = torch_dtype(out_dtype)
        t = t if t.dtype == want else t.to(want)
        raw = t.contiguous().view(_uint(DTYPE_SIZES[out_dtype])).numpy().reshape(-1) if t.numel() else b""
        if check is not None and floating:
            _check(raw, out_dtype, 0, name, check, t.reshape(-1))
        write_chunks(name, [raw])
        return
    if info.dtype == out_dtype and (check is None or not floating):
        write_chunks(name, ck.iter_bytes(name, chunk))
        return
    write_chunks(name, _element_chunks(ck, name, out_dtype, chunk, check if floating else None))


def _element_chunks(ck: Any, name: str, out_dtype: str, chunk: int, check: Any) -> Iterator[Any]:
    """`chunk` bytes' worth of elements at a time from a zero-copy view (cast when the dtype changes, checked when
    asked); each slice's pages dropped after."""
    info = ck.info(name)
    flat = ck.view(name).reshape(-1)
    want = torch_dtype(out_dtype)
    step = max(1, chunk // DTYPE_SIZES[info.dtype])
    row = info.numel // max(1, info.shape[0]) if info.shape else 1
    try:
        for a in range(0, flat.numel(), step):
            b = min(flat.numel(), a + step)
            if info.shape and row and hasattr(ck, "map_rows"):  # the slice's pages mapped in one call
                ck.map_rows(name, a // row, -(-b // row))
            piece = flat[a:b]
            out = piece if piece.dtype == want else piece.to(want)
            bits = out.view(_uint(DTYPE_SIZES[out_dtype])).numpy()
            if check is not None:
                _check(bits, out_dtype, a, name, check, out)
            yield bits
            del out, bits, piece
            if info.shape and row:
                ck.release_rows(name, a // row, -(-b // row))
    finally:
        del flat
        ck.release(name)


def _check(bits: Any, st_dtype: str, base: int, name: str, where: Any, values: Any) -> None:
    bad = first_nonfinite(bits, st_dtype)
    if bad is not None:
        raise nonfinite_error(where, name, base + bad, float(values[bad]))


def _uint(size: int):
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]


def check_finite(name: str, tensor, where: Path, chunk: int = 1 << 24) -> None:
    """NaN/Inf in a weight is a broken checkpoint (or an FP8 NaN code): refuse it by name rather than pass it on.
    Chunked, on the bit patterns (passthrough.first_nonfinite), so the check costs an AND and a max per element."""
    import torch

    from dsconv.tensors import safetensors_dtype

    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    flat = tensor.reshape(-1)
    st = safetensors_dtype(tensor)
    bits_type = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(tensor.element_size())
    for lo in range(0, flat.numel(), chunk):
        part = flat[lo:lo + chunk]
        if bits_type is not None and st in ("BF16", "F16", "F32", "F64"):
            bad = first_nonfinite(part.contiguous().view(bits_type).numpy(), st)
        elif not bool(torch.isfinite(part).all()):
            bad = int((~torch.isfinite(part)).nonzero()[0, 0])
        else:
            bad = None
        if bad is not None:
            raise nonfinite_error(where, name, lo + bad, float(flat[lo + bad]))
