"""Mixtral: every layer is MoE, experts named block_sparse_moe.experts.E.w1/w2/w3 on disk (w1 gate, w3 up, w2 down)."""
from dsconv.families import register
from dsconv.families.base import Family, expert_rules, llama_rules, router_rule


@register
class Mixtral(Family):
    name = "mixtral"
    model_types = ("mixtral",)
    rules = {**llama_rules(), **expert_rules("block_sparse_moe.experts.{E}", ("w1", "w3", "w2")),
             **router_rule("block_sparse_moe.gate")}
    expert_modules = {"gate": "block_sparse_moe.experts.{E}.w1", "up": "block_sparse_moe.experts.{E}.w3",
                      "down": "block_sparse_moe.experts.{E}.w2"}
    fused_renames = {"mlp.gate": "block_sparse_moe.gate"}

    def _facts(self, c):
        f = super()._facts(c)
        f.num_experts = c.get("num_local_experts", 8)
        f.experts_per_tok = c.get("num_experts_per_tok", 2)
        f.moe_intermediate_size = f.intermediate_size
        f.moe_layers = tuple(range(f.num_layers))
        return f

    def mlp_shapes(self, f, layer):
        yield "block_sparse_moe.gate.weight", (f.num_experts, f.hidden_size)
        for e in range(f.num_experts):
            p = f"block_sparse_moe.experts.{e}."
            yield p + "w1.weight", (f.intermediate_size, f.hidden_size)
            yield p + "w2.weight", (f.hidden_size, f.intermediate_size)
            yield p + "w3.weight", (f.intermediate_size, f.hidden_size)
