"""Families and `dsconv inspect`: the tables match what transformers writes, the counts match the model, and the
DeepSeek-V3 reference figures are reproduced from config alone."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dsconv.checkpoint import Checkpoint
from dsconv.families import families, family_for, supported_model_types
from dsconv.families.roles import Category, Role
from dsconv.inspect import inspect_model
from dsconv.tiny import FAMILIES, MOE_FAMILIES, build_model

pytestmark = pytest.mark.cli

DATA = Path(__file__).parent / "data"


def _persistent_buffers(model) -> int:
    """DeepSeek's e_score_correction_bias is a buffer in transformers 5 but a Parameter in DeepSeek's own code and in
    its 671B count; dsconv counts it. Nothing else in these families is a persistent buffer."""
    state = set(model.state_dict())
    return sum(b.numel() for n, b in model.named_buffers() if n in state)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fused", [False, True])
def test_parameters_equal_transformers(tiny_model, family, fused):
    if fused and family not in MOE_FAMILIES:
        pytest.skip("dense family: one layout")
    model = build_model(family)
    report = inspect_model(Checkpoint.open(tiny_model(family, fused=fused)))
    expected = sum(p.numel() for p in model.parameters()) + _persistent_buffers(model)
    assert report["parameters"] == expected
    if not any(f.name == family and f.has("router.bias") for f in families()):
        assert _persistent_buffers(model) == 0  # only DeepSeek-style routers keep a bias buffer
    assert sum(c["parameters"] for c in report["categories"].values()) == report["parameters"]


@pytest.mark.parametrize("family", FAMILIES)
def test_synthesized_list_matches_saved_checkpoint(tiny_model, family):
    """The family's table, run on config.json alone, predicts every tensor name, shape and dtype on disk."""
    d = tiny_model(family)
    ck = Checkpoint.open(d)
    specs = {s.name: s for s in ck.family.synthesize(ck.config)}
    assert set(specs) == set(ck.tensors)
    for name, info in ck.tensors.items():
        assert specs[name].shape == info.shape, name
        assert specs[name].dtype == info.dtype, name


def test_tied_embeddings_counted_once(tiny_model):
    d = tiny_model("qwen2", tie_word_embeddings=True)
    ck = Checkpoint.open(d)
    assert "lm_head.weight" not in ck.tensors
    model = build_model("qwen2", tie_word_embeddings=True)
    assert inspect_model(ck)["parameters"] == sum(p.numel() for p in model.parameters())
    assert "lm_head" not in inspect_model(ck)["categories"]


def test_roles_of_deepseek(tiny_model):
    ck = Checkpoint.open(tiny_model("deepseek_v3"))
    role = lambda n: ck.role(n).role  # noqa: E731
    assert role("model.layers.0.self_attn.q_a_proj.weight") is Role.ATTN_LATENT
    assert role("model.layers.0.self_attn.kv_b_proj.weight") is Role.ATTN_IN
    assert role("model.layers.0.self_attn.o_proj.weight") is Role.ATTN_OUT
    assert role("model.layers.1.mlp.experts.15.down_proj.weight") is Role.EXPERT_OUT
    assert role("model.layers.1.mlp.gate.e_score_correction_bias") is Role.ROUTER
    assert ck.role("model.layers.1.mlp.shared_experts.up_proj.weight").category is Category.SHARED_EXPERTS
    assert ck.role("model.layers.0.mlp.up_proj.weight").category is Category.DENSE_MLP
    assert Role.ATTN_OUT.tp_dim == 1 and Role.ATTN_IN.tp_dim == 0 and Role.NORM.tp_dim is None


def test_mtp_layer_is_its_own_category(tiny_model, tmp_path):
    import shutil

    from dsconv.tiny import add_mtp_layer

    d = tmp_path / "m"
    shutil.copytree(tiny_model("deepseek_v3"), d)
    add_mtp_layer(d)
    ck = Checkpoint.open(d)
    report = inspect_model(ck)
    assert ck.facts.num_mtp_layers == 1
    assert report["categories"]["mtp"]["parameters"] > 0
    assert report["main_parameters"] == report["parameters"] - report["categories"]["mtp"]["parameters"]
    assert ck.role("model.layers.3.eh_proj.weight").role is Role.MTP_PROJ
    assert ck.role("model.layers.3.mlp.experts.2.up_proj.weight").category is Category.MTP


