"""What the networks read from a model's config: transformers' own config object (its defaults and normalisation,
e.g. `rope_parameters` holding rope_theta in v5, `layer_types`) and its own rope init functions, so rotary tables
(linear, llama3, yarn incl. DeepSeek's mscale) are bit-identical to the PyTorch model's."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from dsconv.errors import UserError

# rope types whose tables do not depend on the sequence length (dynamic NTK and longrope switch tables at run time)
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "proportional")


def hf_config(model_dir: Path, config: dict[str, Any]):
    """transformers' config object for config.json (no model, no weights)."""
    import transformers

    cfg = dict(config)
    cfg.pop("quantization_config", None)  # FP8/int8 loading hints; the network gets plain float weights
    try:
        return transformers.AutoConfig.for_model(**cfg)
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"{model_dir / 'config.json'}: transformers cannot read it ({e})",
                        hint="compare it with the model's published config.json") from None


def require_silu(cfg, where: str) -> None:
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UserError(f"{where}: hidden_act {act!r} is not supported by the MindIR export", hint="SwiGLU (silu) only")


def rope_tables(cfg, where: str) -> tuple[np.ndarray, float]:
    """(inv_freq float32 [dim/2], attention scaling) exactly as the model's RotaryEmbedding computes them."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(cfg, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE:
        raise UserError(f"{where}: rope_type {rope_type!r} is not supported by the MindIR export",
                        hint=f"supported: {', '.join(STATIC_ROPE)} (dynamic and longrope change tables with length)")
    if rope_type == "default":
        base = params["rope_theta"]
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dim = int(dim * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg)
    return inv_freq.float().numpy(), float(scaling)


def sliding_windows(cfg, all_layers_key: bool) -> list[int]:
    """Per layer: 0 for full causal attention, else the sliding window (as transformers builds its masks).

    `all_layers_key`: Mistral/Mixtral/Qwen3-MoE slide on every layer when `sliding_window` is set; Qwen2/Qwen3/
    Qwen2-MoE slide on the layers `layer_types` marks as "sliding_attention".
    """
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None) or 0
    if not window:
        return [0] * n
    if all_layers_key:
        return [int(window)] * n
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * n
    return [int(window) if t == "sliding_attention" else 0 for t in types[:n]]


def yarn_softmax_scale(cfg, head_dim: int) -> float:
    """DeepSeek: head_dim^-0.5, times mscale^2 when yarn's mscale_all_dim is set (transformers' yarn_apply_mscale)."""
    scaling = head_dim ** (-0.5)
    params = getattr(cfg, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            factor = params["factor"]
            mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scaling = scaling * mscale * mscale
    return scaling
