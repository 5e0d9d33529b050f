"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): softmax top-k experts plus a gated shared expert."""
from dsconv.families import register
from dsconv.families.base import (Family, cfg_get, dense_mlp, expert_rules, llama_rules, router_rule,
                                  shared_expert_rules)


def sparse_layers(c, n_layers):
    """Qwen-MoE's rule: MoE where (layer+1) % decoder_sparse_step == 0 and the layer is not in mlp_only_layers."""
    step = c.get("decoder_sparse_step", 1) or 1
    dense = set(c.get("mlp_only_layers") or [])
    if not num_experts(c):
        return ()
    return tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)


def num_experts(c) -> int:
    """Hub configs say num_experts; transformers 5 writes num_local_experts for Qwen3-MoE."""
    return cfg_get(c, "num_experts", "num_local_experts", default=0)


def moe_facts(f, c):
    f.num_experts = num_experts(c)
    f.experts_per_tok = c.get("num_experts_per_tok", 0)
    f.moe_intermediate_size = c.get("moe_intermediate_size", 0)
    f.moe_layers = sparse_layers(c, f.num_layers)
    return f


def routed_shapes(f):
    """The router and every routed expert of one MoE layer (Qwen-MoE naming)."""
    yield "mlp.gate.weight", (f.num_experts, f.hidden_size)
    for e in range(f.num_experts):
        yield from dense_mlp(f"mlp.experts.{e}", f.hidden_size, f.moe_intermediate_size)


@register
class Qwen2Moe(Family):
    name = "qwen2_moe"
    model_types = ("qwen2_moe",)
    rules = {**llama_rules(), **expert_rules(), **router_rule(), **shared_expert_rules("mlp.shared_expert"),
             **router_rule("mlp.shared_expert_gate")}

    def _facts(self, c):
        f = moe_facts(super()._facts(c), c)
        f.shared_intermediate_size = c.get("shared_expert_intermediate_size", 0)
        return f

    def qkv_bias(self, f):
        return True

    def mlp_shapes(self, f, layer):
        if layer not in f.moe_layers:
            yield from super().mlp_shapes(f, layer)
            return
        yield from routed_shapes(f)
        yield from dense_mlp("mlp.shared_expert", f.hidden_size, f.shared_intermediate_size)
        yield "mlp.shared_expert_gate.weight", (1, f.hidden_size)
