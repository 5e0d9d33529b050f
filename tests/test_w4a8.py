"""`quantize --scheme w4a8_dynamic`: the recipe, its refusals (exit 2 with the engine's rule), both quantization
paths (streamed round-to-nearest, calibrated GPTQ) agreeing with the format, `dsconv eval`'s A8W4 kernel
simulation, and `inspect`'s W4A8 sizing of DeepSeek-R1."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dsconv.checkpoint import Checkpoint
from dsconv.qformat import scale_bias, scale_bias_sums, unpack_int4
from dsconv.quant.formats.msmodelslim import QuantLinear
from dsconv.quant.evaluate.fidelity import EngineLinear
from dsconv.quant.algorithms.fake_quant import fake_quant_int8_rows

pytestmark = [pytest.mark.cli]
W4 = ["--bits", "4", "--scheme", "w4a8_dynamic"]
DATA = Path(__file__).parent / "data"


def test_dense_family_is_refused_with_the_rule(tiny_model, run_cli, tmp_path):
    r = run_cli(["quantize", "-m", str(tiny_model("llama")), "-o", str(tmp_path / "o"), *W4, "--engine",
                 "vllm-ascend"])
    assert r.code == 2 and "has none" in r.err and "get_pergroup_param" in r.err
    assert "Traceback" not in r.err and not (tmp_path / "o").exists()


def test_group_size_is_refused(tiny_model, run_cli, tmp_path):
    r = run_cli(["quantize", "-m", str(tiny_model("qwen3_moe")), "-o", str(tmp_path / "o"), *W4,
                 "--group-size", "16", "--engine", "vllm-ascend"])
    assert r.code == 2 and "per channel" in r.err


def test_mindie_refuses_w4a8_where_one_region_holds_every_kind(tiny_model, run_cli, tmp_path):
    r = run_cli(["quantize", "-m", str(tiny_model("mixtral", dtype="bf16")), "-o", str(tmp_path / "o"), *W4,
                 "--engine", "mindie"])
    assert r.code == 2 and "one quantized type per region" in r.err and "vllm-ascend" in r.err
    r = run_cli(["quantize", "-m", str(tiny_model("qwen3_moe", dtype="bf16")), "-o", str(tmp_path / "o"), *W4,
                 "--engine", "mindie"])  # attention has its own region there, but no W4A8 MoE pack
    assert r.code == 2 and "PackType.ALL_W4A8" in r.err and "vllm-ascend" in r.err


def test_vllm_refuses_static_shared_experts_beside_w4a8(tiny_model, run_cli, tmp_path):
    r = run_cli(["quantize", "-m", str(tiny_model("qwen2_moe")), "-o", str(tmp_path / "o"), "--scheme", "w8a16",
                 "--moe-scheme", "w4a8_dynamic", "--engine", "vllm-ascend"])
    assert r.code == 2 and "shared experts" in r.err and "fused_moe.py" in r.err


def test_dry_run_shows_the_recipe_per_kind(tiny_model, run_cli):
    r = run_cli(["quantize", "-m", str(tiny_model("deepseek_v3", dtype="bf16")), *W4, "--dry-run", "--json"])
    assert r.code == 0, r.err
    s = json.loads(r.out)
    kinds = {k: set(v) for k, v in s["layer_types"].items()}
    assert kinds == {"attention": {"W8A8_DYNAMIC"}, "kv_b": {"FLOAT"}, "dense_mlp": {"W8A8_DYNAMIC"},
                     "shared_experts": {"W8A8_DYNAMIC"}, "routed_experts": {"W4A8_DYNAMIC"}}
    assert s["config_keys"] == {"quantize": "w8a8_dynamic", "mla_quantize": "w8a8_dynamic",
                                "moe_quantize": "w4a8_dynamic"}


def _w4a8_linears(d: Path) -> dict[str, dict[str, np.ndarray]]:
    from safetensors import safe_open

    t: dict[str, np.ndarray] = {}
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            t.update({k: sf.get_tensor(k).numpy() for k in sf.keys() if sf.get_slice(k).get_dtype() != "BF16"})
    desc = json.loads((d / "quant_model_description.json").read_text())
    return {n[:-7]: {s: t[n[:-7] + s] for s in (".weight", ".weight_scale", ".scale_bias")}
            for n, v in desc.items() if v == "W4A8_DYNAMIC" and n.endswith(".weight") and n in t}


def test_gptq_path_writes_consistent_scale_bias(tiny_model, run_cli, tmp_path):
    """The calibrated path keeps q whole (scale_bias from it), the streamed path sums row blocks: both must give
    8 * s * sum(q); GPTQ must actually change some values against round-to-nearest."""
    from dsconv.bundled import calib_texts
    from dsconv.tiny import make_tiny, train_tokenizer

    src = make_tiny("qwen3_moe", tmp_path / "m", dtype="bf16", tokenizer=train_tokenizer(calib_texts(), 384))
    outs = {}
    for method in ("rtn", "gptq"):
        r = run_cli(["quantize", "-m", str(src), "-o", str(tmp_path / method), *W4, "--engine", "vllm-ascend",
                     "--method", method, "--calib-samples", "16", "--seq-len", "48"])
        assert r.code == 0, r.err
        outs[method] = _w4a8_linears(tmp_path / method)
    differ = 0
    for method, lin in outs.items():
        for P, t in lin.items():
            q = unpack_int4(t[".weight"], t[".weight"].shape[0] * 2)
            chunks = t[".scale_bias"].shape[1]
            assert np.array_equal(t[".scale_bias"], scale_bias(scale_bias_sums(q, chunks), t[".weight_scale"]))
            if method == "gptq":
                differ += not np.array_equal(t[".weight"], outs["rtn"][P][".weight"])
    assert differ > 0


def test_eval_simulates_the_a8w4_kernel_and_sees_a_wrong_scale_bias():
    rng = np.random.default_rng(0)
    n, k = 32, 64
    q = rng.integers(-8, 8, size=(n, k)).astype(np.int8)
    s = rng.uniform(0.01, 0.02, size=(n, 1)).astype(np.float32)
    sb = scale_bias(scale_bias_sums(q, 16), s)
    ql = QuantLinear("m.down_proj", "W4A8_DYNAMIC", q, s, np.zeros_like(s), scale_bias=sb)
    x = torch.from_numpy(rng.normal(size=(5, k)).astype(np.float32))
    want = fake_quant_int8_rows(x) @ torch.from_numpy(q.astype(np.float32) * s).T  # a8 x w4, exactly
    got = EngineLinear(ql)(x)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    bad = QuantLinear("m.down_proj", "W4A8_DYNAMIC", q, s, np.zeros_like(s), scale_bias=np.zeros_like(sb))
    assert not torch.allclose(EngineLinear(bad)(x), want, rtol=1e-3, atol=1e-3)


def test_inspect_sizes_deepseek_r1_w4a8_on_one_node(run_cli):
    r = run_cli(["inspect", "--config", str(DATA / "deepseek_v3_config.json"), "--json"])
    assert r.code == 0, r.err
    rep = json.loads(r.out)
    w4 = rep["w4a8"]
    assert w4["layer_types"]["routed_experts"] == "W4A8_DYNAMIC" and w4["layer_types"]["kv_b"] == "FLOAT"
    card = rep["cards"]["Ascend910B"]
    assert card["w4a8"]["cards_x1.3"] <= 8 < card["int8"]["cards_x1.2"]
    # routed experts at ~half a byte (58 MoE layers x 256 experts x 3 x 7168 x 2048); the rest int8 or 16-bit,
    # with the MTP layer (its 256 experts ~23 GB) kept in BF16 as `quantize` keeps it
    experts = 58 * 256 * 3 * 7168 * 2048
    assert experts / 2 < w4["weight_bytes"] < experts / 2 + 60e9
    text = run_cli(["inspect", "--config", str(DATA / "deepseek_v3_config.json")]).out
    assert "fits one 8-card node" in text


@pytest.mark.slow
def test_shard_plans_deepseek_r1_w4a8_on_one_node_from_its_config(run_cli):
    """Bytes per card from the W4A8 output's own tensors (quantize's layout, from config.json alone): EP 8 x TP 8
    on one 8-card 910B node fits with a 32k context; the BF16 model does not."""
    cfg = str(DATA / "deepseek_v3_config.json")
    args = ["shard", "--config", cfg, "--engine", "vllm-ascend", "--ep", "8", "--tp", "8", "--world", "8",
            "--max-context", "32768", "--json"]
    r = run_cli([*args, "--scheme", "w4a8_dynamic"])
    assert r.code == 0, r.err
    plan = json.loads(r.out)
    assert plan["ok"] and plan["memory"]["ok"] and plan["memory"]["min_kv_tokens"] >= 32768
    assert plan["source"]["dtypes"]["I8"] > 40000 and plan["source"]["quant_type"] == "W8A8_DYNAMIC"
    inspect = json.loads(run_cli(["inspect", "--config", cfg, "--json"]).out)
    per_card = plan["total_bytes"] / 8
    assert abs(per_card - inspect["w4a8"]["weight_bytes"] / 8) / per_card < 0.01, "inspect and shard agree"
    text = run_cli([*args[:-1], "--scheme", "w4a8_dynamic"]).out
    assert "plan OK" in text
    bf16 = run_cli(args)
    assert bf16.code == 3, "the BF16 model needs more than one node"


def test_shard_slices_packed_experts_and_scale_bias_under_expert_tp(tiny_model, run_cli, tmp_path):
    """moe_tp 2: gate/up packed rows split on dim 0 with their scales, down's k (packed columns) and its 16
    scale_bias chunks split on dim 1 (vLLM _load_w13 / _load_w2 and MindIE's row W4A8 branch do the same)."""
    from safetensors import safe_open

    q = tmp_path / "q"
    assert run_cli(["quantize", "-m", str(tiny_model("qwen3_moe")), "-o", str(q), *W4, "--engine",
                    "vllm-ascend"]).code == 0
    r = run_cli(["shard", "-m", str(q), "--ep", "1", "--tp", "2", "--world", "2", "--engine", "vllm-ascend",
                 "--format", "ranks", "-o", str(tmp_path / "s")])
    assert r.code == 0, r.err

    def load(d: Path) -> dict[str, torch.Tensor]:
        out = {}
        for f in d.glob("*.safetensors"):
            with safe_open(str(f), "pt") as sf:
                out.update({k: sf.get_tensor(k) for k in sf.keys() if ".experts.0." in k})
        return out

    full = load(q)
    P = next(k for k in full if k.endswith("experts.0.down_proj.weight"))[:-len(".weight")]
    G = P.replace("down_proj", "gate_proj")
    for rank in (0, 1):
        part = load(tmp_path / "s" / f"rank_{rank:02d}")
        half = full[P + ".weight"].shape[1] // 2
        assert torch.equal(part[P + ".weight"], full[P + ".weight"][:, rank * half:(rank + 1) * half])
        assert torch.equal(part[P + ".scale_bias"], full[P + ".scale_bias"][:, rank * 8:(rank + 1) * 8])
        assert torch.equal(part[P + ".weight_scale"], full[P + ".weight_scale"])
        rows = full[G + ".weight"].shape[0] // 2
        assert torch.equal(part[G + ".weight"], full[G + ".weight"][rank * rows:(rank + 1) * rows])
        assert torch.equal(part[G + ".scale_bias"], full[G + ".scale_bias"][rank * 2 * rows:(rank + 1) * 2 * rows])


def test_exports_of_a_w4a8_output_are_refused_with_exit_2(tiny_model, run_cli, tmp_path):
    """int4 weights have no ONNX (opset <= 18) or AscendQuant form, and MindIR export takes weight-only models."""
    src = tiny_model("qwen3_moe")
    q = tmp_path / "q"
    assert run_cli(["quantize", "-m", str(src), "-o", str(q), *W4, "--engine", "vllm-ascend"]).code == 0
    onnx = run_cli(["export", "-m", str(src), "--quantized", str(q), "--format", "onnx", "-o", str(tmp_path / "o")])
    assert onnx.code == 2 and "W4A8_DYNAMIC" in onnx.err and "Traceback" not in onnx.err
    ms = run_cli(["export", "-m", str(q), "--format", "mindir", "-o", str(tmp_path / "m")])
    assert ms.code == 2 and "Traceback" not in ms.err
    assert not (tmp_path / "o").exists() and not (tmp_path / "m").exists()


def test_verify_recomputes_scale_bias(tiny_model, run_cli, tmp_path):
    from safetensors.torch import load_file, save_file

    from dsconv.quant.formats.msmodelslim import verify_output

    q = tmp_path / "q"
    assert run_cli(["quantize", "-m", str(tiny_model("qwen3_moe")), "-o", str(q), *W4, "--engine",
                    "vllm-ascend"]).code == 0
    assert run_cli(["verify", str(q)]).code == 0
    (f,) = sorted(q.glob("*.safetensors"))
    t = load_file(str(f))
    k = next(k for k in sorted(t) if k.endswith("experts.2.up_proj.scale_bias"))
    t[k] = t[k] * 1.01
    save_file(t, str(f), metadata={"format": "pt"})
    assert run_cli(["verify", str(q)]).code != 0, "the manifest's digest catches the edit first"
    problems = verify_output(q)  # the stage's own check, behind the hashes
    assert len(problems) == 1 and "up_proj.scale_bias differs" in problems[0], problems


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_deepseek_mtp_layer_follows_the_recipe(run_cli, tmp_path, method):
    """msModelSlim's recipe makes the MTP layer W8A8_DYNAMIC (its kv_b_proj float) and writes mtp_quantize, so MindIE
    reads its experts with `quantize`'s type; both quantize paths round it to nearest (no forward reaches it)."""
    from dsconv.bundled import calib_texts
    from dsconv.tiny import add_mtp_layer, make_tiny, train_tokenizer

    src = make_tiny("deepseek_v3", tmp_path / "m", dtype="bf16", tokenizer=train_tokenizer(calib_texts(), 384))
    add_mtp_layer(src)
    out = tmp_path / method
    r = run_cli(["quantize", "-m", src, "-o", out, *W4, "--method", method, "--calib-samples", "8", "--seq-len", "32"])
    assert r.code == 0, r.err
    desc = json.loads((out / "quant_model_description.json").read_text())
    mtp = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    types = {n: t for n, t in desc.items() if n.startswith(f"model.layers.{mtp}.") and n.endswith(".weight")}
    assert types[f"model.layers.{mtp}.mlp.experts.0.gate_proj.weight"] == "W8A8_DYNAMIC"
    assert types[f"model.layers.{mtp}.self_attn.q_b_proj.weight"] == "W8A8_DYNAMIC"
    for float_one in ("self_attn.kv_b_proj", "eh_proj", "mlp.gate"):
        assert types[f"model.layers.{mtp}.{float_one}.weight"] == "FLOAT"
    assert json.loads((out / "config.json").read_text())["mtp_quantize"] == "w8a8_dynamic"
    assert run_cli(["verify", out]).code == 0
    plain = run_cli(["quantize", "-m", src, "--bits", "8", "--dry-run", "--json"])
    assert json.loads(plain.out)["config_keys"].get("mtp_quantize") is None, "other schemes keep MTP float"


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "mixtral"])
def test_inspect_w4a8_bytes_equal_the_planned_output(tiny_model, family):
    """inspect sizes the W4A8 recipe per tensor without planning; it must equal the bytes of the tensors quantize's
    own plan would write (the DeepSeek model with its MTP layer)."""
    import shutil

    from dsconv.inspect import inspect_model
    from dsconv.quant.stage import planned_output
    from dsconv.tiny import add_mtp_layer

    src = tiny_model(family, dtype="bf16")  # inspect counts what stays float at 16 bits, as real checkpoints are
    if family == "deepseek_v3":
        d = src.parent / "with-mtp"
        if not d.exists():
            shutil.copytree(src, d)
            add_mtp_layer(d)
        src = d
    ck = Checkpoint.open(src)
    specs, _ = planned_output(ck, "w4a8_dynamic", "vllm-ascend")
    assert inspect_model(ck)["w4a8"]["weight_bytes"] == sum(s.nbytes for s in specs)


def test_cli_scheme_choices_are_the_plans_schemes():
    from dsconv.commands.quantize import SCHEME_NAMES
    from dsconv.quant.plan.plan import SCHEMES

    assert SCHEME_NAMES == list(SCHEMES)
