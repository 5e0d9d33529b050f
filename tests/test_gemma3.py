"""Gemma 3 end to end on a tiny gemma3_text built by transformers (one sliding layer with window 4, one full layer,
query_pre_attn_scalar != head_dim, final-logit softcapping): inspect, the layer-by-layer runner quantize uses,
ONNX with a KV cache, MindIR, quantize + eval, shard. The plain fp32 ONNX and MindIR parity runs in the
every-family tests (tests/test_export_onnx.py, tests/test_mindir.py)."""
from __future__ import annotations

import json

import pytest
import torch

from dsconv.checkpoint import Checkpoint
from dsconv.inspect import inspect_model
from dsconv.tiny import build_model

pytestmark = [pytest.mark.cli]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """A bf16 tiny Gemma 3 with the bundled tokenizer (quantize calibrates and eval scores text)."""
    from dsconv.demo import calib_texts
    from dsconv.tiny import make_tiny, train_tokenizer

    root = tmp_path_factory.mktemp("gemma3")
    tok = train_tokenizer(calib_texts(), vocab_size=384)
    return make_tiny("gemma3", root / "model", dtype="bf16", tokenizer=tok)


def test_inspect_counts_equal_transformers(gemma, run_cli):
    cfg = json.loads((gemma / "config.json").read_text())
    model = build_model("gemma3", vocab_size=cfg["vocab_size"])
    report = inspect_model(Checkpoint.open(gemma))
    assert report["family"] == "gemma3"
    assert report["parameters"] == sum(p.numel() for p in model.parameters())
    cats = report["categories"]
    assert "lm_head" not in cats  # tied: the embedding is counted once
    # 6 norms per layer (input, post-attention, pre/post-feedforward, q, k) + the final norm
    assert cats["norms"]["tensors"] == 6 * cfg["num_hidden_layers"] + 1
    assert cats["norms"]["parameters"] == sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    r = run_cli(["inspect", "--config", gemma / "config.json", "--json"])
    assert r.code == 0, r.err
    assert json.loads(r.out)["parameters"] == report["parameters"]


