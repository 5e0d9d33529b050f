"""The quantize stage: `run(QuantRequest) -> QuantResult`.

One plan from headers, then one of two paths writing the msModelSlim layout through the one writer: weight-only
round-to-nearest streams tensor by tensor (`streaming`), everything else calibrates layer by layer (`calibration`).
Fallback decisions, the description, config and reports are written last, all inside one transactional output.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from dsconv import engines
from dsconv.checkpoint import Checkpoint
from dsconv.errors import UserError
from dsconv.families.roles import Category
from dsconv.executor import ExecOptions, make_executor
from dsconv.io.writer import OutputDir
from dsconv.quant.formats.msmodelslim import C8, FA_QUANT
from dsconv.quant.formats.output import QuantWriter, description, final_specs
from dsconv.quant.plan import report as rep
from dsconv.quant.plan.options import QuantOptions, check_options, fallback_policy, needs_calibration
from dsconv.qformat import STATIC_TYPES, W4A4
from dsconv.quant.plan.plan import SCHEMES, make_plan
from dsconv.quant.streaming import weight_only
from dsconv.schemas.core import decode_utf8, read_bytes
from dsconv.tensors import PRECISIONS


@dataclass
class QuantRequest:
    """What `dsconv quantize` was asked: the model, where to write, the options, and how to run."""

    model: Path
    output: Path
    options: QuantOptions = field(default_factory=QuantOptions)
    force: bool = False
    progress: bool = True
    dry_run: bool = False                                    # plan from headers only; nothing written
    warn: Callable[[str], None] = lambda message: None       # non-fatal notices (e.g. little calibration text)
    execution: ExecOptions | None = None                     # how independent jobs run (default: inline)
    origin: Path | None = None                               # the model the user named, when `model` is its rotation


@dataclass
class QuantResult:
    """The summary of a run (the --json output), or of the plan alone for a dry run."""

    summary: dict[str, Any]
    dry_run: bool = False

    def render(self) -> str:
        return rep.render_plan(self.summary) if self.dry_run else rep.render(self.summary)


def _check_family(ck: Any) -> None:
    if ck.family.quantize_refused:
        raise UserError(f"{ck.root}: {ck.family.name} cannot be quantized for an engine: {ck.family.quantize_refused}",
                        hint="export it (--format onnx or safetensors), or shard the float checkpoint")


def planned_output(ck: Any, scheme: str, engine: str | None = None) -> tuple[list[Any], dict[str, Any]]:
    """The tensors (TensorSpec) and description `dsconv quantize --scheme SCHEME` would write for `ck` (a
    Checkpoint or a config's ConfigOnly), from headers alone: what `shard --config --scheme` plans."""
    if scheme not in SCHEMES:
        raise UserError(f"unknown scheme {scheme}", hint=f"choose one of {', '.join(SCHEMES)}")
    _check_family(ck)
    prof = engines.get(engine)
    engines.check_engine(prof, ck.family, ck.root)
    ktypes = engines.kind_types(prof, ck.family, SCHEMES[scheme], bits_default=False)
    plan = make_plan(ck, scheme, None, "rtn", (), assign=engines.assigner(prof, ck.family, ktypes),
                     mix_ok=prof.fallback_ok, mtp_type=engines.mtp_type(ktypes),
                     engine_dtype=engines.engine_dtype(prof, ck.family, ck.facts.dtype))
    engines.check_mix(prof, ck.family, ck.config.get("model_type", ""), plan.linears.values())
    engines.check_plan(prof, ck.family, plan.linears.values())
    types = {m: lp.qtype for m, lp in plan.linears.items()}
    specs = final_specs(ck, plan, types)
    return specs, description(plan, types, specs)


def _resolved_precision(asked: str | None, calibrate: bool) -> str | None:
    """--calib-precision as the run uses it and the manifest records it: `auto` (the default) resolved on this host
    for a run that calibrates (weight-only never imports torch: nothing), MKL's float32 (`fp32`) as None."""
    if asked == "auto":
        if not calibrate:
            return None
        from dsconv.quant.calibrate.context import auto_precision

        asked = auto_precision()
    return None if asked == "fp32" else asked


def _load_calibration(ck: Any, plan: Any, opts: QuantOptions, warn: Callable[[str], None]) -> Any:
    """The tokenized calibration set, with a warning where it is too small for what the plan fits on it.

    Its modules (and the Calibrator) are imported where used, not at the top: a weight-only run never loads torch,
    whose 2 s import was a sixth of its time (docs/performance.md)."""
    from dsconv.quant.algorithms.selection import HOLD_EVERY, MIN_PROMPTS, held_out_prompts
    from dsconv.quant.calibrate.data import load_calib, min_tokens_warning
    from dsconv.runner.texts import load_tokenizer

    calib = load_calib(opts.calib, load_tokenizer(ck.root), opts.calib_samples, opts.seq_len)
    needs = {}
    if plan.scheme in STATIC_TYPES:
        needs["static activation ranges"] = 512
    if plan.method == "gptq":  # a Hessian fitted on fewer tokens than ~2x its width overfits (docs/accuracy.md)
        k = max(lp.k for lp in plan.linears.values())
        needs[f"GPTQ Hessians (2 x the widest input, {k}, after holding out 1/{HOLD_EVERY} of the prompts)"] = \
            -(-2 * k * HOLD_EVERY // (HOLD_EVERY - 1))
    w = min_tokens_warning(calib, needs)
    unchecked = {"gptq": "GPTQ is used on every layer without checking it against round-to-nearest",
                 "awq": "AWQ's choices against round-to-nearest are judged on the rows they were searched on"}
    if plan.method in unchecked and held_out_prompts(len(calib.samples)) is None:
        warn(f"{len(calib.samples)} calibration prompts are too few to hold some out: "
             f"{unchecked[plan.method]} (give >= {MIN_PROMPTS} prompts)")
    if w:
        warn(w)
    return calib


def _from_scratch(req: QuantRequest, name: str, make: Callable[[Path], Any]) -> tuple[QuantResult, Any]:
    """Quantize what `make(scratch)` writes into a scratch checkpoint beside the output (`.OUTPUT.dsconv-NAME`),
    removed afterwards, on failure too; the manifest names the model the user gave (`origin`), from which
    `dsconv verify` rebuilds the scratch. Returns the result and what `make` returned."""
    import shutil
    from dataclasses import replace

    scratch = req.output.absolute().parent / f".{req.output.name}.dsconv-{name}"
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        made = make(scratch)
        return run(replace(req, model=scratch, origin=req.model)), made
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_cast(req: QuantRequest) -> QuantResult:
    """`quantize --dtype`: the model's float tensors cast (quant/cast.py), then quantized: the two-step way's
    output (export --dtype, then quantize)."""
    from dataclasses import replace

    from dsconv.quant.cast import cast_checkpoint

    if req.options.rotate is not None:
        raise UserError("--dtype and --rotate together: rotation keeps the model's dtype",
                        hint="run `dsconv rotate` first, then quantize its output with --dtype")
    run(replace(req, dry_run=True))  # every refusal from headers, naming the user's model, before the cast
    return _from_scratch(req, "cast", lambda d: cast_checkpoint(req.model, d, req.options.dtype,
                                                                progress=req.progress))[0]


def _rotated(model_dir: Path) -> bool:
    """Whether `model_dir` is a `dsconv rotate` output (its manifest's stage)."""
    from dsconv.io.writer import read_manifest

    try:
        return read_manifest(Path(model_dir)).get("stage") == "rotate"
    except UserError:  # no manifest, or not a sound one
        return False


def _run_rotated(req: QuantRequest) -> QuantResult:
    """`quantize --rotate`: the model rotated (dsconv/quant/rotate.py), then quantized; the manifest's seed lets
    `dsconv verify` rebuild the rotated float source."""
    from dataclasses import replace

    from dsconv.quant.rotate import RotateRequest, refusal
    from dsconv.quant.rotate import run as rotate

    ck = Checkpoint.open(req.model)
    why = refusal(ck)
    if why:
        raise UserError(f"{req.model}: {ck.family.name} cannot be rotated: {why}", hint="quantize it without --rotate")
    plain = replace(req, options=replace(req.options, rotate=None))
    if req.dry_run:
        return run(plain)
    run(replace(plain, dry_run=True))  # every refusal from headers, naming the user's model, before the rotation
    if req.options.scheme in ("w4a16", "w4a8_dynamic"):
        req.warn(f"--rotate with {req.options.scheme}: rotation spreads activation outliers, which 4-bit weights do not "
                 "need; on the real fixtures it made W4A16 and W4A8 worse (docs/rotation.md)")
    result, rotated = _from_scratch(req, "rotated", lambda d: rotate(RotateRequest(
        req.model, d, seed=req.options.rotate, progress=req.progress)))
    result.summary["rotation"] = {k: rotated.summary[k] for k in ("rotation", "seed", "hidden_size", "untied",
                                                                   "read", "written", "folded", "seconds")}
    return result


def run(req: QuantRequest) -> QuantResult:
    """Run `dsconv quantize`."""
    if req.options.dtype is not None and req.origin is None and not req.dry_run:
        return _run_cast(req)
    if req.options.rotate is not None and req.origin is None:
        return _run_rotated(req)
    t0 = time.perf_counter()
    opts, model_dir, output = req.options, req.model, req.output
    if opts.scheme not in SCHEMES:
        raise UserError(f"unknown scheme {opts.scheme}", hint=f"choose one of {', '.join(SCHEMES)}")
    ck = Checkpoint.open(model_dir)
    _check_family(ck)
    if ck.is_quantized:
        raise UserError(f"{model_dir} is already quantized (it has a quant_model_description)",
                        hint="quantize the original float checkpoint")
    prof = engines.get(opts.engine)
    engines.check_engine(prof, ck.family, model_dir)
    engines.check_layout(prof, opts.layout)
    engines.check_dtype(prof, PRECISIONS[opts.dtype] if opts.dtype else ck.facts.dtype, model_dir, ck.family)
    if opts.moe_scheme is not None and opts.moe_scheme not in SCHEMES:
        raise UserError(f"unknown --moe-scheme {opts.moe_scheme}", hint=f"choose one of {', '.join(SCHEMES)}")
    family = ck.family
    ktypes = engines.kind_types(prof, family, SCHEMES[opts.scheme], opts.bits_default,
                                SCHEMES[opts.moe_scheme] if opts.moe_scheme else None)
    if opts.kv_cache:  # the int8 cache's form (FA quant for MLA, else C8) may need its own attention type
        ktypes = engines.kv_recipe(prof, ktypes, FA_QUANT if ck.facts.is_mla else C8)
    preview = engines.preview(ck, ktypes, SCHEMES[opts.scheme], opts.ignore)
    if engines.W4A8 in (SCHEMES[opts.scheme], SCHEMES.get(opts.moe_scheme or "")) and \
            not any(lp.qtype == engines.W4A8 for lp in preview):
        raise UserError(f"--engine {prof.name}: W4A8_DYNAMIC is written for routed-expert layers, and "
                        f"{family.name} ({model_dir}) has none (no engine loads a per-channel W4A8 linear: {prof.label}: "
                        f"{prof.why_not[(engines.W4A8, 'linear')].text}; "
                        f"{prof.why_not[(engines.W4A8, 'linear')].source})",
                        hint="use --scheme w8a8_dynamic, or --bits 4 (W4A16)")
    engines.check_mix(prof, family, ck.config.get("model_type", ""), preview)
    engines.check_plan(prof, family, preview)  # before any work
    mtp_type = engines.mtp_type(ktypes)
    plan = make_plan(ck, opts.scheme, opts.group_size, opts.method, opts.ignore,
                     assign=engines.assigner(prof, family, ktypes), recipe=opts.recipe, mix_ok=prof.fallback_ok, mtp_type=mtp_type, kv_cache=opts.kv_cache,
                     engine_dtype=engines.engine_dtype(prof, family, ck.facts.dtype))
    engines.check_plan(prof, family, plan.linears.values())
    engines.check_kv_cache(prof, family, ck.config.get("model_type", ""), plan)
    engines.check_packing(prof, ck.family, plan.linears.values(), plan.group_size)
    check_options(opts, plan)
    if req.origin is None and not req.dry_run and any(lp.qtype == W4A4 for lp in plan.linears.values()) and \
            not _rotated(model_dir):
        req.warn("W4A4_DYNAMIC without --rotate: int4 activations per token leave every channel but the largest "
                 "few on a handful of levels; add --rotate (docs/rotation.md)")
    policy = fallback_policy(opts, plan) if engines.check_fallback(prof, opts.fallback, opts.fallback_threshold) \
        else None
    calibrate = needs_calibration(opts, plan)
    opts = replace(opts, calib_precision=_resolved_precision(opts.calib_precision, calibrate))
    kinds = {m: engines.layer_kind(lp) for m, lp in plan.linears.items()}
    mtp = mtp_type if any(lp.category == Category.MTP for lp in plan.linears.values()) else None
    cfg_keys = engines.config_updates(prof, family, {m: lp.qtype for m, lp in plan.linears.items()}, kinds, mtp)
    if calibrate and req.origin is None:
        from dsconv.runner.texts import require_tokenizer_files

        require_tokenizer_files(model_dir)
    if req.dry_run:
        dry = rep.plan_summary(ck, plan, opts, policy, calibrate)
        dry.update(engine=prof.name, config_keys=cfg_keys, layer_types=engines.kind_table(
            plan.linears.values(), plan.ignored, {ck.role(n).module: ck.role(n) for n in ck.names()}))
        return QuantResult(dry, dry_run=True)
    ex = make_executor(req.execution)
    try:
        if calibrate:
            from dsconv.quant.calibrate.calib_jobs import warm_workers

            warm_workers(ex, ck, plan)  # the workers start while the tokenizer loads
        calib = _load_calibration(ck, plan, opts, req.warn) if calibrate else None
    except BaseException:
        ex.close()
        raise
    with ex, OutputDir(output, stage="quantize", inputs=[req.origin or model_dir], force=req.force,
                       options=opts.as_dict(), input_identity=ck.identity()) as out:
        qw = QuantWriter(out, ck, plan, opts.layout, opts.max_shard_size, staged=policy is not None,
                         name_type=cfg_keys.get("quantize"))
        cal = None
        ran = {"executor": "inline", "workers": 1, "ran": "inline"}
        t_cal = time.perf_counter()
        with ex:  # closed again once the jobs are done: the workers' memory is freed before the output is assembled
            if calib is not None:  # linears and routed experts of each layer as jobs (calib_jobs.py)
                from dsconv.quant.calibrate.calibration import Calibrator
                cal = Calibrator(ck, plan, opts, calib, qw, req.progress, executor=ex)
                cal.run()
                records = cal.records
            else:
                records = weight_only(ck, plan, qw, req.progress, ex)
            ran = ex.summary()
        t_cal = time.perf_counter() - t_cal
        decision = rep.decide(plan, records, policy, SCHEMES[opts.fallback_to])
        t_finish = time.perf_counter()
        desc = qw.finish(decision.types)  # staged layers assembled under their final types, untouched tensors copied
        t_finish = time.perf_counter() - t_finish
        desc.update(engines.description_updates(prof, desc))
        cfg_keys = engines.config_updates(prof, family, decision.types, kinds, mtp)
        if cfg_keys:  # MindIE: the description's global type is config's `quantize` (its own exporter's rule)
            desc["model_quant_type"] = cfg_keys["quantize"].upper()
        out.write_json(qw.description_name, desc)
        config = ck.family.engine_config(
            {k: v for k, v in ck.config.items() if k not in ("quantization_config", *engines.ALL_CONFIG_KEYS)})
        config.update(cfg_keys)
        if ck.facts.fp8_block:  # weights arrive dequantized: the unquantized ones are written in the model dtype
            config["torch_dtype"] = config.get("torch_dtype") or "bfloat16"
        for f in ck.copy_files():
            tok = engines.tokenizer_config(prof, decode_utf8(read_bytes(f, "tokenizer config", "check the model's "
                                                                        "tokenizer files"), str(f))) \
                if f.name == "tokenizer_config.json" else None
            if tok is not None:
                out.write_text(f.name, tok)
            elif f.name != "config.json":
                out.copy_in(f)
        out.write_text("config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        found = cal.findings() if cal is not None else None
        report = rep.build_report(ck, plan, opts, records, decision, policy, found, calib)
        if cal is not None:  # seconds per calibration step and layer (calibrate/steps.py)
            report["timings"] = {**cal.clock.report(), "finish_write": round(t_finish, 3),
                                 "calibration": round(t_cal, 3)}
        out.write_json(rep.REPORT_FILE, report)
        if cal is not None and cal.expert_counts:
            out.write_json(rep.EXPERT_LOAD_FILE, {"layers": {str(k): v for k, v in sorted(cal.expert_counts.items())}})
        files = sorted(p.relative_to(out.path).as_posix() for p in out.path.rglob("*") if p.is_file())
    result = rep.summary(ck, plan, opts, report, decision, output, files + ["dsconv_manifest.json"],
                         seconds=time.perf_counter() - t0, calibration_seconds=t_cal)
    if cal is not None:
        result["timings"] = {k: round(v, 3) for k, v in cal.timings.items()}
        result["timings"].update({k: report["timings"][k] for k in ("steps", "steps_cpu", "in_jobs")})
        result["forward"] = cal.fwd.summary()
    result.update(engine=prof.name, config_keys=cfg_keys, execution=ran)
    return QuantResult(result)
