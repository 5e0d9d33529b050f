"""`quantize --calib-precision bf16`: the calibration forward's matmuls in bf16 (torch's CPU autocast; AMX runs them
5-6x faster than float32 per core), routers, statistics, searches and fallback checks in float32. Its accuracy is
judged on real models in benchmarks/bench_fidelity.py (the "--calib-precision bf16" rows beside their float32 rows);
here: where bf16 applies and where it must not, that the statistics move only by bf16 rounding, that the default
writes what it wrote before, and the refusals."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.cli
FAST = ["--bits", "8", "--calib-samples", "16", "--seq-len", "64"]


@pytest.fixture(scope="module")
def models(calib_models):
    return calib_models  # conftest.py: a tiny llama and a tiny qwen2_moe with a trained tokenizer


def test_bf16_reaches_the_layers_matmuls_but_not_the_router(models):
    from dsconv.checkpoint import Checkpoint
    from dsconv.quant.calibrate.context import forward_matmuls
    from dsconv.quant.plan.options import QuantOptions
    from dsconv.runner.layers import Skeleton

    sk = Skeleton(Checkpoint.open(models["moe"]))
    layer = sk.materialise(0)
    seen: dict[str, torch.dtype] = {}

    def record(name: str):
        def hook(mod, args, y) -> None:
            seen[name] = (y[0] if isinstance(y, tuple) else y).dtype
        return hook

    hooks = [m.register_forward_hook(record(n)) for n, m in layer.named_modules()
             if n in ("self_attn.q_proj", "mlp.gate", "mlp.shared_expert.down_proj")]
    x = torch.randn(2, 7, sk.model.config.hidden_size)
    bound = layer.mlp.gate.forward
    for precision, want in ((None, torch.float32), ("bf16", torch.bfloat16)):
        seen.clear()
        with torch.no_grad(), forward_matmuls(QuantOptions(calib_precision=precision), sk, layer):
            y = layer(x, **sk.layer_inputs(x, layer))
        y = y[0] if isinstance(y, tuple) else y
        assert seen == {"self_attn.q_proj": want, "mlp.gate": torch.float32,
                        "mlp.shared_expert.down_proj": want}, (precision, seen)
        assert y.dtype == torch.float32  # the residual stream stays float32
    assert "forward" not in layer.mlp.gate.__dict__ and layer.mlp.gate.forward == bound  # the wrapper is gone
    for h in hooks:
        h.remove()


def _run(run_cli, model, out, *extra):
    r = run_cli(["quantize", "-m", model, "-o", out, *FAST, *extra])
    assert r.code == 0, r.err
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors, json.loads((out / "quant_report.json").read_text())


@pytest.mark.parametrize("key", ["llama", "moe"])
def test_bf16_statistics_move_by_bf16_rounding_only(key, models, run_cli, tmp_path):
    """The same plan and types; activation scales within a few bf16 steps of the float32 run's (a clip ratio may
    move one step, a near-tied token change its expert), but not all equal: the forward did run in bf16."""
    extra = ["--moe-scheme", "w8a8", "--min-expert-tokens", "0"] if key == "moe" else []
    a, ra = _run(run_cli, models[key], tmp_path / "fp32", *extra)
    b, rb = _run(run_cli, models[key], tmp_path / "bf16", *extra, "--calib-precision", "bf16")
    assert a.keys() == b.keys()
    assert {m: v["type"] for m, v in ra["linears"].items()} == {m: v["type"] for m, v in rb["linears"].items()}
    scales = [n for n in a if n.endswith(".input_scale")]
    rel = np.array([abs(b[n].item() / a[n].item() - 1) for n in scales])
    assert scales and (rel > 0).any(), "bf16 changed no activation scale: did the forward run in bf16?"
    assert np.median(rel) < 0.005 and rel.max() < 0.10, sorted(rel)[-5:]
    # the fallback check's reference outputs are float32 in both runs (an expert's are recomputed from its rows, not
    # taken from its bf16 forward): the weight-only error, a function of the rows and weights alone, agrees (with
    # the experts' bf16 outputs as reference it measured 6% higher)
    for part in ("experts", "others"):
        ratio = np.array([rb["linears"][m]["output_error"]["weight_only"] / v["output_error"]["weight_only"]
                          for m, v in ra["linears"].items() if v.get("output_error", {}).get("weight_only")
                          and ((".experts." in m) == (part == "experts"))])
        if ratio.size:
            assert abs(np.median(ratio) - 1) < 0.02 and np.abs(ratio - 1).max() < 0.25, (part, sorted(ratio))
    assert key != "moe" or any(".experts." in m for m in ra["linears"])


def test_the_manifest_records_the_precision_that_ran_auto_resolved_for_this_host(models, run_cli, tmp_path):
    from dsconv.quant.calibrate.context import auto_precision

    here = auto_precision()  # fp32-onednn on an AMD host, float32 through MKL on an Intel one
    auto = None if here == "fp32" else here
    for extra, want in (([], auto), (["--calib-precision", "auto"], auto),
                        (["--calib-precision", "bf16"], "bf16"), (["--calib-precision", "fp32"], None),
                        (["--calib-precision", "fp32-onednn"], "fp32-onednn")):
        out = tmp_path / "-".join(["default", *extra])
        assert run_cli(["quantize", "-m", models["llama"], "-o", out, *FAST, *extra]).code == 0
        opts = json.loads((out / "dsconv_manifest.json").read_text())["options"]
        assert opts.get("calib_precision") == want and ("calib_precision" in opts) == (want is not None), opts
    out = tmp_path / "weight-only"  # no calibration: auto resolves to nothing, and the manifest says nothing
    assert run_cli(["quantize", "-m", models["llama"], "-o", out, "--scheme", "w8a16", "--method", "rtn",
                    "--calib-precision", "auto"]).code == 0
    assert "calib_precision" not in json.loads((out / "dsconv_manifest.json").read_text())["options"]


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_bf16_is_refused_where_the_forward_computes_a_hessian_or_a_search(method, models, run_cli, tmp_path):
    r = run_cli(["quantize", "-m", models["llama"], "-o", tmp_path / "q", "--scheme", "w4a16", "--group-size", "64",
                 "--method", method, "--calib-precision", "bf16", "--calib-samples", "4"])
    assert r.code == 2 and f"--method {method}" in r.err and "float32" in r.err, r.err
    assert "Traceback" not in r.err and not (tmp_path / "q").exists()


def test_native_bf16_is_read_from_the_cpu_flags(tmp_path):
    from dsconv.runtime.process import cpu_flags, native_bf16_matmul

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f amx_bf16 amx_tile\n")
    assert {"amx_bf16", "avx512f"} <= cpu_flags(str(info)) and native_bf16_matmul(cpu_flags(str(info)))
    assert not native_bf16_matmul({"fpu", "avx2", "avx512f"}) and native_bf16_matmul({"avx512_bf16"})
    assert cpu_flags(str(tmp_path / "absent")) == set()


def test_auto_picks_onednn_only_where_mkl_runs_its_generic_code(tmp_path, monkeypatch):
    """MKL dispatches its fast kernels on Intel's vendor string: an AMD or Hygon x86 host gets float32 through
    oneDNN; Intel, ARM (Kunpeng) and a host whose vendor cannot be read keep torch's own float32."""
    from dsconv.quant.calibrate import context
    from dsconv.runtime.process import cpu_vendor

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx512f\n")
    assert cpu_vendor(str(info)) == "AuthenticAMD" and cpu_vendor(str(tmp_path / "absent")) is None
    if not context.onednn_available() or not torch.backends.mkl.is_available():
        pytest.skip("this torch lacks oneDNN or MKL")
    for vendor, machine, want in (("AuthenticAMD", "x86_64", "fp32-onednn"), ("HygonGenuine", "x86_64", "fp32-onednn"),
                                  ("GenuineIntel", "x86_64", "fp32"), ("AuthenticAMD", "aarch64", "fp32"),
                                  ("", "x86_64", "fp32")):
        assert context.auto_precision(vendor, machine) == want, (vendor, machine)
    monkeypatch.setattr("dsconv.runtime.process.cpu_vendor", lambda: None)  # no vendor to read: torch's own
    assert context.auto_precision(None, "x86_64") == "fp32"


