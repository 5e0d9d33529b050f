"""The weight-only path of `dsconv quantize` (w8a16, w8a8_dynamic, w4a16 with round-to-nearest): nothing depends on
activations, so tensors stream from the checkpoint straight into the output, one tensor in memory and the next one
read ahead.

Why part jobs: the output parts are planned before their first byte (QuantWriter opens the final set), so each part -
or, when there are fewer parts than workers, each run of its tensors - can be written by its own task
(`part_jobs` -> `run_part`), on any executor (dsconv.executor). A job names its inputs by byte range and its output by
path; the task reads, quantizes, writes and returns the part's digest (when it wrote all of it) with the linears'
error figures. The bytes are the same whoever runs the job.
"""
from __future__ import annotations

import mmap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from dsconv.checkpoint import Checkpoint
from dsconv.executor import Executor
from dsconv.io.parts import PartLayout, PartWriter, Region
from dsconv.io.tensorfile import TensorInfo, TensorReader, dequant_fp8_block
from dsconv.quant.algorithms.error_metrics import sampled_weight_error
from dsconv.quant.formats.msmodelslim import LinearResult, emit_linear
from dsconv.quant.formats.output import QuantWriter, as_float
from dsconv.quant.plan.plan import LinearPlan, QuantPlan, linear_specs
from dsconv.quant.plan.report import LinearRecord
from dsconv.quant.weights import quantize_weight, rtn_linear_into
from dsconv.runtime.process import gc_paused

VIEWABLE = ("BF16", "F16", "F32")


@dataclass(frozen=True)
class Source:
    """One input of a job, by byte range: a linear (weight, bias, FP8 scale) or a float tensor (`lp` None)."""

    weight: TensorInfo
    lp: LinearPlan | None = None
    bias: TensorInfo | None = None
    scale: TensorInfo | None = None  # FP8 weight_scale_inv
    out_dtype: str | None = None     # a float's output dtype


@dataclass(frozen=True)
class Params:
    """The plan's few facts a task needs (the whole QuantPlan would be megabytes per job for DeepSeek)."""

    group_size: int
    method: str
    deq_dtype: str
    fp8_block: tuple[int, int]


@dataclass(frozen=True)
class PartJob:
    index: int            # the part's index in the output set
    part: PartLayout      # the slots this job writes (all of the part, or a run of it)
    sources: tuple[Source, ...]
    params: Params
    nbytes: int           # input bytes, for progress

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.part.slots]


@dataclass
class PartResult:
    digest: str | None
    records: list[tuple[str, str, float]]


# Runs per worker when a part is cut (fewer parts than workers): the driver hashes each finished run behind the
# jobs still running (io.parts.BehindHash), so the hash left after the last job is one run's, not the part's; and
# with a cold input the jobs' disk waits interleave. A 5.3 GB DeepSeek-shaped checkpoint in one part on 2 workers,
# input not cached (2026-12-03): 7.2 / 6.6 / 6.1 / 5.95 / 5.9 s with 1 / 2 / 4 / 8 / 16 runs per worker.
RUNS_PER_WORKER = 8


