"""`dsconv quantize` end to end on tiny models: the exact layout, the math against values computed by hand from the
original weights and calibration activations, layer-by-layer == whole model, expert coverage, fallbacks, smoothing,
FP8 + MTP inputs, determinism, and the user errors."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from dsconv.checkpoint import Checkpoint
from dsconv.quant import stage
from dsconv.quant.algorithms.schemes import activation_qparams, deq_scale_from_int64
from dsconv.quant.calibrate.data import load_calib
from dsconv.runner.texts import load_tokenizer
from dsconv.runner.layers import ExpertLoop, install_forward, load_full_model
from dsconv.quant.formats.msmodelslim import check_description, verify_output
from dsconv.quant.plan.options import QuantOptions
from dsconv.quant.stage import QuantRequest

pytestmark = [pytest.mark.cli]

# the mechanics of static W8A8 itself: without the default smoothing, clipping searches and mixed recipe (tested in
# test_quant_mechanisms.py)
FAST = dict(calib_samples=8, seq_len=48, smooth_alpha=None, recipe="uniform", act_method="minmax")


@pytest.fixture(scope="module")
def tok():
    from dsconv.bundled import calib_texts
    from dsconv.tiny import train_tokenizer

    return train_tokenizer(calib_texts(), vocab_size=384)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tok):
    """Tiny checkpoints with a tokenizer: DeepSeek-V3 bf16 / fp16 / FP8+MTP, Qwen2 (biases), Mixtral fused."""
    from dsconv.tiny import add_mtp_layer, make_tiny, write_fp8_checkpoint

    root = tmp_path_factory.mktemp("qmodels")
    out = {"ds": make_tiny("deepseek_v3", root / "ds", dtype="bf16", tokenizer=tok),
           # wide enough for W4A16 groups of 64 (MindIE runs 0, 64, 128, 256) with two groups per row
           "dsw": make_tiny("deepseek_v3", root / "dsw", dtype="bf16", tokenizer=tok, hidden_size=128,
                            intermediate_size=256, q_lora_rank=128, kv_lora_rank=128, moe_intermediate_size=128),
           "ds16": make_tiny("deepseek_v3", root / "ds16", dtype="fp16", tokenizer=tok, seed=1),
           "qwen2": make_tiny("qwen2", root / "qwen2", dtype="bf16", tokenizer=tok),
           "mixtral": make_tiny("mixtral", root / "mixtral", fused=True, dtype="bf16", tokenizer=tok)}
    mtp = make_tiny("deepseek_v3", root / "dsmtp", dtype="bf16", tokenizer=tok, seed=2)
    add_mtp_layer(mtp)
    out["ds8"] = write_fp8_checkpoint(mtp, root / "ds8", block=(16, 16), max_part_tensors=30)
    return out


# MindIE permutes DeepSeek's MLA rope rows on the stored weight, so W4A16 per group is refused there (exit 2), and it
# builds DeepSeek's shared experts in no weight-only type: these stay float in the W4A16 tests of the tiny DeepSeek,
# as the refusals' hints say
ROPE_ROWS = ("q_b_proj|kv_a_proj_with_mqa",)
W4_KEEP_FLOAT = (*ROPE_ROWS, "shared_experts")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cache: dict = {}
    root = tmp_path_factory.mktemp("qout")

    def go(model: Path, name: str, **kw) -> tuple[Path, dict]:
        if name not in cache:
            out = root / name
            opts = QuantOptions(**{**FAST, **kw})
            cache[name] = (out, stage.run(QuantRequest(model, out, opts, progress=False)).summary)
        return cache[name]

    return go


def tensors_of(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for n in h.keys():
                out[n] = h.get_tensor(n)
    return out


def calib_stats(model_dir: Path, samples: int, seq_len: int):
    """Per-linear input (min, max) and per-expert token counts from ONE whole-model forward with hooks."""
    ck = Checkpoint.open(model_dir)
    cs = load_calib(None, load_tokenizer(model_dir), samples, seq_len)
    model, sk = load_full_model(ck)
    ranges: dict[str, list[float]] = {}
    counts: dict[int, torch.Tensor] = {}

    def upd(name, x):
        if x is None or x.numel() == 0:
            return
        lo, hi = float(x.min()), float(x.max())
        r = ranges.setdefault(name, [lo, hi])
        r[0], r[1] = min(r[0], lo), max(r[1], hi)

    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            P = sk.ck_name(sk.module_names[mod])
            mod.register_forward_pre_hook(lambda m, a, P=P: upd(P, a[0]))
    for i in range(sk.num_layers):
        ex = sk.experts_module(i)
        if ex is None:
            continue
        E = ex.gate_up_proj.shape[0]
        names = [sk.expert_module_names(i, e) for e in range(E)]

        def weights(e, ex=ex):
            I = ex.down_proj.shape[-1]
            return {"gate": ex.gate_up_proj[e][:I], "up": ex.gate_up_proj[e][I:], "down": ex.down_proj[e]}

        def observe(e, slot, x, w, names=names):  # each projection's input, then its plain product
            upd(names[e][slot], x)
            return x @ w.T

        loop = ExpertLoop(ex, E, weights, linear=observe)
        install_forward(ex, loop)
        counts[i] = loop
    with torch.no_grad():
        for s in cs.samples:  # one sample at a time: no padding at all
            model(torch.tensor([s]))
    return ranges, {i: [int(c) for c in loop.counts] for i, loop in counts.items()}, cs


# ------------------------------------------------------------------------------------------------ layout
def test_layout_and_description_complete(models, run):
    out, summary = run(models["ds"], "ds_w8a8")
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(["config.json", "dsconv_manifest.json", "expert_load.json", "generation_config.json",
                            "quant_model_description.json", "quant_model_weights.safetensors", "quant_report.json",
                            "tokenizer.json", "tokenizer_config.json"])
    desc = json.loads((out / "quant_model_description.json").read_text())
    t = tensors_of(out)
    assert list(desc)[:3] == ["model_quant_type", "version", "group_size"]
    assert desc["model_quant_type"] == "W8A8" and desc["group_size"] == 0 and desc["version"] == "1.0.0"
    assert set(desc) - {"model_quant_type", "version", "group_size"} == set(t)
    assert check_description(desc, {n: (Checkpoint.open(out).info(n).dtype, tuple(v.shape)) for n, v in t.items()}) == []
    assert verify_output(out) == []
    src = Checkpoint.open(models["ds"])
    for name, r in src.roles.items():  # kept by role: embeddings, norms, routers, lm_head, correction bias
        if not (r.role.quantized_by_default and r.param == "weight"):
            assert desc[name] == "FLOAT" and t[name].dtype == src.load(name).dtype, name
            assert torch.equal(t[name], src.load(name)), name
    P = "model.layers.1.mlp.experts.3.down_proj"
    assert desc[P + ".weight"] == "W8A8" and t[P + ".weight"].dtype == torch.int8
    assert t[P + ".input_scale"].dtype == torch.float32 and t[P + ".input_scale"].shape == (1,)
    assert t[P + ".deq_scale"].dtype == torch.float32 and t[P + ".deq_scale"].shape == (64,)
    assert t[P + ".quant_bias"].dtype == torch.int32
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "deepseek_v3"
    load = json.loads((out / "expert_load.json").read_text())
    assert set(load) == {"layers"} and set(load["layers"]) == {"1", "2"} and len(load["layers"]["1"]) == 16
    report = json.loads((out / "quant_report.json").read_text())
    assert report["linears"][P]["type"] == "W8A8" and report["linears"][P]["weight_error"] < 0.01
    assert summary["linears"] == {"W8A8": 117}  # kv_b_proj x 3 stay float (both engines' rule)
    assert desc["model.layers.1.self_attn.kv_b_proj.weight"] == "FLOAT"
    assert cfg["quantize"] == "w8a8"  # MindIE (the default engine) opens the description by this key


def up_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """Positive float32 values rounded up to 8 significant bits (the grid bf16 holds), by integer ops on the bits:
    how activation scales are written (the engines keep scales in the model dtype). Values here are all above
    2**-17."""
    bits = x.float().contiguous().view(torch.int32).long()
    return ((bits + 0xFFFF) & 0xFFFF0000).to(torch.int32).view(torch.float32)


def weight_scale_by_hand(w: torch.Tensor, qmax: int) -> torch.Tensor:
    """The weight scale rule, by hand (rows of ``w [..., g]``): the bf16 value just above max|w| / qmax, or the one
    just below (truncated bits) where it keeps every weight within half a step and rounds the row with a smaller
    squared error (float64 here: a near-tie could go either way, none occurs in these models)."""
    exact = w.abs().amax(dim=-1) / qmax
    hi = up_to_bf16(exact)
    lo = (exact.float().contiguous().view(torch.int32).long() & 0xFFFF0000).to(torch.int32).view(torch.float32)

    def err(c: torch.Tensor) -> torch.Tensor:
        q = torch.round(w / c[..., None]).clamp(-qmax - 1, qmax)
        return (q * c[..., None] - w).double().square().sum(-1)

    ok = (lo < hi) & (lo * (qmax + 0.5) >= w.abs().amax(dim=-1))
    return torch.where(ok & (err(lo) < err(hi)), lo, hi)


def test_w8a8_math_by_hand_with_bias(models, run):
    """Qwen2 (q/k/v biases): q = round(W / s) with s the bf16 value next to absmax/127 (weight_scale_by_hand),
    deq_scale = input_scale * s, quant_bias = round(bias / deq_scale - rowsum(q) * input_offset), input params from the
    calibration range (its scale rounded up the same way)."""
    out, _ = run(models["qwen2"], "qwen2_w8a8", fallback=0)
    t = tensors_of(out)
    src = Checkpoint.open(models["qwen2"])
    ranges, _, _ = calib_stats(models["qwen2"], FAST["calib_samples"], FAST["seq_len"])
    for P in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        w = src.load(P + ".weight").float()  # float32 arithmetic, as the engine's reference
        scale = weight_scale_by_hand(w, 127)
        q = torch.round(w / scale[:, None]).to(torch.int8)
        assert torch.equal(t[P + ".weight"], q)
        lo, hi = min(ranges[P][0], 0.0), max(ranges[P][1], 0.0)
        in_scale = up_to_bf16(torch.tensor((hi - lo) / 255)).item()
        in_off = round(-128 - lo / in_scale)
        assert t[P + ".input_scale"].item() == pytest.approx(in_scale, rel=1e-4)
        assert torch.equal(t[P + ".input_scale"].to(torch.bfloat16).float(), t[P + ".input_scale"])
        assert abs(t[P + ".input_offset"].item() - in_off) <= 1
        deq = t[P + ".input_scale"] * scale
        assert torch.allclose(t[P + ".deq_scale"], deq, rtol=1e-6)
        bias = src.load(P + ".bias").double() if P + ".bias" in src else torch.zeros(w.shape[0], dtype=torch.float64)
        qb = torch.round(bias / t[P + ".deq_scale"].double() - q.double().sum(1) * t[P + ".input_offset"].double())
        assert torch.equal(t[P + ".quant_bias"], qb.to(torch.int32))
    assert torch.equal(t["model.layers.0.self_attn.q_proj.bias"], src.load("model.layers.0.self_attn.q_proj.bias"))


def test_fp16_model_stores_deq_scale_as_int64_bit_pattern(models, run):
    out, _ = run(models["ds16"], "ds16_w8a8", fallback=0)
    t = tensors_of(out)
    P = "model.layers.0.self_attn.q_a_proj"
    stored = t[P + ".deq_scale"]
    assert stored.dtype == torch.int64
    deq = deq_scale_from_int64(stored.numpy())
    scale = weight_scale_by_hand(Checkpoint.open(models["ds16"]).load(P + ".weight").float(), 127).double()
    np.testing.assert_allclose(deq, (t[P + ".input_scale"].double() * scale).numpy(), rtol=1e-6)
    assert int(stored[0]) == int(np.array([deq[0]], np.float32).view(np.int32)[0])


def test_layer_by_layer_equals_whole_model(models, run):
    """Every linear's activation range (incl. each expert's) and every expert's token count from the layer-by-layer
    pipeline equal those of one whole-model forward with hooks."""
    out, _ = run(models["ds"], "ds_w8a8")
    t = tensors_of(out)
    ranges, counts, cs = calib_stats(models["ds"], FAST["calib_samples"], FAST["seq_len"])
    load = json.loads((out / "expert_load.json").read_text())["layers"]
    assert {int(k): v for k, v in load.items()} == counts
    assert all(sum(v) == cs.tokens * 4 for v in counts.values())  # top-4 routing
    report = json.loads((out / "quant_report.json").read_text())
    checked = 0
    for P, entry in report["linears"].items():
        if entry.get("range") == "borrowed":
            continue
        s, o = activation_qparams(*ranges[P])
        assert t[P + ".input_scale"].item() == pytest.approx(float(s), rel=1e-4), P
        assert abs(t[P + ".input_offset"].item() - float(o)) <= 1, P
        checked += 1
    assert checked >= 100


def test_w4a16_packing_and_groups(models, run):
    out, summary = run(models["dsw"], "ds_w4_rtn", scheme="w4a16", group_size=64, method="rtn", ignore=W4_KEEP_FLOAT)
    assert summary["calibration"] is None  # weight-only RTN needs no activations
    t = tensors_of(out)
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert desc["model_quant_type"] == "W4A16" and desc["group_size"] == 64
    P = "model.layers.0.mlp.down_proj"  # [128, 256]
    w = Checkpoint.open(models["dsw"]).load(P + ".weight").float()
    g = w.reshape(128, 4, 64)
    scale = weight_scale_by_hand(g, 7)
    q = torch.round(g / scale[..., None]).clamp(-8, 7).reshape(128, 256).to(torch.int8)
    packed = t[P + ".weight"]
    assert packed.shape == (64, 256) and packed.dtype == torch.int8
    assert t[P + ".weight_scale"].shape == (128, 4) and torch.equal(t[P + ".weight_scale"], scale)
    assert torch.count_nonzero(t[P + ".weight_offset"]) == 0
    u = packed.view(torch.uint8).int()
    low = ((u & 0xF) ^ 8) - 8  # sign-extend the nibbles by hand: even rows low, odd rows high
    high = ((u >> 4) ^ 8) - 8
    assert torch.equal(low.to(torch.int8), q[0::2]) and torch.equal(high.to(torch.int8), q[1::2])


def test_w4a16_mse_method_same_format_lower_weight_error_without_calibration(models, run):
    """--method mse: searched group scales, written exactly like round-to-nearest's (packed int4, one scale per
    group, zero offsets), no calibration, and a weight error no larger on any linear."""
    out_m, s_m = run(models["dsw"], "ds_w4_mse", scheme="w4a16", group_size=64, method="mse", ignore=W4_KEEP_FLOAT)
    out_r, _ = run(models["dsw"], "ds_w4_rtn", scheme="w4a16", group_size=64, method="rtn", ignore=W4_KEEP_FLOAT)
    assert s_m["calibration"] is None and s_m["method"] == "mse"
    t_m, t_r = tensors_of(out_m), tensors_of(out_r)
    assert {n: (v.shape, v.dtype) for n, v in t_m.items()} == {n: (v.shape, v.dtype) for n, v in t_r.items()}
    rep_m = json.loads((out_m / "quant_report.json").read_text())["linears"]
    rep_r = json.loads((out_r / "quant_report.json").read_text())["linears"]
    assert all(rep_m[m]["weight_error"] <= rep_r[m]["weight_error"] + 1e-6 for m in rep_r)
    assert np.mean([rep_m[m]["weight_error"] for m in rep_m]) < 0.95 * np.mean([rep_r[m]["weight_error"] for m in rep_r])


def test_gptq_warns_when_calibration_is_small_for_its_hessians(models, tmp_path):
    """GPTQ fits its Hessian's tokens: fewer than ~2x the widest input (after the held-out split) is a warning."""
    warns: list[str] = []
    opts = QuantOptions(**{**FAST, "scheme": "w4a16", "group_size": 64, "method": "gptq", "calib_samples": 9,
                           "seq_len": 16, "ignore": W4_KEEP_FLOAT})
    stage.run(QuantRequest(models["dsw"], tmp_path / "o", opts, progress=False, warn=warns.append))
    hit = [w for w in warns if "GPTQ Hessians" in w]
    assert hit and "2 x the widest input" in hit[0] and "results may be poor" in hit[0]


