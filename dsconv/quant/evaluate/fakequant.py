"""The quantized model as the ONNX export sees it (`load_source`): transformers' module with weights dequantized from a
`dsconv quantize` output and activations quantized where the engine quantizes them, the int8 tensors to put back into
the graph, and dsconv's own simulation of the quantized model (what `dsconv eval` measures) to check the file against.

Why here and not in convert/: it is the quantize output's meaning (its layout, its activation schemes); the export
stage (convert/quant_onnx.py) traces and rewrites what it is handed, and the command layer hands it this.

Why trace a fake-quantized model instead of rewriting the float graph by pattern: the activation quantization sits
inside the modules (W8A8 static per tensor, W8A8_DYNAMIC per token, also in front of fused MoE experts), where the
tracer sees it exactly; the weights are then swapped for their int8 values in the graph (quant_graph.py), so the
written numbers are the quantize output's, byte for byte.

  W8A8 (static)  QuantizeLinear -> DequantizeLinear on the input with exactly input_scale / input_offset (zero point =
                 input_offset: msModelSlim's `x_q = round(x / s + o)` is ONNX's `round(x / s) + zp` for an integer
                 o), then the dequantized weight; the bias becomes `(quant_bias + o * sum_k w_q) * deq_scale`, which
                 makes `x_dq @ w_dq^T + b` equal the engine's `(x_q @ w_q^T + quant_bias) * deq_scale`.
  W8A8_DYNAMIC   per-token symmetric int8 written with plain ONNX ops (Abs, ReduceMax, Div, Where, Round, Clip,
                 Mul): ONNX's own DynamicQuantizeLinear is per-tensor uint8, and per-axis QuantizeLinear needs a
                 constant scale; the ops compute exactly what dsconv's simulation computes.
  W8A16          weight only.
Routed experts (fused 3-D parameters, `batched_mm`): the per-token quantization of the experts' input is a pre-hook,
that of the down projection's input wraps the module's own `_apply_gate`; static W8A8 experts have per-expert input
scales that a batched gather cannot apply and are refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from dsconv.errors import UserError
from dsconv.model.quiet import quiet_transformers
from dsconv.quant.algorithms.fake_quant import fake_quant_int8_rows

SUPPORTED = ("W8A8", "W8A8_DYNAMIC", "W8A16")
ACT_QUANT = ("W8A8", "W8A8_DYNAMIC")


@dataclass
class QLayer:
    """One quantized linear as the export writes it."""

    module: str                       # checkpoint module name
    qtype: str
    q: np.ndarray                     # int8 [n, k], the quantize output's tensor
    weight_scale: np.ndarray          # float32 [n]: w = q * weight_scale
    weight: np.ndarray                # float32 [n, k] dequantized
    input_scale: float | None = None
    input_offset: float | None = None
    deq_scale: np.ndarray | None = None    # float32 [n]
    quant_bias: np.ndarray | None = None   # int32 [n]
    bias: np.ndarray | None = None         # float32 [n] stored bias

    def fake_quant_bias(self) -> np.ndarray:
        """The float bias that makes the dequantized matmul equal the engine's int32 one (see module docstring)."""
        rowsum = self.q.sum(axis=1, dtype=np.int64).astype(np.float64)
        b = (self.quant_bias.astype(np.float64) + float(self.input_offset) * rowsum) * self.deq_scale.astype(np.float64)
        return b.astype(np.float32)


@dataclass
class FusedExperts:
    """The int8 form of one fused expert parameter ([E, rows, k]) and its per-row scales."""

    name: str                         # graph initializer name (in-memory parameter name)
    q: np.ndarray                     # int8 [E, rows, k]
    scale: np.ndarray                 # float32 [E, rows]
    modules: list[str] = field(default_factory=list)


