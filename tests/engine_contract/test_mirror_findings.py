"""Each MindIE loader rule found by reading its code (no loader runs here) has a mirror check in
tests/engine_contract/; these tests show each check catches the mistake it stands for, on a copy of a real dsconv
output broken in exactly that way. A mirror that accepted the broken copy would prove nothing about the real one."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine_contract import mindie_sharded
from tests.engine_contract.test_quantize_contract import _read

pytestmark = [pytest.mark.cli, pytest.mark.slow]


def _copy(src: Path, tmp_path: Path) -> Path:
    d = tmp_path / src.name
    shutil.copytree(src, d)
    return d


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(d: Path, edit) -> None:
    for f in sorted(d.glob("*.safetensors")):
        t = load_file(str(f))
        if edit(t):
            save_file(t, str(f), metadata={"format": "pt"})


def test_dsconv_output_passes_every_mindie_rule(produce):
    """The unbroken outputs the copies below come from."""
    for family in ("deepseek_v3", "qwen2"):
        r = produce(family, "bits8", "mindie")
        assert _read("mindie", r.out, r.src) == []


@pytest.mark.parametrize("key,value,rule", [
    ("torch_dtype", None, "ModelRunner.__init__"),        # transformers 5 writes `dtype` only
    ("rope_scaling", None, "DeepseekV2Config.__init__"),  # required argument (null allowed)
    ("topk_method", None, "router_deepseekv2"),           # transformers 5's DeepseekV3 config has none
    ("rope_theta", None, "config rope_theta"),            # MindIE defaults it to 10000
])
def test_config_keys_mindie_reads(key, value, rule, produce, tmp_path):
    """config_deepseekv2.py / model_runner.py / router_deepseekv2.py read these keys with no usable default."""
    r = produce("deepseek_v3", "bits8", "mindie")
    d = _copy(r.out, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    if key == "rope_theta":  # a model whose theta is not MindIE's default
        cfg["rope_parameters"]["rope_theta"] = 1e6
        cfg["rope_theta"] = 1e6
        (d / "config.json").write_text(json.dumps(cfg))
    _edit_config(d, **{key: value})
    problems = _read("mindie", d, r.src)
    assert any(rule in p for p in problems), problems


def test_scales_the_model_dtype_cannot_hold(produce, tmp_path):
    """correct_tensor_dtype casts input_scale / weight_scale to the model dtype: a float32 value off bf16's grid."""
    r = produce("qwen2", "bits8", "mindie")
    d = _copy(r.out, tmp_path)

    def nudge(t: dict) -> bool:
        k = next((k for k in sorted(t) if k.endswith(".input_scale")), None)
        if k is not None:
            t[k] = t[k] * (1 + 2.0 ** -12)
        return k is not None

    _edit_tensors(d, nudge)
    assert any("correct_tensor_dtype" in p for p in _read("mindie", d, r.src))


def test_mla_w4a16_per_group_is_refused_and_the_mirror_catches_it(produce, tmp_path):
    """process_mla_linear.py::preprocess_linear_for_rope permutes rope rows on the stored weight: dsconv refuses
    per-group W4A16 (packed along n) there for MindIE; written anyway, the mirror flags it; per channel is fine."""
    from dsconv.engines import profiles
    from dsconv.quant.plan.options import QuantOptions
    from dsconv.quant.stage import QuantRequest, run
    from tests.engine_contract.conftest import FAST, SCHEMES

    r = produce("deepseek_v3", "w4a16", "mindie")
    assert r.out is None and "preprocess_linear_for_rope" in r.refusal and "--group-size 0" in r.refusal
    object.__setattr__(profiles.MINDIE, "rope_rows_packed_ok", True)  # the frozen profile, for this write only
    try:
        out = tmp_path / "w4g"
        run(QuantRequest(r.src, out, QuantOptions(**{**FAST, **SCHEMES["w4a16"], "engine": "mindie"}),
                         progress=False))
    finally:
        object.__setattr__(profiles.MINDIE, "rope_rows_packed_ok", False)
    assert any("preprocess_linear_for_rope" in p for p in _read("mindie", out, r.src))
    pc = produce("deepseek_v3", "w4a16_pc", "mindie")
    assert pc.out is not None and _read("mindie", pc.out, pc.src) == []


def test_router_rows_rotated_in_one_ep_folder(tmp_path, run_cli):
    """DeepseekMoE.__init__ rotates the router rows at load even for offline-sharded weights: stored rotated, as
    MindIE's own weight_sharder dumps them, the mirror reports a double rotation."""
    from dsconv.demo import write_demo_model

    model = write_demo_model(tmp_path / "model")
    out = tmp_path / "sh"
    assert run_cli(["shard", "-m", model, "--ep", 4, "--tp", 2, "-o", out]).code == 0
    assert mindie_sharded.read(out) == []
    folder = out / "model-moe-tp-000-ep-001"

    def rotate(t: dict) -> bool:
        keys = [k for k in t if k.endswith((".mlp.gate.weight", ".mlp.gate.bias"))]
        for k in keys:
            t[k] = torch.roll(t[k], shifts=-4, dims=0)
        return bool(keys)

    _edit_tensors(folder, rotate)
    assert any("DeepseekMoE.__init__" in p for p in mindie_sharded.read(out))
