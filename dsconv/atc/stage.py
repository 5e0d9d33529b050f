"""The `atc` stage, `run(AtcRequest) -> AtcResult`: profile + model header -> decisions -> preflight ->
OUTPUT/<soc>/ files [-> atc run].

Plan first, then write: every option is decided (and its source recorded) and every preflight rule run before a byte
is written; a rule that makes the compile certainly fail stops here with a one-line UserError. OUTPUT may hold
several SoCs (`dsconv atc --soc Ascend910B` then `--soc Ascend310P3`): a run replaces only its own SoC directory
(`--force` when it exists) and carries the others over into the new transaction.
"""
from __future__ import annotations

import os
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from dsconv import __version__
from dsconv.atc.cast import DEFAULT_TOLERANCE, cast_model, check_fp16
from dsconv.atc.findings import FAIL, PASS, WARN, Finding, raise_failures, summary_text
from dsconv.atc.fusion import FusionSwitches, build_switches
from dsconv.atc.graph import ModelInfo, read_model
from dsconv.atc.options import (IMPLMODES, LOG_LEVELS, PRECISION_MODES, PRECISION_MODES_V2, AtcOptions, InputShape,
                                check_choice)
from dsconv.atc.preflight import Thresholds, estimate_weight_bytes, run_preflight
from dsconv.atc.profiles import Decisions, SocProfile, load_profile
from dsconv.atc.runner import RunResult, find_atc, run_script
from dsconv.atc.shapes import ShapePlan, plan_shapes
from dsconv.errors import UserError
from dsconv.io.writer import MANIFEST, OutputDir, read_manifest

FP16_MODEL = "model_fp16.onnx"


@dataclass
class AtcRequest:
    """Everything `dsconv atc` was asked; None means "the profile's default"."""

    onnx: Path
    output: Path
    soc: str | None = None
    profile: Path | None = None
    batch: Sequence[int] | None = None
    seq: Sequence[int] | None = None
    past: Sequence[int] | None = None
    input_shape: str | None = None
    dynamic_batch_size: bool = False
    input_shape_range: bool = False
    precision_mode: str | None = None
    precision_mode_v2: str | None = None
    implmode: str | None = None
    op_precision_mode: Path | None = None
    optypelist: Sequence[str] | None = None
    fusion: Sequence[str] = ()
    keep_dtype: Sequence[str] = ()
    cast_fp16: bool = False
    fp16_tolerance: float = DEFAULT_TOLERANCE
    log: str | None = None
    run: bool = False
    atc_bin: Path | None = None
    force: bool = False
    thresholds: Thresholds = field(default_factory=Thresholds)
    warn: Callable[[str], None] | None = None
    echo: Callable[[str], None] | None = None  # streamed atc log lines


@dataclass
class AtcPlan:
    """Every decision for one compile, made from the profile, the model header and the request."""

    profile: SocProfile
    info: ModelInfo
    options: AtcOptions
    decisions: Decisions
    shapes: ShapePlan
    switches: FusionSwitches
    findings: list[Finding]
    gears: list[Gear] = field(default_factory=list)  # INT8 deploy models: one static compile per gear


@dataclass
class Gear:
    """One static compile of an INT8 deploy model: its shapes, command and script."""

    label: str          # b1_s128[_p512]
    shapes: ShapePlan
    options: AtcOptions

    @property
    def script(self) -> str:
        return f"atc_{self.label}.sh"


@dataclass
class AtcResult:
    """What one run wrote (OUTPUT/<soc>/), the --json summary, the preflight findings and the atc run, if any."""

    output: Path
    soc_dir: Path
    soc_version: str
    summary: dict[str, Any]
    findings: list[Finding]
    run: RunResult | None = None


