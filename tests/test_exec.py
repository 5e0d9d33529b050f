"""The executor (dsconv.executor): outputs are byte-identical whoever runs the jobs - inline (--workers 1), two local
processes, or a local Ray instance - for weight-only quantize, the FP8 -> BF16 cast and shard writing (ranks and
MindIE folders); the executor's contract (order, errors, a missing Ray) on its own."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import dsconv.executor as dexec
from dsconv.errors import UserError

pytestmark = [pytest.mark.cli, pytest.mark.slow]

# report keys that legitimately vary run to run
VARYING = ("seconds", "time", "timing", "rss", "throughput", "created", "command", "versions")


def drop_varying(obj):
    if isinstance(obj, dict):
        return {k: drop_varying(v) for k, v in obj.items() if not any(t in k.lower() for t in VARYING)}
    if isinstance(obj, list):
        return [drop_varying(v) for v in obj]
    return obj


def tree(out: Path) -> dict[str, str]:
    """Every file's sha256; the manifest by its per-file digests (JSON files' as "-": they are compared on their own,
without timings - quant_report.json records each calibration step's seconds), JSON reports without timings."""
    res = {}
    for p in sorted(out.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(out).as_posix()
        if p.name == "dsconv_manifest.json":
            files = json.loads(p.read_text())["files"]
            data = json.dumps({k: "-" if k.endswith(".json") else v for k, v in files.items()},
                              sort_keys=True).encode()
        elif p.suffix == ".json":
            data = json.dumps(drop_varying(json.loads(p.read_text().replace(str(out), "<OUT>"))), sort_keys=True).encode()
        else:
            data = p.read_bytes()
        res[rel] = hashlib.sha256(data).hexdigest()
    return res


@pytest.fixture(scope="module")
def fan_out():
    """Processes even for tiny jobs (they would run inline below INLINE_BELOW)."""
    old = dexec.INLINE_BELOW
    dexec.INLINE_BELOW = 0
    yield
    dexec.INLINE_BELOW = old


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray instance for the module (its start-up is paid once)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory):
    from dsconv.tiny import write_fp8_checkpoint

    fp8 = tmp_path_factory.mktemp("fp8x") / "model"
    write_fp8_checkpoint(tiny_model("deepseek_v3"), fp8, block=(16, 16), max_part_tensors=9)
    return {"llama": tiny_model("llama", dtype="bf16"), "moe": tiny_model("qwen2_moe", dtype="bf16"),
            "fp8": fp8, "ds": tiny_model("deepseek_v3", dtype="bf16")}


# (name, model key, CLI args); small --max-shard-size gives several parts per output
CASES = [
    ("w8a16", "llama", ["quantize", "--scheme", "w8a16", "--max-shard-size", "60KB"]),
    ("w4a16", "llama", ["quantize", "--scheme", "w4a16", "--method", "rtn", "--group-size", "64",
                        "--max-shard-size", "40KB"]),
    ("w8a8dyn-moe", "moe", ["quantize", "--scheme", "w8a8_dynamic", "--smooth-quant", "off",
                            "--max-shard-size", "100KB"]),
    ("fp8-cast", "fp8", ["export", "--format", "safetensors"]),
    ("shard-ranks", "moe", ["shard", "--ep", "2", "--tp", "2", "--format", "ranks", "--max-shard-size", "50KB"]),
    ("shard-mindie", "ds", ["shard", "--ep", "2", "--tp", "2", "--format", "mindie"]),
]


def _run(run_cli, tmp: Path, models, case, extra: list[str]) -> tuple[dict[str, str], dict]:
    name, key, args = case
    out = tmp / name
    r = run_cli([args[0], "--model", models[key], "--output", out, *args[1:], *extra, "--json"])
    assert r.code == 0, r.err
    summary = json.loads(r.out)
    return tree(out), summary


def args_of(case) -> list[str]:
    return case[2]


def _ran(summary: dict) -> dict:
    return summary.get("execution") or summary["output"]["execution"]


