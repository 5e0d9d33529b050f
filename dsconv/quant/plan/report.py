"""Fallback decisions, the calibration report (quant_report.json) and the terminal summary of `dsconv quantize`.

Fallback units are what an engine fuses (q/k/v, gate/up, all experts of a layer): a unit keeps one type. A unit's
sensitivity is its linears' relative output error under static W8A8 (fake-quantized activations and dequantized
weights vs float, on calibration rows): the maximum over its members, or for routed experts the token-weighted RMS
over experts (an expert that saw three tokens must not decide for the 255 others).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsconv.qformat import FA_QUANT, FA_QUANT_WHERE, MIX_WHERE, W8A8_MIX
from dsconv.qformat import STATIC_TYPES
from dsconv.quant.plan.plan import ACT_QUANT, QuantPlan, model_quant_type
from dsconv.quant.plan.recipe import RECIPE_FLOAT_REASON


@dataclass
class LinearRecord:
    """What quantizing one linear measured (goes to quant_report.json)."""

    module: str
    planned: str
    weight_error: float
    tokens: int | None = None
    errors: dict[str, float] = field(default_factory=dict)  # output error on calibration rows, by type
    range_source: str | None = None  # "own" | "borrowed" (under-covered expert: union of the layer's ranges)
    note: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"planned": self.planned, "weight_error": round(self.weight_error, 6)}
        if self.tokens is not None:
            d["tokens"] = self.tokens
        if self.errors:
            d["output_error"] = {k: round(v, 6) for k, v in self.errors.items()}
        if self.range_source:
            d["range"] = self.range_source
        if self.note:
            d["note"] = self.note
        return d


REPORT_FILE = "quant_report.json"
EXPERT_LOAD_FILE = "expert_load.json"


@dataclass
class Decision:
    types: dict[str, str]                           # module -> final type
    units: list[dict[str, Any]] = field(default_factory=list)
    fell_back: list[str] = field(default_factory=list)  # units
    target: str | None = None
    policy: str | None = None


def unit_errors(plan: QuantPlan, records: dict[str, Any]) -> dict[str, tuple[float | None, int]]:
    """unit -> (static W8A8 sensitivity, members); None when nothing was measured."""
    out: dict[str, tuple[float | None, int]] = {}
    for unit, members in plan.units().items():
        if members[0].qtype not in STATIC_TYPES:
            continue
        errs = [(records[lp.module].errors.get("static"), records[lp.module].tokens or 0, lp.is_expert)
                for lp in members if lp.module in records]
        errs = [e for e in errs if e[0] is not None]
        if not errs:
            out[unit] = (None, len(members))
        elif errs[0][2]:  # routed experts: token-weighted RMS
            tot = sum(t for _, t, _ in errs)
            if any(math.isinf(e) for e, _, _ in errs):
                out[unit] = (float("inf"), len(members))
            elif tot:
                out[unit] = (math.sqrt(sum(t * e * e for e, t, _ in errs) / tot), len(members))
            else:
                out[unit] = (math.sqrt(sum(e * e for e, _, _ in errs) / len(errs)), len(members))
        else:
            out[unit] = (max(e for e, _, _ in errs), len(members))
    return out


def decide(plan: QuantPlan, records: dict[str, Any], policy: tuple[str, float] | None, target: str) -> Decision:
    types = {m: lp.qtype for m, lp in plan.linears.items()}
    if policy is None:
        errs = unit_errors(plan, records)
        units = [{"unit": u, "error": _r(e), "members": n, "fell_back": False} for u, (e, n) in errs.items()]
        return Decision(types, units)
    kind, value = policy
    errs = unit_errors(plan, records)
    ranked = sorted(errs.items(), key=lambda kv: (-(kv[1][0] if kv[1][0] is not None else -1.0), kv[0]))
    forced = {u for u, (e, _) in errs.items() if e is not None and math.isinf(e)}
    if kind == "count":
        chosen = {u for u, (e, _) in ranked[: int(value)] if e is not None} | forced
        label = f"worst {int(value)}"
    else:
        chosen = {u for u, (e, _) in errs.items() if e is not None and e > value} | forced
        label = f"error > {value:g}"
    units = []
    for u, (e, n) in ranked:
        units.append({"unit": u, "error": _r(e), "members": n, "fell_back": u in chosen})
    for lp in plan.linears.values():
        if lp.unit in chosen:
            types[lp.module] = target
    return Decision(types, units, sorted(chosen, key=lambda u: [x["unit"] for x in units].index(u)), target, label)


def _r(x: float | None) -> float | None:
    if x is None:
        return None
    return x if math.isinf(x) else round(x, 6)


@dataclass
class Findings:
    """What the calibrated path found beyond each linear's record: the smoothing log, the searches and choices by
    kind (clipping, awq, gptq_or_rtn) and the tokens routed to each expert per layer."""

    smoothing: list[dict[str, Any]]
    decisions: dict[str, Any]
    expert_counts: dict[int, list[int]]


def build_report(ck: Any, plan: QuantPlan, opts: Any, records: dict[str, Any], decision: Decision,
                 policy: tuple[str, float] | None, found: Findings | None, calib: Any) -> dict[str, Any]:
    """quant_report.json: deterministic (no timings), so reruns are comparable byte for byte."""
    layers: dict[str, dict[str, Any]] = {}
    for lp in plan.linears.values():
        rec = records.get(lp.module)
        key = str(lp.layer) if lp.layer is not None else "-"
        d = layers.setdefault(key, {"linears": 0, "types": Counter(), "errors": []})
        d["linears"] += 1
        d["types"][decision.types[lp.module]] += 1
        if rec is not None:
            d["errors"].append(rec.weight_error)
    per_layer = {}
    for key, d in layers.items():
        errs = d.pop("errors")
        per_layer[key] = {"linears": d["linears"], "types": dict(sorted(d["types"].items())),
                          "weight_error_mean": round(sum(errs) / len(errs), 6) if errs else None,
                          "weight_error_max": round(max(errs), 6) if errs else None}
    linears = {}
    for m, lp in plan.linears.items():
        rec = records.get(m)
        entry = rec.as_dict() if rec is not None else {"planned": lp.qtype}
        entry["type"] = decision.types[m]
        linears[m] = entry
    report: dict[str, Any] = {
        "scheme": plan.scheme, "method": plan.method, "group_size": plan.group_size,
        "recipe": getattr(opts, "recipe", None) if plan.scheme in STATIC_TYPES else None,
        "act_method": opts.act_method if plan.scheme in STATIC_TYPES else None,
        "smooth_quant": opts.smooth_alpha if plan.scheme in ACT_QUANT else None,
        "model_quant_type": model_quant_type(decision.types.values()),
        "calibration": calib.describe() if calib is not None else None,
        "fallback": {"policy": decision.policy, "target": decision.target, "units": decision.units,
                     "fell_back": decision.fell_back},
        "kept_float": {**plan.ignored, **{fp.name: "role kept in float" for fp in plan.floats.values()
                                          if fp.role.is_linear and fp.name.endswith(".weight")
                                          and fp.name[:-7] not in plan.ignored}},
        "layers": per_layer,
        "linears": linears,
    }
    if plan.method == "gptq":  # the GPTQ settings (weights.quantize_weight: act order, static groups)
        report["gptq"] = {"damp": opts.damp, "act_order": True, "static_groups": True}
    if found is not None:
        report["smoothing"] = found.smoothing
        report.update({k: v for k, v in found.decisions.items() if v})
        if found.expert_counts:
            report["experts"] = expert_coverage(found.expert_counts, opts.min_expert_tokens, opts.all_experts,
                                                records, plan)
    return report


def expert_coverage(counts: dict[int, list[int]], min_tokens: int, all_experts: bool, records: dict[str, Any],
                    plan: QuantPlan) -> dict[str, Any]:
    under = {str(layer): {str(e): c for e, c in enumerate(cs) if c < min_tokens} for layer, cs in sorted(counts.items())}
    under = {k: v for k, v in under.items() if v}
    borrowed = sorted({lp.layer for m, lp in plan.linears.items()
                       if lp.is_expert and records.get(m) is not None and records[m].range_source == "borrowed"})
    return {"min_expert_tokens": min_tokens, "all_experts": all_experts,
            "layers": {str(k): {"routed": sum(v), "experts": len(v), "min": min(v), "max": max(v),
                                "under_min": sum(1 for c in v if c < min_tokens), "never": sum(1 for c in v if c == 0)}
                       for k, v in sorted(counts.items())},
            "under_min": under,
            "borrowed_range_layers": borrowed}


def summary(ck: Any, plan: QuantPlan, opts: Any, report: dict[str, Any], decision: Decision, output: Path,
            files: list[str], seconds: float, calibration_seconds: float) -> dict[str, Any]:
    """The --json summary (and what the terminal rendering reads)."""
    types = Counter(decision.types.values())
    return {"output": str(output), "model": str(ck.root), "scheme": plan.scheme, "method": plan.method,
            "model_quant_type": report["model_quant_type"], "group_size": plan.group_size,
            "linears": dict(sorted(types.items())), "kept_float": len(report["kept_float"]),
            "calibration": report["calibration"], "fallback": report["fallback"], "layers": report["layers"],
            "experts": report.get("experts"), "smoothing": report.get("smoothing"),
            "decisions": decisions_summary(report), "kv_cache": kv_cache_summary(plan),
            "files": files, "seconds": round(seconds, 2), "calibration_seconds": round(calibration_seconds, 2)}


def render(s: dict[str, Any]) -> str:
    """Terminal summary: per-layer weight error, fallback decisions, expert coverage."""
    lines = [f"{s['scheme']} ({s['method']}{', group ' + str(s['group_size']) if s['group_size'] else ''}) -> "
             f"{s['output']}: {', '.join(f'{n} {t}' for t, n in s['linears'].items())}; "
             f"{s['kept_float']} linear(s) kept in float" + _kv_text(s.get("kv_cache")) + _mix_text(s["linears"])]
    c = s.get("calibration")
    if c:
        lines.append(f"calibration: {c['samples']} samples, {c['tokens']} tokens (seq-len {c['seq_len']}) from "
                     f"{c['source']}")
    else:
        lines.append("calibration: none needed (round-to-nearest weights, no static activation ranges)")
    lines.append("layer  linears  weight error mean / max  types")
    for key, d in sorted(s["layers"].items(), key=lambda kv: _layer_order(kv[0])):
        mean = d["weight_error_mean"]
        err = f"{mean * 100:.2f}% / {d['weight_error_max'] * 100:.2f}%" if mean is not None else "-"
        lines.append(f"{key:>5}  {d['linears']:>7}  {err:>23}  " + ", ".join(f"{t} {n}" for t, n in d["types"].items()))
    fb = s["fallback"]
    if fb["units"]:
        worst = [u for u in fb["units"] if u["error"] is not None][:5]
        lines.append("static W8A8 sensitivity (relative output error), worst units: " +
                     ", ".join(f"{u['unit']} {u['error'] * 100:.1f}%" for u in worst))
    if fb["policy"]:
        if fb["fell_back"]:
            lines.append(f"fallback ({fb['policy']}) to {fb['target']}: {len(fb['fell_back'])} unit(s): " +
                         ", ".join(fb["fell_back"][:12]) + (" ..." if len(fb["fell_back"]) > 12 else ""))
        else:
            lines.append(f"fallback ({fb['policy']}): none")
    sm = s.get("smoothing")
    if sm:
        done = [x for x in sm if x["applied"]]
        lines.append(f"smoothing: {len(done)} site(s) folded" +
                     (f"; skipped {len(sm) - len(done)} ({sm[[x['applied'] for x in sm].index(False)]['reason']})"
                      if len(done) < len(sm) else ""))
    for line in decisions_lines(s.get("decisions") or {}):
        lines.append(line)
    ex = s.get("experts")
    if ex:
        short = ex["under_min"]
        if short:
            lines.append(f"experts with < {ex['min_expert_tokens']} calibration tokens: " + "; ".join(
                f"layer {k}: {len(v)} ({', '.join(f'e{e}={n}' for e, n in list(v.items())[:6])}"
                f"{' ...' if len(v) > 6 else ''})" for k, v in short.items()))
            if ex["borrowed_range_layers"]:
                lines.append("  their static ranges were widened to the layer's (union); --all-experts calibrates "
                             "every expert on every token")
        else:
            lines.append(f"experts: every expert got >= {ex['min_expert_tokens']} calibration tokens")
        lines.append(f"expert load written to {EXPERT_LOAD_FILE} (for `dsconv shard`)")
    lines.append(f"done in {s['seconds']:.1f}s")
    return "\n".join(lines)


def _layer_order(key: str) -> tuple[int, int, str]:
    """Layers in numeric order (0, 1, 2, ... 10), then named groups such as `model`."""
    return (0, int(key), "") if key.isdigit() else (1, 0, key)


def decisions_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The accuracy decisions in a few numbers (details per site/linear stay in quant_report.json)."""
    out: dict[str, Any] = {}
    if report.get("recipe"):
        out["recipe"] = report["recipe"]
        if report["recipe"] == "mixed":
            kept = sum(1 for why in report["kept_float"].values() if why == RECIPE_FLOAT_REASON)
            out["recipe_down_proj"] = "float" if kept else "W8A8_DYNAMIC"
    searched = [e["search"] for e in report.get("smoothing") or [] if "search" in e]
    if searched:
        out["smoothing_alphas"] = dict(sorted(Counter(str(x["alpha"]) if x["alpha"] is not None else "off"
                                                      for x in searched).items()))
    clips = report.get("clipping") or {}
    if clips:
        out["clipped_inputs"] = sum(1 for c in clips.values() if c["ratio"] < 1.0)
        out["static_inputs"] = len(clips)
    if report.get("gptq"):
        out["gptq_damp"] = report["gptq"]["damp"]
    if report.get("awq"):
        out["awq"] = awq_summary(report["awq"])
    choice = report.get("gptq_or_rtn") or {}
    if choice:
        out["gptq_or_rtn"] = dict(sorted(Counter(choice.values()).items()))
    return out


