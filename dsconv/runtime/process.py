"""Process-level helpers every stage shares: a temporary working directory, the garbage collector paused for a block,
and this process's peak RSS."""
from __future__ import annotations

import contextlib
import gc
import os
import sys
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def working_dir(path: Path) -> Iterator[None]:
    """chdir into `path` for a block (MindSpore drops debris in the cwd; the demo runs commands in its workspace)."""
    old = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for a block that builds many small, acyclic, long-lived objects (the
    header listing of 91,991 tensors, a MindIE plan of 189k parts: ~0.9 M objects): every collection the
    allocations trigger walks all the young objects built so far, which made planning DeepSeek-V3 ~40% slower for
    nothing collected. On the way out the block's objects move straight to the oldest generation (freeze + unfreeze,
    no walk; still collectable), so the first collection after the block does not walk them all either (0.3 s).
    Nests."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if gc.get_freeze_count() == 0:  # someone else's frozen objects stay frozen
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def peak_rss_bytes() -> int:
    """This process's peak resident set size. Linux: VmHWM, which starts afresh at exec (ru_maxrss keeps the
    high-water mark of the process that forked us, so a child would report at least its parent's size)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _cpuinfo(field: str, path: str) -> str | None:
    """The first value of `field` in /proc/cpuinfo (Linux); None where the file or the field is absent."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (Linux); empty where /proc/cpuinfo is absent or unreadable."""
    return set((_cpuinfo("flags", path) or "").split())


def cpu_vendor(path: str = "/proc/cpuinfo") -> str | None:
    """The x86 vendor string (GenuineIntel, AuthenticAMD, HygonGenuine, ...); None elsewhere."""
    return _cpuinfo("vendor_id", path)


def native_bf16_matmul(flags: set[str] | None = None) -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX or AVX512-BF16): elsewhere oneDNN converts, slower than
    float32."""
    flags = cpu_flags() if flags is None else flags
    return bool(flags & {"amx_bf16", "avx512_bf16"})
