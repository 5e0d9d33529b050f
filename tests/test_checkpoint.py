"""The streaming reader: loads equal transformers' tensors in both MoE layouts, FP8 on read, and every bad input is a
one-line user error (exit 2) naming the file and tensor."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from conftest import copy_model, write_raw_safetensors
from dsconv.checkpoint import Checkpoint
from dsconv.errors import UserError
from dsconv.io.tensorfile import dequant_fp8_block, read_tensor_infos
from dsconv.tiny import FAMILIES, MOE_FAMILIES, build_model, write_fp8_checkpoint

pytestmark = pytest.mark.cli


def _model_tensors(model) -> dict[str, torch.Tensor]:
    """The model's state as per-expert tensors (the normalised form), computed independently of dsconv."""
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[(name[: -len("gate_up_proj")], e, "gate")] = t[e, :half]
                out[(name[: -len("gate_up_proj")], e, "up")] = t[e, half:]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[(name[: -len("down_proj")], e, "down")] = t[e]
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("fused", [False, True])
def test_moe_layouts_load_identically(tiny_model, family, fused):
    """Both on-disk MoE layouts present the same per-expert tensors, equal to the model's own weights."""
    d = tiny_model(family, fused=fused)
    ck = Checkpoint.open(d)
    model = build_model(family)
    ref = _model_tensors(model)
    experts = [n for n in ck.names() if ck.role(n).expert is not None]
    assert experts, "no expert tensors found"
    for name in experts:
        r = ck.role(name)
        key = next(k for k in ref if isinstance(k, tuple) and k[1] == r.expert and k[2] == r.slot
                   and k[0].startswith(f"{ck.family.layer_prefix}{r.layer}."))
        assert torch.equal(ck.load(name), ref[key]), name
    n_plain = sum(1 for n in ck.names() if ck.role(n).expert is None)
    assert n_plain + len(experts) == len(ck.tensors)


def test_fused_and_per_expert_give_the_same_names(tiny_model):
    a = Checkpoint.open(tiny_model("mixtral", fused=False))
    b = Checkpoint.open(tiny_model("mixtral", fused=True))
    assert sorted(a.names()) == sorted(b.names())
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in b.tensors
    for name in a.names():
        assert a.info(name).shape == b.info(name).shape
        assert torch.equal(a.load(name), b.load(name)), name


def test_load_returns_independent_copy(tiny_model):
    ck = Checkpoint.open(tiny_model("llama"))
    t = ck.load("model.norm.weight")
    before = t.clone()
    t.mul_(0)
    assert torch.equal(ck.load("model.norm.weight"), before)


def test_bf16_load(tiny_model):
    ck = Checkpoint.open(tiny_model("qwen2", dtype="bf16"))
    t = ck.load("model.layers.0.self_attn.q_proj.bias")
    assert t.dtype == torch.bfloat16 and t.shape == (64,)