def read_layers(qck: Any) -> dict[str, QLayer]:
    """Every quantized linear of a quantize output, read back from the written tensors."""
    from dsconv.quant.formats.msmodelslim import quantized_modules, read_linear

    out: dict[str, QLayer] = {}
    for P, qtype in quantized_modules(qck.quant_description).items():
        if qtype not in SUPPORTED:
            raise UserError(f"{P} is {qtype}: the quantized ONNX export takes W8A8, W8A8_DYNAMIC and W8A16",
                            hint="int4 weights have no ONNX (opset <= 18) or AscendQuant form; quantize with "
                                 "--bits 8, or keep the layer out with --ignore")
        ql = read_linear(qck, P, qtype)
        if ql.weight_scale is not None:
            off = np.asarray(ql.weight_offset if ql.weight_offset is not None else 0.0, np.float32)
            if np.any(off != 0):
                raise UserError(f"{P}.weight_offset is not zero", hint="the export takes symmetric int8 weights "
                                "(what dsconv and msModelSlim write)")
            ws = np.asarray(ql.weight_scale, np.float32).reshape(-1)
        else:  # W8A8 static stores deq_scale = input_scale * weight_scale
            ws = (ql.deq_scale.astype(np.float64) / float(ql.input_scale)).astype(np.float32)
        if ws.size != ql.q.shape[0]:
            raise UserError(f"{P}: {ws.size} weight scales for {ql.q.shape[0]} output channels",
                            hint="the export takes per-channel scales (group_size 0)")
        layer = QLayer(P, qtype, np.ascontiguousarray(ql.q), ws, ql.dequantized(), bias=ql.bias)
        if qtype == "W8A8":
            off = float(ql.input_offset)
            if off != round(off) or not -128 <= off <= 127:
                raise UserError(f"{P}.input_offset {off} is not an int8 integer",
                                hint="ONNX and AscendQuant take an integer zero point; re-run dsconv quantize")
            layer.input_scale, layer.input_offset = float(ql.input_scale), off
            layer.deq_scale = ql.deq_scale.astype(np.float32)
            layer.quant_bias = ql.quant_bias.astype(np.int32)
        out[P] = layer
    return out


