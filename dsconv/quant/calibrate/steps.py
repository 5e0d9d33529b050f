"""One decoder layer's calibration, step by step, and what each step cost (quant_report.json `timings`).

A layer's steps, top to bottom (`calibrate_layer`):

1. materialise - its weights from the checkpoint (routed experts load in their own jobs);
2. awq (--method awq) - its probe forward, scale and clip searches, weight choices;
3. forward - ONE pass of every calibration batch through the float layer. Hooks gather, at once, each distinct
   linear input's statistics (min/max, the row sample, GPTQ's Hessian), the smoothing searches' probes, the
   KV-cache statistics and the MoE routed tokens; the outputs replace the inputs as the next layer's. Smoothing
   does not need a forward of its own: its folds leave the float layer unchanged (norm weight / s, consumer columns
   x s) and divide each consumer's input by s per channel, which min/max, sampled rows and X^T X follow exactly up
   to float rounding (`InputStats.rescale`). Where a statistic cannot follow - a histogram observer (--act-method
   percentile/mse), FA quant's per-tensor latent window behind a norm that could be smoothed - the layer probes
   first (`one_forward`), as it always did;
4. smooth_search - per site the SmoothQuant strength (or the fixed alpha), folded; the statistics rescaled;
5. clip_search - each static input's clip ratio by its consumers' output error;
6. linear_jobs - the layer's linears as jobs: weights (rtn or gptq), activation parameters and the output errors
   the fallback decision reads (each job reports its own seconds: quantize, gptq, fallback_check);
7. propagate (GPTQ, dense layers) - the quantized layer's outputs for the next layer;
8. experts - the routed experts as jobs (in the jobs' own seconds: expert_forward, their forward and statistics;
   expert_quantize / expert_gptq / expert_fallback_check, their linears), then the under-covered ones. Unless a
   fixed smoothing scale is folded into them, the jobs are submitted right after the forward (`experts_first`),
   so on a cluster they run while the driver searches (steps 4-6); their results are taken here, in order, so the
   output and the report do not change;
9. write - the layer's tensors (quantized linears as their jobs return, floats, cache scales).

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

from dsconv.quant.algorithms import clipping
from dsconv.quant.algorithms.methods import ACT_SEARCH
from dsconv.quant.algorithms.observers import MinMaxObserver
from dsconv.quant.algorithms.schemes import dequant_weight
from dsconv.quant.calibrate import awq
from dsconv.quant.calibrate.calib_jobs import Dispatch, StartedExperts
from dsconv.quant.calibrate.context import CalibContext, LayerActivations, StatsSpec
from dsconv.quant.calibrate.forward_jobs import Forward
from dsconv.quant.calibrate.hooks import ExpertRecorder, LinearHooks
from dsconv.quant.calibrate.kv_cache import CacheStats, cache_stats
from dsconv.quant.calibrate.layers import install_forward
from dsconv.quant.calibrate.smooth_layer import Smoothed, fold, smoothing_probes
from dsconv.quant.calibrate.stats import InputStats
from dsconv.quant.formats.output import QuantWriter
from dsconv.quant.formats.msmodelslim import FA_QUANT
from dsconv.quant.plan.options import smoothing_of
from dsconv.quant.plan.plan import ACT_QUANT, LinearPlan


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


def one_forward(run: CalibContext, i: int, lps: dict[str, LinearPlan]) -> bool:
    """Whether layer i's smoothing searches share its statistics forward (module docstring, step 3): not with a
    histogram observer, nor where FA quant's latent norm feeds an activation-quantized kv_b_proj (a norm that could
    be smoothed, which would change the latent FA quant measures per tensor)."""
    if run.static and run.observer_method != MinMaxObserver.method:
        return False
    kv = run.plan.kv.get(i)
    if kv is not None and kv.form == FA_QUANT:
        lp = lps.get(kv.measured[1])
        if lp is not None and lp.qtype in ACT_QUANT:
            return False
    return True


def experts_first(run: CalibContext) -> bool:
    """Whether the routed experts' jobs can start right after the statistics forward: nothing the searches decide
    reaches them unless a fixed --smooth-quant alpha folds a scale into their gate/up columns (auto never smooths a
    norm the experts read: smooth_layer.fold)."""
    return smoothing_of(run.opts, run.plan) is None or run.opts.smooth_alpha == "auto"


def rescale_inputs(group: dict[nn.Module, InputStats], inputs: dict[nn.Module, torch.Tensor]) -> None:
    """Each distinct input's statistics divided by the s its fold divided it by (shared inputs: once)."""
    done: set[int] = set()
    for mod, s in inputs.items():
        st = group.get(mod)
        if st is not None and id(st) not in done:
            done.add(id(st))
            st.rescale(s)


