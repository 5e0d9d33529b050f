"""The engine check's comparison (dsconv/engine_check/mindie_match.py) on synthetic held weights: rows are compared in
place, so a fused gate_up holding up before gate, a head's rows permuted or a scale 8x too small fail, and a correct
layout passes. `make engine-check` proves the same on real outputs through the engines' own loaders; these keep the
comparison honest in `make test`, where no engine runs. Also the `dsconv verify --engine` plumbing that needs none."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "dsconv" / "engine_check"))

import mindie_held as mh  # noqa: E402
import mindie_match as mm  # noqa: E402

pytestmark = pytest.mark.unit
L = "model.layers.0.mlp"


def _quantized(W: np.ndarray, module: str, scale_factor: float = 1.0) -> mh.Held:
    """W8A8_DYNAMIC as a kernel holds it: int8 rows and a per-row scale (absmax / 127, times scale_factor)."""
    s = np.abs(W).max(axis=1) / 127 * scale_factor
    q = np.clip(np.round(W / s[:, None]), -127, 127)
    R, K = W.shape
    return mh.Held(module, "W8A8_DYNAMIC", q, mh.per_row(s, R, K), np.zeros((R, K)), None,
                   raw={"weight_scale": s[:, None]})


def _setup(tmp_path: Path, held_W: np.ndarray, scale_factor: float = 1.0):
    rng = np.random.default_rng(0)
    gate, up = rng.standard_normal((8, 16)), rng.standard_normal((8, 16))
    gate, up = (torch.from_numpy(a).to(torch.bfloat16).double().numpy() for a in (gate, up))
    weights = {f"{L}.gate_proj.weight": gate, f"{L}.up_proj.weight": up}
    module = f"{L}.gate_up_proj.linear"
    ref_rows = np.concatenate([gate, up])  # MindIE's fusion order: gate, then up
    np.savez(tmp_path / "ref.npz", **{f"w::{module}": ref_rows})
    ref = mm.Reference.load(str(tmp_path / "ref.npz"), {"linears": {module: {"kind": "FLOAT", "transposed": False}},
                                                       "norms": []})
    src = mm.Source(weights, {}, {}, dtype=torch.bfloat16)
    return [_quantized(held_W(gate, up), module, scale_factor)], ref, src


def test_a_correct_fused_layout_passes(tmp_path):
    held, ref, src = _setup(tmp_path, lambda g, u: np.concatenate([g, u]))
    out = mm.compare(held, ref, src)
    assert not out.value_mismatch, out.value_mismatch
    assert out.covered[f"{L}.gate_proj.weight"][1].all() and out.covered[f"{L}.up_proj.weight"][1].all()


def test_up_before_gate_fails_and_names_where_the_rows_went(tmp_path):
    held, ref, src = _setup(tmp_path, lambda g, u: np.concatenate([u, g]))
    out = mm.compare(held, ref, src)
    assert out.value_mismatch, "gate/up swapped inside the fused tensor passed"
    assert "16 of 16 rows" in out.value_mismatch[0] and "looks like" in out.value_mismatch[0]


def test_rows_permuted_within_a_block_fail(tmp_path):
    held, ref, src = _setup(tmp_path, lambda g, u: np.concatenate([g[::-1], u]))
    out = mm.compare(held, ref, src)
    assert out.value_mismatch and "8 of 16 rows" in out.value_mismatch[0]


def test_a_scale_eight_times_too_small_fails_on_the_clip_bound(tmp_path):
    held, ref, src = _setup(tmp_path, lambda g, u: np.concatenate([g, u]), scale_factor=1 / 8)
    out = mm.compare(held, ref, src)
    frac = max(out.clipped.values())
    assert frac > mm.CLIP_LIMIT
    assert any("clipped" in x for x in out.value_mismatch), out.value_mismatch


def test_unpack_int4_reads_the_format_description_packing():
    """docs/formats/w4a8.md §1, packed along rows: packed[j, k] = (q[2j, k] & 0xF) | (q[2j+1, k] << 4); the checker's
    unpacking (pairs along the last axis, even element low) inverts it once transposed."""
    q = np.random.default_rng(1).integers(-8, 8, size=(6, 5))
    packed = ((q[0::2] & 0xF) | ((q[1::2] & 0xF) << 4)).astype(np.uint8).view(np.int8)
    assert np.array_equal(mh.unpack_int4(packed.T).T, q)


def test_verify_engine_finds_the_source_through_the_manifests(tmp_path):
    from dsconv.engines.loader_check import origins
    from dsconv.errors import UserError

    src, quant, shard = tmp_path / "src", tmp_path / "quant", tmp_path / "shard"
    for d in (src, quant, shard):
        d.mkdir()
    (src / "config.json").write_text("{}")
    (quant / "dsconv_manifest.json").write_text(json.dumps({"stage": "quantize", "inputs": [str(src)]}))
    (shard / "dsconv_manifest.json").write_text(json.dumps({"stage": "shard", "inputs": [str(quant)]}))
    assert origins(quant) == (src, quant)
    assert origins(shard) == (src, quant)
    (src / "config.json").unlink()
    with pytest.raises(UserError, match="--source"):
        origins(quant)


def test_verify_engine_mindie_without_sources_is_a_clear_user_error(tmp_path, monkeypatch):
    from dsconv.engines.loader_check import check
    from dsconv.errors import UserError

    monkeypatch.delenv("MINDIE_LLM_SRC", raising=False)
    src, quant = tmp_path / "src", tmp_path / "quant"
    src.mkdir()
    quant.mkdir()
    (src / "config.json").write_text("{}")
    (quant / "dsconv_manifest.json").write_text(json.dumps({"stage": "quantize", "inputs": [str(src)]}))
    with pytest.raises(UserError, match="needs MindIE-LLM's sources") as e:
        check(quant, "mindie")
    assert "not on PyPI" in e.value.hint


def _smooth_pair(tmp_path: Path, down_carries_factor: bool):
    """up_proj [8, 16] and down_proj [16, 8]; SmoothQuant divides up row i by s_i and multiplies down column i by
    s_i (the model is unchanged); a writer that forgot the down side computes another model."""
    rng = np.random.default_rng(2)
    bf = lambda a: torch.from_numpy(a).to(torch.bfloat16).double().numpy()  # noqa: E731
    up, down = bf(rng.standard_normal((8, 16))), bf(rng.standard_normal((16, 8)))
    s = np.linspace(0.5, 2.0, 8)
    names = {"up": f"{L}.up_proj.linear", "down": f"{L}.down_proj.linear"}
    np.savez(tmp_path / "ref.npz", **{f"w::{names['up']}": up, f"w::{names['down']}": down})
    ref = mm.Reference.load(str(tmp_path / "ref.npz"), {"linears": {n: {"kind": "FLOAT", "transposed": False}
                                                                    for n in names.values()}, "norms": []})
    src = mm.Source({f"{L}.up_proj.weight": up, f"{L}.down_proj.weight": down}, {}, {}, dtype=torch.bfloat16)
    held = [_quantized(up / s[:, None], names["up"]),
            _quantized(down * s[None, :] if down_carries_factor else down, names["down"])]
    return mm.compare(held, ref, src)


def test_smoothquant_moved_between_up_and_down_passes(tmp_path):
    out = _smooth_pair(tmp_path, down_carries_factor=True)
    assert not out.value_mismatch, out.value_mismatch


def test_smoothquant_on_up_alone_fails_on_down(tmp_path):
    out = _smooth_pair(tmp_path, down_carries_factor=False)
    assert any("down_proj" in x for x in out.value_mismatch), out.value_mismatch


def test_fp8_source_is_compared_as_the_floats_it_stands_for(tiny_model, tmp_path):
    """An output quantized from DeepSeek's FP8 checkpoint is compared with the source's dequantized weights (the
    engine check's own block dequantization equals dsconv's reader's in float32, value for value); the scales are
    not weights."""
    import mindie_reference as mr

    from dsconv.checkpoint import Checkpoint
    from dsconv.io.tensorfile import dequant_fp8_block
    from dsconv.tiny import write_fp8_checkpoint

    src = write_fp8_checkpoint(tiny_model("deepseek_v3"), tmp_path / "fp8", block=(16, 16))
    paths = sorted(src.glob("*.safetensors"))
    got = mr.source_tensors(paths, _read_all)
    assert not any(n.endswith("weight_scale_inv") for n in got)
    with Checkpoint.open(src) as ck:
        for name in ("model.layers.0.self_attn.kv_b_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight"):
            assert ck.info(name).dtype == "F8_E4M3"
            w, s = ck.load(name), ck.load(ck.fp8_scales[name])
            assert torch.equal(got[name], dequant_fp8_block(w, s, (16, 16), out_dtype=torch.float32))


def _read_all(paths):
    from safetensors.torch import load_file

    out = {}
    for p in paths:
        out.update(load_file(str(p)))
    return out