def part_jobs(ck: Checkpoint, plan: QuantPlan, qw: QuantWriter, workers: int) -> list[PartJob]:
    """One job per output part, which hashes its part on the way; parts are cut into runs of whole sources only when
    there are fewer parts than workers, and those parts are hashed by the driver behind the jobs (`weight_only`)."""
    params = Params(plan.group_size, plan.method, plan.deq_dtype, tuple(ck.facts.fp8_block or (128, 128)))
    weights = {lp.weight: lp for lp in plan.linears.values()}
    owner: dict[str, int] = {}  # output tensor -> index of the source producing it
    sources: list[Source] = []
    for name in ck.names():
        lp = weights.get(name)
        if lp is None and name not in plan.floats:
            continue
        info = ck.info(name)
        scale = ck.info(ck.fp8_scales[name]) if name in ck.fp8_scales else None
        if lp is None:
            src = Source(info, scale=scale, out_dtype=plan.floats[name].dtype)
            outs = [name]
        else:
            bias = ck.info(lp.bias) if lp.bias else None
            src = Source(info, lp, bias, scale)
            outs = [s.name for s in linear_specs(lp, qw.types[lp.module], plan, bias.dtype if bias else None)]
        for o in outs:
            owner[o] = len(sources)
        sources.append(src)
    layouts = qw.ts.layout()
    pieces = 1 if len(layouts) >= workers else RUNS_PER_WORKER * -(-workers // len(layouts))
    jobs = []
    for i, part in enumerate(layouts):
        idx = list(dict.fromkeys(owner[s.name] for s in part.slots if s.name in owner))
        size = sum(sources[j].weight.nbytes for j in idx)
        runs: list[list[int]] = [[]]
        acc = 0
        for j in idx:
            if runs[-1] and acc >= size / pieces * len(runs):
                runs.append([])
            runs[-1].append(j)
            acc += sources[j].weight.nbytes
        for run in runs:
            names = {s.name for s in part.slots if owner.get(s.name) in set(run)}
            sub = part if len(runs) == 1 else part.subset(names)
            jobs.append(PartJob(i, sub, tuple(sources[j] for j in run), params,
                                sum(sources[j].weight.nbytes for j in run)))
    return jobs


def weight_only(ck: Checkpoint, plan: QuantPlan, qw: QuantWriter, progress: bool = True,
                executor: Executor | None = None) -> dict[str, LinearRecord]:
    """Round-to-nearest without activations: every part job through the executor (inline by default), adopted
    into the output set in order."""
    from tqdm import tqdm

    assert not qw.staged, "weight-only runs never wait for fallback decisions"
    ex = executor or Executor(1)
    jobs = part_jobs(ck, plan, qw, ex.workers)
    records: dict[str, LinearRecord] = {}
    total = sum(j.nbytes for j in jobs)
    with tqdm(total=total, unit="B", unit_scale=True, desc="quantize", disable=None if progress else True,
              leave=False) as bar, gc_paused():  # blocks make acyclic arrays: no collection walks them
        for job, res in zip(jobs, ex.map(run_part, jobs, work_bytes=total, threads=True)):
            qw.ts.adopt(job.index, job.names, res.digest)  # a part written in runs is hashed behind the jobs
            qw.written.update(job.names)
            for module, qtype, err in res.records:
                records[module] = LinearRecord(module, qtype, err)
            bar.update(job.nbytes)
    return records


# ---- the task ---------------------------------------------------------------------------------------------------
def run_part(job: PartJob) -> PartResult:
    """Read, quantize and write one job's tensors (quantized straight from the page cache while the previous tensor
    is written on a thread and the next is read ahead by the kernel: at most two tensors' outputs alive)."""
    with gc_paused():
        return _run_part(job)


def _run_part(job: PartJob) -> PartResult:
    reader = TensorReader()
    out = PartWriter(job.part)
    wanted = set(job.names)
    records: list[tuple[str, str, float]] = []
    try:
        with ThreadPoolExecutor(1) as writer, ThreadPoolExecutor(1, thread_name_prefix="dsconv-prefetch") as fetch:
            pending = None
            ahead = 0  # sources before this index have been asked for (read-ahead window)
            for j, src in enumerate(job.sources):
                ahead = _read_ahead(lambda info: fetch.submit(reader.prefetch, info), job.sources, j, ahead)
                if _by_rows(src, wanted, job.params.method):
                    if pending is not None:
                        pending.result()  # output in order
                        pending = None
                    records.append(_rtn_rows(reader, src, job.params, out, wanted))
                    continue
                items = _produce(reader, src, job.params, records)
                if pending is not None:
                    pending.result()  # one write in flight: bounded memory, output in order
                pending = writer.submit(_write_items, out, [(n, a) for n, a in items if n in wanted], reader, src)
                del items
            if pending is not None:
                pending.result()
        return PartResult(out.close(), records)
    except BaseException:
        out.abort()
        raise
    finally:
        reader.close()


# Input bytes read ahead of the tensor being quantized, by a helper thread (TensorReader.prefetch): with only the
# kernel's read-ahead (madvise WILLNEED on the rounding thread) a cold disk and the rounding took turns more than
# they overlapped. Page-cache pages, not this process's memory.
READ_AHEAD_BYTES = 256 << 20


def _read_ahead(ask: Callable[[TensorInfo], Any], sources: tuple[Source, ...], j: int, ahead: int) -> int:
    """``ask`` for the sources after ``j`` until READ_AHEAD_BYTES are requested beyond it (always the next one);
    returns the index of the first source not yet asked for."""
    ahead = max(ahead, j + 1)
    window = sum(s.weight.nbytes for s in sources[j + 1:ahead])
    while ahead < len(sources) and (ahead == j + 1 or window < READ_AHEAD_BYTES):
        ask(sources[ahead].weight)
        window += sources[ahead].weight.nbytes
        ahead += 1
    return ahead


def _by_rows(src: Source, wanted: set[str], method: str) -> bool:
    """A linear stored as is (not FP8, viewable) and rounded to nearest streams one row block at a time
    (weights.rtn_linear_into); searched scales (`mse`) need the whole weight (`_produce`)."""
    return (method == "rtn" and src.lp is not None and src.scale is None and src.weight.dtype in VIEWABLE and src.weight.numel > 0
            and f"{src.lp.module}.weight" in wanted)


def _rtn_rows(reader: TensorReader, src: Source, params: Params, out: PartWriter,
              wanted: set[str]) -> tuple[str, str, float]:
    """Round-to-nearest of one linear in row blocks straight into the part (memory: a few blocks, not the weight's
    int8 copy); each block's input pages dropped once written. The same bytes and error figure as `_produce`.

    Only the `wanted` components are written: a part boundary may fall between a linear's weight and its scales
    (any --max-shard-size can cut there), and the next part's job writes the rest through `_produce`."""
    info, lp = src.weight, src.lp
    row = info.nbytes // max(1, info.shape[0])
    w = reader.array(info)
    bias = reader.read(src.bias) if src.bias is not None else None
    try:
        err = rtn_linear_into(w, lp, lp.qtype, params.group_size, params.deq_dtype, bias, out.write_chunks,
                              lambda name, arr: out.write(name, arr) if name in wanted else None, release=lambda a, b: reader.release_range(info, a * row, b * row))
    finally:
        del w
        reader.advise(info, getattr(mmap, "MADV_DONTNEED", 4))
    return lp.module, lp.qtype, err


def _write_items(out: PartWriter, items: list[tuple[str, Any]], reader: TensorReader, src: Source) -> None:
    for name, arr in items:
        if isinstance(arr, TensorInfo):  # kept as stored: a copy in the kernel, as the shard writer copies
            out.write_regions(name, [Region(str(arr.file), arr.start, arr.nbytes)])
        else:
            out.write(name, arr)
    reader.advise(src.weight, getattr(mmap, "MADV_DONTNEED", 4))


def _produce(reader: TensorReader, src: Source, params: Params, records: list) -> list[tuple[str, Any]]:
    """The (name, array) pairs of one source, in the output's order; a float kept as stored is its TensorInfo
    (copied in the kernel when written)."""
    info = src.weight
    if src.lp is None:
        if src.scale is None and info.dtype == src.out_dtype:
            return [(info.name, info)]
        t = dequant_fp8_block(reader.read(info), reader.read(src.scale), params.fp8_block) \
            if src.scale is not None else reader.read(info)
        return [(info.name, as_float(t, src.out_dtype))]
    lp = src.lp
    if src.scale is not None:
        t = dequant_fp8_block(reader.read(info), reader.read(src.scale), params.fp8_block)
    elif info.dtype in VIEWABLE and info.numel:
        t = reader.array(info) if params.method == "rtn" else reader.view(info)
    else:
        t = reader.read(info)
    q, scale = quantize_weight(lp, t, params, None, 0.0)  # type: ignore[arg-type]  # Params has what it reads
    records.append((lp.module, lp.qtype, sampled_weight_error(t, q, scale)))
    bias = reader.read(src.bias) if src.bias is not None else None
    return list(emit_linear(lp.module, lp.qtype, LinearResult(q=q, scale=scale, bias=bias), params.deq_dtype,
                            chunks=lp.scale_bias_chunks))