def _values(cli: Sequence[int] | None, default: tuple[int, ...], flag: str, p: SocProfile, d: Decisions,
            key: str) -> tuple[int, ...]:
    if cli:
        if any(v <= 0 for v in cli):
            raise UserError(f"{flag} values must be positive, got {','.join(map(str, cli))}")
        return d.set(key, tuple(sorted(set(cli))), flag)
    return d.set(key, default, p.source, f"gears.{key} default")


def plan(req: AtcRequest) -> AtcPlan:
    """Decide every option and run preflight; nothing is written. Raises UserError on a failed rule."""
    for flag, value, choices in (("--precision-mode", req.precision_mode, PRECISION_MODES),
                                 ("--precision-mode-v2", req.precision_mode_v2, PRECISION_MODES_V2),
                                 ("--implmode", req.implmode, IMPLMODES), ("--log", req.log, LOG_LEVELS)):
        check_choice(value, choices, flag)
    profile = load_profile(req.soc, req.profile)
    d = Decisions()
    soc = profile.soc_version
    if profile.assumed_from:
        d.set("soc_version", soc, f"family {profile.assumed_from} assumes {soc}",
              f"pass --soc with the chip `npu-smi info` prints if it is not {soc}")
    else:
        d.set("soc_version", soc, "--profile" if req.profile else "--soc")
    d.set("profile_files", [Path(f).name for f in profile.files], "--profile" if req.profile else "bundled")
    info = read_model(req.onnx)
    bf16_model = bool(info.bf16_evidence)
    quantized = bool(info.quant_evidence)
    extra: list[Finding] = []
    # ---- shapes and gears
    mode = "dynamic_dims"
    if req.dynamic_batch_size and req.input_shape_range:
        extra.append(Finding("one-dynamic-option", FAIL, "--dynamic-batch-size and --input-shape-range are both given",
                             "ATC takes one dynamic shape option per model; keep one"))
    elif req.dynamic_batch_size:
        mode = "dynamic_batch_size"
    elif req.input_shape_range:
        mode = "range"
    batch = _values(req.batch, profile.gear_batch, "--batch", profile, d, "batch")
    seq = _values(req.seq, profile.gear_seq, "--seq", profile, d, "seq")
    past = _values(req.past, profile.gear_past, "--past", profile, d, "past")
    user_shape = InputShape.parse(req.input_shape, "--input-shape") if req.input_shape else None
    shapes = plan_shapes(info.inputs, batch=batch, seq=seq, past=past, mode=mode, user_shape=user_shape,
                         max_gears=profile.max_gears, min_gears=profile.min_gears,
                         max_dims_per_gear=profile.max_dims_per_gear)
    int8 = info.deploy_int8
    gear_plans: list[ShapePlan] = []
    if int8 and user_shape is not None and (user_shape.dynamic_count or user_shape.has_ranges):
        extra.append(Finding("int8-dynamic", FAIL, f"--input-shape {req.input_shape} keeps dynamic dimensions on an "
                             "INT8 deploy model; ATC does not support DT_INT8 inputs with dynamic shapes",
                             "give sizes instead of -1/ranges, or use --batch/--seq: dsconv compiles one static .om "
                             "per gear"))
    elif int8 and shapes.mode == "dynamic_dims" and shapes.gears:
        # INT8 deploy models take no dynamic shapes (docs/amct_facts.md F8): each gear becomes its own static compile
        for g in shapes.gears:
            gear_plans.append(plan_shapes(info.inputs, batch=(g["batch"],), seq=(g.get("seq", seq[0]),),
                                          past=(g.get("past", past[0]),), user_shape=user_shape,
                                          max_gears=profile.max_gears, min_gears=profile.min_gears,
                                          max_dims_per_gear=profile.max_dims_per_gear))
        values, shapes = shapes.values, gear_plans[0]
        shapes.values = values
    for key in ("batch", "seq", "past"):
        if key not in shapes.values:
            d.items[key].note = "not used: no input dimension of the model has this role"
    if gear_plans:
        d.set("shape_mode", "static_per_gear", "the model is an INT8 (AMCT) deploy model",
              f"{len(gear_plans)} static compiles, one .om per gear: ATC takes no dynamic shapes for DT_INT8")
    else:
        d.set("shape_mode", shapes.mode, "--dynamic-batch-size" if req.dynamic_batch_size else
              "--input-shape-range" if req.input_shape_range else "default: --dynamic_dims gears", shapes.note)
    if user_shape is not None:
        d.set("input_shape_given", req.input_shape, "--input-shape")
    # ---- precision
    if req.precision_mode or req.precision_mode_v2:
        if req.precision_mode:
            d.set("precision_mode", req.precision_mode, "--precision-mode")
        if req.precision_mode_v2:
            d.set("precision_mode_v2", req.precision_mode_v2, "--precision-mode-v2")
    elif bf16_model and profile.bf16 and profile.precision_default_bf16_model and not req.cast_fp16:
        d.set("precision_mode", profile.precision_default_bf16_model, profile.source,
              "precision.default_bf16_model: the model is BF16")
    else:
        d.set("precision_mode", profile.precision_default, profile.source, "precision.default")
    pm = d.items.get("precision_mode")
    pm2 = d.items.get("precision_mode_v2")
    # ---- implementation mode
    if req.implmode:
        implmode = d.set("op_select_implmode", req.implmode, "--implmode")
        optypes = tuple(req.optypelist) if req.optypelist else None
        if optypes:
            d.set("optypelist_for_implmode", optypes, "--optypelist")
    elif int8 and profile.implmode_default.startswith("high_precision"):
        implmode = d.set("op_select_implmode", "high_performance", "the model is an INT8 (AMCT) deploy model",
                         f"instead of the profile's {profile.implmode_default}: AMCT deploy models take no "
                         "high-precision features")
        optypes = tuple(req.optypelist) if req.optypelist else None
    else:
        implmode = d.set("op_select_implmode", profile.implmode_default, profile.source, "implmode.default")
        optypes = tuple(req.optypelist) if req.optypelist else (profile.optypelist_default or None)
        if optypes:
            d.set("optypelist_for_implmode", optypes, "--optypelist" if req.optypelist else profile.source)
    # ---- fusion
    switches, notes = build_switches(profile, list(req.fusion), quantized)
    extra += [Finding("quant-fusion", WARN, n, "") for n in notes]
    if quantized:
        d.set("fusion_quantized_off", list(profile.quantized_off_graph + profile.quantized_off_ub), profile.source,
              "the model is INT8: " + "; ".join(info.quant_evidence))
    log = d.set("log", req.log or profile.log, "--log" if req.log else profile.source)
    # ---- the command
    if req.cast_fp16:
        model_arg = FP16_MODEL
        d.set("model", FP16_MODEL, "--cast-fp16", f"FP16 copy of {req.onnx}, checked in onnxruntime")
    else:
        model_arg = str(Path(req.onnx).absolute())
        d.set("model", model_arg, "--onnx")
    opts = AtcOptions(
        model=model_arg, framework=5, output="model", soc_version=soc, input_format="ND",
        input_shape=shapes.input_shape, dynamic_dims=shapes.dynamic_dims,
        dynamic_batch_size=shapes.dynamic_batch_size,
        precision_mode=pm.value if pm else None, precision_mode_v2=pm2.value if pm2 else None,
        op_select_implmode=implmode, optypelist_for_implmode=optypes, fusion_switch_file="fusion_switch.cfg",
        op_precision_mode=str(Path(req.op_precision_mode).absolute()) if req.op_precision_mode else None,
        keep_dtype="keep_dtype.cfg" if req.keep_dtype else None, log=log,
    )
    AtcOptions.from_json(opts.to_json(), where=f"command built from {profile.path.name}")  # every value parses
    op_text = None
    if req.op_precision_mode is not None:
        if not Path(req.op_precision_mode).is_file():
            raise UserError(f"--op-precision-mode {req.op_precision_mode} does not exist",
                            hint="pass the ini file ATC's --op_precision_mode reads")
        op_text = Path(req.op_precision_mode).read_text(errors="replace")
    findings = extra + run_preflight(info, profile, opts, shapes, cast_fp16=req.cast_fp16,
                                     thresholds=req.thresholds, op_precision_text=op_text,
                                     implmode_from_user=bool(req.implmode))
    gears = []
    for gp in gear_plans:
        g = gp.gears[0]
        label = "_".join(f"{k[0]}{g[k]}" for k in ("batch", "seq", "past") if k in g and k in shapes.values)
        gears.append(Gear(label or "static", gp, opts.with_(input_shape=gp.input_shape, output=f"model_{label}")))
    if gears:
        findings.append(Finding("int8-gears", PASS, f"INT8 deploy model: {len(gears)} gear(s) compiled as "
                                f"{len(gears)} static .om (" + ", ".join(f"model_{g.label}.om" for g in gears[:4])
                                + (" ..." if len(gears) > 4 else "") + ")"))
    raise_failures(findings, where=Path(req.onnx).name)
    return AtcPlan(profile, info, opts, d, shapes, switches, findings, gears)


