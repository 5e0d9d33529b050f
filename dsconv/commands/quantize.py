"""`dsconv quantize`: calibrated INT8/INT4 in the msModelSlim layout (MindIE, vLLM-Ascend)."""
from __future__ import annotations

from pathlib import Path

import click

from dsconv import workspace
from dsconv.commands.options import (PATH, SIZE, emit_json, exec_options, force_option, json_option, model_option,
                                     output_option, resolve_exec, warn)
from dsconv.errors import UserError
from dsconv.quant.algorithms.methods import DEFAULT_METHOD, METHODS, SCHEME_DEFAULT_METHOD, default_method


SCHEME_NAMES = ["w8a8", "w8a8_dynamic", "w8a8_mix", "w8a16", "w4a16", "w4a8_dynamic", "w4a4_dynamic"]  # quant.plan.SCHEMES (kept light)


def parse_smooth(value: str | None) -> float | str | None:
    """--smooth-quant auto | off | ALPHA."""
    if value is None or value == "auto":
        return "auto"
    if value == "off":
        return None
    try:
        alpha = float(value)
    except ValueError:
        raise UserError(f"--smooth-quant {value!r} is not auto, off or a number",
                        hint="e.g. --smooth-quant auto (default), --smooth-quant 0.5") from None
    if not 0.0 <= alpha <= 1.0:  # nan fails this too; s = act^ALPHA / w^(1-ALPHA) migrates a share, 0..1
        raise UserError(f"--smooth-quant {value!r} is not an ALPHA in 0..1",
                        hint="e.g. --smooth-quant 0.5, or auto to search it per site")
    return alpha


@click.command()
@model_option
@output_option
@click.option("--bits", type=click.Choice(["8", "4"]), default=None,
              help="Weight bits: 8 defaults to --scheme w8a8, 4 to w4a16.")
@click.option("--scheme", type=click.Choice(SCHEME_NAMES), default=None,
              help="w8a8: int8 weights per channel + static per-tensor int8 activations (input_scale/offset from "
                   "calibration); w8a8_dynamic: per-token activations at run time; w8a8_mix (PD-mix): both in one "
                   "checkpoint, static on a decode instance, dynamic on prefill, routed experts w8a8_dynamic; "
                   "w8a16 / w4a16: weight-only; "
                   "w4a8_dynamic (MoE): routed experts int4 per channel with per-token int8 activations, every "
                   "other linear w8a8_dynamic (Ascend's W4A8 recipe); w4a4_dynamic (vLLM-Ascend, with --rotate): int4 "
                   "weights and per-token int4 activations where the rotation reaches the input (q/k/v, gate/up), "
                   "w8a8_dynamic elsewhere.")
@click.option("--moe-scheme", type=click.Choice(SCHEME_NAMES), default=None,
              help="Routed experts' scheme when it differs from the rest (default: --scheme, or the engine's "
                   "recipe with --bits).")
@click.option("--kv-cache", type=click.Choice(["int8"]), default=None,
              help="int8: the KV cache in int8, scales measured on the calibration text: C8 for GQA models "
                   "(per-channel key/value scales), FA quant for DeepSeek MLA (per-head query, latent); refused "
                   "where the engine would not load or use them (docs/formats/kv_cache_c8.md). Default: the cache "
                   "stays in the model dtype.")
@click.option("--engine", type=click.Choice(["mindie", "vllm-ascend"]), default=None,
              help="Serving engine the output must load in (default: `engine` in dsconv.toml, else mindie). "
                   "--bits 8 takes its recipe (DeepSeek: attention static W8A8, MLP and experts W8A8_DYNAMIC, "
                   "kv_b_proj float); a scheme it cannot load is refused before any work.")
@click.option("--group-size", type=click.IntRange(min=0), default=None,
              help="INT4 group length along the input dimension (default 128; 0 = per output channel).")
@click.option("--method", type=click.Choice(list(METHODS)), default=None,
              help="Weight rounding: rtn, round-to-nearest with max|w| scales; mse, each group's scale searched for "
                   "the smallest rounding error (no calibration); gptq, error compensation with the calibration "
                   "Hessian (act order, static groups), kept per linear only where it beats rtn on held-out "
                   f"calibration prompts; awq (W4A16/W8A16), activation-aware scales folded into the norms and up_proj plus a clip search, both by output error on calibration rows, kept per site only where no linear is worse than rtn on held-out prompts. Default: {DEFAULT_METHOD[4]} for 4 bits "
                   f"({', '.join(f'{m} for {s}' for s, m in SCHEME_DEFAULT_METHOD.items())}), {DEFAULT_METHOD[8]} for "
                   "8 (measured end to end on real models: docs/accuracy.md).")
@click.option("--act-method", type=click.Choice(["search", "minmax", "percentile", "mse"]), default="search",
              show_default=True,
              help="Static activation ranges. search (default): the min/max range scaled by the clip ratio that "
                   "gives the consumers' smallest output error on calibration rows (1.0 included, so never worse "
                   "than min/max there). minmax: never clips, msModelSlim's default. percentile/mse: judged by the "
                   "activation's own distribution.")
