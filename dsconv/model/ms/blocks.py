"""MindSpore building blocks shared by every architecture: RMSNorm, rotary embeddings, GQA attention, SwiGLU, MoE.

The math follows transformers 5's modeling files line by line (which op runs in float32, where the cast happens), so
an fp32 export matches the PyTorch model to ~1e-6. Cells do not prefix their parameters (auto_prefix=False): every
Parameter keeps the checkpoint name the family gave it (as `dsconv inspect` lists them), so attribute names
here are free and no tensor name is restated.

Everything here is written for a static graph with dynamic batch and sequence: no data-dependent Python control
flow, and the causal/padding masks and positions are derived from the `attention_mask` input itself.
"""
from __future__ import annotations

import os

os.environ.setdefault("GLOG_v", "3")  # MindSpore's C++ log is noisy; must be set before the first import

import numpy as np  # noqa: E402
import mindspore as ms  # noqa: E402
from mindspore import Parameter, Tensor, nn, ops  # noqa: E402

F32 = ms.float32
# A finite "minus infinity" for masked attention scores (in float32): a fully masked row (a left-padding query)
# then gets a uniform softmax instead of NaN, and no NaN can leak into the other rows through the values.
MASK_MIN = float(np.finfo(np.float32).min)


# ------------------------------------------------------------------------------------------------ linear layers
def dequantize(q, scale, offset, int4: str, compute):
    """int8 weight (or packed int4) -> float `[..., n, k]` in the graph: `(q - offset) * scale` per row or group.

    int4 `rows`: msModelSlim's `[n/2, k]` (row 2i in the low nibble, 2i+1 in the high one); `cols`: the older
    `[n, k/2]` along k. Nibbles are sign-extended with arithmetic shifts, which MindSpore runs on int8 on CPU.
    """
    if int4 == "rows" or int4 == "cols":
        low = ops.bitwise_right_shift(ops.bitwise_left_shift(q, 4), 4)
        high = ops.bitwise_right_shift(q, 4)
        lead = q.shape[:-2]
        if int4 == "rows":
            q = ops.stack((low, high), -2).reshape(lead + (q.shape[-2] * 2, q.shape[-1]))
        else:
            q = ops.stack((low, high), -1).reshape(lead + (q.shape[-2], q.shape[-1] * 2))
    lead = q.shape[:-2]
    n, k = q.shape[-2], q.shape[-1]
    groups = scale.shape[-1]
    w = q.astype(F32).reshape(lead + (n, groups, k // groups))
    w = (w - offset.expand_dims(-1)) * scale.expand_dims(-1)
    return w.reshape(lead + (n, k)).astype(compute)


class Linear(nn.Cell):
    """`y = x W^T + b` with W float (cast to the compute dtype) or int8/int4 dequantized inside the graph."""

    def __init__(self, weight: Parameter, compute, bias: Parameter | None = None, scale: Parameter | None = None,
                 offset: Parameter | None = None, int4: str = "") -> None:
        super().__init__(auto_prefix=False)
        self.weight = weight
        self.bias = bias
        self.quantized = scale is not None
        self.weight_scale = scale
        self.weight_offset = offset
        self.int4 = int4
        self.compute = compute
        self.cast_weight = weight.dtype != compute

    def materialize(self):
        if self.quantized:
            return dequantize(self.weight, self.weight_scale, self.weight_offset, self.int4, self.compute)
        if self.cast_weight:
            return self.weight.astype(self.compute)
        return self.weight

    def construct(self, x):
        if self.bias is None:
            return ops.dense(x, self.materialize())
        return ops.dense(x, self.materialize(), self.bias.astype(self.compute))


class ExpertWeights(Linear):
    """One projection of every routed expert, stacked `[E, out, in]` (float, or int8/int4 + scales): the weight of a
    Linear, materialised for the dense expert computation."""

    def __init__(self, weight: Parameter, compute, scale: Parameter | None = None, offset: Parameter | None = None,
                 int4: str = "") -> None:
        super().__init__(weight, compute, None, scale, offset, int4)

    def construct(self):
        return self.materialize()


class DenseExperts(nn.Cell):
    """All routed experts computed for every token, combined with a dense `[tokens, experts]` weight matrix.

    Exact for any routing and exportable with dynamic shapes (no data-dependent gather/scatter), at E/top_k times
    the FLOPs of sparse dispatch: right for the small models this export targets, not for a 671B MoE.
    """

    def __init__(self, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights) -> None:
        super().__init__(auto_prefix=False)
        self.gate, self.up, self.down = gate, up, down

    def construct(self, x, weights):
        """x [T, H], weights [T, E] (zero for experts not chosen) -> [T, H]."""
        xe = x.expand_dims(0)  # [1, T, H] broadcast over experts
        g = ops.matmul(xe, self.gate().swapaxes(1, 2))  # [E, T, I]
        u = ops.matmul(xe, self.up().swapaxes(1, 2))
        y = ops.matmul(ops.silu(g) * u, self.down().swapaxes(1, 2))  # [E, T, H]
        return (y * weights.swapaxes(0, 1).expand_dims(-1)).sum(0)


def one_hot_weights(indices, values, num_experts: int):
    """top-k (indices [T, k], values [T, k]) -> dense [T, E]."""
    oh = ops.one_hot(indices, num_experts, Tensor(1.0, values.dtype), Tensor(0.0, values.dtype))
    return (oh * values.expand_dims(-1)).sum(1)


# ------------------------------------------------------------------------------------------------ norms, MLPs
class RMSNorm(nn.Cell):
    """transformers' RMSNorm: normalise in float32, cast back, then scale by the weight in the compute dtype."""

    def __init__(self, weight: Parameter, eps: float, compute) -> None:
        super().__init__(auto_prefix=False)
        self.weight = weight
        self.eps = float(eps)
        self.compute = compute
        self.cast_weight = weight.dtype != compute

    def construct(self, x):
        h = x.astype(F32)
        var = (h * h).mean(-1, keep_dims=True)
        h = (h * ops.rsqrt(var + self.eps)).astype(self.compute)
        w = self.weight.astype(self.compute) if self.cast_weight else self.weight
        return w * h


class SwiGLU(nn.Cell):
    """`down(silu(gate(x)) * up(x))`: the dense MLP and the shared experts of every family here."""

    def __init__(self, gate: Linear, up: Linear, down: Linear) -> None:
        super().__init__(auto_prefix=False)
        self.gate, self.up, self.down = gate, up, down

    def construct(self, x):
        return self.down(ops.silu(self.gate(x)) * self.up(x))


# ------------------------------------------------------------------------------------------------ routers
class SoftmaxTopKRouter(nn.Cell):
    """Qwen-MoE / Mixtral: softmax over experts in float32, top-k, optional renormalisation -> dense [T, E]."""

    def __init__(self, weight: Parameter, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__(auto_prefix=False)
        self.weight = weight  # kept float32
        self.top_k = int(top_k)
        self.norm = bool(norm_topk_prob)
        self.num_experts = int(weight.shape[0])

    def construct(self, x):
        logits = ops.dense(x.astype(F32), self.weight.astype(F32))
        probs = ops.softmax(logits, -1)
        values, indices = ops.topk(probs, self.top_k)
        if self.norm:
            values = values / values.sum(-1, keepdims=True)
        return one_hot_weights(indices, values, self.num_experts)


class GroupLimitedSigmoidRouter(nn.Cell):
    """DeepSeek-V3's `noaux_tc` routing, as transformers' DeepseekV3TopkRouter: sigmoid scores, + the correction bias
    for choosing only, best `topk_group` groups by the sum of their top-2 scores, top-k within them, weights from the
    uncorrected scores, optional renormalisation, times `routed_scaling_factor` -> dense [T, E]."""

    def __init__(self, weight: Parameter, bias: Parameter, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float) -> None:
        super().__init__(auto_prefix=False)
        self.weight = weight
        self.bias = bias
        self.num_experts = int(weight.shape[0])
        self.top_k = int(top_k)
        self.n_group = int(n_group)
        self.per_group = self.num_experts // self.n_group
        self.topk_group = int(topk_group)
        self.norm = bool(norm_topk_prob)
        self.scale = float(routed_scaling_factor)

    def construct(self, x):
        logits = ops.dense(x.astype(F32), self.weight.astype(F32))
        scores = ops.sigmoid(logits)
        choice = scores + self.bias.astype(F32)
        grouped = choice.reshape(-1, self.n_group, self.per_group)
        group_scores = ops.topk(grouped, 2)[0].sum(-1)  # [T, G]
        group_idx = ops.topk(group_scores, self.topk_group)[1]
        group_mask = ops.one_hot(group_idx, self.n_group, Tensor(1.0, F32), Tensor(0.0, F32)).sum(1)  # [T, G]
        score_mask = ops.tile(group_mask.expand_dims(-1), (1, 1, self.per_group)).reshape(-1, self.num_experts)
        choice = ops.where(score_mask > 0, choice, ops.full_like(choice, float("-inf")))
        indices = ops.topk(choice, self.top_k)[1]
        values = ops.gather_elements(scores, 1, indices)
        if self.norm:
            values = values / (values.sum(-1, keepdims=True) + 1e-20)
        values = values * self.scale
        return one_hot_weights(indices, values, self.num_experts)


class SparseMoE(nn.Cell):
    """Router + dense-combined experts, optional shared expert(s) and Qwen2-MoE's sigmoid shared-expert gate."""

    def __init__(self, router: nn.Cell, experts: DenseExperts, hidden: int, compute,
                 shared: SwiGLU | None = None, shared_gate: Linear | None = None) -> None:
        super().__init__(auto_prefix=False)
        self.hidden = int(hidden)
        self.compute = compute
        self.router = router
        self.experts = experts
        self.has_shared = shared is not None
        self.has_shared_gate = shared_gate is not None
        if shared is not None:
            self.shared = shared
        if shared_gate is not None:
            self.shared_gate = shared_gate

    def construct(self, x):
        shape = x.shape
        h = x.reshape(-1, self.hidden)
        weights = self.router(h).astype(self.compute)
        y = self.experts(h, weights)
        if self.has_shared:
            s = self.shared(h)
            if self.has_shared_gate:
                s = ops.sigmoid(self.shared_gate(h)) * s
            y = y + s
        return y.reshape(shape)


# ------------------------------------------------------------------------------------------------ rotary, masks
class Rotary(nn.Cell):
    """cos/sin tables `[B, S, dim]` for the positions in the graph (inv_freq and attention scaling from
    transformers' own rope init functions, so linear/llama3/yarn scaling match exactly)."""

    def __init__(self, inv_freq: np.ndarray, attention_scaling: float, compute) -> None:
        super().__init__(auto_prefix=False)
        self.inv_freq = Tensor(np.asarray(inv_freq, np.float32))
        self.attention_scaling = float(attention_scaling)
        self.compute = compute

    def construct(self, positions):
        freqs = positions.astype(F32).expand_dims(-1) * self.inv_freq
        emb = ops.cat((freqs, freqs), -1)
        cos = ops.cos(emb) * self.attention_scaling
        sin = ops.sin(emb) * self.attention_scaling
        return cos.astype(self.compute), sin.astype(self.compute)


def rotate_half(x):
    half = x.shape[-1] // 2
    return ops.cat((-x[..., half:], x[..., :half]), -1)


def apply_rope(x, cos, sin):
    """x [B, H, S, d], cos/sin [B, 1, S, r]: the first r dims of each head turned, the rest passed (partial rotary,
    GLM-4.5's partial_rotary_factor; r == d for a full rotation)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turned = x[..., :r]
    return ops.cat((turned * cos + rotate_half(turned) * sin, x[..., r:]), -1)


def apply_rope_interleaved(x, cos, sin):
    """DeepSeek's interleaved pairs (x0, x1), (x2, x3)...: transformers' apply_rotary_pos_emb_interleave."""
    half = cos.shape[-1] // 2
    c = cos[..., :half]
    s = sin[..., :half]
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return ops.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)


def positions_and_masks(attention_mask, windows: tuple):
    """From the [B, S] 0/1 mask: position ids (cumsum - 1, as transformers' generate() makes them, so a
    left-padded row gives the same logits as the unpadded one) and one additive float32 bias [B, 1, S, S] per
    attention window (0 = full causal; w > 0 = sliding window of w keys, as transformers' sliding mask)."""
    mask = attention_mask.astype(ms.int32)
    positions = ops.maximum(ops.cumsum(mask, 1) - 1, 0)
    idx = ops.cumsum(ops.ones_like(mask[0:1]), 1) - 1  # [1, S]: 0..S-1 without a dynamic scalar
    q_idx = idx.reshape(1, -1, 1)
    k_idx = idx.reshape(1, 1, -1)
    keys = (mask > 0).expand_dims(1)  # [B, 1, S]
    causal = k_idx <= q_idx  # [1, S, S]
    biases = ()
    for w in windows:
        allowed = causal
        if w > 0:
            allowed = ops.logical_and(allowed, k_idx > q_idx - w)
        allowed = ops.logical_and(allowed, keys).expand_dims(1)  # [B, 1, S, S]
        zero = ops.zeros_like(allowed.astype(F32))
        biases = biases + (ops.where(allowed, zero, zero + MASK_MIN),)
    return positions, biases


# ------------------------------------------------------------------------------------------------ attention
def repeat_kv(x, rep: int):
    """[B, KVH, S, d] -> [B, KVH * rep, S, d], each KV head repeated for its query group (transformers' repeat_kv)."""
    if rep == 1:
        return x
    b, h, s, d = x.shape
    return ops.tile(x.expand_dims(2), (1, 1, rep, 1, 1)).reshape(b, h * rep, s, d)


def attend(q, k, v, bias, scaling: float):
    """Eager attention: scores in float32 with the additive mask, softmax in float32, back to the compute dtype."""
    scores = ops.matmul(q, k.swapaxes(-1, -2)).astype(F32) * scaling + bias
    probs = ops.softmax(scores, -1).astype(q.dtype)
    return ops.matmul(probs, v)


class GQAAttention(nn.Cell):
    """Llama/Qwen/Mixtral attention: q/k/v projections (optional biases), optional per-head q/k RMSNorm (Qwen3),
    rotary embeddings, grouped KV heads, output projection."""

    def __init__(self, q: Linear, k: Linear, v: Linear, o: Linear, heads: int, kv_heads: int, head_dim: int,
                 scaling: float, mask_index: int, q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> None:
        super().__init__(auto_prefix=False)
        self.q, self.k, self.v, self.o = q, k, v, o
        self.heads, self.kv_heads, self.head_dim = int(heads), int(kv_heads), int(head_dim)
        self.rep = self.heads // self.kv_heads
        self.scaling = float(scaling)
        self.mask_index = int(mask_index)
        self.has_qk_norm = q_norm is not None
        if q_norm is not None:
            self.q_norm = q_norm
            self.k_norm = k_norm

    def construct(self, x, cos, sin, biases):
        b, s, _ = x.shape
        q = self.q(x).reshape(b, s, self.heads, self.head_dim)
        k = self.k(x).reshape(b, s, self.kv_heads, self.head_dim)
        v = self.v(x).reshape(b, s, self.kv_heads, self.head_dim)
        if self.has_qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = q.transpose(0, 2, 1, 3)
        k = k.transpose(0, 2, 1, 3)
        v = v.transpose(0, 2, 1, 3)
        cos = cos.expand_dims(1)
        sin = sin.expand_dims(1)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        out = attend(q, repeat_kv(k, self.rep), repeat_kv(v, self.rep), biases[self.mask_index], self.scaling)
        out = out.transpose(0, 2, 1, 3).reshape(b, s, self.heads * self.head_dim)
        return self.o(out)


# ------------------------------------------------------------------------------------------------ the model
class DecoderLayer(nn.Cell):
    """Pre-norm residual block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    def __init__(self, input_norm: RMSNorm, attn: nn.Cell, post_norm: RMSNorm, mlp: nn.Cell) -> None:
        super().__init__(auto_prefix=False)
        self.input_norm, self.attn, self.post_norm, self.mlp = input_norm, attn, post_norm, mlp

    def construct(self, x, cos, sin, biases):
        x = x + self.attn(self.input_norm(x), cos, sin, biases)
        return x + self.mlp(self.post_norm(x))


class Backbone(nn.Cell):
    """`model.*` of transformers' *ForCausalLM: embeddings, layers, final norm."""

    def __init__(self, embed: Parameter, layers: list[nn.Cell], norm: RMSNorm, rotary: Rotary,
                 windows: tuple[int, ...], compute) -> None:
        super().__init__(auto_prefix=False)
        self.embed = embed
        self.layers = nn.CellList(layers, auto_prefix=False)
        self.norm = norm
        self.rotary = rotary
        self.windows = tuple(int(w) for w in windows)
        self.compute = compute
        self.cast_embed = embed.dtype != compute

    def construct(self, input_ids, attention_mask):
        table = self.embed
        if self.cast_embed:
            table = table.astype(self.compute)
        x = ops.gather(table, input_ids, 0)
        positions, biases = positions_and_masks(attention_mask, self.windows)
        cos, sin = self.rotary(positions)
        for layer in self.layers:
            x = layer(x, cos, sin, biases)
        return self.norm(x)


class CausalLM(nn.Cell):
    """`(input_ids [B, S], attention_mask [B, S]) -> logits [B, S, vocab]` (float32), output head tied or not."""

    def __init__(self, backbone: Backbone, head: Linear | None, compute) -> None:
        super().__init__(auto_prefix=False)
        self.model = backbone
        self.tied = head is None
        if head is not None:
            self.head = head
        self.compute = compute

    def construct(self, input_ids, attention_mask):
        h = self.model(input_ids, attention_mask)
        if self.tied:
            w = self.model.embed
            logits = ops.dense(h, w.astype(self.compute) if self.model.cast_embed else w)
        else:
            logits = self.head(h)
        return logits.astype(F32)


def mask_indices(windows_per_layer: list[int]) -> tuple[tuple[int, ...], list[int]]:
    """Distinct windows (0 = full causal) and, per layer, the index of its mask in that tuple."""
    distinct = tuple(sorted(set(windows_per_layer)))
    return distinct, [distinct.index(w) for w in windows_per_layer]
