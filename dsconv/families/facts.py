"""ModelFacts: the one reader of config.json's meaning (layer/expert counts, head geometry, MLA ranks, norms, rope,
routing, sliding windows), and `hf_config`, the one place a transformers config object is made from config.json.

Each family's `_facts` fills the fields from its own keys; every stage (and the torch and MindSpore builders) asks
these facts, never config.json directly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from dsconv.errors import UserError
from dsconv.tensors import DTYPE_FROM_CONFIG



@dataclass
class ModelFacts:
    """The config-derived facts every stage needs (layer/expert counts, head geometry, MLA ranks)."""

    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    intermediate_size: int
    dtype: str = "BF16"
    num_mtp_layers: int = 0
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    fp8_block: tuple[int, int] | None = None
    #: per layer "full_attention" or "linear_attention" (hybrid models: Qwen3-Next); () = every layer full attention
    layer_kinds: tuple[str, ...] = ()
    #: DeepSeek-V3.2's lightning indexer: heads x head dim of its queries (0: no indexer); its key cache per token
    index_n_heads: int = 0
    index_head_dim: int = 0
    #: Gated DeltaNet linear attention (Qwen3-Next): key/value heads and head dims, causal conv kernel
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_head_dim: int = 0
    linear_v_head_dim: int = 0
    linear_conv_kernel: int = 0
    #: full attention with an output gate: q_proj writes the query and a sigmoid gate per head (Qwen3-Next)
    attn_output_gate: bool = False
    #: an MTP layer stores its own embedding and LM head (DeepSeek) rather than sharing the main model's (GLM-4.5)
    mtp_own_head: bool = True
    #: q/k RMSNorm in full attention (GLM-4.5 reads use_qk_norm)
    qk_norm: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    # ---- read for the builders (not reported: `as_dict` keeps the fields above) ----
    config: dict[str, Any] = field(default_factory=dict, repr=False)
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    qkv_bias: bool = False
    #: routed-expert selection: "softmax" (softmax top-k, Qwen-MoE/Mixtral) or "sigmoid_group" (DeepSeek noaux_tc)
    router: str = "softmax"
    #: renormalise the top-k weights; None: as transformers' config says (Mixtral always does)
    norm_topk_prob: bool | None = None
    #: sliding windows: "all" (every layer when sliding_window is set: Mistral, Mixtral, Qwen3-MoE) or "layer_types"
    sliding: str = "layer_types"

    # ---- shape formulas the family tables use ----
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_out_size(self) -> int:
        return self.num_heads * self.v_head_dim

    @property
    def kv_a_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_b_size(self) -> int:
        return self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)

    @property
    def q_proj_size(self) -> int:
        """q_proj's rows: the query heads, twice over with an output gate."""
        return self.q_size * (2 if self.attn_output_gate else 1)

    @property
    def index_q_size(self) -> int:
        return self.index_n_heads * self.index_head_dim

    @property
    def linear_key_dim(self) -> int:
        return self.linear_k_heads * self.linear_k_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_v_heads * self.linear_v_head_dim

    @property
    def linear_qkvz_size(self) -> int:
        """in_proj_qkvz's rows: q and k per key head, v and the output gate z per value head."""
        return 2 * self.linear_key_dim + 2 * self.linear_value_dim

    @property
    def linear_qkv_size(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def linear_ba_size(self) -> int:
        """in_proj_ba's rows: the write strength b and the decay a, one each per value head."""
        return 2 * self.linear_v_heads

    def attention_kind(self, layer: int | None) -> str:
        """A layer's attention kind: "linear_attention" where `layer_kinds` says so, else "full_attention" (an MTP
        layer past the listed ones included)."""
        return self.layer_kinds[layer] if layer is not None and layer < len(self.layer_kinds) else "full_attention"

    @property
    def linear_attention_layers(self) -> int:
        return sum(k == "linear_attention" for k in self.layer_kinds)

    @property
    def full_attention_layers(self) -> int:
        """Layers with a KV cache (all but the linear-attention ones of a hybrid model)."""
        return self.num_layers - self.linear_attention_layers

    @property
    def mtp_in_size(self) -> int:
        return 2 * self.hidden_size

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and bool(self.moe_layers)

    def kv_bytes_per_token(self, bytes_per_element: int = 2, tp: int = 1) -> int:
        """KV-cache bytes per token on one card, all layers (MTP excluded).

        MLA caches the latent (kv_lora_rank + rope dims), replicated on every TP rank; MHA/GQA caches K and V for the
        KV heads, divided by tp while tp <= KV heads (beyond that each rank keeps one head). An int8 MLA cache (FA
        quant) holds the latent in int8 and its rope part in the model dtype (2 bytes).
        """
        if self.is_mla:
            rope_bytes = 2 if bytes_per_element == 1 else bytes_per_element
            return self.num_layers * (self.kv_lora_rank * bytes_per_element + self.qk_rope_head_dim * rope_bytes) \
                + self.indexer_bytes_per_token()
        heads = max(1, math.ceil(self.num_kv_heads / tp)) if tp > 1 else self.num_kv_heads
        return 2 * self.full_attention_layers * heads * self.head_dim * bytes_per_element

    def indexer_bytes_per_token(self) -> int:
        """DeepSeek-V3.2's indexer key cache, all layers: one index_head_dim key per token and layer, replicated on
        every TP rank like the latent; 2 bytes per element whatever the KV cache's dtype (the engines keep it
        apart from the C8/FA-quant scales)."""
        return self.num_layers * self.index_head_dim * 2

    def state_bytes_per_sequence(self, bytes_per_element: int = 2, tp: int = 1) -> int:
        """The constant-size state a linear-attention layer keeps per sequence instead of a KV cache, all such layers,
        on one card: the causal conv's last kernel-1 inputs (conv_dim channels) and the DeltaNet recurrent matrix
        (k_head_dim x v_head_dim per value head), both split by TP with the heads, as vLLM allocates them
        (vllm/model_executor/layers/mamba/mamba_utils.py::gated_delta_net_state_shape)."""
        linear = self.linear_attention_layers
        if not linear:
            return 0
        conv = self.linear_qkv_size * (self.linear_conv_kernel - 1)
        recurrent = self.linear_v_heads * self.linear_k_head_dim * self.linear_v_head_dim
        return linear * math.ceil((conv + recurrent) / tp) * bytes_per_element

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in NOT_REPORTED
             and not (k in REPORTED_IF_SET and v == REPORTED_IF_SET[k])}
        d["moe_layers"] = list(self.moe_layers)
        if self.layer_kinds:
            d["layer_kinds"] = list(self.layer_kinds)
        return d

    # ---- what transformers' config object computes (defaults, layer_types, rope tables) ----
    def hf(self):
        """transformers' config object for this config (built once)."""
        if "_hf" not in self.extra:
            self.extra["_hf"] = hf_config(self.config)
        return self.extra["_hf"]

    def layer_windows(self) -> list[int]:
        """Per layer: 0 for full causal attention, else the sliding window (as transformers builds its masks)."""
        cfg = self.hf()
        n = self.num_layers
        window = getattr(cfg, "sliding_window", None) or 0
        if not window:
            return [0] * n
        if self.sliding == "all":
            return [int(window)] * n
        types = getattr(cfg, "layer_types", None) or ["full_attention"] * n
        return [int(window) if t == "sliding_attention" else 0 for t in types[:n]]

    @property
    def rotary_fraction(self) -> float:
        """The share of each head rope turns: transformers' partial_rotary_factor (rope_parameters in v5, top level
        before); 1.0 for a full rotation."""
        cfg = self.hf()
        params = getattr(cfg, "rope_parameters", None) or {}
        return float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0)

    def rope_tables(self, where: str = "config.json") -> tuple[Any, float]:
        """(inv_freq float32 [dim/2], attention scaling) exactly as the model's RotaryEmbedding computes them."""
        import torch
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        cfg = self.hf()
        params = getattr(cfg, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type not in STATIC_ROPE:
            raise UserError(f"{where}: rope_type {rope_type!r} is not supported by the MindIR export",
                            hint=f"supported: {', '.join(STATIC_ROPE)} (dynamic and longrope change tables with "
                                 "length)")
        if rope_type == "default":
            base = params["rope_theta"]
            dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            dim = int(dim * self.rotary_fraction)
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg)
        return inv_freq.float().numpy(), float(scaling)

    def softmax_scale(self, head_dim: int) -> float:
        """head_dim^-0.5, times mscale^2 when yarn's mscale_all_dim is set (DeepSeek; transformers' yarn)."""
        scaling = head_dim ** (-0.5)
        params = getattr(self.hf(), "rope_parameters", None) or {}
        if params.get("rope_type", "default") != "default":
            mscale_all_dim = params.get("mscale_all_dim", 0)
            if mscale_all_dim:
                factor = params["factor"]
                mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
                scaling = scaling * mscale * mscale
        return scaling

    def routing(self) -> dict[str, Any]:
        """Routed-expert selection parameters as transformers' config resolves them (its defaults included)."""
        cfg = self.hf()
        norm = self.norm_topk_prob
        return {"top_k": int(cfg.num_experts_per_tok),
                "norm_topk_prob": bool(getattr(cfg, "norm_topk_prob", False)) if norm is None else norm,
                "n_group": int(getattr(cfg, "n_group", 1) or 1), "topk_group": int(getattr(cfg, "topk_group", 1) or 1),
                "routed_scaling_factor": float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0)}

    def require_silu(self, where: str = "config.json") -> None:
        if self.hidden_act not in ("silu", "swish"):
            raise UserError(f"{where}: hidden_act {self.hidden_act!r} is not supported by the MindIR export",
                            hint="SwiGLU (silu) only")