@click.option("--smooth-quant", "smooth_alpha", default="auto", show_default=True, metavar="auto|off|ALPHA",
              help="SmoothQuant for W8A8/W8A8_DYNAMIC: move activation outliers into the weights (s = act^ALPHA / "
                   "w^(1-ALPHA)), folded into the preceding RMSNorm (and up_proj -> down_proj) so the graph is "
                   "unchanged. auto: each site gets the ALPHA (or none) with the smallest measured output error.")
@click.option("--fallback", type=click.IntRange(min=0), default=None, metavar="N",
              help="Static W8A8: fall back the N most sensitive units (q/k/v, gate/up, experts of a layer...) to "
                   "--fallback-to. 0 disables fallback. Default: the threshold below.")
@click.option("--fallback-threshold", type=click.FloatRange(min=0), default=None, metavar="X",
              help="Static W8A8: fall back units whose measured relative output error exceeds X "
                   "(default 0.10).")
@click.option("--fallback-to", type=click.Choice(["w8a8_dynamic", "w8a16"]), default="w8a8_dynamic",
              show_default=True, help="What a sensitive W8A8 unit becomes.")
@click.option("--recipe", type=click.Choice(["mixed", "uniform"]), default="mixed", show_default=True,
              help="Static W8A8: mixed gives down_proj (token-wise outliers) per-token dynamic activations, as "
                   "Ascend's static practices leave it out; uniform keeps every linear static.")
@click.option("--ignore", multiple=True, metavar="REGEX",
              help="Keep linears whose module name matches REGEX in float (repeatable). Embeddings, norms, routers, "
                   "lm_head and DeepSeek's MTP layer are kept in float anyway.")
@click.option("--calib", type=PATH, default=None,
              help="Calibration set: .jsonl (inputs_pretokenized | text | prompt | question+answer | messages per "
                   "line) or .json list of strings. Default: the bundled calib_data/qa.jsonl. Round-to-nearest "
                   "without static activations (w8a16, w8a8_dynamic, w4a16 --method rtn) needs none and skips "
                   "it; give --calib to record MoE expert load anyway.")
@click.option("--calib-samples", type=click.IntRange(min=1), default=None, metavar="N", help="Use the first N samples (default: all).")
@click.option("--seq-len", type=click.IntRange(min=2), default=512, show_default=True, help="Tokens per calibration sample (cut).")
@click.option("--min-expert-tokens", type=click.IntRange(min=0), default=32, show_default=True,
              help="MoE: experts routed fewer calibration tokens are reported (and, for static W8A8, get the layer's "
                   "activation range).")
@click.option("--all-experts", is_flag=True,
              help="MoE: run every calibration token through every expert for statistics (none left uncalibrated).")
@click.option("--layout", type=click.Choice(["msmodelslim", "mindie"]), default="msmodelslim", show_default=True,
              help="File names: quant_model_weights*.safetensors + quant_model_description.json, or MindIE's older "
                   "quant_model_weight_<type>.safetensors + quant_model_description_<type>.json.")
@click.option("--max-shard-size", type=SIZE, default="4GB", show_default=True,
              help="Size cap of each weights part (a tensor larger than it is a part of its own, as HF writes).")
@click.option("--rotate", "rotate_seed", type=int, default=None, is_flag=False, flag_value=0, metavar="[SEED]",
              help="Rotate the residual stream first (QuaRot): norms folded, an orthogonal (randomised Hadamard) "
                   "matrix folded into every linear that reads or writes it, so activation outliers spread over all "
                   "channels; the same function, loaded as ordinary weights (dsconv rotate; docs/rotation.md). SEED "
                   "picks the random signs (default 0).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default=None,
              help="Write the float tensors (norms, embeddings, biases) in this dtype and make it the model's: a "
                   "float32 checkpoint in one step for MindIE, which runs bf16 and fp16 only (default: as stored).")
@click.option("--calib-precision", type=click.Choice(["auto", "fp32", "fp32-onednn", "bf16"]), default="auto",
              show_default=True,
              help="The calibration forward's matmuls (linear, attention). fp32: float32 through torch's own (MKL). "
                   "fp32-onednn: float32 through oneDNN, the same arithmetic summed in another order, 2x on x86 "
                   "CPUs not made by Intel (MKL runs its generic code there); auto: fp32-onednn on those, fp32 "
                   "elsewhere (the two moved real models' perplexity alike over 16 calibration sets); the "
                   "manifest records which ran. bf16: bf16 inputs with float32 sums, 5-6x faster on "
                   "CPUs with AMX (Intel Sapphire Rapids and later) and what the NPU computes; statistics, searches "
                   "and fallback checks stay float32; not for --method gptq/awq (docs/performance.md, "
                   "docs/accuracy.md).")
