"""The quantization plan, from headers alone: which linear gets which type, and every output tensor's name/dtype/shape.

Decisions come from the family's Role table (`ck.role(name)`), never from names: a tensor is a quantized linear when
its role is quantized by default, its param is `weight`, it is not an MTP tensor (kept in float: the MTP module needs
its own forward for calibration) and no `--ignore` regex of the user matches its module. Fallback *units* are the
groups an engine fuses and must keep in one type: (layer, role, category), e.g. q/k/v of a layer, gate/up of a dense
MLP, all routed experts' gate/up of a layer.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from dsconv.errors import UserError
from dsconv.families.roles import Category, Role
from dsconv.engines import W4A8
from dsconv.qformat import ACT_QUANT, STATIC_TYPES, W4A4, scale_bias_chunks  # noqa: F401  (ACT_QUANT: read from here)
from dsconv.quant.algorithms.schemes import check_group_size
from dsconv.quant.formats.msmodelslim import FLOAT, linear_layout
from dsconv.quant.plan.kv_cache import KVLayer, plan_kv_cache
from dsconv.quant.plan.recipe import RECIPE_FLOAT_REASON, planned_type
from dsconv.tensors import TensorSpec

# scheme option -> description type
SCHEMES = {"w8a8": "W8A8", "w8a8_dynamic": "W8A8_DYNAMIC", "w8a8_mix": "W8A8_MIX", "w8a16": "W8A16",
           "w4a16": "W4A16", "w4a8_dynamic": "W4A8_DYNAMIC", "w4a4_dynamic": W4A4}
DEFAULT_SCHEME = {8: "w8a8", 4: "w4a16"}
BITS = {"W8A8": 8, "W8A8_DYNAMIC": 8, "W8A8_MIX": 8, "W8A16": 8, "W4A16": 4, "W4A8_DYNAMIC": 4, W4A4: 4}
# the description's model_quant_type: most aggressive first (fewer weight bits, then static activations, then
# dynamic, then weight-only; W4A4_DYNAMIC outranks every 8-bit type in msModelSlim's list too). W4A8_DYNAMIC is not
# in msModelSlim's list (a mixed DeepSeek file says W8A8_DYNAMIC; ascendv1.py QUANT_TYPE_PRIORITY), and engines read
# it that way.
AGGRESSIVENESS = (W4A4, "W4A16", "W8A8", "W8A8_MIX", "W8A8_DYNAMIC", "W8A16", FLOAT)
FALLBACK_TARGETS = ("w8a8_dynamic", "w8a16")


def model_quant_type(types: Iterable[str]) -> str:
    present = set(types)
    return next((t for t in AGGRESSIVENESS if t in present), FLOAT)


@dataclass
class LinearPlan:
    """One linear layer P of the checkpoint and the type it gets."""

    module: str               # P: checkpoint name without `.weight`
    weight: str               # checkpoint tensor name of the weight
    bias: str | None          # checkpoint tensor name of the bias, if any
    shape: tuple[int, int]    # [n, k]
    src_dtype: str            # checkpoint dtype of the weight (BF16, F16, F32, F8_E4M3)
    role: Role
    category: Category
    layer: int | None
    expert: int | None
    slot: str | None
    qtype: str                # planned type (may fall back later for W8A8 units)
    unit: str                 # fallback unit key

    @property
    def n(self) -> int:
        return self.shape[0]

    @property
    def k(self) -> int:
        return self.shape[1]

    @property
    def is_expert(self) -> bool:
        return self.role in (Role.EXPERT_IN, Role.EXPERT_OUT)

    @property
    def scale_bias_chunks(self) -> int:
        """A W4A8 scale_bias's columns: 16 k-chunks for a row-parallel layer (input split by TP), else 1."""
        return scale_bias_chunks(self.role.tp_dim)


