"""Assembly helpers the architecture modules share: one decoder part from the checkpoint at a time."""
from __future__ import annotations

from typing import Callable

from mindspore import nn

from dsconv.convert.ms_nets.blocks import (Backbone, CausalLM, DecoderLayer, DenseExperts, GQAAttention, RMSNorm,
                                           Rotary, SwiGLU, mask_indices)
from dsconv.convert.ms_nets.config import rope_tables
from dsconv.convert.ms_nets.weights import WeightSource


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def norm(ws: WeightSource, name: str, size: int, eps: float) -> RMSNorm:
    return RMSNorm(ws.float_param(name + ".weight", (size,)), eps, ws.compute)


def swiglu(ws: WeightSource, prefix: str, hidden: int, inter: int) -> SwiGLU:
    return SwiGLU(ws.linear(prefix + ".gate_proj", hidden, inter), ws.linear(prefix + ".up_proj", hidden, inter),
                  ws.linear(prefix + ".down_proj", inter, hidden))


def dense_experts(ws: WeightSource, layer: int, n_experts: int, hidden: int, inter: int) -> DenseExperts:
    return DenseExperts(ws.experts(layer, n_experts, "gate", hidden, inter),
                        ws.experts(layer, n_experts, "up", hidden, inter),
                        ws.experts(layer, n_experts, "down", inter, hidden))


def gqa_attention(ws: WeightSource, cfg, layer: int, mask_index: int, qk_norm: bool = False) -> GQAAttention:
    """Llama-style attention of `layer`; q/k/v/o biases are taken when the checkpoint has them."""
    p = layer_prefix(layer) + "self_attn."
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    h = cfg.hidden_size
    q_norm = k_norm = None
    if qk_norm:
        q_norm = norm(ws, p + "q_norm", head_dim, cfg.rms_norm_eps)
        k_norm = norm(ws, p + "k_norm", head_dim, cfg.rms_norm_eps)
    return GQAAttention(ws.linear(p + "q_proj", h, heads * head_dim), ws.linear(p + "k_proj", h, kv_heads * head_dim),
                        ws.linear(p + "v_proj", h, kv_heads * head_dim), ws.linear(p + "o_proj", heads * head_dim, h),
                        heads, kv_heads, head_dim, head_dim ** -0.5, mask_index, q_norm, k_norm)


def causal_lm(ws: WeightSource, cfg, windows: list[int], make_layer: Callable[[int, int], nn.Cell],
              progress: Callable[[int], None] | None = None, rope: tuple | None = None) -> CausalLM:
    """Embeddings, `make_layer(layer, mask_index)` for every decoder layer, final norm, lm_head (or tied)."""
    h, vocab = cfg.hidden_size, cfg.vocab_size
    where = str(ws.ck.root / "config.json")
    inv_freq, attention_scaling = rope or rope_tables(cfg, where)
    distinct, index = mask_indices(windows)
    embed = ws.float_param("model.embed_tokens.weight", (vocab, h))
    layers = []
    for i in range(cfg.num_hidden_layers):
        layers.append(make_layer(i, index[i]))
        if progress:
            progress(i)
    final = norm(ws, "model.norm", h, cfg.rms_norm_eps)
    backbone = Backbone(embed, layers, final, Rotary(inv_freq, attention_scaling, ws.compute), distinct, ws.compute)
    tied = getattr(cfg, "tie_word_embeddings", False) and not ws.has("lm_head.weight")
    head = None if tied else ws.linear("lm_head", h, vocab)
    return CausalLM(backbone, head, ws.compute)


def decoder_layer(ws: WeightSource, cfg, layer: int, attn: nn.Cell, mlp: nn.Cell,
                  mlp_name: str = "mlp") -> DecoderLayer:
    """Input norm, attention, post-attention norm and `mlp` of `layer`."""
    p = layer_prefix(layer)
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    return DecoderLayer(norm(ws, p + "input_layernorm", h, eps), attn, norm(ws, p + "post_attention_layernorm", h, eps),
                        mlp, mlp_name)
