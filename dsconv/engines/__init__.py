"""Which engine the output is for, and what that engine's loader accepts (profiles in profiles.py, as data).

`quantize` and `shard` take `--engine mindie|vllm-ascend` (default mindie, or `engine = "..."` in dsconv.toml). Before
any work the plan is checked against the profile: a kind given a type the engine has no scheme for is a UserError.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any, Callable, Iterable

from dsconv.engines.profiles import DEFAULT_ENGINE, ENGINES, FLOAT, KINDS, VLLM_ASCEND, EngineProfile
from dsconv.errors import UserError
from dsconv.qformat import W4A4, W8A8_MIX
from dsconv.families.residual import reads_residual
from dsconv.families.roles import Category, Role
from dsconv.tensors import PRECISIONS

__all__ = ["ENGINES", "EngineProfile", "get", "default_engine", "layer_kind", "kind_types", "assigner",
           "check_plan", "check_packing", "check_layout", "check_fallback", "check_dtype", "config_updates",
           "description_updates", "engine_dtype", "tokenizer_config", "kind_table", "FLOAT", "KINDS"]

# --bits 8 recipes per engine, for families without one of their own (Family.bits8_recipe: DeepSeek's mix)
DEFAULT_BITS8: dict[str, dict[str, str]] = {
    # MindIE reads one `quantize` region: static everywhere
    "mindie": {k: "W8A8" for k in KINDS},
    # vLLM-Ascend has no static MoE scheme: routed experts per-token dynamic. A linear attention's projections
    # (Qwen3-Next's Gated DeltaNet, 1.5% of its weights) stay float, as msModelSlim's Qwen3.5 practice keeps them: its
    # recurrence carries quantization error from token to token (tiny Qwen3-Next, `eval` KL: 0.086 static, 0.013
    # per-token dynamic, 0.002 float)
    "vllm-ascend": {"attention": "W8A8", "linear_attention": FLOAT, "dense_mlp": "W8A8",
                    "shared_experts": "W8A8", "routed_experts": "W8A8_DYNAMIC"},
}
#: the slots of a linear attention's projections (families' tables): layer kind "linear_attention"
LINEAR_ATTENTION_SLOTS = frozenset({"qkvz", "ba", "out", "in_qkv", "in_z", "in_b", "in_a"})


# `--scheme w4a8_dynamic`: msModelSlim's W4A8 practice (lab_practice/deepseek_v3/deepseek_w4a8_per_channel.yaml):
# routed experts int4 per channel, every other quantized linear W8A8_DYNAMIC (neither engine loads a per-channel
# W4A8 linear; vLLM-Ascend's W4A8 MoE needs W8A8_DYNAMIC shared experts), the engine's float-only kinds float
W4A8 = "W4A8_DYNAMIC"
W4A8_RECIPE = {"attention": "W8A8_DYNAMIC", "linear_attention": "W8A8_DYNAMIC", "dense_mlp": "W8A8_DYNAMIC",
               "shared_experts": "W8A8_DYNAMIC", "routed_experts": W4A8}
# ... and the MTP layer's linears (its experts included) W8A8_DYNAMIC, its kv_b_proj float: MindIE reads an MTP layer
# with `quantize`'s type once config.json has `mtp_quantize` (profiles: MINDIE.rules["mtp"])
W4A8_MTP = "W8A8_DYNAMIC"


# `--scheme w4a4_dynamic` (vLLM-Ascend's linear-only W4A4_DYNAMIC; docs/formats/w4a4.md): int4 activations where the
# offline rotation reaches the input (families/residual.py: q/k/v, q_a/kv_a, gate/up), W8A8_DYNAMIC elsewhere, for
# routed experts and for a linear attention's projections (its recurrence carries the error)
W4A4_OTHER = "W8A8_DYNAMIC"
W4A4_RECIPE = {"attention": W4A4, "linear_attention": W4A4_OTHER, "dense_mlp": W4A4, "shared_experts": W4A4,
               "routed_experts": W4A4_OTHER}


# `--scheme w8a8_mix` (PD-mix): every linear W8A8_MIX but routed experts, which get W8A8_DYNAMIC - what both engines
# compute for experts on any instance, and the only expert type their PD-mix loaders take (profiles: why_not
# (W8A8_MIX, moe); docs/formats/w8a8_mix.md)
W8A8_MIX_RECIPE = {**{k: W8A8_MIX for k in KINDS}, "routed_experts": "W8A8_DYNAMIC"}


def mtp_type(kind_types: dict[str, str]) -> str | None:
    """The MTP layer's type under a recipe (None: it stays float): W8A8_DYNAMIC beside W4A8 routed experts."""
    return W4A8_MTP if kind_types.get("routed_experts") == W4A8 else None


