"""What MindIE's own loader showed dsconv must do (make engine-check, dsconv/engine_check/mindie_loader.py), each fix with
a test that fails without it. The rules and their MindIE-LLM sources are in dsconv/engines/profiles.py and the family
tables; docs/engine_check.md lists the findings."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

pytestmark = pytest.mark.cli

FAST = ["--calib-samples", "4", "--seq-len", "32"]


@pytest.fixture(scope="module")
def tok():
    from dsconv.bundled import calib_texts
    from dsconv.tiny import train_tokenizer

    return train_tokenizer(calib_texts(), vocab_size=384)


@pytest.fixture(scope="module")
def model(tmp_path_factory, tok):
    """family -> a tiny bf16 checkpoint with a tokenizer (cached); widths every group of 64 divides."""
    from dsconv.tiny import make_tiny

    cache: dict[tuple, Path] = {}

    def get(family: str, dtype: str = "bf16", **overrides) -> Path:
        key = (family, dtype, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_tiny(family, tmp_path_factory.mktemp(family) / "m", dtype=dtype, tokenizer=tok,
                                   **overrides)
        return cache[key]

    return get


def _dry(run_cli, src: Path, *args: str) -> dict:
    r = run_cli(["quantize", "-m", src, "--dry-run", "--json", *args])
    assert r.code == 0, r.err
    return json.loads(r.out)


def _dtype(d: Path, name: str) -> str:
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            if name in h.keys():
                return h.get_slice(name).get_dtype()
    raise KeyError(name)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("args,attn", [(["--scheme", "w8a8_dynamic"], "w8a8_dynamic"), (["--bits", "8"], "w8a8")])
def test_qwen_moe_attention_gets_its_own_region(family, args, attn, model, run_cli):
    """MindIE's Qwen-MoE reads attention with `attn_quantize`, and without it a w8a8_dynamic model's attention as
    static w8a8 ('weight ...q_proj.deq_scale does not exist'): dsconv always writes the key."""
    keys = _dry(run_cli, model(family), "--engine", "mindie", *args)["config_keys"]
    assert keys == {"quantize": attn, "attn_quantize": attn}
    assert "attn_quantize" not in _dry(run_cli, model(family), "--engine", "vllm-ascend", *args)["config_keys"]


def test_qwen3_moe_config_names_its_experts_as_mindie_reads(model, run_cli, tmp_path):
    """MindIE's Qwen2MoeConfig reads num_experts (default 60); transformers 5 writes num_local_experts."""
    src = model("qwen3_moe")
    assert "num_experts" not in json.loads((src / "config.json").read_text())
    out = tmp_path / "q"
    r = run_cli(["quantize", "-m", src, "-o", out, "--scheme", "w8a16", "--engine", "mindie"])
    assert r.code == 0, r.err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_experts"] == cfg["num_local_experts"] == 8


@pytest.mark.parametrize("args", [["--scheme", "w8a16"], ["--scheme", "w4a16", "--group-size", "0"]])
def test_deepseek_weight_only_shared_experts_are_refused_for_mindie(args, model, run_cli):
    """MindIE looks DeepSeek's shared-expert type up in a list without weight-only types (KeyError 'W8A16'): exit 2
    before any work, naming the rule, its source and the ways out; keeping them float loads."""
    src = model("deepseek_v3")
    r = run_cli(["quantize", "-m", src, "--engine", "mindie", *args, "--dry-run"])
    assert r.code == 2 and "shared_experts layers" in r.err and "weight_loader.py::get_linear_quant_type" in r.err
    assert "--ignore 'shared_expert'" in r.err and "--scheme w4a8_dynamic | w8a8 | w8a8_dynamic" in r.err
    dry = _dry(run_cli, src, "--engine", "mindie", *args, "--ignore", "shared_experts")
    assert set(dry["layer_types"]["shared_experts"]) == {"FLOAT"}


def test_mixtral_runs_in_fp16_on_mindie_so_deq_scale_is_the_int64_word(model, run_cli, tmp_path):
    """MindIE runs Mixtral in float16 whatever the checkpoint and casts a float32 deq_scale to it (experts'
    down_proj up to 8% off): for MindIE dsconv writes the int64 word even from a bf16 source; vLLM keeps float32."""
    src = model("mixtral")
    for engine, want in (("mindie", "I64"), ("vllm-ascend", "F32")):
        out = tmp_path / engine
        r = run_cli(["quantize", "-m", src, "-o", out, "--bits", "8", "--engine", engine, *FAST])
        assert r.code == 0, r.err
        assert _dtype(out, "model.layers.0.self_attn.o_proj.deq_scale") == want