@dataclass
class FloatPlan:
    """A tensor kept in floating point (FP8 weights are written dequantized, in the model dtype)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    role: Role
    layer: int | None
    src_dtype: str


@dataclass
class QuantPlan:
    scheme: str                      # the requested scheme, e.g. "W8A8"
    group_size: int                  # W4A16 group (0 = per channel); 0 for 8-bit schemes
    method: str                      # rtn | mse | gptq (methods.py)
    model_dtype: str                 # BF16 / F16 / F32: the checkpoint's
    linears: dict[str, LinearPlan]   # by module P, checkpoint order
    floats: dict[str, FloatPlan]     # by tensor name, checkpoint order
    dropped: list[str]               # FP8 weight_scale_inv auxiliaries (consumed by dequantization)
    ignored: dict[str, str] = field(default_factory=dict)  # module -> why it stays float
    kv: dict[int, KVLayer] = field(default_factory=dict)   # layer -> its C8 cache scales (--kv-cache int8)
    engine_dtype: str = ""           # what the engine computes in (engines.engine_dtype): decides deq_scale storage

    @property
    def deq_dtype(self) -> str:
        return "I64" if (self.engine_dtype or self.model_dtype) == "F16" else "F32"

    def units(self) -> dict[str, list[LinearPlan]]:
        out: dict[str, list[LinearPlan]] = {}
        for lp in self.linears.values():
            out.setdefault(lp.unit, []).append(lp)
        return out

    def by_layer(self) -> dict[int | None, list[LinearPlan]]:
        out: dict[int | None, list[LinearPlan]] = {}
        for lp in self.linears.values():
            out.setdefault(lp.layer, []).append(lp)
        return out


def _check_w4a8(module: str, role: Role, shape: tuple[int, int], group_size: int) -> None:
    """The per-channel W4A8 form's shape rules (msModelSlim save/utils/pack.py): int4 packed in pairs of output
    rows, and a row layer's k cut in 16 scale_bias chunks; one group_size (0) for the whole description."""
    n, k = shape
    if group_size:
        raise UserError(f"layer {module}: W4A8_DYNAMIC is written per channel (the description's one group_size is "
                        f"0), so it cannot share a model with --group-size {group_size}",
                        hint="drop --group-size, or give the other layers an 8-bit scheme")
    chunks = scale_bias_chunks(role.tp_dim)
    if n % 2 or k % chunks:
        need = "an even number of output rows" if n % 2 else f"an input width divisible by {chunks}"
        raise UserError(f"layer {module}: W4A8_DYNAMIC needs {need} (int4 packed in row pairs, scale_bias in "
                        f"{chunks} chunks), got {list(shape)}", hint=f"add --ignore '{re.escape(module)}$' to keep it "
                        "in float")


def unit_of(role: Role, category: Category, layer: int | None) -> str:
    return f"{'' if layer is None else layer}:{category.value}/{role.value}"