def _family(family: Any) -> Any:
    """A Family, from itself or its model_type."""
    if isinstance(family, str):
        from dsconv.families import family_for

        return family_for({"model_type": family})
    return family


def get(name: str | None) -> EngineProfile:
    name = name or default_engine()
    prof = ENGINES.get(name)
    if prof is None:
        raise UserError(f"unknown engine {name!r}", hint=f"use one of {', '.join(ENGINES)}")
    return prof


def default_engine() -> str:
    """`engine = "..."` under [defaults] in dsconv.toml, else mindie."""
    from dsconv import workspace

    ws = workspace.find()
    name = (ws.defaults or {}).get("engine") if ws is not None else None
    if name is None:
        return DEFAULT_ENGINE
    if name not in ENGINES:
        raise UserError(f"{ws.path}: engine = {name!r} is not an engine", hint=f"use one of {', '.join(ENGINES)}")
    return name


def layer_kind(r: Any) -> str | None:
    """dsconv's layer kind of a linear (a TensorRole), None for what is never quantized."""
    if r.category == Category.MTP:
        return None
    if r.role in (Role.EXPERT_IN, Role.EXPERT_OUT):
        return "routed_experts"
    if r.category == Category.SHARED_EXPERTS:
        return "shared_experts"
    if r.category == Category.DENSE_MLP:
        return "dense_mlp"
    if r.category == Category.ATTENTION:
        return "kv_b" if r.slot == "kv_b" else "linear_attention" if r.slot in LINEAR_ATTENTION_SLOTS else "attention"
    return None


def kind_types(prof: EngineProfile, family: Any, qtype: str, bits_default: bool,
               moe_qtype: str | None = None) -> dict[str, str]:
    """kind -> type: the --bits 8 recipe, or the one --scheme everywhere; --moe-scheme for routed experts; the
    engine's float-only kinds (DeepSeek kv_b_proj) FLOAT."""
    if bits_default and qtype == "W8A8":
        out = dict(_family(family).bits8_recipe or DEFAULT_BITS8[prof.name])
    elif qtype == W4A8:
        out = dict(W4A8_RECIPE)
    elif qtype == W4A4:
        out = dict(W4A4_RECIPE)
    elif qtype == W8A8_MIX:
        out = dict(W8A8_MIX_RECIPE)
    else:
        out = {k: qtype for k in KINDS}
    if moe_qtype is not None:
        out["routed_experts"] = moe_qtype
    for kind in float_only(prof, family):
        out[kind] = FLOAT
    return out


def float_only(prof: EngineProfile, family: Any) -> dict[str, Any]:
    """kind -> Rule: the layer kinds the engine must get in float (the profile's; Family.engine_float_kinds)."""
    from dsconv.engines.profiles import Rule

    own = {k: Rule(*v) for k, v in _family(family).engine_float_kinds.get(prof.name, {}).items()}
    return {**prof.float_only, **own}


def kv_recipe(prof: EngineProfile, types: dict[str, str], form: str | None) -> dict[str, str]:
    """The W4A8 recipe beside an int8 KV cache whose engine needs another attention type: msModelSlim's W4A8C8
    practice (deepseekr1_w4a8c8_per_channel.yaml) makes the MLA attention static W8A8, which MindIE's FA3 path needs
    (profiles: kv_int8). Any other recipe is left as asked (check_kv_cache refuses a mismatch)."""
    need = prof.kv_int8.get(form) if form else None
    allowed = need.attention_types if need else None
    if not allowed or types.get("routed_experts") != W4A8 or types.get("attention") in allowed:
        return types
    return {**types, "attention": sorted(allowed)[0]}


