"""KV-cache int8 (C8) in the plan: which attention layers get cache scales, and the tensors that carries.

msModelSlim's C8 form (docs/formats/kv_cache_c8.md): per attention layer, a symmetric per-channel int8 scale over
the cached key and value channels (num_kv_heads x head_dim, heads outermost, as k_proj/v_proj write their rows) and
a zero offset, stored beside the projections that produce them - `<attn>.k_proj.kv_cache_scale` / `kv_cache_offset`
and the same under `v_proj` - typed "C8" in the description, whose globals say `kv_cache_type` / `kv_quant_type`
"C8". Which layers and widths is read from the family's Role table (attention inputs with slot k / v), never from
names; the scales come from calibration (the post-rope keys and values the cache receives: calibrate/kv_cache.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsconv.errors import UserError
from dsconv.families.roles import Category, Role
from dsconv.quant.formats.msmodelslim import C8, KV_CACHE_LAYOUT
from dsconv.tensors import TensorSpec

KV_CACHE_CHOICES = ("int8",)
# the description's global keys for a C8 model (msModelSlim ascendv1.py::on_dynamic_cache writes both)
GLOBALS = {"kv_cache_type": C8, "kv_quant_type": C8}
SCALE, OFFSET = (suffix for suffix, _, _ in KV_CACHE_LAYOUT)


@dataclass(frozen=True)
class KVLayer:
    """One attention layer's cache: the modules producing its keys and values, and their widths (channels)."""

    layer: int
    k_module: str
    v_module: str
    k_width: int
    v_width: int

    def specs(self) -> list[TensorSpec]:
        """Its four tensors, from the layout table: per channel (scales exact in the model dtype: the engines hold
        them there)."""
        return [TensorSpec(f"{m}.{suffix}", dtype, tuple(w if d == "n" else d for d in rule))
                for m, w in ((self.k_module, self.k_width), (self.v_module, self.v_width))
                for suffix, dtype, rule in KV_CACHE_LAYOUT]


def plan_kv_cache(ck: Any, kv_cache: str | None) -> dict[int, KVLayer]:
    """layer -> KVLayer for `--kv-cache int8` ({} when off); a UserError for a model whose cache has no C8 form."""
    if kv_cache is None:
        return {}
    if kv_cache not in KV_CACHE_CHOICES:
        raise UserError(f"unknown --kv-cache {kv_cache}", hint=f"use {', '.join(KV_CACHE_CHOICES)}")
    if ck.facts.is_mla:
        raise UserError(f"{ck.root}: --kv-cache int8 is the C8 form of GQA caches (per-channel key/value scales); "
                        f"{ck.family.name} caches an MLA latent, whose int8 form (FA quant: fa_q/fa_k/fa_v scales "
                        "after weight absorption) dsconv does not write",
                        hint="drop --kv-cache (vLLM-Ascend enables FA quant on A2/A3 only on a PD-disaggregated "
                             "decode instance)")
    found: dict[int, dict[str, tuple[str, int]]] = {}
    for name in ck.names():
        r = ck.role(name)
        if r.role == Role.ATTN_IN and r.category == Category.ATTENTION and r.param == "weight" \
                and r.slot in ("k", "v") and r.layer is not None:
            found.setdefault(r.layer, {})[r.slot] = (r.module, int(ck.info(name).shape[0]))
    out = {}
    for layer, kv in sorted(found.items()):
        if set(kv) != {"k", "v"}:
            raise UserError(f"layer {layer}: --kv-cache int8 needs its k and v projections, found only "
                            f"{', '.join(sorted(kv))}", hint="the checkpoint is incomplete")
        out[layer] = KVLayer(layer, kv["k"][0], kv["v"][0], kv["k"][1], kv["v"][1])
    if not out:
        raise UserError(f"{ck.root}: no attention layer with k/v projections for --kv-cache int8")
    return out


def kv_types(kv: dict[int, KVLayer]) -> dict[str, str]:
    """Every C8 tensor name -> its description type."""
    return {s.name: C8 for layer in kv.values() for s in layer.specs()}