def _independent_dequant(w: np.ndarray, s: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    out = np.empty(w.shape, dtype=np.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            sl = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            out[sl] = w[sl] * s[i, j]
    return out


@pytest.fixture(scope="module")
def fp8_dir(tiny_model, tmp_path_factory):
    src = tiny_model("deepseek_v3")
    return write_fp8_checkpoint(src, tmp_path_factory.mktemp("fp8"), block=(16, 24), max_part_tensors=40)


def test_fp8_dequant_on_read_across_parts(fp8_dir, tiny_model):
    ck = Checkpoint.open(fp8_dir)
    orig = Checkpoint.open(tiny_model("deepseek_v3"))
    assert len(ck.files) > 2
    fp8 = [n for n in ck.names() if ck.info(n).dtype == "F8_E4M3"]
    assert fp8 and all(ck.fp8_scales[n] for n in fp8)
    cross = [n for n in fp8 if ck.info(n).file != ck.info(ck.fp8_scales[n]).file]
    assert cross, "the fixture must put scales in other parts"
    for name in fp8:
        w = ck.load(name).float().numpy()
        s = ck.load(ck.fp8_scales[name]).numpy()
        ref = _independent_dequant(w, s, (16, 24))
        got = ck.load(name, dequantize=True)
        assert got.dtype == torch.bfloat16
        np.testing.assert_allclose(got.float().numpy(), ref, rtol=1e-2, atol=1e-6)  # bf16 rounding only
        # and close to the original weight (FP8 e4m3 has a 3-bit mantissa)
        o = orig.load(name).float().numpy()
        assert np.abs(got.float().numpy() - o).max() <= 0.07 * np.abs(o).max() + 1e-6
    # ragged blocks really occur: 40 rows of kv_a in blocks of 16
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert ck.info(kv_a).shape[0] % 16 != 0


def test_dequant_fp8_block_ragged():
    w = torch.randn(5, 7).to(torch.float8_e4m3fn)
    s = torch.tensor([[2.0, 3.0], [5.0, 7.0]])
    got = dequant_fp8_block(w, s, (3, 4), out_dtype=torch.float32)
    ref = _independent_dequant(w.float().numpy(), s.numpy(), (3, 4))
    np.testing.assert_array_equal(got.numpy(), ref)


# ---- bad inputs: one line, exit 2, naming the file/tensor -------------------------------------------------------

def _expect_error(run_cli, model, *needles):
    r = run_cli(["inspect", "--model", model])
    assert r.code == 2, (r.code, r.err)
    line = r.err.strip()
    assert "\n" not in line and "Traceback" not in line
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def test_missing_config(run_cli, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    _expect_error(run_cli, tmp_path, "config.json")


def test_unknown_model_type(run_cli, tiny_model, tmp_path):
    d = copy_model(tiny_model("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (d / "config.json").write_text(json.dumps(cfg))
    line = _expect_error(run_cli, d, "gpt_neox", "deepseek_v3", "mixtral", "qwen3_moe")


def test_truncated_file(run_cli, tiny_model, tmp_path):
    d = copy_model(tiny_model("llama"), tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    _expect_error(run_cli, d, "model.safetensors", "truncated")


def test_garbage_header(run_cli, tiny_model, tmp_path):
    d = copy_model(tiny_model("llama"), tmp_path / "m")
    (d / "model.safetensors").write_bytes((16).to_bytes(8, "little") + b"\xff" * 16 + b"\0" * 64)
    _expect_error(run_cli, d, "model.safetensors", "JSON")


def test_oversized_header(run_cli, tiny_model, tmp_path):
    d = copy_model(tiny_model("llama"), tmp_path / "m")
    (d / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}")
    _expect_error(run_cli, d, "model.safetensors", "header claims")


def _llama_dir(tiny_model, tmp_path):
    d = copy_model(tiny_model("llama"), tmp_path / "m")
    (d / "model.safetensors").unlink()
    return d


def test_overlapping_ranges(run_cli, tiny_model, tmp_path):
    d = _llama_dir(tiny_model, tmp_path)
    header = {"model.norm.weight": {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]},
              "model.embed_tokens.weight": {"dtype": "F32", "shape": [64], "data_offsets": [128, 384]}}
    write_raw_safetensors(d / "model.safetensors", header, b"\0" * 384)
    _expect_error(run_cli, d, "overlap", "model.norm.weight")


def test_range_past_end_of_file(run_cli, tiny_model, tmp_path):
    d = _llama_dir(tiny_model, tmp_path)
    header = {"model.norm.weight": {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]}}
    write_raw_safetensors(d / "model.safetensors", header, b"\0" * 100)
    _expect_error(run_cli, d, "model.norm.weight", "past the end")


def test_size_mismatch_in_header(run_cli, tiny_model, tmp_path):
    d = _llama_dir(tiny_model, tmp_path)
    header = {"model.norm.weight": {"dtype": "F32", "shape": [64], "data_offsets": [0, 200]}}
    write_raw_safetensors(d / "model.safetensors", header, b"\0" * 256)
    _expect_error(run_cli, d, "model.norm.weight", "needs 256")


def _indexed(tiny_model, tmp_path, weight_map_edit):
    d = copy_model(tiny_model("llama"), tmp_path / "m")
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
    from safetensors import safe_open

    with safe_open(d / "model-00001-of-00001.safetensors", "pt") as f:
        wm = {k: "model-00001-of-00001.safetensors" for k in f.keys()}
    weight_map_edit(wm)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return d


def test_index_ok(tiny_model, tmp_path):
    d = _indexed(tiny_model, tmp_path, lambda wm: None)
    assert len(Checkpoint.open(d)) == len(Checkpoint.open(tiny_model("llama")))


def test_index_escaping_model_dir(run_cli, tiny_model, tmp_path):
    (tmp_path / "evil.safetensors").write_bytes(b"")
    d = _indexed(tiny_model, tmp_path, lambda wm: wm.update({"model.norm.weight": "../evil.safetensors"}))
    _expect_error(run_cli, d, "model.norm.weight", "outside the model directory")


def test_index_absolute_path(run_cli, tiny_model, tmp_path):
    d = _indexed(tiny_model, tmp_path, lambda wm: wm.update({"model.norm.weight": "/etc/passwd"}))
    _expect_error(run_cli, d, "outside the model directory")


def test_index_missing_part(run_cli, tiny_model, tmp_path):
    d = _indexed(tiny_model, tmp_path, lambda wm: wm.update({"model.norm.weight": "model-00002-of-00002.safetensors"}))
    _expect_error(run_cli, d, "model-00002-of-00002.safetensors", "missing")


def test_index_tensor_not_in_part(run_cli, tiny_model, tmp_path):
    d = _indexed(tiny_model, tmp_path, lambda wm: wm.update({"model.layers.9.mlp.up_proj.weight":
                                                             "model-00001-of-00001.safetensors"}))
    _expect_error(run_cli, d, "model.layers.9.mlp.up_proj.weight", "does not hold it")


def test_fp8_weight_without_scale(run_cli, fp8_dir, tmp_path):
    d = copy_model(fp8_dir, tmp_path / "m")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    victim = next(k for k in index["weight_map"] if k.endswith("_scale_inv"))
    del index["weight_map"][victim]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect_error(run_cli, d, victim[: -len("_scale_inv")], "no ")


def test_unknown_tensor_in_known_family(run_cli, tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    d = copy_model(tiny_model("llama"), tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    sd["model.layers.0.self_attn.rotary_blob.weight"] = torch.zeros(2)
    save_file(sd, d / "model.safetensors")
    _expect_error(run_cli, d, "model.layers.0.self_attn.rotary_blob.weight", "llama")


def test_pickle_refused_then_allowed(run_cli, tiny_model, tmp_path):
    from safetensors.torch import load_file

    d = copy_model(tiny_model("llama"), tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    torch.save(sd, d / "pytorch_model.bin")
    _expect_error(run_cli, d, "pytorch_model.bin", "--allow-pickle")
    r = run_cli(["inspect", "--model", d, "--allow-pickle", "--json"])
    assert r.code == 0, r.err
    assert json.loads(r.out)["parameters"] == sum(t.numel() for t in sd.values())
    ck = Checkpoint.open(d, allow_pickle=True)
    assert torch.equal(ck.load("model.norm.weight"), sd["model.norm.weight"])


def test_malicious_pickle_is_not_executed(run_cli, tiny_model, tmp_path):
    import pickle

    d = copy_model(tiny_model("llama"), tmp_path / "m")
    (d / "model.safetensors").unlink()
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with open(d / "pytorch_model.bin", "wb") as f:
        pickle.dump({"x": Evil()}, f)
    r = run_cli(["inspect", "--model", d, "--allow-pickle"])
    assert r.code == 2 and not marker.exists()


def test_header_listing_reads_no_data(tiny_model, tmp_path):
    """Opening reads headers only: a checkpoint whose data region is a sparse hole opens instantly."""
    d = _llama_dir(tiny_model, tmp_path)
    n = 2000
    header = {f"model.layers.{i}.input_layernorm.weight": {"dtype": "BF16", "shape": [4096],
                                                           "data_offsets": [i * 8192, (i + 1) * 8192]}
              for i in range(n)}
    path = write_raw_safetensors(d / "model.safetensors", header, b"")
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size + n * 8192)
    infos = read_tensor_infos(path)  # the header listing Checkpoint.open runs per part
    assert len(infos) == n and math.prod(infos["model.layers.5.input_layernorm.weight"].shape) == 4096


def test_open_rejects_non_directory(tmp_path):
    with pytest.raises(UserError, match="not a directory"):
        Checkpoint.open(tmp_path / "nope")