class _StaticFakeQuant(torch.autograd.Function):
    """x -> clamp(round(x / s + o), -128, 127) -> (x_q - o) * s; exported as QuantizeLinear/DequantizeLinear."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float, offset: float) -> torch.Tensor:  # type: ignore[override]
        from dsconv.quant.algorithms.schemes import fake_quant_activation

        return fake_quant_activation(x, scale, offset)

    @staticmethod
    def symbolic(g, x, scale: float, offset: float):  # type: ignore[no-untyped-def]
        s = g.op("Constant", value_t=torch.tensor(scale, dtype=torch.float32))
        z = g.op("Constant", value_t=torch.tensor(int(offset), dtype=torch.int8))
        return g.op("DequantizeLinear", g.op("QuantizeLinear", x, s, z), s, z)


class QuantLinearForward:
    """The forward of one quantized nn.Linear: activation fake quant, then the (dequantized) weight."""

    def __init__(self, mod: nn.Linear, layer: QLayer) -> None:
        self.mod, self.layer = mod, layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        L = self.layer
        if L.qtype == "W8A8":
            x = _StaticFakeQuant.apply(x, L.input_scale, L.input_offset)
        elif L.qtype == "W8A8_DYNAMIC":
            x = fake_quant_int8_rows(x)
        return nn.functional.linear(x, self.mod.weight, self.mod.bias)


def build(qck: Any, layers: dict[str, QLayer]) -> tuple[nn.Module, dict[str, FusedExperts], dict[str, Any]]:
    """(the fake-quantized torch model, fused expert int8 parameters by graph name, a report)."""
    from dsconv.model import torch_builder
    from dsconv.runner.layers import install_forward

    def load(name: str, dtype: torch.dtype) -> torch.Tensor:
        module, _, param = name.rpartition(".")
        L = layers.get(module)
        if L is not None and param == "weight":
            return torch.from_numpy(L.weight).to(dtype)
        return qck.load(name, dequantize=True).to(dtype)

    experts = "batched_mm" if qck.facts.is_moe else None
    with quiet_transformers():
        model, unused = torch_builder.build(qck, torch.float32, attn="eager", experts=experts, load=load)
    mat = torch_builder.Materialiser(qck, model)
    seen: set[str] = set()
    with torch.no_grad():
        for name, mod in model.named_modules():
            if not isinstance(mod, nn.Linear):
                continue
            L = layers.get(mat.ck_name(name))
            if L is None:
                continue
            seen.add(L.module)
            if L.qtype == "W8A8" and mod.bias is not None:
                mod.bias.copy_(torch.from_numpy(L.fake_quant_bias()))
            if L.qtype in ACT_QUANT:
                install_forward(mod, QuantLinearForward(mod, L))
    fused = _fused_experts(qck, model, mat, layers, seen)
    missing = sorted(set(layers) - seen)
    if missing:
        raise UserError(f"{len(missing)} quantized linears have no module in the model, e.g. {missing[0]}",
                        hint="the quantize output does not match its config.json")
    report = {"unused_tensors": unused, "linears": len(layers) - sum(len(f.modules) for f in fused.values()),
              "expert_linears": sum(len(f.modules) for f in fused.values())}
    return model, fused, report


def _fused_experts(qck: Any, model: nn.Module, mat: Any, layers: dict[str, QLayer],
                   seen: set[str]) -> dict[str, FusedExperts]:
    """Int8 forms of the fused expert parameters whose experts are quantized, and the activation hooks."""
    from dsconv.model.torch_builder import is_fused_experts

    family = qck.family
    out: dict[str, FusedExperts] = {}
    for mname, mod in model.named_modules():
        if not is_fused_experts(mod, family):
            continue
        prefix = mname[: -len(family.fused_experts)]
        E = int(getattr(mod, next(iter(family.fused_params))).shape[0])
        names = [{s: n[: -len(".weight")] for s, n in mat.expert_names(prefix, e).items()} for e in range(E)]
        slot_types: dict[str, set[str | None]] = {}
        for per in names:
            for slot, P in per.items():
                slot_types.setdefault(slot, set()).add(layers[P].qtype if P in layers else None)
        for slot, types in slot_types.items():
            if len(types) > 1:
                raise UserError(f"{mname}: the experts' {slot} projections mix {sorted(map(str, types))}",
                                hint="the fused expert graph applies one scheme per projection to every expert")
            if "W8A8" in types:
                raise UserError(f"{mname}: static W8A8 experts have one input scale per expert, which the fused "
                                "expert graph cannot apply", hint="quantize experts with --moe-scheme w8a8_dynamic")
        for pname, slots in family.fused_params.items():
            if slot_types.get(slots[0]) == {None}:
                continue
            per_e = [[layers[names[e][s]] for s in slots] for e in range(E)]
            q = np.stack([np.concatenate([L.q for L in Ls], axis=0) for Ls in per_e])
            scale = np.stack([np.concatenate([L.weight_scale for L in Ls]) for Ls in per_e])
            graph_name = f"{mname}.{pname}"
            out[graph_name] = FusedExperts(graph_name, q, scale, [L.module for Ls in per_e for L in Ls])
            seen.update(out[graph_name].modules)
        first = {s: next(iter(t)) for s, t in slot_types.items()}
        gate_up = [s for s in family.fused_params.get("gate_up_proj", ()) if first.get(s) == "W8A8_DYNAMIC"]
        if gate_up:
            mod.register_forward_pre_hook(_quant_experts_input)
        if first.get("down") == "W8A8_DYNAMIC":
            gate = mod._apply_gate
            mod._apply_gate = lambda x, gate=gate: fake_quant_int8_rows(gate(x))  # type: ignore[method-assign]
    return out


def _quant_experts_input(module: nn.Module, args: tuple) -> tuple:
    """Per-token quantization of the tokens entering the experts (every routed copy of a token is the same row)."""
    return (fake_quant_int8_rows(args[0]), *args[1:])


@dataclass
class Source:
    """What the quantized ONNX export needs from a quantize output (convert/quant_onnx.py duck-types it)."""

    layers: dict[str, QLayer]
    model: nn.Module
    fused: dict[str, FusedExperts]
    report: dict[str, Any]
    simulation: Callable[[], nn.Module]  # dsconv's model of the quantized output, built on demand


def load_source(qck: Any) -> Source:
    """Read the quantize output and build the fake-quantized torch model (and, lazily, the simulation)."""
    layers = read_layers(qck)
    model, fused, report = build(qck, layers)

    def simulation() -> nn.Module:
        from dsconv.quant.evaluate.fidelity import load_quantized_model

        with quiet_transformers():  # the graph has no KV cache to hold in int8: compared without it
            return load_quantized_model(qck, int8_cache=False)[0].eval()

    return Source(layers, model, fused, report, simulation)
