"""What a model family is: ONE declarative table of tensor-name templates, and the facts derived from config.json.

Each row of the table (`TensorRow`, written with keywords) says, for one tensor of the checkpoint: its name template (gguf-py style: the layer and
expert numbers replaced by {L} and {E}; per-layer rows start with `LAYER`, which the family binds to its own
`layer_prefix`), its Role and inspect Category, the slot stages know it by, its shape as a
formula over ModelFacts, the TP dimension (from the role unless stated), and when it is present. Everything else is
derived from the table, never restated. The table is checked when the family class is defined (a shape dim that is
no ModelFacts attribute, an unknown `when`, a parameter outside the family's vocabulary: `TableError` at import), and
`@register` adds the family to the registry (`family_for`, `supported_model_types`).

* classification of a name (`classify`): one dict lookup per name - 91,991 DeepSeek-V3 names in a blink;
* the full tensor list of a config with no weights (`synthesize`: inspect/shard from config alone, tests);
* the MindSpore builder's weight lookup (`tensor(key, layer, expert)` and `shape(key, facts)`): builders ask by key
  ("attn.q", "mlp.down", "expert.gate", "router", ...), never by a name string;
* the tiny-model config (`tiny`) sits next to the table (export tolerances need none: convert/tolerance.py derives
  them from the model's own float noise).
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Iterator, Mapping

from dsconv.errors import UserError
from dsconv.families.facts import ConfigValues, ModelFacts, cfg_get, config_dtype
from dsconv.schemas.model import REQUIRED, config_fields
from dsconv.families.roles import AUX_PARAMS, OTHER_PARAMS, WEIGHT_PARAMS, Category, Role, TensorRole
from dsconv.tensors import TensorSpec

#: the start of every per-layer name template in a table; the family replaces it with `layer_prefix` + "{L}."
LAYER = "{L}."
Dim = int | str  # an int, or a ModelFacts attribute (property) name


class TableError(ValueError):
    """A family's table is wrong (raised when the family class is defined, so at import, never at first use)."""