@pytest.fixture(scope="module")
def deepseek_report(run_cli):
    r = run_cli(["inspect", "--config", DATA / "deepseek_v3_config.json", "--json"])
    assert r.code == 0, r.err
    return json.loads(r.out)


def test_deepseek_v3_reference_counts(deepseek_report):
    """The numbers of docs/formats.md (DeepSeek-V3), from config.json alone."""
    rep = deepseek_report
    assert rep["main_parameters"] == 671_026_419_200
    assert rep["elements"] == 684_531_386_000
    assert rep["bytes"] == 688_574_839_360
    assert rep["tensors"] == 91_991
    assert rep["categories"]["routed_experts"]["parameters"] == 653_908_770_816  # layers 3-60 (MTP apart)
    assert rep["kv_cache_bytes_per_token"]["bf16"] == 70_272
    # one expert of one layer is 44,040,192 parameters
    assert 3 * 2048 * 7168 == 44_040_192


def test_deepseek_cards(deepseek_report):
    rep = deepseek_report
    c = rep["cards"]["Ascend910B"]
    mem = 64 * 2**30
    assert c["memory_bytes"] == mem
    assert c["bf16"]["weight_bytes"] == 2 * rep["parameters"]
    assert c["bf16"]["cards"] == math.ceil(2 * rep["parameters"] / mem)
    assert c["bf16"]["cards_x1.3"] == math.ceil(2 * rep["parameters"] * 1.3 / mem)
    assert c["int8"]["cards"] < c["bf16"]["cards"] and c["int4"]["cards"] < c["int8"]["cards"]
    assert rep["cards"]["Ascend910B4"]["bf16"]["cards"] >= 2 * c["bf16"]["cards"] - 1
    assert "fp16" in rep["cards"]["Ascend310P3"] and "bf16" not in rep["cards"]["Ascend310P3"]


def test_inspect_table_output(run_cli, tiny_model):
    r = run_cli(["inspect", "--model", tiny_model("qwen2_moe")])
    assert r.code == 0, r.err
    for word in ("routed_experts", "shared_experts", "router", "Ascend910B4", "Ascend310P3", "KV cache"):
        assert word in r.out


def test_unknown_model_type_lists_supported(run_cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    r = run_cli(["inspect", "--config", tmp_path / "config.json"])
    assert r.code == 2
    for t in supported_model_types():
        assert t in r.err


def test_config_missing_key_is_user_error(run_cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    r = run_cli(["inspect", "--config", tmp_path / "config.json"])
    assert r.code == 2 and "num_attention_heads" in r.err or "num_hidden_layers" in r.err


def test_family_registry_covers_the_issue():
    for t in ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3"):
        assert family_for({"model_type": t}).model_types


@pytest.mark.parametrize("family", FAMILIES)
def test_table_is_consistent(family):
    """Every row of a family's table names its layer/expert placeholders, a known presence rule and shape formulas
    the facts can evaluate; `tensor(key)` gives back the row's template filled in (what the MindSpore builder asks)."""
    from dsconv.families import families
    from dsconv.families.base import PRESENT
    from dsconv.tiny import tiny_config

    fam = next(f for f in families() if f.name == family)
    facts = fam.facts(tiny_config(family).to_dict())
    for row in fam.table:
        assert row.when is None or row.when in PRESENT, row
        assert row.per_layer or not row.per_expert, row
        assert all(d > 0 for d in row.dims(facts) if row.when in (None, "untied")), row
        assert fam.tensor(row.key, 3, 5) == row.name.replace("{L}", "3").replace("{E}", "5")
        assert fam.classify(fam.tensor(row.key, 0, 0), facts).role is row.role
    assert {"embed", "norm.input", "norm.post", "norm.final", "lm_head", "attn.o"} <= {r.key for r in fam.table}