def make_plan(ck: Any, scheme: str, group_size: int | None = None, method: str = "rtn",
              ignore: Iterable[str] = (), assign: Callable[[Any], tuple[str | None, str | None]] | None = None,
              recipe: str = "mixed", mix_ok: bool = True, mtp_type: str | None = None,
              kv_cache: str | None = None, engine_dtype: str | None = None) -> QuantPlan:
    """Decide every tensor's fate from headers; all user errors (bad group size, odd int4 rows) surface here.

    `assign` (from dsconv.engines) gives a layer's type by its kind: (type or None for the scheme's, why FLOAT); where
    it leaves the type to the scheme, the recipe decides (recipe.py), with `mix_ok` False for an engine that reads one
    quantized type per region. `kv_cache` "int8" adds the C8 cache scales of every attention layer (kv_cache.py)."""
    qtype = SCHEMES[scheme]
    bits = BITS[qtype]
    if bits == 8:
        if group_size:
            raise UserError(f"--group-size {group_size} applies to 4-bit schemes only",
                            hint="8-bit weights are quantized per output channel; drop --group-size")
        group_size = 0
    elif group_size is None:
        group_size = 0 if qtype in (W4A8, W4A4) else 128
    patterns = []
    for p in ignore:
        try:
            patterns.append(re.compile(p))
        except re.error as e:
            raise UserError(f"--ignore {p!r} is not a valid regular expression ({e})") from None
    facts = ck.facts
    model_dtype = facts.dtype if facts.dtype in ("BF16", "F16", "F32") else "BF16"
    linears: dict[str, LinearPlan] = {}
    floats: dict[str, FloatPlan] = {}
    dropped: list[str] = []
    ignored: dict[str, str] = {}
    names = ck.names()
    fp8_aux = set(ck.fp8_scales.values())  # a set: a dict view's `in` scans every value (quadratic over DeepSeek)
    biases = {}
    for name in names:
        r = ck.role(name)
        if r.param == "bias":
            biases[r.module] = name
    for name in names:
        r = ck.role(name)
        info = ck.info(name)
        if r.is_aux:
            if name in fp8_aux:
                dropped.append(name)
                continue
            raise UserError(f"tensor {name} is a quantization auxiliary ({r.param})",
                            hint="the input is already quantized; quantize the original float checkpoint")
        if r.param == "weight" and r.role.quantized_by_default and len(info.shape) == 2:
            reason = None
            if r.category == Category.MTP and mtp_type is None:
                reason = "MTP layer (kept in float)"
            else:
                hit = next((p.pattern for p in patterns if p.search(r.module)), None)
                if hit is not None:
                    reason = f"--ignore {hit}"
            layer_type = qtype
            if reason is None and assign is not None:
                t, why = assign(r)
                reason = why if t == FLOAT else None
                layer_type = t if t not in (None, FLOAT) else qtype
            if reason is None and r.category == Category.MTP:
                layer_type = mtp_type  # the recipe's type for the MTP layer (rounded to nearest, never calibrated)
            if reason is None:  # the recipe refines a static W8A8 layer, whoever chose it
                layer_type = planned_type(layer_type, r.role, recipe, mix_ok)
                if layer_type == FLOAT:
                    reason = RECIPE_FLOAT_REASON
            if reason is None:
                n, k = info.shape
                if layer_type == W4A8:
                    _check_w4a8(r.module, r.role, (n, k), group_size)
                elif layer_type == W4A4 and group_size:
                    raise UserError(f"layer {r.module}: W4A4_DYNAMIC is per channel (vLLM-Ascend reads weight_scale "
                                    f"[n, 1]), so it cannot share a model with --group-size {group_size}",
                                    hint="drop --group-size")
                elif BITS[layer_type] == 4:
                    check_group_size(k, group_size, r.module)
                    if (k % 2 if group_size in (0, k) else n % 2):  # per channel packs along k, per group along n
                        raise UserError(f"layer {r.module}: int4 packing needs an even number of "
                                        f"{'input columns' if group_size in (0, k) else 'output rows'}, got "
                                        f"{list(info.shape)}",
                                        hint=f"add --ignore '{re.escape(r.module)}$' to keep it in float")
                linears[r.module] = LinearPlan(
                    module=r.module, weight=name, bias=biases.get(r.module), shape=(n, k), src_dtype=info.dtype,
                    role=r.role, category=r.category, layer=r.layer, expert=r.expert, slot=r.slot, qtype=layer_type,
                    unit=unit_of(r.role, r.category, r.layer))
                continue
            ignored[r.module] = reason
        if r.param == "bias" and r.module in linears:
            continue  # written with its linear
        out_dtype = model_dtype if info.dtype.startswith("F8_") else info.dtype
        floats[name] = FloatPlan(name, out_dtype, tuple(info.shape), r.role, r.layer, info.dtype)
    # a bias whose linear is quantized was skipped above only if the linear came first; fix the order-independence
    for module, lp in linears.items():
        if lp.bias is not None:
            floats.pop(lp.bias, None)
    if not linears:
        raise UserError(f"{ck.root}: no linear layer is left to quantize",
                        hint="check --ignore: it excludes every quantizable layer")
    static = [lp.qtype for lp in linears.values() if lp.qtype in STATIC_TYPES]
    if static and qtype not in STATIC_TYPES:
        qtype = static[0]  # a recipe with static layers calibrates (plan.scheme drives calibration and fallback)
    return QuantPlan(scheme=qtype, group_size=group_size, method=method, model_dtype=model_dtype, linears=linears,
                     floats=floats, dropped=dropped, ignored=ignored, kv=plan_kv_cache(ck, kv_cache),
                     engine_dtype=engine_dtype or model_dtype)


# ------------------------------------------------------------------------------------------- output tensors
def linear_specs(lp: LinearPlan, qtype: str, plan: QuantPlan, bias_dtype: str | None) -> list[TensorSpec]:
    """The tensors a linear of type `qtype` (or STAGED) has in the output, in the layout table's order."""
    n, k = lp.shape
    groups = 1 if plan.group_size == 0 else k // plan.group_size
    bias = (bias_dtype or plan.model_dtype) if lp.bias is not None else None
    return [TensorSpec(*t) for t in linear_layout(lp.module, qtype, n, k, groups, plan.deq_dtype, bias,
                                                  lp.scale_bias_chunks)]


def float_spec(fp: FloatPlan) -> TensorSpec:
    return TensorSpec(fp.name, fp.dtype, fp.shape)
