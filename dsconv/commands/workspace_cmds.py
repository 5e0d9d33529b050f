"""`dsconv init`, `dsconv inspect`, `dsconv verify`: the workspace and the read-only commands."""
from __future__ import annotations

from pathlib import Path

import click

from dsconv import workspace
from dsconv.commands.options import PATH, emit_json, json_option
from dsconv.errors import CheckFailed, UserError


@click.command()
@click.option("--model", "-m", type=PATH, required=True, help="HF model directory this workspace works on.")
@click.option("--output", "-o", type=PATH, default=Path("dsconv-out"), show_default=True,
              help="Root under which each stage writes its output (<root>/onnx, quant, shard, atc, ...).")
@click.option("--force", is_flag=True, help="Overwrite an existing dsconv.toml.")
def init(model: Path, output: Path, force: bool) -> None:
    """Write dsconv.toml here so the other commands need no paths."""
    from dsconv.checkpoint import Checkpoint

    Checkpoint.open(model)  # validate now, not at the first stage
    ws = workspace.init(model, output, force=force)
    click.echo(f"wrote {ws.path}: model {ws.model}, outputs under {ws.output}")


@click.command()
@click.option("--model", "-m", type=PATH, default=None, help="HF model directory (default: the workspace's).")
@click.option("--config", "config", type=PATH, default=None, help="A config.json alone: no weights needed.")
@click.option("--allow-pickle", is_flag=True, help="Read .bin/.pt weights (weights-only unpickler).")
@json_option
def inspect(model: Path | None, config: Path | None, allow_pickle: bool, as_json: bool) -> None:
    """Parameters and bytes by category, dtypes, KV cache, and cards needed per SoC and precision."""
    from dsconv.checkpoint import open_input
    from dsconv.inspect import inspect_model, render

    if config is None:
        model = workspace.resolve_model(model)
    ck = open_input(model, config=config, allow_pickle=allow_pickle)
    report = inspect_model(ck)
    if as_json:
        emit_json(report)
    else:
        click.echo(render(report))


@click.command()
@click.argument("directory", type=PATH)
@click.option("--engine", type=click.Choice(["mindie", "vllm-ascend"]), default=None,
              help="Also load the output with this engine's own weight loader on this host and compare what it holds "
                   "with the float source, position by position (sets up the engine's environment once: "
                   "docs/engine_check.md).")
@click.option("--source", type=PATH, default=None,
              help="With --engine: the float checkpoint the output was made from (default: the manifest's input).")
@click.option("--mindie-src", type=PATH, default=None, envvar="MINDIE_LLM_SRC",
              help="With --engine mindie: a MindIE-LLM checkout, an installation's atb_llm, or its source archive "
                   "(MindIE-LLM is not on PyPI) [env MINDIE_LLM_SRC].")
@json_option
def verify(directory: Path, engine: str | None, source: Path | None, mindie_src: Path | None, as_json: bool) -> None:
    """Re-check a dsconv output: every file's digest and size, then the stage's own check; with --engine, the
    engine's own loader."""
    from dsconv.stages import has_check, verify as run_verify

    if not directory.is_dir():
        raise UserError(f"{directory} is not a directory", hint="pass a directory dsconv wrote")
    manifest, problems = run_verify(directory)
    loaded = None
    if engine and not problems:
        import tempfile

        from dsconv.engines.loader_check import cast_origin, check, rotation_origin

        rotated = rotation_origin(directory.resolve()) if source is None else None
        cast = cast_origin(directory.resolve()) if source is None else None
        with tempfile.TemporaryDirectory(prefix="dsconv-verify-") as tmp:
            if rotated is not None:  # `quantize --rotate`: the float source is the rotated model, rebuilt (seeded)
                from dsconv.quant.rotate import RotateRequest, run as rotate

                source = Path(tmp) / "rotated-source"
                rotate(RotateRequest(rotated[0], source, seed=rotated[1], progress=False))
            elif cast is not None:  # `quantize --dtype`: the source as quantize read it, cast again
                from dsconv.quant.cast import cast_checkpoint

                source = cast_checkpoint(cast[0], Path(tmp) / "cast-source", cast[1], progress=False)
            loaded = check(directory, engine, source, str(mindie_src) if mindie_src else None)
        if loaded.get("load") != "ok":
            problems = [f"{engine}'s loader: {loaded.get('load')}: {x}" for x in
                        (loaded.get("problems") or [loaded.get("error") or "no result (see the log above)"])]
    if as_json:
        emit_json({"directory": str(directory), "stage": manifest.get("stage"), "files": len(manifest["files"]),
                   "ok": not problems, "problems": problems, **({"engine": {engine: loaded}} if loaded else {})})
    if problems:
        raise CheckFailed(f"{directory}: {len(problems)} problem(s), first: {problems[0]}",
                          details="\n".join(problems[:50]))
    if not as_json:
        click.echo(f"{directory}: {len(manifest['files'])} files match the manifest ({manifest.get('stage')} output)")
        if has_check(manifest.get("stage", "")):
            click.echo(f"{directory}: the {manifest.get('stage')} check passed")
        if loaded:
            held = f"{loaded['rows']} rows in {loaded['linears']} linears compared in place" if "rows" in loaded \
                else f"{loaded['tensors']} tensors in place, every weight decoded to its source"
            click.echo(f"{directory}: {engine}'s own loader took it: {held}")
