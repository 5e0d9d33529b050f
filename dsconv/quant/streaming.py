"""The weight-only path of `dsconv quantize` (w8a16, w8a8_dynamic, w4a16 with round-to-nearest): nothing depends on
activations, so tensors stream from the checkpoint straight into the output, one tensor in memory and the next one
read ahead."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from dsconv.checkpoint import Checkpoint
from dsconv.quant.formats.msmodelslim import LinearResult
from dsconv.quant.output import QuantWriter
from dsconv.quant.plan import QuantPlan
from dsconv.quant.schemes import dequant_weight, relative_error
from dsconv.quant.stats import LinearRecord
from dsconv.quant.weights import quantize_weight

ERROR_SAMPLE_ROWS = 256  # rows used to estimate a big tensor's relative error


def weight_only(ck: Checkpoint, plan: QuantPlan, qw: QuantWriter, progress: bool = True) -> dict[str, LinearRecord]:
    """Round-to-nearest without activations: tensors stream in output order, quantized straight from the page cache
    (`Checkpoint.view`) while the previous tensor is written (pwrite + sha256, both outside the GIL) and the next one is
    read ahead by the kernel. At most two tensors' outputs are alive at once."""
    from tqdm import tqdm

    weights = {lp.weight: lp for lp in plan.linears.values()}
    order = [n for n in ck.names() if n in weights or n in plan.floats]
    records: dict[str, LinearRecord] = {}
    total = sum(ck.info(n).nbytes for n in order)
    with ThreadPoolExecutor(1) as writer, tqdm(total=total, unit="B", unit_scale=True, desc="quantize",
                                                disable=None if progress else True, leave=False) as bar:
        pending = None
        done: list[str] = []
        for j, name in enumerate(order):
            if j + 1 < len(order):
                ck.prefetch(order[j + 1])
            t = ck.view(name)
            lp = weights.get(name)
            if lp is None:
                job = (qw.float, name, t)
            else:
                q, scale = quantize_weight(lp, t, plan, None, 0.0)
                records[lp.module] = LinearRecord(lp.module, lp.qtype, _sampled_error(t, q, scale))
                job = (qw.linear, lp, LinearResult(q=q, scale=scale, bias=ck.load(lp.bias) if lp.bias else None))
            if pending is not None:
                pending.result()  # one write in flight: bounded memory, output in order
                for n in done:
                    ck.release(n)
                done = []
            pending = writer.submit(*job)
            done.append(name)
            bar.update(ck.info(name).nbytes)
            del t, job
        if pending is not None:
            pending.result()
        for n in done:
            ck.release(n)
    return records


def _sampled_error(w: torch.Tensor, q: np.ndarray, scale: np.ndarray) -> float:
    """Relative Frobenius error, from evenly spaced rows for big tensors (the estimate is within a few percent of
    the exact figure; the exact one would cost a second bf16 widening of the whole tensor)."""
    n = w.shape[0]
    step = max(1, n // ERROR_SAMPLE_ROWS)
    rows = slice(0, n, step)
    return relative_error(w[rows], dequant_weight(q[rows], scale[rows]))
