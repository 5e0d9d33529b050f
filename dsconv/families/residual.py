"""Which family-table rows read the residual stream, which write it and which live inside a block: one table, keyed
by the tables' row keys.

Two users need the same fact. `dsconv rotate` folds an orthogonal Q into the rows that read the stream (after their
norm's scale) and Q^T into the rows that write it; `quantize --scheme w4a4_dynamic` gives 4-bit activations only to
the rows whose input the rotation reaches (the stream, behind a norm), and 8-bit per-token activations to the
others (a writer's input is a block's inner activation: o_proj's per-head mix, down_proj's gated product).
"""
from __future__ import annotations

#: the norm whose output each residual-reading row takes (its scale is folded into the row's input columns)
READS = {
    "norm.input": ("attn.q", "attn.k", "attn.v", "attn.q_a", "attn.kv_a", "linear.qkvz", "linear.ba",
                   "linear.in_qkv", "linear.in_z", "linear.in_b", "linear.in_a", "indexer.wk",
                   "indexer.weights_proj"),
    "norm.post": ("mlp.gate", "mlp.up", "expert.gate", "expert.up", "shared.gate", "shared.up", "router",
                  "shared_gate"),
    "norm.final": ("lm_head",),
}
READER_NORM = {key: norm for norm, keys in READS.items() for key in keys}
#: rows that write the residual stream: Q^T on their output rows
WRITES = frozenset({"attn.o", "linear.out", "mlp.down", "expert.down", "shared.down"})
#: rows inside a block, which neither read nor write the residual stream: unchanged
INSIDE = frozenset({"attn.q_b", "attn.kv_b", "attn.q_bias", "attn.k_bias", "attn.v_bias", "attn.q_norm",
                    "attn.k_norm", "attn.q_a_norm", "attn.kv_a_norm", "router.bias", "linear.conv1d",
                    "linear.dt_bias", "linear.A_log", "linear.norm", "indexer.wq_b", "indexer.k_norm",
                    "indexer.k_norm_bias"})
FOLDED = frozenset(READS)  # the norms folded away (all-ones afterwards)
KNOWN = FOLDED | frozenset(READER_NORM) | WRITES | INSIDE | {"embed"}


def reads_residual(key: str | None) -> bool:
    """Whether the row `key` takes the residual stream (behind a norm) as its input."""
    return key in READER_NORM