def decisions_lines(d: dict[str, Any]) -> list[str]:
    lines = []
    if d.get("recipe"):
        if d["recipe"] != "mixed":
            lines.append(f"recipe: {d['recipe']} (every linear static)")
        elif d.get("recipe_down_proj") == "float":
            lines.append("recipe: mixed (down_proj kept float: the engine reads one quantized type per region; "
                         "the rest static)")
        else:
            lines.append("recipe: mixed (down_proj per-token dynamic, the rest static)")
    if d.get("smoothing_alphas"):
        lines.append("smoothing strength chosen per site by output error: " +
                     ", ".join(f"{a} x{n}" for a, n in d["smoothing_alphas"].items()))
    if "clipped_inputs" in d:
        lines.append(f"static ranges clipped by output error: {d['clipped_inputs']} of {d['static_inputs']} inputs")
    if "gptq_damp" in d:
        lines.append(f"GPTQ: act order, static groups, damping {d['gptq_damp']:g} x mean(diag H)")
    if d.get("awq"):
        a = d["awq"]
        lines.append(f"awq: {a['folded']} of {a['sites']} site(s) scaled (alpha " +
                     (", ".join(f"{k} x{n}" for k, n in a["alphas"].items()) or "-") + "); weights per linear on "
                     "held-out prompts: " + ", ".join(f"{k} {n}" for k, n in a["choice"].items()))
    if d.get("gptq_or_rtn"):
        lines.append("weights, chosen per linear on held-out prompts: " +
                     ", ".join(f"{k} {n}" for k, n in d["gptq_or_rtn"].items()))
    return lines


