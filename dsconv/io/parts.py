"""Planned safetensors parts that tasks fill on their own (layer 1, beside the writer).

Why apart from writer.py: the driver plans a set of parts (`TensorSetWriter`: headers written, files sized) and keeps
the transaction; a task in another process or on another host (dsconv.executor) gets a `PartLayout` - a path and the
byte slots of its tensors - and fills it with a `PartWriter`, hashing the whole part on the way when it writes all of
it, so the driver never reads the bytes back. Nothing here needs the driver's memory.
"""
from __future__ import annotations

import errno
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np

from dsconv.io.digest import WINDOW, hash_ranges, new_hash

# The rename-when-complete protects against crashes of the process; against power loss, parts are fsynced only when
# DSCONV_FSYNC=1 (it costs 3x on a 2 GB write here, like the tools users compare with, which never fsync), and
# `dsconv verify` re-checks every digest either way.
DURABLE = os.environ.get("DSCONV_FSYNC", "") not in ("", "0")


def as_bytes(tensor: Any) -> memoryview:
    """A zero-copy byte view of a contiguous torch tensor, numpy array or bytes-like object."""
    if isinstance(tensor, (bytes, bytearray, memoryview)):
        return memoryview(tensor).cast("B")
    if isinstance(tensor, np.ndarray):
        return memoryview(np.ascontiguousarray(tensor)).cast("B")
    import torch

    t = tensor.detach().cpu().contiguous()
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


SPLIT_WRITE_MIN = 2 << 20  # chunks from this size on are written as two halves on two threads
_HELPERS: dict[int, Any] = {}


def _helpers():
    """This process's two helper threads for `put` (per pid: a forked worker starts its own)."""
    pool = _HELPERS.get(os.getpid())
    if pool is None:
        from concurrent.futures import ThreadPoolExecutor

        pool = _HELPERS[os.getpid()] = ThreadPoolExecutor(2, thread_name_prefix="dsconv-put")
    return pool


def pwrite_all(fd: int, data: memoryview, pos: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], pos + done)


def put(fd: int, data: memoryview, pos: int, update: Any = None) -> None:
    """`data` (a byte memoryview) written at `pos` while `update` (a running hash's, or None) reads it. Big chunks
    are written as two halves, the second on a helper thread, and hashed on the other helper: pwrite's copy into
    the page cache is as long as the hash, and one thread doing it for every tensor was the longest path of an
    FP8 -> BF16 export (pwrite and the hash release the GIL). The hash still sees the bytes in order."""
    pool = _helpers() if len(data) >= SPLIT_WRITE_MIN or (update is not None and len(data) >= 2**20) else None
    if pool is None:
        pwrite_all(fd, data, pos)
        if update is not None:
            update(data)
        return
    jobs = [pool.submit(update, data)] if update is not None else []
    half = len(data) // 2 if len(data) >= SPLIT_WRITE_MIN else len(data)
    if half < len(data):
        jobs.append(pool.submit(pwrite_all, fd, data[half:], pos + half))
    try:
        pwrite_all(fd, data[:half], pos)
    finally:
        errors = [j.exception() for j in jobs]
    for e in errors:
        if e is not None:
            raise e


def put_chunks(fd: int, chunks: Iterable[Any], pos: int, nbytes: int, name: str, update: Any = None) -> int:
    """Byte chunks (memoryviews, bytes, contiguous arrays of any numpy dtype) written from `pos` by `put`, never
    more than `nbytes`, hashed in order by `update` when given; returns the position after the last one. Each chunk
    is done before the next is asked for, so an iterator may reuse its buffer."""
    start, end = pos, pos + nbytes
    for chunk in chunks:
        if isinstance(chunk, np.ndarray):  # any numpy dtype, ml_dtypes' bfloat16 included (no buffer format)
            chunk = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
        data = chunk if isinstance(chunk, memoryview) else memoryview(chunk)
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        if pos + len(data) > end:
            raise ValueError(f"tensor {name}: more than its planned bytes ({pos - start + len(data)} of the "
                             f"{nbytes} left)")
        put(fd, data, pos, update)
        pos += len(data)
        del data, chunk
    return pos


_WRITEBACK: list[Any] = []  # libc's sync_file_range, once looked up ([None] where there is none)


