"""Engine profiles (dsconv/engines): recipes per layer kind, refusals before any work, config keys, dsconv.toml."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from dsconv import engines
from dsconv.errors import UserError
from dsconv.families.roles import Category, Role

pytestmark = pytest.mark.cli


def lin(module, role, category, slot=None, qtype="W8A8"):
    return SimpleNamespace(module=module, role=role, category=category, slot=slot, qtype=qtype)


def test_bits8_recipes_per_engine_and_family():
    """DeepSeek: Ascend's mix for both engines (MindIE-LLM examples/models/deepseek-v3/README.md); others: static
    everywhere for MindIE (one `quantize` region), dynamic routed experts for vLLM-Ascend (no static MoE scheme)."""
    for e in engines.ENGINES.values():
        t = engines.kind_types(e, "deepseek_v3", "W8A8", bits_default=True)
        assert t == {"attention": "W8A8", "kv_b": "FLOAT", "dense_mlp": "W8A8_DYNAMIC",
                     "shared_experts": "W8A8_DYNAMIC", "routed_experts": "W8A8_DYNAMIC"}
    assert engines.kind_types(engines.get("mindie"), "qwen3_moe", "W8A8", True)["routed_experts"] == "W8A8"
    assert engines.kind_types(engines.get("vllm-ascend"), "qwen3_moe", "W8A8", True)["routed_experts"] == "W8A8_DYNAMIC"
    t = engines.kind_types(engines.get("vllm-ascend"), "llama", "W8A16", False, moe_qtype="W8A8_DYNAMIC")
    assert t["attention"] == "W8A16" and t["routed_experts"] == "W8A8_DYNAMIC" and t["kv_b"] == "FLOAT"


def test_refusal_names_kind_example_source_and_alternative():
    v = engines.get("vllm-ascend")
    with pytest.raises(UserError) as e:
        engines.check_plan(v, "qwen3_moe", [lin("model.layers.0.mlp.experts.0.up_proj", Role.EXPERT_IN,
                                                  Category.ROUTED_EXPERTS, "up", "W8A8")])
    msg = e.value.one_line()
    assert "routed_experts layers (e.g. model.layers.0.mlp.experts.0.up_proj) cannot be W8A8" in msg
    assert "create_scheme_for_layer" in msg and "--moe-scheme w4a8_dynamic | w8a8_dynamic" in msg \
        and "--engine mindie" in msg
    with pytest.raises(UserError, match="no W4A16 linear scheme"):
        engines.check_plan(v, "llama", [lin("model.layers.0.self_attn.q_proj", Role.ATTN_IN, Category.ATTENTION,
                                            "q", "W4A16")])


def test_mindie_regions_hold_one_type():
    """MindIE reads a region's tensors with its config key's recipe (weights.py::get_multi_weights_col)."""
    m = engines.get("mindie")
    plan = [lin("model.layers.0.self_attn.q_proj", Role.ATTN_IN, Category.ATTENTION, "q", "W8A8"),
            lin("model.layers.0.mlp.experts.0.up_proj", Role.EXPERT_IN, Category.ROUTED_EXPERTS, "up",
                "W8A8_DYNAMIC")]
    with pytest.raises(UserError, match="one quantized type per region"):
        engines.check_plan(m, "mixtral", plan)
    engines.check_plan(m, "deepseek_v3", plan)  # mla_quantize and moe_quantize are separate regions there
    engines.check_plan(m, "qwen3_moe", plan)  # attn_quantize too (qwen2_moe/flash_causal_qwen2_moe.py)
    types = {p.module: p.qtype for p in plan}
    kinds = {p.module: engines.layer_kind(p) for p in plan}
    assert engines.config_updates(m, "deepseek_v3", types, kinds) == {"quantize": "w8a8_dynamic",
                                                                       "mla_quantize": "w8a8"}
    assert engines.config_updates(engines.get("vllm-ascend"), "deepseek_v3", types, kinds) == {}
    # MindIE's Qwen-MoE reads a w8a8_dynamic model's attention as static without attn_quantize: always written
    assert engines.config_updates(m, "qwen3_moe", types, kinds) == {"quantize": "w8a8_dynamic",
                                                                     "attn_quantize": "w8a8"}


def test_fallback_and_legacy_layout_per_engine():
    with pytest.raises(UserError, match="cannot fall back"):
        engines.check_fallback(engines.get("mindie"), 2, None)
    assert engines.check_fallback(engines.get("mindie"), None, None) is False
    assert engines.check_fallback(engines.get("vllm-ascend"), 2, None) is True
    with pytest.raises(UserError, match="only quant_model_description.json"):
        engines.check_layout(engines.get("vllm-ascend"), "mindie")


def test_engine_from_dsconv_toml(tmp_path, tiny_model, run_cli):
    m = tiny_model("qwen3_moe", dtype="bf16")
    (tmp_path / "dsconv.toml").write_text(f'[workspace]\nmodel = "{m}"\noutput = "out"\n[defaults]\nengine = "vllm-ascend"\n')
    r = run_cli(["quantize", "--scheme", "w8a16", "--dry-run"], cwd=tmp_path)
    assert r.code == 2 and "--engine vllm-ascend: routed_experts layers" in r.err
    r = run_cli(["quantize", "--scheme", "w8a16", "--dry-run", "--engine", "mindie"], cwd=tmp_path)
    assert r.code == 0 and "per layer kind for mindie" in r.out and 'config.json: "quantize": "w8a16"' in r.out
    (tmp_path / "dsconv.toml").write_text(f'[workspace]\nmodel = "{m}"\n[defaults]\nengine = "tgi"\n')
    r = run_cli(["quantize", "--scheme", "w8a16", "--dry-run"], cwd=tmp_path)
    assert r.code == 2 and "is not an engine" in r.err