def assigner(prof: EngineProfile, family: Any, types: dict[str, str]) -> Callable[[Any], tuple[str | None, str | None]]:
    """For quant.plan.make_plan: TensorRole -> (type or None = the scheme's, reason when it must stay float)."""
    floats = float_only(prof, family)

    def assign(r: Any) -> tuple[str | None, str | None]:
        kind = layer_kind(r) or ("kv_b" if r.category == Category.MTP and r.slot == "kv_b" else None)
        if kind is None:
            return None, None
        t = types.get(kind)
        if t == W4A4 and not reads_residual(_family(family).row_key(f"{r.module}.weight")):
            t = W4A4_OTHER  # its input is a block's inner activation, which no offline rotation reaches
        if t == FLOAT:
            rule = floats.get(kind)
            return FLOAT, f"{prof.label}: {rule.text} ({rule.source})" if rule else f"{kind} kept in float"
        return t, None
    return assign


# an --ignore pattern naming a layer kind's modules in every family
IGNORE_PATTERN = {"shared_experts": "shared_expert", "routed_experts": r"experts\.\d+"}


def _alternatives(prof: EngineProfile, kind: str, qtype: str) -> str:
    lt = prof.layer_type(kind)
    ok = sorted(prof.schemes[lt])
    opt = "--moe-scheme" if kind == "routed_experts" else "--scheme"
    others = [p.label for p in ENGINES.values() if p is not prof and p.loads(qtype, kind)]
    alt = f"use {opt} {' | '.join(t.lower() for t in ok)}" if ok else "keep it in float"
    if others:
        alt += f", or --engine {' / '.join(p.name for p in ENGINES.values() if p.label in others)}"
    return alt


def runs_mix(prof: EngineProfile, family: Any, model_type: str) -> bool:
    """Whether the engine's model code for `model_type` runs W8A8_MIX linears (Family.w8a8_mix_engines)."""
    return not prof.mix_per_model or model_type in _family(family).w8a8_mix_engines.get(prof.name, ())


def check_mix(prof: EngineProfile, family: Any, model_type: str, linears: Iterable[Any]) -> None:
    """UserError (exit 2) for W8A8_MIX linears in a model whose code on this engine does not run them."""
    if runs_mix(prof, family, model_type):
        return
    example = next((lp.module for lp in linears if lp.qtype == W8A8_MIX), None)
    if example is not None:
        rule = prof.rules["w8a8_mix"]
        others = [p.name for p in ENGINES.values() if p is not prof and runs_mix(p, family, model_type)]
        raise UserError(f"--engine {prof.name}: {model_type} models cannot have W8A8_MIX linears (e.g. {example}): "
                        f"{prof.label}: {rule.text} ({rule.source})",
                        hint="use --scheme w8a8 or w8a8_dynamic" + "".join(f", or --engine {o}" for o in others))