#: the newer families' fields, reported only where they differ from these defaults (the older families' reports stay)
REPORTED_IF_SET = {"layer_kinds": (), "index_n_heads": 0, "index_head_dim": 0, "linear_k_heads": 0,
                   "linear_v_heads": 0, "linear_k_head_dim": 0, "linear_v_head_dim": 0, "linear_conv_kernel": 0,
                   "attn_output_gate": False, "mtp_own_head": True, "qk_norm": True}
#: ModelFacts fields that are not part of the reported architecture (inspect's JSON)
NOT_REPORTED = ("extra", "config", "rms_norm_eps", "hidden_act", "qkv_bias", "router", "norm_topk_prob", "sliding")
# rope types whose tables do not depend on the sequence length (dynamic NTK and longrope switch tables at run time)
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "proportional")


class ConfigValues(Mapping[str, Any]):
    """What a family's `_facts` reads: the keys it declares (`Family.config_keys`), checked and defaulted by
    dsconv.schemas.model.config_fields, and `raw`, the whole config.json (transformers' config is built from it).

    Why reading an undeclared key is an error (a KeyError, a bug): every key `_facts` reads is then declared, so it
    is validated when the config is read and fuzzed (benchmarks/fuzz.py takes its keys from the declarations)."""

    def __init__(self, values: dict[str, Any], raw: Mapping[str, Any]) -> None:
        self._values = values
        self.raw = raw

    def __getitem__(self, key: str) -> Any:
        if key not in self._values:
            raise KeyError(f"config key {key!r} is read but not in the family's config_keys")
        return self._values[key]

    def get(self, key: str, default: Any = None) -> Any:  # no silent default for an undeclared key
        value = self[key]
        return default if value is None else value

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def cfg_get(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    """First present key (HF renamed several across versions, e.g. torch_dtype -> dtype)."""
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    return default


def config_dtype(c: Mapping[str, Any]) -> str:
    raw = str(cfg_get(c, "dtype", "torch_dtype", default="bfloat16")).replace("torch.", "")
    return DTYPE_FROM_CONFIG.get(raw, "BF16")


#: model_type -> the transformers model type whose code runs it, where transformers has no class of its own
#: (Kimi-K2 names remote code in auto_map; dsconv never runs it, it builds DeepSeek-V3). Filled by @register.
TRANSFORMERS_MODEL_TYPE: dict[str, str] = {}


def hf_config(config: dict[str, Any], where: str = "config.json"):
    """transformers' config object for config.json's dict (no model, no weights). FP8/int8 `quantization_config` is
    dropped: dsconv hands transformers plain float weights (dequantized by the reader)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    cfg = {k: v for k, v in config.items() if k not in ("quantization_config", "auto_map")}
    model_type = cfg.pop("model_type", None)
    try:
        return AutoConfig.for_model(TRANSFORMERS_MODEL_TYPE.get(model_type, model_type), **cfg)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as e:  # transformers 5 validates its fields
        raise UserError(f"{where}: transformers cannot read it as a {model_type} config ({e})",
                        hint="compare it with the model's published config.json") from None


def legacy_config_keys(config: dict[str, Any]) -> dict[str, Any]:
    """The pre-transformers-5 spellings of keys transformers 5 renamed, from the new ones: `torch_dtype` (MindIE's
    ModelRunner reads it under its pinned transformers 4.30, which ignores `dtype`), `rope_theta` and
    `rope_scaling` (from `rope_parameters`; read as attributes by MindIE's model configs, where a missing
    rope_theta silently means 10000 and a missing rope_scaling is a TypeError for DeepSeek). Empty when the config
    already uses the old names."""
    out: dict[str, Any] = {}
    if config.get("dtype") is not None:
        out["torch_dtype"] = config["dtype"]
    rp = config.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" in rp:  # one table (not nested per attention type)
        out["rope_theta"] = rp["rope_theta"]
        kind = rp.get("rope_type", rp.get("type", "default"))
        # null for plain rope: MindIE's DeepseekV2Config takes rope_scaling as a required argument
        out["rope_scaling"] = None if kind == "default" else {
            **{k: v for k, v in rp.items() if k != "rope_theta"}, "type": kind, "rope_type": kind}
    return out
