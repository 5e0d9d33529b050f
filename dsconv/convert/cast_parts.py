"""The parts of `dsconv export --format safetensors` as independent jobs (dsconv.executor): each output part - or a run
of its tensors when there are fewer parts than workers - is read by byte range, converted and written by its own task.

Why the kernel arrives in the job: the conversion (`fp8.write_converted`) stays in fp8.py, which imports this module;
a module-level function pickles by reference, so a task in another process calls the same code and writes the same
bytes as the inline run. A job streams each tensor exactly as the inline writer does - FP8 weights in stripes of
block rows read from a view of the input, cast and kept tensors in 64 MiB chunks - so a worker's memory is a few
stripes or chunks, not its largest tensor.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from dsconv.executor import Executor
from dsconv.io.parts import PartLayout, PartWriter
from dsconv.io.tensorfile import TensorInfo, TensorReader


@dataclass(frozen=True)
class CastJob:
    index: str                        # the output part's file name (its tensor set)
    part: PartLayout                  # the slots this job writes
    tensors: tuple[Any, ...]          # fp8.TensorPlan, in slot order
    infos: dict[str, TensorInfo]      # every input the tensors read (FP8 scales included)
    block: tuple[int, int]
    root: str                         # the input directory (for messages)
    threads: int
    write: Callable[..., Any]         # fp8.write_converted(write_chunks, source, plan entry, threads)
    nbytes: int                       # output bytes, for progress


class _ByPath:
    """What `write_converted` asks of a checkpoint, served from byte ranges by path: load, zero-copy views (stored
    dtype), chunked bytes, page release, `facts.fp8_block` and `root`. Never pickled: built inside the task."""

    VIEWABLE = ("BF16", "F16", "F32")  # as Checkpoint.VIEWABLE: dtypes a chunk can be cast from without a copy
    readable_by_path = True

    def __init__(self, infos: dict[str, TensorInfo], block: tuple[int, int], root: Path) -> None:
        self.reader = TensorReader()
        self.infos = infos
        self.facts = SimpleNamespace(fp8_block=block)
        self.root = root

    def info(self, name: str) -> TensorInfo:
        return self.infos[name]

    def load(self, name: str, dequantize: bool = False):
        return self.reader.read(self.infos[name])  # FP8 weights never reach here with dequantize=True

    def stored_view(self, name: str):
        return self.reader.view(self.infos[name])

    def view(self, name: str):
        info = self.infos[name]
        return self.reader.view(info) if info.dtype in self.VIEWABLE and info.numel else self.load(name)

    def iter_bytes(self, name: str, chunk: int | None = None):
        return self.reader.iter_bytes(self.infos[name], chunk)

    def release_rows(self, name: str, lo: int, hi: int) -> None:
        info = self.infos[name]
        row = info.nbytes // max(1, info.shape[0]) if info.shape else info.nbytes
        self.reader.release_range(info, lo * row, hi * row)

    def map_rows(self, name: str, lo: int, hi: int) -> None:
        info = self.infos[name]
        row = info.nbytes // max(1, info.shape[0]) if info.shape else info.nbytes
        self.reader.populate_range(info, lo * row, hi * row)

    def release(self, name: str) -> None:
        self.reader.advise(self.infos[name], getattr(mmap, "MADV_DONTNEED", 4))


def cast_part(job: CastJob) -> str | None:
    """Convert and write one job's tensors, streamed; the part's digest when the job wrote all of it."""
    from dsconv.runtime.process import gc_paused

    src = _ByPath(job.infos, job.block, Path(job.root))
    out = PartWriter(job.part)
    try:
        with gc_paused():  # a few objects per stripe: no collection walks the worker's (torch's) objects
            for t in job.tensors:
                job.write(out.write_chunks, src, t, job.threads)
        return out.close()
    except BaseException:
        out.abort()
        raise
    finally:
        src.reader.close()


def cast_jobs(ck: Any, plan: Any, sets: dict[str, Any], workers: int, write: Callable[..., Any]) -> list[CastJob]:
    """One job per output part, or runs of its tensors (by bytes) when there are fewer than two parts per worker."""
    import math
    import os

    from dsconv.tensors import DTYPE_SIZES

    pieces = max(1, -(-2 * workers // max(1, len(plan.parts)))) if workers > 1 else 1
    threads = max(1, (os.cpu_count() or 1) // workers)
    block = tuple(ck.facts.fp8_block or (128, 128))
    jobs = []
    for part in plan.parts:
        layout = sets[part.file].layout()[0]
        sizes = [math.prod(t.shape) * DTYPE_SIZES[t.out_dtype] for t in part.tensors]
        total = sum(sizes)
        runs: list[list[int]] = [[]]
        acc = 0
        for i, size in enumerate(sizes):
            if runs[-1] and acc >= total / pieces * len(runs):
                runs.append([])
            runs[-1].append(i)
            acc += size
        for run in runs:
            tensors = tuple(part.tensors[i] for i in run)
            names = {t.name for t in tensors}
            infos = {t.name: ck.info(t.name) for t in tensors}
            infos.update({t.scale: ck.info(t.scale) for t in tensors if t.scale})
            jobs.append(CastJob(part.file, layout if len(runs) == 1 else layout.subset(names), tensors, infos,
                                block, str(ck.root), threads, write, sum(sizes[i] for i in run)))
    return jobs


def run_cast_jobs(ex: Executor, jobs: list[CastJob], sets: dict[str, Any], bar: Any) -> None:
    """Every job through the executor; each part adopted into its tensor set as its jobs come back, in order."""
    for job, digest in zip(jobs, ex.map(cast_part, jobs, work_bytes=sum(j.nbytes for j in jobs))):
        sets[job.index].adopt(0, [s.name for s in job.part.slots], digest)
        bar.update(job.nbytes)