def test_layer_runner_reproduces_transformers(gemma):
    """quantize's runner (embedding rows, one decoder layer at a time) gives transformers' hidden states: the
    embedding scale, the sliding mask of layer 0 and each layer type's rotary table all matter here."""
    from transformers import AutoModelForCausalLM

    from dsconv.runner.layers import Skeleton

    ck = Checkpoint.open(gemma)
    ref = AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.randint(0, ck.facts.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(input_ids=ids, output_hidden_states=True).hidden_states
        sk = Skeleton(ck)
        x = sk.embed(ids)
        assert torch.allclose(x, want[0], atol=1e-5)
        for i in range(sk.num_layers):
            layer = sk.materialise(i)
            x = layer(x, **sk.layer_inputs(x, layer))
            x = x[0] if isinstance(x, tuple) else x
            sk.release(i)
            if i < sk.num_layers - 1:  # the last hidden state transformers reports is after the final norm
                assert torch.allclose(x, want[i + 1], atol=1e-4), i
        # a sliding layer run with the full mask (or the global rope base) would differ
        layer = sk.materialise(0)
        wrong = {**sk.layer_inputs(want[0], layer), **{"attention_mask": sk.layer_inputs(want[0], sk.layers[1])[
            "attention_mask"]}}
        y = layer(want[0], **wrong)
        assert not torch.allclose(y[0] if isinstance(y, tuple) else y, want[1], atol=1e-3)


def test_onnx_with_past_matches_transformers(gemma, tmp_path):
    """KV-cache graph: the sliding layer's cache keeps every position (the mask applies the window), so past +
    new tokens beyond the window still give transformers' logits."""
    from dsconv.convert.onnx import export_onnx

    s = export_onnx(gemma, tmp_path / "o", with_past=True)
    assert s["check"]["passed"] and s["check"]["worst"]["max_abs_err"] < 1e-4
    assert any(c["past"] + c["tokens"] > 4 for c in s["check"]["cases"])


def test_mindir_bf16_and_weight_only_quantized(gemma, tmp_path, run_cli):
    """bf16 export (offset norms stored bf16) and a W8A16 quantized Gemma both pass the check against PyTorch."""
    r = run_cli(["export", "-m", gemma, "-o", tmp_path / "bf16", "--format", "mindir", "--dtype", "bf16", "--json"])
    assert r.code == 0, r.err
    check = json.loads(r.out)["check"]
    assert check["passed"] and check["max_abs_err"] < 1e-3
    r = run_cli(["quantize", "-m", gemma, "-o", tmp_path / "q", "--scheme", "w8a16", "--engine", "vllm-ascend"])
    assert r.code == 0, r.err
    r = run_cli(["export", "-m", tmp_path / "q", "-o", tmp_path / "qm", "--format", "mindir", "--json"])
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert out["check"]["passed"] and out["linear_weights"] == {"W8A16": 14}


@pytest.mark.parametrize("scheme,ppl_pct,top1", [("w8a16", 0.5, 0.9), ("w8a8", 3.0, 0.8)])
def test_quantize_and_eval_round_trip(gemma, tmp_path, run_cli, scheme, ppl_pct, top1):
    args = ["--scheme", scheme] + (["--calib-samples", "8"] if scheme == "w8a8" else [])
    r = run_cli(["quantize", "-m", gemma, "-o", tmp_path / "q", *args, "--engine", "vllm-ascend"])
    assert r.code == 0, r.err
    desc = json.loads((tmp_path / "q" / "quant_model_description.json").read_text())
    assert desc["model_quant_type"] == scheme.upper()
    assert desc["model.layers.0.mlp.gate_proj.weight"] == scheme.upper()
    assert desc["model.layers.1.self_attn.q_norm.weight"] == "FLOAT"
    assert desc["model.layers.0.pre_feedforward_layernorm.weight"] == "FLOAT"
    r = run_cli(["eval", "-m", gemma, "-q", tmp_path / "q", "--samples", "6", "--seq-len", "48", "--json"])
    assert r.code == 0, r.err
    res = json.loads(r.out)
    # static W8A8's mixed recipe under vLLM-Ascend (MindIE has no Gemma model): the 2 down_proj per-token dynamic
    # (dsconv/quant/plan/recipe.py)
    assert res["linears"] == ({"W8A8": 12, "W8A8_DYNAMIC": 2} if scheme == "w8a8" else {scheme.upper(): 14})
    assert abs(res["ppl_change_pct"]) < ppl_pct and res["top1_agreement"] > top1, res
    assert 0 < res["logits_mean_abs_error"]


def test_shard_dry_run_and_write(gemma, tmp_path, run_cli):
    from safetensors import safe_open

    r = run_cli(["shard", "-m", gemma, "-o", tmp_path / "plan", "--tp", "2", "--dry-run", "--json", "--engine",
                 "vllm-ascend"])
    assert r.code == 0, r.err
    assert not (tmp_path / "plan").exists()
    r = run_cli(["shard", "-m", gemma, "-o", tmp_path / "s", "--tp", "2", "--format", "ranks", "--engine",
                 "vllm-ascend"])
    assert r.code == 0, r.err
    ck = Checkpoint.open(gemma)
    ranks = [safe_open(str(tmp_path / "s" / f"rank_0{i}" / "model.safetensors"), "pt") for i in range(2)]
    for name in ck.tensors:
        parts = [f.get_tensor(name) for f in ranks]
        whole = ck.load(name)
        dim = ck.role(name).role.tp_dim
        if dim is None:  # norms (the sandwich and q/k ones) are replicated
            assert all(torch.equal(p, whole) for p in parts), name
        else:
            assert torch.equal(torch.cat(parts, dim), whole), name
    assert ck.role("model.layers.0.post_feedforward_layernorm.weight").role.tp_dim is None
    assert ck.role("model.layers.0.self_attn.o_proj.weight").role.tp_dim == 1


def test_unsupported_activation_is_a_user_error(tiny_model, tmp_path, run_cli):
    d = tiny_model("gemma3", hidden_activation="relu")
    r = run_cli(["export", "-m", d, "-o", tmp_path / "m", "--format", "mindir"])
    assert r.code == 2 and "hidden_activation 'relu'" in r.err
    assert not (tmp_path / "m").exists()
