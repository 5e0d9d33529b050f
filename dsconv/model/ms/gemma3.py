"""Gemma 3 (text): the ops no other family has, assembled with the shared cells by the family table's keys.

New here: RMSNorm whose weight is an offset from 1 and which scales in float32 before the cast (transformers'
Gemma3RMSNorm); GeGLU (gelu, tanh approximation); sandwich layers (attention and MLP outputs normed again before the
residual add: table rows norm.pre_ff / norm.post_ff); embeddings times sqrt(hidden); one rotary table per layer type
(sliding layers the local base, full layers the global one); query_pre_attn_scalar as the softmax scale;
final-logit softcapping. Attention, masks, sliding windows, linear layers and quantized weights are the shared ones.

`attn_logit_softcapping` is not applied: transformers' Gemma3Attention does not pass it to the attention function,
so the model users run (the check's reference) never caps attention scores.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from mindspore import Parameter, nn, ops

from dsconv.model.ms.blocks import (F32, Backbone, CausalLM, GQAAttention, Linear, Rotary, mask_indices,
                                    positions_and_masks)
from dsconv.errors import UserError
from dsconv.families.facts import STATIC_ROPE

# hidden_activation -> MindSpore gelu's `approximate` (gelu_pytorch_tanh, gelu_new, gelu_fast: the tanh formula)
GELU = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu": "none"}
SANDWICH = ("norm.input", "norm.post", "norm.pre_ff", "norm.post_ff")


class OffsetRMSNorm(nn.Cell):
    """`(x / rms(x)) * (1 + w)` in float32, then cast to the input dtype (Llama's RMSNorm casts before scaling)."""

    def __init__(self, weight: Parameter, eps: float) -> None:
        super().__init__(auto_prefix=False)
        self.weight = weight
        self.eps = float(eps)

    def construct(self, x):
        h = x.astype(F32)
        h = h * ops.rsqrt((h * h).mean(-1, keep_dims=True) + self.eps)
        return (h * (1.0 + self.weight.astype(F32))).astype(x.dtype)


class GeGLU(nn.Cell):
    """`down(gelu(gate(x)) * up(x))`."""

    def __init__(self, gate: Linear, up: Linear, down: Linear, approximate: str) -> None:
        super().__init__(auto_prefix=False)
        self.gate_proj, self.up_proj, self.down_proj = gate, up, down
        self.approximate = approximate

    def construct(self, x):
        return self.down_proj(ops.gelu(self.gate_proj(x), approximate=self.approximate) * self.up_proj(x))


class SandwichLayer(nn.Cell):
    """`x + post_attn(attn(norm(x)))`, then `x + post_ff(mlp(pre_ff(x)))`; the rotary table of its layer type."""

    def __init__(self, norms: list[OffsetRMSNorm], attn: GQAAttention, mlp: GeGLU, rope_index: int) -> None:
        super().__init__(auto_prefix=False)
        self.input_layernorm, self.post_attention_layernorm = norms[0], norms[1]
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norms[2], norms[3]
        self.self_attn = attn
        self.mlp = mlp
        self.rope_index = int(rope_index)

    def construct(self, x, ropes, biases):
        cos, sin = ropes[self.rope_index]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, biases))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class ScaledBackbone(Backbone):
    """Backbone with embeddings times sqrt(hidden) and one rotary table per layer type."""

    def __init__(self, embed: Parameter, layers: list[nn.Cell], norm: OffsetRMSNorm, rotaries: list[Rotary],
                 windows: tuple[int, ...], compute, embed_scale: float) -> None:
        super().__init__(embed, layers, norm, rotaries[0], windows, compute)
        self.rotaries = nn.CellList(rotaries, auto_prefix=False)
        self.embed_scale = float(embed_scale)

    def construct(self, input_ids, attention_mask):
        table = self.embed
        if self.cast_embed:
            table = table.astype(self.compute)
        x = ops.gather(table, input_ids, 0) * self.embed_scale
        positions, biases = positions_and_masks(attention_mask, self.windows)
        ropes = ()
        for rotary in self.rotaries:
            ropes = ropes + (rotary(positions),)
        for layer in self.layers:
            x = layer(x, ropes, biases)
        return self.norm(x)


