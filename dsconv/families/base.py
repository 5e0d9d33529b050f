"""What a model family is: ONE declarative table of tensor-name templates, and the facts derived from config.json.

Each row of the table (`T`) says, for one tensor of the checkpoint: its name template (gguf-py style: the layer and
expert numbers replaced by {L} and {E}), its Role and inspect Category, the slot stages know it by, its shape as a
formula over ModelFacts, the TP dimension (from the role unless stated), and when it is present. Everything else is
derived from the table, never restated:

* classification of a name (`classify`): one dict lookup per name - 91,991 DeepSeek-V3 names in a blink;
* the full tensor list of a config with no weights (`synthesize`: inspect/shard from config alone, tests);
* the MindSpore builder's weight lookup (`tensor(key, layer, expert)` and `shape(key, facts)`): builders ask by key
  ("attn.q", "mlp.down", "expert.gate", "router", ...), never by a name string;
* the tiny-model config (`tiny`) sits next to the table (export tolerances need none: convert/tolerance.py derives
  them from the model's own float noise).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from dsconv.errors import UserError
from dsconv.families.facts import ModelFacts, cfg_get, config_dtype
from dsconv.families.roles import ALL_PARAMS, Category, Role, TensorRole
from dsconv.tensors import TensorSpec

L = "model.layers.{L}."
Dim = int | str  # an int, or a ModelFacts attribute (property) name


@dataclass(frozen=True)
class T:
    """One row of a family's table: one tensor kind.

    key      unique in the family: what builders ask for ("attn.q", "norm.input", "expert.down", ...)
    name     full name template with the parameter ("model.layers.{L}.self_attn.q_proj.weight")
    shape    formula: ints and ModelFacts attribute names (`("q_size", "hidden_size")`)
    slot     what TensorRole.slot reports (gate/up/down, q/k/v/o, q_a, kv_b, ...)
    when     a PRESENT predicate name (see PRESENT), None = always
    dtype    a fixed dtype (routing biases stay F32), None = the checkpoint's
    tp_dim   override of the role's TP dimension
    """

    key: str
    name: str
    role: Role
    category: Category
    shape: tuple[Dim, ...]
    slot: str | None = None
    when: str | None = None
    dtype: str | None = None
    tp_dim: int | None = None

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def param(self) -> str:
        return self.name.rsplit(".", 1)[1]

    @property
    def per_layer(self) -> bool:
        return "{L}" in self.name

    @property
    def per_expert(self) -> bool:
        return "{E}" in self.name

    def dims(self, f: ModelFacts) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else int(getattr(f, d)) for d in self.shape)


#: when a row is present, given the facts and the layer (None outside the layers)
PRESENT: dict[str, Callable[[ModelFacts, int | None], bool]] = {
    "dense": lambda f, layer: layer not in f.moe_layers,
    "moe": lambda f, layer: layer in f.moe_layers,
    "shared": lambda f, layer: layer in f.moe_layers and f.shared_intermediate_size > 0,
    "q_lora": lambda f, layer: bool(f.q_lora_rank),
    "no_q_lora": lambda f, layer: not f.q_lora_rank,
    "qkv_bias": lambda f, layer: f.qkv_bias,
    "noaux_tc": lambda f, layer: layer in f.moe_layers and f.router == "sigmoid_group",
    "untied": lambda f, layer: not f.tie_word_embeddings,
    "mtp": lambda f, layer: layer is not None and layer >= f.num_layers,
}


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


class Family:
    """Base of every family. Subclasses set `model_types`, `table`, `tiny`, and read their own config keys."""

    name: str = ""
    model_types: tuple[str, ...] = ()
    #: the one model description (see T); row order is checkpoint order
    table: tuple[T, ...] = ()
    #: config overrides of the seeded tiny model (dsconv.tiny) over its common small widths
    tiny: dict[str, Any] = {}
    # RMSNorm computes x * (norm_offset + weight): Gemma stores weights as offsets from 1. Folding a scale into a norm
    # (SmoothQuant) must scale the effective weight, not the stored one.
    norm_offset: float = 0.0
    #: where transformers' fused 3-D experts live (relative to the layer) and renames of their siblings
    fused_experts: str = "mlp.experts"
    fused_renames: dict[str, str] = {}
    #: config.json keys this family cannot do without beyond the common ones (checked by dsconv.schemas.config)
    required_config: tuple[str, ...] = ()
    #: transformers' fused 3-D expert parameters -> the per-expert slots each holds, stacked along dim 1
    fused_params: dict[str, tuple[str, ...]] = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls._rows = {r.key: r for r in cls.table}
        modules: dict[str, T] = {}
        for r in cls.table:
            modules.setdefault(r.module, r)
        cls._modules = modules
        #: per-expert module templates relative to the layer, by slot (the on-disk "original" layout)
        cls.expert_modules = {r.slot: r.module[len(L):] for r in cls.table if r.per_expert and r.param == "weight"}
        if len(cls._rows) != len(cls.table):
            raise ValueError(f"{cls.__name__}: duplicate keys in its table")

    # ---- the table as builders see it -----------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self._rows

    def row(self, key: str) -> T:
        return self._rows[key]

    def tensor(self, key: str, layer: int | None = None, expert: int | None = None) -> str:
        """The concrete tensor name of `key` ("attn.q", layer 3 -> model.layers.3.self_attn.q_proj.weight)."""
        return self._rows[key].name.replace("{L}", str(layer)).replace("{E}", str(expert))

    def module(self, key: str, layer: int | None = None, expert: int | None = None) -> str:
        return self.tensor(key, layer, expert).rsplit(".", 1)[0]

    def shape(self, key: str, f: ModelFacts) -> tuple[int, ...]:
        return self._rows[key].dims(f)

    # ---- classification -------------------------------------------------------------------------------------
    def classify(self, name: str, facts: ModelFacts) -> TensorRole:
        module, param, layer, expert = template_of(name)
        rule = self._modules.get(module)
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
            config=c, rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), hidden_act=c.get("hidden_act", "silu"),
            qkv_bias=bool(c.get("attention_bias", False)),
        )

    # ---- synthesis from config alone ------------------------------------------------------------------------
    def iter_shapes(self, f: ModelFacts) -> Iterator[tuple[T, str, tuple[int, ...]]]:
        """(row, name, shape) of every tensor a checkpoint of these facts holds, in checkpoint order: the rows
        before the first layer row, every decoder layer (expert rows expanded per expert where they stand), the
        rows after the layers, then the MTP layers (DeepSeek stores them last, as layer num_hidden_layers...)."""
        first = next((i for i, r in enumerate(self.table) if r.per_layer), len(self.table))
        last = max((i for i, r in enumerate(self.table) if r.per_layer), default=first - 1)
        for r in self.table[:first]:
            if r.when is None or PRESENT[r.when](f, None):
                yield r, r.name, r.dims(f)
        for layer in range(f.num_layers):
            yield from self._layer_shapes(f, layer, self.table[first:last + 1])
        for r in self.table[last + 1:]:
            if r.when is None or PRESENT[r.when](f, None):
                yield r, r.name, r.dims(f)
        for layer in range(f.num_layers, f.num_layers + f.num_mtp_layers):
            yield from self._layer_shapes(f, layer, self.table[first:last + 1])

    def _layer_shapes(self, f: ModelFacts, layer: int, rows: tuple[T, ...]) -> Iterator[tuple[T, str, tuple[int, ...]]]:
        i = 0
        while i < len(rows):
            run = [rows[i]]  # a run of expert rows is expanded expert by expert
            while run[0].per_expert and i + len(run) < len(rows) and rows[i + len(run)].per_expert:
                run.append(rows[i + len(run)])
            i += len(run)
            live = [r for r in run if r.when is None or PRESENT[r.when](f, layer)]
            for e in (range(f.num_experts) if run[0].per_expert else (None,)) if live else ():
                for r in live:
                    yield r, self.tensor(r.key, layer, e), r.dims(f)

    def synthesize(self, config: dict[str, Any]) -> list[TensorSpec]:
        """The full tensor list (names, shapes, dtypes) a checkpoint of this config has, with no weights. FP8
        configs (DeepSeek's published form): quantizable linear weights F8_E4M3, each followed by its F32
        `weight_scale_inv` block grid."""
        f = self.facts(config)
        out: list[TensorSpec] = []
        for row, name, shape in self.iter_shapes(f):
            if row.dtype:
                out.append(TensorSpec(name, row.dtype, shape))
            elif f.fp8_block and row.role.quantized_by_default and row.param == "weight":
                out.append(TensorSpec(name, "F8_E4M3", shape))
                br, bc = f.fp8_block
                out.append(TensorSpec(name + "_scale_inv", "F32", (math.ceil(shape[0] / br), math.ceil(shape[1] / bc))))
            else:
                out.append(TensorSpec(name, f.dtype, shape))
        return out


# ------------------------------------------------------------------------------------------------ row builders
def linear(key: str, module: str, role: Role, category: Category, out: Dim, inp: Dim, slot: str | None = None,
           when: str | None = None) -> tuple[T, ...]:
    return (T(key, module + ".weight", role, category, (out, inp), slot, when),)


def norm(key: str, module: str, size: Dim = "hidden_size", category: Category = Category.NORMS,
         when: str | None = None) -> tuple[T, ...]:
    return (T(key, module + ".weight", Role.NORM, category, (size,), None, when),)


def gqa_attention(qkv_bias: bool = True) -> tuple[T, ...]:
    """Llama-style attention: q/k/v (biases where `qkv_bias` facts say so), o."""
    a, A = L + "self_attn.", Category.ATTENTION
    rows = (*linear("attn.q", a + "q_proj", Role.ATTN_IN, A, "q_size", "hidden_size", "q"),
            *linear("attn.k", a + "k_proj", Role.ATTN_IN, A, "kv_size", "hidden_size", "k"),
            *linear("attn.v", a + "v_proj", Role.ATTN_IN, A, "kv_size", "hidden_size", "v"))
    if qkv_bias:
        rows += (T("attn.q_bias", a + "q_proj.bias", Role.ATTN_IN, A, ("q_size",), "q", "qkv_bias"),
                 T("attn.k_bias", a + "k_proj.bias", Role.ATTN_IN, A, ("kv_size",), "k", "qkv_bias"),
                 T("attn.v_bias", a + "v_proj.bias", Role.ATTN_IN, A, ("kv_size",), "v", "qkv_bias"))
    return rows + linear("attn.o", a + "o_proj", Role.ATTN_OUT, A, "hidden_size", "attn_out_size", "o")


def qk_norm() -> tuple[T, ...]:
    """Per-head RMSNorm on q and k before rotary (Qwen3, Gemma 3)."""
    return (*norm("attn.q_norm", L + "self_attn.q_norm", "head_dim"),
            *norm("attn.k_norm", L + "self_attn.k_norm", "head_dim"))


def swiglu(prefix: str, category: Category, inter: Dim, key: str = "mlp", when: str | None = None,
           role_in: Role = Role.MLP_IN, role_out: Role = Role.MLP_OUT,
           names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> tuple[T, ...]:
    """gate/up/down of a gated MLP (dense, shared expert, or one routed expert)."""
    g, u, d = names
    return (*linear(f"{key}.gate", f"{prefix}.{g}", role_in, category, inter, "hidden_size", "gate", when),
            *linear(f"{key}.up", f"{prefix}.{u}", role_in, category, inter, "hidden_size", "up", when),
            *linear(f"{key}.down", f"{prefix}.{d}", role_out, category, "hidden_size", inter, "down", when))


def experts(prefix: str = L + "mlp.experts.{E}", names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
            inter: Dim = "moe_intermediate_size") -> tuple[T, ...]:
    return swiglu(prefix, Category.ROUTED_EXPERTS, inter, "expert", "moe", Role.EXPERT_IN, Role.EXPERT_OUT, names)


def router(module: str = L + "mlp.gate", key: str = "router", out: Dim = "num_experts",
           when: str | None = "moe") -> tuple[T, ...]:
    return (T(key, module + ".weight", Role.ROUTER, Category.ROUTER, (out, "hidden_size"), None, when),)


def decoder(attention: tuple[T, ...], mlp: tuple[T, ...]) -> tuple[T, ...]:
    """The Llama skeleton every family here shares: embeddings, per layer two norms + attention + MLP, final norm,
    lm_head (absent when tied)."""
    return (*linear("embed", "model.embed_tokens", Role.EMBED, Category.EMBEDDING, "vocab_size", "hidden_size"),
            *norm("norm.input", L + "input_layernorm"), *norm("norm.post", L + "post_attention_layernorm"),
            *attention, *mlp,
            *norm("norm.final", "model.norm"),
            *linear("lm_head", "lm_head", Role.LM_HEAD, Category.LM_HEAD, "vocab_size", "hidden_size",
                    when="untied"))


def dense_mlp(when: str | None = None) -> tuple[T, ...]:
    return swiglu(L + "mlp", Category.DENSE_MLP, "intermediate_size", when=when)
