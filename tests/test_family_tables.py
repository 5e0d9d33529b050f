"""A family's table is checked when its class is defined (families/base.py TableError), families register with
`@register`, and the layer prefix and parameter vocabulary belong to the family."""
from __future__ import annotations

import pytest

from dsconv.families import family_for, supported_model_types
from dsconv.families.base import LAYER, REGISTRY, Family, TableError, TensorRow, register
from dsconv.families.rows import decoder, dense_mlp, gqa_attention, linear
from dsconv.families.roles import AUX_PARAMS, Category, Role

pytestmark = pytest.mark.unit


def row(**kw) -> TensorRow:
    base = {"key": "probe", "name": LAYER + "probe.weight", "role": Role.MLP_IN, "category": Category.DENSE_MLP,
            "shape": ("intermediate_size", "hidden_size")}
    return TensorRow(**{**base, **kw})


@pytest.fixture
def scratch_registry():
    """Registrations a test makes are undone (the registry is process-wide)."""
    saved = dict(REGISTRY)
    yield
    REGISTRY.clear()
    REGISTRY.update(saved)


def test_rows_take_keywords_only():
    with pytest.raises(TypeError):
        TensorRow("k", "model.norm.weight", Role.NORM, Category.NORMS, ("hidden_size",))  # type: ignore[misc]


def test_a_misspelt_shape_dim_fails_when_the_family_is_defined():
    with pytest.raises(TableError, match=r"row 'probe'.*'intermediate_sise' is not a ModelFacts attribute.*"
                                         r"did you mean 'intermediate_size'"):
        class Bad(Family):  # noqa: F841
            table = (row(shape=("intermediate_sise", "hidden_size")),)


def test_an_unknown_when_fails_when_the_family_is_defined():
    with pytest.raises(TableError, match=r"when='untide' is not a PRESENT predicate.*did you mean 'untied'"):
        class Bad(Family):  # noqa: F841
            table = (row(when="untide"),)


def test_a_parameter_outside_the_vocabulary_fails_and_a_family_can_extend_it():
    with pytest.raises(TableError, match="parameter 'gamma' is not in the family's"):
        class Bad(Family):  # noqa: F841
            table = (row(name=LAYER + "probe.gamma"),)

    class Good(Family):
        other_params = Family.other_params + ("gamma",)
        table = (row(name=LAYER + "probe.gamma"),)

    assert "gamma" in Good().params and set(AUX_PARAMS) <= Good().params


def test_duplicate_keys_and_misplaced_placeholders_fail():
    with pytest.raises(TableError, match="duplicate keys"):
        class Dup(Family):  # noqa: F841
            table = (row(), row(name=LAYER + "other.weight"))
    with pytest.raises(TableError, match="must start with LAYER"):
        class Mid(Family):  # noqa: F841
            table = (row(name="model.x.{L}.probe.weight"),)
    with pytest.raises(TableError, match="not a TensorRow"):
        class Tuple(Family):  # noqa: F841
            table = (("probe", "model.norm.weight"),)


def test_register_adds_the_family_and_refuses_a_taken_model_type(scratch_registry):
    @register
    class Probe(Family):
        name = "probe"
        model_types = ("probe_model",)
        table = decoder(attention=gqa_attention(), mlp=dense_mlp())

    assert "probe_model" in supported_model_types()
    assert type(family_for({"model_type": "probe_model"})) is Probe
    with pytest.raises(TableError, match="already"):
        @register
        class Thief(Family):  # noqa: F841
            model_types = ("probe_model",)


def test_another_layer_prefix_is_one_attribute(scratch_registry):
    """A GPT-2-style checkpoint (`transformer.h.N.`): the family's rows are bound to its prefix; synthesis and
    classification follow."""
    class Prefixed(Family):
        name = "prefixed"
        model_types = ("prefixed_probe",)
        layer_prefix = "transformer.h."
        table = (*linear(key="embed", module="transformer.wte", role=Role.EMBED, category=Category.EMBEDDING,
                         shape=("vocab_size", "hidden_size")),
                 *decoder(attention=gqa_attention(qkv_bias=False), mlp=dense_mlp())[1:])

    fam = Prefixed()
    assert fam.tensor("attn.q", 3) == "transformer.h.3.self_attn.q_proj.weight"
    config = {"model_type": "prefixed_probe", "num_hidden_layers": 2, "hidden_size": 16, "vocab_size": 32,
              "num_attention_heads": 2, "intermediate_size": 24}
    facts = fam.facts(config)
    names = [t.name for t in fam.synthesize(config)]
    assert "transformer.h.1.mlp.down_proj.weight" in names and not any(n.startswith("model.layers.") for n in names)
    role = fam.classify("transformer.h.1.self_attn.o_proj.weight_scale", facts)
    assert (role.layer, role.role, role.is_aux) == (1, Role.ATTN_OUT, True)
