"""The models the field deploys now - GLM-4.5, DeepSeek-V3.2, Kimi-K2, Qwen3-Next, Qwen3.5-MoE - through inspect, export's refusals,
quantize's engine rules, shard's memory and eval, against transformers' own modules and the published configs.

The engines' own loaders take these outputs in `make engine-check` (tests/engine_check/); here is what runs in
`make test`: sizes from config.json alone equal what transformers builds, caches equal what its cache objects hold,
and every refusal names its rule before any work."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from benchmarks.bench_field_models import transformers_parameters
from dsconv.checkpoint import Checkpoint
from dsconv.families import family_for

pytestmark = pytest.mark.cli
REAL = Path(__file__).parent / "data" / "real_configs"
# published config.json -> (family, the model card's total in billions, which figure it quotes: DeepSeek's 685B
# counts its MTP block, GLM's cards do not)
CARDS = {"glm-4.5": ("glm4_moe", 355, "main_parameters"), "glm-4.5-air": ("glm4_moe", 106, "main_parameters"),
         "deepseek-v3.2": ("deepseek_v32", 685, "parameters"), "kimi-k2-instruct": ("kimi_k2", 1000, "parameters"),
         "qwen3-next-80b-a3b": ("qwen3_next", 80, "parameters"),
         # Qwen3.5's 397B: the text model and its vision tower (transformers' whole VL model), not the MTP block
         "qwen3.5-397b-a17b": ("qwen3_5_moe", 397, "main_parameters")}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """bf16 tiny checkpoints of the new families with the bundled-text tokenizer (what quantize and eval need)."""
    from dsconv.bundled import calib_texts
    from dsconv.tiny import make_tiny, train_tokenizer

    tok = train_tokenizer(calib_texts(), vocab_size=384)
    root = tmp_path_factory.mktemp("new")
    return {f: make_tiny(f, root / f, dtype="bf16", tokenizer=tok)
            for f in ("glm4_moe", "deepseek_v32", "kimi_k2", "qwen3_next", "qwen3_5_moe")}


@pytest.mark.parametrize("name", sorted(CARDS))
def test_real_configs_size_as_transformers_builds_them(run_cli, name):
    config = json.loads((REAL / f"{name}.json").read_text())
    r = run_cli(["inspect", "--config", REAL / f"{name}.json", "--json"])
    assert r.code == 0, r.err
    report = json.loads(r.out)
    family, card, quoted = CARDS[name]
    assert report["family"] == family
    assert report["main_parameters"] == transformers_parameters(config)  # transformers never builds the MTP layer
    assert abs(report[quoted] / 1e9 - card) / card < 0.03  # the card's round figure
    assert sum(c["parameters"] for c in report["categories"].values()) == report["parameters"]
    if family == "deepseek_v32":
        assert 0.84e9 < report["categories"]["indexer"]["parameters"] < 0.86e9


def test_kv_indexer_and_state_bytes_equal_transformers_caches():
    """Per token: K/V of the full-attention layers and V3.2's indexer keys; per sequence: the linear-attention state,
    as transformers' cache objects hold them after a forward (conv state: vLLM keeps kernel - 1 of its kernel
    inputs)."""
    from dsconv.tiny import build_model, tiny_config

    ids = torch.tensor([[1, 2, 3, 4, 5]])
    for fam_name, per_token, per_seq in (("qwen3_next", True, True), ("deepseek_v32", False, False)):
        model = build_model(fam_name)
        with torch.no_grad():
            cache = model(input_ids=ids, use_cache=True).past_key_values
        cfg = tiny_config(fam_name).to_dict()
        facts = family_for(cfg).facts(cfg)
        if per_token:
            kv = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers if hasattr(layer, "keys")
                     and layer.keys is not None)
            assert facts.kv_bytes_per_token(4) == kv * 4 // ids.shape[1]
        if per_seq:
            k = facts.linear_conv_kernel
            state = sum(cache.get_recurrent_state(i).numel() + cache.get_conv_state(i).numel() * (k - 1) // k
                        for i, kind in enumerate(facts.layer_kinds) if kind == "linear_attention")
            assert facts.state_bytes_per_sequence(4) == state * 4
            assert facts.state_bytes_per_sequence(2, tp=2) == math.ceil(state / 2) * 2
        else:
            indexer = sum(layer.indexer_keys.numel() for layer in cache.layers)
            assert facts.indexer_bytes_per_token() == indexer * 2 // ids.shape[1]


def test_kimi_k2_remote_code_is_never_run(built, run_cli, tmp_path):
    """Kimi-K2's config.json names DeepseekV3ForCausalLM with auto_map to modeling_deepseek.py: dsconv builds
    transformers' own DeepSeek-V3 and never imports the file (here, one that would raise), nor lets transformers
    ask whether to run it (its prompt once reached stdout through the tokenizer's loading)."""
    d = tmp_path / "kimi"
    shutil.copytree(built["kimi_k2"], d)
    config = json.loads((d / "config.json").read_text())
    assert config["model_type"] == "kimi_k2" and "auto_map" in config
    for f in ("configuration_deepseek.py", "modeling_deepseek.py"):
        (d / f).write_text("raise RuntimeError('remote code ran')\n")
    r = run_cli(["inspect", "--model", d])
    assert r.code == 0 and "kimi_k2" in r.out, r.err
    r = run_cli(["export", "--model", d, "--output", tmp_path / "o", "--format", "onnx"])
    assert r.code == 0 and "check passed" in r.out, r.err
    r = run_cli(["quantize", "-m", d, "-o", tmp_path / "q", "--engine", "vllm-ascend", "--scheme", "w8a8_dynamic",
                 "--calib-samples", "2", "--seq-len", "32", "--json"])
    assert r.code == 0 and "custom code" not in r.out + r.err and json.loads(r.out)


@pytest.mark.parametrize("family", ["deepseek_v32", "qwen3_next", "qwen3_5_moe"])
def test_mindie_has_no_model_refused_before_any_work(built, run_cli, tmp_path, family):
    r = run_cli(["quantize", "-m", built[family], "-o", tmp_path / "q", "--engine", "mindie", "--bits", "8"])
    assert r.code == 2 and f"MindIE does not load {family} models" in r.err and "atb_llm/models/__init__.py" in r.err
    assert "--engine vllm-ascend" in r.err and not (tmp_path / "q").exists()
    r = run_cli(["shard", "--model", built[family], "--engine", "mindie", "--tp", "2", "--dry-run"])
    assert r.code == 2 and f"MindIE does not load {family} models" in r.err


def test_glm_attention_static_or_float_for_mindie(built, run_cli, tmp_path):
    r = run_cli(["quantize", "-m", built["glm4_moe"], "-o", tmp_path / "q", "--engine", "mindie",
                 "--scheme", "w8a8_dynamic"])
    assert r.code == 2 and "attention layers" in r.err and "attn_quantize_type=_W8A8" in r.err


def test_inspect_reports_what_each_new_model_keeps(run_cli):
    r = run_cli(["inspect", "--config", REAL / "qwen3-next-80b-a3b.json", "--json"])
    report = json.loads(r.out)
    facts = family_for(json.loads((REAL / "qwen3-next-80b-a3b.json").read_text()))
    assert report["architecture"]["layer_kinds"].count("full_attention") == 12
    # 36 layers x (conv 8192 x 3 + 32 x 128 x 128) x 2 bytes; the KV cache in 12 layers only
    assert report["state_bytes_per_sequence"] == 36 * (8192 * 3 + 32 * 128 * 128) * 2
    assert report["kv_cache_bytes_per_token"]["bf16"] == 2 * 12 * 2 * 256 * 2
    assert "mindie" in report["engines_refused"] and "mindie" not in report["engine_recipes"]
    assert report["engine_recipes"]["vllm-ascend"]["linear_attention"] == "FLOAT"
    assert facts.name == "qwen3_next"
    r = run_cli(["inspect", "--config", REAL / "deepseek-v3.2.json"])
    assert "indexer's key cache: 15,616 B per token" in r.out  # 61 layers x 128 x 2 bytes


def test_shard_counts_the_state_and_the_indexer_cache(run_cli):
    r = run_cli(["shard", "--config", REAL / "qwen3-next-80b-a3b.json", "--tp", "4", "--ep", "4", "--engine",
                 "vllm-ascend", "--batch", "8", "--json"])
    assert r.code == 0, r.err
    mem = json.loads(r.out)["memory"]
    per_card = 36 * (8192 * 3 // 4 + 32 * 128 * 128 // 4) * 2
    assert mem["state_bytes"] == 8 * per_card
    assert mem["kv_requested_bytes"] == mem["kv_bytes_per_token"] * 4096 * 8 + 8 * per_card
    r = run_cli(["shard", "--config", REAL / "deepseek-v3.2.json", "--tp", "4", "--ep", "32", "--world", "32",
                 "--engine", "vllm-ascend", "--json"])
    assert json.loads(r.out)["memory"]["kv_bytes_per_token"] == 61 * (512 * 2 + 64 * 2) + 61 * 128 * 2


def test_mtp_layer_gets_description_entries(built, run_cli, tmp_path):
    """GLM-4.5's MTP layer (stored after the decoder layers, sharing the main embedding and head): every tensor has
    a description entry, FLOAT under --bits 8 (vLLM-Ascend's note: not quantized on the NPU)."""
    from dsconv.tiny import add_mtp_layer

    d = tmp_path / "glm"
    shutil.copytree(built["glm4_moe"], d)
    add_mtp_layer(d)
    ck = Checkpoint.open(d)
    mtp = sorted(n for n in ck.names() if ck.role(n).layer == ck.facts.num_layers)
    assert any(n.endswith("eh_proj.weight") for n in mtp) and not any("shared_head.head" in n for n in mtp)
    r = run_cli(["quantize", "-m", d, "-o", tmp_path / "q", "--engine", "vllm-ascend", "--bits", "8",
                 "--calib-samples", "4", "--seq-len", "32"])
    assert r.code == 0, r.err
    desc = json.loads((tmp_path / "q" / "quant_model_description.json").read_text())
    assert all(desc.get(n) == "FLOAT" for n in mtp)


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v32", "kimi_k2", "qwen3_next", "qwen3_5_moe"])
def test_eval_streams_the_new_families(built, run_cli, tmp_path, family):
    """The streamed eval (a decoder layer at a time) and --qa on a quantized output: the float side equals
    transformers' own model on the same tokens, so the report is about quantization alone."""
    q = tmp_path / "q"
    r = run_cli(["quantize", "-m", built[family], "-o", q, "--engine", "vllm-ascend", "--scheme", "w8a8_dynamic",
                 "--calib-samples", "4", "--seq-len", "32"])
    assert r.code == 0, r.err
    r = run_cli(["eval", "-m", built[family], "-q", q, "--samples", "2", "--seq-len", "64", "--qa",
                 "--max-new-tokens", "4", "--json"])
    assert r.code == 0, r.err
    report = json.loads(r.out)
    assert report["tokens"] == 128 and 0 < report["kl_divergence"] < 0.1 and report["top1_agreement"] > 0.5
    assert report["qa"]["questions"] > 0


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_qwen_mtp_block_carried_in_float(built, run_cli, tmp_path, family):
    """Qwen3-Next's and Qwen3.5's published checkpoints carry their MTP block as mtp.* (fc, norms, a full-attention
    MoE layer), which transformers never builds: dsconv counts it as MTP, requires all of it once any is there, and
    writes it float, every tensor described FLOAT."""
    from dsconv.tiny import add_mtp_layer

    d = tmp_path / family
    shutil.copytree(built[family], d)
    add_mtp_layer(d)
    ck = Checkpoint.open(d)
    mtp = sorted(n for n in ck.names() if n.startswith("mtp."))
    assert "mtp.fc.weight" in mtp and any(".mlp.experts." in n for n in mtp)
    assert all(ck.role(n).category.value == "mtp" for n in mtp) and ck.facts.num_mtp_layers == 1
    assert {n for _, n, _ in ck.family.iter_shapes(ck.facts) if n.startswith("mtp.")} == set(mtp)
    report = json.loads(run_cli(["inspect", "--model", d, "--json"]).out)
    assert report["categories"]["mtp"]["tensors"] == len(mtp)
    assert report["parameters"] - report["main_parameters"] == report["categories"]["mtp"]["parameters"]
    r = run_cli(["quantize", "-m", d, "-o", tmp_path / "q", "--engine", "vllm-ascend", "--bits", "8",
                 "--calib-samples", "4", "--seq-len", "32"])
    assert r.code == 0, r.err
    desc = json.loads((tmp_path / "q" / "quant_model_description.json").read_text())
    assert all(desc.get(n) == "FLOAT" for n in mtp)


def test_kimi_k2_remote_tokenizer_is_refused_with_the_way_out(built, run_cli, tmp_path):
    """Kimi-K2's real tokenizer is code (tokenizer_config.json auto_map -> tokenization_kimi.TikTokenTokenizer):
    calibration refuses it in one line, says why and how to get a tokenizer.json, and never runs it."""
    d = tmp_path / "kimi"
    shutil.copytree(built["kimi_k2"], d)
    (d / "tokenizer.json").unlink()
    (d / "tokenization_kimi.py").write_text("raise RuntimeError('remote code ran')\n")
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
         "tokenizer_class": "TikTokenTokenizer"}))
    r = run_cli(["quantize", "-m", d, "-o", tmp_path / "q", "--engine", "vllm-ascend", "--bits", "8"])
    assert r.code == 2 and "tokenizer is remote code" in r.err and "TikTokenConverter" in r.err
    assert "Traceback" not in r.err and not (tmp_path / "q").exists()


