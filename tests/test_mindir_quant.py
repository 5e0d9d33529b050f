"""MindIR export of quantized and FP8 inputs: int8/int4 weights stay int8 in the MindIR and are dequantized in the
graph; the check compares with transformers on the dequantized weights.

The quantized directories are written here in the msModelSlim layout (docs/formats.md) with dsconv's own
quantization math, independent of `dsconv quantize` (whose output has its own test below).
"""
from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mindspore")

from dsconv.checkpoint import Checkpoint  # noqa: E402
from dsconv.convert.mindir import export_mindir  # noqa: E402
from dsconv.errors import UserError  # noqa: E402
from dsconv.quant.algorithms.schemes import (pack_int4, pack_int4_along_k,  # noqa: E402
                                             quantize_weight_per_channel, quantize_weight_per_group,
                                             w8a8_static_params)

pytestmark = [pytest.mark.cli]


def write_quantized(src: Path, dst: Path, pick, group: int = 16) -> Path:
    """Quantize the linear weights of `src` into `dst` in the msModelSlim layout; `pick(role) -> type` chooses
    W8A16 (int8 per channel), W4A16 (int4 per group, packed [n/2, k]), W4A16_K (the older [n, k/2] packing),
    W8A8 (static activations) or FLOAT for each linear weight."""
    ck = Checkpoint.open(src)
    dst.mkdir(parents=True)
    tensors: dict[str, np.ndarray] = {}
    desc: dict[str, str] = {}
    for name, role in ck.roles.items():
        t = ck.load(name, dequantize=True)
        kind = pick(role) if role.role.quantized_by_default and role.param == "weight" else "FLOAT"
        p = name[: -len(".weight")]
        if kind == "W8A16":
            q, scale = quantize_weight_per_channel(t, 8, name)
            new = {name: q, p + ".weight_scale": scale, p + ".weight_offset": np.zeros_like(scale)}
        elif kind in ("W4A16", "W4A16_K"):
            q, scale, offset = quantize_weight_per_group(t, group if kind == "W4A16" else 0, 4, name)
            packed = pack_int4(q, name) if kind == "W4A16" else pack_int4_along_k(q, name)
            new = {name: packed, p + ".weight_scale": scale, p + ".weight_offset": offset}
            kind = "W4A16"
        elif kind == "W8A8":
            q, scale = quantize_weight_per_channel(t, 8, name)
            aux = w8a8_static_params(q, scale, 0.05, 3.0)
            new = {name: q, p + ".input_scale": np.array([0.05], np.float32),
                   p + ".input_offset": np.array([3.0], np.float32), p + ".deq_scale": aux["deq_scale"],
                   p + ".quant_bias": aux["quant_bias"]}
        else:
            new = {name: t.float().numpy().astype(np.float32)}
        tensors.update(new)
        desc.update({k: kind for k in new})
    types = set(desc.values()) - {"FLOAT"}
    header = {"model_quant_type": sorted(types)[0] if types else "FLOAT", "version": "1.0.0", "group_size": group}
    from safetensors.numpy import save_file

    save_file(tensors, dst / "quant_model_weights.safetensors", metadata={"format": "pt"})
    (dst / "quant_model_description.json").write_text(json.dumps({**header, **desc}, indent=2))
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def randomize_biases(model_dir: Path, seed: int = 0) -> Path:
    """dsconv.tiny leaves biases at zero, where a mis-mapped bias would still match: make them random."""
    import torch
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(seed)
    for part in model_dir.glob("*.safetensors"):
        tensors = load_file(part)
        for n in [n for n in tensors if n.endswith(".bias")]:
            tensors[n] = (torch.randn(tensors[n].shape, generator=g) * 0.2).to(tensors[n].dtype)
        save_file(tensors, part, metadata={"format": "pt"})
    return model_dir


def mindir_parameters(path: Path) -> dict[str, tuple[str, list[int]]]:
    """name (as in the checkpoint) -> (dtype name, dims) of every parameter stored in a MindIR file."""
    import mindspore as ms

    model = ms.load_mindir(str(path))
    out = {}
    for p in model.graph.parameter:
        out[p.name.split(":")[-1]] = (type(p).DataType.Name(p.data_type), list(p.dims))
    return out


def mixed(role) -> str:
    """W4A16 for the up projections and every linear of odd layers, W8A16 elsewhere (both kinds in every model);
    dense down projections of odd layers in the older int4 packing along k ([n, k/2], told apart by shape)."""
    if (role.layer or 0) % 2 == 1 and role.slot == "down" and role.expert is None:
        return "W4A16_K"
    return "W4A16" if role.slot == "up" or (role.layer or 0) % 2 == 1 else "W8A16"


