"""The export check's default tolerance, derived from the reference's own float noise (convert/tolerance.py).

(a) correct exports pass by default with a margin: a deep, narrow bf16 Llama shaped like a real 135M model (30
    layers, tied embeddings, logits ~35), whose correct fp32 export differs from PyTorch by more than the fixed 1e-4
    of old; bf16 graphs with rounded constants (Gemma's tanh-GELU). Every family's tiny model: test_export_onnx.py.
(b) wrong exports still fail: faults injected into the written graph's weights (a transposed square weight, a
    dropped bias, a 1% scale on one layer's weight) or into the reference (a wrong rope base), re-checked with the
    export's own check (`recheck`, onnxruntime as is); each must land far past the bound, so that a tolerance made
    loose enough to pass them would show here. Exit 3 through the CLI for one of them.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from dsconv.convert import tolerance
from dsconv.convert.onnx import export_onnx, recheck

pytestmark = [pytest.mark.cli, pytest.mark.usefixtures("one_torch_thread")]

#: the fixed absolute tolerance the fp32 check had before (its default --atol)
OLD_FP32_ATOL = 1e-4


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """(model dir, output dir, summary): the deep narrow model, exported fp32 with the default check."""
    from dsconv.tiny import make_deep

    root = tmp_path_factory.mktemp("deep")
    model = make_deep(root / "model")
    return model, root / "onnx", export_onnx(model, root / "onnx")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """(model dir, output dir, summary): the tiny Qwen2 (non-zero q/k/v biases), exported fp32."""
    from dsconv.tiny import make_tiny

    root = tmp_path_factory.mktemp("qwen2")
    model = make_tiny("qwen2", root / "model")
    return model, root / "onnx", export_onnx(model, root / "onnx")


def faulted(src: Path, dst: Path, name: str, change) -> Path:
    """A copy of the exported graph with one initializer changed (the rest byte for byte)."""
    m = onnx.load(str(src))
    t = next(t for t in m.graph.initializer if t.name == name)
    a = numpy_helper.to_array(t)
    t.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(change(a)).astype(a.dtype), name))
    onnx.save(m, str(dst))
    return dst


def assert_rule(check: dict) -> None:
    """The report states the rule, its figures, and the bound they give."""
    assert check["rule"] == "noise" and check["atol"] is None and "float64" in check["tolerance"]
    assert check["constants"] == {"K": tolerance.NOISE_K, "floor": tolerance.NOISE_FLOOR}
    for kind, bound in check["bound"].items():
        extra = check.get("bf16_constants", {}).get(kind, 0.0)
        assert bound == pytest.approx(tolerance.bound(check["noise"][kind], check["max_abs_ref"][kind], extra))
        assert check["noise"][kind] > 0
    worst = max(check["max_abs_err"][k] / check["bound"][k] for k in check["bound"])
    assert check["margin"] == pytest.approx(1 / worst)


# ------------------------------------------------------------------------------------------------ (a) correct
def test_deep_model_passes_where_the_fixed_tolerance_failed(deep):
    model, out, s = deep
    check = s["check"]
    assert check["passed"] and (out / "model.onnx").is_file()
    assert_rule(check)
    observed = check["max_abs_err"]["logits"]
    assert observed > OLD_FP32_ATOL  # the old default would have refused this correct export (exit 3)
    assert check["noise"]["logits"] > OLD_FP32_ATOL / 4  # float32's own rounding on these logits is of that size
    assert check["max_abs_ref"]["logits"] > 20  # logits of a real model's size
    assert check["margin"] > 3  # passes with room, not by luck
    assert "float64_reference" in s["timings"]
    info = json.loads((out / "export_info.json").read_text())
    assert info["check"]["margin"] == check["margin"] and info["check"]["noise"] == check["noise"]


def test_recheck_reproduces_the_export_check_and_atol_keeps_the_old_rule(deep):
    model, out, s = deep
    again = recheck(model, out / "model.onnx")
    assert again["passed"] and again["max_abs_err"] == s["check"]["max_abs_err"]
    assert again["noise"] == s["check"]["noise"]
    old = recheck(model, out / "model.onnx", atol=OLD_FP32_ATOL)  # --atol: the absolute rule, no noise run
    assert old["rule"] == "atol" and old["bound"] == {"logits": OLD_FP32_ATOL} and "noise" not in old
    assert not old["passed"] and old["margin"] < 1


def test_printed_summary_states_noise_bound_and_margin(deep):
    from dsconv.convert.onnx import render

    text = render(deep[2])
    line = next(x for x in text.splitlines() if "check passed" in x)
    assert "bound" in line and "noise" in line and "vs float64" in line and "margin" in line
    assert f"{tolerance.NOISE_K:g} x noise" in line


def test_bf16_graph_constants_are_allowed_for(tiny_model, tmp_path):
    """A bf16 graph holds its scalar constants in bf16 (Gemma's tanh-GELU 0.044715 -> 0.0447, sqrt(2/pi) -> 0.797);
    widened to float32 for the check it differs from PyTorch's float32 by more than float32 noise, and by more than
    the fixed 1e-3 of old. The check measures what those constants can move and adds it to the bound."""
    from dsconv.convert.onnx_check import rounded_bf16_constants

    s = export_onnx(tiny_model("gemma3"), tmp_path / "o", dtype="bf16")
    check = s["check"]
    assert check["passed"]
    assert_rule(check)
    observed, constants = check["max_abs_err"]["logits"], check["bf16_constants"]["logits"]
    assert observed > 1e-3 and observed > tolerance.NOISE_K * check["noise"]["logits"]  # noise alone: refused
    assert observed < constants < 20 * observed  # the constants term covers it, and not wildly
    assert rounded_bf16_constants(tmp_path / "o" / "model.onnx")
    s = export_onnx(tiny_model("llama"), tmp_path / "llama", dtype="bf16")  # no rounded constant: float32's bound
    assert s["check"]["passed"] and s["check"]["bf16_constants"] == {"logits": 0.0}
    assert not rounded_bf16_constants(tmp_path / "llama" / "model.onnx")


def test_float64_run_is_the_model_in_float64_one_layer_at_a_time(tiny_model):
    from dsconv.checkpoint import Checkpoint
    from dsconv.convert import hf_model

    with Checkpoint.open(tiny_model("qwen2", tie_word_embeddings=True)) as ck:
        model, _ = hf_model.load_for_export(ck, "fp32")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 320, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        f32 = model(input_ids=ids).logits
        with tolerance.in_float64(model):
            f64 = model(input_ids=ids).logits
            assert {p.dtype for p in model.parameters()} == {torch.float32}  # widened only while a layer runs
        assert f64.dtype == torch.float64 and 0 < (f64 - f32).abs().max() < 1e-4
        after = {n: p.detach() for n, p in model.named_parameters()}
        assert all(torch.equal(before[n], after[n]) and after[n].dtype == torch.float32 for n in before)
        assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
        whole = model.double()(input_ids=ids).logits  # the same as the whole model in float64
    assert torch.equal(f64, whole)


# ------------------------------------------------------------------------------------------------ (b) faults
def assert_caught(report: dict, at_least: float = 10.0) -> None:
    """Failed, and by far: the error is `at_least` x the bound (so the bound is no loophole for it)."""
    assert not report["passed"]
    err, bound = report["max_abs_err"]["logits"], report["bound"]["logits"]
    assert err > at_least * bound, (err, bound)
    assert report["margin"] < 1 / at_least


@pytest.mark.parametrize("name,change", [
    ("model.layers.0.self_attn.o_proj.weight.T", lambda a: a.T),  # [64, 64]: a transposed square weight
    ("model.layers.0.self_attn.q_proj.bias", np.zeros_like),
    ("model.layers.1.self_attn.k_proj.bias", np.zeros_like),
    ("model.layers.1.self_attn.v_proj.bias", np.zeros_like),
    ("model.layers.1.mlp.down_proj.weight.T", lambda a: a * 1.01),
], ids=["transposed o_proj", "dropped q bias", "dropped k bias", "dropped v bias", "1% down_proj"])
def test_faults_in_the_graph_fail(qwen2, tmp_path, name, change):
    model, out, s = qwen2
    assert s["check"]["passed"]
    report = recheck(model, faulted(out / "model.onnx", tmp_path / "f.onnx", name, change))
    assert_caught(report, at_least=100)


@pytest.mark.parametrize("name,change", [
    ("model.layers.15.mlp.down_proj.weight.T", lambda a: a * 1.01),  # the smallest fault measured (mid-depth)
    ("model.layers.29.self_attn.o_proj.weight.T", lambda a: a.T),
], ids=["1% down_proj mid-depth", "transposed o_proj last layer"])
def test_faults_fail_on_the_deep_model_too(deep, tmp_path, name, change):
    """The deep model's bound is the largest here (its noise is); a fault must still land far past it."""
    model, out, _ = deep
    report = recheck(model, faulted(out / "model.onnx", tmp_path / "f.onnx", name, change))
    assert_caught(report)


@pytest.mark.parametrize("fixture", ["qwen2", "deep"])
def test_wrong_rope_base_in_the_reference_fails(request, tmp_path, fixture):
    """The graph is right; the reference's rope base is 10% off (rope_theta 10000 -> 11000)."""
    model, out, _ = request.getfixturevalue(fixture)
    wrong = shutil.copytree(model, tmp_path / "wrong")
    config = json.loads((wrong / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] *= 1.1
    (wrong / "config.json").write_text(json.dumps(config))
    assert_caught(recheck(wrong, out / "model.onnx"))


def test_fault_exits_3_and_writes_nothing(tiny_model, tmp_path, run_cli, monkeypatch):
    """The written weights (not the reference) get a 1% scale on one layer's weight, as a broken writer would:
    `dsconv export` refuses with the figures and writes nothing."""
    from dsconv.convert import onnx_graph
    from dsconv.io.onnx_data import external_location

    real = onnx_graph.write_onnx
    name = "model.layers.1.mlp.down_proj.weight.T"

    def write_then_break(graph, weights, directory, *args, **kwargs):
        files = real(graph, weights, directory, *args, **kwargs)
        m = onnx.load(str(directory / "model.onnx"), load_external_data=False)
        location, offset, length = external_location(next(t for t in m.graph.initializer if t.name == name))
        data = np.memmap(directory / location, dtype=np.float32, mode="r+", offset=offset, shape=(length // 4,))
        data *= 1.01
        data.flush()
        del data
        return files

    monkeypatch.setattr(onnx_graph, "write_onnx", write_then_break)
    r = run_cli(["export", "--model", tiny_model("llama"), "--output", tmp_path / "o"])
    assert r.code == 3, r.err
    assert "logits max |onnx - torch|" in r.err and "x noise" in r.err and "Traceback" not in r.err
    assert not (tmp_path / "o").exists() and list(tmp_path.iterdir()) == []