def test_gptq_beats_rtn_on_output_error(models, run):
    """Same calibration rows, same group size: GPTQ's INT4 output error is below round-to-nearest's on average (its
    weight error is not: it trades weight error for output error), incl. routed experts and MLA projections."""
    from dsconv.bundled import bundled_calib_path

    kw = dict(scheme="w4a16", group_size=64, calib_samples=12, seq_len=64, calib=bundled_calib_path(),
              ignore=W4_KEEP_FLOAT)
    out_g, s_g = run(models["dsw"], "ds_w4_gptq", method="gptq", **kw)
    out_r, s_r = run(models["dsw"], "ds_w4_rtn_cal", method="rtn", **kw)
    assert s_g["method"] == "gptq" and s_r["calibration"] is not None
    rep_g = json.loads((out_g / "quant_report.json").read_text())
    assert rep_g["gptq"] == {"damp": 0.1, "act_order": True, "static_groups": True}
    g = rep_g["linears"]
    r = json.loads((out_r / "quant_report.json").read_text())["linears"]
    assert set(g) == set(r) and len(g) == 105  # 117 linears less the 6 rope-row and 6 shared-expert ones kept float
    out_err = lambda rep: np.mean([e["output_error"]["weight_only"] for e in rep.values()])  # noqa: E731
    assert out_err(g) < 0.85 * out_err(r)
    experts = [m for m in g if ".experts." in m]
    assert np.mean([g[m]["output_error"]["weight_only"] for m in experts]) < \
        np.mean([r[m]["output_error"]["weight_only"] for m in experts])


