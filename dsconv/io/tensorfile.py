"""safetensors files at the byte level: validated headers, where each tensor's bytes are, and reading one tensor out
of a read-only mmap (layer 1: knows files and dtypes, not models).

Why apart from checkpoint.py: stages read their own outputs back (shard verify, quantized directories) with the same
validation and the same memory behaviour, without a model family; `Checkpoint` (which classifies every tensor through
its family) builds on this.

Everything read is untrusted: headers are bounded and checked, byte ranges must lie in the file and not overlap.
"""
from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dsconv import schemas
from dsconv.errors import UserError
from dsconv.schemas.core import os_reason
from dsconv.tensors import TensorSpec, numpy_dtype, torch_dtype

MAX_HEADER = 100 * 2**20  # safetensors' own limit
PAGE = mmap.PAGESIZE
READ_CHUNK = 32 * 2**20
#: bytes per step when a tensor streams through unchanged or cast (pass-through, FP8 export); bounds resident memory
COPY_CHUNK = 64 * 2**20
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Python < 3.12 lacks the constant


@dataclass(frozen=True, init=False)
class TensorInfo:
    """Where one (logical) tensor's bytes are: file and absolute byte range. No data."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int
    end: int
    source: str  # the tensor name on disk (differs for experts cut out of a fused tensor)

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], file: Path, start: int, end: int,
                 source: str) -> None:
        # stores into the instance dict, not seven frozen-dataclass setattrs (2.7x faster; an open of DeepSeek-V3
        # makes 91,991 of these); in field order, so the dict keeps sharing its keys with the class's
        d = self.__dict__
        d["name"], d["dtype"], d["shape"], d["file"], d["start"], d["end"], d["source"] = \
            name, dtype, shape, file, start, end, source

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, self.shape)


def read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """Validated safetensors header of `path`: (data start offset, {name: entry}); reads only the header bytes."""
    where = path.name
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise UserError(f"{where} is truncated ({size} bytes)", hint="re-download or re-copy the file")
            n = int.from_bytes(f.read(8), "little")
            if n > MAX_HEADER:
                raise UserError(f"{where}: header claims {n} bytes (limit {MAX_HEADER})",
                                hint="the file is not safetensors or is damaged")
            if 8 + n > size:
                raise UserError(f"{where} is truncated: header of {n} bytes but file is {size} bytes",
                                hint="re-download or re-copy the file")
            raw = f.read(n)
    except OSError as e:
        raise UserError(f"cannot read {path}: {os_reason(e)}", hint="check the file's permissions") from None
    return 8 + n, schemas.safetensors_header(raw, where, size - 8 - n)


class TensorReader:
    """Reads one tensor's byte range out of a read-only mmap into a fresh tensor, dropping the mapped pages as it goes.

    Shared by every reader of safetensors in dsconv (checkpoints, and stages reading their own outputs back), so the
    memory behaviour is the same everywhere: resident memory is the tensor plus one 32 MiB chunk.
    """

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap | None] = {}

    def _map(self, path: Path) -> mmap.mmap | None:
        if path not in self._maps:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self._maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        return self._maps[path]

    def read(self, info: TensorInfo):
        import torch

        mm = self._map(info.file)
        if info.numel == 0 or mm is None:
            return torch.empty(info.shape, dtype=torch_dtype(info.dtype))
        out = torch.empty(info.nbytes, dtype=torch.uint8)
        dst = out.numpy()
        # Copy in chunks, dropping each chunk's pages from this process right after (they stay in the page cache):
        # resident memory is the tensor plus one chunk, never the mapped tensor and its copy at once.
        for lo in range(0, info.nbytes, READ_CHUNK):
            hi = min(info.nbytes, lo + READ_CHUNK)
            dst[lo:hi] = np.frombuffer(mm, dtype=np.uint8, count=hi - lo, offset=info.start + lo)
            a = info.start + lo
            a -= a % PAGE
            try:
                mm.madvise(mmap.MADV_DONTNEED, a, info.start + hi - a)
            except (AttributeError, OSError, ValueError):
                pass
        return out.view(torch_dtype(info.dtype)).reshape(info.shape)

    def iter_bytes(self, info: TensorInfo, chunk: int | None = None):
        """A tensor's bytes as consecutive read-only memoryviews of at most `chunk` bytes over the page cache; each
        chunk's pages leave this process when the next is asked for, so resident memory is one chunk whatever the
        tensor's size (a 1.85 GB embedding passes through in 64 MiB steps). `chunk` is rounded down to whole pages."""
        mm = self._map(info.file)
        if info.nbytes == 0 or mm is None:
            return
        chunk = chunk or COPY_CHUNK
        chunk = max(PAGE, chunk - chunk % PAGE)
        whole = memoryview(mm)
        try:
            lo = info.start
            self._madvise(mm, lo, min(info.end, lo + chunk) - lo, getattr(mmap, "MADV_WILLNEED", 3))
            while lo < info.end:
                hi = min(info.end, lo - lo % PAGE + chunk)  # page-aligned steps after the first
                if hi < info.end:  # read the next chunk ahead while this one is consumed
                    self._madvise(mm, hi, min(info.end, hi + chunk) - hi, getattr(mmap, "MADV_WILLNEED", 3))
                piece = whole[lo:hi]
                try:
                    yield piece
                finally:
                    piece.release()
                self._madvise(mm, lo, hi - lo, mmap.MADV_DONTNEED)
                lo = hi
        finally:
            whole.release()

    @staticmethod
    def _madvise(mm: mmap.mmap, start: int, length: int, advice: int) -> None:
        a = start - start % PAGE
        try:
            mm.madvise(advice, a, start + length - a)
        except (AttributeError, OSError, ValueError):
            pass

    @staticmethod
    def prefetch(info: TensorInfo, chunk: int = 64 << 20) -> None:
        """Bring a tensor's bytes into the page cache from a helper thread: each window mapped on its own and
        populated (MADV_POPULATE_READ, which waits for the disk outside the GIL), then unmapped, so nothing is
        copied and nothing stays in this process. On a cold disk POSIX_FADV_WILLNEED of 256 MB was measured to read
        nothing ahead, and a wider MADV_WILLNEED window did not shorten the run; `pread` into a buffer worked but
        copied every byte (0.7 s against 0.07 s for 4 GB in the page cache). Kernels before 5.14: `pread`."""
        if info.nbytes == 0:
            return
        fd = os.open(info.file, os.O_RDONLY)
        try:
            pos = info.start - info.start % mmap.ALLOCATIONGRANULARITY
            while pos < info.end:
                n = min(chunk, info.end - pos)
                try:
                    with mmap.mmap(fd, n, offset=pos, access=mmap.ACCESS_READ) as mm:
                        mm.madvise(MADV_POPULATE_READ)
                except OSError:
                    _pread_range(fd, pos, info.end)
                    return
                pos += n
        finally:
            os.close(fd)

    def populate_range(self, info: TensorInfo, lo: int, hi: int) -> None:
        """Map the pages of bytes [lo, hi) of a tensor into this process in one call (MADV_POPULATE_READ, Linux
        5.14+; a no-op elsewhere) before a row-block consumer of `view()` reads them: a page fault per 4 KiB cost
        more than the FP8 dequantization of the page."""
        mm = self._map(info.file)
        if mm is not None and hi > lo:
            self._madvise(mm, info.start + lo, hi - lo, MADV_POPULATE_READ)

    def release_range(self, info: TensorInfo, lo: int, hi: int) -> None:
        """Drop the pages of bytes [lo, hi) of a tensor (relative to its start) from this process: a row-block
        consumer of `view()` releases each block as it is done with it."""
        mm = self._map(info.file)
        if mm is not None and hi > lo:
            self._madvise(mm, info.start + lo, hi - lo, mmap.MADV_DONTNEED)

    def view(self, info: TensorInfo):
        """A zero-copy, read-only tensor over the page cache (for callers that only read, e.g. weight-only
        quantization, where a copy would cost as much as the work). Call `release(info)` when done with it."""
        import warnings

        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "buffer is not writable": views are never written through
            t = torch.frombuffer(self._map(info.file), dtype=torch_dtype(info.dtype), count=info.numel,
                                 offset=info.start)
        return t.reshape(info.shape)

    def array(self, info: TensorInfo) -> np.ndarray:
        """`view()` as a read-only numpy array (BF16 as ml_dtypes' bfloat16): the weight-only path rounds numpy
        arrays and so never imports torch. Call `release(info)` when done with it."""
        mm = self._map(info.file)
        dtype = numpy_dtype(info.dtype)
        if mm is None or info.numel == 0:
            return np.empty(info.shape, dtype)
        return np.frombuffer(mm, dtype=dtype, count=info.numel, offset=info.start).reshape(info.shape)

    def advise(self, info: TensorInfo, advice: int) -> None:
        """madvise a tensor's pages: MADV_WILLNEED to read ahead, MADV_DONTNEED to drop them from this process."""
        mm = self._map(info.file)
        lo = info.start - info.start % PAGE
        try:
            if mm is not None:
                mm.madvise(advice, lo, info.end - lo)
        except (OSError, ValueError, AttributeError):
            pass

    def close(self) -> None:
        for mm in self._maps.values():
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # a view is still alive somewhere: the map goes with it
                    pass
        self._maps.clear()


