"""The options of `dsconv quantize` and the rules between them (checked against the plan before any work)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dsconv.errors import UserError
from dsconv.io.writer import DEFAULT_MAX_SHARD_SIZE
from dsconv.quant.algorithms.methods import ACT_SEARCH, METHODS, smoothing_mode
from dsconv.quant.algorithms.observers import ACT_METHODS
from dsconv.qformat import STATIC_TYPES
from dsconv.quant.plan.plan import ACT_QUANT, FALLBACK_TARGETS, QuantPlan

# Default --fallback-threshold: static W8A8 units whose relative output error exceeds 10% fall back. Measured on a
# small Llama trained here (benchmarks/bench_quantize.py): the down_proj units (input SiLU(gate) * up, the outliers
# the reference describes) are the most sensitive at 1.8-4.6%, every other unit is below 1.8%, and static W8A8 as a
# whole costs +0.11% perplexity - nothing there needs to fall back. 10% is where per-tensor int8 has lost more than
# three bits to a few outlier channels (the error grows ~2x per lost bit); such a unit costs far more than its share.
DEFAULT_FALLBACK_THRESHOLD = 0.10


@dataclass
class QuantOptions:
    scheme: str = "w8a8"
    group_size: int | None = None
    method: str = "rtn"
    act_method: str = ACT_SEARCH  # min/max clipped by output error (clipping.py); or an observer method
    smooth_alpha: float | str | None = "auto"  # "auto": searched per site (smoothing.py); None: off; or an alpha
    fallback: int | None = None
    fallback_threshold: float | None = None
    fallback_to: str = "w8a8_dynamic"
    recipe: str = "mixed"  # static W8A8: down_proj per-token dynamic (recipe.py); "uniform": all static
    ignore: tuple[str, ...] = ()
    calib: Path | None = None
    calib_samples: int | None = None
    seq_len: int = 512
    min_expert_tokens: int = 32
    all_experts: bool = False
    layout: str = "msmodelslim"
    engine: str = "mindie"            # dsconv.engines profile the output must load in
    bits_default: bool = False        # scheme came from --bits (the engine's recipe) rather than --scheme
    moe_scheme: str | None = None     # routed experts' scheme when it differs (--moe-scheme)
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    kv_cache: str | None = None       # "int8": C8 key/value cache scales from calibration (--kv-cache)
    damp: float = 0.1
    batch_tokens: int = 4096   # padded tokens per forward batch
    sample_tokens: int = 128   # calibration rows kept per linear input to measure output error (fallbacks, report)
    rotate: int | None = None  # --rotate: the seed of the residual rotation quantize runs on (dsconv/quant/rotate.py)
    dtype: str | None = None   # --dtype bf16|fp16: the output's float tensors and model dtype (a float32 input)
    # --calib-precision: the forward's matmuls ("auto": resolved by quant/stage.py, to None - fp32, MKL - or another)
    calib_precision: str | None = "auto"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("rotate", "dtype", "calib_precision"):  # manifests of runs without them stay as they were
            if d[key] is None:
                d.pop(key)
        d["calib"] = str(self.calib) if self.calib else None
        d["ignore"] = list(self.ignore)
        return d


def fallback_policy(opts: QuantOptions, plan: QuantPlan) -> tuple[str, float] | None:
    """('count', N) | ('threshold', X) for static W8A8; None when no type depends on measurements."""
    if opts.fallback is not None and opts.fallback < 0:
        raise UserError(f"--fallback {opts.fallback} must be >= 0")
    if opts.fallback_threshold is not None and opts.fallback_threshold < 0:
        raise UserError(f"--fallback-threshold {opts.fallback_threshold} must be >= 0")
    if plan.scheme not in STATIC_TYPES:
        if opts.fallback or opts.fallback_threshold is not None:
            raise UserError(f"--fallback/--fallback-threshold apply to static w8a8, not {plan.scheme.lower()}",
                            hint="drop them, or use --scheme w8a8")
        return None
    if opts.fallback is not None and opts.fallback_threshold is not None:
        raise UserError("--fallback N and --fallback-threshold X are alternatives", hint="give one of them")
    if opts.fallback is not None:
        return None if opts.fallback == 0 else ("count", float(opts.fallback))
    return ("threshold", DEFAULT_FALLBACK_THRESHOLD if opts.fallback_threshold is None
            else opts.fallback_threshold)


def check_options(opts: QuantOptions, plan: QuantPlan) -> None:
    if opts.act_method not in ACT_METHODS + (ACT_SEARCH,):
        raise UserError(f"unknown --act-method {opts.act_method}",
                        hint=f"choose one of {', '.join((ACT_SEARCH,) + ACT_METHODS)}")
    if opts.fallback_to not in FALLBACK_TARGETS:
        raise UserError(f"--fallback-to {opts.fallback_to} is not a fallback type",
                        hint=f"choose {' or '.join(FALLBACK_TARGETS)}")
    if isinstance(opts.smooth_alpha, float) and plan.scheme not in ACT_QUANT:
        raise UserError(f"--smooth-quant applies to schemes with quantized activations, not {plan.scheme.lower()}",
                        hint="use it with --scheme w8a8 or w8a8_dynamic")
    if opts.method not in METHODS:
        raise UserError(f"unknown --method {opts.method}", hint=f"use {', '.join(METHODS)}")
    if opts.min_expert_tokens < 0:
        raise UserError("--min-expert-tokens must be >= 0")
    if opts.calib_precision not in (None, "auto", "fp32", "fp32-onednn", "bf16"):
        raise UserError(f"unknown --calib-precision {opts.calib_precision}",
                        hint="choose auto, fp32, fp32-onednn or bf16")
    if opts.calib_precision == "bf16" and opts.method in ("gptq", "awq"):
        raise UserError(f"--calib-precision bf16 does not apply to --method {opts.method}: its Hessian and scale "
                        "search are computed inside the forward and need float32",
                        hint="drop --calib-precision (or use --method rtn)")


def needs_calibration(opts: QuantOptions, plan: QuantPlan) -> bool:
    """Weight-only round-to-nearest needs no activations; an explicit --calib still runs (for expert load), and
    C8 cache scales are measured on real text."""
    return (plan.scheme in STATIC_TYPES or opts.method in ("gptq", "awq") or smoothing_of(opts, plan) is not None
            or opts.calib is not None or bool(plan.kv))


def smoothing_of(opts: QuantOptions, plan: QuantPlan) -> float | str | None:
    """None (off), "auto" or a fixed alpha: what this plan smooths with."""
    return smoothing_mode(opts.smooth_alpha, plan.scheme in ACT_QUANT)
