"""Putting quantized tensors into the output (through dsconv.io.writer): straight into the final parts, or staged until
fallbacks are decided.

The final safetensors parts are planned before their first byte (their headers list every tensor), so a linear's type
must be known when the set is planned. With static W8A8 and a fallback policy, a unit's type is only known once its
sensitivity is measured; then each calibrated layer is staged in a scratch file (inside the output's temporary
directory, removed before commit) holding every component any final type needs, and the final set is assembled once
the decisions are in. Without pending decisions nothing is staged: one write per tensor.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dsconv.io.passthrough import copy_tensor
from dsconv.io.writer import OutputDir, TensorSetWriter
from dsconv.quant.formats.msmodelslim import (DESCRIPTION_VERSION, FLOAT, GLOBAL_KEYS, LAYER_TYPE_KEY, STAGED,
                                             LinearResult, emit_linear, layout_names)
from dsconv.quant.plan.kv_cache import kv_description
from dsconv.qformat import STATIC_TYPES, W8A8_MIX
from dsconv.quant.plan.plan import LinearPlan, QuantPlan, float_spec, linear_specs, model_quant_type
from dsconv.tensors import TensorSpec, torch_dtype

if TYPE_CHECKING:  # torch is imported by what runs a model; a weight-only run never loads it (copy speed)
    import torch

STAGING = ".dsconv-staging"


def final_specs(ck: Any, plan: QuantPlan, types: dict[str, str]) -> list[TensorSpec]:
    """Every output tensor in checkpoint order (a linear's tensors at its weight's place)."""
    out: list[TensorSpec] = []
    weights = {lp.weight: lp for lp in plan.linears.values()}
    kv_after = {kv.after: kv for kv in plan.kv.values()}  # cache scales follow their layer's v_proj / latent norm
    for name in ck.names():
        lp = weights.get(name)
        if lp is not None:
            bias_dtype = ck.info(lp.bias).dtype if lp.bias else None
            out += linear_specs(lp, types[lp.module], plan, bias_dtype)
        elif name in plan.floats:
            out.append(float_spec(plan.floats[name]))
        if name in kv_after:
            out += kv_after[name].specs()
    return out


def description(plan: QuantPlan, types: dict[str, str], specs: list[TensorSpec]) -> dict[str, Any]:
    """quant_model_description.json: the global keys, then every output tensor -> its type, in file order."""
    owner = {}
    for lp in plan.linears.values():
        owner[lp.module] = types[lp.module]
    desc: dict[str, Any] = {"model_quant_type": model_quant_type(types.values()), "version": DESCRIPTION_VERSION,
                            "group_size": plan.group_size if any(t == "W4A16" for t in types.values()) else 0}
    cache = kv_description(plan.kv)
    desc.update({k: v for k, v in cache.items() if k in GLOBAL_KEYS})
    for spec in specs:
        module, _, param = spec.name.rpartition(".")
        t = owner.get(module, FLOAT)
        if t == W8A8_MIX and param == "bias":
            t = FLOAT  # msModelSlim describes a PD-mix linear's float bias FLOAT (ascendv1.py::on_w8a8_pd_mix)
        desc[spec.name] = cache.get(spec.name) or (t if spec.name not in plan.floats else FLOAT)
    desc.update({k: v for k, v in cache.items() if k.endswith(LAYER_TYPE_KEY)})
    return desc


def as_float(t: torch.Tensor, st_dtype: str) -> torch.Tensor:
    want = torch_dtype(st_dtype)
    return t if t.dtype == want else t.to(want)


class QuantWriter:
    """Direct (types fixed now) or staged (types decided at `finish`) output of a quantization run."""

    def __init__(self, out: OutputDir, ck: Any, plan: QuantPlan, layout: str, max_shard_size: int,
                 staged: bool, name_type: str | None = None) -> None:
        self.out = out
        self.name_type = name_type  # the type legacy MindIE file names carry (config.json `quantize`)
        self.ck = ck
        self.plan = plan
        self.layout = layout
        self.max_shard_size = max_shard_size
        self.staged = staged
        self.written: set[str] = set()
        self.stage_root = out.path / STAGING
        self._stage_sets: dict[Any, TensorSetWriter] = {}
        self._stage_files: dict[str, Path] = {}  # tensor name -> staging file
        self.ts: TensorSetWriter | None = None
        self.files: list[str] = []
        self.types: dict[str, str] = {}
        self._kv: dict[str, torch.Tensor] = {}  # C8 scales kept until the final set is open (staged runs)
        if not staged:
            self._open_final({m: lp.qtype for m, lp in plan.linears.items()})

    def _bias_dtype(self, lp: LinearPlan) -> str | None:
        return self.ck.info(lp.bias).dtype if lp.bias else None

    def _open_final(self, types: dict[str, str]) -> None:
        self.types = dict(types)
        self.specs = final_specs(self.ck, self.plan, self.types)
        prefix, self.description_name = layout_names(self.layout,
                                                     self.name_type or model_quant_type(self.types.values()))
        self.ts = self.out.tensor_set(self.specs, prefix=prefix, max_shard_size=self.max_shard_size)
        self.files = self.ts.files

    # ---- layers -------------------------------------------------------------------------------------------------
    def open_layer(self, key: Any, linears: list, floats: list) -> None:
        """Staged mode: plan the scratch file of one calibrated layer (its linears' components and its floats)."""
        if not self.staged:
            return
        specs = []
        for lp in linears:
            bias_dtype = self._bias_dtype(lp)
            specs += linear_specs(lp, STAGED if lp.qtype in STATIC_TYPES else lp.qtype, self.plan, bias_dtype)
        specs += [float_spec(fp) for fp in floats]
        if not specs:
            return
        self.stage_root.mkdir(exist_ok=True)
        ts = TensorSetWriter(self.stage_root, specs, prefix=f"layer-{key}", max_shard_size=1 << 62)
        self._stage_sets[key] = ts
        for s in specs:
            self._stage_files[s.name] = self.stage_root / ts.files[0]

    def close_layer(self, key: Any) -> None:
        ts = self._stage_sets.pop(key, None)
        if ts is not None:
            ts.close()

    def _stage_set(self, name: str) -> TensorSetWriter:
        for ts in self._stage_sets.values():
            if name in ts.specs:
                return ts
        raise RuntimeError(f"{name} has no open staging set")

    def linear(self, lp: LinearPlan, res: LinearResult) -> None:
        if self.staged:  # a static candidate stages every component its final type may need; others their own
            ts = self._stage_set(lp.weight)
            for name, arr in emit_linear(lp.module, STAGED if lp.qtype in STATIC_TYPES else lp.qtype, res,
                                         self.plan.deq_dtype, chunks=lp.scale_bias_chunks):
                ts.write(name, arr)
            return
        for name, arr in emit_linear(lp.module, self.types[lp.module], res, self.plan.deq_dtype,
                                     chunks=lp.scale_bias_chunks):
            self.ts.write(name, arr)
            self.written.add(name)

    def float(self, name: str, tensor: torch.Tensor) -> None:
        t = as_float(tensor, self.plan.floats[name].dtype)
        if self.staged and name in self._stage_files:
            self._stage_set(name).write(name, t)
            return
        self.ts.write(name, t)
        self.written.add(name)

    def kv_cache(self, tensors: dict[str, torch.Tensor]) -> None:
        """A layer's C8 scales and offsets (float32, a few KiB): written now, or at `finish` when staged."""
        if self.staged:
            self._kv.update(tensors)
            return
        self._write_kv(tensors)

    def _write_kv(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self.ts.write(name, t)
            self.written.add(name)

    # ---- end ----------------------------------------------------------------------------------------------------
    def finish(self, types: dict[str, str] | None = None) -> dict[str, Any]:
        """Write whatever is not written yet (staged layers, untouched floats); return the description."""
        if self.staged:
            for key in list(self._stage_sets):
                self.close_layer(key)
            self._open_final(types or {m: lp.qtype for m, lp in self.plan.linears.items()})
            self._assemble()
            shutil.rmtree(self.stage_root, ignore_errors=True)
            self._write_kv(self._kv)
        for spec in self.specs:
            if spec.name in self.written:
                continue
            if spec.name not in self.plan.floats:
                raise RuntimeError(f"{spec.name} was never produced")  # C8 scales included: calibration makes them
            copy_tensor(self.ts.write_chunks, self.ck, spec.name, spec.dtype)
            self.written.add(spec.name)
        return description(self.plan, self.types, self.specs)

    def _assemble(self) -> None:
        from safetensors import safe_open

        handles: dict[Path, Any] = {}

        def get(name: str) -> torch.Tensor:
            path = self._stage_files[name]
            if path not in handles:
                handles[path] = safe_open(str(path), framework="pt")
            return handles[path].get_tensor(name)

        for spec in self.specs:
            if spec.name in self.written or spec.name not in self._stage_files:
                continue
            module, _, param = spec.name.rpartition(".")
            lp = self.plan.linears.get(module)
            if lp is None or lp.qtype not in STATIC_TYPES:
                self.ts.write(spec.name, get(spec.name))  # a float or a linear whose type never depended on data
                self.written.add(spec.name)
                continue
            if param != "weight":
                continue  # written with its weight (which comes first in linear_specs order)
            P = lp.module
            res = LinearResult(q=get(P + ".weight").numpy(), scale=get(P + ".weight_scale").numpy(),
                               input_scale=np.float32(get(P + ".input_scale").item()),
                               input_offset=np.float32(get(P + ".input_offset").item()),
                               deq_scale=get(P + ".deq_scale").numpy(), quant_bias=get(P + ".quant_bias").numpy(),
                               bias=get(P + ".bias") if lp.bias else None)
            for name, arr in emit_linear(P, self.types[P], res, self.plan.deq_dtype):
                self.ts.write(name, arr)
                self.written.add(name)
        handles.clear()