def read_tensor_infos(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file (validated header), e.g. a stage reading its own output back."""
    start, header = read_header(path)
    return {name: TensorInfo(name, e["dtype"], tuple(e["shape"]), path, start + e["data_offsets"][0],
                             start + e["data_offsets"][1], name) for name, e in header.items()}


def dequant_fp8_block(weight, scale_inv, block: tuple[int, int] = (128, 128), out_dtype=None):
    """FP8 [out, in] x float32 [ceil(out/b0), ceil(in/b1)] -> BF16 (or `out_dtype`), exactly `weight.float() * scale`
    rounded once: by io/fp8_kernel.py's tables for e4m3 with finite scales below 2^7 and no NaN code, else the
    reference loop (`reference_dequant_fp8`), which also gives NaN codes their NaN."""
    import torch

    from dsconv.io import fp8_kernel

    out_dtype = out_dtype or torch.bfloat16
    scale = scale_inv.to(torch.float32)
    if (weight.dtype == torch.float8_e4m3fn and weight.dim() == 2
            and out_dtype in (torch.bfloat16, torch.float16, torch.float32)
            and tuple(scale.shape) == tuple(-(-n // b) for n, b in zip(weight.shape, block))
            and fp8_kernel.fits(scale.numpy())):
        codes = weight.contiguous().view(torch.uint8).numpy()
        if codes.size and not fp8_kernel.nan_codes(codes):
            out = torch.empty(tuple(weight.shape), dtype=out_dtype)
            fp8_kernel.dequantize_rows(codes, scale.numpy(), block, 0, float_view(out))
            return out
    return reference_dequant_fp8(weight, scale, block, out_dtype)


def float_view(t):
    """A numpy view of a float tensor in its own float dtype (bfloat16 through ml_dtypes)."""
    import torch

    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def reference_dequant_fp8(weight, scale_inv, block: tuple[int, int] = (128, 128), out_dtype=None):
    """The reference: one row-block stripe at a time through torch's float8 cast (ragged edges)."""
    import torch

    out_dtype = out_dtype or torch.bfloat16
    rows, cols = weight.shape
    b0, b1 = block
    out = torch.empty((rows, cols), dtype=out_dtype)
    col_scale_idx = torch.arange(cols) // b1
    for i in range(0, rows, b0):
        stripe = weight[i:i + b0].to(torch.float32)
        stripe.mul_(scale_inv[i // b0].to(torch.float32)[col_scale_idx])
        out[i:i + b0] = stripe.to(out_dtype)
    return out


def _pread_range(fd: int, pos: int, end: int, chunk: int = 8 << 20) -> None:
    """Read bytes [pos, end) of `fd` through one reused buffer (into the page cache; the buffer is discarded)."""
    buf = memoryview(bytearray(min(chunk, end - pos)))
    while pos < end:
        n = os.preadv(fd, [buf[: min(len(buf), end - pos)]], pos)
        if n <= 0:
            return
        pos += n
