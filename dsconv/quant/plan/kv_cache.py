"""KV-cache int8 in the plan (`--kv-cache int8`): which attention layers get cache scales, and the tensors that carries.

Two forms, both msModelSlim's (docs/formats/kv_cache_c8.md), picked by what the model caches:

* C8 (GQA: per-head keys and values): a symmetric per-channel int8 scale over the cached key and value channels
  (num_kv_heads x head_dim, heads outermost, as k_proj/v_proj write their rows) and a zero offset, stored beside the
  projections that produce them - `<attn>.k_proj.kv_cache_scale` / `kv_cache_offset` and the same under `v_proj` -
  typed C8; globals `kv_cache_type` / `kv_quant_type` C8.
* FA quant (DeepSeek MLA: one latent per token): `<attn>.fa_q` one scale per head (the query after absorbing
  kv_b_proj's key part), `<attn>.fa_k` / `fa_v` one scale for the latent (kv_a_layernorm's output), each with a
  zero int8 offset, typed FAQuant; `<attn>.quant_type` INT8 and the global `fa_quant_type` FAKQuant.

Layers and widths come from the family's Role table (attention inputs with slot k / v; the MLA latent norm and
query projection), never from names; the scales from calibration (calibrate/kv_cache.py). DeepSeek's MTP layer keeps
a float cache (msModelSlim's recipes exclude it; transformers has no module to calibrate it with).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsconv.errors import UserError
from dsconv.families.roles import Category, Role
from dsconv.quant.formats.msmodelslim import C8, FA_LAYOUT, FA_MODULES, FA_QUANT, KV_CACHE_LAYOUT, LAYER_TYPE_KEY
from dsconv.tensors import TensorSpec

KV_CACHE_CHOICES = ("int8",)
# the description's global keys per form (msModelSlim ascendv1.py: on_dynamic_cache writes both C8 keys;
# FA quant: fa_quant_type, and INT8 under each quantized attention's `quant_type`)
GLOBALS = {C8: {"kv_cache_type": C8, "kv_quant_type": C8}, FA_QUANT: {"fa_quant_type": "FAKQuant"}}
ATTENTION_TYPE = "INT8"
SCALE, OFFSET = (suffix for suffix, _, _ in KV_CACHE_LAYOUT)


@dataclass(frozen=True)
class KVLayer:
    """One attention layer's cache scales: its form, the modules its tensors hang under (with their rows: C8 the
    k/v projections and their widths, FA quant fa_q / fa_k / fa_v and heads / 1 / 1), and the attention module."""

    layer: int
    form: str
    owners: tuple[tuple[str, int], ...]
    attn: str
    after: str  # the checkpoint tensor its tensors follow in the output (v_proj's weight; the latent norm's)
    # FA quant: the modules whose outputs are measured - the query projection, kv_b_proj (absorbed into the query),
    # the latent norm (checkpoint module names); C8 measures what the attention hands its cache instead
    measured: tuple[str, ...] = ()

    @property
    def k_module(self) -> str:
        return self.owners[0][0]

    @property
    def v_module(self) -> str:
        return self.owners[-1][0]

    def specs(self) -> list[TensorSpec]:
        """Its tensors, from the layout table (scales exact in the model dtype: the engines hold them there)."""
        layout = KV_CACHE_LAYOUT if self.form == C8 else FA_LAYOUT
        return [TensorSpec(f"{m}.{suffix}", dtype, tuple(n if d == "n" else d for d in rule))
                for m, n in self.owners for suffix, dtype, rule in layout]

    def description(self) -> dict[str, str]:
        """Its description entries: every tensor's type, and FA quant's per-attention INT8."""
        out = {s.name: self.form for s in self.specs()}
        if self.form == FA_QUANT:
            out[self.attn + LAYER_TYPE_KEY] = ATTENTION_TYPE
        return out


def plan_kv_cache(ck: Any, kv_cache: str | None) -> dict[int, KVLayer]:
    """layer -> KVLayer for `--kv-cache int8` ({} when off)."""
    if kv_cache is None:
        return {}
    if kv_cache not in KV_CACHE_CHOICES:
        raise UserError(f"unknown --kv-cache {kv_cache}", hint=f"use {', '.join(KV_CACHE_CHOICES)}")
    by_layer: dict[int, dict[str, tuple[str, int]]] = {}
    for name in ck.names():
        r = ck.role(name)
        if r.role in (Role.ATTN_IN, Role.ATTN_LATENT, Role.NORM) and r.category != Category.MTP \
                and r.param == "weight" and r.layer is not None and r.slot:
            by_layer.setdefault(r.layer, {})[r.slot] = (r.module, int(ck.info(name).shape[0]))
    out = {}
    for layer, slots in sorted(by_layer.items()):
        if ck.facts.attention_kind(layer) == "linear_attention":
            continue  # a recurrent state, no KV cache
        if ck.facts.is_mla:
            q = slots.get("q_b") or slots.get("q")
            if "kv_a_norm" not in slots or "kv_b" not in slots or q is None:
                raise UserError(f"layer {layer}: --kv-cache int8 needs the MLA latent norm and query projection",
                                hint="the checkpoint is incomplete")
            attn = slots["kv_a_norm"][0].rpartition(".")[0]
            out[layer] = KVLayer(layer, FA_QUANT, tuple((f"{attn}.{m}", n) for m, n in
                                                        zip(FA_MODULES, (ck.facts.num_heads, 1, 1))), attn,
                                 slots["kv_a_norm"][0] + ".weight",
                                 (q[0], slots["kv_b"][0], slots["kv_a_norm"][0]))
            continue
        if not {"k", "v"} <= set(slots):
            raise UserError(f"layer {layer}: --kv-cache int8 needs its k and v projections, found "
                            f"{', '.join(sorted(slots)) or 'neither'}", hint="the checkpoint is incomplete")
        out[layer] = KVLayer(layer, C8, (slots["k"], slots["v"]), slots["k"][0].rpartition(".")[0],
                             slots["v"][0] + ".weight")
    if not out:
        raise UserError(f"{ck.root}: no attention layer with a cache for --kv-cache int8")
    return out


def kv_description(kv: dict[int, KVLayer]) -> dict[str, str]:
    """The description's cache entries: the form's globals, then every layer's."""
    out: dict[str, str] = {}
    for layer in kv.values():
        out.update(GLOBALS[layer.form])
    for layer in kv.values():
        out.update(layer.description())
    return out
