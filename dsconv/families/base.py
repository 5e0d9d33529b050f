"""What a model family is: a table of tensor-name templates -> Role, and the few facts derived from config.json.

Names are matched by template, gguf-py style: the layer and expert numbers in a name are replaced by {L} and {E}
(`model.layers.{L}.mlp.experts.{E}.down_proj`), so classifying the 91,991 names of DeepSeek-V3 is a dict lookup per
name, and the table reads like the checkpoint it describes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator

from dsconv.errors import UserError
from dsconv.families.roles import ALL_PARAMS, Category, Role, TensorRole
from dsconv.tensors import DTYPE_FROM_CONFIG, TensorSpec


@dataclass(frozen=True)
class Rule:
    """One row of a family's table: a module template and what it is."""

    role: Role
    category: Category
    slot: str | None = None


@dataclass
class ModelFacts:
    """The config-derived facts every stage needs (layer/expert counts, head geometry, MLA ranks)."""

    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    intermediate_size: int
    dtype: str = "BF16"
    num_mtp_layers: int = 0
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    fp8_block: tuple[int, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and bool(self.moe_layers)

    def kv_bytes_per_token(self, bytes_per_element: int = 2, tp: int = 1) -> int:
        """KV-cache bytes per token on one card, all layers (MTP excluded).

        MLA caches the latent (kv_lora_rank + rope dims), replicated on every TP rank; MHA/GQA caches K and V for the
        KV heads, divided by tp while tp <= KV heads (beyond that each rank keeps one head).
        """
        if self.is_mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * bytes_per_element
        heads = max(1, math.ceil(self.num_kv_heads / tp)) if tp > 1 else self.num_kv_heads
        return 2 * self.num_layers * heads * self.head_dim * bytes_per_element

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d["moe_layers"] = list(self.moe_layers)
        return d


def template_of(name: str) -> tuple[str, str, int | None, int | None]:
    """`model.layers.3.mlp.experts.7.up_proj.weight` -> ('model.layers.{L}.mlp.experts.{E}.up_proj', 'weight', 3, 7)."""
    parts = name.split(".")
    param = parts.pop() if parts and parts[-1] in ALL_PARAMS else ""
    layer = expert = None
    for i, p in enumerate(parts):
        if p.isdigit():
            if layer is None and i > 0 and parts[i - 1] == "layers":
                layer = int(p)
                parts[i] = "{L}"
            elif expert is None and i > 0 and parts[i - 1] == "experts":
                expert = int(p)
                parts[i] = "{E}"
    return ".".join(parts), param, layer, expert


def cfg_get(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """First present key (HF renamed several across versions, e.g. torch_dtype -> dtype)."""
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    return default


class Family:
    """Base of every family. Subclasses set `model_types`, `rules`, and override the few facts that differ."""

    name: str = ""
    model_types: tuple[str, ...] = ()
    rules: dict[str, Rule] = {}
    #: per-expert module templates (the on-disk "original" layout) by slot; fused layouts are presented this way
    expert_modules: dict[str, str] = {"gate": "mlp.experts.{E}.gate_proj", "up": "mlp.experts.{E}.up_proj",
                                      "down": "mlp.experts.{E}.down_proj"}
    #: where transformers' fused 3-D experts live (relative to the layer) and renames of their siblings
    fused_experts: str = "mlp.experts"
    fused_renames: dict[str, str] = {}

    # ---- classification -------------------------------------------------------------------------------------
    def classify(self, name: str, facts: ModelFacts) -> TensorRole:
        module, param, layer, expert = template_of(name)
        rule = self.rules.get(module)
        if rule is None or not param:
            raise UserError(f"tensor {name} is not part of the {self.name} layout dsconv knows",
                            hint="check that config.json's model_type matches the weights, or report the name")
        category = rule.category
        if layer is not None and layer >= facts.num_layers:
            category = Category.MTP
        concrete = module.replace("{L}", str(layer)).replace("{E}", str(expert))
        return TensorRole(concrete, param, rule.role, category, layer, expert, rule.slot)

    # ---- facts ----------------------------------------------------------------------------------------------
    def facts(self, config: dict[str, Any]) -> ModelFacts:
        try:
            return self._facts(config)
        except (KeyError, TypeError, ZeroDivisionError) as e:
            raise UserError(f"config.json lacks or mis-states {e} for {self.name}",
                            hint="compare it with the model's published config.json") from None

    def _facts(self, c: dict[str, Any]) -> ModelFacts:
        heads = c["num_attention_heads"]
        hidden = c["hidden_size"]
        head_dim = cfg_get(c, "head_dim", default=hidden // heads)
        return ModelFacts(
            model_type=c["model_type"], num_layers=c["num_hidden_layers"], hidden_size=hidden,
            vocab_size=c["vocab_size"], num_heads=heads, num_kv_heads=cfg_get(c, "num_key_value_heads", default=heads),
            head_dim=head_dim, v_head_dim=head_dim, intermediate_size=c["intermediate_size"],
            dtype=config_dtype(c), tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        )

    # ---- synthesis from config alone ------------------------------------------------------------------------
    def synthesize(self, config: dict[str, Any]) -> list[TensorSpec]:
        """The full tensor list (names, shapes, dtypes) a checkpoint of this config has, with no weights."""
        f = self.facts(config)
        out: list[TensorSpec] = []
        for name, shape in self.iter_shapes(f):
            out.append(TensorSpec(name, self.synth_dtype(name, f), tuple(shape)))
        return out

    def synth_dtype(self, name: str, f: ModelFacts) -> str:
        return f.dtype

    def iter_shapes(self, f: ModelFacts) -> Iterator[tuple[str, tuple[int, ...]]]:
        yield "model.embed_tokens.weight", (f.vocab_size, f.hidden_size)
        for layer in range(f.num_layers):
            p = f"model.layers.{layer}."
            yield p + "input_layernorm.weight", (f.hidden_size,)
            yield p + "post_attention_layernorm.weight", (f.hidden_size,)
            for name, shape in self.attention_shapes(f, layer):
                yield p + name, shape
            for name, shape in self.mlp_shapes(f, layer):
                yield p + name, shape
        yield "model.norm.weight", (f.hidden_size,)
        if not f.tie_word_embeddings:
            yield "lm_head.weight", (f.vocab_size, f.hidden_size)

    def attention_shapes(self, f: ModelFacts, layer: int) -> Iterator[tuple[str, tuple[int, ...]]]:
        q, kv = f.num_heads * f.head_dim, f.num_kv_heads * f.head_dim
        yield "self_attn.q_proj.weight", (q, f.hidden_size)
        yield "self_attn.k_proj.weight", (kv, f.hidden_size)
        yield "self_attn.v_proj.weight", (kv, f.hidden_size)
        if self.qkv_bias(f):
            yield "self_attn.q_proj.bias", (q,)
            yield "self_attn.k_proj.bias", (kv,)
            yield "self_attn.v_proj.bias", (kv,)
        yield "self_attn.o_proj.weight", (f.hidden_size, q)

    def qkv_bias(self, f: ModelFacts) -> bool:
        return bool(f.extra.get("attention_bias"))

    def mlp_shapes(self, f: ModelFacts, layer: int) -> Iterator[tuple[str, tuple[int, ...]]]:
        yield from dense_mlp("mlp", f.hidden_size, f.intermediate_size)


def dense_mlp(prefix: str, hidden: int, inter: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    yield f"{prefix}.gate_proj.weight", (inter, hidden)
    yield f"{prefix}.up_proj.weight", (inter, hidden)
    yield f"{prefix}.down_proj.weight", (hidden, inter)


def config_dtype(c: dict[str, Any]) -> str:
    raw = str(cfg_get(c, "dtype", "torch_dtype", default="bfloat16")).replace("torch.", "")
    return DTYPE_FROM_CONFIG.get(raw, "BF16")


def llama_rules(mlp: str = "mlp") -> dict[str, Rule]:
    """The Llama skeleton most families share."""
    L = "model.layers.{L}."
    return {
        "model.embed_tokens": Rule(Role.EMBED, Category.EMBEDDING),
        "lm_head": Rule(Role.LM_HEAD, Category.LM_HEAD),
        "model.norm": Rule(Role.NORM, Category.NORMS),
        L + "input_layernorm": Rule(Role.NORM, Category.NORMS),
        L + "post_attention_layernorm": Rule(Role.NORM, Category.NORMS),
        L + "self_attn.q_proj": Rule(Role.ATTN_IN, Category.ATTENTION, "q"),
        L + "self_attn.k_proj": Rule(Role.ATTN_IN, Category.ATTENTION, "k"),
        L + "self_attn.v_proj": Rule(Role.ATTN_IN, Category.ATTENTION, "v"),
        L + "self_attn.o_proj": Rule(Role.ATTN_OUT, Category.ATTENTION, "o"),
        L + f"{mlp}.gate_proj": Rule(Role.MLP_IN, Category.DENSE_MLP, "gate"),
        L + f"{mlp}.up_proj": Rule(Role.MLP_IN, Category.DENSE_MLP, "up"),
        L + f"{mlp}.down_proj": Rule(Role.MLP_OUT, Category.DENSE_MLP, "down"),
    }


def expert_rules(experts: str = "mlp.experts.{E}", names: tuple[str, str, str] = ("gate_proj", "up_proj",
                                                                                   "down_proj")) -> dict[str, Rule]:
    L = "model.layers.{L}."
    gate, up, down = names
    return {
        L + f"{experts}.{gate}": Rule(Role.EXPERT_IN, Category.ROUTED_EXPERTS, "gate"),
        L + f"{experts}.{up}": Rule(Role.EXPERT_IN, Category.ROUTED_EXPERTS, "up"),
        L + f"{experts}.{down}": Rule(Role.EXPERT_OUT, Category.ROUTED_EXPERTS, "down"),
    }


def shared_expert_rules(prefix: str) -> dict[str, Rule]:
    L = "model.layers.{L}."
    return {
        L + f"{prefix}.gate_proj": Rule(Role.MLP_IN, Category.SHARED_EXPERTS, "gate"),
        L + f"{prefix}.up_proj": Rule(Role.MLP_IN, Category.SHARED_EXPERTS, "up"),
        L + f"{prefix}.down_proj": Rule(Role.MLP_OUT, Category.SHARED_EXPERTS, "down"),
    }


def router_rule(module: str = "mlp.gate") -> dict[str, Rule]:
    return {"model.layers.{L}." + module: Rule(Role.ROUTER, Category.ROUTER)}