@pytest.fixture(scope="module")
def inline(run_cli, models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inline")
    return {c[0]: _run(run_cli, tmp, models, c, ["--workers", "1"]) for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_two_processes_write_the_same_bytes(case, inline, run_cli, models, tmp_path, fan_out):
    files, summary = _run(run_cli, tmp_path, models, case, ["--workers", "2"])
    want, first = inline[case[0]]
    assert _ran(first) == {"executor": "inline", "workers": 1, "ran": "inline"}
    # weight-only quantization runs outside the GIL: its jobs go to threads of the driver, the rest to processes
    ran = "threads" if args_of(case)[0] == "quantize" else "local"
    assert _ran(summary) == {"executor": "local", "workers": 2, "ran": ran}
    assert files == want
    assert sum(f.endswith(".safetensors") for f in files) >= 2


def test_cli_starts_and_stops_its_own_local_ray(inline, run_cli, models, tmp_path, fan_out):
    """Without a Ray in the process, `--executor ray` starts a local instance and shuts it down when done (runs
    before the module's shared instance starts)."""
    import ray

    assert not ray.is_initialized()
    files, summary = _run(run_cli, tmp_path, models, CASES[0], ["--executor", "ray", "--workers", "2"])
    assert _ran(summary) == {"executor": "ray", "workers": 2, "ran": "ray"}
    assert files == inline[CASES[0][0]][0]
    assert not ray.is_initialized()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_local_ray_writes_the_same_bytes(case, inline, run_cli, models, tmp_path, fan_out, ray_local):
    files, summary = _run(run_cli, tmp_path, models, case, ["--executor", "ray", "--workers", "2"])
    assert _ran(summary) == {"executor": "ray", "workers": 2, "ran": "ray"}
    assert files == inline[case[0]][0]


def test_parts_are_real_jobs(inline):
    """The cases must exercise several jobs, or the identity above proves nothing."""
    for name, (files, _) in inline.items():
        assert sum(f.endswith(".safetensors") for f in files) >= 2, name


# ---- the executor's contract -----------------------------------------------------------------------------------
def _square(x: int) -> int:
    return x * x


def _fail(x: int) -> int:
    if x == 3:
        raise UserError(f"job {x} is bad", hint="fix job 3")
    return x


def test_results_come_back_in_order(fan_out):
    with dexec.make_executor(dexec.ExecOptions(workers=2)) as ex:
        assert list(ex.map(_square, range(20))) == [x * x for x in range(20)]
        assert ex.summary()["ran"] == "local"


def _touch(path: str) -> str:
    Path(path).touch()
    return path


def test_the_first_jobs_run_before_any_result_is_taken(fan_out, tmp_path):
    """`map` submits its first `ahead` jobs at the call, so they run while the caller does other work (the driver's
    searches while a layer's expert jobs run); the rest wait until results are taken."""
    import time

    paths = [str(tmp_path / f"job{i}") for i in range(7)]
    with dexec.make_executor(dexec.ExecOptions(workers=2)) as ex:
        results = ex.map(_touch, paths, ahead=4)
        deadline = time.monotonic() + 60
        while not all(Path(p).exists() for p in paths[:4]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(Path(p).exists() for p in paths[:4])
        assert not any(Path(p).exists() for p in paths[4:])
        assert list(results) == paths


def test_a_task_user_error_reaches_the_driver_whole(fan_out):
    with dexec.make_executor(dexec.ExecOptions(workers=2)) as ex:
        with pytest.raises(UserError) as e:
            list(ex.map(_fail, range(6)))
    assert e.value.hint == "fix job 3" and e.value.exit_code == 2


def test_small_work_stays_inline(monkeypatch):
    monkeypatch.setattr(dexec, "INLINE_BELOW", 64 * 2**20)
    with dexec.make_executor(dexec.ExecOptions(workers=2)) as ex:
        assert list(ex.map(_square, [1, 2], work_bytes=10)) == [1, 4]
        assert ex.summary()["ran"] == "inline"


def test_warm_starts_every_worker_before_the_first_job(fan_out):
    """`warm` starts the pool on a thread and each worker imports the job modules: by the first map the workers are
    up (a calibrated run's forkserver start overlaps the tokenizer's load), and the jobs still run in order."""
    with dexec.make_executor(dexec.ExecOptions(workers=2)) as ex:
        ex.warm(work_bytes=1, modules=("decimal",))
        ex._join_warm()
        assert len(ex._pool._processes) == 2
        assert list(ex.map(_square, range(6))) == [x * x for x in range(6)]


def test_warm_leaves_small_work_and_one_worker_alone(monkeypatch):
    monkeypatch.setattr(dexec, "INLINE_BELOW", 64 * 2**20)
    for workers, work in ((2, 10), (1, 2**30)):
        with dexec.make_executor(dexec.ExecOptions(workers=workers)) as ex:
            ex.warm(work_bytes=work, modules=("decimal",))
            assert getattr(ex, "_warming", None) is None and getattr(ex, "_pool", None) is None


def test_only_a_calibrated_quantize_warms_its_workers(monkeypatch, run_cli, calib_models, tmp_path):
    calls = []
    monkeypatch.setattr(dexec.ProcessExecutor, "warm", lambda self, work_bytes=None, modules=(): calls.append(
        (work_bytes, tuple(modules))))
    r = run_cli(["quantize", "-m", calib_models["llama"], "--bits", "8", "-o", tmp_path / "c", "--workers", "2",
                 "--calib-samples", "8", "--seq-len", "32"])
    assert r.code == 0, r.err
    assert len(calls) == 1 and calls[0][0] > 0 and calls[0][1] == ("dsconv.quant.calibrate.calib_jobs",)
    r = run_cli(["quantize", "-m", calib_models["llama"], "--scheme", "w8a16", "--method", "rtn", "-o", tmp_path / "w",
                 "--workers", "2"])
    assert r.code == 0, r.err
    assert len(calls) == 1


def test_bad_options_are_user_errors(run_cli, models, tmp_path):
    r = run_cli(["quantize", "-m", models["llama"], "--scheme", "w8a16", "-o", tmp_path / "q", "--ray-address",
                 "auto"])
    assert r.code == 2 and "--ray-address applies to --executor ray" in r.err
    r = run_cli(["shard", "-m", models["moe"], "--ep", "2", "--tp", "2", "-o", tmp_path / "s", "--workers", "0"])
    assert r.code == 2


def test_missing_ray_is_exit_2(monkeypatch, run_cli, models, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    r = run_cli(["quantize", "-m", models["llama"], "--scheme", "w8a16", "-o", tmp_path / "q", "--executor", "ray"])
    assert r.code == 2 and "pip install 'dsconv[ray]'" in r.err
    assert not (tmp_path / "q").exists()


def test_workspace_defaults(run_cli, models, tmp_path):
    (tmp_path / "dsconv.toml").write_text(f'[workspace]\nmodel = "{models["llama"]}"\noutput = "out"\n'
                                          '[defaults]\nworkers = 1\n')
    r = run_cli(["quantize", "--scheme", "w8a16", "--json"], cwd=tmp_path)
    assert r.code == 0, r.err
    assert json.loads(r.out)["execution"]["workers"] == 1
    (tmp_path / "dsconv.toml").write_text(f'[workspace]\nmodel = "{models["llama"]}"\noutput = "out"\n'
                                          '[defaults]\nworkers = "many"\n')
    r = run_cli(["quantize", "--scheme", "w8a16", "--force"], cwd=tmp_path)
    assert r.code == 2 and "workers = 'many'" in r.err
