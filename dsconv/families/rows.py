"""The row builders family tables are written with (keywords only): a linear's weight, a norm, Llama-style attention,
a gated MLP, routed experts, a router, the decoder skeleton, the MTP layer's own tensors. A module path is the name
template without its parameter; per-layer ones start with LAYER."""
from __future__ import annotations

from dsconv.families.base import LAYER, Dim, TensorRow
from dsconv.families.roles import Category, Role

Rows = tuple[TensorRow, ...]
SELF_ATTN = LAYER + "self_attn."
GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")


def linear(*, key: str, module: str, role: Role, category: Category, shape: tuple[Dim, Dim], slot: str | None = None,
           when: str | None = None) -> Rows:
    """The weight of one linear layer, shape (out, in)."""
    return (TensorRow(key=key, name=module + ".weight", role=role, category=category, shape=shape, slot=slot,
                      when=when),)


def norm(*, key: str, module: str, size: Dim = "hidden_size", category: Category = Category.NORMS,
         when: str | None = None, slot: str | None = None) -> Rows:
    return (TensorRow(key=key, name=module + ".weight", role=Role.NORM, category=category, shape=(size,), when=when,
                      slot=slot),)


def gqa_attention(*, qkv_bias: bool = True, when: str | None = None) -> Rows:
    """Llama-style attention: q/k/v (biases where `qkv_bias` facts say so), o. q_proj's rows are `q_proj_size`
    (twice the heads where the attention gates its output, Qwen3-Next). `when`: the layers that have it."""
    attn = {"role": Role.ATTN_IN, "category": Category.ATTENTION, "when": when}
    rows = (*linear(key="attn.q", module=SELF_ATTN + "q_proj", **attn, shape=("q_proj_size", "hidden_size"), slot="q"),
            *linear(key="attn.k", module=SELF_ATTN + "k_proj", **attn, shape=("kv_size", "hidden_size"), slot="k"),
            *linear(key="attn.v", module=SELF_ATTN + "v_proj", **attn, shape=("kv_size", "hidden_size"), slot="v"))
    if qkv_bias:
        attn.pop("when")
        rows += tuple(TensorRow(key=f"attn.{s}_bias", name=f"{SELF_ATTN}{s}_proj.bias", **attn, shape=(size,), slot=s,
                                when="qkv_bias") for s, size in (("q", "q_size"), ("k", "kv_size"), ("v", "kv_size")))
    return rows + linear(key="attn.o", module=SELF_ATTN + "o_proj", role=Role.ATTN_OUT, category=Category.ATTENTION,
                         shape=("hidden_size", "attn_out_size"), slot="o", when=when)


def qk_norm(*, when: str | None = None) -> Rows:
    """Per-head RMSNorm on q and k before rotary (Qwen3, Gemma 3; GLM-4.5 where use_qk_norm)."""
    return (*norm(key="attn.q_norm", module=SELF_ATTN + "q_norm", size="head_dim", when=when),
            *norm(key="attn.k_norm", module=SELF_ATTN + "k_norm", size="head_dim", when=when))


def swiglu(*, module: str, category: Category, inter: Dim, key: str = "mlp", when: str | None = None,
           role_in: Role = Role.MLP_IN, role_out: Role = Role.MLP_OUT,
           names: tuple[str, str, str] = GATE_UP_DOWN) -> Rows:
    """gate/up/down of a gated MLP (dense, shared expert, or one routed expert) under `module`, named `names`."""
    g, u, d = names
    return (*linear(key=f"{key}.gate", module=f"{module}.{g}", role=role_in, category=category,
                    shape=(inter, "hidden_size"), slot="gate", when=when),
            *linear(key=f"{key}.up", module=f"{module}.{u}", role=role_in, category=category,
                    shape=(inter, "hidden_size"), slot="up", when=when),
            *linear(key=f"{key}.down", module=f"{module}.{d}", role=role_out, category=category,
                    shape=("hidden_size", inter), slot="down", when=when))


def experts(*, module: str = LAYER + "mlp.experts.{E}", names: tuple[str, str, str] = GATE_UP_DOWN,
            inter: Dim = "moe_intermediate_size") -> Rows:
    """One routed expert's gate/up/down (rows keyed expert.gate/up/down, present in MoE layers)."""
    return swiglu(module=module, category=Category.ROUTED_EXPERTS, inter=inter, key="expert", when="moe",
                  role_in=Role.EXPERT_IN, role_out=Role.EXPERT_OUT, names=names)


def router(*, module: str = LAYER + "mlp.gate", key: str = "router", out: Dim = "num_experts",
           when: str | None = "moe") -> Rows:
    return (TensorRow(key=key, name=module + ".weight", role=Role.ROUTER, category=Category.ROUTER,
                      shape=(out, "hidden_size"), when=when),)


def embedding() -> Rows:
    return linear(key="embed", module="model.embed_tokens", role=Role.EMBED, category=Category.EMBEDDING,
                  shape=("vocab_size", "hidden_size"))


def final_norm_and_head() -> Rows:
    """The final norm and the lm_head (absent when tied)."""
    return (*norm(key="norm.final", module="model.norm"),
            *linear(key="lm_head", module="lm_head", role=Role.LM_HEAD, category=Category.LM_HEAD,
                    shape=("vocab_size", "hidden_size"), when="untied"))


def layer_norms() -> Rows:
    return (*norm(key="norm.input", module=LAYER + "input_layernorm"),
            *norm(key="norm.post", module=LAYER + "post_attention_layernorm"))


def decoder(*, attention: Rows, mlp: Rows) -> Rows:
    """The Llama skeleton every family here shares: embeddings, per layer two norms + attention + MLP, final norm,
    lm_head (absent when tied)."""
    return (*embedding(), *layer_norms(), *attention, *mlp, *final_norm_and_head())


def dense_mlp(*, when: str | None = None) -> Rows:
    return swiglu(module=LAYER + "mlp", category=Category.DENSE_MLP, inter="intermediate_size", when=when)


def mtp_block() -> tuple[Rows, Rows]:
    """The multi-token-prediction layer's own tensors around its decoder layer (layer index >= num_hidden_layers,
    category MTP): (before the layer: embedding, enorm, hnorm, eh_proj; after it: shared_head norm and head). The
    embedding and head are stored per MTP layer only where `mtp_own_head` (DeepSeek); GLM-4.5's MTP layer shares
    the main model's (vLLM glm4_moe_mtp.py::load_weights maps lm_head / embed_tokens onto it)."""
    mtp = Category.MTP
    before = (
        *linear(key="mtp.embed", module=LAYER + "embed_tokens", role=Role.EMBED, category=mtp,
                shape=("vocab_size", "hidden_size"), when="mtp_own_head"),
        *norm(key="mtp.enorm", module=LAYER + "enorm", category=mtp, when="mtp"),
        *norm(key="mtp.hnorm", module=LAYER + "hnorm", category=mtp, when="mtp"),
        *linear(key="mtp.eh_proj", module=LAYER + "eh_proj", role=Role.MTP_PROJ, category=mtp,
                shape=("hidden_size", "mtp_in_size"), when="mtp"))
    after = (
        *norm(key="mtp.norm", module=LAYER + "shared_head.norm", category=mtp, when="mtp"),
        *linear(key="mtp.head", module=LAYER + "shared_head.head", role=Role.LM_HEAD, category=mtp,
                shape=("vocab_size", "hidden_size"), when="mtp_own_head"))
    return before, after
