"""Every preflight rule, table-driven: a small ONNX model built for the rule, the verdict, the words of the message.

A `fail` row also checks that the failure is a one-line UserError (exit 2) naming the rule and carrying the fix.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dsconv.atc.findings import Finding
from dsconv.atc.graph import read_model
from dsconv.atc.options import AtcOptions
from dsconv.atc.preflight import Thresholds, check_mixed_int, check_soc
from dsconv.atc.profiles import load_profile
from dsconv.soc import PROFILE_DIR
from dsconv.atc.samples import tiny_lm
from dsconv.atc.shapes import Role, classify
from dsconv.atc.stage import AtcRequest, plan
from dsconv.errors import UserError

pytestmark = pytest.mark.unit


def verdicts(req: AtcRequest) -> tuple[dict[str, list[Finding]], UserError | None]:
    """rule -> findings; for a stopped plan, the failed rules from the UserError (first one + details)."""
    try:
        p = plan(req)
    except UserError as e:
        out: dict[str, list[Finding]] = {}
        lines = [e.one_line()] + (e.details.splitlines() if e.details else [])
        for line in lines:
            rule = line.split("[", 1)[1].split("]", 1)[0]
            out.setdefault(rule, []).append(Finding(rule, "fail", line))
        return out, e
    out = {}
    for f in p.findings:
        out.setdefault(f.rule, []).append(f)
    return out, None


def _rm_data(path: Path) -> None:
    (path.parent / (path.name + ".data")).unlink()


def _truncate_data(path: Path) -> None:
    d = path.parent / (path.name + ".data")
    d.write_bytes(d.read_bytes()[:10])


def _layernorm_model(path: Path, opset: int) -> Path:
    x = helper.make_tensor_value_info("input_ids", TensorProto.FLOAT, ["batch", "seq", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    g = helper.make_graph([helper.make_node("LayerNormalization", ["input_ids", "g"], ["y"], name="ln")], "g", [x],
                          [y], [numpy_helper.from_array(np.ones(4, np.float32), "g")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def _unknown_dim_model(path: Path) -> Path:
    x = helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 4, "weird"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    g = helper.make_graph([helper.make_node("Relu", ["features"], ["y"], name="relu")], "g", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def _profile(tmp_path: Path, **changes: Any) -> Path:
    data = json.loads((PROFILE_DIR / "Ascend310P3.json").read_text())
    data.update(changes)
    p = tmp_path / "own.json"
    p.write_text(json.dumps(data))
    return p


# (id, model kwargs | builder, post-process, request kwargs, rule, status, words in the message)
ROWS: list[tuple[str, Any, Callable | None, dict, str, str, str]] = [
    ("opset-14", {}, None, {}, "opset", "pass", "opset 14"),
    ("opset-16-warn", {"opset": 16}, None, {}, "opset", "warn", "outside 11-15"),
    ("opset-19", {"opset": 19}, None, {}, "opset", "fail", "opset 19"),
    ("opset-8", {"opset": 8}, None, {}, "opset", "fail", "accepts 9-18"),
    ("external-data-ok", {"external_data": True}, None, {}, "external-data", "pass", "1 external data file"),
    ("external-data-missing", {"external_data": True}, _rm_data, {}, "external-data", "fail", "is missing"),
    ("external-data-truncated", {"external_data": True}, _truncate_data, {}, "external-data", "fail", "truncated"),
    ("over-2gb-inline", {}, None, {"thresholds": Thresholds(protobuf_limit=4096)}, "external-data", "fail",
     "save_as_external_data=True"),
    ("over-2gb-external-ok", {"external_data": True}, None, {"thresholds": Thresholds(protobuf_limit=4096)},
     "external-data", "pass", "external data"),
    ("input-names-unknown", {}, None, {"input_shape": "input_ids:-1,-1;mask:-1,-1"}, "input-names", "fail",
     "names mask"),
    ("input-names-missing", {}, None, {"input_shape": "input_ids:-1,-1"}, "input-names", "fail",
     "leaves out dynamic input(s) attention_mask"),
    ("input-rank", {}, None, {"input_shape": "input_ids:-1,-1,-1;attention_mask:-1,-1"}, "input-rank", "fail",
     "rank 3, the model has rank 2"),
    ("input-shape-ok", {}, None, {"input_shape": "input_ids:1,-1;attention_mask:1,-1"}, "input-rank", "pass", ""),
    ("dynamic-dim-role", _unknown_dim_model, None, {}, "dynamic-dim-role", "fail", "features axis 2"),
    ("gear-count-110", {}, None, {"batch": list(range(1, 12)), "seq": list(range(16, 176, 16))}, "gear-count",
     "fail", "110 gear(s); ATC accepts 2 to 100"),
    ("gear-count-static", {}, None, {"batch": [1], "seq": [128]}, "gear-count", "pass", "static shapes"),
    ("gear-count-ok", {}, None, {"batch": [1, 4], "seq": [128, 512, 1024]}, "gear-count", "pass", "6 gears"),
    ("dims-per-gear", {"kv_cache": True}, None, {}, "dims-per-gear", "warn", "6 dynamic dimensions per gear"),
    ("dims-per-gear-ok", {}, None, {}, "dims-per-gear", "pass", "4 dynamic"),
    ("two-dynamic-options", {}, None, {"dynamic_batch_size": True, "input_shape_range": True},
     "one-dynamic-option", "fail", "both given"),
    ("int8-dynamic", {"int8": True}, None, {}, "int8-dynamic", "fail", "QuantizeLinear"),
    ("int8-static", {"int8": True}, None, {"batch": [1], "seq": [128]}, "int8-dynamic", "pass", "static shapes"),
    ("int8-range", {"int8": True}, None, {"batch": [1, 2], "seq": [128], "input_shape_range": True},
     "int8-dynamic", "fail", "(range)"),
    ("int8-one-value-range", {"int8": True}, None, {"batch": [1], "seq": [128], "input_shape_range": True},
     "int8-dynamic", "pass", "static shapes"),
    ("precision-v1-v2", {}, None, {"precision_mode": "force_fp16", "precision_mode_v2": "fp16"},
     "precision-v1-v2", "fail", "both given"),
    ("bf16-mode-310p3", {}, None, {"soc": "Ascend310P3", "precision_mode": "allow_mix_precision_bf16"},
     "precision-mode-soc", "fail", "not available on Ascend310P3 (no BF16)"),
    ("bf16-mode-v2-310p3", {}, None, {"soc": "Ascend310P3", "precision_mode_v2": "mixed_bfloat16"},
     "precision-mode-soc", "fail", "(no BF16)"),
    ("bf16-mode-910b", {}, None, {"precision_mode": "allow_fp32_to_bf16"}, "precision-mode-soc", "pass", ""),
    ("bf16-model-310p3", {"dtype": "bfloat16"}, None, {"soc": "Ascend310P3"}, "bf16-model", "fail",
     "--cast-fp16"),
    ("bf16-model-310p3-cast", {"dtype": "bfloat16"}, None, {"soc": "Ascend310P3", "cast_fp16": True},
     "bf16-model", "pass", "cast to FP16"),
    ("bf16-model-910b", {"dtype": "bfloat16"}, None, {}, "bf16-model", "pass", "has BF16"),
    ("mixed-int", {"mixed_int": True}, None, {}, "mixed-int", "fail", "mixed_add"),
    ("mixed-int-ok", {}, None, {}, "mixed-int", "pass", ""),
    ("topk-indices", {"topk_index_add": True}, None, {}, "topk-indices", "warn", "TopK indices"),
    ("custom-op", {"custom_op": True}, None, {}, "onnx-ops", "fail", "MyCustomOp (custom_0)"),
    ("doubtful-qdq", {"int8": True}, None, {"batch": [1], "seq": [128]}, "onnx-ops-doubtful", "warn",
     "QuantizeLinear (quant): not in CANN 8.0's ONNX operator list"),
    ("layernorm-opset-14", lambda p: _layernorm_model(p, 14), None, {}, "onnx-ops", "fail",
     "LayerNormalization needs opset 17"),
    ("layernorm-opset-17", lambda p: _layernorm_model(p, 17), None, {}, "onnx-ops", "pass", ""),
    ("quant-fusion-on", {"int8": True}, None, {"batch": [1], "seq": [128], "soc": "Ascend910B3",
                                                "fusion": ["V100RequantFusionPass=on"]}, "quant-fusion", "warn",
     "needs off for quantized"),
]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_rule(tmp_path, row):
    _, model, post, req_kw, rule, status, words = row
    path = tmp_path / "model.onnx"
    if callable(model):
        model(path)
    else:
        tiny_lm(path, **model)
    if post:
        post(path)
    kw = {"soc": "Ascend910B3", **req_kw}
    found, err = verdicts(AtcRequest(onnx=path, output=tmp_path / "out", **kw))
    assert rule in found, f"{rule} not reported: {found}"
    got = found[rule]
    assert any(f.status == status for f in got), got
    assert any(words in f.line() for f in got if f.status == status), got
    if status == "fail":
        assert err is not None and err.exit_code == 2
        assert "\n" not in err.one_line() and ";" in err.one_line()  # one line, with the fix after ';'
    else:
        assert err is None or rule not in err.one_line()


@pytest.mark.parametrize("usable_mb,frac,precision,status,words", [
    (1, 0.8, None, "fail", "do not fit one device"),
    (2, 0.8, None, "pass", "(75.0%)"),
    (2, 0.5, None, "warn", "KV cache and workspace"),
    (2, 0.8, "must_keep_origin_dtype", "fail", "do not fit"),  # fp32 weights stay 4 bytes
])
def test_weight_memory(tmp_path, usable_mb, frac, precision, status, words):
    path = tiny_lm(tmp_path / "m.onnx", vocab=4096, hidden=96)  # 3 MiB of fp32 weights, 1.5 MiB as fp16
    prof = _profile(tmp_path, usable_memory_mb=usable_mb, device_memory_mb=usable_mb, memory_warn_fraction=frac)
    found, err = verdicts(AtcRequest(onnx=path, output=tmp_path / "o", profile=prof, precision_mode=precision))
    assert [f.status for f in found["weight-memory"]] == [status]
    assert words in found["weight-memory"][0].line()


def test_unsupported_ops_name_every_node(tmp_path):
    path = tiny_lm(tmp_path / "m.onnx", custom_op=True)
    with pytest.raises(UserError) as e:
        plan(AtcRequest(onnx=path, output=tmp_path / "o", soc="Ascend310P3"))
    line = e.value.one_line()
    assert "[onnx-ops]" in line and "MyCustomOp (custom_0)" in line and "EZ3003" in line and "--profile" in line


def test_mixed_int_reports_types(tmp_path):
    info = read_model(tiny_lm(tmp_path / "m.onnx", mixed_int=True))
    bad = [f for f in check_mixed_int(info) if f.status == "fail"]
    assert len(bad) == 1 and "input_ids INT64" in bad[0].message and "offset_i32 INT32" in bad[0].message


def test_soc_rule():
    p = load_profile("Ascend310P3")
    o = AtcOptions(model="m.onnx", framework=5, output="model", soc_version="Ascend910B3")
    assert check_soc(o, p)[0].status == "fail"
    assert check_soc(o.with_(soc_version="Ascend310P3"), p)[0].status == "pass"


def test_several_failures_one_line_plus_details(tmp_path):
    path = tiny_lm(tmp_path / "m.onnx", opset=19, custom_op=True, mixed_int=True)
    with pytest.raises(UserError) as e:
        plan(AtcRequest(onnx=path, output=tmp_path / "o", soc="Ascend910B3"))
    assert e.value.one_line().startswith("m.onnx: [opset]")
    assert "[mixed-int]" in e.value.details and "[onnx-ops]" in e.value.details


def test_header_only_read_of_external_data(tmp_path):
    """The rules read shapes and byte ranges from the header; the weights file is never opened."""
    path = tiny_lm(tmp_path / "m.onnx", external_data=True, vocab=512, hidden=32)
    data = tmp_path / "m.onnx.data"
    info = read_model(path)
    assert info.external_files == {"m.onnx.data": data.stat().st_size}
    assert info.weight_bytes == 2 * 512 * 32 * 4 + 8
    assert info.inline_bytes < 100


@pytest.mark.parametrize("name,dims,roles", [
    ("input_ids", ["batch", "seq"], [Role.BATCH, Role.SEQ]),
    ("input_ids", ["input_ids_dynamic_axes_1", "input_ids_dynamic_axes_2"], [Role.BATCH, Role.SEQ]),
    ("input_ids", ["s0", "s1"], [Role.BATCH, Role.SEQ]),
    ("attention_mask", ["batch_size", "past_sequence_length + 1"], [Role.BATCH, Role.TOTAL]),
    ("past_key_values.0.key", ["batch", 8, "past_sequence", 64], [Role.BATCH, Role.STATIC, Role.PAST, Role.STATIC]),
    ("past_key_values.3.value", [None, 8, None, 64], [Role.BATCH, Role.STATIC, Role.PAST, Role.STATIC]),
    ("inputs_embeds", ["b", "s", 16], [Role.BATCH, Role.SEQ, Role.STATIC]),
    ("pixel_values", ["b", 3, "h", "w"], [Role.BATCH, Role.STATIC, Role.UNKNOWN, Role.UNKNOWN]),
])
def test_dim_roles(name, dims, roles):
    from dsconv.atc.graph import ValueInfo

    vi = [ValueInfo(name, TensorProto.INT64, tuple(dims))]
    if "past" in name:
        vi.append(ValueInfo("attention_mask", TensorProto.INT64, ("batch", None)))
    got = [d.role for d in classify(vi) if d.input == name]
    assert got == roles