def test_w4a16_group_sizes_mindie_does_not_run_are_refused(model, run_cli):
    """BaseConfig.__check_group_size: 0, 64, 128 or 256 (NotImplementedError otherwise)."""
    src = model("llama", intermediate_size=256, head_dim=64)
    r = run_cli(["quantize", "-m", src, "--engine", "mindie", "--bits", "4", "--group-size", "32", "--dry-run"])
    assert r.code == 2 and "BaseConfig.__check_group_size" in r.err and "--group-size 0 | 64" in r.err, r.err
    assert _dry(run_cli, src, "--engine", "mindie", "--bits", "4", "--group-size", "64")["scheme"] == "W4A16"


def test_float32_source_is_refused_for_mindie(model, run_cli):
    """ModelRunner takes torch_dtype float16 / bfloat16 only: a float32 checkpoint's output would not start."""
    src = model("llama", dtype="fp32")
    r = run_cli(["quantize", "-m", src, "--engine", "mindie", "--scheme", "w8a16", "--dry-run"])
    assert r.code == 2 and "ModelRunner.__init__" in r.err and "--dtype bf16 or fp16" in r.err, r.err
    assert run_cli(["quantize", "-m", src, "--engine", "vllm-ascend", "--scheme", "w8a16", "--dry-run"]).code == 0


def test_tokenizer_config_is_written_as_mindies_transformers_reads_it(model, run_cli, tmp_path):
    """transformers 5 saves tokenizer_class TokenizersBackend and a list under extra_special_tokens; MindIE's
    transformers 4.57 knows neither (AutoTokenizer fails): its output carries PreTrainedTokenizerFast and
    additional_special_tokens, nothing else changed; vLLM-Ascend's output keeps the file as it was."""
    src = model("llama")
    text = (src / "tokenizer_config.json").read_text()
    assert '"TokenizersBackend"' in text
    doc = json.loads(text)
    doc["extra_special_tokens"] = ["<|x|>"]
    (src / "tokenizer_config.json").write_text(json.dumps(doc, indent=2))
    outs = {}
    for engine in ("mindie", "vllm-ascend"):
        outs[engine] = tmp_path / engine
        r = run_cli(["quantize", "-m", src, "-o", outs[engine], "--scheme", "w8a16", "--engine", engine])
        assert r.code == 0, r.err
    got = json.loads((outs["mindie"] / "tokenizer_config.json").read_text())
    assert got["tokenizer_class"] == "PreTrainedTokenizerFast" and got["additional_special_tokens"] == ["<|x|>"]
    assert "extra_special_tokens" not in got
    assert {k: v for k, v in got.items() if k not in ("tokenizer_class", "additional_special_tokens")} == \
        {k: v for k, v in doc.items() if k not in ("tokenizer_class", "extra_special_tokens")}
    assert (outs["vllm-ascend"] / "tokenizer_config.json").read_text() == json.dumps(doc, indent=2)


def test_qwen2_moe_shared_expert_stays_float_for_mindie(model, run_cli):
    """MindIE's Qwen2-MoE graph is handed only the shared expert's weights, no scales: float for MindIE."""
    for engine in ("mindie", "vllm-ascend"):
        types = set(_dry(run_cli, model("qwen2_moe"), "--engine", engine, "--bits", "8")["layer_types"]
                    ["shared_experts"])
        assert (types == {"FLOAT"}) == (engine == "mindie"), (engine, types)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_qwen_moe_w4a8_experts_are_refused_for_mindie(family, model, run_cli):
    """MindIE's Qwen-MoE layer builds no W4A8 MLP pack (AssertionError 'PackType.ALL_W4A8 not supported')."""
    r = run_cli(["quantize", "-m", model(family), "--engine", "mindie", "--bits", "4", "--scheme", "w4a8_dynamic",
                 "--dry-run"])
    assert r.code == 2 and "routed_experts" in r.err and ("modeling_qwen2_moe.py" in r.err or "region" in r.err)


def test_shard_refuses_a_tp_leaving_mindie_one_int4_group_per_rank(model, run_cli, tmp_path):
    """A row-parallel W4A16 layer whose rank keeps one group column is read by MindIE as per-channel int4: `dsconv
    shard --engine mindie` rejects that tp (exit 3, with layouts that work); vLLM-Ascend has no such rule."""
    src = model("llama", intermediate_size=128, head_dim=64)
    q = tmp_path / "q"
    r = run_cli(["quantize", "-m", src, "-o", q, "--bits", "4", "--group-size", "64", "--method", "rtn",
                 "--engine", "mindie"])
    assert r.code == 0, r.err
    r = run_cli(["shard", "-m", q, "--tp", "2", "--engine", "mindie", "--format", "plan", "--dry-run"])
    assert r.code == 3 and "down_proj" in r.out + r.err and "W4A16LinearStatic" in r.out + r.err, r.out + r.err
    assert run_cli(["shard", "-m", q, "--tp", "2", "--engine", "vllm-ascend", "--format", "plan",
                    "--dry-run"]).code == 0