def check_plan(prof: EngineProfile, family: Any, linears: Iterable[Any]) -> None:
    """UserError (exit 2) for the first layer kind the engine cannot load in its planned type, and for MindIE
    regions holding two quantized types. Runs on the plan, before any tensor is read."""
    by_kind: dict[str, dict[str, str]] = {}
    for lp in linears:
        kind = layer_kind(lp)
        if kind is None:
            continue
        by_kind.setdefault(kind, {}).setdefault(lp.qtype, lp.module)
    fam = _family(family)
    for kind in KINDS:
        for qtype, example in by_kind.get(kind, {}).items():
            limit = fam.engine_kind_types.get(prof.name, {}).get(kind)
            if limit is not None and qtype not in limit[0]:
                ok = sorted(t.lower() for t in limit[0] if t != FLOAT)
                others = [p.name for p in ENGINES.values() if p is not prof and p.loads(qtype, kind)
                          and qtype in fam.engine_kind_types.get(p.name, {}).get(kind, (frozenset({qtype}),))[0]]
                raise UserError(f"--engine {prof.name}: {kind} layers (e.g. {example}) cannot be {qtype} in "
                                f"{fam.name}: {prof.label}: {limit[1]} ({limit[2]})",
                                hint=f"keep them float (--ignore '{IGNORE_PATTERN.get(kind, kind)}'), use "
                                     f"--scheme {' | '.join(ok)}" + "".join(f", or --engine {o}" for o in others))
            if prof.loads(qtype, kind):
                continue
            why = prof.why_not.get((qtype, prof.layer_type(kind)))
            reason = f"{why.text} ({why.source})" if why else f"it has no {qtype} {prof.layer_type(kind)} scheme"
            raise UserError(f"--engine {prof.name}: {kind} layers (e.g. {example}) cannot be {qtype}: "
                            f"{prof.label}: {reason}", hint=_alternatives(prof, kind, qtype))
    shared = by_kind.get("shared_experts", {})
    if prof.w4a8_shared_types is not None and W4A8 in by_kind.get("routed_experts", {}):
        for qtype, example in shared.items():
            if qtype not in prof.w4a8_shared_types:
                rule = prof.rules["w4a8"]
                raise UserError(f"--engine {prof.name}: shared experts (e.g. {example}) cannot be {qtype} beside "
                                f"W4A8 routed experts: {prof.label}: {rule.text} ({rule.source})",
                                hint="use --scheme w4a8_dynamic (its recipe), or --scheme w8a8_dynamic")
    for key, kinds in prof.region_map(_family(family)).items():
        present = {t: k for k in kinds for t in by_kind.get(k, {}) if t != FLOAT}
        if len(present) > 1:
            (t1, k1), (t2, k2) = sorted(present.items())[:2]
            raise UserError(f"--engine {prof.name}: config.json `{key}` governs {', '.join(kinds)}, but {k1} would be "
                            f"{t1} and {k2} {t2}: {prof.label} reads one quantized type per region "
                            f"({prof.rules['regions'].source})",
                            hint="use --engine vllm-ascend (it reads each layer's type)" if W4A8 in present else
                            "give them one type (drop --moe-scheme), or use --engine vllm-ascend")


def preview(ck: Any, types: dict[str, str], default: str, ignore: Iterable[str] = ()) -> list[Any]:
    """The linears a plan would quantize, with their kind's type, from headers (to check before planning); modules
    an --ignore pattern names stay float (an invalid pattern is make_plan's to report)."""
    import re
    from types import SimpleNamespace

    patterns = []
    for p in ignore:
        try:
            patterns.append(re.compile(p))
        except re.error:
            pass
    out = []
    for name in ck.names():
        r = ck.role(name)
        if r.param != "weight" or not r.role.quantized_by_default or len(ck.info(name).shape) != 2:
            continue
        if any(p.search(r.module) for p in patterns):
            continue
        kind = layer_kind(r)
        if kind is not None:
            out.append(SimpleNamespace(module=r.module, role=r.role, category=r.category, slot=r.slot,
                                       qtype=types.get(kind, default)))
    return out


def check_packing(prof: EngineProfile, family: Any, linears: Iterable[Any], group_size: int) -> None:
    """UserError (exit 2) for a W4A16 group size the engine does not run (profiles: rules["group_size"]), and for
    int4 packed along the output dim (W4A16 per group) on rows the engine permutes for rope at load time
    (rules["rope_rows"])."""
    linears = list(linears)
    w4a16 = [lp for lp in linears if lp.qtype == "W4A16"]
    if w4a16 and prof.group_sizes is not None and group_size not in prof.group_sizes:
        rule = prof.rules["group_size"]
        sizes = sorted(g for g in prof.group_sizes if g and all(lp.k % g == 0 for lp in w4a16))
        raise UserError(f"--engine {prof.name}: W4A16 with --group-size {group_size} (e.g. {w4a16[0].module}): "
                        f"{prof.label}: {rule.text} ({rule.source})",
                        hint=f"use --group-size {' | '.join(map(str, [0, *sizes]))}")
    if prof.rope_rows_packed_ok:
        return
    for lp in linears:
        if lp.qtype == "W4A16" and lp.slot in family.rope_permuted_slots and group_size not in (0, lp.k):
            rule = prof.rules["rope_rows"]
            raise UserError(f"--engine {prof.name}: {lp.module} cannot be W4A16 with groups of {group_size}: "
                            f"{prof.label}: {rule.text} ({rule.source})",
                            hint="use --group-size 0 (per channel, packed along the input dim), "
                                 "or keep these float with --ignore 'q_b_proj|kv_a_proj_with_mqa'")


