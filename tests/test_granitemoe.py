"""Granite-MoE: a real architecture whose checkpoint stores each layer's experts as Granite's own 3-D tensors
(`block_sparse_moe.input_linear` / `output_linear`) and its router under `router.layer`, added as one family file.
Every stage takes it or refuses it with the reason (inspect, ONNX export and both fused layouts are also covered by
the per-family parametrisations of test_families_inspect.py, test_export_onnx.py and test_mindir.py)."""
from __future__ import annotations

import pytest

from dsconv.checkpoint import Checkpoint

pytestmark = [pytest.mark.cli]


def test_granite_3d_experts_on_disk_read_as_per_expert_byte_ranges(tiny_model):
    from safetensors import safe_open

    d = tiny_model("granitemoe")
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        on_disk = set(f.keys())
        fused = f.get_tensor("model.layers.0.block_sparse_moe.input_linear.weight")
        down = f.get_tensor("model.layers.0.block_sparse_moe.output_linear.weight")
    assert "model.layers.0.block_sparse_moe.router.layer.weight" in on_disk
    ck = Checkpoint.open(d)
    inter = fused.shape[1] // 2
    for e in (0, fused.shape[0] - 1):
        P = f"model.layers.0.block_sparse_moe.experts.{e}"
        assert ck.load(P + ".gate_proj.weight").equal(fused[e, :inter])
        assert ck.load(P + ".up_proj.weight").equal(fused[e, inter:])
        assert ck.load(P + ".down_proj.weight").equal(down[e])
        assert ck.role(P + ".gate_proj.weight").role.value == "expert_in"


def test_quantize_is_refused_with_the_reason(tiny_model, run_cli, tmp_path):
    r = run_cli(["quantize", "-m", tiny_model("granitemoe"), "--bits", "8", "-o", tmp_path / "q"])
    assert r.code == 2 and "input_linear" in r.err and "MindIE" in r.err and not (tmp_path / "q").exists()


def test_shard_writes_ranks_that_reassemble_the_3d_tensors(tiny_model, run_cli, tmp_path):
    out = tmp_path / "s"
    r = run_cli(["shard", "-m", tiny_model("granitemoe"), "--ep", "2", "--tp", "1", "--format", "ranks", "-o", out])
    assert r.code == 0, r.err
    v = run_cli(["verify", out])
    assert v.code == 0 and "shard check passed" in v.out
