"""`quantize --dtype bf16|fp16`: a float32 checkpoint for MindIE in one step, byte for byte the two-step way's
(`export --format safetensors --dtype`, then `quantize`); loaded by both engines in `make engine-check` (dtype "fp32"
rows)."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.cli
FAST = ["--bits", "8", "--calib-samples", "8", "--seq-len", "32"]


@pytest.fixture(scope="module")
def fp32_qwen2(tmp_path_factory):
    from dsconv.bundled import calib_texts
    from dsconv.tiny import make_tiny, train_tokenizer

    # qwen2: q/k/v biases, which the cast must carry too
    return make_tiny("qwen2", tmp_path_factory.mktemp("f32") / "qwen2",
                     tokenizer=train_tokenizer(calib_texts(), vocab_size=384))


def test_float32_is_refused_for_mindie_with_the_one_step_way(fp32_qwen2, run_cli, tmp_path):
    r = run_cli(["quantize", "-m", fp32_qwen2, "-o", tmp_path / "q", *FAST])
    assert r.code == 2 and "model dtype fp32" in r.err and "add --dtype bf16 or fp16" in r.err, r.err
    assert not (tmp_path / "q").exists()


def test_dtype_equals_export_then_quantize(fp32_qwen2, run_cli, tmp_path):
    one = tmp_path / "one"
    r = run_cli(["quantize", "-m", fp32_qwen2, "-o", one, *FAST, "--dtype", "bf16"])
    assert r.code == 0, r.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one"]  # no scratch left
    assert run_cli(["export", "-m", fp32_qwen2, "-o", tmp_path / "bf16", "--format", "safetensors",
                    "--dtype", "bf16"]).code == 0
    assert run_cli(["quantize", "-m", tmp_path / "bf16", "-o", tmp_path / "two", *FAST]).code == 0
    for f in ("quant_model_weights.safetensors", "quant_model_description.json", "config.json"):
        assert (one / f).read_bytes() == (tmp_path / "two" / f).read_bytes(), f
    config = json.loads((one / "config.json").read_text())
    assert "bfloat16" in (config.get("dtype"), config.get("torch_dtype"))
    manifest = json.loads((one / "dsconv_manifest.json").read_text())
    assert manifest["inputs"] == [str(fp32_qwen2)] and manifest["options"]["dtype"] == "bf16"
    assert run_cli(["verify", one]).code == 0


def test_dtype_refusals(fp32_qwen2, run_cli, tmp_path):
    r = run_cli(["quantize", "-m", fp32_qwen2, "-o", tmp_path / "q", *FAST, "--dtype", "bf16", "--rotate"])
    assert r.code == 2 and "--dtype and --rotate" in r.err, r.err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
