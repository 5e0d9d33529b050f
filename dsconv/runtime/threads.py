"""Thread-level helpers every stage shares: `ordered_map`, a function over items on a process-wide thread pool with
its results in order and only a few computed ahead; `serial_pool`, threads in which torch runs serially."""
from __future__ import annotations

import os
import sys
from typing import Any


_POOLS: dict[tuple[int, int], Any] = {}


def _threads(n: int):
    """A process-wide pool of `n` threads (per pid: a forked worker gets its own). Reused across tensors, so the
    threads' scratch buffers and malloc arenas are reused too instead of growing with every new pool."""
    key = (os.getpid(), n)
    if key not in _POOLS:
        _POOLS[key] = serial_pool(n, "dsconv-block")
    return _POOLS[key]


def serial_pool(n: int, prefix: str):
    """A pool of `n` threads in which torch runs serially: the pool is the parallelism (n threads for n cores), so a
    torch op inside a pool thread runs on that thread, not on torch's own threads too (whose OpenMP team would spin
    on the same cores)."""
    from concurrent.futures import ThreadPoolExecutor

    torch = sys.modules.get("torch")
    if torch is None:
        return ThreadPoolExecutor(n, thread_name_prefix=prefix)
    # torch.set_num_threads(1) in each thread once it exists (all n are started here, on a barrier); it also moves
    # torch's process-wide default, which this thread then puts back (its own setting unchanged: the value it
    # reports is the default it was started with).
    import threading

    mine = torch.get_num_threads()
    barrier = threading.Barrier(n)

    def serial() -> None:
        torch.get_num_threads()  # torch's per-thread setup first, so it does not undo the next line later
        torch.set_num_threads(1)
        barrier.wait()

    pool = ThreadPoolExecutor(n, thread_name_prefix=prefix, initializer=serial)
    list(pool.map(lambda _: None, range(n)))  # every thread started (each ran `serial`)
    torch.set_num_threads(mine)
    return pool


def ordered_map(fn, items, threads: int = 2):
    """`fn` over `items` on `threads` threads, results yielded in order with at most `threads + 1` computed ahead:
    a streaming consumer (a writer putting row blocks into a file in order) overlaps with the computation while
    memory stays a few results, never all of them (`Executor.map` would submit everything at once).
    numpy and pwrite release the GIL, so the threads and the consumer run in parallel. `fn` must not call
    ordered_map itself (the pool is shared)."""
    from collections import deque

    if threads <= 1:
        for item in items:
            yield fn(item)
        return
    pool = _threads(threads)
    ahead: deque = deque()
    it = iter(items)
    try:
        for item in it:
            ahead.append(pool.submit(fn, item))
            if len(ahead) > threads:
                break
        while ahead:
            result = ahead.popleft().result()
            for item in it:
                ahead.append(pool.submit(fn, item))
                break
            yield result
            del result
    finally:
        for f in ahead:  # an abandoned stream: drop what has not started, wait for what has
            if not f.cancel():
                f.exception()