def _link_tree(src: Path, dst: Path) -> None:
    """Carry a previous SoC directory into the new output: hard links where possible (cheap, atomic-safe)."""
    def link(s: str, t: str) -> None:
        try:
            os.link(s, t)
        except OSError:
            shutil.copy2(s, t)

    shutil.copytree(src, dst, copy_function=link)


def _script(opts: AtcOptions, onnx: Path, soc: str) -> str:
    lines = ["#!/usr/bin/env bash",
             f"# ATC compile of {onnx.name} for {soc}, generated by dsconv {__version__} (`dsconv atc`).",
             "# Every option and where it came from: profile.json; the checks that ran: preflight.txt.",
             "# Run it where CANN is installed: source <ascend-toolkit>/set_env.sh && bash atc.sh",
             "# ATC_BIN=/path/to/atc picks another atc; the exit status is atc's.",
             "set -euo pipefail",
             'cd "$(dirname "$0")"',
             '"${ATC_BIN:-atc}" \\']
    toks = opts.shell_lines()
    lines += [f"    {t} \\" for t in toks[:-1]] + [f"    {toks[-1]}"]
    return "\n".join(lines) + "\n"


def _build_all(gears: list[Gear], onnx: Path, soc: str) -> str:
    """atc.sh of an INT8 deploy model: every gear's static compile, one after the other."""
    lines = ["#!/usr/bin/env bash",
             f"# ATC compiles of the INT8 deploy model {onnx.name} for {soc}, generated by dsconv {__version__}.",
             "# INT8 (AMCT) deploy models take no dynamic shapes: one static .om per gear (model_<gear>.om).",
             "# Each gear's command is in atc_<gear>.sh; every option and its source: profile.json.",
             "# Run it where CANN is installed: source <ascend-toolkit>/set_env.sh && bash atc.sh",
             "set -euo pipefail",
             'cd "$(dirname "$0")"']
    lines += [f'echo "== gear {g.label}" && bash {g.script}' for g in gears]
    return "\n".join(lines) + "\n"