def plan_summary(ck: Any, plan: QuantPlan, opts: Any, policy: tuple[str, float] | None,
                 calibrate: bool) -> dict[str, Any]:
    """--dry-run: the plan from headers (types, sizes), nothing computed or written."""
    from dsconv.quant.formats.output import final_specs

    types = {m: lp.qtype for m, lp in plan.linears.items()}
    specs = final_specs(ck, plan, types)
    return {"dry_run": True, "scheme": plan.scheme, "method": plan.method, "group_size": plan.group_size,
            "linears": dict(Counter(types.values())), "kept_float": {**plan.ignored},
            "tensors": len(specs), "output_bytes": sum(s.nbytes for s in specs),
            "input_bytes": sum(ck.info(n).nbytes for n in ck.names()), "calibration": calibrate,
            "fallback": None if policy is None else f"{policy[0]} {policy[1]:g} -> {opts.fallback_to}",
            "kv_cache": kv_cache_summary(plan)}


def kv_cache_summary(plan: QuantPlan) -> dict[str, Any] | None:
    """--kv-cache int8: the form (C8 / FAQuant), its layers and how many scales (None when the cache stays in the
    model dtype)."""
    if not plan.kv:
        return None
    form = next(iter(plan.kv.values())).form
    return {"type": form, "layers": len(plan.kv),
            "scales": sum(n for kv in plan.kv.values() for _, n in kv.owners),
            **({"used": FA_QUANT_WHERE} if form == FA_QUANT else {})}