@pytest.mark.parametrize("family", ["qwen2", "deepseek_v3"])
def test_weight_only_quantized_model_exports_int8(family, tiny_model, tmp_path, monkeypatch):
    src = randomize_biases(shutil.copytree(tiny_model(family), tmp_path / "float"))  # Qwen2's qkv biases
    quant = write_quantized(src, tmp_path / "quant", mixed)
    monkeypatch.chdir(tmp_path)
    s = export_mindir(quant, tmp_path / "out")
    check = s["check"]
    assert s["quantized"] and check["passed"] and check["max_abs_err"] < 1e-4, check
    assert s["linear_weights"]["W8A16"] > 0 and s["linear_weights"]["W4A16"] > 0
    params = mindir_parameters(tmp_path / "out" / "model.mindir")
    kinds = Counter(dtype for dtype, _ in params.values())
    assert kinds["INT8"] >= 4, kinds  # int8 stays int8 in the file; dequantization is in the graph
    assert s["parameter_bytes"] <= s["input_bytes"] * 1.05  # nothing widened to float
    if family == "qwen2":  # layer 1 is W4A16: q_proj [64, 64] packed two rows per byte -> [32, 64], group 16
        dtype, dims = params["model.layers.1.self_attn.q_proj.weight"]
        assert dtype == "INT8" and dims == [32, 64]
        assert params["model.layers.1.self_attn.q_proj.weight_scale"] == ("FLOAT", [64, 4])
        assert params["model.layers.0.self_attn.q_proj.bias"][0] == "FLOAT"  # qkv bias kept
        assert params["model.layers.1.mlp.down_proj.weight"] == ("INT8", [64, 64])  # [64, 128] packed along k
    if family == "deepseek_v3":  # routed experts stacked: int8 [E, rows, in] with their scales
        stacked = [n for n, (d, dims) in params.items() if ".experts." in n and d == "INT8"]
        assert stacked and all(params[n][1][0] == 16 for n in stacked)


def test_w8a8_is_refused(tiny_model, tmp_path, run_cli):
    quant = write_quantized(tiny_model("llama"), tmp_path / "quant", lambda role: "W8A8")
    with pytest.raises(UserError, match="W8A8"):
        export_mindir(quant, tmp_path / "out")
    result = run_cli(["export", "--format", "mindir", "-m", quant, "-o", tmp_path / "out"], cwd=tmp_path)
    assert result.code == 2 and "weight-only" in result.err and "Traceback" not in result.err
    assert not (tmp_path / "out").exists()


def test_fp8_checkpoint_with_mtp_layer(tiny_model, tmp_path, monkeypatch):
    """DeepSeek as published: FP8 block-scaled weights (scales in the next part) and the MTP module stored as an
    extra layer. Weights are dequantized on read; the MTP layer is not part of the model (as in transformers)."""
    from dsconv.tiny import add_mtp_layer, write_fp8_checkpoint

    src = shutil.copytree(tiny_model("deepseek_v3"), tmp_path / "bf16")
    add_mtp_layer(src)
    fp8 = write_fp8_checkpoint(src, tmp_path / "fp8", block=(32, 32), max_part_tensors=40)
    monkeypatch.chdir(tmp_path)
    s = export_mindir(fp8, tmp_path / "out")
    assert s["check"]["passed"] and s["check"]["max_abs_err"] < 1e-4
    assert not s["quantized"] and s["linear_weights"].get("float", 0) > 0
    assert s["mtp_tensors_skipped"] > 10
    params = mindir_parameters(tmp_path / "out" / "model.mindir")
    assert not any(".layers.3." in n for n in params)  # num_hidden_layers = 3: layer 3 is the MTP module


def test_dsconv_quantize_output(tiny_model, tmp_path, run_cli):
    """The real `dsconv quantize` output (W4A16, round-to-nearest, groups of 64) exports and checks."""
    quant = tmp_path / "quant"
    made = run_cli(["quantize", "-m", tiny_model("llama", dtype="bf16"), "-o", quant, "--scheme", "w4a16", "--method",
                    "rtn", "--group-size", "64"], cwd=tmp_path)
    assert made.code == 0, made.err
    done = run_cli(["export", "--format", "mindir", "-m", quant, "-o", tmp_path / "out", "--json"], cwd=tmp_path)
    assert done.code == 0, done.err
    s = json.loads(done.out)
    assert s["check"]["passed"] and s["linear_weights"].get("W4A16", 0) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "quant"]
    shutil.rmtree(tmp_path / "out")