def run(req: AtcRequest) -> AtcResult:
    """Plan, preflight, write OUTPUT/<soc>/, optionally run atc. See the module docstring."""
    warn = req.warn or (lambda m: None)
    atc = find_atc(req.atc_bin) if (req.run or req.atc_bin) else None
    pl = plan(req)
    profile, info, opts, d, shapes, switches, findings = (pl.profile, pl.info, pl.options, pl.decisions, pl.shapes,
                                                          pl.switches, pl.findings)
    gears = pl.gears
    soc = profile.soc_version
    for f in findings:
        if f.status == WARN:
            warn(f"[{f.rule}] {f.line()}")
    final = Path(req.output).absolute()
    force, carry = req.force, []
    if (final / MANIFEST).is_file():
        manifest = read_manifest(final)
        if manifest.get("stage") == "atc":
            if (final / soc).exists() and not req.force:
                raise UserError(f"{final / soc} already exists",
                                hint=f"pass --force to replace it (other SoCs in {final} are kept)")
            carry = sorted(p for p in final.iterdir() if p.is_dir() and p.name != soc and not p.name.startswith("."))
            force = True
    options = {"soc_version": soc, "atc_options": opts.to_json(), "carried_socs": [p.name for p in carry]}
    weights = estimate_weight_bytes(info, opts.precision_mode or opts.precision_mode_v2, req.cast_fp16)
    run: RunResult | None = None
    cast_info = None
    with OutputDir(final, stage="atc", inputs=[req.onnx], force=force, options=options) as out:
        for p in carry:
            _link_tree(p, out.path / p.name)
        sd = out.path / soc
        sd.mkdir(parents=True)
        if req.cast_fp16:
            res = cast_model(Path(req.onnx), sd / FP16_MODEL)
            res.check = check_fp16(Path(req.onnx), sd / FP16_MODEL, tolerance=req.fp16_tolerance)
            cast_info = res.to_json()
            if res.kept_fp32:
                warn(f"[cast-fp16] kept in fp32 (values beyond fp16's 65504): {', '.join(res.kept_fp32[:5])}"
                     + (f" +{len(res.kept_fp32) - 5} more" if len(res.kept_fp32) > 5 else "")
                     + "; ATC may still reduce them with --precision_mode, check accuracy on the device")
            if res.fp32_nodes:
                d.set("fp32_nodes", res.fp32_nodes, "--cast-fp16", "nodes left in fp32 between Casts")
            flips = res.check.get("routing_flips")
            if flips:
                warn(f"[cast-fp16] {flips['positions']} of {flips['of']} positions differ beyond "
                     f"{req.fp16_tolerance:.2%} ({res.check['worst_rel_err']:.1%}), as when an MoE router flips a "
                     f"choice at an fp16 near-tie; every other position is within {flips['rest_max_rel_err']:.3%}; "
                     "check accuracy on the device, or compile in BF16 on Ascend910B")
            findings.append(Finding("fp16-check", PASS,
                                    f"FP16 copy matches the original in onnxruntime within "
                                    f"{req.fp16_tolerance:.2%} (worst {res.check['worst_rel_err']:.3%} on "
                                    f"{res.check['worst_output']}"
                                    + (f"; {flips['positions']}/{flips['of']} isolated positions beyond it, "
                                       "routing flips" if flips else "") + ")"))
        out.write_text(f"{soc}/fusion_switch.cfg", switches.render())
        if req.keep_dtype:
            out.write_text(f"{soc}/keep_dtype.cfg", "\n".join(req.keep_dtype) + "\n")
        for g in gears:
            out.write_text(f"{soc}/{g.script}", _script(g.options, Path(req.onnx), soc)).chmod(0o755)
        script = out.write_text(f"{soc}/atc.sh", _build_all(gears, Path(req.onnx), soc) if gears
                                else _script(opts, Path(req.onnx), soc))
        script.chmod(0o755)
        profile_json = {
            "tool": f"dsconv {__version__}", "soc_version": soc, "product": profile.product,
            "profile_files": list(profile.files), "profile_note": profile.note, "profile_sources": list(profile.sources),
            "model": {"path": str(Path(req.onnx).absolute()), "opset": info.opset, "float_dtype": info.float_dtype(),
                      "weight_bytes": info.weight_bytes, "estimated_device_weight_bytes": weights,
                      "quantized": info.quant_evidence, "bf16": info.bf16_evidence,
                      "inputs": [{"name": v.name, "dims": list(v.dims)} for v in info.inputs]},
            "decisions": d.to_json(),
            "shapes": shapes.to_json(),
            "fusion": {"file": "fusion_switch.cfg", "switches": switches.to_file_json()["Switch"],
                       "sources": switches.sources},
            "cast_fp16": cast_info,
            "atc_options": opts.to_json(),
            "command": "atc " + shlex.join(opts.argv()),
        }
        if info.deploy_int8:
            profile_json["int8"] = {
                "precision": "INT8", "deploy_model": True, **info.deploy_int8,
                "note": "AMCT deploy model: AscendQuant -> int8 MatMul -> AscendDequant; compiled with static shapes "
                        "only and without high-precision modes (ATC constraints)",
                "gears": [{"gear": g.label, "script": g.script, "om": f"model_{g.label}.om",
                           "input_shape": g.shapes.input_shape.render(),
                           "command": "atc " + shlex.join(g.options.argv())} for g in gears]}
        out.write_json(f"{soc}/profile.json", profile_json)
        pre = {"soc_version": soc, "model": str(Path(req.onnx).absolute()),
               "findings": [f.to_json() for f in findings],
               "counts": {s: sum(f.status == s for f in findings) for s in (PASS, WARN, FAIL)}}
        out.write_json(f"{soc}/preflight.json", pre)
        out.write_text(f"{soc}/preflight.txt",
                       summary_text(findings, f"dsconv atc preflight: {Path(req.onnx).name} for {soc}"))
        if atc is not None:
            run = run_script(script, atc, sd / "atc.log", echo=req.echo)
            out.write_json(f"{soc}/run.json", run.to_json())
    soc_dir = final / soc
    if run is not None:
        run.log = soc_dir / "atc.log"
    summary = {
        "output": str(final), "soc_dir": str(soc_dir), "soc_version": soc,
        "decisions": d.to_json(),
        "shapes": {"mode": "static_per_gear", "input_shape": shapes.input_shape.render(), "gears": len(gears)}
        if gears else {"mode": shapes.mode, "input_shape": shapes.input_shape.render(), "gears": len(shapes.gears)},
        "preflight": [f.to_json() for f in findings],
        "files": sorted(f.name for f in soc_dir.iterdir()),
        "int8": info.deploy_int8 or None,
        "gears_static": [g.label for g in gears],
        "command": f"bash {soc_dir / 'atc.sh'}",
        "atc": run.to_json() if run is not None else None,
    }
    return AtcResult(final, soc_dir, soc, summary, findings, run)