@dataclass(frozen=True, kw_only=True)
class TensorRow:
    """One row of a family's table: one tensor kind. Keywords only.

    key      unique in the family: what builders ask for ("attn.q", "norm.input", "expert.down", ...)
    name     name template with the parameter: `LAYER + "self_attn.q_proj.weight"` in the table, bound by the
             family to its full form ("model.layers.{L}.self_attn.q_proj.weight")
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
    "mtp_block": lambda f, layer: f.num_mtp_layers > 0,  # the tensors of an MTP block stored apart (mtp_prefixes)
    "mtp_own_head": lambda f, layer: layer is not None and layer >= f.num_layers and f.mtp_own_head,
    "qk_norm": lambda f, layer: f.qk_norm and f.attention_kind(layer) != "linear_attention",
    "full_attention": lambda f, layer: f.attention_kind(layer) != "linear_attention",
    "linear_attention": lambda f, layer: f.attention_kind(layer) == "linear_attention",
    # written by `quantize` only (e.g. DeepSeek's FA-quant cache scales): known by name, never expected in a source
    "quantized_output": lambda f, layer: False,
}


#: the names a shape dim may use: ModelFacts fields and properties
FACTS_DIMS = frozenset({f.name for f in fields(ModelFacts)} |
                       {n for n, v in vars(ModelFacts).items() if isinstance(v, property)})


def registered() -> list["Family"]:
    """Every family `@register` has seen once, in registration order."""
    return list({id(f): f for f in REGISTRY.values()}.values())


#: model_type -> its Family instance, filled by `@register` (read through dsconv.families.family_for)
REGISTRY: dict[str, "Family"] = {}


def register(cls: type["Family"]) -> type["Family"]:
    """Class decorator: make `cls` (whose table was checked when the class was defined) the family of each of its
    `model_types`."""
    if not cls.model_types:
        raise TableError(f"{cls.__name__}: a registered family needs model_types")
    family = cls()
    from dsconv.families.facts import TRANSFORMERS_MODEL_TYPE

    for model_type in cls.model_types:
        if cls.transformers_model_type:
            TRANSFORMERS_MODEL_TYPE[model_type] = cls.transformers_model_type
        other = REGISTRY.get(model_type)
        if other is not None and (type(other).__module__, type(other).__qualname__) != (cls.__module__,
                                                                                        cls.__qualname__):
            raise TableError(f"{cls.__name__}: model_type {model_type!r} is already {type(other).__name__}'s")
        REGISTRY[model_type] = family
    return cls


class Family:
    """Base of every family. Subclasses set `model_types`, `table`, `tiny`, and read their own config keys."""

    name: str = ""
    model_types: tuple[str, ...] = ()
    #: the one model description (see TensorRow); row order is checkpoint order
    table: tuple[TensorRow, ...] = ()
    #: what the checkpoint puts before a layer's number: the table's `LAYER` rows become layer_prefix + "{L}." ...
    layer_prefix: str = "model.layers."
    #: where the checkpoint keeps the text model's own modules: table rows written "model.*" (embed_tokens, norm)
    #: become text_prefix + "*"; transformers' causal LM holds them as "model.*" (Materialiser.ck_name maps back).
    #: A vision-language checkpoint (Qwen3.5-MoE) keeps its text model under "model.language_model."
    text_prefix: str = "model."
    #: the config.json key holding the text model's values in a vision-language config ("text_config"): read as if
    #: they stood at the top level (`flat_config`)
    config_section: str | None = None
    #: name prefixes of a vision tower stored beside the text model: classified Role.TOWER / Category.VISION and
    #: carried through every stage in float, as the engines load it
    tower_prefixes: tuple[str, ...] = ()
    #: the transformers auto class whose model the published checkpoint is saved from (tiny models, parameter counts);
    #: the stages always run the causal LM it holds
    checkpoint_class: str = "AutoModelForCausalLM"
    #: the parameter vocabulary of this family's tensors: what a table row's name may end with (weights and biases,
    #: other model parameters), and the quantization auxiliaries that follow a weight (families/roles.py)
    weight_params: tuple[str, ...] = WEIGHT_PARAMS
    other_params: tuple[str, ...] = OTHER_PARAMS
    aux_params: tuple[str, ...] = AUX_PARAMS
    #: config overrides of the seeded tiny model (dsconv.tiny) over its common small widths
    tiny: dict[str, Any] = {}
    # RMSNorm computes x * (norm_offset + weight): Gemma stores weights as offsets from 1. Folding a scale into a norm
    # (SmoothQuant) must scale the effective weight, not the stored one.
    norm_offset: float = 0.0
    #: where transformers' fused 3-D experts live (relative to the layer) and renames of their siblings
    fused_experts: str = "mlp.experts"
    fused_renames: dict[str, str] = {}
    #: every config.json key `_facts` reads -> its value when absent or null (REQUIRED: the family cannot do without
    #: it). Checked by kind and bounds when the config is read (dsconv.schemas.model.config_fields); `_facts` sees
    #: these keys alone (ConfigValues), and benchmarks/fuzz.py mutates each of them.
    config_keys: dict[str, Any] = {
        "model_type": REQUIRED, "num_hidden_layers": REQUIRED, "hidden_size": REQUIRED, "vocab_size": REQUIRED,
        "num_attention_heads": REQUIRED, "intermediate_size": REQUIRED,
        "head_dim": None, "num_key_value_heads": None,  # None: hidden_size / heads, and as many as the heads
        "dtype": None, "torch_dtype": None, "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "attention_bias": False,
    }
    #: transformers' fused 3-D expert parameters -> the per-expert slots each holds, stacked along dim 1
    fused_params: dict[str, tuple[str, ...]] = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
    #: 3-D expert tensors a checkpoint may store besides transformers' own (`fused_experts`.`fused_params`),
    #: relative to the layer -> the per-expert slots each holds
    disk_fused_params: dict[str, tuple[str, ...]] = {}
    #: engine -> (rule, source) where the engine has no model for this family: refused before any work
    engine_refused: dict[str, tuple[str, str]] = {}
    #: name prefixes of an MTP block stored apart from the decoder layers (Qwen3-Next's `mtp.*`: its own fc, norms
    #: and a decoder layer): classified as category MTP and carried through every stage in float, never required
    mtp_prefixes: tuple[str, ...] = ()
    #: keys of rows not quantized by default that an FP8 checkpoint still stores in FP8 with block scales
    fp8_keys: tuple[str, ...] = ()
    #: the transformers model type that runs this family's checkpoints, where transformers has none of its own
    transformers_model_type: str | None = None
    #: config.json keys the tiny model's saved config.json carries besides transformers' (e.g. Kimi-K2's auto_map)
    tiny_saved: dict[str, Any] = {}
    #: why a stage cannot take this family (None: it can): engines' loaders, the MindSpore builder
    quantize_refused: str | None = None
    #: why the residual stream cannot be rotated offline (`dsconv rotate`, `quantize --rotate`), or None
    rotation_refused: str | None = None
    mindir_refused: str | None = None
    onnx_refused: str | None = None

    @property
    def disk_fused(self) -> dict[str, tuple[str, ...]]:
        """Checkpoint names of 3-D fused experts relative to the layer -> the per-expert slots each holds."""
        return {**{f"{self.fused_experts}.{p}": slots for p, slots in self.fused_params.items()},
                **self.disk_fused_params}
    #: config.json keys the engines read with a default that is wrong for this family, and the value this family's
    #: transformers code implies when the key is absent (transformers 5 stops writing some of them)
    engine_config_defaults: dict[str, Any] = {}
    #: slots whose output rows an engine permutes at load time for rotary embedding (MindIE regroups MLA rope rows)
    rope_permuted_slots: tuple[str, ...] = ()
    #: `quantize --bits 8` for every engine, where the family follows a recipe of its own: layer kind -> type
    #: (None: each engine's default recipe, engines.DEFAULT_BITS8)
    bits8_recipe: dict[str, str] | None = None
    #: engine -> config.json key -> the layer kinds it governs, where that engine reads one type per region
    #: (absent: the engine's default regions)
    engine_regions: dict[str, dict[str, tuple[str, ...]]] = {}
    #: engine -> region keys written whenever their region is quantized (the engine's default for the key is not
    #: `quantize`'s type)
    engine_explicit_keys: dict[str, tuple[str, ...]] = {}
    #: engine -> layer kind -> (rule, source) where the engine runs that kind of this family only in float (kept float)
    engine_float_kinds: dict[str, dict[str, tuple[str, str]]] = {}
    #: engine -> layer kind -> (the types the engine's loader takes for it in this family, rule, source)
    engine_kind_types: dict[str, dict[str, tuple[frozenset[str], str, str]]] = {}
    #: engine -> (the dtype it computes this family in whatever config.json says, rule, source): scales are
    #: written in the form that dtype's kernels read (an fp16 run reads deq_scale as int64)
    engine_dtypes: dict[str, tuple[str, str, str]] = {}
    #: engine -> (the model dtypes it refuses for this family, rule, source)
    engine_refused_dtypes: dict[str, tuple[frozenset[str], str, str]] = {}
    #: keys transformers 5 derives and saves that the engines' own config classes reject (left out of config.json as
    #: the published checkpoint leaves them out; transformers derives them again)
    engine_config_derived: tuple[str, ...] = ()
    #: config.json key an engine reads -> the key this family's transformers 5 config holds the value under
    #: (written when absent, as engine_config writes the renamed keys back)
    engine_config_aliases: dict[str, str] = {}
    #: engine -> (rule, source) of an offline-sharded layout the engine's loader reads for this family; every
    #: other engine shards the family itself at load time
    offline_sharded: dict[str, tuple[str, str]] = {}
    #: engine -> the model types of this family whose loader reads its int8 KV-cache scales (C8, or FA quant for
    #: MLA) into the attention (`quantize --kv-cache int8`; engines/profiles.py kv_int8 says where it was read)
    kv_int8_engines: dict[str, tuple[str, ...]] = {}
    #: engine -> the model types of this family whose model code runs W8A8_MIX (PD-mix) linears, for the engines
    #: that run it per model (profiles: mix_per_model, rules["w8a8_mix"]; docs/formats/w8a8_mix.md)
    w8a8_mix_engines: dict[str, tuple[str, ...]] = {}
    #: MindIE service config: the model section under `models` that sets its expert-parallel level (None: none)
    mindie_ep_section: str | None = None
    #: std of the seeded tiny model's router weights (dsconv.tiny): wide enough that routing varies by input
    tiny_router_std: float = 0.5

    def engine_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """config.json as the engines read it: the keys transformers 5 renamed written back under the names MindIE
        (transformers 4.30) and vLLM read, beside the new ones; then the family's implied keys. Values come from
        the model's own config; a key already present is never changed."""
        from dsconv.families.facts import legacy_config_keys

        out = dict(config)
        for k, v in {**legacy_config_keys(config), **self.engine_config_defaults}.items():
            out.setdefault(k, v)
        for k, src in self.engine_config_aliases.items():
            if k not in out and out.get(src) is not None:
                out[k] = out[src]
        for k in self.engine_config_derived:
            out.pop(k, None)
        return out

    @property
    def params(self) -> frozenset[str]:
        """Every parameter name a tensor of this family may end with."""
        return self._params

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls._params = frozenset(cls.weight_params + cls.aux_params + cls.other_params)
        if not cls.layer_prefix.endswith(".") or "{" in cls.layer_prefix:
            raise TableError(f"{cls.__name__}.layer_prefix {cls.layer_prefix!r} must end with '.' (model.layers.)")
        cls.table = tuple(cls._bind(r) for r in cls.table)
        for r in cls.table:
            cls._check(r)
        cls._rows = {r.key: r for r in cls.table}
        if len(cls._rows) != len(cls.table):
            raise TableError(f"{cls.__name__}: duplicate keys in its table")
        modules: dict[str, TensorRow] = {}
        for r in cls.table:
            modules.setdefault(r.module, r)
        cls._modules = modules
        cls._row_of = {(r.module, r.param): r for r in cls.table}
        layer = cls.layer_prefix + LAYER
        #: per-expert module templates relative to the layer, by slot (the on-disk "original" layout)
        cls.expert_modules = {r.slot: r.module[len(layer):] for r in cls.table if r.per_expert and r.param == "weight"}
        #: the name parts a layer number and an expert number follow ("layers", "experts")
        cls._layer_part = cls.layer_prefix[:-1].rsplit(".", 1)[-1]
        cls._expert_parts = frozenset(r.name.split(".{E}.")[0].rsplit(".", 1)[-1] for r in cls.table if r.per_expert)

    @classmethod
    def _bind(cls, r: TensorRow) -> TensorRow:
        """A row of the table with `LAYER` replaced by the family's layer prefix."""
        if not isinstance(r, TensorRow):
            raise TableError(f"{cls.__name__}: its table holds {r!r}, not a TensorRow")
        if r.name.startswith(LAYER):
            return replace(r, name=cls.layer_prefix + r.name)
        return replace(r, name=cls.text_prefix + r.name[len("model."):]) if r.name.startswith("model.") else r

    @classmethod
    def _check(cls, r: TensorRow) -> None:
        """A row's dims are ModelFacts attributes, its `when` a PRESENT predicate, its parameter in the family's
        vocabulary, its {L}/{E} placeholders where the family can find them."""
        where = f"{cls.__name__} table row {r.key!r} ({r.name})"

        def close(word: str, known: Any) -> str:
            near = difflib.get_close_matches(word, sorted(known), n=1)
            return f" (did you mean {near[0]!r}?)" if near else ""

        if not isinstance(r.role, Role) or not isinstance(r.category, Category):
            raise TableError(f"{where}: role must be a Role and category a Category, not {r.role!r}, {r.category!r}")
        if not isinstance(r.shape, tuple) or not r.shape:
            raise TableError(f"{where}: shape must be a non-empty tuple of ints and ModelFacts attributes")
        for d in r.shape:
            if not isinstance(d, int) and d not in FACTS_DIMS:
                raise TableError(f"{where}: shape dim {d!r} is not a ModelFacts attribute{close(str(d), FACTS_DIMS)}")
        if r.when is not None and r.when not in PRESENT:
            raise TableError(f"{where}: when={r.when!r} is not a PRESENT predicate{close(r.when, PRESENT)}; "
                             f"known: {', '.join(PRESENT)}")
        if r.param not in cls.weight_params + cls.other_params:
            raise TableError(f"{where}: parameter {r.param!r} is not in the family's weight_params/other_params")
        if r.per_expert and not r.per_layer:
            raise TableError(f"{where}: an {{E}} row must be a per-layer row")
        if r.per_layer and not r.name.startswith(cls.layer_prefix + LAYER):
            raise TableError(f"{where}: a per-layer name must start with LAYER ({cls.layer_prefix}{LAYER})")
        if r.per_expert and ".{E}." not in r.name:
            raise TableError(f"{where}: {{E}} must be a whole name part")

    # ---- the table as builders see it -----------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self._rows

    def row(self, key: str) -> TensorRow:
        return self._rows[key]

    def tensor(self, key: str, layer: int | None = None, expert: int | None = None) -> str:
        """The concrete tensor name of `key` ("attn.q", layer 3 -> model.layers.3.self_attn.q_proj.weight)."""
        return self._rows[key].name.replace("{L}", str(layer)).replace("{E}", str(expert))

    def module(self, key: str, layer: int | None = None, expert: int | None = None) -> str:
        return self.tensor(key, layer, expert).rsplit(".", 1)[0]

    def shape(self, key: str, f: ModelFacts) -> tuple[int, ...]:
        return self._rows[key].dims(f)

    # ---- classification -------------------------------------------------------------------------------------
    def template_of(self, name: str) -> tuple[str, str, int | None, int | None]:
        """`model.layers.3.mlp.experts.7.up_proj.weight` -> ('model.layers.{L}.mlp.experts.{E}.up_proj', 'weight',
        3, 7): the layer number follows the last part of `layer_prefix`, the expert number its experts' part."""
        parts = name.split(".")
        param = parts.pop() if parts and parts[-1] in self._params else ""
        layer = expert = None
        for i, p in enumerate(parts):
            if p.isdigit() and i > 0:
                if layer is None and parts[i - 1] == self._layer_part:
                    layer = int(p)
                    parts[i] = "{L}"
                elif expert is None and parts[i - 1] in self._expert_parts:
                    expert = int(p)
                    parts[i] = "{E}"
        return ".".join(parts), param, layer, expert

    def row_key(self, name: str) -> str | None:
        """The table row of a tensor name, by its module and its parameter (a bias is a row of its own), else the
        row of its module (an auxiliary such as weight_scale follows its weight); None outside the table."""
        module, param, _, _ = self.template_of(name)
        row = self._row_of.get((module, param)) or self._modules.get(module)
        return row.key if row is not None else None

    def classify(self, name: str, facts: ModelFacts) -> TensorRole:
        if self.tower_prefixes and name.startswith(self.tower_prefixes):
            module, _, param = name.rpartition(".")
            if param in self._params:
                return TensorRole(module, param, Role.TOWER, Category.VISION)
        if self.mtp_prefixes and name.startswith(self.mtp_prefixes):  # an MTP block stored apart from the layers,
            module, _, param = name.rpartition(".")  # carried as it is, in float
            if param in self._params:
                rule = self._modules.get(module)  # its own rows (fc, norms) by their role
                return TensorRole(module, param, rule.role if rule else Role.MTP_PROJ, Category.MTP)
        module, param, layer, expert = self.template_of(name)
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
    def facts(self, config: Mapping[str, Any], where: str = "config.json") -> ModelFacts:
        """The facts of a config; the keys the family reads are checked first (UserError naming `where` and the
        key), so `_facts` computes with values of the declared kinds."""
        return self._facts(ConfigValues(config_fields(self.flat_config(config), where, self.config_keys), config))

    def flat_config(self, config: Mapping[str, Any]) -> Mapping[str, Any]:
        """config.json with the text model's section (`config_section`) read as top-level keys; a key the top level
        also holds (model_type, tie_word_embeddings) keeps the top level's value, as transformers reads it."""
        section = config.get(self.config_section) if self.config_section else None
        if not isinstance(section, Mapping):
            return config
        return {**section, **config}

    def nest_config(self, flat: dict[str, Any]) -> dict[str, Any]:
        """The inverse of `flat_config` for a config written from flat keys (the tiny model's)."""
        return flat

    def tower_shapes(self, facts: ModelFacts) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of the vision tower's tensors, from config.json alone (none without a tower)."""
        return []

    def _facts(self, c: ConfigValues) -> ModelFacts:
        heads = c["num_attention_heads"]
        hidden = c["hidden_size"]
        head_dim = cfg_get(c, "head_dim", default=hidden // heads)
        return ModelFacts(
            model_type=c["model_type"], num_layers=c["num_hidden_layers"], hidden_size=hidden,
            vocab_size=c["vocab_size"], num_heads=heads, num_kv_heads=cfg_get(c, "num_key_value_heads", default=heads),
            head_dim=head_dim, v_head_dim=head_dim, intermediate_size=c["intermediate_size"],
            dtype=config_dtype(c), tie_word_embeddings=c["tie_word_embeddings"],
            config=c.raw, rms_norm_eps=float(c["rms_norm_eps"]), hidden_act=c["hidden_act"],
            qkv_bias=c["attention_bias"],
        )

    # ---- synthesis from config alone ------------------------------------------------------------------------
    def iter_shapes(self, f: ModelFacts) -> Iterator[tuple[TensorRow, str, tuple[int, ...]]]:
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
            shapes = self._layer_shapes(f, layer, self.table[first:last + 1])
            if not self.mtp_prefixes:
                yield from shapes
                continue
            # an MTP block stored apart (Qwen3-Next, Qwen3.5): its decoder layers as mtp.layers.K.*, in float
            old, new = f"{self.layer_prefix}{layer}.", f"{self.mtp_prefixes[0]}layers.{layer - f.num_layers}."
            yield from ((replace(r, dtype=r.dtype or f.dtype), name.replace(old, new), shape)
                        for r, name, shape in shapes)

    def _layer_shapes(self, f: ModelFacts, layer: int, rows: tuple[TensorRow, ...]) -> Iterator[tuple[TensorRow, str, tuple[int, ...]]]:
        i = 0
        while i < len(rows):
            run = [rows[i]]  # a run of expert rows is expanded expert by expert
            while run[0].per_expert and i + len(run) < len(rows) and rows[i + len(run)].per_expert:
                run.append(rows[i + len(run)])
            i += len(run)
            live = [r for r in run if r.when is None or PRESENT[r.when](f, layer)]
            # a row's shape and its layer's name are the same for every expert (256 x 3 per DeepSeek-V3 layer)
            named = [(r, r.name.replace("{L}", str(layer)), r.dims(f)) for r in live]
            for e in (range(f.num_experts) if run[0].per_expert else (None,)) if live else ():
                for r, name, shape in named:
                    yield r, name.replace("{E}", str(e)), shape

    def synthesize(self, config: dict[str, Any]) -> list[TensorSpec]:
        """The full tensor list (names, shapes, dtypes) a checkpoint of this config has, with no weights. FP8
        configs (DeepSeek's published form): quantizable linear weights F8_E4M3, each followed by its F32
        `weight_scale_inv` block grid."""
        f = self.facts(config)
        out: list[TensorSpec] = []
        for row, name, shape in self.iter_shapes(f):
            if row.dtype:
                out.append(TensorSpec(name, row.dtype, shape))
            elif f.fp8_block and (row.role.quantized_by_default or row.key in self.fp8_keys) and row.param == "weight":
                out.append(TensorSpec(name, "F8_E4M3", shape))
                br, bc = f.fp8_block
                out.append(TensorSpec(name + "_scale_inv", "F32", (math.ceil(shape[0] / br), math.ceil(shape[1] / bc))))
            else:
                out.append(TensorSpec(name, f.dtype, shape))
        return out + [TensorSpec(name, f.dtype, shape) for name, shape in self.tower_shapes(f)]
