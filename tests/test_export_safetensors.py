"""`dsconv export --format safetensors`: FP8 -> BF16 against an independent dequantization, layout kept, config
fixed, transformers loads the result; dtype casts; a weight without its scale is a user error and nothing is written."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from dsconv.convert.fp8 import dequantize_fp8, export_safetensors
from dsconv.errors import UserError
from dsconv.tiny import write_fp8_checkpoint

pytestmark = pytest.mark.cli

BLOCK = (16, 16)


def independent_dequant(weight: torch.Tensor, scale: torch.Tensor, block=BLOCK, dtype=torch.bfloat16):
    """torch's own float8 conversion times the block scales expanded with numpy, rounded once."""
    rows, cols = weight.shape
    expanded = np.repeat(np.repeat(scale.numpy(), block[0], axis=0), block[1], axis=1)[:rows, :cols]
    return (weight.to(torch.float32) * torch.from_numpy(np.ascontiguousarray(expanded))).to(dtype)


def read_all(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


@pytest.fixture(scope="module")
def fp8_dir(tiny_model, tmp_path_factory) -> Path:
    """A DeepSeek-style FP8 checkpoint in parts, each scale in the part after its weight; 16x16 blocks give ragged
    edges (kv_a_proj has 40 rows)."""
    src = tiny_model("deepseek_v3")  # fp32: norms, embeddings and the router stay fp32 next to the FP8 weights
    out = tmp_path_factory.mktemp("fp8") / "model"
    write_fp8_checkpoint(src, out, block=BLOCK, max_part_tensors=9)
    (out / "tokenizer_config.json").write_text("{}")
    return out


@pytest.fixture(scope="module")
def bf16_out(fp8_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("st") / "bf16"
    return out, export_safetensors(fp8_dir, out, dtype="bf16")


def test_fp8_round_trip_equals_independent_dequantization(fp8_dir, bf16_out):
    out, summary = bf16_out
    src = read_all(fp8_dir)
    got = read_all(out)
    scales = [n for n in src if n.endswith("_scale_inv")]
    assert scales and summary["dequantize"] == len(scales) == summary["scales_dropped"]
    assert not [n for n in got if n.endswith("_scale_inv")]
    assert set(got) == {n for n in src if not n.endswith("_scale_inv")}
    for name, t in src.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            want = independent_dequant(t, src[name + "_scale_inv"])
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], want), name
        elif ".mlp.gate." in name:  # fp32 router weight and bias stay fp32 (transformers keeps them so)
            assert t.dtype == got[name].dtype == torch.float32 and torch.equal(got[name], t), name
        else:
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], t.to(torch.bfloat16)), name


def test_layout_config_and_files(fp8_dir, bf16_out):
    out, summary = bf16_out
    src_index = json.loads((fp8_dir / "model.safetensors.index.json").read_text())["weight_map"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for name, part in index["weight_map"].items():
        assert src_index[name] == part  # every tensor stays in the part it came from, under the same file name
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(set(index["weight_map"].values()))
    assert summary["parts_dropped"] == 1  # the last input part held only scales
    assert index["metadata"]["total_size"] == summary["bytes_out"]
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    assert (out / "tokenizer_config.json").is_file() and (out / "generation_config.json").is_file()
    assert (out / "dsconv_manifest.json").is_file()


def test_transformers_loads_the_result(fp8_dir, bf16_out):
    from transformers import AutoModelForCausalLM

    out, _ = bf16_out
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    src = read_all(fp8_dir)
    w = "model.layers.1.mlp.experts.5.down_proj.weight"
    want = independent_dequant(src[w], src[w + "_scale_inv"])
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj[5].to(torch.bfloat16), want)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()