def _operands() -> tuple[torch.Tensor, ...]:
    """x, w, b and F.linear's result through oneDNN and through MKL, which the tests can tell apart."""
    from dsconv.quant.calibrate.context import onednn_available

    if not onednn_available():
        pytest.skip("this torch has no oneDNN")
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(300, 896, generator=g), torch.randn(1024, 896, generator=g), torch.randn(1024, generator=g)
    onednn = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    mkl = torch.addmm(b, x, w.t())
    assert not torch.equal(onednn, mkl)  # the two libraries sum in different orders: the test can tell them apart
    return x, w, b, onednn, mkl


def test_float32_linears_run_on_onednn_whatever_the_thread_count():
    """`--calib-precision fp32-onednn` sends the forward's `F.linear` to oneDNN (2x MKL's sgemm on an AMD host), with
    bits that do not follow the thread count - a forward job on one thread must write the driver's bytes - and
    leaves everything else to torch: the default float32, other dtypes, autograd."""
    import torch.nn.functional as F

    from dsconv.quant.calibrate.context import forward_matmuls
    from dsconv.quant.plan.options import QuantOptions
    from dsconv.runner.layers import plain_linear

    x, w, b, onednn, mkl = _operands()
    lin = torch.nn.Linear(896, 1024).requires_grad_(False)
    lin.weight.copy_(w)
    lin.bias.copy_(b)
    threads, outs = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with torch.no_grad(), forward_matmuls(QuantOptions(calib_precision="fp32-onednn")):
                outs += [F.linear(x, w, b), lin(x)]
                assert torch.equal(F.linear(x.double(), w.double()), x.double() @ w.double().t())  # not float32
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, onednn) for o in outs)
    with forward_matmuls(QuantOptions(calib_precision="fp32-onednn")):  # autograd on: torch's own linear
        assert torch.equal(F.linear(x, w, b), mkl)
    with torch.no_grad(), forward_matmuls(QuantOptions(calib_precision=None)):  # fp32: torch's own (MKL)
        assert torch.equal(F.linear(x, w, b), mkl)
    assert torch.equal(F.linear(x, w, b), mkl)  # outside the block: torch's own again
    assert torch.equal(plain_linear(0, "gate", x, w), x @ w.T)  # the experts' projection: the same sgemm as before


