"""How a layer's calibration forward is cut into jobs (forward_jobs.Forward.runs).

A job is a list of pieces in calibration order, each (sample indices, padded length). Two cuts:

* runs of whole batches, about equal in real tokens, one per worker and at most one per batch - what every executor
  gets while there are at least as many batches as nodes, and always under GPTQ (its per-batch X^T X must not be cut
  into partial sums);
* with more nodes than batches (on Ray: 5 calibration batches, 8 nodes), one job per node over an equal share of
  the padded tokens: a batch may be cut into parts, each padded to its whole batch's length, so every sample's rows
  are computed as in the serial run (per-row matmuls give the same bits whatever the row count; attention and norms
  are per sample). Without it a cluster larger than the batch count had nodes idle through every forward.
"""
from __future__ import annotations

from typing import Any

import numpy as np

Piece = tuple[list[int], int]   # (calibration sample indices, padded length)
Job = list[Piece]


def whole_batches(acts: Any) -> Job:
    """Every batch of `acts` (context.LayerActivations), padded to its longest sample: the serial pass."""
    return [(b, max(int(acts.lengths[j]) for j in b)) for b in acts.batches]


def cut_jobs(acts: Any, workers: int, node_cpus: int, whole_only: bool = False) -> list[Job]:
    """The forward's jobs for `workers` workers on nodes of `node_cpus` CPUs (see the module docstring)."""
    whole = whole_batches(acts)
    nb = len(whole)
    nodes = workers // max(1, node_cpus)
    samples = sum(len(b) for b in acts.batches)
    if nodes > nb and not whole_only and acts.held_tokens is None and samples > 1:
        return sub_batch_jobs(whole, min(nodes, samples))
    if nb < 2:
        return [whole]
    n = min(workers, nb)
    tok = np.cumsum([sum(acts.lengths[j] for j in b) for b in acts.batches])
    cuts = sorted({0, nb, *(min(nb, int(np.searchsorted(tok, tok[-1] * k / n)) + 1) for k in range(1, n))})
    return [whole[a:b] for a, b in zip(cuts, cuts[1:])]


def sub_batch_jobs(whole: Job, jobs: int) -> list[Job]:
    """The samples, in calibration order, cut into `jobs` contiguous runs of about equal padded tokens (a sample
    costs its batch's padded length); each run's samples grouped by batch, every part padded as its whole batch."""
    flat = [(b, j, pad) for b, (samples, pad) in enumerate(whole) for j in samples]
    cost = np.cumsum([pad for _, _, pad in flat])
    cuts = sorted({0, len(flat), *(int(np.searchsorted(cost, cost[-1] * k / jobs)) + 1 for k in range(1, jobs))})
    out = []
    for a, b in zip(cuts, cuts[1:]):
        pieces: Job = []
        last = None
        for batch, j, pad in flat[a:b]:
            if batch != last:
                pieces.append(([], pad))
                last = batch
            pieces[-1][0].append(j)
        out.append(pieces)
    return out
