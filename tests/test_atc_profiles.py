"""SoC profiles are data: bundled files load and say what the reference says; bad files are rejected by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsconv.atc.options import PRECISION_MODES, PRECISION_MODES_V2
from dsconv.atc.profiles import load_profile, load_profile_file
from dsconv.soc import PROFILE_DIR, available_socs
from dsconv.errors import UserError

pytestmark = pytest.mark.unit

VARIANTS_64GB = ["Ascend910B1", "Ascend910B2", "Ascend910B2C", "Ascend910B3", "Ascend910B4-1"]


def test_bundled_socs():
    assert set(available_socs()) == {"Ascend910B", *VARIANTS_64GB, "Ascend910B4", "Ascend310P3"}


@pytest.mark.parametrize("soc", VARIANTS_64GB + ["Ascend910B4", "Ascend310P3"])
def test_every_bundled_profile_loads(soc):
    p = load_profile(soc)
    assert p.soc_version == soc
    assert set(p.precision_modes) <= set(PRECISION_MODES) and set(p.precision_modes_v2) <= set(PRECISION_MODES_V2)
    assert p.precision_default in p.precision_modes
    assert {"MatMul", "Gather", "Softmax", "TopK", "OneHot", "IsNaN", "AscendQuant"} <= p.onnx_ops
    assert "MyCustomOp" not in p.onnx_ops and "NonZero" not in p.onnx_ops
    assert {"QuantizeLinear", "DequantizeLinear", "MatMulInteger", "NonZero"} == set(p.onnx_ops_doubtful)
    assert p.fusion_graph == {"ALL": "on"} and p.fusion_ub == {"ALL": "on"}
    assert p.quantized_off_ub == ("TbePool2dQuantFusionPass",)
    assert (p.opset_safe_min, p.opset_safe_max) == (11, 15)


@pytest.mark.parametrize("soc,mb", [(v, 65536) for v in VARIANTS_64GB] + [("Ascend910B4", 32768)])
def test_910b_memory_and_bf16(soc, mb):
    p = load_profile(soc)
    assert p.device_memory_mb == mb and p.bf16
    assert {"allow_mix_precision_bf16", "allow_fp32_to_bf16"} <= set(p.precision_modes)
    assert "mixed_bfloat16" in p.precision_modes_v2
    assert p.quantized_off_graph == ("V100RequantFusionPass",)


def test_310p3_has_no_bf16():
    p = load_profile("Ascend310P3")
    assert not p.bf16 and p.device_memory_mb == 24576 and p.usable_memory_mb < p.device_memory_mb
    assert not [m for m in p.precision_modes + p.precision_modes_v2 if "bf16" in m or "bfloat16" in m]
    assert p.quantized_off_graph == ("V200RequantFusionPass",)


def test_family_names_its_assumed_variant():
    p = load_profile("Ascend910B")
    assert p.soc_version == "Ascend910B3" and p.assumed_from == "Ascend910B"
    assert [Path(f).name for f in p.files] == ["Ascend910B3.json", "_common_910b.json"]


def test_soc_names_are_case_insensitive():
    assert load_profile("ascend310p3").soc_version == "Ascend310P3"


def test_unknown_soc_is_a_user_error():
    with pytest.raises(UserError, match="no dsconv profile for SoC 'Ascend310P1'"):
        load_profile("Ascend310P1")
    with pytest.raises(UserError, match="no --soc"):
        load_profile(None)


def _write(tmp_path: Path, name: str, data: dict) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(data))
    return p


def _own(tmp_path: Path, **changes) -> Path:
    data = json.loads((PROFILE_DIR / "Ascend310P3.json").read_text())
    data.update(changes)
    return _write(tmp_path, "Mine.json", data)


def test_user_profile_file(tmp_path):
    p = load_profile(profile=_own(tmp_path, usable_memory_mb=1000))
    assert p.usable_memory_mb == 1000 and p.path.name == "Mine.json"


def test_user_profile_can_extend_a_bundled_base(tmp_path):
    f = _write(tmp_path, "B3x.json", {"schema": 1, "extends": "_common_910b.json", "soc_version": "Ascend910B3",
                                      "device_memory_mb": 1, "usable_memory_mb": 1})
    p = load_profile_file(f)
    assert p.bf16 and p.usable_memory_mb == 1 and "MatMul" in p.onnx_ops


@pytest.mark.parametrize("changes,needle", [
    ({"precison": {}}, "unknown key 'precison'"),
    ({"device_memory_mb": "24GB"}, "device_memory_mb must be int"),
    ({"gears": {"batch": [1, 4], "seq": [128], "past": [1], "min_gears": 2, "max_gears": 100,
                "max_dims_per_gear": 4, "bacth": [1]}}, "unknown key 'bacth'"),
    ({"gears": {"batch": [], "seq": [128]}}, "gears.batch must be a non-empty list"),
    ({"precision": {"modes": ["force_fp16"], "default": "allow_mix_precision", "modes_v2": []}},
     "precision.default allow_mix_precision is not in precision.modes"),
    ({"precision": {"modes": ["force_fp16", "allow_mix_precision_bf16"], "default": "force_fp16", "modes_v2": []}},
     "dtypes.bf16 is false but precision modes allow_mix_precision_bf16"),
    ({"precision": {"modes": ["force_fp61"], "default": "force_fp61", "modes_v2": []}}, "ATC does not know"),
    ({"fusion": {"GraphFusion": {"ALL": "OFF"}, "UBFusion": {}}}, "use \"on\" or \"off\""),
    ({"opset": {"min": 11, "max": 15, "safe_min": 9, "safe_max": 15}}, "min <= safe_min"),
    ({"onnx_ops_min_opset": {"Gelu": 20}}, "onnx_ops_min_opset.Gelu"),
    ({"onnx_ops_doubtful": {"MatMul": "why"}}, "MatMul is in both"),
])
def test_bad_profiles_rejected(tmp_path, changes, needle):
    with pytest.raises(UserError, match=needle):
        load_profile(profile=_own(tmp_path, **changes))


def test_profile_missing_keys_and_bad_json(tmp_path):
    with pytest.raises(UserError, match="missing"):
        load_profile(profile=_write(tmp_path, "a.json", {"schema": 1, "soc_version": "Ascend310P3"}))
    bad = tmp_path / "b.json"
    bad.write_text("{ not json")
    with pytest.raises(UserError, match="b.json:1: invalid JSON"):
        load_profile(profile=bad)
    with pytest.raises(UserError, match="family file"):
        load_profile(profile=PROFILE_DIR / "Ascend910B.json")


def test_soc_and_profile_must_agree(tmp_path):
    with pytest.raises(UserError, match="does not match"):
        load_profile("Ascend910B3", profile=_own(tmp_path))