def test_a_workers_jobs_run_their_linears_on_onednn_too():
    """A worker process starts with autograd on (the driver calibrates under no_grad). A job's block
    (`job_threads`, which every linear, expert and forward job enters) must still send its float32 linears to
    oneDNN: without it two workers ran their experts through MKL, at half the inline run's speed, and with other
    bits."""
    import torch.nn.functional as F

    from dsconv.quant.calibrate.calib_jobs import job_threads
    from dsconv.quant.calibrate.context import forward_matmuls
    from dsconv.quant.plan.options import QuantOptions

    x, w, b, onednn, _ = _operands()
    assert torch.is_grad_enabled()  # as in a fresh worker
    with job_threads(1), forward_matmuls(QuantOptions(calib_precision="fp32-onednn")):
        assert torch.equal(F.linear(x, w, b), onednn)
    assert torch.is_grad_enabled()  # the job's block leaves the process as it found it


@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel"])
def test_an_unresolved_auto_means_what_it_means_to_the_stage(vendor, monkeypatch):
    """The stage resolves `auto` before the forward; a caller that hands the forward an unresolved one gets the
    same library: oneDNN where MKL runs its generic code (an AMD host), MKL on Intel's."""
    import platform

    import torch.nn.functional as F

    from dsconv.quant.calibrate.context import forward_matmuls
    from dsconv.quant.plan.options import QuantOptions

    x, w, b, onednn, mkl = _operands()
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkl.is_available():
        pytest.skip("auto picks oneDNN only on an x86 host with MKL")
    monkeypatch.setattr("dsconv.runtime.process.cpu_vendor", lambda: vendor)
    with torch.no_grad(), forward_matmuls(QuantOptions(calib_precision="auto")):
        assert torch.equal(F.linear(x, w, b), onednn if vendor == "AuthenticAMD" else mkl)
