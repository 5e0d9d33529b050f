"""`dsconv export --format safetensors`: rewrite a checkpoint in another dtype, FP8 block-scaled weights dequantized.

Plan from headers, then stream. The output keeps the input's layout (one part per input part, same names, same tensor
order, an index of the same name) minus the FP8 `weight_scale_inv` scales, folded into their weights. Each tensor is
converted and written in bounded pieces (`write_converted`: stripes of FP8 block rows, 64 MiB chunks of cast or kept
tensors), so memory is a few pieces, and the next stripes' arithmetic overlaps the previous ones' pwrite + hash. Per
tensor: an FP8 weight (with its scale, wherever the index puts it) is dequantized to the target dtype; other floating
tensors are cast, except float32 router tensors (DeepSeek's `e_score_correction_bias`), which stay float32 as
transformers keeps them; integer and bool tensors are unchanged. config.json loses `quantization_config` and gets the
new dtype; tokenizer and generation files are copied. Fused MoE checkpoints are written with the per-expert names the
reader presents (transformers' default layout, which it loads as well).

The FP8 kernel (`io/fp8_kernel.py`, which the reader uses too when quantize reads FP8) is exact (bit-identical to
`fp8.to(float32) * scale` rounded to the target dtype): each block column's 256 possible results are computed once and
every element is a table lookup. It runs on 128-row stripes, two threads, each stripe's input pages dropped once it is
converted. NaN codes are refused per stripe on the bytes; NaN/Inf checks of the output are skipped for FP8 stripes
whose block scales prove them finite. `pipeline=True` (whole tensors, one written while the next converts) is the baseline
benchmarks/bench_export.py measures the streamed path against.
"""
from __future__ import annotations

import math
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dsconv.convert import DTYPES
from dsconv.errors import UserError
from dsconv.families.roles import Role
from dsconv.io.passthrough import check_finite
from dsconv.io.tensorfile import float_view
from dsconv.runtime.process import gc_paused, peak_rss_bytes
from dsconv.tensors import FLOAT_DTYPES, FP8_DTYPES, PRECISIONS, config_with_dtype, numpy_dtype, safetensors_dtype

INDEX_SUFFIX = ".safetensors.index.json"
STRIPE_ROWS = 128


@dataclass(frozen=True)
class TensorPlan:
    name: str
    in_dtype: str
    out_dtype: str
    shape: tuple[int, ...]
    action: str  # "dequantize" | "cast" | "keep"
    scale: str | None = None


@dataclass
class PartPlan:
    file: str  # output file name (the input part's name)
    tensors: list[TensorPlan] = field(default_factory=list)


@dataclass
class RewritePlan:
    dtype: str
    parts: list[PartPlan]
    dropped: list[str]  # scales folded into their weights
    index_name: str | None
    bytes_in: int
    bytes_out: int

    @property
    def tensors(self) -> list[TensorPlan]:
        return [t for p in self.parts for t in p.tensors]

    def counts(self) -> dict[str, int]:
        out = {"dequantize": 0, "cast": 0, "keep": 0}
        for t in self.tensors:
            out[t.action] += 1
        return out


