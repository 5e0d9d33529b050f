"""The digest each manifest records per file (layer 1): BLAKE3, and sha256 for manifests written before it.

Why BLAKE3: every byte a stage writes is hashed once on the way out, and at DeepSeek-R1's 1.3 TB of BF16 the hash
was the largest single cost of the FP8 -> BF16 export after the copy into the page cache (23% of its CPU time,
`perf`, 2026-12-07). BLAKE3 is a cryptographic hash like sha256 - a damaged or swapped file cannot match by chance -
at 4.8 GB/s on one core of this host against sha256's 1.1 GB/s (256 MB in 8 MB updates, 2026-12-07), and its
update releases the GIL as hashlib's does. Manifests keep the algorithm as the entry's key ({"blake3": hex, "size":
n}), so `dsconv verify` still checks a directory an earlier dsconv wrote with sha256.
"""
from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path
from typing import Any

ALGORITHM = "blake3"
ALGORITHMS = ("blake3", "sha256")  # what a manifest entry may name (schemas.manifest checks it); stages write the first
WINDOW = 64 * 2**20  # bytes of a file mapped at a time (io.parts copies and gathers in the same windows)


def new_hash(algorithm: str = ALGORITHM) -> Any:
    """A running hash with hashlib's interface (update, hexdigest)."""
    if algorithm == "blake3":
        from blake3 import blake3

        return blake3()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest {algorithm}")


def entry(hexdigest: str, size: int) -> dict[str, Any]:
    """A manifest's record of one file."""
    return {ALGORITHM: hexdigest, "size": size}


def recorded(info: dict[str, Any]) -> tuple[str, str]:
    """(algorithm, hex digest) of a manifest entry (the schema checked it names exactly one)."""
    for algorithm in ALGORITHMS:
        if algorithm in info:
            return algorithm, info[algorithm]
    raise KeyError(f"no digest among {', '.join(ALGORITHMS)}")


def file_digest(path: Path, algorithm: str = ALGORITHM) -> str:
    """A file's digest read from mapped windows of the page cache (reading it into a buffer cost a copy of every
    byte, a quarter of sha256's own time)."""
    h = new_hash(algorithm)
    fd = os.open(path, os.O_RDONLY)
    try:
        hash_ranges(h, [(fd, 0, os.fstat(fd).st_size)])
    finally:
        os.close(fd)
    return h.hexdigest()


def hash_ranges(h: Any, ranges: list[tuple[int, int, int]]) -> None:
    """Feed byte ranges (fd, start, nbytes) of files to `h` in order from the page cache, one mapped window at a time
    (nothing stays mapped)."""
    for fd, start, nbytes in ranges:
        pos, end = start, start + nbytes
        while pos < end:
            lo = pos - pos % mmap.ALLOCATIONGRANULARITY
            hi = min(end, lo + WINDOW)
            with mmap.mmap(fd, hi - lo, offset=lo, access=mmap.ACCESS_READ) as mm:
                with memoryview(mm) as mv:
                    h.update(mv[pos - lo:hi - lo])
            pos = hi
