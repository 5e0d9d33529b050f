"""GPTQ as a calibration plug-in (algorithm.py). What it observes: each linear input's X^T X (`needs_hessian`) and
the held-out prompts its per-linear choice against round-to-nearest is judged on (`holds_out`); what it computes:
the weights, in the linear jobs (quant/weights.py ROUNDING["gptq"], algorithms/gptq.py); what it changes in the
layer: a dense layer's weights become their quantized values, and its outputs are recomputed with them before the
next layer calibrates (as in its paper: each Hessian then describes the inputs the quantized model produces; MoE
layers pass on float outputs)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsconv.quant.algorithms.schemes import dequant_weight
from dsconv.quant.calibrate.algorithm import Algorithm, LayerState


class Gptq(Algorithm):
    name = "gptq"
    step = "propagate"
    needs_hessian = True
    holds_out = True

    @classmethod
    def active(cls, run: Any) -> bool:
        return run.plan.method == "gptq"

    def before(self, st: LayerState) -> None:
        self.propagate = st.experts is None and bool(st.targets)
        if self.propagate:  # the statistics forward leaves the next layer's input to after_linears
            st.write_outputs = False

    def on_linear(self, st: LayerState, module: nn.Module, result: Any) -> None:
        if self.propagate:  # versioned in place: forward jobs see it
            module.weight.copy_(torch.from_numpy(dequant_weight(result.q, result.scale)))

    def after_linears(self, st: LayerState) -> None:
        if self.propagate:  # the next layer calibrates on what this quantized layer outputs
            with self.cal.clock(self.step):
                self.cal.fwd.plain_pass(st.i, st.layer)