def check_kv_cache(prof: EngineProfile, family: Any, model_type: str, plan: Any) -> None:
    """UserError (exit 2) for int8 KV-cache scales (--kv-cache int8) the engine would not load, or not use, for this
    model type (Family.kv_int8_engines), its linears' types and the model dtype (profiles: kv_int8)."""
    form = next((kv.form for kv in plan.kv.values()), None)  # one form per model: C8 or FA quant
    if form is None:
        return
    need = prof.kv_int8[form]
    why = f"{prof.label}: {need.rule.text} ({need.rule.source})"
    loads = {name for name, types in family.kv_int8_engines.items() if model_type in types}
    others = [p.name for p in ENGINES.values() if p is not prof and p.name in loads]
    if prof.name not in loads:
        raise UserError(f"--engine {prof.name}: --kv-cache int8 is not loaded for {model_type} models: {why}",
                        hint=f"drop --kv-cache{', or use --engine ' + ' / '.join(others) if others else ''}")
    if plan.model_dtype not in need.dtypes:
        names = {st: cli for cli, st in PRECISIONS.items()}  # BF16 -> bf16, as --dtype spells them
        wanted = " or ".join(names[d] for d in sorted(need.dtypes))
        have = names.get(plan.model_dtype, plan.model_dtype)
        raise UserError(f"--engine {prof.name}: --kv-cache int8 needs {wanted} weights, the model is {have}: {why}",
                        hint=f"add --dtype {names[sorted(need.dtypes)[-1]]}")
    for what, allowed, linears in (
            ("linears", need.linear_types, plan.linears.values()),
            ("attention linears", need.attention_types, [lp for lp in plan.linears.values()
                                                         if layer_kind(lp) == "attention"])):
        bad = sorted({lp.qtype for lp in linears} - {FLOAT} - set(allowed)) if allowed else []
        if bad:
            raise UserError(f"--engine {prof.name}: --kv-cache int8 pairs with {' / '.join(sorted(allowed))} {what}, "
                            f"this plan has {', '.join(bad)}: {why}",
                            hint=f"use --scheme {' or '.join(t.lower() for t in sorted(allowed))}")


def refusal(prof: EngineProfile, family: Any) -> Any:
    """The Rule by which the engine has no model for this family (Family.engine_refused), else None."""
    from dsconv.engines.profiles import Rule

    own = _family(family).engine_refused.get(prof.name)
    return Rule(*own) if own else None


def check_engine(prof: EngineProfile, family: Any, root: Any) -> None:
    """UserError (exit 2) before any work when the engine has no model for the family."""
    rule = refusal(prof, family)
    if rule is not None:
        others = [n for n, p in ENGINES.items() if refusal(p, family) is None]
        raise UserError(f"--engine {prof.name}: {prof.label} does not load {_family(family).name} models here "
                        f"({root}): {rule.text} ({rule.source})",
                        hint=f"use --engine {' or '.join(others)}" if others else "no engine dsconv knows loads it")