def test_qwen3_5_vision_language_checkpoint(built, run_cli, tmp_path):
    """Qwen3.5-MoE is published as a vision-language checkpoint: the text values under text_config, the text model
    under model.language_model.*, a vision tower under model.visual.*. The tower is counted (from vision_config alone
    as transformers builds it) and carried float with a FLOAT entry per tensor; the text model is quantized, its
    split DeltaNet projections each described (vLLM stacks them into in_proj_qkvz / in_proj_ba at load)."""
    cfg = json.loads((REAL / "qwen3.5-397b-a17b.json").read_text())
    report = json.loads(run_cli(["inspect", "--config", REAL / "qwen3.5-397b-a17b.json", "--json"]).out)
    assert report["categories"]["vision"]["parameters"] == 456_010_480  # 27 ViT blocks and the merger
    assert report["architecture"]["num_layers"] == 60 and report["architecture"]["num_mtp_layers"] == 1
    # 45 linear layers x (conv: (2 x 16 x 128 + 64 x 128) channels x 3 + recurrent 64 x 128 x 128) x 2 bytes
    assert report["state_bytes_per_sequence"] == 45 * ((2 * 16 * 128 + 64 * 128) * 3 + 64 * 128 * 128) * 2
    assert family_for(cfg).facts(cfg).hidden_size == 4096  # read from text_config
    ck = Checkpoint.open(built["qwen3_5_moe"])
    vision = [n for n in ck.names() if n.startswith("model.visual.")]
    assert vision and all(ck.role(n).category.value == "vision" for n in vision)
    q = tmp_path / "q"
    r = run_cli(["quantize", "-m", built["qwen3_5_moe"], "-o", q, "--engine", "vllm-ascend", "--scheme",
                 "w8a8_dynamic", "--calib-samples", "4", "--seq-len", "32"])
    assert r.code == 0, r.err
    desc = json.loads((q / "quant_model_description.json").read_text())
    assert all(desc[n] == "FLOAT" for n in vision)
    lin = "model.language_model.layers.0.linear_attn."
    assert {desc[lin + p + ".weight"] for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")} == \
        {"W8A8_DYNAMIC"}
    out = Checkpoint.open(q)
    assert json.loads((q / "config.json").read_text())["text_config"]["hidden_size"] == 64
    for n in vision:  # carried byte for byte
        assert torch.equal(out.load(n), ck.load(n))
