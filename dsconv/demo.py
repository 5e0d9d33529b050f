"""`dsconv demo [DIR]`: the whole pipeline on a seeded tiny DeepSeek-V3, in under a minute.

It writes the model (MLA, one dense layer then MoE layers with a shared expert and 16 routed experts, a small BPE
tokenizer trained on the bundled calibration text), initialises a workspace on it, and then runs each stage exactly
as a user types it - `dsconv quantize --bits 8`, no paths - printing a short summary of each. The INT8 path ends it:
the quantize output exported as a fake-quant + AMCT deploy ONNX and compiled (profile, static gears) for 310P3.
"""
from __future__ import annotations

import shlex
import shutil
import time
from pathlib import Path
from typing import Callable

import click

from dsconv.bundled import calib_texts
from dsconv.runtime.process import working_dir

# The pipeline as a user types it in a workspace. A step whose command is not registered is reported and skipped.
STEPS: list[tuple[str, list[str]]] = [
    ("inspect", ["inspect"]),
    ("export onnx", ["export"]),
    ("export mindir", ["export", "--format", "mindir"]),
    ("quantize", ["quantize", "--bits", "8"]),
    ("eval", ["eval", "--samples", "32"]),
    ("shard", ["shard", "--ep", "4", "--tp", "2"]),
    ("atc 910B", ["atc", "--soc", "Ascend910B"]),
    ("atc 310P3", ["atc", "--soc", "Ascend310P3", "--cast-fp16"]),
    # INT8 all the way to OM: the calibrated W8A8 output as AMCT's deploy ONNX, compiled static per gear for 310P3
    ("export int8", ["export", "--quantized", "out/quant"]),
    ("atc 310P3 int8", ["atc", "--soc", "Ascend310P3", "--onnx", "out/onnx_int8/model_deploy.onnx",
                        "--output", "out/atc_int8"]),
]


def write_demo_model(model_dir: Path, mtp: bool = False, seed: int = 0) -> Path:
    from dsconv.families.deepseek_v3 import DeepseekV3
    from dsconv.tiny import add_mtp_layer, make_tiny, train_tokenizer

    tok = train_tokenizer(calib_texts(), vocab_size=512)
    make_tiny(DeepseekV3.name, model_dir, seed=seed, dtype="bf16", tokenizer=tok)
    if mtp:
        add_mtp_layer(model_dir, seed=seed)
    return model_dir


def run_demo(directory: Path, cli: click.Group, mtp: bool = False, force: bool = False,
             echo: Callable[[str], None] = click.echo) -> dict[str, float]:
    """Build the demo workspace in `directory` and run every stage through `cli`, the `dsconv` click group (passed
    in: the demo sits beside the CLI and must not import it); returns seconds per step."""
    from dsconv import workspace

    directory = directory.absolute()
    model_dir = directory / "model"
    if directory.exists() and any(directory.iterdir()):
        if not force and not (directory / workspace.FILENAME).is_file():
            from dsconv.errors import UserError

            raise UserError(f"{directory} exists and is not a dsconv demo", hint="choose another DIR")
    directory.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    if not (model_dir / "config.json").is_file() or force:
        shutil.rmtree(model_dir, ignore_errors=True)
        write_demo_model(model_dir, mtp=mtp)
    timings["model"] = time.perf_counter() - t0
    echo(f"== tiny DeepSeek-V3 written to {model_dir} ({timings['model']:.1f}s)")
    with working_dir(directory):
        workspace.init(model_dir, Path("out"), force=True)
        echo(f"== workspace: {directory / workspace.FILENAME} (outputs under {directory / 'out'})")
        shutil.rmtree(directory / "out", ignore_errors=True)  # the demo's own outputs: always fresh
        for label, args in STEPS:
            if args[0] not in cli.commands:
                echo(f"\n(skipping {label}: `dsconv {args[0]}` is not available in this build)")
                continue
            echo(f"\n$ dsconv {shlex.join(args)}")
            t = time.perf_counter()
            cli.main(args=args, prog_name="dsconv", standalone_mode=False)
            timings[label] = time.perf_counter() - t
    echo(f"\n== demo done in {time.perf_counter() - t0:.1f}s: " +
         ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))
    return timings
