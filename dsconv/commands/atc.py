"""`dsconv atc`: the ATC compile profile for one SoC (atc.sh, fusion switch file, profile.json, preflight), checked
before ATC runs; `--run` / `--atc-bin` runs it where CANN's atc exists."""
from __future__ import annotations

from pathlib import Path

import click

from dsconv.commands.options import PATH, emit_json, force_option, json_option, output_option, warn
from dsconv.errors import UserError


MAX_GEAR = 2**31 - 1  # a shape dimension ATC stores as int32; a gear beyond it is a typo that atc.sh would carry


def _ints(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        vals = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise UserError(f"--{param.name} {value}: expected comma-separated integers like 1,4") from None
    if not vals or any(not 1 <= v <= MAX_GEAR for v in vals):
        raise UserError(f"--{param.name} {value}: values must be positive integers up to {MAX_GEAR}")
    return vals


def _default_onnx() -> Path:
    from dsconv.workspace import previous_output

    prev = previous_output("export")
    if prev is None or not (prev / "model.onnx").is_file():
        raise UserError("no --onnx given and no exported model.onnx in this workspace",
                        hint="pass --onnx FILE or run `dsconv export` first")
    return prev / "model.onnx"


@click.command()
@click.option("--onnx", "onnx_path", type=PATH, default=None,
              help="ONNX model (default: model.onnx of the workspace's `dsconv export`).")
@click.option("--soc", default=None, help="Ascend910B (assumes Ascend910B3), Ascend910B1..B4, Ascend910B2C, "
                                          "Ascend910B4-1 or Ascend310P3.")
@click.option("--profile", "profile_path", type=PATH, default=None, help="Your own SoC profile JSON (see "
                                                                       "dsconv/atc_profiles/).")
@click.option("--batch", callback=_ints, default=None, help="Batch gears, e.g. 1,4 (default: the profile's).")
@click.option("--seq", callback=_ints, default=None, help="Sequence gears, e.g. 128,512,1024.")
@click.option("--past", callback=_ints, default=None, help="KV-cache length gears (models with past inputs).")
@click.option("--input-shape", default=None, help='Override ATC\'s --input_shape, e.g. "input_ids:-1,-1;...".')
@click.option("--dynamic-batch-size", is_flag=True, help="Only the batch is dynamic (--dynamic_batch_size).")
@click.option("--input-shape-range", is_flag=True, help="Shape ranges lo~hi instead of gears.")
@click.option("--precision-mode", default=None, help="ATC --precision_mode (default: the profile's).")
@click.option("--precision-mode-v2", default=None, help="ATC --precision_mode_v2 (instead of --precision-mode).")
@click.option("--implmode", default=None, help="ATC --op_select_implmode.")
@click.option("--optypelist", default=None, help="ATC --optypelist_for_implmode, e.g. SoftmaxV2.")
@click.option("--op-precision-mode", "op_precision_mode", type=PATH, default=None,
              help="ATC --op_precision_mode ini file (per-operator precision); refused with high_precision for "
                   "INT8 deploy models.")
@click.option("--fusion", multiple=True, metavar="PASS=on|off",
              help="Fusion switch override; repeatable; UBFusion.PASS=off names the section.")
@click.option("--keep-dtype", multiple=True, metavar="OP", help="Op name (or OpType::Name) kept in its original "
                                                                "dtype; repeatable (--keep_dtype file).")
@click.option("--cast-fp16", is_flag=True, help="Write an FP16 copy (checked in onnxruntime) and compile that.")
@click.option("--fp16-tolerance", type=float, default=1e-2, show_default=True,
              help="Allowed FP16 error, relative to each output's largest value.")
@click.option("--log", "log_level", default=None, help="ATC --log level (default: the profile's, error).")
@click.option("--run", is_flag=True, help="Run atc (from PATH) after the checks.")
@click.option("--atc-bin", type=PATH, default=None, help="Run this atc executable after the checks.")
@output_option
@json_option
@force_option
def atc(onnx_path: Path | None, soc: str | None, profile_path: Path | None, batch, seq, past, input_shape,
        dynamic_batch_size: bool, input_shape_range: bool, precision_mode, precision_mode_v2, implmode, optypelist,
        op_precision_mode, fusion, keep_dtype, cast_fp16: bool, fp16_tolerance: float, log_level, run: bool,
        atc_bin: Path | None, output: Path | None, as_json: bool, force: bool) -> None:
    """Generate and check the ATC (.om) compile profile for one Ascend SoC; run atc where it exists.

    Writes OUTPUT/<soc>/: atc.sh (the exact command), fusion_switch.cfg, profile.json (every decision and its
    source), preflight.json and preflight.txt. Rules that make a compile certainly fail stop with exit 2.
    """
    from dsconv.atc.stage import AtcRequest, render, run as run_atc
    from dsconv.workspace import resolve_output

    onnx = Path(onnx_path) if onnx_path is not None else _default_onnx()
    out_dir = resolve_output("atc", output)
    if fp16_tolerance <= 0:
        raise UserError(f"--fp16-tolerance {fp16_tolerance} must be positive")
    req = AtcRequest(
        onnx=onnx, output=out_dir, soc=soc, profile=profile_path, batch=batch, seq=seq, past=past,
        input_shape=input_shape, dynamic_batch_size=dynamic_batch_size, input_shape_range=input_shape_range,
        precision_mode=precision_mode, precision_mode_v2=precision_mode_v2, implmode=implmode,
        op_precision_mode=op_precision_mode,
        optypelist=tuple(o.strip() for o in optypelist.split(",") if o.strip()) if optypelist else None,
        fusion=tuple(fusion), keep_dtype=tuple(keep_dtype), cast_fp16=cast_fp16, fp16_tolerance=fp16_tolerance,
        log=log_level, run=run, atc_bin=atc_bin, force=force, warn=warn,
        echo=None if as_json else (lambda line: click.echo(line, err=True)),
    )
    result = run_atc(req)
    if as_json:
        emit_json(result.summary)
    else:
        click.echo(render(result))
    if result.run is not None and result.run.returncode != 0:
        from dsconv.atc.runner import AtcFailed

        raise AtcFailed(result.run)
