"""A layer's calibration forward split over the calibration batches, as executor jobs.

Why this cut: the calibrated path propagates float activations layer by layer, so once layer i's input rows are in
the driver (`LayerActivations.h`), its batches are independent - each job pushes a contiguous run of batches through
a copy of layer i and returns what the driver's hooks would have gathered, per pass:

* observation (an algorithm's probe forward of its own: SmoothQuant's where its statistics cannot follow its folds):
  the observers it asks for (algorithm.Observer: each rebuilt in the job from its `spec()`, its `partial()` merged
  by the driver's `merge()`), the routed experts returning zeros;
* statistics (`Calibrator.layer`): each distinct linear input's `InputStats` (min/max observer, row sample, GPTQ's
  Hessian and held-out rows), the MoE layer's routed tokens (`ExpertRecorder`), the layer's output rows, and the
  algorithms' observers riding on it (smoothing probes, KV-cache statistics);
* GPTQ's propagation: the layer with its quantized weights over every batch, output rows only.

Exactness: the batches are the driver's (`LayerActivations.batches`) whatever the worker count, and the driver
merges the jobs' partials in batch order. With more nodes than batches (on Ray: 5 batches, 8 nodes) a job may hold
part of a batch, padded to its whole batch's length: each sample's rows are then computed as in the whole batch -
per-row matmuls give the same bits whatever the row count (measured at DeepSeek-V3's widths, 1 and 2 threads),
attention and norms are per sample - and GPTQ, whose per-batch X^T X would be cut into partial sums, keeps whole
batches. Min/max are order-free; row samples are taken by global token index, so each job
starts its samplers at the token count of the batches before it (checked when merging, never assumed silently) and
the concatenated samples are the serial ones. Float sums are not order-free: a GPTQ Hessian comes back as one X^T X
per batch (k^2 float32 each: memory a worker pays for exactness) and the driver adds them in batch order, as the
serial accumulator does. awq's scale search and the histogram observers (--act-method percentile/mse) stay on the
serial forward, and the run says so (`summary()`, in the --json output). A job runs on the CPUs the executor gives
it (`Executor.cpus_per_job`): one, unless there are fewer jobs than workers - on Ray, 5 calibration batches on 8
nodes of 2 CPUs get a node each, the cluster's otherwise idle cores. The driver's serial loop keeps torch's threads.
The forward's bits were measured equal with 1 and 2 threads (layers of the medium DeepSeek-shaped model,
DeepSeek-V3-sized matmuls, SDPA, X^T X), and tests/test_calib_jobs.py compares the serial bytes with split runs of
one and of two threads per job on every run of the slow suite.

Where it splits (`SPLIT_ENV`): over Ray workers by default (other nodes' cores); over local processes only when
asked. On one host torch's threads already use every core, and splitting over processes measured slower: Qwen
0.5B `--bits 8` on 2 cores, forward 248 s split over 2 single-threaded jobs (6 batches, so uneven) against a whole
run of 246 s threaded.

Transport: the layer's input rows as one .npy per layer in the jobs directory (workers gather their batches' rows
from it by mmap), the parameters the driver changed since materialising the layer (smoothing folds, GPTQ's quantized
weights; tracked by torch's version counters, so the driver changes them in place, never through `.data`, which torch
does not version) as a torch.save'd dict of tensors; the layer itself is materialised by each job from the
checkpoint by path (Skeleton). Never a pickled module.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

import dsconv.executor as dexec
from dsconv.quant.algorithms.gptq import HessianAccumulator
from dsconv.quant.algorithms.observers import MinMaxObserver
from dsconv.quant.calibrate.calib_jobs import JOB_THREADS, Context, Dispatch, job_threads, open_job_checkpoint
from dsconv.quant.calibrate.context import (CalibContext, LayerActivations, forward_batch, forward_matmuls,
                                            padded_batch)
from dsconv.quant.calibrate.forward_cuts import Job, cut_jobs, whole_batches
from dsconv.quant.calibrate.algorithm import JobEnv, Observer, observer_class
from dsconv.quant.calibrate.hooks import ExpertRecorder, LinearHooks, RowMask
from dsconv.runner.layers import Skeleton, install_forward
from dsconv.quant.calibrate.stats import InputStats
from dsconv.quant.plan.plan import LinearPlan

SPLIT_ENV = "DSCONV_FORWARD_SPLIT"  # 1: split over local processes too; 0: never split; unset: Ray only
HESSIAN_PARTS_MAX = 4 * 2**30  # bytes of GPTQ's per-batch X^T X parts one forward job may hold


@dataclass(frozen=True)
class ForwardJob:
    ctx: Context
    layer: int
    kind: str                        # "observe" (observers alone) | "stats" (statistics, outputs) | "plain" (outputs)
    first: int                       # 0 for the job holding the first calibration tokens (it records which modules
                                     # read each norm)
    batches: list[list[int]]         # calibration sample indices per batch (or part of a batch), in calibration order
    pads: list[int]                  # each batch's padded length: its whole batch's, for a part of one
    lengths: np.ndarray              # tokens per calibration sample
    starts: np.ndarray               # first token row of each sample in the layer input
    hidden: str                      # .npy of the layer's input rows [tokens, hidden] float32
    state: str | None                # torch.save'd {layer parameter name: tensor} the driver changed
    offset: int                      # real tokens in the batches before this job's
    held: np.ndarray | None          # per token: from a held-out prompt (GPTQ's choice), else None
    held_offset: int                 # held-out tokens in the batches before this job's
    names: dict[str, Any]            # what is hooked: "targets" (statistics) by in-memory name, "observers" by key
    write: bool                      # return the layer's output rows
    threads: int = JOB_THREADS       # torch threads: the CPUs the executor gave it (Executor.cpus_per_job)


@dataclass
class ForwardResult:
    pos: torch.Tensor | None = None  # token rows of the layer input that `y` replaces
    y: torch.Tensor | None = None
    parts: dict[str, Any] = field(default_factory=dict)  # each observer's partial(), by its key
    stats: list[InputStats] = field(default_factory=list)
    group: dict[str, int] = field(default_factory=dict)  # linear -> index in `stats` (shared inputs share one)
    recorded: tuple | None = None    # ExpertRecorder's (hidden, index, weights, pos) of its batches
    forward_s: float = 0.0
    cpu_s: float = 0.0               # the job's CPU seconds (all its threads': its compute, whatever the load)
    threads: int = 1                 # torch's threads as the job ran


def serial_reason(run: CalibContext | None, executor: Any = None) -> str | None:
    """Why this run's forward stays in the driver (None: it splits)."""
    want = os.environ.get(SPLIT_ENV, "")
    if want == "0":
        return f"{SPLIT_ENV}=0"
    if executor is not None and executor.workers > 1 and executor.name != "ray" and want != "1":
        return (f"local processes share this host's cores, which the forward's threads already use "
                f"({SPLIT_ENV}=1 splits it anyway)")
    if run.plan.method == "awq":
        return "--method awq: its scale search probes the layer in the driver"
    if run.static and run.observer_method != MinMaxObserver.method:
        return f"--act-method {run.opts.act_method}: histogram observers are not merged across jobs"
    return None


