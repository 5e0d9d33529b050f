"""Process-level helpers every stage shares: a temporary working directory, and this process's peak RSS."""
from __future__ import annotations

import contextlib
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