class SoftcappedLM(CausalLM):
    """CausalLM with `cap * tanh(logits / cap)` on the float32 logits when final_logit_softcapping is set."""

    def __init__(self, backbone: ScaledBackbone, lm_head: Linear | None, compute, softcap: float | None) -> None:
        super().__init__(backbone, lm_head, compute)
        self.softcap = float(softcap or 0.0)

    def construct(self, input_ids, attention_mask):
        h = self.model(input_ids, attention_mask)
        if self.tied:
            w = self.model.embed
            logits = ops.dense(h, w.astype(self.compute) if self.model.cast_embed else w).astype(F32)
        else:
            logits = self.head(h).astype(F32)
        if self.softcap > 0:
            logits = ops.tanh(logits / self.softcap) * self.softcap
        return logits


def rope_by_type(cfg, types: list[str], where: str) -> list[tuple[np.ndarray, float]]:
    """(inv_freq, attention scaling) per layer type, from transformers' own Gemma3RotaryEmbedding (bit-identical)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    for t in types:
        rope_type = (cfg.rope_parameters.get(t) or {}).get("rope_type", "default")
        if rope_type not in STATIC_ROPE:
            raise UserError(f"{where}: rope_type {rope_type!r} ({t}) is not supported by the MindIR export",
                            hint=f"supported: {', '.join(STATIC_ROPE)}")
    rotary = Gemma3RotaryEmbedding(cfg)
    return [(getattr(rotary, f"{t}_inv_freq").float().numpy(), float(getattr(rotary, f"{t}_attention_scaling")))
            for t in types]


def sandwich_network(t, progress: Callable[[int], None] | None = None) -> SoftcappedLM:
    """The network of a family whose table has sandwich norms (Gemma 3); `t` is build.py's Tensors (the family
    table by key), so no tensor is named here."""
    f, ws = t.facts, t.ws
    cfg = f.hf()
    where = str(ws.ck.root / "config.json")
    if f.hidden_act not in GELU:
        raise UserError(f"{where}: hidden_activation {f.hidden_act!r} is not supported by the MindIR export",
                        hint=f"supported: {', '.join(GELU)}")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise UserError(f"{where}: use_bidirectional_attention (an embedding model) is not supported by the MindIR "
                        "export", hint="export causal Gemma 3 language models")
    layer_types = list(cfg.layer_types[:f.num_layers])
    types = sorted(set(layer_types))
    distinct, mask_index = mask_indices(f.layer_windows())

    def norm(key: str, layer: int | None = None) -> OffsetRMSNorm:
        return OffsetRMSNorm(t.param(key, layer), f.rms_norm_eps)

    layers = []
    for i in range(f.num_layers):
        attn = GQAAttention(t.linear("attn.q", i), t.linear("attn.k", i), t.linear("attn.v", i),
                            t.linear("attn.o", i), f.num_heads, f.num_kv_heads, f.head_dim,
                            cfg.query_pre_attn_scalar ** -0.5, mask_index[i], norm("attn.q_norm", i),
                            norm("attn.k_norm", i))
        mlp = GeGLU(t.linear("mlp.gate", i), t.linear("mlp.up", i), t.linear("mlp.down", i), GELU[f.hidden_act])
        layers.append(SandwichLayer([norm(k, i) for k in SANDWICH], attn, mlp, types.index(layer_types[i])))
        if progress:
            progress(i)
    rotaries = [Rotary(inv, scale, ws.compute) for inv, scale in rope_by_type(cfg, types, where)]
    backbone = ScaledBackbone(t.param("embed"), layers, norm("norm.final"), rotaries, distinct, ws.compute,
                              f.hidden_size ** 0.5)
    tied = f.tie_word_embeddings and not t.present("lm_head")
    return SoftcappedLM(backbone, None if tied else t.linear("lm_head"), ws.compute, cfg.final_logit_softcapping)