class HessianParts(HessianAccumulator):
    """A job's Hessian: each batch's X^T X kept apart (float32, as the accumulator computes it), for the driver to
    add in batch order - one running float sum over the jobs would round differently from the serial one."""

    def __init__(self, k: int, dtype: torch.dtype) -> None:
        self.k, self.dtype, self.tokens = int(k), dtype, 0
        self.parts: list[torch.Tensor] = []

    def update(self, x: Any) -> None:
        t = x.detach().to("cpu", torch.float32).reshape(-1, self.k)
        if t.shape[0]:
            self.parts.append(t.T @ t)
            self.tokens += int(t.shape[0])

    def into(self, acc: HessianAccumulator | None = None) -> HessianAccumulator:
        """Add the parts, in order, to `acc` (a new zero accumulator if None): the serial running sum."""
        acc = acc if acc is not None else HessianAccumulator(self.k, self.dtype)
        for p in self.parts:
            acc.sum += p.to(acc.sum.dtype)
        acc.tokens += self.tokens
        return acc


# ---- the task side ---------------------------------------------------------------------------------------------
_SKELETONS: dict[str, Any] = {}


def run_forward(job: ForwardJob) -> ForwardResult:
    """Task: layer i (materialised from the checkpoint, the driver's changes applied) over a run of batches, with
    the same hooks as the driver's pass; their partial statistics and the output rows returned."""
    ctx, i = job.ctx, job.layer
    with job_threads(job.threads):
        ck, _ = open_job_checkpoint(ctx)
        sk = _SKELETONS.get(ctx.key)
        if sk is None:  # its own, never the driver's (whose layer i holds the driver's changes) even inline
            _SKELETONS.clear()
            sk = _SKELETONS[ctx.key] = Skeleton(ck)
        layer = sk.materialise(i)
        try:
            return _run(job, sk, layer)
        finally:
            sk.release(i)