def plan_rewrite(ck, dtype: str) -> RewritePlan:
    """What will be written, from headers alone; refuses inputs it cannot rewrite faithfully."""
    from dsconv.tensors import DTYPE_SIZES

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    if ck.is_quantized:
        raise UserError(f"{ck.root} is a quantized (msModelSlim layout) output",
                        hint="--format safetensors rewrites float or FP8 checkpoints; export the original model")
    target = PRECISIONS[dtype]
    scales = set(ck.fp8_scales.values())
    for name, role in ck.roles.items():
        if role.param == "weight_scale_inv" and name not in scales:
            raise UserError(f"tensor {name} ({ck.info(name).file.name}) is a weight_scale_inv without an FP8 weight",
                            hint="the checkpoint is inconsistent; re-download it")
    by_file: dict[Path, list] = {}
    for name in ck.names():
        info = ck.info(name)
        by_file.setdefault(info.file, []).append(info)
    parts: list[PartPlan] = []
    bytes_in = bytes_out = 0
    for f in ck.files:
        infos = sorted(by_file.get(f, []), key=lambda i: i.start)
        fname = f.name if f.name.endswith(".safetensors") else f.stem + ".safetensors"
        part = PartPlan(fname)
        for info in infos:
            bytes_in += info.nbytes
            if info.name in scales:
                continue
            role = ck.role(info.name)
            if info.dtype in FP8_DTYPES:
                if info.name not in ck.fp8_scales:  # the reader already refuses this; keep the guard local
                    raise UserError(f"FP8 weight {info.name} has no weight_scale_inv",
                                    hint="a weight without its scale cannot be dequantized")
                t = TensorPlan(info.name, info.dtype, target, info.shape, "dequantize", ck.fp8_scales[info.name])
            elif info.dtype in FLOAT_DTYPES:
                keep_f32 = role.role is Role.ROUTER and info.dtype == "F32"
                out = info.dtype if keep_f32 else target
                t = TensorPlan(info.name, info.dtype, out, info.shape, "keep" if out == info.dtype else "cast")
            else:
                t = TensorPlan(info.name, info.dtype, info.dtype, info.shape, "keep")
            bytes_out += math.prod(t.shape) * DTYPE_SIZES[t.out_dtype]
            part.tensors.append(t)
        if part.tensors:
            parts.append(part)
    indexes = sorted(ck.root.glob("*" + INDEX_SUFFIX))
    index_name = indexes[0].name if indexes else ("model" + INDEX_SUFFIX if len(parts) > 1 else None)
    return RewritePlan(dtype, parts, sorted(scales), index_name, bytes_in, bytes_out)


# ---- the kernel ----------------------------------------------------------------------------------------------
def dequantize_fp8(weight, scale_inv, block: tuple[int, int], out_dtype, name: str = "weight", threads: int = 2):
    """FP8 e4m3 [out, in] x float32 scales [ceil(out/b0), ceil(in/b1)] -> `out_dtype`, exactly as
    `weight.float() * scale` rounded once. Falls back to the reference loop for e5m2 or huge scales."""
    import torch

    out = torch.empty(tuple(weight.shape), dtype=out_dtype)
    out_np = float_view(out) if out.numel() else None
    for r0, r1, stripe in iter_dequantized_fp8(weight, scale_inv, block, out_dtype, name, threads, out=out_np):
        if stripe is not None and out_np is not None and not np.may_share_memory(stripe, out_np):
            out_np[r0:r1] = stripe.view(out_np.dtype)
    return out


