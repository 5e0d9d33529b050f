"""`quantize --scheme w4a4_dynamic`: vLLM-Ascend's W4A4_DYNAMIC linears where the rotation reaches the input, the
recipe's W8A8_DYNAMIC elsewhere, the layout its loader reads, refusals before any work, and the engine's arithmetic
in eval. Loading in the engine itself is `make engine-check` (tests/engine_check: rows "w4a4")."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dsconv import engines
from dsconv.checkpoint import Checkpoint
from dsconv.families import families
from dsconv.families.residual import KNOWN, reads_residual
from dsconv.quant.plan.plan import make_plan

pytestmark = pytest.mark.cli


def _plan(ck, engine: str = "vllm-ascend"):
    prof = engines.get(engine)
    types = engines.kind_types(prof, ck.family, "W4A4_DYNAMIC", bits_default=False)
    return make_plan(ck, "w4a4_dynamic", None, "rtn", assign=engines.assigner(prof, ck.family, types))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe", "deepseek_v3", "qwen3_next", "glm4_moe"])
def test_recipe_four_bit_activations_exactly_where_the_residual_stream_is_read(tiny_model, family):
    """Every planned linear: W4A4_DYNAMIC iff its row reads the residual stream (families/residual.py) and it is not
    a routed expert (no W4A4 MoE method) or a linear attention's (its recurrence); the rest W8A8_DYNAMIC or the
    engine's float-only kinds."""
    ck = Checkpoint.open(tiny_model(family))
    plan = _plan(ck)
    seen = set()
    for lp in plan.linears.values():
        key = ck.family.row_key(lp.weight)
        kind = engines.layer_kind(lp)
        want = "W4A4_DYNAMIC" if reads_residual(key) and kind not in ("routed_experts", "linear_attention") \
            else "W8A8_DYNAMIC"
        assert lp.qtype == want, (lp.module, key, lp.qtype)
        seen.add(lp.qtype)
    assert seen == {"W4A4_DYNAMIC", "W8A8_DYNAMIC"}
    if family == "deepseek_v3":  # q_a/kv_a read the stream, q_b the latent; kv_b float (MLA's absorbed weight)
        types = {lp.slot: lp.qtype for lp in plan.linears.values() if lp.layer == 1 and lp.expert is None}
        assert types["q_a"] == types["kv_a"] == "W4A4_DYNAMIC" and types["q_b"] == types["o"] == "W8A8_DYNAMIC"
        assert "model.layers.1.self_attn.kv_b_proj" in plan.ignored


def test_every_quantized_row_has_a_residual_rule():
    """A new family's linear row must be placed in the residual table (else W4A4 and rotation would guess)."""
    for fam in families():
        for row in fam.table:
            if row.param == "weight" and row.role.quantized_by_default:
                assert row.key in KNOWN, (fam.name, row.key)


def test_w4a4_output_layout_and_eval(tiny_model, run_cli, tmp_path):
    """int8 [n, k] holding int4 values, float32 weight_scale [n, 1] and zero weight_offset (vLLM-Ascend's
    w4a4_laos_dynamic.py parameters), model_quant_type W4A4_DYNAMIC, verify clean; eval runs the int4 activations."""
    from dsconv.bundled import calib_texts
    from dsconv.tiny import make_tiny, train_tokenizer

    src = make_tiny("qwen2", tmp_path / "src", dtype="bf16", tokenizer=train_tokenizer(calib_texts(), vocab_size=384))
    q = tmp_path / "q"
    r = run_cli(["quantize", "-m", src, "-o", q, "--scheme", "w4a4_dynamic", "--engine", "vllm-ascend",
                 "--method", "rtn", "--json"])
    assert r.code == 0, r.err
    assert "W4A4_DYNAMIC without --rotate" in r.err  # the warning: no rotation reached these activations
    desc = json.loads((q / "quant_model_description.json").read_text())
    assert desc["model_quant_type"] == "W4A4_DYNAMIC" and desc["group_size"] == 0
    from safetensors import safe_open

    with safe_open(str(next(q.glob("*.safetensors"))), "pt") as f:
        P = "model.layers.0.self_attn.q_proj"
        w, s, o = f.get_tensor(P + ".weight"), f.get_tensor(P + ".weight_scale"), f.get_tensor(P + ".weight_offset")
        n, k = Checkpoint.open(src).info(P + ".weight").shape
        assert w.dtype == torch.int8 and tuple(w.shape) == (n, k) and int(w.min()) >= -8 and int(w.max()) <= 7
        assert int(w.abs().max()) == 7  # the grid is used, not an int8 weight mislabelled
        assert s.dtype == torch.float32 and tuple(s.shape) == (n, 1) and not bool(o.any())
        assert desc[P + ".weight"] == "W4A4_DYNAMIC"
        assert desc["model.layers.0.self_attn.o_proj.weight"] == "W8A8_DYNAMIC"
        assert desc["model.layers.0.mlp.down_proj.weight"] == "W8A8_DYNAMIC"
    assert run_cli(["verify", q]).code == 0
    e = run_cli(["eval", "-m", src, "-q", q, "--json", "--samples", "4", "--seq-len", "32"])
    assert e.code == 0, e.err
    assert "W4A4_DYNAMIC" in json.dumps(json.loads(e.out))


def test_engine_linear_quantizes_each_token_to_int4():
    """EngineLinear's W4A4 path: per-token scale max|x| / 7, values rounded and clamped to [-8, 7], times the
    dequantized weight: what npu_dynamic_quant(quint4x2) + npu_quant_matmul compute."""
    from dsconv.quant.evaluate.engine_linear import EngineLinear
    from dsconv.quant.formats.msmodelslim import QuantLinear

    rng = np.random.default_rng(0)
    q = rng.integers(-7, 8, size=(6, 16)).astype(np.int8)
    sc = rng.uniform(0.01, 0.02, size=(6, 1)).astype(np.float32)
    el = EngineLinear(QuantLinear("m", "W4A4_DYNAMIC", q, sc, np.zeros_like(sc)))
    x = torch.from_numpy(rng.normal(size=(3, 16)).astype(np.float32))
    s = x.abs().amax(-1, keepdim=True) / 7
    want = (torch.round(x / s).clamp(-8, 7) * s) @ torch.from_numpy(q.astype(np.float32) * sc).T
    torch.testing.assert_close(el(x), want)
    assert not torch.allclose(el(x), x @ torch.from_numpy(q.astype(np.float32) * sc).T, atol=1e-3)


def test_w4a4_refusals_before_any_work(tiny_model, run_cli, tmp_path):
    """MindIE has no W4A4 type; routed experts have no W4A4 method; the weights are per channel only."""
    src = tiny_model("qwen3_moe", dtype="bf16")
    out = tmp_path / "o"
    cases = [
        (["--scheme", "w4a4_dynamic", "--engine", "mindie"], "cannot be W4A4_DYNAMIC"),
        (["--scheme", "w8a8_dynamic", "--moe-scheme", "w4a4_dynamic", "--engine", "vllm-ascend"],
         "registered for linear layers only"),
        (["--scheme", "w4a4_dynamic", "--engine", "vllm-ascend", "--group-size", "64"], "per channel"),
    ]
    for args, says in cases:
        r = run_cli(["quantize", "-m", src, "-o", out, *args, "--method", "rtn"])
        assert r.code == 2, (args, r.err)
        assert says in r.err and "Traceback" not in r.err, r.err
        assert not out.exists()