def test_cast_of_a_fused_moe_checkpoint(tiny_model, tmp_path):
    """bf16 -> fp16 on transformers' fused expert layout: per-expert names, transformers loads it unchanged."""
    from transformers import AutoModelForCausalLM

    src = tiny_model("mixtral", fused=True, dtype="bf16")
    s = export_safetensors(src, tmp_path / "o", dtype="fp16")
    assert s["cast"] == s["tensors"] and s["dequantize"] == 0
    got = read_all(tmp_path / "o")
    assert all(t.dtype == torch.float16 for t in got.values())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in got
    a = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    b, info = AutoModelForCausalLM.from_pretrained(tmp_path / "o", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"]
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert (a(input_ids=ids).logits - b(input_ids=ids).logits).abs().max() < 0.05
    assert json.loads((tmp_path / "o" / "config.json").read_text())["dtype"] == "float16"


def test_weight_without_scale_is_a_user_error_and_nothing_is_written(fp8_dir, tmp_path, run_cli):
    d = tmp_path / "broken"
    shutil.copytree(fp8_dir, d)
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    victim = next(n for n in index["weight_map"] if n.endswith("_scale_inv"))
    del index["weight_map"][victim]
    index_path.write_text(json.dumps(index))
    r = run_cli(["export", "--model", d, "--output", tmp_path / "o", "--format", "safetensors"])
    assert r.code == 2 and victim[: -len("_scale_inv")] in r.err and "Traceback" not in r.err, r.err
    assert not (tmp_path / "o").exists()


def test_cli_dry_run_json_and_verify(fp8_dir, tmp_path, run_cli):
    r = run_cli(["export", "-m", fp8_dir, "-o", tmp_path / "o", "--format", "safetensors", "--dry-run", "--json"])
    plan = json.loads(r.out)
    assert r.code == 0 and plan["dry_run"] and plan["dequantize"] > 0 and not (tmp_path / "o").exists()
    r = run_cli(["export", "-m", fp8_dir, "-o", tmp_path / "o", "--format", "safetensors"])
    assert r.code == 0 and "FP8 dequantized" in r.out, r.err
    assert run_cli(["verify", tmp_path / "o"]).code == 0


@pytest.mark.parametrize("shape,block", [((300, 500), (128, 128)), ((40, 64), (16, 16)), ((37, 129), (16, 32))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_is_exact(shape, block, dtype):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x01  # no NaN codes; subnormals (exponent 0) included
    w = codes.view(torch.float8_e4m3fn)
    scale = torch.rand((math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])), generator=g) * 1e-2
    assert torch.equal(dequantize_fp8(w, scale, block, dtype), independent_dequant(w, scale, block, dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_reader_uses_the_same_exact_kernel(dtype):
    """Checkpoint reads (quantize reading FP8, shard, eval) dequantize through io/fp8_kernel.py's tables: every code
    (NaN codes aside), subnormal products, ragged blocks, a stripe starting inside a block row."""
    from dsconv.io import fp8_kernel
    from dsconv.io.tensorfile import dequant_fp8_block, float_view

    g = torch.Generator().manual_seed(1)
    codes = torch.arange(256, dtype=torch.uint8).repeat(70, 3)[:, :700]
    codes[(codes & 0x7F) == 0x7F] = 0x00
    w = codes.view(torch.float8_e4m3fn)
    scale = torch.rand((3, 6), generator=g) * 1e-2
    scale[0, 0] = 1e-30  # products below bf16's normal range
    want = independent_dequant(w[:, :700], scale, (32, 128), dtype)
    assert torch.equal(dequant_fp8_block(w, scale, (32, 128), dtype), want)
    part = torch.empty(40, 700, dtype=dtype)
    fp8_kernel.dequantize_rows(codes[20:60].numpy(), scale.numpy(), (32, 128), 20, float_view(part))
    assert torch.equal(part, want[20:60])


def test_reader_keeps_nan_codes_nan():
    from dsconv.io.tensorfile import dequant_fp8_block

    w = torch.full((20, 20), 2.0).to(torch.float8_e4m3fn)
    w.view(torch.uint8)[3, 4] = 0xFF
    got = dequant_fp8_block(w, torch.ones(2, 2), BLOCK, torch.float32)
    assert torch.isnan(got[3, 4]) and int(torch.isnan(got).sum()) == 1


def test_kernel_large_scales_and_nan_codes():
    w = torch.full((20, 20), 2.0).to(torch.float8_e4m3fn)
    big = torch.full((2, 2), 300.0)  # beyond the fast path's range: the reference loop takes over
    assert torch.equal(dequantize_fp8(w, big, BLOCK, torch.float32), independent_dequant(w, big, BLOCK, torch.float32))
    bad = w.clone()
    bad.view(torch.uint8)[3, 4] = 0x7F
    with pytest.raises(UserError, match="NaN"):
        dequantize_fp8(bad, torch.ones(2, 2), BLOCK, torch.bfloat16, name="x.weight")


def test_pipelined_writer_writes_the_same_bytes(fp8_dir, bf16_out, tmp_path):
    out, _ = bf16_out
    export_safetensors(fp8_dir, tmp_path / "p", dtype="bf16", pipeline=True)
    for f in sorted(out.glob("*.safetensors")):
        assert (tmp_path / "p" / f.name).read_bytes() == f.read_bytes(), f.name


def test_stage_dispatches_by_format_and_refuses_foreign_options(fp8_dir, tmp_path):
    from dsconv.convert.stage import ExportRequest, render, run
    from dsconv.errors import UserError

    r = run(ExportRequest(model=fp8_dir, output=tmp_path / "o", format="safetensors", dry_run=True))
    assert r.format == "safetensors" and r.summary["dtype"] == "bf16" and r.summary["dry_run"]  # the format's default
    assert render(r).startswith(f"planned {tmp_path / 'o'}: ") and not (tmp_path / "o").exists()
    with pytest.raises(UserError, match="--with-past does not apply to --format safetensors"):
        run(ExportRequest(model=fp8_dir, output=tmp_path / "o", format="safetensors", with_past=True))
    with pytest.raises(UserError, match="not an export format"):
        run(ExportRequest(model=fp8_dir, output=tmp_path / "o", format="gguf"))
