"""`dsconv demo`: the whole pipeline, as a newcomer runs it, in a fresh process; every output verifies."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cli]


@pytest.fixture(scope="module")
def demo_dir(demo_workspace) -> Path:
    return demo_workspace  # run once per session (tests/conftest.py), shared with the golden outputs


def test_demo_runs_every_stage(demo_dir):
    out = (demo_dir / "demo-stdout.txt").read_text()
    assert "skipping" not in out, out
    for cmd in ("$ dsconv inspect", "$ dsconv export", "$ dsconv export --format mindir", "$ dsconv quantize --bits 8",
                "$ dsconv eval", "$ dsconv shard", "$ dsconv atc --soc Ascend910B", "$ dsconv atc --soc Ascend310P3",
                "$ dsconv export --quantized out/quant", "--onnx out/onnx_int8/model_deploy.onnx"):
        assert cmd in out, cmd
    assert (demo_dir / "dsconv.toml").is_file()


@pytest.mark.parametrize("stage", ["onnx", "mindir", "quant", "shard", "atc", "onnx_int8", "atc_int8"])
def test_demo_outputs_verify(demo_dir, stage, run_cli):
    d = demo_dir / "out" / stage
    assert (d / "dsconv_manifest.json").is_file(), sorted(p.name for p in (demo_dir / "out").iterdir())
    r = run_cli(["verify", d])
    assert r.code == 0, r.err


def test_demo_model_is_what_the_issue_says(demo_dir):
    cfg = json.loads((demo_dir / "model" / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["n_routed_experts"] == 16 and cfg["n_shared_experts"] == 1
    assert cfg["first_k_dense_replace"] == 1 and cfg["kv_lora_rank"] > 0
    assert (demo_dir / "model" / "tokenizer.json").is_file()


def test_demo_int8_path(demo_dir):
    """quantize (static W8A8 attention) -> fake-quant + deploy ONNX -> 310P3 profile with INT8 and static gears."""
    info = json.loads((demo_dir / "out" / "onnx_int8" / "export_info.json").read_text())
    assert info["check"]["passed"] and info["deploy"]["AscendQuant"] == info["linears"]["W8A8"] > 0
    prof = json.loads((demo_dir / "out" / "atc_int8" / "Ascend310P3" / "profile.json").read_text())
    assert prof["int8"]["precision"] == "INT8" and prof["int8"]["AscendQuant"] == info["deploy"]["AscendQuant"]
    gears = prof["int8"]["gears"]
    assert len(gears) == 6 and all("-1" not in g["input_shape"] for g in gears)  # 310P3 default: 2 batch x 3 seq
    script = (demo_dir / "out" / "atc_int8" / "Ascend310P3" / "atc.sh").read_text()
    assert all(f"bash atc_{g['gear']}.sh" in script for g in gears)
    assert prof["atc_options"]["op_select_implmode"] == "high_performance"
