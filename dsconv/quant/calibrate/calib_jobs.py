"""The calibrated path's independent work as executor jobs (dsconv.executor): one job per quantized linear of a layer
and one per routed expert.

Why these cuts: once a layer's calibration forward has run, every linear's statistics (observer, GPTQ Hessian,
sample rows) are final, and quantizing one linear - GPTQ solve, held-out choice, activation parameters, output-error
measurement - needs nothing of another. A routed expert needs only the tokens routed to it: its job reads the
layer's MoE input by path, loads its own weights from the checkpoint, runs the expert's forward, gathers the
statistics, quantizes its three projections and returns the expert's output rows, which the driver adds to the
residual stream in expert order (the same sums, in the same order, as the one-process loop).

Transport: inputs are files in the output's temporary directory (`JOBS_DIR`, removed before commit) - weights and
statistics by `torch.save`, the MoE input as .npy - plus small picklable descriptions; results are returned arrays
(int8 weights, scales, records). The driver alone writes the output, in job order, so the bytes never depend on the
executor. A task quantizes with the same public functions as the driver (linear.py), so the two cannot drift
apart. Linear and expert jobs run single-threaded (`JOB_THREADS`) on every executor: MKL's Cholesky gives different
last bits with 1 and 2 threads, and the output must not depend on how many jobs share the host. (Forward jobs may
take more threads on Ray, where their bits were measured equal: forward_jobs.py.)
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from dsconv.checkpoint import Checkpoint
from dsconv.executor import Executor
from dsconv.quant.calibrate.context import CalibContext, StatsSpec, forward_matmuls
from dsconv.runner.layers import SLOTS, Skeleton, expert_forward
from dsconv.quant.calibrate.linear import (PreparedLinear, QuantizedLinear, WeightChoice, load_bias, prepare_linear,
                                           quantize_linear)
from dsconv.quant.formats.msmodelslim import LinearResult
from dsconv.quant.plan.options import QuantOptions
from dsconv.quant.plan.plan import LinearPlan, QuantPlan
from dsconv.quant.plan.report import LinearRecord

JOBS_DIR = ".dsconv-calib-jobs"
JOB_THREADS = 1
_LOCAL: dict[str, tuple[Checkpoint, Skeleton]] = {}  # the driver's own, so inline jobs open nothing twice


@dataclass(frozen=True)
class Context:
    """What every task needs of the run (small and picklable: the plan without its per-tensor tables)."""

    root: str            # the checkpoint, opened by path in a worker
    key: str             # its fingerprint: a long-lived worker (Ray) never reuses a checkpoint that changed
    plan: QuantPlan
    opts: QuantOptions
    staged: bool
    tokens: int          # calibration tokens (a smoothing site's sample stride)
    stats: StatsSpec     # how a linear input's statistics are made
    static: bool
    observer_method: str


@dataclass(frozen=True)
class LinearJob:
    ctx: Context
    lp: LinearPlan
    weight: str              # torch.save'd float weight as the layer holds it (smoothed)
    stats: str | None        # torch.save'd InputStats (shared by the linears that read one input)
    choice: WeightChoice | None = None  # --method awq: the weight the driver's layer search chose


@dataclass(frozen=True)
class ExpertJob:
    ctx: Context
    layer: int
    expert: int
    names: dict[str, str]                     # slot -> checkpoint weight name
    plans: dict[str, LinearPlan | None]       # slot -> its plan (None: not quantized)
    hidden: str                               # .npy of the layer's MoE input [tokens, hidden] float32
    rows: np.ndarray                          # the token rows routed to this expert
    col_scale: str | None                     # .npy of the smoothing scale folded into gate/up, if any


@dataclass
class JobResult:
    written: list[tuple[LinearPlan, LinearResult]] = field(default_factory=list)
    records: dict[str, LinearRecord] = field(default_factory=dict)
    decisions: dict[str, Any] = field(default_factory=dict)
    pending: list[tuple[str, PreparedLinear, tuple[float, float] | None]] = field(default_factory=list)  # slot, own
    y: torch.Tensor | None = None             # an expert's output on its routed rows
    down_range: tuple[float, float] | None = None
    forward_s: float = 0.0
    quantize_s: float = 0.0
    steps: dict[str, float] = field(default_factory=dict)  # the job's own CPU seconds per step (steps.JOB_STEPS)


# ---- the driver side -------------------------------------------------------------------------------------------
def job_bytes(plan: Any) -> int:
    """The bytes a run's jobs quantize: one decision for the whole run, fan out only when they are worth starting
    processes for (Executor.map's `work_bytes`)."""
    return sum(lp.n * lp.k for lp in plan.linears.values()) * 2


def warm_workers(ex: Executor, ck: Checkpoint, plan: Any) -> None:
    """Start the executor's workers, importing this module, while the driver loads the tokenizer: on a small model
    their start-up (~1.3 s: a forkserver importing torch) was a tenth of the run. Only where jobs will run on them."""
    if ck.readable_by_path:
        ex.warm(job_bytes(plan), modules=(__name__,))


class Dispatch:
    """One calibration run's jobs: their workspace, the executor, and `merge`, which takes each result in job order
    (the driver writes it)."""

    def __init__(self, run: CalibContext, tokens: int, stats: StatsSpec, merge: Callable[[JobResult], None]) -> None:
        ck = run.ck
        self.merge = merge
        self.ex = run.executor if run.executor is not None and ck.readable_by_path else Executor(1)
        self.dir = Path(run.workspace) / JOBS_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        plan = dataclasses.replace(run.plan, linears={}, floats={}, dropped=[], ignored={})
        key = hashlib.sha256(json.dumps([ck.identity(), [p.stat().st_mtime_ns for p in ck.files]],
                                        sort_keys=True).encode()).hexdigest()
        self.ctx = Context(str(ck.root), key, plan, run.opts, run.staged, tokens, stats, run.static,
                           run.observer_method)
        _LOCAL[key] = (ck, run.sk)
        self.work = job_bytes(run.plan)
        self.wall = {"linear_jobs": 0.0, "expert_jobs": 0.0}  # driver seconds from first submit to last result

    def close(self) -> None:
        _LOCAL.pop(self.ctx.key, None)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _map(self, fn: Any, jobs: list, kind: str, ahead: int | None = None) -> Iterator[JobResult]:
        """The jobs submitted now (the first `ahead`: Executor.map), merged as their results are taken."""
        return self._merged(self.ex.map(fn, jobs, work_bytes=self.work, ahead=ahead), kind)

    def _merged(self, results: Iterator[JobResult], kind: str) -> Iterator[JobResult]:
        t = time.perf_counter()
        for res in results:
            self.merge(res)
            self.wall[kind] += time.perf_counter() - t
            yield res
            t = time.perf_counter()
        self.wall[kind] += time.perf_counter() - t

    def linears(self, i: int, items: list[tuple[Any, LinearPlan]], group: dict[Any, Any],
                choices: dict[str, WeightChoice]) -> Iterator[tuple[Any, LinearResult]]:
        """Quantize the layer's linears (in `items` order, with the weights --method awq chose) as jobs; yield
        (module, result) in order, each merged first. The statistics are saved once per distinct input and freed in
        the driver before the jobs run."""
        saved: dict[int, str] = {}
        jobs = []
        for j, (mod, lp) in enumerate(items):
            st = group.get(mod)
            if st is not None and id(st) not in saved:
                saved[id(st)] = str(self.dir / f"L{i}-s{len(saved)}.pt")
                torch.save(st, saved[id(st)])
            w = str(self.dir / f"L{i}-w{j}.pt")
            torch.save(mod.weight.detach(), w)
            jobs.append(LinearJob(self.ctx, lp, w, saved.get(id(st)) if st is not None else None,
                                  choices.get(lp.module)))
        for st in set(group.values()):
            st.free()
        try:
            for (mod, lp), res in zip(items, self._map(run_linear, jobs, "linear_jobs")):
                yield mod, res.written[-1][1]
        finally:
            for p in self.dir.glob(f"L{i}-*"):
                p.unlink()

    def start_experts(self, i: int, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                      pos: torch.Tensor, names: list[dict[str, str]], plans: list[dict[str, LinearPlan | None]],
                      col_scale: torch.Tensor | None) -> "StartedExperts":
        """Every routed expert of layer i submitted as a job: they run on the workers while the driver goes on
        (`experts` takes their results). On Ray every expert may run ahead - a result waits in the cluster's object
        store until it is taken -; local workers return results into this process, so at most 2 x workers."""
        hp = self.dir / f"E{i}-hidden.npy"
        np.save(hp, hidden.float().numpy())
        cs = None
        if col_scale is not None:
            cs = str(self.dir / f"E{i}-colscale.npy")
            np.save(cs, col_scale.numpy())
        routes = [torch.where(index == e) for e in range(len(names))]
        jobs = [ExpertJob(self.ctx, i, e, names[e], plans[e], str(hp), rows.numpy(), cs)
                for e, (rows, _) in enumerate(routes)]
        ahead = None if self.ex.local else len(jobs)
        return StartedExperts(i, hidden, weights, pos, routes, self._map(run_expert, jobs, "expert_jobs", ahead))

    def experts(self, started: "StartedExperts") -> tuple[torch.Tensor, list, list]:
        """The started expert jobs' results, in expert order. Returns the MoE output (summed in expert order, as the
        one-process loop does), the deferred (expert, {slot: (PreparedLinear, own range)}) and the down_proj
        ranges."""
        out = torch.zeros_like(started.hidden)
        deferred: list = []
        down: list = []
        try:
            for e, res in enumerate(started.results):
                rows, pos = started.routes[e]
                if res.y is not None:
                    out.index_add_(0, rows, (res.y * started.weights[rows, pos, None]).to(out.dtype))
                if res.down_range is not None:
                    down.append(res.down_range)
                if res.pending:
                    deferred.append((e, {slot: (p, own) for slot, p, own in res.pending}))
        finally:
            for p in self.dir.glob(f"E{started.layer}-*"):
                p.unlink()
        return out, deferred, down


@dataclass
class StartedExperts:
    """A layer's routed expert jobs, submitted (Dispatch.start_experts), and what taking their results needs."""

    layer: int
    hidden: torch.Tensor                      # the layer's MoE input [tokens, hidden]
    weights: torch.Tensor                     # the router's top-k weights
    pos: torch.Tensor                         # the MoE input's rows in the residual stream
    routes: list[tuple[torch.Tensor, torch.Tensor]]  # per expert: (token rows, top-k position)
    results: Iterator[JobResult]


# ---- the task side ---------------------------------------------------------------------------------------------
@contextmanager
def job_threads(n: int) -> Iterator[None]:
    """A job's torch threads, and no autograd: a worker process starts with grad enabled (the driver's calibration
    runs under no_grad), and `--calib-precision fp32-onednn` routes only grad-free linears through oneDNN - without
    this, two workers ran their experts through MKL at half the speed of the inline run."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(old)


def open_job_checkpoint(ctx: Context, skeleton: bool = False) -> tuple[Checkpoint, Skeleton | None]:
    """The run's checkpoint (and model skeleton): the driver's own when inline, else opened once per process."""
    hit = _LOCAL.get(ctx.key) or _OPENED.get(ctx.key)
    if hit is None:
        _OPENED.clear()  # one checkpoint per worker at a time
        hit = _OPENED[ctx.key] = (Checkpoint.open(Path(ctx.root)), None)
    if skeleton and hit[1] is None:
        hit = _OPENED[ctx.key] = (hit[0], Skeleton(hit[0]))
    return hit


_OPENED: dict[str, tuple[Checkpoint, Skeleton | None]] = {}


def _result(done: list[QuantizedLinear], decisions: list[dict[str, dict[str, str]]], quantize_s: float,
            **kw: Any) -> JobResult:
    """A task's linears and decisions, as the driver merges them."""
    merged: dict[str, Any] = {}
    for d in decisions:
        for k, v in d.items():
            merged.setdefault(k, {}).update(v)
    steps: dict[str, float] = {}
    for part in [q.seconds for q in done] + [p.seconds for _, p, _ in kw.get("pending", [])]:
        for k, v in part.items():
            steps[k] = steps.get(k, 0.0) + v
    return JobResult([(q.lp, q.result) for q in done], {q.lp.module: q.record for q in done}, merged,
                     quantize_s=quantize_s, steps=steps, **kw)


def _load_stats(path: str) -> Any:
    """The InputStats the driver saved: torch's weights-only unpickler with only dsconv's statistics classes allowed,
    so a file swapped into the shared temporary directory cannot run code (never a plain unpickle)."""
    from dsconv.quant.algorithms.gptq import HessianAccumulator
    from dsconv.quant.algorithms.observers import HistogramObserver, MinMaxObserver
    from dsconv.quant.algorithms.sampling import RowSampler
    from dsconv.quant.calibrate.stats import InputStats

    numpy_arrays = [np.core.multiarray._reconstruct, np.ndarray, np.dtype,
                    *(type(np.dtype(t)) for t in (np.float32, np.float64, np.int64, np.int32, np.bool_))]
    with torch.serialization.safe_globals([InputStats, RowSampler, MinMaxObserver, HistogramObserver,
                                           HessianAccumulator, *numpy_arrays]):
        return torch.load(path, weights_only=True)


def run_linear(job: LinearJob) -> JobResult:
    """Task: quantize one linear with its statistics (GPTQ, choice, activation parameters, output errors)."""
    ctx = job.ctx
    with job_threads(JOB_THREADS):
        ck = open_job_checkpoint(ctx)[0]
        w = torch.load(job.weight, weights_only=True)
        st = _load_stats(job.stats) if job.stats else None
        t = time.perf_counter()
        done, decisions = quantize_linear(ctx.plan, job.lp, w, st, ctx.opts, load_bias(ck, job.lp, job.choice),
                                          ctx.staged, job.choice)
        return _result([done], [decisions], time.perf_counter() - t)


def run_expert(job: ExpertJob) -> JobResult:
    """Task: one routed expert - forward on its routed rows (all rows with --all-experts), statistics, quantization
    of gate/up/down (under-covered ones prepared only: their activation ranges are the layer's, decided by the
    driver), output rows returned."""
    ctx, opts, e, i = job.ctx, job.ctx.opts, job.expert, job.layer
    with job_threads(JOB_THREADS):
        ck, sk = open_job_checkpoint(ctx, skeleton=True)
        t, c = time.perf_counter(), time.process_time()
        w = {s: sk.load(job.names[s]) for s in SLOTS}
        if job.col_scale is not None:
            cs = torch.from_numpy(np.load(job.col_scale))
            w["gate"].mul_(cs)
            w["up"].mul_(cs)
        plans = {s: lp for s, lp in job.plans.items() if lp is not None}
        if job.rows.size == 0 and not opts.all_experts:  # no token: weights only, ranges borrowed later
            t = time.perf_counter()
            pending = [(s, prepare_linear(ctx.plan, lp, w[s], None, opts, load_bias(ck, lp)), None)
                       for s, lp in _in_slot_order(plans)]
            return _expert_steps(_result([], [p.decisions for _, p, _ in pending], time.perf_counter() - t,
                                         pending=pending), 0.0)
        hidden = np.load(job.hidden, mmap_mode="r")
        x = torch.from_numpy(np.array(hidden) if opts.all_experts else hidden[job.rows])
        del hidden
        out: dict[str, torch.Tensor] = {}
        with forward_matmuls(opts):
            act, y = expert_forward(sk.experts_module(i), e, x, w, outputs=out)
        act, y = act.float(), y.float()
        out["down"] = y
        if opts.all_experts:
            y = y[torch.from_numpy(job.rows)]
        fwd = time.perf_counter() - t
        routed = int(job.rows.size)
        st = {"in": ctx.stats.new(x.shape[-1], f"layer {i} expert {e} gate/up"),
              "down": ctx.stats.new(act.shape[-1], f"layer {i} expert {e} down")}
        st["in"].update(x)
        st["down"].update(act)
        passes = time.process_time() - c  # the expert's own pass (CPU): its forward and statistics
        under = ctx.static and routed < opts.min_expert_tokens and not opts.all_experts
        down = st["down"].clip_range() if ctx.static else None
        t = time.perf_counter()
        pending, done, decisions = [], [], []
        # the fallback check's float outputs on the sampled rows: the expert's forward computed them already (in
        # float32; a bf16 forward's are recomputed from the rows by prepare_linear)
        exact = opts.calib_precision != "bf16"
        for slot, lp in _in_slot_order(plans):
            s = st["in"] if slot != "down" else st["down"]
            ref = out[slot][torch.cat(s.sampler.picked)] if s.sampler.picked and exact else None
            if under:
                p = prepare_linear(ctx.plan, lp, w[slot], s, opts, load_bias(ck, lp), y_ref=ref)
                pending.append((slot, p, s.clip_range()))
                decisions.append(p.decisions)
            else:
                q, d = quantize_linear(ctx.plan, lp, w[slot], s, opts, load_bias(ck, lp), ctx.staged, y_ref=ref)
                q.record.tokens = routed
                done.append(q)
                decisions.append(d)
        return _expert_steps(_result(done, decisions, time.perf_counter() - t, pending=pending, y=y,
                                     down_range=down, forward_s=fwd), passes)


def _expert_steps(res: JobResult, passes: float) -> JobResult:
    """An expert job's seconds under the experts' own step names (steps.JOB_STEPS)."""
    res.steps = {"expert_forward": passes, **{f"expert_{k}": v for k, v in res.steps.items()}}
    return res


def _in_slot_order(plans: dict[str, LinearPlan]) -> list[tuple[str, LinearPlan]]:
    return [(s, plans[s]) for s in SLOTS if s in plans]
