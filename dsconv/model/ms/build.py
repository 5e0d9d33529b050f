"""The one MindSpore network builder: every family's `CausalLM` cell from its table and facts.

Nothing here names a tensor: weights are asked of the family by key ("attn.q", "norm.post", "expert.down", "router")
and layer, shapes come from the same rows' formulas, and the architecture is read off the table and the facts:
MLA when the table has a latent kv projection, q/k norms when it has them, MoE on `facts.moe_layers` with the router
`facts.router` names, shared experts (and Qwen2-MoE's sigmoid gate) where their rows are present, sliding windows and
rotary tables from `ModelFacts`. A family whose op no block implements gets a block in `ATTENTION`/`ROUTERS` (as
MLA has in mla.py), not a network file.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from mindspore import Parameter, Tensor, nn

from dsconv.model.ms.blocks import (Backbone, CausalLM, DecoderLayer, DenseExperts, GQAAttention,
                                           GroupLimitedSigmoidRouter, Linear, RMSNorm, Rotary, SoftmaxTopKRouter,
                                           SparseMoE, SwiGLU, mask_indices)
from dsconv.model.ms.gemma3 import sandwich_network
from dsconv.model.ms.mla import mla
from dsconv.model.ms.weights import WeightSource
from dsconv.families import Family, ModelFacts


class Tensors:
    """The family table as the builder asks it: Parameters and cells by key and layer, through the WeightSource."""

    def __init__(self, ws: WeightSource, family: Family, facts: ModelFacts) -> None:
        self.ws, self.family, self.facts = ws, family, facts

    def present(self, key: str, layer: int | None = None) -> bool:
        return self.family.has(key) and self.ws.has(self.family.tensor(key, layer))

    def param(self, key: str, layer: int | None = None, fp32: bool = False) -> Parameter:
        return self.ws.float_param(self.family.tensor(key, layer), self.family.shape(key, self.facts), fp32=fp32)

    def linear(self, key: str, layer: int | None = None) -> Linear:
        """`key`'s weight (and bias when the checkpoint has one) as a Linear cell."""
        out_f, in_f = self.family.shape(key, self.facts)
        return self.ws.linear(self.family.module(key, layer), in_f, out_f)

    def norm(self, key: str, layer: int | None = None, eps: float | None = None) -> RMSNorm:
        eps = self.facts.rms_norm_eps if eps is None else eps
        return RMSNorm(self.param(key, layer), eps, self.ws.compute)

    def swiglu(self, prefix: str, layer: int) -> SwiGLU:
        """The gated MLP whose rows are `{prefix}.gate/up/down` ("mlp", "shared")."""
        return SwiGLU(*(self.linear(f"{prefix}.{s}", layer) for s in ("gate", "up", "down")))

    def experts(self, layer: int) -> DenseExperts:
        """Every routed expert of `layer`, each projection stacked [E, out, in] (found through the roles' slots)."""
        n = self.facts.num_experts
        stacked = []
        for slot in ("gate", "up", "down"):
            out_f, in_f = self.family.shape(f"expert.{slot}", self.facts)
            stacked.append(self.ws.experts(layer, n, slot, in_f, out_f))
        return DenseExperts(*stacked)


# ------------------------------------------------------------------------------------------------ blocks by kind
def gqa(t: Tensors, layer: int, mask_index: int) -> GQAAttention:
    """Llama-style attention; q/k norms (Qwen3) where the table has them; biases where the checkpoint has them."""
    f = t.facts
    q_norm = k_norm = None
    if t.present("attn.q_norm", layer):  # Qwen3, Gemma 3; GLM-4.5 where use_qk_norm
        q_norm, k_norm = t.norm("attn.q_norm", layer), t.norm("attn.k_norm", layer)
    return GQAAttention(t.linear("attn.q", layer), t.linear("attn.k", layer), t.linear("attn.v", layer),
                        t.linear("attn.o", layer), f.num_heads, f.num_kv_heads, f.head_dim, f.head_dim ** -0.5,
                        mask_index, q_norm, k_norm)


def softmax_router(t: Tensors, layer: int) -> nn.Cell:
    r = t.facts.routing()
    return SoftmaxTopKRouter(t.param("router", layer, fp32=True), r["top_k"], r["norm_topk_prob"])


def sigmoid_group_router(t: Tensors, layer: int) -> nn.Cell:
    r = t.facts.routing()
    if t.present("router.bias", layer):
        bias = t.param("router.bias", layer, fp32=True)
    else:  # transformers initialises the buffer to zeros when a checkpoint lacks it
        name = t.family.tensor("router.bias", layer)
        bias = Parameter(Tensor(np.zeros(t.facts.num_experts, np.float32)), name=name, requires_grad=False)
    return GroupLimitedSigmoidRouter(t.param("router", layer, fp32=True), bias, r["top_k"], r["n_group"],
                                     r["topk_group"], r["norm_topk_prob"], r["routed_scaling_factor"])


ATTENTION: dict[str, Callable[[Tensors, int, int], nn.Cell]] = {"gqa": gqa, "mla": mla}
ROUTERS: dict[str, Callable[[Tensors, int], nn.Cell]] = {"softmax": softmax_router,
                                                         "sigmoid_group": sigmoid_group_router}


def moe(t: Tensors, layer: int) -> SparseMoE:
    """Router + dense-combined experts, plus the shared expert(s) and their sigmoid gate where present."""
    h = t.facts.hidden_size
    shared = t.swiglu("shared", layer) if t.present("shared.gate", layer) else None
    gate = t.linear("shared_gate", layer) if t.present("shared_gate", layer) else None
    return SparseMoE(ROUTERS[t.facts.router](t, layer), t.experts(layer), h, t.ws.compute, shared=shared,
                     shared_gate=gate)


# ------------------------------------------------------------------------------------------------ the network
def build(ws: WeightSource, family: Family, facts: ModelFacts,
          progress: Callable[[int], None] | None = None) -> CausalLM:
    """Embeddings, every decoder layer, final norm, lm_head (or tied) of the checkpoint behind `ws`."""
    where = str(ws.ck.root / "config.json")
    t = Tensors(ws, family, facts)
    if family.has("norm.pre_ff"):  # sandwich layers (Gemma 3): GeGLU, offset norms, rope per layer type
        return sandwich_network(t, progress)
    facts.require_silu(where)
    attention = ATTENTION["mla" if family.has("attn.kv_a") else "gqa"]
    inv_freq, attention_scaling = facts.rope_tables(where)
    distinct, index = mask_indices(facts.layer_windows())
    embed = t.param("embed")
    moe_layers = set(facts.moe_layers)
    layers = []
    for i in range(facts.num_layers):
        mlp = moe(t, i) if i in moe_layers else t.swiglu("mlp", i)
        layers.append(DecoderLayer(t.norm("norm.input", i), attention(t, i, index[i]), t.norm("norm.post", i), mlp))
        if progress:
            progress(i)
    backbone = Backbone(embed, layers, t.norm("norm.final"), Rotary(inv_freq, attention_scaling, ws.compute),
                        distinct, ws.compute)
    tied = getattr(facts.hf(), "tie_word_embeddings", False) and not t.present("lm_head")
    return CausalLM(backbone, None if tied else t.linear("lm_head"), ws.compute)