def _run(job: ForwardJob, sk: Any, layer: nn.Module) -> ForwardResult:
    t, c = time.perf_counter(), time.process_time()
    if job.state is not None:
        params = dict(layer.named_parameters())
        for name, value in torch.load(job.state, weights_only=True).items():
            params[name].copy_(value)
    mods = {n: m for m, n in sk.module_names.items()}
    experts = sk.experts_module(job.layer)
    rows = RowMask()
    n = job.names
    res = ForwardResult()
    hooks = recorder = None
    env = JobEnv(sk, layer, mods, rows, job.first, job.offset, job.ctx.tokens)
    observers = {key: observer_class(key).install(spec, env) for key, spec in n.get("observers", {}).items()}
    cache = next((o.cache for o in observers.values() if o.cache is not None), None)
    if job.kind == "observe":
        if experts is not None:
            install_forward(experts, lambda h, idx, wts: torch.zeros_like(h))
    elif job.kind == "stats":
        targets = {mods[m]: lp for m, lp in n["targets"].items()}

        def make(lp: LinearPlan) -> InputStats:
            st = job.ctx.stats.new(lp.k, lp.module)
            st.sampler.start_at(job.offset)
            if st.hessian is not None:
                st.hessian = HessianParts(st.k, st.hessian.sum.dtype)
            if st.held is not None:
                st.held.start_at(job.held_offset)
            return st

        hooks = LinearHooks(targets, make, rows)
        if experts is not None:
            recorder = ExpertRecorder(rows)
            install_forward(experts, recorder)
    h = np.load(job.hidden, mmap_mode="r")
    held = None if job.held is None else torch.from_numpy(job.held)
    pos, ys = [], []
    for samples, pad in zip(job.batches, job.pads):
        x, idx, mask = padded_batch(h, samples, job.lengths, job.starts, pad)
        rows.set(mask)
        rows.held = None if held is None else held[idx[mask]]
        if recorder is not None:
            recorder.flat_index = idx.reshape(-1)
        with forward_matmuls(job.ctx.opts, sk, layer):
            y = layer(x, **sk.layer_inputs(x, layer, cache))
        y = y[0] if isinstance(y, tuple) else y
        if job.write:
            pos.append(idx[mask])
            ys.append(y[mask])
        if hooks is not None:
            hooks.end_batch()
        for o in observers.values():
            o.end_batch()
    del h
    if job.write:
        res.pos, res.y = torch.cat(pos), torch.cat(ys)
    names = sk.module_names
    for key, o in observers.items():
        o.remove()
        res.parts[key] = o.partial(names)
    if hooks is not None:
        hooks.remove()
        index: dict[int, int] = {}
        for mod, st in hooks.group.items():
            if id(st) not in index:
                index[id(st)] = len(res.stats)
                res.stats.append(st)
            res.group[names[mod]] = index[id(st)]
        if recorder is not None and recorder.parts:
            res.recorded = recorder.take()
    res.forward_s, res.cpu_s = time.perf_counter() - t, time.process_time() - c
    res.threads = torch.get_num_threads()
    return res


