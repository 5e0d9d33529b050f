"""One decoder layer's calibration, step by step, and what each step cost (quant_report.json `timings`).

The steps name no algorithm: each active algorithm (registry.py) takes part through its phases (algorithm.py), in
registry order. A layer's steps, top to bottom (`calibrate_layer`):

1. materialise - its weights from the checkpoint (routed experts load in their own jobs);
2. the algorithms' `before` - their own work before the statistics forward (awq: its probe forward, scale and clip
   searches, weight choices; SmoothQuant, where its statistics cannot follow its folds: a probe forward and the
   folds), and the observers each one rides on the statistics forward;
3. forward - ONE pass of every calibration batch through the float layer. Hooks gather, at once, each distinct
   linear input's statistics (min/max, the row sample, GPTQ's Hessian), the MoE routed tokens and every
   algorithm's observers (smoothing probes, KV-cache statistics); the outputs replace the inputs as the next
   layer's. Smoothing does not need a forward of its own: its folds leave the float layer unchanged (norm weight /
   s, consumer columns x s) and divide each consumer's input by s per channel, which min/max, sampled rows and X^T X
   follow exactly up to float rounding (`InputStats.rescale`). An algorithm that propagated the outputs itself
   (awq) leaves its observers a pass of their own over the layer's input instead;
4. the algorithms' `after` - smooth_search (per site the SmoothQuant strength or the fixed alpha, folded; the
   statistics rescaled), the cache scales written, clip_search (each static input's clip ratio by its consumers'
   output error);
5. linear_jobs - the layer's linears as jobs: weights (rtn or gptq), activation parameters and the output errors
   the fallback decision reads (each job reports its own seconds: quantize, gptq, fallback_check);
6. the algorithms' `after_linears` - propagate (GPTQ, dense layers: the quantized layer's outputs for the next
   layer);
7. experts - the routed experts as jobs (in the jobs' own seconds: expert_forward, their forward and statistics;
   expert_quantize / expert_gptq / expert_fallback_check, their linears), then the under-covered ones. Unless an
   algorithm folds something into them (a fixed smoothing scale), the jobs are submitted right after the forward,
   so on a cluster they run while the driver searches (step 4-5); their results are taken here, in order, so the
   output and the report do not change;
8. write - the layer's tensors (quantized linears as their jobs return, floats, cache scales).

`StepClock` keeps the driver's wall and CPU seconds per step and layer, each step exclusive of the steps inside it
(writing inside the jobs' loop counts as write), so a layer's driver steps add up to its wall time; the jobs' own
CPU seconds are kept apart (`in_jobs`): with --workers they overlap each other and the driver's waiting.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator, Protocol

import torch
from torch import nn

from dsconv.quant.calibrate.algorithm import Algorithm, LayerState
from dsconv.quant.calibrate.calib_jobs import Dispatch, StartedExperts
from dsconv.quant.calibrate.context import CalibContext, LayerActivations, StatsSpec
from dsconv.quant.calibrate.forward_jobs import Forward
from dsconv.quant.calibrate.hooks import ExpertRecorder, LinearHooks
from dsconv.runner.layers import install_forward
from dsconv.quant.formats.output import QuantWriter
from dsconv.quant.plan.plan import LinearPlan


STEPS = ("materialise", "awq", "forward", "smooth_search", "clip_search", "linear_jobs", "propagate", "experts",
         "write")
JOB_STEPS = ("quantize", "gptq", "fallback_check", "expert_forward", "expert_quantize", "expert_gptq",
             "expert_fallback_check")


class StepClock:
    """Wall and CPU seconds per step (STEPS) and layer in the driver, each exclusive of the steps timed inside it,
    and the jobs' own CPU seconds per step (JOB_STEPS) and layer (a job is single-threaded: its compute, whatever
    the host's load)."""

    def __init__(self) -> None:
        self.layer: Any = None                     # the layer being calibrated (a key of `wall`)
        self.wall: dict[Any, dict[str, float]] = {}
        self.cpu: dict[Any, dict[str, float]] = {}
        self.jobs: dict[Any, dict[str, float]] = {}
        self._inner: list[list[float]] = []

    @contextmanager
    def __call__(self, step: str) -> Iterator[None]:
        t, c = time.perf_counter(), time.process_time()
        self._inner.append([0.0, 0.0])
        try:
            yield
        finally:
            dt, dc = time.perf_counter() - t, time.process_time() - c
            inner = self._inner.pop()
            _add(self.wall.setdefault(self.layer, {}), step, dt - inner[0])
            _add(self.cpu.setdefault(self.layer, {}), step, dc - inner[1])
            if self._inner:
                self._inner[-1][0] += dt
                self._inner[-1][1] += dc

    def add_jobs(self, seconds: dict[str, float]) -> None:
        """A job's own CPU seconds per step, to the current layer."""
        mine = self.jobs.setdefault(self.layer, {})
        for k, v in seconds.items():
            _add(mine, k, v)

    def report(self) -> dict[str, Any]:
        """For quant_report.json: totals over layers (`steps`: driver wall, `steps_cpu`, `in_jobs`), then per layer
        (driver wall per step, with `cpu` and `in_jobs` beside)."""
        def rounded(d: dict[str, float]) -> dict[str, float]:
            return {k: round(v, 3) for k, v in d.items()}

        def total(per_layer: dict[Any, dict[str, float]]) -> dict[str, float]:
            out: dict[str, float] = {}
            for d in per_layer.values():
                for k, v in d.items():
                    _add(out, k, v)
            return rounded(out)

        layers = {}
        for key in sorted(set(self.wall) | set(self.jobs), key=lambda k: (isinstance(k, str), k)):
            entry: dict[str, Any] = {**rounded(self.wall.get(key, {})), "cpu": rounded(self.cpu.get(key, {}))}
            if self.jobs.get(key):
                entry["in_jobs"] = rounded(self.jobs[key])
            layers[str(key)] = entry
        return {"steps": total(self.wall), "steps_cpu": total(self.cpu), "in_jobs": total(self.jobs),
                "layers": layers,
                "note": "driver wall (steps) and CPU (steps_cpu, all its threads) seconds per step, each exclusive of "
                        "the steps inside it; in_jobs: the jobs' own CPU seconds (single-threaded; in parallel with "
                        "--workers)"}


