"""`quantize --scheme w8a8_mix` (PD-mix, docs/formats/w8a8_mix.md): msModelSlim's seven tensors per linear over one
int8 weight, routed experts W8A8_DYNAMIC, the engines' refusals, `verify` holding the two paths together, `eval`
computing each path, and `inspect` / `shard` sizing it. The engines' own loaders take it in `make engine-check`."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from dsconv.checkpoint import Checkpoint
from dsconv.qformat import deq_scale_from_int64
from dsconv.quant.evaluate.engine_linear import EngineLinear
from dsconv.quant.formats.msmodelslim import read_linear

pytestmark = [pytest.mark.cli]
MIX = ["--scheme", "w8a8_mix", "--calib-samples", "8", "--seq-len", "64"]
# msModelSlim's order and dtypes (save/ascendv1.py::AscendV1Saver.on_w8a8_pd_mix), for a bf16 model
SEVEN = [("weight", "I8"), ("quant_bias", "I32"), ("input_scale", "F32"), ("input_offset", "F32"),
         ("deq_scale", "F32"), ("weight_scale", "F32"), ("weight_offset", "F32")]


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an output directory, in file order (by data offset)."""
    import struct

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        raw = f.read_bytes()
        header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
        order = sorted((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")
        with safe_open(str(f), "pt") as s:
            out.update({k: s.get_tensor(k) for _, k in order})
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """`source(family, dtype)`: a tiny checkpoint with a tokenizer (calibration and eval need one), cached."""
    from tests.engine_check.cases import build_source, tokenizer

    root, tok = tmp_path_factory.mktemp("mix-src"), tokenizer()
    return lambda family, dtype="bf16": build_source(root, family, dtype, "per-expert", tok)


@pytest.fixture(scope="module")
def mix_out(source, run_cli, tmp_path_factory):
    """A bf16 Qwen2 (biased q/k/v) for vLLM-Ascend: the mixed recipe keeps down_proj W8A8_DYNAMIC."""
    out = tmp_path_factory.mktemp("mix") / "q"
    src = source("qwen2")
    r = run_cli(["quantize", "-m", str(src), "-o", str(out), *MIX, "--engine", "vllm-ascend"])
    assert r.code == 0, r.err
    return src, out


def test_every_linear_has_msmodelslims_seven_tensors(mix_out):
    _, out = mix_out
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert desc["model_quant_type"] == "W8A8_MIX" and desc["version"] == "1.0.0"
    t = _tensors(out)
    mix = sorted(k[:-len(".weight")] for k, v in desc.items() if k.endswith(".weight") and v == "W8A8_MIX")
    assert len(mix) == 2 * 6  # q, k, v, o, gate, up of both layers; down_proj is dynamic (--recipe mixed)
    assert {desc[k] for k in desc if k.endswith("down_proj.weight")} == {"W8A8_DYNAMIC"}
    for P in mix:
        names = [k for k in t if k.startswith(P + ".")]
        have = [(k[len(P) + 1:], st) for k in names for st in [{torch.int8: "I8", torch.int32: "I32",
                                                                   torch.float32: "F32"}.get(t[k].dtype)]]
        assert [h for h in have if h[0] != "bias"] == SEVEN, P  # in this order in the file
        n, k = t[P + ".weight"].shape
        assert t[P + ".input_scale"].shape == (1,) and t[P + ".input_offset"].shape == (1,)
        assert t[P + ".weight_scale"].shape == (n, 1) and t[P + ".weight_offset"].shape == (n, 1)
        assert t[P + ".deq_scale"].shape == (n,) and t[P + ".quant_bias"].shape == (n,)
        assert all(desc[x] == ("FLOAT" if x.endswith(".bias") else "W8A8_MIX") for x in names)  # as msModelSlim
        # one weight for both paths: deq_scale is input_scale * weight_scale in float32
        want = (t[P + ".input_scale"] * t[P + ".weight_scale"].reshape(-1)).to(torch.float32)
        assert torch.equal(t[P + ".deq_scale"], want)
        assert not t[P + ".weight_offset"].any()
    assert any(x.endswith("q_proj.bias") for x in t)  # Qwen2's q/k/v biases: quant_bias (static), bias (dynamic)
    # fused shards share one activation range (vLLM-Ascend keeps one input_scale per qkv / gate_up)
    for layer in (0, 1):
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            mods = [f"model.layers.{layer}.{'self_attn' if 'proj' in group[0] and group[0][0] in 'qkv' else 'mlp'}"
                    f".{g}" for g in group]
            assert len({float(t[m + ".input_scale"]) for m in mods}) == 1, mods
            assert len({float(t[m + ".input_offset"]) for m in mods}) == 1, mods
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and "quantize" not in cfg  # vLLM-Ascend reads the description


def test_verify_holds_the_two_paths_together(mix_out, run_cli, tmp_path):
    import shutil

    from safetensors.torch import save_file

    _, out = mix_out
    assert run_cli(["verify", str(out)]).code == 0
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    f = sorted(bad.glob("*.safetensors"))[0]
    t = _tensors(bad)
    P = "model.layers.0.self_attn.o_proj"
    t[P + ".weight_scale"] = t[P + ".weight_scale"] * 2  # the prefill path now computes another model
    save_file({k: v for k, v in t.items()}, str(f), metadata={"format": "pt"})
    for g in sorted(bad.glob("*.safetensors"))[1:]:
        g.unlink()
    idx = bad / "quant_model_weights.safetensors.index.json"
    if idx.exists():
        idx.unlink()
    (bad / "dsconv_manifest.json").unlink()  # the byte-level manifest check would stop at the rewritten file
    from dsconv.quant.formats.msmodelslim import verify_output

    problems = verify_output(bad)
    assert any(p.startswith(f"{P}: deq_scale (decode path) differs") for p in problems), problems


def test_engine_linear_runs_each_path_as_its_own_type(mix_out):
    _, out = mix_out
    ck = Checkpoint.open(out)
    P = "model.layers.0.self_attn.q_proj"
    ql = read_linear(ck, P, "W8A8_MIX")
    x = torch.randn(5, ql.q.shape[1]) * 3
    static, dynamic = EngineLinear(ql, "static"), EngineLinear(ql, "dynamic")
    assert static.qtype == "W8A8" and dynamic.qtype == "W8A8_DYNAMIC"
    # static: (x_q @ w_q^T + quant_bias) * deq_scale from the stored activation range
    from dsconv.quant.algorithms.schemes import quantize_activation

    xq = quantize_activation(x, ql.input_scale, ql.input_offset).float()
    want = (xq @ torch.from_numpy(ql.q.astype(np.float32)).T + torch.from_numpy(ql.quant_bias.astype(np.float32))) \
        * torch.from_numpy(ql.deq_scale)
    assert torch.allclose(static(x), want, rtol=1e-5, atol=1e-6)
    # the two paths differ in activations only: same weight
    assert torch.allclose(static.w, dynamic.w, rtol=1e-6, atol=0)
    assert not torch.equal(static(x), dynamic(x))


def test_moe_experts_are_dynamic_and_mindie_refuses_moe(source, run_cli, tmp_path):
    out = tmp_path / "moe"
    r = run_cli(["quantize", "-m", str(source("qwen3_moe")), "-o", str(out), *MIX,
                 "--engine", "vllm-ascend"])
    assert r.code == 0, r.err
    desc = json.loads((out / "quant_model_description.json").read_text())
    experts = {v for k, v in desc.items() if ".experts." in k and k.endswith(".weight")}
    attn = {v for k, v in desc.items() if "self_attn" in k and k.endswith("proj.weight")}
    assert experts == {"W8A8_DYNAMIC"} and attn == {"W8A8_MIX"} and desc["model_quant_type"] == "W8A8_MIX"
    assert not any(k.startswith("model.layers.0.mlp.experts.0.") and k.endswith("input_scale") for k in desc)
    for fam in ("qwen3_moe", "deepseek_v3", "mixtral"):
        r = run_cli(["quantize", "-m", str(source(fam)), "-o", str(tmp_path / fam), *MIX,
                     "--engine", "mindie"])
        assert r.code == 2 and "cannot have W8A8_MIX" in r.err and "flash_causal_llama.py" in r.err, r.err
        assert "--engine vllm-ascend" in r.err and not (tmp_path / fam).exists()


def test_mindie_dense_gets_quantize_and_fp16_gets_int64_deq_scale(source, run_cli, tmp_path):
    out = tmp_path / "m"
    r = run_cli(["quantize", "-m", str(source("llama", "fp16")), "-o", str(out), *MIX, "--engine",
                 "mindie"])
    assert r.code == 0, r.err
    cfg = json.loads((out / "config.json").read_text())
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert cfg["quantize"] == "w8a8_mix" and desc["model_quant_type"] == "W8A8_MIX"
    assert {desc[k] for k in desc if k.endswith("down_proj.weight")} == {"FLOAT"}  # one type per MindIE region
    t = _tensors(out)
    P = "model.layers.1.mlp.up_proj"
    assert t[P + ".deq_scale"].dtype == torch.int64
    deq = deq_scale_from_int64(t[P + ".deq_scale"].numpy())
    assert np.array_equal(deq, (t[P + ".input_scale"].numpy() * t[P + ".weight_scale"].numpy().reshape(-1))
                          .astype(np.float32))


def test_eval_reports_both_paths_and_gates_on_each(mix_out, run_cli):
    src, out = mix_out
    r = run_cli(["eval", "-m", str(src), "-q", str(out), "--seq-len", "64", "--samples", "2", "--json"])
    assert r.code == 0, r.err
    res = json.loads(r.out)
    assert set(res["paths"]) == {"static", "dynamic"} and res["path"] == "static"
    assert res["ppl_quantized"] == res["paths"]["static"]["ppl_quantized"]
    assert res["paths"]["static"]["kl_divergence"] != res["paths"]["dynamic"]["kl_divergence"]
    r = run_cli(["eval", "-m", str(src), "-q", str(out), "--seq-len", "64", "--samples", "2"])
    assert "W8A8_MIX static path (decode instance, kv_consumer)" in r.out and "dynamic path" in r.out


def test_both_paths_share_one_float_pass_and_equal_a_pass_each(mix_out, monkeypatch):
    """eval of a W8A8_MIX output runs the float model's layers once for both paths (`run_passes`), and each path's
    per-position results equal a pass of its own to the last bit."""
    from dsconv.quant.evaluate.fidelity import eval_chunks
    from dsconv.quant.evaluate.streamed import StreamedModel, run_pass, run_passes

    src, out = mix_out
    ck, qck = Checkpoint.open(src), Checkpoint.open(out)
    chunks, _ = eval_chunks(ck, None, 64, 3)
    orig = StreamedModel(ck, False)
    opened: list[int] = []
    layer = orig.layer
    monkeypatch.setattr(orig, "layer", lambda i: opened.append(i) or layer(i))
    both = run_passes(orig, [StreamedModel(qck, True, p) for p in ("static", "dynamic")], chunks, 4096,
                      progress=False)
    assert opened == list(range(orig.sk.num_layers))
    for path, got in zip(("static", "dynamic"), both):
        alone = run_pass(StreamedModel(ck, False), StreamedModel(qck, True, path), chunks, 4096, progress=False)
        for k in ("seq", "pos", "arg_o", "arg_q", "nll_o", "nll_q", "kl"):
            assert np.array_equal(getattr(got, k), getattr(alone, k), equal_nan=True), (path, k)
    assert not np.array_equal(both[0].kl, both[1].kl)


def test_eval_split_over_workers_gives_each_path_the_one_process_figures(mix_out, run_cli):
    src, out = mix_out
    args = ["eval", "-m", str(src), "-q", str(out), "--seq-len", "64", "--samples", "3", "--json"]
    one, two = (run_cli([*args, "--workers", w]) for w in ("1", "2"))
    assert one.code == 0 and two.code == 0, one.err + two.err
    p1, p2 = json.loads(one.out)["paths"], json.loads(two.out)["paths"]
    assert set(p1) == set(p2) == {"static", "dynamic"}
    for path in p1:  # equal to float rounding: only the batches' composition differs
        for k in ("tokens", "predicted_tokens", "ppl_original", "ppl_quantized", "kl_divergence", "top1_agreement"):
            assert p2[path][k] == pytest.approx(p1[path][k], rel=2e-4, abs=2e-6), (path, k)
    assert p1["static"]["kl_divergence"] != p1["dynamic"]["kl_divergence"]


def test_the_ppl_gate_holds_every_path():
    from dsconv.quant.evaluate.stage import ppl_failures

    res = {"ppl_change_pct": 0.1, "paths": {"static": {"ppl_change_pct": 0.1}, "dynamic": {"ppl_change_pct": 0.9}}}
    assert ppl_failures(res, 0.5) == ["perplexity rose 0.900% on the dynamic path (limit 0.5%)"]
    assert ppl_failures(res, 1.0) == [] and ppl_failures({"ppl_change_pct": 0.6}, 0.5)


def test_inspect_and_shard_size_it(source, run_cli, tmp_path):
    src = source("deepseek_v3")
    r = run_cli(["inspect", "-m", str(src), "--json"])
    assert r.code == 0, r.err
    rep = json.loads(r.out)
    mix = rep["w8a8_mix"]
    assert mix["engines"]["vllm-ascend"].startswith("loads") and mix["engines"]["mindie"].startswith("refused")
    assert rep["cards"]["Ascend910B"]["w8a8_mix"]["weight_bytes"] == mix["weight_bytes"]
    # what quantize writes: the vLLM-Ascend output's bytes (kv_b and the rest at 16 bits) within the headers
    out = tmp_path / "ds"
    r = run_cli(["quantize", "-m", str(src), "-o", str(out), *MIX, "--engine", "vllm-ascend"])
    assert r.code == 0, r.err
    written = sum(i.nbytes for i in Checkpoint.open(out).tensors.values())
    assert abs(written - mix["weight_bytes"]) <= 0.02 * written, (written, mix["weight_bytes"])
    # shard --config --scheme plans the same tensors quantize wrote
    r = run_cli(["shard", "--config", str(src / "config.json"), "--scheme", "w8a8_mix", "--engine", "vllm-ascend",
                 "--tp", "2", "--ep", "1", "--dry-run", "--json"])
    assert r.code == 0, r.err
    plan = json.loads(r.out)
    held = Checkpoint.open(out).tensors
    # (a config alone does not say the routing bias is bf16 here: a real DeepSeek config's is float32, 64 bytes)
    assert plan["tensor_count"] == len(held) and abs(plan["total_bytes"] - written) <= 64
    from dsconv.quant.stage import planned_output

    specs, desc = planned_output(Checkpoint.open(src), "w8a8_mix", "vllm-ascend")
    assert {s.name: (s.dtype, tuple(s.shape)) for s in specs} == {n: (i.dtype, tuple(i.shape))
                                                                  for n, i in held.items()}


def test_dry_run_says_who_runs_which_path(source, run_cli):
    r = run_cli(["quantize", "-m", str(source("qwen2")), *MIX, "--engine", "vllm-ascend", "--dry-run"])
    assert r.code == 0, r.err
    assert "W8A8_MIX runs static W8A8 on decode instances (vLLM-Ascend: kv_role kv_consumer or kv_both" in r.out
    r = run_cli(["quantize", "-m", str(source("qwen2")), "--scheme", "w8a8", "--engine", "vllm-ascend", "--dry-run"])
    assert r.code == 0 and "W8A8_MIX" not in r.out
