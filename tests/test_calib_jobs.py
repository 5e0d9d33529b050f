"""The calibrated path's jobs (dsconv.quant.calib_jobs): `quantize --bits 8` and `--method gptq` write the same bytes
inline (--workers 1), on two local processes and on a local Ray, for a dense model and a MoE model - per-linear jobs
and per-routed-expert jobs (forward, statistics, quantization), under-covered experts finished by the driver."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import dsconv.exec as dexec
from tests.test_exec import tree

FAST = ["--calib-samples", "12", "--seq-len", "48"]
# (name, model key, CLI args)
CASES = [
    ("bits8-llama", "llama", ["--bits", "8", *FAST]),
    ("bits8-moe", "moe", ["--bits", "8", "--moe-scheme", "w8a8", "--min-expert-tokens", "150", *FAST]),
    ("gptq-llama", "llama", ["--scheme", "w4a16", "--method", "gptq", "--group-size", "16", *FAST]),
    ("gptq-moe", "moe", ["--scheme", "w4a16", "--method", "gptq", "--group-size", "16", *FAST]),
    ("awq-llama", "llama", ["--scheme", "w4a16", "--method", "awq", "--group-size", "16", *FAST]),  # driver's choice
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from dsconv.bundled import calib_texts
    from dsconv.tiny import make_tiny, train_tokenizer

    tok = train_tokenizer(calib_texts(), vocab_size=384)
    root = tmp_path_factory.mktemp("cjmodels")
    return {"llama": make_tiny("llama", root / "llama", dtype="bf16", tokenizer=tok),
            "moe": make_tiny("qwen2_moe", root / "moe", dtype="bf16", tokenizer=tok)}


@pytest.fixture(scope="module")
def fan_out():
    old = dexec.INLINE_BELOW
    dexec.INLINE_BELOW = 0  # processes even for tiny models
    yield
    dexec.INLINE_BELOW = old


def _run(run_cli, out: Path, models, case, extra: list[str]) -> tuple[dict[str, str], dict]:
    name, key, args = case
    r = run_cli(["quantize", "--model", models[key], "--output", out, *args, *extra, "--json"])
    assert r.code == 0, r.err
    return tree(out), json.loads(r.out)


@pytest.fixture(scope="module")
def inline(run_cli, models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cjinline")
    return {c[0]: (*_run(run_cli, tmp / c[0], models, c, ["--workers", "1"]), tmp / c[0]) for c in CASES}


def test_the_cases_exercise_the_jobs(inline):
    """Calibrated (job timings present); in the MoE case some experts under-covered (their ranges borrowed and
    finished by the driver) and others quantized in their own job - or the identity below would prove less."""
    for name, (files, summary, out) in inline.items():
        assert summary["execution"] == {"executor": "inline", "workers": 1, "ran": "inline"}, name
        assert summary["timings"]["jobs_wall"] > 0, name
    report = json.loads((inline["bits8-moe"][2] / "quant_report.json").read_text())
    experts = {m: v for m, v in report["linears"].items() if ".experts." in m}
    ranges = [v.get("range") for v in experts.values()]
    assert 0 < ranges.count("borrowed") < len(ranges), ranges


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_two_processes_write_the_same_bytes(case, inline, run_cli, models, tmp_path, fan_out):
    files, summary = _run(run_cli, tmp_path / "o", models, case, ["--workers", "2"])
    assert summary["execution"] == {"executor": "local", "workers": 2, "ran": "local"}
    assert files == inline[case[0]][0]


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray for the module, shut down after it (test_exec's own checks start without one)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_local_ray_writes_the_same_bytes(case, inline, run_cli, models, tmp_path, fan_out, ray_local):
    files, summary = _run(run_cli, tmp_path / "o", models, case, ["--executor", "ray", "--workers", "2"])
    assert summary["execution"] == {"executor": "ray", "workers": 2, "ran": "ray"}
    assert files == inline[case[0]][0]


def test_job_statistics_are_never_plainly_unpickled(tmp_path):
    """A statistics file swapped into the shared job directory cannot run code: only dsconv's classes load."""
    import pickle

    import torch

    from dsconv.quant.calib_jobs import _load_stats
    from dsconv.quant.stats import InputStats

    class Evil:
        def __reduce__(self):
            import os
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    bad = tmp_path / "stats.pt"
    torch.save(Evil(), bad)
    with pytest.raises(pickle.UnpicklingError):
        _load_stats(str(bad))
    assert not (tmp_path / "pwned").exists()
    good = tmp_path / "good.pt"
    st = InputStats(8, "x", "minmax", hessian=True, sample_tokens=4)
    st.update(torch.randn(16, 8))
    torch.save(st, good)
    back = _load_stats(str(good))
    assert back.tokens == 16 and torch.equal(back.sample, st.sample)
