"""Shared fixtures: tiny checkpoints of every family and the demo workspace (each built once per session) and an
in-process CLI runner."""
from __future__ import annotations

import contextlib
import io
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

os.environ.setdefault("GLOG_v", "3")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class CliResult:
    code: int
    out: str
    err: str


def _run_cli(args: list[str], cwd: Path | None = None) -> CliResult:
    from dsconv.cli import main

    out, err = io.StringIO(), io.StringIO()
    old = Path.cwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main([str(a) for a in args])
                code = 0
            except SystemExit as e:
                code = int(e.code or 0)
    finally:
        os.chdir(old)
    return CliResult(code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models: a parallel region costs more than the matmul (and a time slice when the other core is busy).
    A module opts in with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def run_cli() -> Callable[..., CliResult]:
    """`run_cli(["inspect", "--model", d], cwd=...)` -> CliResult(code, out, err), exit codes as the shell sees them."""
    return _run_cli


@pytest.fixture(scope="session")
def demo_workspace(tmp_path_factory) -> Path:
    """`dsconv demo DIR` run once per session, in a fresh process as a newcomer runs it: DIR holds the workspace,
    `model/`, `out/<stage>` and the run's stdout in `demo-stdout.txt`. The demo's own tests and the golden outputs
    share it; DIR is `<root>/demo` because the golden hashes name the demo's files relative to `<root>`."""
    import subprocess
    import sys

    d = tmp_path_factory.mktemp("demo-session") / "demo"
    env = {**os.environ, "GLOG_v": "3"}
    p = subprocess.run([sys.executable, "-m", "dsconv", "demo", str(d)], capture_output=True, text=True, env=env,
                       cwd=d.parent, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (d / "demo-stdout.txt").write_text(p.stdout)
    return d


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Callable[..., Path]:
    """`tiny_model("mixtral", fused=True, dtype="bf16", **config_overrides)` -> a saved checkpoint dir (cached)."""
    from dsconv.tiny import make_tiny

    cache: dict[tuple, Path] = {}

    def get(family: str, fused: bool = False, dtype: str | None = None, seed: int = 0, **overrides) -> Path:
        key = (family, fused, dtype, seed, tuple(sorted(overrides.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{family}{'-fused' if fused else ''}")
            cache[key] = make_tiny(family, d, seed=seed, fused=fused, dtype=dtype, **overrides)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def calib_models(tmp_path_factory) -> dict[str, Path]:
    """A tiny llama and a tiny qwen2_moe in bf16 with a tokenizer trained on the bundled calibration text: what the
    calibrated path's tests quantize. Expert and shared MLPs 64 wide: W4A16 groups of 64 (MindIE runs 0, 64, 128,
    256)."""
    from dsconv.bundled import calib_texts
    from dsconv.tiny import make_tiny, train_tokenizer

    tok = train_tokenizer(calib_texts(), vocab_size=384)
    root = tmp_path_factory.mktemp("calibmodels")
    return {"llama": make_tiny("llama", root / "llama", dtype="bf16", tokenizer=tok),
            "moe": make_tiny("qwen2_moe", root / "moe", dtype="bf16", tokenizer=tok, moe_intermediate_size=64,
                             shared_expert_intermediate_size=64)}


def hf_from_pretrained(model_dir: Path, **kwargs):
    """transformers' own `from_pretrained`, its config object made by dsconv.families.facts.hf_config: Kimi-K2's
    config.json names remote code in auto_map (from_pretrained alone asks to run it); nothing else differs."""
    from transformers import AutoModelForCausalLM

    from dsconv.families.facts import hf_config

    config = hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    return AutoModelForCausalLM.from_pretrained(model_dir, config=config, trust_remote_code=False, **kwargs).eval()


def write_raw_safetensors(path: Path, header: dict, data: bytes, header_len: int | None = None) -> Path:
    """A safetensors file with an arbitrary (possibly malicious) header, for attack tests."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


def copy_model(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst
