"""Checkpoint tensors -> MindSpore Parameters, one tensor at a time, with the bookkeeping that proves the mapping.

The builder (build.py) asks for tensors by the names the family table gives (never a name of its own); routed
experts are found through the family's roles (layer, expert, slot), so per-expert and fused checkpoints and every
family's expert naming look the same. Every tensor handed out is recorded: after the build, a checkpoint tensor the network did
not consume (MTP layers aside) is an error, never a silent drop.

Quantized inputs (msModelSlim layout): W8A16 and W4A16 linear weights stay int8 Parameters (int4 stays packed two
per byte) with their float32 `weight_scale`/`weight_offset`; the graph dequantizes them (blocks.dequantize).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor

from dsconv.errors import UserError
from dsconv.qformat import cache_tensors
from dsconv.families.roles import Category, Role

from dsconv.model.ms.blocks import ExpertWeights, Linear

WEIGHT_ONLY = ("W8A16", "W4A16")
FLOAT_TYPES = ("FLOAT", None)


@dataclass(frozen=True)
class Precision:
    """`--dtype`: how float weights are stored in the MindIR and which dtype the graph computes in.

    bf16 stores bf16 weights but computes in float32: MindSpore 2.10's CPU kernels have no bf16 MatMul, Softmax
    or Gather, and every export is checked on CPU, so a bf16-compute graph could not be proven here.
    """

    name: str

    @property
    def storage(self):
        return {"fp32": ms.float32, "fp16": ms.float16, "bf16": ms.bfloat16}[self.name]

    @property
    def compute(self):
        return {"fp32": ms.float32, "fp16": ms.float16, "bf16": ms.float32}[self.name]

    @property
    def compute_name(self) -> str:
        return {"fp32": "fp32", "fp16": "fp16", "bf16": "fp32"}[self.name]


def _ms_tensor(arr: np.ndarray, dtype) -> Tensor:
    if dtype == ms.float32:
        return Tensor(np.ascontiguousarray(arr, dtype=np.float32))
    if dtype == ms.float16:
        return Tensor(np.ascontiguousarray(arr, dtype=np.float16))
    return Tensor(np.ascontiguousarray(arr), dtype=dtype)


class WeightSource:
    """Hands out Parameters built from one checkpoint tensor at a time; records what was used and how."""

    def __init__(self, ck, precision: Precision) -> None:
        self.ck = ck
        self.precision = precision
        self.compute = precision.compute
        self.used: set[str] = set()
        self.linear_kinds: Counter = Counter()  # float / W8A16 / W4A16 -> number of linear weights
        self.param_bytes = 0
        desc = ck.quant_description or {}
        self.qdesc = desc
        self._experts = self._index_experts()

    # ---- raw access ---------------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.ck.tensors

    def _take(self, name: str):
        t = self.ck.load(name, dequantize=True)
        self.used.add(name)
        scale = self.ck.fp8_scales.get(name)
        if scale is not None:
            self.used.add(scale)
        return t

    def _float_array(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        info = self.ck.info(name)
        if tuple(info.shape) != tuple(shape):
            raise UserError(f"tensor {name} has shape {list(info.shape)} but config.json implies {list(shape)}",
                            hint="the weights do not belong to this config")
        if info.dtype in ("I8", "U8", "I32", "I64"):
            raise UserError(f"tensor {name} is {info.dtype} where a float tensor is expected",
                            hint="only linear weights can be quantized (W8A16/W4A16) for the MindIR export")
        return self._take(name).float().numpy()

    def _param(self, arr: np.ndarray, dtype, name: str) -> Parameter:
        t = _ms_tensor(arr, dtype)
        self.param_bytes += t.nbytes
        return Parameter(t, name=name, requires_grad=False)

    def float_param(self, name: str, shape: tuple[int, ...], fp32: bool = False) -> Parameter:
        """A float tensor stored in the export dtype (or float32: routers, correction biases)."""
        return self._param(self._float_array(name, shape), ms.float32 if fp32 else self.precision.storage, name)

    # ---- linear layers --------------------------------------------------------------------------------------
    def quant_type(self, weight_name: str) -> str | None:
        if weight_name not in self.qdesc:
            return None if self.ck.info(weight_name).dtype != "I8" else self.qdesc.get("model_quant_type")
        return self.qdesc[weight_name]

    def _quantized(self, prefix: str, out_f: int, in_f: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, str] | None:
        """(int8 weight, scale [n, G], offset [n, G], int4 layout) for a weight-only quantized linear, else None."""
        wname = prefix + ".weight"
        info = self.ck.info(wname)
        qtype = self.quant_type(wname)
        if info.dtype != "I8" and qtype in FLOAT_TYPES:
            return None
        if qtype not in WEIGHT_ONLY or info.dtype != "I8":
            raise UserError(f"{wname}: quantization type {qtype} ({info.dtype}) is not supported by the MindIR export",
                            hint="MindIR export takes weight-only quantized models (W8A16, W4A16); for W8A8 export "
                                 "the unquantized model")
        for aux in (".input_scale", ".deq_scale", ".quant_bias"):
            if self.has(prefix + aux):
                raise UserError(f"{prefix}{aux}: activation quantization (W8A8) is not supported by the MindIR export",
                                hint="export weight-only quantized models (W8A16, W4A16) or the unquantized model")
        shape = tuple(info.shape)
        if shape == (out_f, in_f) and qtype == "W8A16":
            layout = ""
        elif qtype == "W4A16" and out_f % 2 == 0 and shape == (out_f // 2, in_f):
            layout = "rows"
        elif qtype == "W4A16" and in_f % 2 == 0 and shape == (out_f, in_f // 2):
            layout = "cols"
        else:
            raise UserError(f"{wname}: {qtype} weight has shape {list(shape)}, which does not hold a [{out_f}, {in_f}] "
                            "layer", hint="the quantized checkpoint does not match its config")
        q = self._take(wname).numpy()
        if not self.has(prefix + ".weight_scale"):
            raise UserError(f"{wname} is {qtype} but {prefix}.weight_scale is missing",
                            hint="the quantized checkpoint is incomplete")
        scale = self._take(prefix + ".weight_scale").float().numpy()
        if scale.size % out_f or in_f % (scale.size // out_f):
            raise UserError(f"{prefix}.weight_scale has shape {list(scale.shape)}, which fits no per-channel or "
                            f"per-group layout of a [{out_f}, {in_f}] weight",
                            hint="the quantized checkpoint is damaged")
        scale = scale.reshape(out_f, -1).astype(np.float32)
        if self.has(prefix + ".weight_offset"):
            offset = self._take(prefix + ".weight_offset").float().numpy()
            if offset.size != scale.size:
                raise UserError(f"{prefix}.weight_offset has shape {list(offset.shape)}, scale has "
                                f"{list(scale.shape)}", hint="the quantized checkpoint is damaged")
            offset = offset.reshape(scale.shape).astype(np.float32)
        else:
            offset = np.zeros_like(scale)
        return q, scale, offset, layout

    def linear(self, prefix: str, in_f: int, out_f: int) -> Linear:
        """`prefix.weight` [out_f, in_f] (float or weight-only quantized) and `prefix.bias` when the checkpoint has
        one (Qwen2's qkv bias, Llama's attention_bias/mlp_bias) -> a Linear cell."""
        compute = self.compute
        bias = self.float_param(prefix + ".bias", (out_f,)) if self.has(prefix + ".bias") else None
        quant = self._quantized(prefix, out_f, in_f)
        if quant is None:
            self.linear_kinds["float"] += 1
            return Linear(self.float_param(prefix + ".weight", (out_f, in_f)), compute, bias)
        q, scale, offset, layout = quant
        self.linear_kinds[self.quant_type(prefix + ".weight")] += 1
        return Linear(self._param(q, ms.int8, prefix + ".weight"), compute, bias,
                      self._param(scale, ms.float32, prefix + ".weight_scale"),
                      self._param(offset, ms.float32, prefix + ".weight_offset"), layout)

    # ---- routed experts -------------------------------------------------------------------------------------
    def _index_experts(self) -> dict[tuple[int, int, str], str]:
        """(layer, expert, slot) -> module path, from the family's roles (never from names)."""
        out = {}
        for name, r in self.ck.roles.items():
            if r.role in (Role.EXPERT_IN, Role.EXPERT_OUT) and r.param == "weight":
                out[(r.layer, r.expert, r.slot)] = r.module
        return out

    def experts(self, layer: int, n_experts: int, slot: str, in_f: int, out_f: int) -> ExpertWeights:
        """One projection (gate/up/down) of all routed experts of a layer, stacked [E, out_f, in_f]."""
        float_parts: list[np.ndarray] = []
        quant_parts: list[tuple] = []
        for e in range(n_experts):
            module = self._experts.get((layer, e, slot))
            if module is None:
                raise UserError(f"layer {layer}: routed expert {e} has no {slot} projection in {self.ck.root}",
                                hint="the checkpoint is incomplete or does not match config.json")
            quant = self._quantized(module, out_f, in_f)
            if quant is None:
                float_parts.append(self._float_array(module + ".weight", (out_f, in_f)))
            else:
                self.linear_kinds[self.quant_type(module + ".weight")] += 1
                quant_parts.append(quant)
            if float_parts and quant_parts:
                raise UserError(f"layer {layer}: routed experts mix quantized and float {slot} projections",
                                hint="quantize all experts of a layer the same way")
        base = self.ck.family.module(f"expert.{slot}", layer, "all")  # a name of the stack, from the table
        if float_parts:
            self.linear_kinds["float"] += n_experts
            return ExpertWeights(self._param(np.stack(float_parts), self.precision.storage, base), self.compute)
        layouts = {p[3] for p in quant_parts}
        shapes = {(p[0].shape, p[1].shape) for p in quant_parts}
        if len(layouts) != 1 or len(shapes) != 1:
            raise UserError(f"layer {layer}: routed experts' {slot} projections are quantized differently",
                            hint="quantize all experts of a layer with the same scheme and group size")
        q = self._param(np.stack([p[0] for p in quant_parts]), ms.int8, base)
        scale = self._param(np.stack([p[1] for p in quant_parts]), ms.float32, base + "_scale")
        offset = self._param(np.stack([p[2] for p in quant_parts]), ms.float32, base + "_offset")
        return ExpertWeights(q, self.compute, scale, offset, layouts.pop())

    # ---- bookkeeping ----------------------------------------------------------------------------------------
    def unused(self) -> list[str]:
        """Checkpoint tensors the network did not consume (MTP modules are not part of the exported model, nor are
        a quantize output's int8 KV-cache scales: the graph has no cache)."""
        cache = cache_tensors(self.ck.quant_description)
        return [n for n, r in self.ck.roles.items() if n not in self.used and r.category != Category.MTP
                and n not in cache]

    def skipped_mtp(self) -> int:
        return sum(1 for r in self.ck.roles.values() if r.category == Category.MTP)