def start_writeback(fd: int, pos: int, nbytes: int) -> None:
    """Ask the kernel to start writing bytes [pos, pos + nbytes) of `fd` to disk now, without waiting
    (sync_file_range with SYNC_FILE_RANGE_WRITE; Linux only, a no-op elsewhere). A streamed output left to the
    page cache's dirty limits is written in bursts, and the last 10-20% of RAM waits for the disk at close; started
    as each tensor is done, the writes overlap the reading and rounding of the next (the pages stay cached). The
    cost: an output small enough to sit in the page cache now waits for a slow disk before the command returns
    (its data is then on disk); at DeepSeek scale the dirty limits make every writer wait for the disk anyway."""
    if not _WRITEBACK:
        fn = None
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
        except (OSError, AttributeError):
            fn = None
        _WRITEBACK.append(fn)
    if _WRITEBACK[0] is not None and nbytes > 0:
        _WRITEBACK[0](fd, pos, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; a failure here is the final sync's to report


class Known:
    """A part's digest computed elsewhere (by the task that wrote it)."""

    def __init__(self, digest: str) -> None:
        self.digest = digest

    def hexdigest(self) -> str:
        return self.digest

    def update(self, data: Any) -> None:
        raise ValueError("a part written by a task takes no further writes")


@dataclass(frozen=True)
class Slot:
    name: str
    offset: int  # absolute, in the part file
    nbytes: int


@dataclass(frozen=True)
class PartLayout:
    """A planned part: the driver created the file (header written, size set); tasks fill its slots by path."""

    path: str
    header: int  # bytes [0, header) are the safetensors header
    slots: tuple[Slot, ...]
    size: int

    def subset(self, names: set[str]) -> "PartLayout":
        return PartLayout(self.path, self.header, tuple(s for s in self.slots if s.name in names), self.size)

    @property
    def whole(self) -> bool:
        """True when the slots are all the data: a task writing them in order can hash the whole file."""
        return self.header > 0 and (sum(s.nbytes for s in self.slots) == self.size - self.header)


class PartWriter:
    """The task side of a planned part: write slots at their offsets in order (hashing the whole part when it has all
    of them), by path, without the driver's memory. `close()` returns the part's digest, or None for a subset."""

    def __init__(self, part: PartLayout) -> None:
        self.part = part
        self._next = 0
        self._fd = os.open(part.path, os.O_WRONLY)
        self._hash = None
        if part.whole:
            self._hash = new_hash()
            with open(part.path, "rb") as f:
                self._hash.update(f.read(part.header))

    def _slot(self, name: str) -> Slot:
        if self._next >= len(self.part.slots) or self.part.slots[self._next].name != name:
            want = self.part.slots[self._next].name if self._next < len(self.part.slots) else "nothing"
            raise ValueError(f"{self.part.path}: wrote {name}, the plan's next tensor is {want}")
        self._next += 1
        return self.part.slots[self._next - 1]

    def write(self, name: str, tensor: Any) -> None:
        self.write_chunks(name, (as_bytes(tensor),))

    def write_chunks(self, name: str, chunks: Iterable[Any]) -> None:
        """One slot from byte chunks (memoryviews, bytes, contiguous arrays), so no tensor need be whole in memory."""
        slot = self._slot(name)
        self._check_end(name, slot, self._put(name, slot, chunks, slot.offset))
        start_writeback(self._fd, slot.offset, slot.nbytes)

    def write_regions(self, name: str, regions: Iterable["Region"]) -> None:
        """One slot from byte regions of source files (see `Region`): contiguous ranges are copied in the kernel
        (copy_file_range) and hashed beside the copy from the page cache; strided ones are gathered a window at a
        time into one reused buffer; nothing passes through a fresh allocation."""
        slot = self._slot(name)
        regions = coalesce(regions)
        pos, i = slot.offset, 0
        while i < len(regions):
            j = i
            while j < len(regions) and regions[j].contiguous:
                j += 1
            if j > i:
                pos = self._copy(name, slot, regions[i:j], pos)
                i = j
            else:
                pos = self._put(name, slot, region_chunks(regions[i]), pos)
                i += 1
        self._check_end(name, slot, pos)
        start_writeback(self._fd, slot.offset, slot.nbytes)

    @staticmethod
    def _check_end(name: str, slot: Slot, pos: int) -> None:
        if pos != slot.offset + slot.nbytes:
            raise ValueError(f"tensor {name}: {pos - slot.offset} bytes written, {slot.nbytes} planned")

    def _put(self, name: str, slot: Slot, chunks: Iterable[Any], pos: int) -> int:
        return put_chunks(self._fd, chunks, pos, slot.offset + slot.nbytes - pos, name,
                          self._hash.update if self._hash is not None else None)

    def _copy(self, name: str, slot: Slot, regions: list["Region"], pos: int) -> int:
        """Contiguous ranges in the kernel, in order, with one thread hashing the same ranges beside the copy."""
        if pos + sum(r.nbytes for r in regions) > slot.offset + slot.nbytes:
            raise ValueError(f"tensor {name}: more than its planned {slot.nbytes} bytes")
        fds: dict[str, int] = {}
        try:
            for r in regions:
                if r.file not in fds:
                    fds[r.file] = os.open(r.file, os.O_RDONLY)
            t = None
            if self._hash is not None:  # hashing (outside the GIL) beside the copy
                t = _Beside(hash_ranges, self._hash, [(fds[r.file], r.start, r.nbytes) for r in regions])
            current = regions[0].file
            try:
                for r in regions:
                    current = r.file
                    copy_range(fds[r.file], self._fd, r.start, pos, r.nbytes)
                    pos += r.nbytes
            finally:
                if t is not None:
                    t.join()
        except (OSError, ValueError) as e:
            raise _named(e, self.part.path if _is_destination(e) else current) from e
        finally:
            for fd in fds.values():
                os.close(fd)
        return pos

    def close(self) -> str | None:
        if self._next != len(self.part.slots):
            raise RuntimeError(f"{self.part.path}: {len(self.part.slots) - self._next} planned tensors never written")
        if DURABLE:
            os.fsync(self._fd)
        os.close(self._fd)
        return self._hash.hexdigest() if self._hash is not None else None

    def abort(self) -> None:
        os.close(self._fd)


class BehindHash:
    """The digest of a planned part that tasks fill in runs (several jobs, each a subset of its slots): the driver
    reports each finished run (`wrote`), and a helper thread hashes the part from the page cache as far as its slots
    are written in order, behind the tasks still writing the rest. Hashing the whole part at close instead ran on
    one core after everything else: 2.5 s for the 3.3 GB output of a 5.3 GB DeepSeek-shaped checkpoint, a third of
    the run."""

    def __init__(self, part: PartLayout) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._slots = sorted(part.slots, key=lambda s: s.offset)
        self._size = part.size
        self._done: set[str] = set()
        self._next = 0  # index of the first slot not yet handed to the hash
        self._pos = 0   # bytes of the part handed to the hash (the header first)
        self._hash = new_hash()
        self._path = part.path
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dsconv-hash")
        self._jobs: list[Any] = []

    @property
    def complete(self) -> bool:
        return self._next == len(self._slots)

    def wrote(self, names: Iterable[str]) -> None:
        """These slots are written: hash on through every slot now written in order."""
        self._done.update(names)
        while self._next < len(self._slots) and self._slots[self._next].name in self._done:
            self._next += 1
        end = self._size if self.complete else self._slots[self._next].offset
        if end > self._pos:
            self._jobs.append(self._pool.submit(self._hash_range, self._pos, end))
            self._pos = end

    def _hash_range(self, lo: int, hi: int) -> None:
        # opened for each range, after the tasks that wrote it closed the file: on shared storage (NFS) only an open
        # after the writer's close is sure to see its bytes
        fd = os.open(self._path, os.O_RDONLY)
        try:
            hash_ranges(self._hash, [(fd, lo, hi - lo)])
        finally:
            os.close(fd)

    def hexdigest(self) -> str:
        """The part's digest once every slot is written (waits for the helper)."""
        assert self.complete, "a part's digest before all its slots were written"
        for j in self._jobs:
            j.result()
        return self._hash.hexdigest()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


SHORT = "source ended"  # copy_range's message when the source file is shorter than the range


class _Beside(threading.Thread):
    """`fn(*args)` on a thread beside the caller's writes; `join()` re-raises what it raised, so a failed hash is the
    write's error, never a part with a digest of partial data."""

    def __init__(self, fn: Any, *args: Any) -> None:
        super().__init__(daemon=True)
        self._fn, self._args, self._error = fn, args, None
        self.start()

    def run(self) -> None:
        try:
            self._fn(*self._args)
        except BaseException as e:  # noqa: BLE001 - handed to the joining thread
            self._error = e

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self._error is not None:
            raise self._error


@dataclass(frozen=True)
class Region:
    """Bytes of a source file that go into a slot unchanged: `rows` runs of `width` bytes, `stride` apart, from
    `start` (one contiguous range when rows == 1: whole tensors and first-dimension slices; several for a column
    slice); `file` None: `width` x `rows` zero bytes."""

    file: str | None
    start: int
    width: int
    rows: int = 1
    stride: int = 0

    @property
    def nbytes(self) -> int:
        return self.rows * self.width

    @property
    def contiguous(self) -> bool:
        return self.file is not None and (self.rows == 1 or self.stride == self.width)

    def flat(self) -> "Region":
        return Region(self.file, self.start, self.nbytes) if self.contiguous else self


def coalesce(regions: Iterable[Region]) -> list[Region]:
    """Adjacent ranges of one file merged into one copy (a row permutation's runs of consecutive rows), empty ones
    dropped."""
    out: list[Region] = []
    for r in regions:
        r = r.flat()
        if not r.nbytes:
            continue
        last = out[-1] if out else None
        if (last is not None and r.contiguous and last.contiguous and last.file == r.file
                and last.start + last.nbytes == r.start):
            out[-1] = Region(r.file, last.start, last.nbytes + r.nbytes)
        else:
            out.append(r)
    return out


_LOCAL = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """This thread's reused gather buffer (grown as needed: a window, or one row where a row is wider; kept for the
    thread's next gather): fresh pages for every gather would cost a page fault per 4 KiB, as much as the copy."""
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _LOCAL.buf = np.empty(nbytes, dtype=np.uint8)
    return buf[:nbytes]


def region_chunks(r: Region, block: int = WINDOW) -> Iterator[Any]:
    """A region's bytes a window at a time through one reused buffer: zeros, or strided rows gathered from a
    window-sized mmap of the source (nothing stays mapped)."""
    if r.file is None:
        buf = memoryview(bytearray(min(block, r.nbytes)))
        for lo in range(0, r.nbytes, block):
            yield buf[: min(block, r.nbytes - lo)]
        return
    rows_per = max(1, block // max(1, r.stride))
    out = _scratch(min(rows_per, r.rows) * r.width).reshape(-1, r.width)
    with open(r.file, "rb") as f:
        for r0 in range(0, r.rows, rows_per):
            n = min(rows_per, r.rows - r0)
            lo = r.start + r0 * r.stride
            base = lo - lo % mmap.ALLOCATIONGRANULARITY
            span = (n - 1) * r.stride + r.width
            try:
                mm = mmap.mmap(f.fileno(), lo - base + span, offset=base, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise _named(e, r.file) from e
            with mm:
                rows = np.lib.stride_tricks.as_strided(np.frombuffer(mm, np.uint8, span, lo - base),
                                                       (n, r.width), (r.stride, 1))
                np.copyto(out[:n], rows)
                del rows
            yield out[:n]


def copy_range(src: int, dst: int, src_off: int, dst_off: int, nbytes: int) -> None:
    """nbytes from src at src_off to dst at dst_off: copy_file_range, else pread/pwrite in WINDOW blocks."""
    done = 0
    try:
        while done < nbytes:
            n = os.copy_file_range(src, dst, min(nbytes - done, 1 << 30), src_off + done, dst_off + done)
            if n == 0:
                raise OSError(errno.EIO, f"{SHORT} {nbytes - done} bytes early")
            done += n
        return
    except (AttributeError, OSError) as e:
        if isinstance(e, OSError) and e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP,
                                                      errno.EBADF):
            raise
    buf = bytearray(min(WINDOW, nbytes - done))
    view = memoryview(buf)
    while done < nbytes:
        n = os.preadv(src, [view[: min(len(buf), nbytes - done)]], src_off + done)
        if n <= 0:
            raise OSError(errno.EIO, f"{SHORT} {nbytes - done} bytes early")
        w = 0
        while w < n:
            w += os.pwrite(dst, view[w:n], dst_off + done + w)
        done += n


def _is_destination(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


def _named(e: BaseException, path: str | None) -> BaseException:
    """A failed read or write of a region as an OSError naming its file (the CLI shows it as a one-line user error):
    a ValueError from mmap, or a copy that ended early, means the source is shorter than its header says - it changed
    while dsconv read it."""
    if isinstance(e, OSError) and (e.filename or not path):
        return e
    if isinstance(e, ValueError) or str(e.strerror or "").startswith(SHORT):
        return OSError(errno.EIO, "shorter than its safetensors header says: it changed while dsconv read it", path)
    return OSError(e.errno, e.strerror or str(e), path)