# ---- the driver side -------------------------------------------------------------------------------------------
class Forward:
    """A layer's forward passes over the calibration batches: split into jobs where the run allows it (see the
    module docstring), else the serial loop in the driver. Reads and writes `acts` (the layer's input rows become
    its output rows); `forward_s` sums the seconds of every forward, the driver's and the jobs'."""

    def __init__(self, run: CalibContext, acts: LayerActivations, dispatch: Dispatch) -> None:
        self.run, self.acts, self.d = run, acts, dispatch
        self.forward_s = 0.0
        self.reason = serial_reason(run, dispatch.ex)
        # the pass's jobs (forward_cuts.cut_jobs; a single job: the serial loop in the driver). The cut is the run's,
        # not a layer's (batches, workers and nodes do not change): made once, and the CPUs per job with it (on Ray
        # both ask the cluster for its nodes)
        self.runs: list[Job] = self._cut()
        if self.reason is None and len(self.runs) > 1:
            self.reason = self._hessian_budget()
            if self.reason:
                self.runs = [whole_batches(acts)]
        self._cpus = dispatch.ex.cpus_per_job(len(self.runs)) if len(self.runs) > 1 else 1
        self.layer_i: int | None = None
        self.versions: dict[str, tuple[int, int]] = {}
        self.h_path: str | None = None
        self.jobs_per_pass: list[int] = []
        self.job_threads = 0             # the most torch threads a job ran with
        self.wall = self.cpu = self.cpu_critical = 0.0
        self._job_cpu: list[float] = []

    def summary(self) -> dict[str, Any]:
        """How the forward ran (the --json output): jobs per pass, or why it stayed serial."""
        split = max(self.jobs_per_pass, default=1)
        return {"split": split > 1, "jobs_per_pass": split, "batches": len(self.acts.batches),
                "threads_per_job": self.job_threads or None, "serial_reason": self.reason}

    def serial_batch(self, layer: nn.Module, samples: list[int], write: bool,
                     recorder: ExpertRecorder | None = None, cache: Any = None) -> None:
        """One batch through the layer in the driver (context.forward_batch), timed."""
        t = time.perf_counter()
        with forward_matmuls(self.run.opts, self.run.sk, layer):
            forward_batch(self.run.sk, self.acts, layer, samples, write, recorder, cache)
        self.forward_s += time.perf_counter() - t

    def begin(self, i: int, layer: nn.Module) -> None:
        """Layer i was just materialised: remember its parameters' versions (what the driver changes later ships)."""
        self._drop_input()
        self.layer_i = i
        self.versions = {n: (id(p), p._version) for n, p in layer.named_parameters() if not p.is_meta}

    def _hessian_budget(self) -> str | None:
        """GPTQ's per-batch X^T X parts over a job's batches, at most HESSIAN_PARTS_MAX bytes per job (counted per
        linear, so an upper bound); a run above it keeps the forward serial and says so."""
        plan = self.run.plan
        if plan.method != "gptq":
            return None
        per_layer: dict[int | None, int] = {}
        for lp in plan.linears.values():
            if not lp.is_expert:
                per_layer[lp.layer] = per_layer.get(lp.layer, 0) + 4 * lp.k * lp.k
        batches = max(len(job) for job in self.runs)
        need = batches * max(per_layer.values(), default=0)
        if need <= HESSIAN_PARTS_MAX:
            return None
        return (f"--method gptq: per-batch Hessian parts would take up to {need / 2**30:.1f} GiB per job "
                f"(over {HESSIAN_PARTS_MAX / 2**30:.0f} GiB)")

    def _drop_input(self) -> None:
        if self.h_path is not None:
            self.d.dir.joinpath(self.h_path).unlink(missing_ok=True)
            self.h_path = None

    def _cut(self) -> list[Job]:
        ex = self.d.ex
        if self.reason or ex.workers <= 1 or self.d.work < dexec.INLINE_BELOW:
            return [whole_batches(self.acts)]
        return cut_jobs(self.acts, ex.workers, ex.node_cpus(), whole_only=self.run.plan.method == "gptq")

    def _submit(self, i: int, layer: nn.Module, kind: str, names: dict[str, Any], write: bool
                ) -> Iterator[tuple[ForwardJob, ForwardResult]]:
        """Run the pass's jobs; yield (job, result) in batch order as they finish (merged by the caller one at a
        time: the driver never holds every job's partials at once)."""
        acts, d = self.acts, self.d
        if self.h_path is None:
            self.h_path = f"F{i}-hidden.npy"
            np.save(d.dir / self.h_path, acts.h.numpy())
        changed = {n: p.detach().clone() for n, p in layer.named_parameters()
                   if n in self.versions and (id(p), p._version) != self.versions[n]}
        state = None
        if changed:
            state = str(d.dir / f"F{i}-{kind}-state.pt")
            torch.save(changed, state)
        held = None if acts.held_tokens is None else acts.held_tokens.numpy()
        runs, cpus = self.runs, self._cpus
        jobs, offset, held_offset = [], 0, 0
        for k, pieces in enumerate(runs):
            jobs.append(ForwardJob(d.ctx, i, kind, k, [s for s, _ in pieces], [n for _, n in pieces],
                                   np.asarray(acts.lengths), acts.starts, str(d.dir / self.h_path), state, offset,
                                   held, held_offset, names, write, cpus))
            samples = [j for s, _ in pieces for j in s]
            offset += int(sum(acts.lengths[j] for j in samples))
            held_offset += 0 if held is None else int(sum(acts.lengths[j] * bool(held[acts.starts[j]])
                                                          for j in samples))
        self.jobs_per_pass.append(len(jobs))
        try:
            for job, r in zip(jobs, d.ex.map(run_forward, jobs, work_bytes=d.work, cpus=cpus)):
                self.job_threads = max(self.job_threads, r.threads)
                self.forward_s += r.forward_s
                self._job_cpu.append(r.cpu_s)
                if write:  # safe before the other jobs end: they read the layer input from its file
                    acts.h[r.pos] = r.y
                    r.pos = r.y = None
                yield job, r
        finally:
            if state is not None:
                Path(state).unlink(missing_ok=True)
        if write:
            self._drop_input()

    def observe_pass(self, i: int, layer: nn.Module, observers: list[Observer]) -> None:
        """An observation pass over every batch, for `observers` alone (an algorithm's probe forward, or the
        observers of a layer whose outputs an algorithm propagated itself); the caller has the routed experts return
        zeros; nothing is written."""
        cache = next((o.cache for o in observers if o.cache is not None), None)
        with self._pass():
            if len(self.runs) == 1:
                for samples in self.acts.batches:
                    self.serial_batch(layer, samples, write=False, cache=cache)
                    for o in observers:
                        o.end_batch()
                return
            names = self.run.sk.module_names
            by_name = {n: m for m, n in names.items()}
            hooked = {"observers": {o.key: o.spec(names) for o in observers}}
            for job, r in self._submit(i, layer, "observe", hooked, write=False):
                for o in observers:
                    o.merge(r.parts[o.key], job.offset, by_name)

    def stats_pass(self, i: int, layer: nn.Module, hooks: LinearHooks, recorder: ExpertRecorder | None,
                   write: bool, observers: list[Observer] = ()) -> None:
        """The statistics pass over every batch; fills `hooks.group`, `recorder`, the algorithms' `observers`
        (algorithm.Observer, gathered in the same forward) and (with `write`) `acts.h`."""
        cache = next((o.cache for o in observers if o.cache is not None), None)
        with self._pass():
            if len(self.runs) == 1:
                for samples in self.acts.batches:
                    self.serial_batch(layer, samples, write=write, recorder=recorder, cache=cache)
                    hooks.end_batch()
                    for o in observers:
                        o.end_batch()
                return
            names = self.run.sk.module_names
            by_name = {names[m]: m for m in hooks.targets}
            targets = {names[m]: lp for m, lp in hooks.targets.items()}
            base: list[InputStats] = []
            group: dict[str, int] = {}
            hooked = {"targets": targets, "observers": {o.key: o.spec(names) for o in observers}}
            every = {n: m for m, n in names.items()}
            for job, r in self._submit(i, layer, "stats", hooked, write):
                for o in observers:
                    o.merge(r.parts[o.key], job.offset, every)
                if not job.first:
                    base, group = r.stats, r.group
                    for st in base:
                        if isinstance(st.hessian, HessianParts):
                            st.hessian = st.hessian.into()
                else:
                    if r.group != group:
                        raise RuntimeError(f"layer {i}: the forward jobs grouped the linears' inputs differently")
                    for a, b in zip(base, r.stats):
                        _merge_stats(a, b, job.offset, job.held_offset)
                if recorder is not None and r.recorded is not None:
                    recorder.parts.append(r.recorded)
                r.stats = []
            hooks.group.update({by_name[n]: base[k] for n, k in group.items()})

    def plain_pass(self, i: int, layer: nn.Module) -> None:
        """The layer (its weights as the driver holds them: GPTQ's quantized ones) over every batch, writing
        `acts.h`: what the next layer calibrates on."""
        with self._pass():
            if len(self.runs) == 1:
                for samples in self.acts.batches:
                    self.serial_batch(layer, samples, write=True)
            else:
                for _ in self._submit(i, layer, "plain", {}, write=True):
                    pass

    @contextmanager
    def _pass(self) -> Iterator[None]:
        """One pass's driver wall, and its CPU seconds: in total (driver + every job) and on its critical path
        (driver + the longest job) - what the pass would take on free cores, whatever the host's load."""
        t, c = time.perf_counter(), time.process_time()
        self._job_cpu: list[float] = []
        try:
            yield
        finally:
            self.wall += time.perf_counter() - t
            driver = time.process_time() - c
            self.cpu += driver + sum(self._job_cpu)
            self.cpu_critical += driver + max(self._job_cpu, default=0.0)


def _merge_stats(a: InputStats, b: InputStats, offset: int, held_offset: int = 0) -> None:
    """Fold a job's InputStats (started at token `offset`, held-out token `held_offset`) into the first job's, in
    batch order."""
    a.sampler.extend(b.sampler, offset, a.name)  # first: it checks the job's place
    if a.hessian is not None:
        b.hessian.into(a.hessian)
    if a.held is not None:
        a.held.extend(b.held, held_offset, f"{a.name}'s held-out rows")
    if b.observer is not None and b.observer.channel_min is not None:
        o = a.observer
        if o.channel_min is None:
            o.channel_min, o.channel_max = b.observer.channel_min, b.observer.channel_max
        else:
            # new arrays, not out=: results that Ray hands back zero-copy are read-only
            o.channel_min = np.minimum(o.channel_min, b.observer.channel_min)
            o.channel_max = np.maximum(o.channel_max, b.observer.channel_max)
        o.tokens += b.observer.tokens
