"""The shared vocabulary (docs/architecture.md): every stage asks a tensor's Role, never its name."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Role(str, Enum):
    EMBED = "embed"
    LM_HEAD = "lm_head"
    NORM = "norm"
    ATTN_IN = "attn_in"          # q/k/v, q_b, kv_b: output rows split by TP in whole heads
    ATTN_LATENT = "attn_latent"  # q_a, kv_a_with_mqa: replicated
    ATTN_OUT = "attn_out"        # o_proj: input columns split by TP
    MLP_IN = "mlp_in"            # dense and shared-expert gate/up
    MLP_OUT = "mlp_out"          # dense and shared-expert down
    EXPERT_IN = "expert_in"      # routed expert gate/up (w1/w3)
    EXPERT_OUT = "expert_out"    # routed expert down (w2)
    ROUTER = "router"            # mlp.gate, e_score_correction_bias, shared_expert_gate
    MTP_PROJ = "mtp_proj"        # DeepSeek MTP eh_proj: replicated, kept in high precision
    INDEXER = "indexer"          # DeepSeek-V3.2's lightning indexer (wq_b, wk, weights_proj): replicated, float
    MIXER = "mixer"              # linear attention's per-channel parameters (conv1d, A_log, dt_bias): split by heads
    TOWER = "tower"              # a vision-language checkpoint's vision tower: carried as it is, in float

    @property
    def tp_dim(self) -> int | None:
        """Dimension split by tensor parallelism (None: replicated; experts are placed whole by EP)."""
        return _TP_DIM[self]

    @property
    def is_linear(self) -> bool:
        return self in LINEAR_ROLES

    @property
    def quantized_by_default(self) -> bool:
        return self in QUANTIZED_BY_DEFAULT


_TP_DIM = {Role.EMBED: 0, Role.LM_HEAD: 0, Role.NORM: None, Role.ATTN_IN: 0, Role.ATTN_LATENT: None,
           Role.ATTN_OUT: 1, Role.MLP_IN: 0, Role.MLP_OUT: 1, Role.EXPERT_IN: 0, Role.EXPERT_OUT: 1,
           Role.ROUTER: None, Role.MTP_PROJ: None, Role.INDEXER: None, Role.MIXER: 0,
           Role.TOWER: None}
LINEAR_ROLES = frozenset({Role.ATTN_IN, Role.ATTN_LATENT, Role.ATTN_OUT, Role.MLP_IN, Role.MLP_OUT,
                          Role.EXPERT_IN, Role.EXPERT_OUT, Role.MTP_PROJ, Role.LM_HEAD, Role.INDEXER})
QUANTIZED_BY_DEFAULT = frozenset({Role.ATTN_IN, Role.ATTN_LATENT, Role.ATTN_OUT, Role.MLP_IN, Role.MLP_OUT,
                                  Role.EXPERT_IN, Role.EXPERT_OUT})


class Category(str, Enum):
    """How `inspect` groups parameters and bytes."""

    EMBEDDING = "embedding"
    LM_HEAD = "lm_head"
    ATTENTION = "attention"
    DENSE_MLP = "dense_mlp"
    ROUTED_EXPERTS = "routed_experts"
    SHARED_EXPERTS = "shared_experts"
    ROUTER = "router"
    NORMS = "norms"
    INDEXER = "indexer"
    MTP = "mtp"
    VISION = "vision"


# Parameter names a module can carry; quantization auxiliaries follow the weight they belong to.
WEIGHT_PARAMS = ("weight", "bias")
AUX_PARAMS = ("weight_scale_inv", "weight_scale", "weight_offset", "input_scale", "input_offset", "deq_scale",
              "quant_bias", "scale_bias", "kv_cache_scale", "kv_cache_offset")
OTHER_PARAMS = ("e_score_correction_bias",)
ALL_PARAMS = WEIGHT_PARAMS + AUX_PARAMS + OTHER_PARAMS


@dataclass(frozen=True, init=False)
class TensorRole:
    """What a family says of one tensor name."""

    module: str              # the module path (name without its parameter suffix)
    param: str               # weight, bias, weight_scale_inv, deq_scale, ...
    role: Role
    category: Category
    layer: int | None = None
    expert: int | None = None
    slot: str | None = None  # gate / up / down for MLPs and experts

    def __init__(self, module: str, param: str, role: Role, category: Category, layer: int | None = None,
                 expert: int | None = None, slot: str | None = None) -> None:
        # stores into the instance dict, not seven frozen-dataclass setattrs (2.7x faster; an open of DeepSeek-V3
        # classifies 91,991 names); in field order, so the dict keeps sharing its keys with the class's
        d = self.__dict__
        d["module"], d["param"], d["role"], d["category"], d["layer"], d["expert"], d["slot"] = \
            module, param, role, category, layer, expert, slot

    @property
    def is_aux(self) -> bool:
        """A quantization auxiliary (FP8 scale, int8 scale/offset, ...) rather than a model parameter."""
        return self.param in AUX_PARAMS