def _mix_text(linears: dict[str, int]) -> str:
    return f"; W8A8_MIX runs {MIX_WHERE}" if W8A8_MIX in linears else ""


def _kv_text(kv: dict[str, Any] | None) -> str:
    if not kv:
        return ""
    where = f": {FA_QUANT_WHERE}" if kv["type"] == FA_QUANT else ""
    return f"; KV cache int8 ({kv['type']} scales for {kv['layers']} layers{where})"


def render_plan(p: dict[str, Any]) -> str:
    return (f"dry run: {p['scheme']} ({p['method']}): {', '.join(f'{n} {t}' for t, n in p['linears'].items())}, "
            f"{len(p['kept_float'])} linear(s) kept in float by option; {p['tensors']} output tensors, "
            f"{p['output_bytes'] / 1e9:.3f} GB (input {p['input_bytes'] / 1e9:.3f} GB); calibration "
            f"{'yes' if p['calibration'] else 'not needed'}; fallback {p['fallback'] or 'none'}"
            + _kv_text(p.get("kv_cache")) + _mix_text(p["linears"]))


def awq_summary(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts for the printed summary of --method awq's sites (quant_report.json's "awq"): sites folded, alphas
    chosen, per-linear choice."""
    alphas = Counter(str(e["alpha"]) for e in entries if e.get("applied"))
    choice = Counter(c for e in entries for c in (e.get("choice") or {}).values())
    return {"sites": len(entries), "folded": sum(1 for e in entries if e.get("applied")),
            "alphas": dict(sorted(alphas.items())), "choice": dict(sorted(choice.items()))}