@click.option("--dry-run", is_flag=True, help="Print the plan from headers (types, sizes) and write nothing.")
@exec_options
@force_option
@json_option
def quantize(model: Path | None, output: Path | None, bits: str | None, scheme: str | None, moe_scheme: str | None,
             kv_cache: str | None, engine: str | None, group_size: int | None,
             method: str | None, act_method: str, smooth_alpha: str | None, fallback: int | None,
             fallback_threshold: float | None, fallback_to: str, recipe: str, ignore: tuple[str, ...],
             calib: Path | None,
             calib_samples: int | None, seq_len: int, min_expert_tokens: int, all_experts: bool, layout: str,
             max_shard_size: int, rotate_seed: int | None, dtype: str | None, calib_precision: str, dry_run: bool,
             workers: int | None, executor: str | None, ray_address: str | None, force: bool, as_json: bool) -> None:
    """Quantize a model to INT8/INT4 in the layout Ascend serving engines load, layer by layer."""
    from dsconv import engines
    from dsconv.quant.plan.options import QuantOptions
    from dsconv.quant.plan.plan import BITS, DEFAULT_SCHEME, SCHEMES
    from dsconv.quant.stage import QuantRequest, run

    bits_default = scheme is None
    engine = engines.get(engine).name
    if scheme is None:
        if bits is None:
            raise UserError("give --bits 8|4 (or --scheme)", hint="e.g. `dsconv quantize --bits 8`")
        scheme = DEFAULT_SCHEME[int(bits)]
    elif bits is not None and BITS[SCHEMES[scheme]] != int(bits):
        raise UserError(f"--scheme {scheme} has {BITS[SCHEMES[scheme]]}-bit weights, not --bits {bits}",
                        hint="drop one of them")
    if method is None:
        method = default_method(scheme, BITS[SCHEMES[scheme]])
        if method in ("gptq", "awq") and not dry_run:
            warn(f"--method {method} is the default for {scheme} (docs/accuracy.md): calibrating on "
                 f"{calib or 'the bundled qa.jsonl'}; --method rtn needs no calibration")
    if calib_precision == "bf16" and not dry_run:
        from dsconv.runtime.process import native_bf16_matmul

        if not native_bf16_matmul():
            warn("--calib-precision bf16: this CPU has no bf16 matmul unit (AMX, AVX512-BF16); its bf16 forward may "
                 "run slower than the float32 default")
    model = workspace.resolve_model(model)
    output = workspace.resolve_output("quantize", output) if not dry_run or output else Path(".")
    opts = QuantOptions(scheme=scheme, group_size=group_size, method=method, act_method=act_method,
                        smooth_alpha=parse_smooth(smooth_alpha), recipe=recipe, fallback=fallback,
                        fallback_threshold=fallback_threshold,
                        fallback_to=fallback_to, ignore=tuple(ignore), calib=calib, calib_samples=calib_samples,
                        seq_len=seq_len, min_expert_tokens=min_expert_tokens, all_experts=all_experts, layout=layout,
                        engine=engine, bits_default=bits_default, moe_scheme=moe_scheme,
                        max_shard_size=max_shard_size, kv_cache=kv_cache, rotate=rotate_seed, dtype=dtype,
                        calib_precision=calib_precision)
    result = run(QuantRequest(model, output, opts, force=force, progress=not as_json, dry_run=dry_run, warn=warn,
                              execution=resolve_exec(workers, executor, ray_address)))
    if as_json:
        emit_json(result.summary)
    else:
        click.echo(result.render())
        s = result.summary
        if result.dry_run:
            click.echo(f"per layer kind for {s['engine']}: " + "; ".join(
                f"{k} " + ", ".join(f"{n} {t}" for t, n in v.items()) for k, v in s["layer_types"].items()))
        if s.get("config_keys"):
            click.echo("config.json: " + ", ".join(f'"{k}": "{v}"' for k, v in s["config_keys"].items()))


@click.command()
@model_option
@output_option
@click.option("--seed", type=int, default=0, show_default=True, help="The random signs of the Hadamard matrix.")
@force_option
@json_option
def rotate(model: Path | None, output: Path | None, seed: int, force: bool, as_json: bool) -> None:
    """Rotate the residual stream (QuaRot) into a float checkpoint that computes the same function.

    Norm scales are folded into the linears that read them, and an orthogonal matrix (a randomised Hadamard where the
    width has one) into the embedding and every linear that reads or writes the residual stream: activation outliers
    are spread over all channels, which is what `dsconv quantize --rotate` quantizes. Engines load the result as any
    float checkpoint (a tied LM head becomes untied)."""
    from dsconv.quant.rotate import RotateRequest, run

    model = workspace.resolve_model(model)
    output = workspace.resolve_output("rotate", output)
    result = run(RotateRequest(model, output, seed=seed, force=force, progress=not as_json))
    if as_json:
        emit_json(result.summary)
    else:
        click.echo(result.render())