def render(result: AtcResult) -> str:
    """The terminal text: where the profile went, its shapes, precision and preflight, and how to compile."""
    s = result.summary
    dec = s["decisions"]
    counts = {k: sum(f.status == k for f in result.findings) for k in (PASS, WARN)}
    soc_note = f" ({dec['soc_version']['source']})" if "family" in dec["soc_version"]["source"] else ""
    prec = dec.get("precision_mode") or dec.get("precision_mode_v2")
    lines = [f"atc profile for {result.soc_version}{soc_note}: {result.soc_dir}",
             f"  shapes     {s['shapes']['mode']}, {s['shapes']['gears']} gear(s): "
             f"--input_shape={s['shapes']['input_shape']}",
             f"  precision  {prec['value']} ({prec['source']})"
             + (f"; INT8 deploy model, {len(s['gears_static'])} static .om (one per gear)" if s.get("int8") else ""),
             f"  preflight  {counts[PASS]} passed, {counts[WARN]} warning(s): {result.soc_dir / 'preflight.txt'}",
             f"  files      {', '.join(s['files'])}"]
    r = result.run
    if r is None:
        lines.append(f"  compile    where CANN is installed: {s['command']}")
    elif r.returncode == 0:
        lines.append(f"  compile    atc done in {r.seconds:.1f}s: {result.soc_dir / 'model.om'} (log {r.log})")
    return "\n".join(lines)
