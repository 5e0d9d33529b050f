"""The calibrated path's steps (dsconv/quant/calibrate/steps.py): one forward per layer - the smoothing searches ride
on the statistics forward and the statistics follow the folds (`InputStats.rescale`) as a second forward over the
smoothed layer would gather them -, every smoothing candidate scored in int8 as one by one in float, and each
step's seconds per layer in quant_report.json."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import dsconv.quant.calibrate.forward_jobs as fj
from dsconv.quant.algorithms import clipping, smoothing as sm
from dsconv.quant.algorithms.error_metrics import relative_error
from dsconv.quant.algorithms.fake_quant import fake_quant_int8_rows, fake_quant_static
from dsconv.quant.algorithms.int8_outputs import int8_matmul
from dsconv.quant.calibrate import clip_search, smooth_layer
from dsconv.quant.calibrate.stats import InputStats
from dsconv.qformat import dequant_weight
from dsconv.quant.algorithms.schemes import quantize_weight_per_channel

pytestmark = [pytest.mark.cli]


def outlier_rows(tokens: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g)
    x[:, [1, 7, k - 3]] *= 30.0
    return x + 0.2


@pytest.mark.unit
def test_rescaled_statistics_equal_a_second_forward_over_the_smoothed_norm():
    """Min/max, sampled rows, held-out rows and X^T X of the norm's output, divided by the fold's s after the
    fact, match what a pass over the folded norm (weight rounded to bf16, s re-derived) gathers."""
    u = outlier_rows(600, 64)                                  # the normalised rows the norm weight multiplies
    n = 1.0 + 0.1 * torch.randn(64, generator=torch.Generator().manual_seed(1))
    held = torch.arange(600) % 4 == 3
    s = torch.from_numpy(sm.smooth_scales((u * n).abs().amax(0).numpy(), np.full(64, 0.05, np.float32), 0.6))
    n_new, s_eff = sm.norm_fold(n.clone(), 0.0, torch.bfloat16, s)
    assert not torch.equal(s_eff, torch.ones(64))

    def gathered(x: torch.Tensor) -> InputStats:
        st = InputStats(64, "x", "minmax", hessian=True, sample_tokens=32, stride=7, held_out=True)
        for a in range(0, 600, 250):                           # batches, as the forward streams them
            st.update(x[a:a + 250], held=held[a:a + 250])
        return st

    after = gathered(u * n)
    after.rescale(s_eff)
    second = gathered(u * n_new)
    close = dict(rtol=2e-6, atol=1e-6)
    assert np.allclose(after.observer.channel_min, second.observer.channel_min, **close)
    assert np.allclose(after.observer.channel_max, second.observer.channel_max, **close)
    assert torch.allclose(after.sample, second.sample, **close)
    assert torch.allclose(after.held.x, second.held.x, **close)
    assert torch.allclose(torch.from_numpy(after.hessian.hessian()), torch.from_numpy(second.hessian.hessian()),
                          rtol=1e-5, atol=1e-5)
    assert after.tokens == second.tokens == 600


@pytest.mark.unit
@pytest.mark.parametrize("static", [True, False])
def test_integer_candidates_score_as_dequantized_float(static):
    """candidate_errors (int8 codes, one int8 matmul per candidate) gives each candidate's error as dequantizing it
    and multiplying in float32, the smoothed weight rounded as it is written (the grid scales of scale_grid.py, not
    float max|w| / 127)."""
    x = outlier_rows(2000, 96)
    site = sm.SiteSample(2000, cap=128)
    for a in range(0, 2000, 300):
        site.update(x[a:a + 300])
    w = torch.randn(160, 96, generator=torch.Generator().manual_seed(2)) * 0.05
    S = torch.stack([torch.ones(96), *(torch.from_numpy(sm.smooth_scales(site.absmax.numpy(),
                                                                          w.abs().amax(0).numpy(), a))
                                       for a in (0.3, 0.6, 0.9))])
    got = sm.candidate_errors(site.x, w, S, site.cmin, site.cmax, static)
    ref = site.x @ w.T
    for s, e in zip(S, got):
        q, scale = quantize_weight_per_channel((w * s).numpy(), 8)
        xs, ws = site.x / s, torch.from_numpy(dequant_weight(q, scale))
        if static:
            lo, hi = float((site.cmin / s).min()), float((site.cmax / s).max())
            want = min(relative_error(fake_quant_static(xs, lo * c, hi * c) @ ws.T, ref) for c in sm.SEARCH_CLIPS)
        else:
            want = relative_error(fake_quant_int8_rows(xs) @ ws.T, ref)
        assert e == pytest.approx(want, rel=1e-5)


@pytest.mark.unit
def test_the_clip_search_in_integers_scores_as_dequantized_float():
    """best_clip's errors (int8 codes, one int8 matmul for every ratio) are those of the fake-quantized float
    product, at the ratio it chose and at min/max."""
    x = outlier_rows(512, 96)
    w = torch.randn(200, 96, generator=torch.Generator().manual_seed(5)) * 0.05
    lo, hi = float(x.min()), float(x.max())
    ratio, err, err_minmax = clipping.best_clip(x, lo, hi, [w])
    ref = x @ w.T
    for r, e in ((ratio, err), (1.0, err_minmax)):
        want = relative_error(fake_quant_static(x, lo * r, hi * r) @ fake_quant_int8_rows(w).T, ref)
        assert e == pytest.approx(want, rel=1e-5)


@pytest.mark.unit
@pytest.mark.parametrize("has_int_mm", [True, False], ids=["int_mm", "float-fallback"])
def test_int8_matmul_is_exact_with_or_without_torchs_int8_kernel(monkeypatch, has_int_mm):
    if not has_int_mm:
        def missing(*args):
            raise RuntimeError("Could not run 'aten::_int_mm' with arguments from the 'CPU' backend")

        monkeypatch.setattr(torch, "_int_mm", missing)
    g = torch.Generator().manual_seed(4)
    a = torch.randint(-128, 128, (37, 4864), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (11, 4864), generator=g, dtype=torch.int8)
    want = (a.long() @ b.long().T).double()
    got = int8_matmul(a, b)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    from dsconv.bundled import calib_texts
    from dsconv.tiny import make_tiny, train_tokenizer

    return make_tiny("llama", tmp_path_factory.mktemp("steps") / "llama", dtype="bf16",
                     tokenizer=train_tokenizer(calib_texts(), vocab_size=384))


def _quantize(run_cli, model: Path, out: Path, monkeypatch, *extra: str) -> tuple[dict, int]:
    """`quantize --bits 8` inline; (its --json summary, layer forwards over a batch it ran)."""
    calls = [0]
    real = fj.forward_batch

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(fj, "forward_batch", counted)
    r = run_cli(["quantize", "--model", model, "--output", out, "--bits", "8", "--calib-samples", "12", "--workers",
                 "1", "--json", *extra])
    assert r.code == 0, r.err
    return json.loads(r.out), calls[0]


def test_bits8_pushes_each_batch_through_each_layer_once(run_cli, llama, tmp_path, monkeypatch):
    """Smoothing (auto), statistics, clip search, outputs: one forward per layer and batch; each step's seconds per
    layer in quant_report.json."""
    summary, calls = _quantize(run_cli, llama, tmp_path / "q", monkeypatch)
    layers = json.loads((llama / "config.json").read_text())["num_hidden_layers"]
    assert summary["forward"]["batches"] >= 1
    assert calls == layers * summary["forward"]["batches"]
    report = json.loads((tmp_path / "q" / "quant_report.json").read_text())
    assert any(e.get("applied") for e in report["smoothing"]), "the run must smooth something to prove the point"
    t = report["timings"]
    assert set(t["layers"]) == {str(i) for i in range(layers)}
    driver = {"materialise", "forward", "smooth_search", "clip_search", "linear_jobs", "write"}
    for i in range(layers):
        layer = t["layers"][str(i)]
        assert driver <= set(layer) and driver <= set(layer["cpu"])
        assert {"quantize", "fallback_check"} <= set(layer["in_jobs"])
        assert all(v >= 0 for k, v in layer.items() if k in driver)
    assert sum(t["steps"].values()) <= t["calibration"]
    assert t["steps"]["forward"] > 0 and t["steps_cpu"]["forward"] > 0 and t["in_jobs"]["quantize"] >= 0


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    from dsconv.bundled import calib_texts
    from dsconv.tiny import make_tiny, train_tokenizer

    return make_tiny("qwen2_moe", tmp_path_factory.mktemp("steps") / "moe", dtype="bf16",
                     tokenizer=train_tokenizer(calib_texts(), vocab_size=384), moe_intermediate_size=64,
                     shared_expert_intermediate_size=64)


@pytest.mark.parametrize("alpha", [None, "0.5"], ids=["auto", "fixed-alpha"])
def test_routed_experts_start_before_the_searches_unless_a_scale_folds_into_them(run_cli, moe, tmp_path,
                                                                                  monkeypatch, alpha):
    """With auto smoothing (never a norm the experts read), a MoE layer's expert jobs are submitted right after its
    forward, before the smoothing fold, the clip search and the linear jobs, and their results taken after; a fixed
    alpha may fold a scale into the experts' columns, so they start only after the fold."""
    from dsconv.quant.calibrate.calib_jobs import Dispatch
    from dsconv.quant.calibrate.calibration import Calibrator

    events: list[str] = []

    def spy(owner, name: str, label: str) -> None:
        real = getattr(owner, name)

        def wrapped(*a, **kw):
            events.append(label)
            return real(*a, **kw)
        monkeypatch.setattr(owner, name, wrapped)

    spy(Calibrator, "start_experts", "start")
    spy(Calibrator, "run_experts", "take")
    spy(smooth_layer, "fold", "fold")
    spy(clip_search.clipping, "choose_clips", "clip")
    spy(Dispatch, "linears", "linears")
    _quantize(run_cli, moe, tmp_path / "q", monkeypatch, *(["--smooth-quant", alpha] if alpha else []))
    layers = [e for e in "|".join(events).split("|take") if e.strip("|")]
    assert len(layers) == json.loads((moe / "config.json").read_text())["num_hidden_layers"]
    for layer in layers:
        order = [e for e in layer.split("|") if e]
        assert {"start", "fold", "clip", "linears"} <= set(order), order
        if alpha is None:
            assert order.index("start") < order.index("fold") < order.index("clip") < order.index("linears"), order
        else:
            assert order.index("fold") < order.index("clip") < order.index("linears") < order.index("start"), order