def iter_dequantized_fp8(weight, scale_inv, block: tuple[int, int], out_dtype, name: str = "weight",
                         threads: int = 2, out: np.ndarray | None = None, map_rows=None, drop_rows=None):
    """`dequantize_fp8` one stripe of whole block rows at a time, in row order: `(row_start, row_stop, array)`, the
    array in `out_dtype`'s numpy form (bfloat16 through ml_dtypes) and written into `out[row_start:row_stop]` when
    `out` is given. Stripes are computed by `threads` threads at most a few ahead of the consumer, so a writer
    consuming them in order overlaps pwrite + hash with the arithmetic and never holds the whole output; the kernel
    is the module docstring's. A NaN code (0x7F/0xFF) is a UserError naming the first stripe holding one.
    `map_rows(r0, r1)` / `drop_rows(r0, r1)`, when given, map a stripe's input pages before it is read and drop them
    once it is (a view of an mmap; on the stripe's own thread, not the consumer's). Without `out`, a yielded array is
    valid until the next one is asked for (its buffer is reused)."""
    import torch

    from dsconv.io import fp8_kernel
    from dsconv.io.tensorfile import dequant_fp8_block
    from dsconv.runtime.threads import ordered_map

    scale = scale_inv.to(torch.float32)
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or not fp8_kernel.fits(scale.numpy()):
        whole = dequant_fp8_block(weight, scale, block, out_dtype=out_dtype)
        yield 0, whole.shape[0], float_view(whole) if whole.numel() else None
        return
    rows, cols = weight.shape
    b0, b1 = block
    if tuple(scale.shape) != (math.ceil(rows / b0), math.ceil(cols / b1)):
        raise UserError(f"{name}_scale_inv has shape {list(scale.shape)} for a {list(weight.shape)} weight in "
                        f"{b0}x{b1} blocks", hint="the scale does not belong to this weight")
    scale_np = scale.numpy()
    codes = weight.view(torch.uint8).numpy()
    np_out = numpy_dtype(safetensors_dtype(out_dtype))
    # a stripe never straddles a block row: a divisor of it, or whole block rows
    step = STRIPE_ROWS if b0 % STRIPE_ROWS == 0 else b0 * max(1, STRIPE_ROWS // b0)

    def stripe(r0: int):
        if map_rows is not None:
            map_rows(r0, min(rows, r0 + step))
        x = codes[r0:r0 + step]
        if fp8_kernel.nan_codes(x):
            raise UserError(f"FP8 weight {name} holds NaN codes (rows from {r0})",
                            hint="the checkpoint is damaged; re-download it")
        dst = out[r0:r0 + x.shape[0]] if out is not None else _STRIPES.take(x.size * np_out.itemsize, np_out, x.shape)
        fp8_kernel.dequantize_rows(x, scale_np, block, r0, dst)
        if drop_rows is not None:
            drop_rows(r0, r0 + x.shape[0])
        return r0, r0 + x.shape[0], dst

    for r0, r1, dst in ordered_map(stripe, range(0, rows, step), threads if rows > step else 1):
        yield r0, r1, dst
        if out is None:
            _STRIPES.give(dst)  # the consumer is done with it


class _Buffers:
    """Output stripes in reused byte buffers: a stripe is handed out by `take` and comes back by `give` once the
    consumer has written it. At most `keep` idle buffers stay (a few stripes: threads + 2 are in flight)."""

    def __init__(self, keep: int = 4) -> None:
        self.keep, self.idle, self.lock = keep, [], threading.Lock()

    def take(self, nbytes: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        with self.lock:
            i = next((i for i, b in enumerate(self.idle) if b.size >= nbytes), None)
            buf = self.idle.pop(i) if i is not None else None
        if buf is None:
            buf = np.empty(nbytes, np.uint8)
        return buf[:nbytes].view(dtype).reshape(shape)

    def give(self, arr: np.ndarray) -> None:
        base = arr.base
        while isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        if isinstance(base, np.ndarray) and base.dtype == np.uint8 and base.ndim == 1:
            with self.lock:
                self.idle.append(base)
                if len(self.idle) > self.keep:  # by index: list.remove compares arrays with ==
                    del self.idle[min(range(len(self.idle)), key=lambda i: len(self.idle[i]))]


_STRIPES = _Buffers()


def write_converted(write_chunks, ck, t: TensorPlan, threads: int = 2) -> int:
    """One planned tensor converted and written through `write_chunks(name, chunks)` in bounded pieces, checked for
    NaN/Inf on the way; returns the bytes written. From the checkpoint and the plan entry alone, so a worker can run
    it. FP8: stripes of block rows (`iter_dequantized_fp8`), computed while the previous ones are written; cast and
    kept floats: 64 MiB chunks. Memory is a few stripes or chunks; the bytes are `convert_tensor` + `check_finite`'s."""
    from dsconv.io.passthrough import copy_tensor, first_nonfinite, nonfinite_error
    from dsconv.tensors import DTYPE_SIZES, torch_dtype

    nbytes = math.prod(t.shape) * DTYPE_SIZES[t.out_dtype]
    if t.action != "dequantize":
        copy_tensor(write_chunks, ck, t.name, t.out_dtype, check=ck.root)
        return nbytes
    import torch

    # the FP8 weight as a view of the input (pages dropped stripe by stripe below), so no stage of the tensor is
    # ever whole in memory: not the input, not the output
    viewed = ck.readable_by_path and ck.info(t.name).numel > 0
    w, scale = ck.stored_view(t.name) if viewed else ck.load(t.name), ck.load(t.scale)
    # e4m3 products are finite when every scale is finite and < 2^7 (|x| <= 448, so |x * s| < 57344, finite in bf16,
    # fp16 and fp32): checked once on the scales instead of on every output element
    s = scale.float()
    proven = (w.dtype == torch.float8_e4m3fn and s.numel() > 0 and bool(torch.isfinite(s).all())
              and float(s.abs().max()) < 2.0 ** 7)
    cols = w.shape[1] if w.dim() == 2 else 1

    def stripes():
        paged = viewed and w.dim() == 2
        for r0, r1, arr in iter_dequantized_fp8(
                w, scale, ck.facts.fp8_block or (128, 128), torch_dtype(t.out_dtype), t.name, threads,
                map_rows=(lambda r0, r1: ck.map_rows(t.name, r0, r1)) if paged else None,
                drop_rows=(lambda r0, r1: ck.release_rows(t.name, r0, r1)) if paged else None):
            if arr is None:
                continue
            if not proven:
                bad = first_nonfinite(arr, t.out_dtype)
                if bad is not None:
                    raise nonfinite_error(ck.root, t.name, r0 * cols + bad, float(arr.reshape(-1)[bad]))
            yield arr

    try:
        write_chunks(t.name, stripes())
    finally:
        if viewed:
            ck.release(t.name)
    return nbytes


def convert_tensor(ck, t: TensorPlan, threads: int = 2):
    """One planned tensor, read and converted whole (the pipelined writer's path; `write_converted` streams)."""
    from dsconv.tensors import torch_dtype

    x = ck.load(t.name)
    if t.action == "dequantize":
        scale = ck.load(t.scale)
        return dequantize_fp8(x, scale, ck.facts.fp8_block or (128, 128), torch_dtype(t.out_dtype), t.name, threads)
    if t.action == "cast":
        return x.to(torch_dtype(t.out_dtype))
    return x


class _BackgroundWriter:
    """Writes one tensor on a thread while the caller converts the next. `put` waits until the previous write is
    done, so at most two converted tensors exist at once (the one being written and the one being made)."""

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue()
        self._idle = threading.Semaphore(1)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            ts, name, tensor = item
            del item
            if self._error is None:
                try:
                    ts.write(name, tensor)
                except BaseException as e:  # re-raised in the caller's thread
                    self._error = e
            del tensor
            self._idle.release()

    def put(self, ts, name: str, tensor) -> None:
        self._idle.acquire()
        if self._error is not None:
            self._idle.release()
            raise self._error
        self._q.put((ts, name, tensor))

    def close(self) -> None:
        self._idle.acquire()
        self._q.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


def rewrite_into(out, ck, plan: RewritePlan, progress: bool | None = None, pipeline: bool = False,
                 executor=None) -> None:
    """Stream every planned tensor into `out` (an open OutputDir), then config, index and the small files. With an
    executor (dsconv.executor), each part is a job (convert/cast_parts.py) unless the input is pickled."""
    from tqdm import tqdm

    from dsconv.tensors import TensorSpec

    sets = {}
    for part in plan.parts:
        specs = [TensorSpec(t.name, t.out_dtype, t.shape) for t in part.tensors]
        prefix = part.file[: -len(".safetensors")]
        sets[part.file] = out.tensor_set(specs, prefix=prefix, max_shard_size=sum(s.nbytes for s in specs) + 1)
    bar = tqdm(total=plan.bytes_out, unit="B", unit_scale=True, desc="safetensors", file=sys.stderr,
               disable=(not sys.stderr.isatty()) if progress is None else not progress)
    by_parts = executor is not None and not pipeline and ck.readable_by_path
    writer = _BackgroundWriter() if pipeline else None
    try:
        if by_parts:
            from dsconv.convert.cast_parts import cast_jobs, run_cast_jobs

            jobs = cast_jobs(ck, plan, sets, executor.workers, write_converted)
            run_cast_jobs(executor, jobs, sets, bar)
        for part in (() if by_parts else plan.parts):
            ts = sets[part.file]
            for t in part.tensors:
                if writer is None:
                    bar.update(write_converted(ts.write_chunks, ck, t))
                    continue
                tensor = convert_tensor(ck, t)
                check_finite(t.name, tensor, ck.root)
                writer.put(ts, t.name, tensor)
                bar.update(tensor.numel() * tensor.element_size())
                del tensor
    finally:
        if writer is not None:
            writer.close()
        bar.close()
    if plan.index_name:
        weight_map = {t.name: p.file for p in plan.parts for t in p.tensors}
        out.write_json(plan.index_name, {"metadata": {"total_size": plan.bytes_out},
                                         "weight_map": dict(sorted(weight_map.items()))})
    out.write_json("config.json", rewritten_config(ck.config, plan.dtype))
    for f in ck.copy_files():
        if f.name != "config.json":
            out.copy_in(f)


def rewritten_config(config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """config.json of the rewritten checkpoint: no quantization_config, the new dtype under the keys present."""
    new = config_with_dtype(config, dtype)
    new.pop("quantization_config", None)
    return new


def export_safetensors(model_dir: Path, output: Path, *, dtype: str = "bf16", force: bool = False,
                       allow_pickle: bool = False, dry_run: bool = False, progress: bool | None = None,
                       stage: str = "safetensors", pipeline: bool = False, execution=None) -> dict[str, Any]:
    """Rewrite `model_dir` into `output` in `dtype` (FP8 dequantized); returns a JSON-ready summary."""
    from dsconv.checkpoint import Checkpoint
    from dsconv.executor import make_executor
    from dsconv.io.writer import OutputDir

    t0 = time.perf_counter()
    model_dir, output = Path(model_dir), Path(output)
    ck = Checkpoint.open(model_dir, allow_pickle=allow_pickle)
    plan = plan_rewrite(ck, dtype)
    summary: dict[str, Any] = {
        "format": "safetensors", "model": str(model_dir), "output": str(output), "dtype": dtype,
        "parts": [p.file for p in plan.parts], "parts_dropped": len(ck.files) - len(plan.parts),
        "index": plan.index_name, "tensors": len(plan.tensors),
        **plan.counts(), "scales_dropped": len(plan.dropped), "bytes_in": plan.bytes_in, "bytes_out": plan.bytes_out,
        "largest_tensor_bytes": max((ck.info(t.name).nbytes for t in plan.tensors), default=0),
    }
    if dry_run:
        summary["dry_run"] = True
        return summary
    with ck, OutputDir(output, stage=stage, inputs=[model_dir], force=force, input_identity=ck.identity(),
                       options={"dtype": dtype, "format": "safetensors"}) as out:
        # gc paused: a few objects per stripe, and every collection would walk all of torch's
        with make_executor(execution) as ex, gc_paused():
            rewrite_into(out, ck, plan, progress=progress, pipeline=pipeline, executor=ex)
            summary["execution"] = ex.summary()
    seconds = time.perf_counter() - t0
    summary.update(seconds=round(seconds, 3), throughput_in_mb_s=round(plan.bytes_in / seconds / 1e6, 1),
                   peak_rss_bytes=peak_rss_bytes())
    return summary


def render(summary: dict[str, Any]) -> str:
    from dsconv.tensors import human_bytes as hb

    lines = [f"{'planned' if summary.get('dry_run') else 'wrote'} {summary['output']}: {summary['tensors']} tensors "
             f"in {len(summary['parts'])} part(s) as {summary['dtype']} "
             f"({summary['dequantize']} FP8 dequantized, {summary['cast']} cast, {summary['keep']} kept, "
             f"{summary['scales_dropped']} scales dropped"
             + (f"; {summary['parts_dropped']} input part(s) held only scales and are gone" if summary['parts_dropped']
                else "") + ")",
             f"  {hb(summary['bytes_in'])} in -> {hb(summary['bytes_out'])} out; "
             f"largest tensor {hb(summary['largest_tensor_bytes'])}"]
    if "seconds" in summary:
        lines.append(f"  {summary['seconds']:.1f} s ({summary['throughput_in_mb_s']:.0f} MB/s of input), "
                     f"peak RSS {hb(summary['peak_rss_bytes'])}")
    return "\n".join(lines)