class LayerRun(Protocol):
    """What a layer's steps use of the run (calibration.py's Calibrator, which owns it): its context, activations,
    forward, job dispatch, writer and clock, and where the layer's decisions go."""
    ctx: CalibContext
    acts: LayerActivations
    fwd: Forward
    jobs: Dispatch
    qw: QuantWriter
    stats: StatsSpec
    clock: StepClock
    by_layer: dict[int, list[LinearPlan]]
    decisions: dict[str, Any]
    smoothing: list[dict[str, Any]]

    def kv_pass(self, layer: nn.Module, experts: nn.Module | None, cache: CacheStats) -> None: ...

    def start_experts(self, i: int, experts: nn.Module, recorder: ExpertRecorder, lps: dict[str, LinearPlan],
                      col_scale: torch.Tensor | None) -> StartedExperts: ...

    def run_experts(self, started: StartedExperts) -> None: ...


def calibrate_layer(cal: LayerRun, i: int) -> None:
    """Layer i's steps (module docstring), each timed on `cal.clock`."""
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
    smoothed, probes = Smoothed(), None
    if smoothing_of(run.opts, plan) is not None:
        if one_forward(run, i, lps):  # the searches' probes ride on the statistics forward
            probes = smoothing_probes(run, acts, layer, targets, experts, lps)
        else:  # a probe forward of its own first
            if experts is not None:
                install_forward(experts, lambda h, idx, wts: torch.zeros_like(h))
            first = smoothing_probes(run, acts, layer, targets, experts, lps)
            with clock("forward"):
                fwd.smooth_pass(i, layer, first.probe, first.sites, first.norms, first.consumers)
            first.remove()
            with clock("smooth_search"):
                smoothed = fold(run, i, first, targets, experts, lps)
    # --kv-cache int8: what the attention caches, measured during the statistics forward
    cache = cache_stats(plan.kv[i], sk, layer, acts.rows) if i in plan.kv else None
    chosen = awq.AwqLayer()  # --method awq: scales folded, weights chosen, outputs propagated by its probe
    if plan.method == "awq":
        with clock("awq"):
            # the probe overwrites the layer's input rows with its outputs when it propagates (dense layers)
            layer_input = acts.h.clone() if cache is not None and experts is None else None
            chosen = awq.run_layer(run, acts, fwd.serial_batch, i, layer, targets, lps, experts)
            smoothed.modified.update(chosen.modified)
            if chosen.log is not None:
                cal.decisions.setdefault("awq", []).extend(chosen.log)
        if cache is not None and chosen.written:  # no statistics forward follows: the cache gets a pass of its
            # own, on the layer as AWQ left it (its v -> o fold rescales what v_proj writes to the cache) and on
            # the layer's input (the probe has replaced it by the outputs)
            with clock("forward"):
                acts.h, layer_output = layer_input, acts.h
                cal.kv_pass(layer, experts, cache)
                acts.h = layer_output
        del layer_input

    hooks = LinearHooks(targets, lambda lp: cal.stats.new(lp.k, lp.module), acts.rows)
    recorder = ExpertRecorder(acts.rows) if experts is not None else None
    if experts is not None:
        install_forward(experts, recorder)
    propagate = plan.method == "gptq" and experts is None and bool(targets)
    if not chosen.written:
        with clock("forward"):
            fwd.stats_pass(i, layer, hooks, recorder, write=not propagate, cache=cache, kv=plan.kv.get(i),
                           probes=probes)
    hooks.remove()
    started = None
    if experts is not None and experts_first(run):  # they run on the workers during the searches and linear jobs
        with clock("experts"):
            started = cal.start_experts(i, experts, recorder, lps, None)
    if probes is not None:
        probes.remove()
        with clock("smooth_search"):
            smoothed = fold(run, i, probes, targets, experts, lps)
            rescale_inputs(hooks.group, smoothed.inputs)
            if smoothed.col_scale is not None and recorder is not None:
                recorder.rescale(smoothed.col_scale)
    cal.smoothing += smoothed.log
    if cache is not None:
        cache.remove()
        with clock("write"):
            qw.kv_cache(cache.tensors(plan.kv[i]))
    if run.static and run.opts.act_method == ACT_SEARCH:
        with clock("clip_search"):
            clipping.choose_clips(hooks.group, targets, cal.decisions.setdefault("clipping", {}))
    order = sorted(targets.items(), key=lambda kv: list(lps).index(kv[1].module))
    with clock("linear_jobs"):
        for mod, res in cal.jobs.linears(i, order, hooks.group, chosen.choices):
            if propagate:
                mod.weight.copy_(torch.from_numpy(dequant_weight(res.q, res.scale)))  # versioned: jobs see it
    if propagate:  # the next layer calibrates on what this quantized layer outputs
        with clock("propagate"):
            fwd.plain_pass(i, layer)
    if experts is not None:
        with clock("experts"):
            if started is None:
                started = cal.start_experts(i, experts, recorder, lps, smoothed.col_scale)
            elif smoothed.col_scale is not None:
                raise AssertionError(f"layer {i}: the experts started before a smoothing scale folded into them")
            cal.run_experts(started)
    with clock("write"):
        for fp in floats:
            t = smoothed.modified.get(fp.name)
            qw.float(fp.name, t if t is not None else run.ck.load(fp.name, dequantize=True))
        qw.close_layer(i)
    sk.release(i)