def check_dtype(prof: EngineProfile, dtype: str, root: Any, family: Any = None) -> None:
    """UserError (exit 2) for a model dtype the engine does not run (rules["dtype"], Family.engine_refused_dtypes)."""
    names = {st: cli for cli, st in PRECISIONS.items()}  # BF16 -> bf16, as --dtype spells them
    own = _family(family).engine_refused_dtypes.get(prof.name) if family is not None else None
    ok = sorted(prof.dtypes - (own[0] if own else frozenset())) if prof.dtypes else ["BF16"]
    rule = (own[1], own[2]) if own is not None and dtype in own[0] else None
    if rule is None and prof.dtypes is not None and dtype not in prof.dtypes:
        rule = (prof.rules["dtype"].text, prof.rules["dtype"].source)
    if rule is not None:
        raise UserError(f"--engine {prof.name}: model dtype {names.get(dtype, dtype)} ({root}): {prof.label}: "
                        f"{rule[0]} ({rule[1]})", hint=f"add --dtype {' or '.join(names[d] for d in ok)} (quantize "
                                                       "writes the float tensors in it)")


def engine_dtype(prof: EngineProfile, family: Any, model_dtype: str) -> str:
    """The dtype the engine computes this family in (Family.engine_dtypes), else the model's."""
    fact = _family(family).engine_dtypes.get(prof.name)
    return fact[0] if fact else model_dtype


def tokenizer_config(prof: EngineProfile, text: str) -> str | None:
    """tokenizer_config.json's text as the engine's transformers reads it (profiles: rules["tokenizer"]): a
    `tokenizer_class` it resolves, list-valued keys under its names; None when nothing changes. Edited as text, so
    nothing else moves (the file may hold integers beyond dsconv's JSON reader, e.g. model_max_length 1e30)."""
    import re

    out = text
    for old, new in prof.tokenizer_classes.items():
        out = re.sub(r'("tokenizer_class"\s*:\s*)"' + re.escape(old) + '"', lambda m: m.group(1) + json.dumps(new),
                     out)
    for old, new in prof.tokenizer_list_keys.items():
        if f'"{new}"' not in out:
            out = re.sub(r'"' + re.escape(old) + r'"(\s*:\s*\[)', lambda m: json.dumps(new) + m.group(1), out)
    return out if out != text else None


def check_layout(prof: EngineProfile, layout: str) -> None:
    if layout == "mindie" and not prof.legacy_layout:
        raise UserError(f"--layout mindie: {prof.label} reads only quant_model_description.json "
                        f"({prof.rules['description'].source})", hint="use --layout msmodelslim (the default)")


def check_fallback(prof: EngineProfile, fallback: int | None, threshold: float | None) -> bool:
    """Whether per-unit fallback may run. MindIE reads one type per region: a unit falling back to another
    quantized type would be read with the region's recipe, so fallback is off for it (an explicit request is an
    error)."""
    if prof.fallback_ok:
        return True
    if (fallback is not None and fallback > 0) or threshold is not None:
        raise UserError(f"--engine {prof.name}: static W8A8 units cannot fall back to another type: {prof.label} "
                        f"reads one quantized type per region ({prof.rules['regions'].source})",
                        hint="drop --fallback/--fallback-threshold (or --ignore the sensitive layers to keep them "
                             "float), or use --engine vllm-ascend")
    return False


def region_types(prof: EngineProfile, family: Any, types: dict[str, str], kinds: dict[str, str]) -> dict[str, str]:
    """config key -> lower-case type of the linears it governs (module -> type; module -> kind)."""
    out: dict[str, str] = {}
    for key, governed in prof.region_map(_family(family)).items():
        ts = sorted({t for m, t in types.items() if kinds.get(m) in governed and t != FLOAT})
        if ts:
            out[key] = ts[0].lower()
    return out


