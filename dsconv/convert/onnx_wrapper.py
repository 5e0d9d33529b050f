"""The nn.Module that is traced: transformers' causal LM behind the input/output names deployment tools expect.

Inputs   input_ids int64 [batch_size, sequence_length]
         attention_mask int64 [batch_size, total_sequence_length] (past + current tokens; 1 = token, 0 = padding)
         position_ids int64 [batch_size, sequence_length]        (only with position_ids=True)
         past_key_values.N.key / .value                            (only with with_past=True)
Outputs  logits [batch_size, sequence_length, vocab_size] first, then present.N.key / .value

Without a position_ids input, positions come from the mask inside the graph, as `generate()` makes them
(`cumsum(attention_mask) - 1`, padding at 1), so a left-padded row gives the logits the row gives alone.

The cache is whatever transformers' DynamicCache holds per layer, as optimum names it. For GQA/MHA models that is
K and V, [batch, kv_heads, seq, head_dim]. For DeepSeek-V3, transformers 5 caches the MLA latents themselves
(`cache.update(kv_nope, k_rot)` before `kv_b_proj` decompresses them), so `.key` is the normalised latent
[batch, 1, seq, kv_lora_rank] and `.value` the rotated shared rope key [batch, 1, seq, qk_rope_head_dim]: the
(kv_lora_rank + rope) per token and layer that serving engines keep, 71x smaller than decompressed K/V for the real
model. The wrapper builds the cache from the flat tensors, so no attention code of ours stands between the graph
and transformers'.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class CacheLayer:
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int


@dataclass
class IOSpec:
    """Names, dynamic axes and cache geometry of the exported graph (also written to export_info.json)."""

    with_past: bool
    position_ids: bool
    cache: list[CacheLayer] = field(default_factory=list)

    @property
    def input_names(self) -> list[str]:
        names = ["input_ids", "attention_mask"] + (["position_ids"] if self.position_ids else [])
        for i in range(len(self.cache) if self.with_past else 0):
            names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        return names

    @property
    def output_names(self) -> list[str]:
        names = ["logits"]
        for i in range(len(self.cache) if self.with_past else 0):
            names += [f"present.{i}.key", f"present.{i}.value"]
        return names

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        seq = "sequence_length"
        total = "total_sequence_length" if self.with_past else seq
        axes: dict[str, dict[int, str]] = {"input_ids": {0: "batch_size", 1: seq},
                                           "attention_mask": {0: "batch_size", 1: total},
                                           "logits": {0: "batch_size", 1: seq}}
        if self.position_ids:
            axes["position_ids"] = {0: "batch_size", 1: seq}
        for name in self.input_names:
            if name.startswith("past_key_values."):
                axes[name] = {0: "batch_size", 2: "past_sequence_length"}
        for name in self.output_names[1:]:
            axes[name] = {0: "batch_size", 2: "total_sequence_length"}
        return axes

    def past_shape(self, layer: int, which: str, batch: int, past: int) -> tuple[int, int, int, int]:
        c = self.cache[layer]
        return (batch, c.key_heads, past, c.key_dim) if which == "key" else (batch, c.value_heads, past, c.value_dim)

    def describe(self) -> dict[str, Any]:
        axes = self.dynamic_axes()
        out = {"inputs": [], "outputs": []}
        for kind, names in (("inputs", self.input_names), ("outputs", self.output_names)):
            for n in names:
                shape: list[Any]
                if n.startswith(("past_key_values.", "present.")):
                    i, which = int(n.split(".")[-2]), n.split(".")[-1]
                    fixed = self.past_shape(i, which, 0, 0)
                    shape = [axes[n][0], fixed[1], axes[n][2], fixed[3]]
                elif n == "logits":
                    shape = [axes[n][0], axes[n][1], "vocab_size"]
                else:
                    shape = [axes[n][0], axes[n][1]]
                out[kind].append({"name": n, "shape": shape})
        return out


def positions_from_mask(attention_mask: torch.Tensor, seq_len) -> torch.Tensor:
    """generate()'s position ids: count of real tokens before each one, padding at 1; the last seq_len columns."""
    pos = attention_mask.cumsum(-1) - 1
    pos = pos.masked_fill(attention_mask == 0, 1)
    return pos[:, pos.shape[1] - seq_len:]


class ExportWrapper(torch.nn.Module):
    """Flat tensors in, flat tensors out, around a transformers causal LM (its parameters keep their names under
    `model.`)."""

    def __init__(self, model: torch.nn.Module, spec: IOSpec) -> None:
        super().__init__()
        self.model = model
        self.spec = spec

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *rest: torch.Tensor):
        if self.spec.position_ids:
            position_ids, rest = rest[0], rest[1:]
        else:
            position_ids = positions_from_mask(attention_mask, input_ids.shape[1])
        if not self.spec.with_past:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False)
            return out.logits
        from transformers import DynamicCache

        layers = len(self.spec.cache)
        cache = DynamicCache(ddp_cache_data=[(rest[2 * i], rest[2 * i + 1]) for i in range(layers)])
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, use_cache=True)
        present: list[torch.Tensor] = []
        for layer in out.cache.layers[:layers]:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def cache_geometry(model: torch.nn.Module) -> list[CacheLayer]:
    """Per-layer cache tensor shapes, read from one real forward pass (works for GQA and MLA alike)."""
    ids = torch.zeros((1, 2), dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
    return [CacheLayer(layer.keys.shape[1], layer.keys.shape[3], layer.values.shape[1], layer.values.shape[3])
            for layer in out.cache.layers]


def trace_inputs(spec: IOSpec, vocab_size: int, dtype: torch.dtype, seed: int = 1234) -> tuple[torch.Tensor, ...]:
    """Tracing inputs that exercise every branch the graph must keep: batch 2, several tokens, one left-padded row,
    and a non-empty past (a trace with an empty past or an all-ones mask could fold those paths away)."""
    g = torch.Generator().manual_seed(seed)
    batch, seq, past = 2, 5, 3 if spec.with_past else 0
    ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
    mask = torch.ones((batch, past + seq), dtype=torch.long)
    mask[1, :2] = 0
    args: list[torch.Tensor] = [ids, mask]
    if spec.position_ids:
        args.append(positions_from_mask(mask, seq))
    if spec.with_past:
        for i in range(len(spec.cache)):
            for which in ("key", "value"):
                args.append(torch.randn(spec.past_shape(i, which, batch, past), generator=g).to(dtype))
    return tuple(args)