def test_statistics_a_fold_cannot_rescale_still_get_their_own_probe(run_cli, llama, tmp_path, monkeypatch):
    """A histogram observer (--act-method mse) cannot follow a per-channel fold: the layer probes first, as before."""
    summary, calls = _quantize(run_cli, llama, tmp_path / "q", monkeypatch, "--act-method", "mse")
    layers = json.loads((llama / "config.json").read_text())["num_hidden_layers"]
    assert calls == 2 * layers * summary["forward"]["batches"]


def test_one_forward_writes_what_two_did(run_cli, llama, tmp_path, monkeypatch):
    """The same output as with the smoothing probe's forward of its own, up to the float rounding of the
    rescaled statistics: the same types and folds, int8 weights and scales equal or next to each other."""
    _quantize(run_cli, llama, tmp_path / "one", monkeypatch)
    monkeypatch.setattr(smooth_layer, "one_forward", lambda *a: False)
    _quantize(run_cli, llama, tmp_path / "two", monkeypatch)
    desc = [json.loads((tmp_path / d / "quant_model_description.json").read_text()) for d in ("one", "two")]
    assert desc[0] == desc[1]
    tensors = []
    for d in ("one", "two"):
        with safe_open(str(next((tmp_path / d).glob("quant_model_weight*.safetensors"))), "pt") as f:
            tensors.append({k: f.get_tensor(k) for k in f.keys()})
    assert tensors[0].keys() == tensors[1].keys()
    for name, a in tensors[0].items():
        b = tensors[1][name]
        if a.dtype == torch.int8:
            assert (a.int() - b.int()).abs().max() <= 1 and (a != b).float().mean() < 1e-3, name
        else:
            assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-6), name
