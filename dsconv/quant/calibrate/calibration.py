"""The calibrated path of `dsconv quantize` (static W8A8, GPTQ, smoothing, or an explicit --calib).

The calibration tokens are embedded once, then each decoder layer is materialised from the checkpoint, all
calibration activations are pushed through it with statistics streamed by hooks (as jobs over runs of the
calibration batches where the run allows: forward_jobs.py), its linears are quantized and written, and it is freed.
Routed experts run after the rest of the layer, each as its own job (calib_jobs.py: its forward, statistics and
quantization), as do the quantization of the layer's other linears once their statistics are
in; the jobs run on the executor (`--workers`, `--executor ray`), the driver writes their results in order, so peak
driver memory is one layer without its experts, the jobs in flight, and the activations ([tokens, hidden] float32,
twice).

Activations propagate in float (each layer sees the float model's inputs), so statistics do not depend on the
order layers are quantized in, and the layer-by-layer results equal a whole-model forward with hooks. GPTQ is the
exception (as in its paper): a dense layer's outputs are recomputed with its quantized weights before the next layer
calibrates, so each Hessian describes the inputs the quantized model will actually produce (one extra forward per
layer; MoE layers still pass on float outputs).

The Calibrator only sequences a layer's steps and owns what the run produces (records, decisions, expert counts,
the smoothing log, timings). Every step takes what it reads explicitly: the run's inputs (`context.CalibContext`),
the activations (`context.LayerActivations`), and returns its results as values - one linear's tensors and record
(linear.py), the jobs' results (calib_jobs.py, merged here in job order). The calibration algorithms (smoothing, the
KV-cache scales, AWQ, the clip search, GPTQ) are plug-ins (algorithm.py, registry.py) that each layer runs through
the same phases.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from dsconv.checkpoint import Checkpoint
from dsconv.errors import UserError
from dsconv.executor import Executor
from dsconv.quant.algorithms.schemes import activation_qparams
from dsconv.quant.calibrate import registry
from dsconv.quant.calibrate.calib_jobs import Dispatch, JobResult, StartedExperts
from dsconv.quant.calibrate.context import CalibContext, LayerActivations
from dsconv.quant.calibrate.data import CalibSet
from dsconv.quant.calibrate.forward_jobs import Forward
from dsconv.quant.calibrate.hooks import ExpertRecorder
from dsconv.runner.layers import Skeleton, install_forward
from dsconv.quant.calibrate.linear import QuantizedLinear, finish_linear, load_bias, quantize_linear
from dsconv.quant.calibrate.stats import InputStats
from dsconv.quant.calibrate.steps import StepClock, calibrate_layer
from dsconv.quant.formats.output import QuantWriter
from dsconv.quant.plan.options import QuantOptions
from dsconv.quant.plan.plan import LinearPlan, QuantPlan
from dsconv.quant.plan.report import Findings, LinearRecord


class Calibrator:
    """Layer-by-layer calibration and quantization (see the module docstring)."""

    def __init__(self, ck: Checkpoint, plan: QuantPlan, opts: QuantOptions, calib: CalibSet, qw: QuantWriter | None,
                 progress: bool = True, executor: Executor | None = None) -> None:
        self.qw, self.progress = qw, progress
        self.ctx = CalibContext(ck, Skeleton(ck), plan, opts, workspace=qw.out.path if qw is not None else None,
                                staged=qw.staged if qw is not None else False, executor=executor)
        self.algorithms = registry.active(self.ctx)  # in the order each layer runs them
        self.acts = LayerActivations.embedded(self.ctx.sk, calib, ck.facts.vocab_size, opts.batch_tokens,
                                              hold_out=any(a.holds_out for a in self.algorithms))
        self.stats = self.acts.stats_spec(plan, opts, hessian=any(a.needs_hessian for a in self.algorithms))
        self.by_layer = plan.by_layer()
        self.decisions: dict[str, Any] = {}  # searches and choices, for quant_report.json (clipping, W4 choice)
        self.records: dict[str, LinearRecord] = {}
        self.expert_counts: dict[int, list[int]] = {}
        self.smoothing: list[dict[str, Any]] = []
        # seconds: the forward passes with statistics hooks (driver and jobs); summed over jobs, the routed experts'
        # forward and quantizing + measuring linears; after run(), the driver's wall time in linear and expert jobs
        self.timings = {"forward": 0.0, "experts": 0.0, "quantize": 0.0}
        self.clock = StepClock()  # seconds per step and layer (steps.py), for quant_report.json

    # ---- the run --------------------------------------------------------------------------------------------
    def run(self) -> None:
        from tqdm import tqdm

        self.jobs = Dispatch(self.ctx, self.acts.tokens, self.stats, self.merge)  # linears and experts as jobs
        self.fwd = Forward(self.ctx, self.acts, self.jobs)  # the layer forward over batches, as jobs where it splits
        try:
            with torch.no_grad():
                for i in tqdm(range(self.ctx.sk.num_layers), desc="quantize", unit="layer",
                              disable=None if self.progress else True, leave=False):
                    self.layer(i)
                self.beyond_layers()
        finally:
            self.jobs.close()
        self.timings["forward"] += self.fwd.forward_s
        self.timings.update(self.jobs.wall, jobs_wall=sum(self.jobs.wall.values()), forward_wall=self.fwd.wall,
                            forward_cpu=self.fwd.cpu, forward_cpu_critical=self.fwd.cpu_critical)

    def beyond_layers(self) -> None:
        """Linears past the decoder layers (DeepSeek's MTP layer under the W4A8 recipe): transformers has no module
        to run them, so they are rounded to nearest from their weights alone, as the recipe's dynamic types allow."""
        ctx = self.ctx
        self.clock.layer = "beyond"
        for lp in ctx.plan.linears.values():
            if lp.layer is None or lp.layer < ctx.sk.num_layers:
                continue
            w = ctx.ck.load(lp.weight, dequantize=True)
            out, _ = quantize_linear(ctx.plan, lp, w, None, ctx.opts, load_bias(ctx.ck, lp), staged=False)
            self.write(out)

    def findings(self) -> Findings:
        """What the run found beyond the records, for quant_report.json."""
        return Findings(self.smoothing, self.decisions, self.expert_counts)

    def merge(self, res: JobResult) -> None:
        """A job's result, in job order: its linears written, its records and decisions kept."""
        with self.clock("write"):
            for lp, r in res.written:
                self.qw.linear(lp, r)
        self.clock.add_jobs(res.steps)
        self.records.update(res.records)
        for k, v in res.decisions.items():
            if isinstance(v, dict):
                self.decisions.setdefault(k, {}).update(v)
            else:
                self.decisions[k] = v
        self.timings["experts"] += res.forward_s
        self.timings["quantize"] += res.quantize_s

    def write(self, out: QuantizedLinear) -> None:
        with self.clock("write"):
            self.qw.linear(out.lp, out.result)
        self.records[out.lp.module] = out.record

    def layer(self, i: int) -> None:
        calibrate_layer(self, i)

    # ---- experts --------------------------------------------------------------------------------------------
    def start_experts(self, i: int, experts: nn.Module, recorder: ExpertRecorder, lps: dict[str, LinearPlan],
                      col_scale: torch.Tensor | None) -> StartedExperts:
        """Every routed expert of layer i submitted as a job (they run while the driver goes on: steps.py)."""
        sk = self.ctx.sk
        hidden, index, weights, pos = recorder.take()
        E = int(experts.gate_up_proj.shape[0])
        self.expert_counts[i] = [int(c) for c in torch.bincount(index.reshape(-1), minlength=E)[:E]]
        names = [sk.expert_weight_names(i, e) for e in range(E)]
        plans = [{s: lps.get(n) for s, n in sk.expert_module_names(i, e).items()} for e in range(E)]
        return self.jobs.start_experts(i, hidden, index, weights, pos, names, plans, col_scale)

    def run_experts(self, started: StartedExperts) -> None:
        """The started experts' results added to the residual stream; then, in expert order, the under-covered (and
        never-routed) experts' linears with activation ranges borrowed from the whole layer's."""
        i, hidden, static = started.layer, started.hidden, self.ctx.static
        counts = self.expert_counts[i]
        out, deferred, down_ranges = self.jobs.experts(started)
        self.acts.h.index_add_(0, started.pos, out)
        if not deferred:
            return
        union_in = None
        if static:  # gate/up of every expert read the same tensor: its range over all MoE tokens
            st = InputStats(hidden.shape[-1], f"layer {i} MoE input", self.ctx.observer_method, False, 0)
            st.update(hidden)
            union_in = st.clip_range()
        union_down = (min(r[0] for r in down_ranges), max(r[1] for r in down_ranges)) if down_ranges else None
        t = time.perf_counter()
        for e, held in deferred:  # under-covered (and never-routed) experts, in expert order
            for slot, (p, own) in held.items():
                qparams, source = None, None
                if static:
                    rng = _union(own, union_in if slot != "down" else union_down)
                    if rng is None:
                        raise UserError(f"layer {i}: no calibration token reached any expert's {slot} projection",
                                        hint="use more calibration text or --all-experts")
                    qparams, source = activation_qparams(*rng), "borrowed"
                out_lin = finish_linear(p, qparams, self.ctx.staged, source)
                out_lin.record.tokens = int(counts[e])
                self.write(out_lin)
        self.timings["quantize"] += time.perf_counter() - t


def _union(a: tuple[float, float] | None, b: tuple[float, float] | None) -> tuple[float, float] | None:
    if a is None:
        return b
    if b is None:
        return a
    return (min(a[0], b[0]), max(a[1], b[1]))
