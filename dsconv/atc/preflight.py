"""Preflight: the ONNX model and the planned atc command against the SoC profile, before ATC runs.

Each rule is one function returning Findings; `fail` marks a compile (or deployment) that would certainly fail and
becomes a one-line UserError, `warn` a likely problem printed to stderr with its fix. The rules follow
docs/commands/atc.md ("Preflight rules") and the CANN ATC parameter reference.
Everything here reads the model header only (graph.read_model), never the weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from onnx import TensorProto

from dsconv.atc.findings import FAIL, PASS, WARN, Finding
from dsconv.atc.graph import ModelInfo, dtype_name
from dsconv.atc.options import AtcOptions, check_combinations
from dsconv.atc.profiles import SocProfile
from dsconv.atc.shapes import ShapePlan
from dsconv.tensors import human_bytes as human

PROTOBUF_LIMIT = 2 * 1024**3  # protobuf cannot serialize a message of 2 GiB or more

# ops whose inputs ATC requires to share one dtype (mixed int32/int64 fails with E89999)
ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Mod", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual",
               "Max", "Min", "Sum", "Mean", "BitShift"}
WHERE_DATA_INPUTS = (1, 2)
INT_TYPES = {TensorProto.INT32, TensorProto.INT64}
# precision modes that keep fp32 weights in fp32; every other mode stores float weights in 16 bits
KEEPS_FP32 = {"force_fp32", "must_keep_origin_dtype", "cube_fp16in_fp32out", "origin"}


@dataclass(frozen=True)
class Thresholds:
    """Limits the rules use; tests lower them instead of building multi-GB files."""

    protobuf_limit: int = PROTOBUF_LIMIT


def check_opset(info: ModelInfo, p: SocProfile) -> list[Finding]:
    v = info.opset
    if not p.opset_min <= v <= p.opset_max:
        return [Finding("opset", FAIL, f"{info.path.name} uses ONNX opset {v}; {p.soc_version} accepts "
                        f"{p.opset_min}-{p.opset_max}",
                        f"re-export with opset {p.opset_safe_max} (torch.onnx.export(..., opset_version="
                        f"{p.opset_safe_max})) or lower it with onnx.version_converter and re-check in onnxruntime")]
    if not p.opset_safe_min <= v <= p.opset_safe_max:
        return [Finding("opset", WARN, f"opset {v} is outside {p.opset_safe_min}-{p.opset_safe_max}, the range "
                        "every CANN release accepts",
                        f"if ATC rejects it, re-export with opset {p.opset_safe_max}")]
    return [Finding("opset", PASS, f"opset {v} (safe range {p.opset_safe_min}-{p.opset_safe_max})")]


def check_model_size(info: ModelInfo, th: Thresholds) -> list[Finding]:
    """A model over 2 GB must keep its weights in ONNX external data."""
    out = []
    if info.file_size >= th.protobuf_limit or info.inline_bytes >= th.protobuf_limit:
        size = max(info.file_size, info.inline_bytes)
        out.append(Finding("external-data", FAIL, f"{info.path.name} holds {human(size)} inside the protobuf "
                           f"(limit {human(th.protobuf_limit)}) without external data",
                           "re-save it with onnx.save_model(model, path, save_as_external_data=True, "
                           "all_tensors_to_one_file=True)"))
        return out
    missing, short = [], []
    for rel, need in info.external_files.items():
        f = info.path.parent / rel
        if not f.is_file():
            missing.append(rel)
        elif f.stat().st_size < need:
            short.append(f"{rel} ({f.stat().st_size} of {need} bytes)")
    if missing:
        out.append(Finding("external-data", FAIL, f"external data file {missing[0]} of {info.path.name} is missing",
                           f"copy it next to {info.path.name} (ATC reads it from there)"))
    elif short:
        out.append(Finding("external-data", FAIL, f"external data file {short[0]} is truncated",
                           "re-export or re-copy the model"))
    else:
        where = (f"{len(info.external_files)} external data file(s)" if info.external_files
                 else "weights inline")
        out.append(Finding("external-data", PASS, f"{human(info.file_size)} protobuf, {where}"))
    return out


def check_quant_dynamic(info: ModelInfo, plan: ShapePlan) -> list[Finding]:
    if info.deploy_int8:
        return []  # check_int8_deploy
    ev = info.quant_evidence
    if ev and plan.dynamic:
        return [Finding("int8-dynamic", FAIL, f"the model is INT8 ({', '.join(ev)}) and the compile uses dynamic "
                        f"shapes ({plan.mode})",
                        "INT8 deploy models need static shapes: pass one --batch and one --seq value")]
    if ev:
        return [Finding("int8-dynamic", PASS, f"INT8 model ({', '.join(ev)}) with static shapes")]
    return [Finding("int8-dynamic", PASS, "not an INT8 model")]


#: high-precision settings an AMCT deploy model must not be compiled with (ATC constraints, docs/amct_facts.md F8)
INT8_REFUSED_MODES = {"precision_mode": ("force_fp32", "must_keep_origin_dtype"), "precision_mode_v2": ("origin",)}
INT8_OPSET = (8, 16)  # CANN's ONNX operator list: AscendQuant/AscendDequant "Opset v8..v16" (F7)


def check_int8_deploy(info: ModelInfo, o: AtcOptions, plan: ShapePlan, op_precision_text: str | None = None,
                      implmode_from_user: bool = False) -> list[Finding]:
    """The ATC constraints on an AMCT deploy model (AscendQuant/AscendDequant nodes): no high-precision modes, no
    dynamic shapes, an opset CANN registers the Ascend quantization operators for."""
    asc = info.deploy_int8
    if not asc:
        return []
    out: list[Finding] = []
    why = "ATC: a quantized (AMCT) deploy model compiled in a high-precision mode gets neither INT8 speed nor the " \
          "precision"
    bad = [f"--{k} {getattr(o, k)}" for k, modes in INT8_REFUSED_MODES.items() if getattr(o, k) in modes]
    if bad:
        out.append(Finding("int8-precision", FAIL, f"{bad[0]} on an INT8 deploy model ({why})",
                           "drop it: use the profile's default (allow_mix_precision / force_fp16) or "
                           "--precision-mode allow_fp32_to_fp16"))
    else:
        out.append(Finding("int8-precision", PASS, f"precision mode {o.precision_mode or o.precision_mode_v2} keeps "
                           "the INT8 layers INT8"))
    if o.op_precision_mode is not None:
        text = op_precision_text if op_precision_text is not None else ""
        if "high_precision" in text:
            out.append(Finding("int8-op-precision", FAIL, f"--op_precision_mode {o.op_precision_mode} sets "
                               f"high_precision on an INT8 deploy model ({why})",
                               "remove the high_precision entries or the option"))
        else:
            out.append(Finding("int8-op-precision", PASS, f"--op_precision_mode {o.op_precision_mode} sets no "
                               "high_precision"))
    if o.op_select_implmode in ("high_precision", "high_precision_for_all") and implmode_from_user:
        out.append(Finding("int8-implmode", WARN, f"--op_select_implmode {o.op_select_implmode} on an INT8 deploy "
                           "model: AMCT asks for no high-precision features",
                           "use --implmode high_performance unless an accuracy problem needs it"))
    dyn = [k for k in ("dynamic_batch_size", "dynamic_image_size", "dynamic_dims", "input_shape_range")
           if getattr(o, k) is not None]
    if plan.dynamic or dyn:
        out.append(Finding("int8-dynamic", FAIL, f"INT8 deploy model with dynamic shapes "
                           f"({', '.join('--' + d for d in dyn) or plan.mode}); ATC does not support DT_INT8 inputs "
                           "with dynamic shapes",
                           "drop --dynamic-batch-size/--input-shape-range and -1 in --input-shape: give --batch/--seq "
                           "values and dsconv compiles one static .om per gear"))
    lo, hi = INT8_OPSET
    if not lo <= info.opset <= hi:
        out.append(Finding("int8-opset", FAIL, f"{info.path.name} declares opset {info.opset}; CANN registers "
                           f"AscendQuant/AscendDequant for ONNX opsets {lo}-{hi}",
                           f"re-export the quantized model with --opset {min(max(info.opset, lo), 14)}"))
    else:
        out.append(Finding("int8-opset", PASS, f"opset {info.opset}: AscendQuant/AscendDequant are registered "
                           f"({lo}-{hi})"))
    return out


def check_precision(o: AtcOptions, p: SocProfile) -> list[Finding]:
    out = []
    if o.precision_mode is not None and o.precision_mode not in p.precision_modes:
        bf16 = "bf16" in o.precision_mode
        out.append(Finding("precision-mode-soc", FAIL,
                           f"--precision_mode {o.precision_mode} is not available on {p.soc_version}"
                           + (" (no BF16)" if bf16 and not p.bf16 else ""),
                           f"use one of {', '.join(p.precision_modes)}"))
    elif o.precision_mode_v2 is not None and o.precision_mode_v2 not in p.precision_modes_v2:
        bf16 = "bfloat16" in o.precision_mode_v2
        out.append(Finding("precision-mode-soc", FAIL,
                           f"--precision_mode_v2 {o.precision_mode_v2} is not available on {p.soc_version}"
                           + (" (no BF16)" if bf16 and not p.bf16 else ""),
                           f"use one of {', '.join(p.precision_modes_v2)}"))
    else:
        out.append(Finding("precision-mode-soc", PASS,
                           f"precision mode {o.precision_mode or o.precision_mode_v2} is available on {p.soc_version}"))
    return out


def check_bf16_model(info: ModelInfo, p: SocProfile, cast_fp16: bool) -> list[Finding]:
    ev = info.bf16_evidence
    if not ev:
        return [Finding("bf16-model", PASS, "no BF16 tensors")]
    if p.bf16:
        return [Finding("bf16-model", PASS, f"BF16 model ({ev[0]}); {p.soc_version} has BF16")]
    if cast_fp16:
        return [Finding("bf16-model", PASS, f"BF16 model ({ev[0]}) cast to FP16 for {p.soc_version} (--cast-fp16)")]
    return [Finding("bf16-model", FAIL, f"{info.path.name} is BF16 ({', '.join(ev[:2])}) and {p.soc_version} has no "
                    "BF16", "pass --cast-fp16 to write an FP16 copy (checked in onnxruntime) and compile that")]


def check_mixed_int(info: ModelInfo) -> list[Finding]:
    """int32 and int64 inputs to one elementwise op fail in ATC (E89999); TopK indices are int32 inside ATC."""
    out: list[Finding] = []
    for node in info.nodes:
        if node.op_type not in ELEMENTWISE and node.op_type != "Where":
            continue
        idx = WHERE_DATA_INPUTS if node.op_type == "Where" else range(len(node.input))
        names = [node.input[i] for i in idx if i < len(node.input) and node.input[i]]
        types = {n: info.elem_types.get(n) for n in names}
        ints = {t for t in types.values() if t in INT_TYPES}
        label = node.name or f"{node.op_type} -> {node.output[0]}"
        if len(ints) == 2:
            desc = ", ".join(f"{n} {dtype_name(t)}" for n, t in types.items() if t in INT_TYPES)
            out.append(Finding("mixed-int", FAIL, f"node {label} ({node.op_type}) mixes int32 and int64 inputs "
                               f"({desc}); ATC fails with E89999",
                               "export the index math in one integer type (Cast the int32 input to int64)"))
            continue
        topk = [n for n in names if info.producers.get(n, ("",))[0] == "TopK" and info.producers[n][2] == 1]
        if topk and TensorProto.INT64 in ints and any(n not in topk for n in names):
            out.append(Finding("topk-indices", WARN, f"node {label} ({node.op_type}) combines TopK indices {topk[0]} "
                               "with an int64 tensor; ATC computes TopK indices as int32 (E89999 in the field)",
                               "Cast the other input to int32, or the TopK indices to int64 right after TopK"))
    if not any(f.rule == "mixed-int" for f in out):
        out.append(Finding("mixed-int", PASS, "no elementwise op mixes int32 and int64"))
    return out


def check_ops(info: ModelInfo, p: SocProfile) -> list[Finding]:
    unknown = {op: nodes for op, nodes in info.nodes_by_type.items()
               if op not in p.onnx_ops and op not in p.onnx_ops_doubtful}
    doubtful = {op: nodes for op, nodes in info.nodes_by_type.items() if op in p.onnx_ops_doubtful}
    too_new = {op: since for op, since in p.onnx_ops_min_opset.items()
               if op in info.nodes_by_type and info.opset < since}
    out = []
    if unknown:
        parts = []
        for op, nodes in sorted(unknown.items()):
            more = f" +{len(nodes) - 3} more" if len(nodes) > 3 else ""
            parts.append(f"{op} ({', '.join(nodes[:3])}{more})")
        out.append(Finding("onnx-ops", FAIL, f"operator type(s) not in the {p.soc_version} profile: "
                           + "; ".join(parts) + " (ATC: EZ3003/E19010)",
                           "rewrite them with supported ONNX ops before export, or, if your CANN release supports "
                           "them, add them to onnx_ops in a copy of the profile and pass --profile"))
    if too_new:
        op, since = sorted(too_new.items())[0]
        out.append(Finding("onnx-ops", FAIL, f"{op} needs opset {since}, the model declares {info.opset}",
                           f"re-export with opset >= {since} or without {op}"))
    for op, nodes in sorted(doubtful.items()):
        out.append(Finding("onnx-ops-doubtful", WARN, f"{op} ({', '.join(nodes[:3])}"
                           + (f" +{len(nodes) - 3} more" if len(nodes) > 3 else "") + f"): {p.onnx_ops_doubtful[op]}",
                           "if ATC rejects it, rewrite it before export (for INT8: msModelSlim's Ascend quant ops)"))
    if not unknown and not too_new:
        out.append(Finding("onnx-ops", PASS, f"all {len(info.nodes_by_type)} operator types are in the profile"
                           + (f" ({len(doubtful)} with a warning)" if doubtful else "")))
    return out


def estimate_weight_bytes(info: ModelInfo, precision: str | None, cast_fp16: bool) -> int:
    """Device bytes of the weights in the .om: fp32/bf16 weights shrink to 16 bits unless the mode keeps fp32."""
    total = 0
    for t in (*info.initializers, *info.constants):
        if t.data_type == TensorProto.FLOAT and (cast_fp16 or precision not in KEEPS_FP32):
            total += t.nbytes // 2
        elif t.data_type == TensorProto.BFLOAT16 and cast_fp16:
            total += t.nbytes
        else:
            total += t.nbytes
    return total


def check_memory(info: ModelInfo, p: SocProfile, precision: str | None, cast_fp16: bool) -> list[Finding]:
    need = estimate_weight_bytes(info, precision, cast_fp16)
    usable = p.usable_memory_mb * 1024**2
    frac = need / usable
    figures = f"{human(need)} of weights vs {human(usable)} usable on {p.soc_version}"
    if need > usable:
        return [Finding("weight-memory", FAIL, f"the weights do not fit one device: {figures}",
                        "quantize (dsconv quantize --bits 8) or shard across devices (dsconv shard) first")]
    if frac > p.memory_warn_fraction:
        return [Finding("weight-memory", WARN, f"weights use {frac:.0%} of the device ({figures}); KV cache and "
                        "workspace need 20-30% more", "use fewer/smaller gears, quantize, or shard")]
    return [Finding("weight-memory", PASS, f"{figures} ({frac:.1%})")]


def check_soc(o: AtcOptions, p: SocProfile) -> list[Finding]:
    if o.soc_version != p.soc_version:
        return [Finding("soc-version", FAIL, f"--soc_version {o.soc_version} differs from the profile's "
                        f"{p.soc_version}", "regenerate the command from the profile")]
    return [Finding("soc-version", PASS, f"--soc_version={o.soc_version}")]


def run_preflight(info: ModelInfo, profile: SocProfile, opts: AtcOptions, plan: ShapePlan, *, cast_fp16: bool = False,
                  thresholds: Thresholds = Thresholds(), op_precision_text: str | None = None,
                  implmode_from_user: bool = False) -> list[Finding]:
    """Every rule, in the order a user would fix them."""
    findings: list[Finding] = []
    findings += check_opset(info, profile)
    findings += check_model_size(info, thresholds)
    findings += check_soc(opts, profile)
    findings += plan.findings
    findings += check_combinations(opts)
    findings += check_quant_dynamic(info, plan)
    findings += check_int8_deploy(info, opts, plan, op_precision_text, implmode_from_user)
    findings += check_precision(opts, profile)
    findings += check_bf16_model(info, profile, cast_fp16)
    findings += check_mixed_int(info)
    findings += check_ops(info, profile)
    findings += check_memory(info, profile, opts.precision_mode or opts.precision_mode_v2, cast_fp16)
    # one verdict per rule id and status is enough; keep order, drop exact duplicates
    seen, out = set(), []
    for f in findings:
        if f not in seen:
            seen.add(f)
            out.append(f)
    # a pass is noise when the same rule also failed or warned
    bad_rules = {f.rule for f in out if f.status != PASS}
    return [f for f in out if f.status != PASS or f.rule not in bad_rules]