def config_updates(prof: EngineProfile, family: Any, types: dict[str, str], kinds: dict[str, str],
                   mtp_type: str | None = None) -> dict[str, str]:
    """Keys the engine needs in config.json: MindIE `quantize` (+ DeepSeek `mla_quantize` / `moe_quantize` when they
    differ from it). vLLM-Ascend needs none (and must not find quantization_config)."""
    if not prof.config_keys:
        return {}
    regions = region_types(prof, family, types, kinds)
    quantize = regions.get("quantize") or regions.get("moe_quantize") or next(iter(regions.values()), None)
    if quantize is None:
        return {}
    out = {"quantize": quantize}
    w4a8 = W4A8.lower() in regions.values()  # msModelSlim names every region then (profiles: rules["w4a8_regions"])
    explicit = _family(family).engine_explicit_keys.get(prof.name, ())
    for key in prof.config_keys:
        if key != "quantize" and key in regions and (w4a8 or key in explicit or regions[key] != quantize):
            out[key] = regions[key]
    if mtp_type is not None and "mtp_quantize" in prof.config_keys:
        out["mtp_quantize"] = mtp_type.lower()
    return out


def description_updates(prof: EngineProfile, desc: dict[str, Any]) -> dict[str, Any]:
    """Keys the engine's description lookup needs beyond one per tensor: vLLM-Ascend reads a fused MoE layer's type
    under `<moe>.experts.weight` (profiles.VLLM_ASCEND.rules["moe_key"]); it is the type of that layer's expert 0,
    which the engine requires all its experts to share."""
    if not prof.moe_type_key:
        return {}
    out: dict[str, Any] = {}
    for name, qtype in desc.items():
        moe, sep, rest = name.partition(".experts.0.")
        if sep and rest.endswith(".weight") and rest.count(".") == 1:
            out.setdefault(moe + ".experts.weight", qtype)
    return out


def kind_table(linears: Iterable[Any], ignored: dict[str, str] | None = None,
               roles: dict[str, Any] | None = None) -> dict[str, dict[str, int]]:
    """kind -> {type: count} for --dry-run (float-only kinds counted from `ignored` with their roles)."""
    out: dict[str, Counter] = {}
    for lp in linears:
        kind = layer_kind(lp)
        if kind is not None:
            out.setdefault(kind, Counter())[lp.qtype] += 1
    for module, r in (roles or {}).items():
        kind = layer_kind(r)
        if kind is not None and module in (ignored or {}):
            out.setdefault(kind, Counter())[FLOAT] += 1
    return {k: dict(sorted(out[k].items())) for k in KINDS if k in out}


# every config.json key any engine profile writes (a re-quantized input must not keep stale ones)
ALL_CONFIG_KEYS = tuple(sorted({k for p in ENGINES.values() for k in p.config_keys}))


def _present(ck: Any) -> set[str | None]:
    return {layer_kind(r) for n in ck.names() if (r := ck.role(n)).param == "weight" and r.role.quantized_by_default}


def w4a8_recipe(ck: Any) -> dict[str, str]:
    """layer kind -> type `quantize --scheme w4a8_dynamic` gives it (both engines), for the kinds the model has."""
    t, present = kind_types(VLLM_ASCEND, ck.family, W4A8, bits_default=False), _present(ck)
    return {k: t[k] for k in KINDS if k in present}


def recipes(ck: Any) -> dict[str, dict[str, str]]:
    """engine -> layer kind -> type `quantize --bits 8` gives it (for `dsconv inspect`), for the kinds the model has."""
    present, out = _present(ck), {}
    for name, prof in ENGINES.items():
        if refusal(prof, ck.family) is not None:
            continue
        t = kind_types(prof, ck.family, "W8A8", bits_default=True)
        out[name] = {k: t[k] for k in KINDS if k in present}
    return out


def mix_engines(ck: Any) -> dict[str, str]:
    """engine -> "loads", or the rule refusing `quantize --scheme w8a8_mix` of this model (`dsconv inspect`)."""
    out = {}
    model_type = ck.config.get("model_type", "")
    for name, prof in ENGINES.items():
        if refusal(prof, ck.family) is not None:
            continue
        ok = runs_mix(prof, ck.family, model_type)
        out[name] = ("loads" + (" (routed experts W8A8_DYNAMIC)" if ck.facts.num_experts else "")) if ok else \
            f"refused: {model_type} has no PD-mix path in {prof.label} ({prof.rules['w8a8_mix'].source.split(';')[0]})"
    return out
