"""Multi-head Latent Attention (DeepSeek-V2/V3/R1) as transformers 5 computes it: q through the q_a/q_b low-rank pair
(or one q projection without q_lora), a shared latent for k/v decompressed per head by kv_b, rotary on the rope parts only
(interleaved pairs), softmax scale times yarn's mscale_all_dim^2. The block for the op no other family has; the
generic builder (build.py) takes every weight from the family table by key."""
from __future__ import annotations

from mindspore import nn, ops

from dsconv.model.ms.blocks import Linear, RMSNorm, apply_rope, apply_rope_interleaved, attend

LATENT_NORM_EPS = 1e-6  # the q_a / kv_a latent norms use RMSNorm's default eps in transformers, not rms_norm_eps


class MLAttention(nn.Cell):
    """q = q_b(norm(q_a(x))) (or q_full(x)); latent kv = norm(kv_a(x)[:r]), shared rope key kv_a(x)[r:];
    k/v per head from kv_b(latent); rotary on the rope parts only."""

    def __init__(self, q_full: Linear | None, q_a: Linear | None, q_a_norm: RMSNorm | None, q_b: Linear | None,
                 kv_a: Linear, kv_a_norm: RMSNorm, kv_b: Linear, o: Linear, heads: int, nope: int, rope: int,
                 v_dim: int, kv_lora_rank: int, scaling: float, interleave: bool, mask_index: int) -> None:
        super().__init__(auto_prefix=False)
        self.has_q_lora = q_full is None
        if self.has_q_lora:
            self.q_a, self.q_a_norm, self.q_b = q_a, q_a_norm, q_b
        else:
            self.q = q_full
        self.kv_a, self.kv_a_norm, self.kv_b, self.o = kv_a, kv_a_norm, kv_b, o
        self.heads, self.nope, self.rope, self.v_dim = int(heads), int(nope), int(rope), int(v_dim)
        self.rank = int(kv_lora_rank)
        self.scaling = float(scaling)
        self.interleave = bool(interleave)
        self.mask_index = int(mask_index)

    def construct(self, x, cos, sin, biases):
        b, s, _ = x.shape
        if self.has_q_lora:
            q = self.q_b(self.q_a_norm(self.q_a(x)))
        else:
            q = self.q(x)
        q = q.reshape(b, s, self.heads, self.nope + self.rope).transpose(0, 2, 1, 3)
        q_pass = q[..., :self.nope]
        q_rot = q[..., self.nope:]
        compressed = self.kv_a(x)
        kv_latent = self.kv_a_norm(compressed[..., :self.rank])
        k_rot = compressed[..., self.rank:].reshape(b, 1, s, self.rope)
        cos = cos.expand_dims(1)
        sin = sin.expand_dims(1)
        if self.interleave:
            q_rot = apply_rope_interleaved(q_rot, cos, sin)
            k_rot = apply_rope_interleaved(k_rot, cos, sin)
        else:
            q_rot = apply_rope(q_rot, cos, sin)
            k_rot = apply_rope(k_rot, cos, sin)
        query = ops.cat((q_pass, q_rot), -1)
        kv = self.kv_b(kv_latent).reshape(b, s, self.heads, self.nope + self.v_dim).transpose(0, 2, 1, 3)
        key = ops.cat((kv[..., :self.nope], ops.tile(k_rot, (1, self.heads, 1, 1))), -1)
        value = kv[..., self.nope:]
        out = attend(query, key, value, biases[self.mask_index], self.scaling)
        out = out.transpose(0, 2, 1, 3).reshape(b, s, self.heads * self.v_dim)
        return self.o(out)


def mla(t, layer: int, mask_index: int) -> MLAttention:
    """The attention of `layer` from the family table (t: build.Tensors)."""
    f = t.facts
    q_full = q_a = q_a_norm = q_b = None
    if t.present("attn.q_a", layer):
        q_a = t.linear("attn.q_a", layer)
        q_a_norm = t.norm("attn.q_a_norm", layer, LATENT_NORM_EPS)
        q_b = t.linear("attn.q_b", layer)
    else:
        q_full = t.linear("attn.q", layer)
    interleave = bool(getattr(f.hf(), "rope_interleave", True))
    qk = f.qk_nope_head_dim + f.qk_rope_head_dim
    return MLAttention(q_full, q_a, q_a_norm, q_b, t.linear("attn.kv_a", layer),
                       t.norm("attn.kv_a_norm", layer, LATENT_NORM_EPS), t.linear("attn.kv_b", layer),
                       t.linear("attn.o", layer), f.num_heads, f.qk_nope_head_dim, f.qk_rope_head_dim, f.v_head_dim,
                       f.kv_lora_rank, f.softmax_scale(qk), interleave, mask_index)
