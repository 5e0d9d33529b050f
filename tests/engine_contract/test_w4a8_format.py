"""W4A8_DYNAMIC outputs read back WITHOUT dsconv's code: the int4 values and scale_bias recovered from the packing
rule as the engines' sources state it, and the recipe's types and config keys.

Rules (docs/formats/w4a8.md):
- packing, msmodelslim core/quant_service/modelslim_v1/save/utils/pack.py::w4a8_pack_int4 / _pack_int4: int8
  [out/2, in], byte [j, k] = (q[2j, k] & 0xF) | (q[2j+1, k] << 4), two's complement, for column and row layers alike;
- scale, msmodelslim ir/api/impl/int_quantization.py (symmetric branch): absmax / 7 per output channel, q clamped to
  [-8, 7]; saved as fp32 [out, 1] with zero offsets (save/ascendv1.py::on_w4a8_dynamic);
- scale_bias, pack.py::process_scale: 8 * sum_k(q * scale) per row [out, 1] for gate/up (w1/w3), and per 16
  contiguous k-chunks [out, 16] for down (w2);
- description: every tensor of a W4A8 projection tagged W4A8_DYNAMIC, "version" "1.0.0", "group_size" 0 written
  (MindIE-LLM atb/utils/weights.py reads a missing group_size as per-group), model_quant_type W8A8_DYNAMIC
  (ascendv1.py QUANT_TYPE_PRIORITY has no W4A8);
- DeepSeek config.json (msmodelslim model/deepseek_v3/model_adapter.py::ascendv1_save_postprocess): quantize,
  mla_quantize "w8a8_dynamic", moe_quantize "w4a8_dynamic".
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

pytestmark = [pytest.mark.cli]


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int8 [n/2, k] -> int8 [n, k] by the rule alone: low nibble = even row, high nibble = odd row, sign-extended."""
    b = packed.to(torch.int16) & 0xFF
    lo, hi = b & 0x0F, (b >> 4) & 0x0F
    lo = torch.where(lo >= 8, lo - 16, lo)
    hi = torch.where(hi >= 8, hi - 16, hi)
    return torch.stack([lo, hi], dim=1).reshape(packed.shape[0] * 2, packed.shape[1]).to(torch.int8)


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


@pytest.fixture(scope="module")
def w4a8_outputs(tiny_model, run_cli, tmp_path_factory):
    root = tmp_path_factory.mktemp("w4a8")
    out = {}
    for family, engine in (("deepseek_v3", "mindie"), ("qwen3_moe", "vllm-ascend")):
        src = tiny_model(family, dtype="bf16")
        dst = root / family
        r = run_cli(["quantize", "-m", str(src), "-o", str(dst), "--bits", "4", "--scheme", "w4a8_dynamic",
                     "--engine", engine])
        assert r.code == 0, r.err
        out[family] = (src, dst)
    return out


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_int4_values_and_scale_bias_recovered_from_the_packing_rule(w4a8_outputs, family):
    src, dst = w4a8_outputs[family]
    orig, q = _tensors(src), _tensors(dst)
    desc = json.loads((dst / "quant_model_description.json").read_text())
    experts = sorted(n[:-len(".weight")] for n, t in desc.items()
                     if t == "W4A8_DYNAMIC" and n.endswith(".weight") and n in q)
    assert experts and all(".experts." in p for p in experts), "only routed experts are W4A8"
    for P in experts:
        w = orig[P + ".weight"].float()
        n, k = w.shape
        packed = q[P + ".weight"]
        assert packed.dtype == torch.int8 and tuple(packed.shape) == (n // 2, k), P
        vals = _unpack_rows(packed).to(torch.int32)
        assert int(vals.min()) >= -8 and int(vals.max()) <= 7
        s = q[P + ".weight_scale"]
        assert s.dtype == torch.float32 and tuple(s.shape) == (n, 1)
        assert torch.equal(q[P + ".weight_offset"], torch.zeros(n, 1))
        # a bf16 value next to absmax/7 (the one above or, where every weight stays within half a step, the one
        # below: scale_grid.py): every weight within half a step, the scale within one bf16 ulp of absmax/7
        absmax = w.abs().amax(dim=1, keepdim=True)
        assert torch.all(s * 7.5 >= absmax) and torch.all((s - absmax / 7).abs() <= absmax / 7 * 2 ** -7 + 1e-30), P
        assert torch.equal(s.to(torch.bfloat16).float(), s), "bf16-exact, so MindIE's fp16 cast changes nothing"
        assert torch.all((vals.float() * s - w).abs() <= s / 2 * (1 + 1e-6)), P
        # scale_bias: 8 * scale * sum of q, per row (column layers) or per 16 k-chunks (down_proj / w2)
        row_layer = "down_proj" in P or P.endswith(".w2")
        chunks = 16 if row_layer else 1
        want = 8 * (vals.double() * s.double()).reshape(n, chunks, k // chunks).sum(-1)
        sb = q[P + ".scale_bias"]
        assert sb.dtype == torch.float32 and tuple(sb.shape) == (n, chunks), P
        assert torch.allclose(sb.double(), want, rtol=1e-6, atol=1e-6), P
        for suffix in ("weight", "weight_scale", "weight_offset", "scale_bias"):
            assert desc[f"{P}.{suffix}"] == "W4A8_DYNAMIC"
    assert desc["version"] == "1.0.0" and desc["group_size"] == 0 and desc["model_quant_type"] == "W8A8_DYNAMIC"


def test_deepseek_recipe_types_and_mindie_config_keys(w4a8_outputs):
    _, dst = w4a8_outputs["deepseek_v3"]
    desc = json.loads((dst / "quant_model_description.json").read_text())
    cfg = json.loads((dst / "config.json").read_text())
    assert (cfg["quantize"], cfg["mla_quantize"], cfg["moe_quantize"]) == ("w8a8_dynamic", "w8a8_dynamic",
                                                                            "w4a8_dynamic")
    assert "quantization_config" not in cfg
    kinds = {"self_attn.q_a_proj": "W8A8_DYNAMIC", "self_attn.kv_a_proj_with_mqa": "W8A8_DYNAMIC",
             "self_attn.q_b_proj": "W8A8_DYNAMIC", "self_attn.o_proj": "W8A8_DYNAMIC",
             "self_attn.kv_b_proj": "FLOAT", "mlp.gate.": "FLOAT", "shared_experts.": "W8A8_DYNAMIC",
             "mlp.experts.": "W4A8_DYNAMIC"}
    for frag, want in kinds.items():
        seen = {t for n, t in desc.items() if n.endswith(".weight") and frag in n and ".layers." in n}
        assert seen == {want}, (frag, seen)
    dense = {t for n, t in desc.items() if "layers.0.mlp." in n and n.endswith(".weight")}
    assert dense == {"W8A8_DYNAMIC"}, "DeepSeek's dense first layer: W8A8_DYNAMIC"
    assert desc["model.embed_tokens.weight"] == "FLOAT" and desc["lm_head.weight"] == "FLOAT"