def _add(d: dict[str, float], key: str, value: float) -> None:
    d[key] = d.get(key, 0.0) + value


class LayerRun(Protocol):
    """What a layer's steps use of the run (calibration.py's Calibrator, which owns it): its context, activations,
    forward, job dispatch, writer and clock, the run's algorithms (registry.py), and where the layer's decisions
    go."""
    ctx: CalibContext
    algorithms: list[type[Algorithm]]
    acts: LayerActivations
    fwd: Forward
    jobs: Dispatch
    qw: QuantWriter
    stats: StatsSpec
    clock: StepClock
    by_layer: dict[int, list[LinearPlan]]
    decisions: dict[str, Any]
    smoothing: list[dict[str, Any]]

    def start_experts(self, i: int, experts: nn.Module, recorder: ExpertRecorder, lps: dict[str, LinearPlan],
                      col_scale: torch.Tensor | None) -> StartedExperts: ...

    def run_experts(self, started: StartedExperts) -> None: ...


def calibrate_layer(cal: LayerRun, i: int) -> None:
    """Layer i's steps (module docstring), each timed on `cal.clock`; the algorithms' phases (algorithm.py) in
    registry order."""
    run, sk, plan, qw, acts, fwd, clock = cal.ctx, cal.ctx.sk, cal.ctx.plan, cal.qw, cal.acts, cal.fwd, cal.clock
    clock.layer = i
    with clock("materialise"):
        layer = sk.materialise(i)
    fwd.begin(i, layer)
    lps = {lp.module: lp for lp in cal.by_layer.get(i, [])}
    floats = [fp for fp in plan.floats.values() if fp.layer == i]
    qw.open_layer(i, list(lps.values()), floats)
    experts = sk.experts_module(i)
    targets: dict[nn.Module, LinearPlan] = {}
    for mod in layer.modules():
        if isinstance(mod, nn.Linear):
            lp = lps.get(sk.ck_name(sk.module_names[mod]))
            if lp is not None:
                targets[mod] = lp
    st = LayerState(i, layer, lps, targets, experts)
    algos = [a(cal) for a in cal.algorithms]
    for a in algos:  # each algorithm's own work, then what it observes of the statistics forward
        a.before(st)
        st.observed += a.observers(st)
    if st.written and st.observed:  # an algorithm's forward propagated the outputs: the observers see the input
        with clock("forward"):   # again (the attention runs before the MLP: the experts return zeros here)
            if experts is not None:
                install_forward(experts, lambda h, idx, wts: torch.zeros_like(h))
            st.layer_input, acts.h = acts.h, st.layer_input
            fwd.observe_pass(i, layer, st.observed)
            acts.h, st.layer_input = st.layer_input, None
    st.hooks = LinearHooks(targets, lambda lp: cal.stats.new(lp.k, lp.module), acts.rows)
    st.recorder = ExpertRecorder(acts.rows) if experts is not None else None
    if experts is not None:
        install_forward(experts, st.recorder)
    if not st.written:
        with clock("forward"):
            fwd.stats_pass(i, layer, st.hooks, st.recorder, write=st.write_outputs, observers=st.observed)
    st.hooks.remove()
    for o in st.observed:
        o.remove()
    started = None
    if experts is not None and not any(a.folds_into_experts() for a in algos):
        with clock("experts"):  # they run on the workers during the searches and linear jobs
            started = cal.start_experts(i, experts, st.recorder, lps, None)
    for a in algos:
        a.after(st)
    order = sorted(targets.items(), key=lambda kv: list(lps).index(kv[1].module))
    with clock("linear_jobs"):
        for mod, res in cal.jobs.linears(i, order, st.hooks.group, st.choices):
            for a in algos:
                a.on_linear(st, mod, res)
    for a in algos:
        a.after_linears(st)
    if experts is not None:
        with clock("experts"):
            if started is None:
                started = cal.start_experts(i, experts, st.recorder, lps, st.col_scale)
            elif st.col_scale is not None:
                raise AssertionError(f"layer {i}: the experts started before a scale folded into them")
            cal.run_experts(started)
    with clock("write"):
        for fp in floats:
            t = st.modified.get(fp.name)
            qw.float(fp.name, t if t is not None else run.ck.load(fp.name, dequantize=True))
        qw.close_layer(i)
    sk.release(i)