def test_histogram_act_methods_clip_inside_minmax(models, run):
    mm, _ = run(models["qwen2"], "qwen2_w8a8", fallback=0)
    t_mm = tensors_of(mm)
    for method in ("mse", "percentile"):
        out, s = run(models["qwen2"], f"qwen2_{method}", fallback=0, act_method=method)
        t = tensors_of(out)
        scales = [(t[n].item(), t_mm[n].item()) for n in t if n.endswith(".input_scale")]
        assert len(scales) == 14 and all(a <= b * (1 + 1e-6) for a, b in scales)
        assert json.loads((out / "quant_report.json").read_text())["act_method"] == method


def test_mindie_legacy_layout_named_by_config_quantize(models, run):
    out, summary = run(models["ds"], "ds_mindie_bits8", layout="mindie", bits_default=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantize"] == "w8a8_dynamic" and cfg["mla_quantize"] == "w8a8" and "moe_quantize" not in cfg
    assert (out / "quant_model_description_w8a8_dynamic.json").is_file()
    assert (out / "quant_model_weight_w8a8_dynamic.safetensors").is_file()
    assert verify_output(out) == []


def test_fallback_count(models, run):
    out, summary = run(models["ds"], "ds_fb", fallback=2, engine="vllm-ascend", moe_scheme="w8a8_dynamic")
    fb = summary["fallback"]
    assert len(fb["fell_back"]) == 2 and fb["target"] == "W8A8_DYNAMIC"
    ranked = [u for u in fb["units"] if u["error"] is not None]
    assert [u["unit"] for u in ranked[:2]] == fb["fell_back"]  # the two most sensitive
    assert ranked[0]["error"] >= ranked[1]["error"] >= ranked[2]["error"]
    desc = json.loads((out / "quant_model_description.json").read_text())
    t = tensors_of(out)
    report = json.loads((out / "quant_report.json").read_text())
    dyn = [P for P, e in report["linears"].items() if e["type"] == "W8A8_DYNAMIC" and ".experts." not in P]
    assert dyn
    for P in dyn:
        assert desc[P + ".weight"] == "W8A8_DYNAMIC" and t[P + ".weight_scale"].shape[1] == 1
        assert torch.count_nonzero(t[P + ".weight_offset"]) == 0 and P + ".input_scale" not in t
    assert verify_output(out) == []


def test_threshold_zero_falls_back_everything_to_w8a16(models, run):
    out, summary = run(models["qwen2"], "qwen2_all_fb", fallback_threshold=0.0, fallback_to="w8a16",
                       engine="vllm-ascend")
    assert summary["linears"] == {"W8A16": 14} and summary["model_quant_type"] == "W8A16"
    assert verify_output(out) == []


def test_fp8_input_with_mtp_and_ignore(models, run):
    out, _ = run(models["ds8"], "ds8_w8a8", ignore=(r"layers\.2\.self_attn\.o_proj$",))
    desc = json.loads((out / "quant_model_description.json").read_text())
    t = tensors_of(out)
    assert not any(n.endswith("weight_scale_inv") for n in t)
    mtp = [n for n in desc if n.startswith("model.layers.3.")]
    assert mtp and all(desc[n] == "FLOAT" for n in mtp)
    assert t["model.layers.3.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16  # FP8 dequantized, not int8
    assert desc["model.layers.2.self_attn.o_proj.weight"] == "FLOAT"
    assert t["model.layers.2.self_attn.o_proj.weight"].dtype == torch.bfloat16
    src = Checkpoint.open(models["ds8"])
    assert torch.equal(t["model.layers.2.self_attn.o_proj.weight"],
                       src.load("model.layers.2.self_attn.o_proj.weight", dequantize=True))
    report = json.loads((out / "quant_report.json").read_text())
    assert "model.layers.3.eh_proj.weight" in report["kept_float"]
    assert report["kept_float"]["model.layers.2.self_attn.o_proj"].startswith("--ignore")
    assert verify_output(out) == []


def test_smoothing_folds_into_norms_exactly(models, run):
    out, summary = run(models["ds"], "ds_smooth", smooth_alpha=0.5, fallback=0)
    t = tensors_of(out)
    src = Checkpoint.open(models["ds"])
    applied = [s for s in summary["smoothing"] if s["applied"]]
    assert {s["norm"] for s in applied} >= {"model.layers.0.input_layernorm.weight",
                                            "model.layers.1.post_attention_layernorm.weight"}
    for norm, P in (("model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_a_proj"),
                    ("model.layers.1.post_attention_layernorm.weight", "model.layers.1.mlp.experts.5.up_proj")):
        n0, n1 = src.load(norm).double(), t[norm].double()
        assert not torch.equal(n0, n1) and t[norm].dtype == torch.bfloat16
        w0 = src.load(P + ".weight").double() * n0  # the float product norm x weight is what must survive
        deq = t[P + ".deq_scale"].double() / t[P + ".input_scale"].double()
        w1 = t[P + ".weight"].double() * deq[:, None] * n1
        assert (w1 - w0).norm() / w0.norm() < 0.02
    router = "model.layers.1.mlp.gate.weight"  # the router reads the smoothed norm: rescaled, still float
    assert t[router].dtype == src.load(router).dtype and not torch.equal(t[router], src.load(router))


def test_expert_coverage_and_all_experts(models, run):
    out, summary = run(models["mixtral"], "mx_cov", calib_samples=2, seq_len=16, min_expert_tokens=10 ** 6)
    ex = summary["experts"]
    assert set(ex["under_min"]) == {"0", "1"} and len(ex["under_min"]["0"]) == 8
    assert ex["borrowed_range_layers"] == [0, 1]
    out2, s2 = run(models["mixtral"], "mx_all", calib_samples=2, seq_len=16, all_experts=True,
                   min_expert_tokens=10 ** 6)
    assert s2["experts"]["borrowed_range_layers"] == []
    report = json.loads((out2 / "quant_report.json").read_text())
    P = "model.layers.0.block_sparse_moe.experts.0.w2"
    tokens = s2["calibration"]["tokens"]
    assert report["linears"][P]["type"] == "W8A8"
    load = json.loads((out2 / "expert_load.json").read_text())["layers"]
    assert sum(load["0"]) == tokens * 2  # top-2: counts stay the routed ones in --all-experts mode


def test_deterministic_bytes(models, run, tmp_path):
    first, _ = run(models["ds"], "ds_w8a8")
    again = tmp_path / "again"
    stage.run(QuantRequest(models["ds"], again, QuantOptions(**FAST), progress=False))
    for name in ("quant_model_weights.safetensors", "quant_model_description.json", "expert_load.json",
                 "config.json"):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    reports = [json.loads((d / "quant_report.json").read_text()) for d in (first, again)]
    assert all(r.pop("timings")["steps_cpu"]["forward"] > 0 for r in reports)  # seconds: the one part that varies
    assert reports[0] == reports[1]


def test_split_parts_with_index(models, tmp_path):
    out = tmp_path / "split"
    stage.run(QuantRequest(models["qwen2"], out, QuantOptions(scheme="w8a16", max_shard_size=20_000),
                           progress=False))
    parts = sorted(p.name for p in out.glob("quant_model_weights-*.safetensors"))
    assert len(parts) > 1 and parts[0] == f"quant_model_weights-00001-of-{len(parts):05d}.safetensors"
    index = json.loads((out / "quant_model_weights.safetensors.index.json").read_text())
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert set(index["weight_map"]) == set(desc) - {"model_quant_type", "version", "group_size"}
    assert set(index) == {"metadata", "weight_map"} and index["metadata"]["total_size"] > 0
    assert verify_output(out) == []


# ------------------------------------------------------------------------------------------------ CLI and errors
def test_cli_errors(models, run_cli, tmp_path):
    ds = models["ds"]
    r = run_cli(["quantize", "-m", ds, "--bits", "4", "--group-size", "48", "--ignore", "shared_experts",
                 "-o", tmp_path / "x"])
    assert r.code == 2 and "layer model.layers.0.mlp.down_proj: group size 48 does not divide its input width 128" in r.err
    assert "valid group sizes for this layer: 32, 64, 128, 0 (per channel)" in r.err
    r = run_cli(["quantize", "-m", ds, "--bits", "4", "--scheme", "w8a8", "-o", tmp_path / "x"])
    assert r.code == 2 and "8-bit weights" in r.err
    r = run_cli(["quantize", "-m", ds, "--scheme", "w8a16", "--smooth-quant", "0.5", "--ignore", "shared_expert",
                 "-o", tmp_path / "x"])
    assert r.code == 2 and "--smooth-quant applies to schemes with quantized activations" in r.err
    r = run_cli(["quantize", "-m", ds, "--bits", "8", "--fallback", "2", "--fallback-threshold", "0.1",
                 "--engine", "vllm-ascend", "-o", tmp_path / "x"])
    assert r.code == 2 and "alternatives" in r.err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"nope": 1}\n')
    r = run_cli(["quantize", "-m", ds, "--bits", "8", "--calib", bad, "-o", tmp_path / "x"])
    assert r.code == 2 and f"{bad}:2: no calibration text" in r.err
    r = run_cli(["quantize", "-m", ds, "--bits", "8", "--ignore", ".*", "-o", tmp_path / "x"])
    assert r.code == 2 and "no linear layer is left" in r.err
    assert not (tmp_path / "x").exists()


def test_cli_quantized_input_refused_and_dry_run(models, run, run_cli, tmp_path):
    out, _ = run(models["qwen2"], "qwen2_all_fb", fallback_threshold=0.0, fallback_to="w8a16",
                 engine="vllm-ascend")
    r = run_cli(["quantize", "-m", out, "--bits", "8", "-o", tmp_path / "y"])
    assert r.code == 2 and "already quantized" in r.err
    r = run_cli(["quantize", "-m", models["dsw"], "--bits", "4", "--group-size", "64", "--dry-run", "--json",
                 "--ignore", "shared_experts"])
    assert r.code == 2 and "preprocess_linear_for_rope" in r.err and "--group-size 0" in r.err
    r = run_cli(["quantize", "-m", models["dsw"], "--bits", "4", "--group-size", "64", "--dry-run", "--json",
                 "--ignore", "|".join(W4_KEEP_FLOAT)])
    assert r.code == 0
    plan = json.loads(r.out)
    assert plan["dry_run"] and plan["linears"] == {"W4A16": 105} and plan["output_bytes"] < plan["input_bytes"]
    # the 4-bit default is the method measured best end to end on three real models (docs/accuracy.md): GPTQ, which
    # calibrates (on the bundled set unless --calib); W4A8's experts keep plain rounding, which needs none
    assert plan["method"] == "gptq" and plan["calibration"] is True
    r = run_cli(["quantize", "-m", models["ds"], "--bits", "4", "--scheme", "w4a8_dynamic", "--dry-run", "--json"])
    assert r.code == 0 and json.loads(r.out)["method"] == "rtn" and json.loads(r.out)["calibration"] is False
    r = run_cli(["quantize", "-m", models["qwen2"], "--scheme", "w8a16", "-o", tmp_path / "z", "--json"])
    assert r.code == 0 and json.loads(r.out)["linears"] == {"W8A16": 14}
    r = run_cli(["verify", tmp_path / "z"])
    assert r.code == 0 and "quantize output" in r.out


def test_weight_only_needs_no_tokenizer(tmp_path):
    from dsconv.tiny import make_tiny

    m = make_tiny("llama", tmp_path / "m", dtype="bf16")
    s = stage.run(QuantRequest(m, tmp_path / "o", QuantOptions(scheme="w8a16"), progress=False)).summary
    assert s["linears"] == {"W8A16": 14} and math.isfinite(s["layers"]["0"]["weight_error_mean"])


def test_calibrating_default_says_so_up_front(models, run_cli, tmp_path):
    r = run_cli(["quantize", "-m", models["qwen2"], "--bits", "4", "--group-size", "0", "--calib-samples", "4",
                 "--seq-len", "32", "-o", tmp_path / "g", "--json"])
    assert r.code == 0, r.err
    assert "--method gptq is the default for w4a16" in r.err and "bundled qa.jsonl" in r.err
    assert json.loads(r.out)["method"] == "gptq"
    r = run_cli(["quantize", "-m", models["qwen2"], "--bits", "4", "--group-size", "0", "--method", "rtn", "-o",
                 tmp_path / "r"])
    assert r.code == 0 and "is the default" not in r.err
