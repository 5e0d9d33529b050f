"""The ATC option grammar: typed table, render/parse round trips, and the combination rules ATC enforces."""
from __future__ import annotations

import pytest

from dsconv.atc.options import (OPTIONS, AtcOptions, InputShape, check_combinations, parse_argv, parse_gears,
                                parse_script, render_gears)
from dsconv.errors import UserError

pytestmark = pytest.mark.unit

BASE = dict(model="m.onnx", framework=5, output="model", soc_version="Ascend910B3")


def opts(**kw) -> AtcOptions:
    return AtcOptions(**{**BASE, **kw})


def statuses(o: AtcOptions) -> dict[str, str]:
    out: dict[str, str] = {}
    for f in check_combinations(o):
        if out.get(f.rule) != "fail":
            out[f.rule] = f.status
    return out


# ---------------------------------------------------------------- --input_shape and gears


@pytest.mark.parametrize("text", [
    "input_ids:-1,-1;attention_mask:-1,-1",
    "input_ids:1,128",
    "input_ids:1~8,128~1024;attention_mask:1~8,128~1024",
    "past_key_values.0.key:-1,2,-1,8;input_ids:-1,-1",
    "input:0:1,3",  # TF-style names keep their colon
])
def test_input_shape_round_trip(text):
    assert InputShape.parse(text).render() == text


@pytest.mark.parametrize("text,needle", [
    ("input_ids", "name:d0"), ("input_ids:1,x", "not a size"), ("input_ids:0,4", "dimension 0"),
    ("input_ids:8~1,4", "lo <= hi"), ("a:1;a:2", "twice"), ("", "empty"),
])
def test_input_shape_rejects(text, needle):
    with pytest.raises(UserError, match=needle):
        InputShape.parse(text)


def test_input_shape_counts():
    s = InputShape.parse("a:-1,4,-1;b:1~4,2")
    assert s.dynamic_count == 2 and s.has_ranges
    assert s.as_dict()["a"] == (-1, 4, -1)


def test_gears_round_trip():
    g = parse_gears("1,128,1,128;4,512,4,512")
    assert g == ((1, 128, 1, 128), (4, 512, 4, 512))
    assert render_gears(g) == "1,128,1,128;4,512,4,512"
    with pytest.raises(UserError):
        parse_gears("1,x")
    with pytest.raises(UserError):
        parse_gears("1,-4")


# ---------------------------------------------------------------- the typed table


# every option dsconv can write, with a value: render -> parse must give the same typed value back
EVERY_OPTION = {
    "model": "/data/m.onnx", "framework": "5", "output": "model", "soc_version": "Ascend310P3", "input_format": "ND",
    "input_shape": "input_ids:-1,-1;attention_mask:-1,-1", "dynamic_dims": "1,128,1,128;4,512,4,512",
    "dynamic_batch_size": "1,2,4", "dynamic_image_size": "224,224;448,448", "input_shape_range": "x:[1~4,3]",
    "precision_mode": "allow_mix_precision", "precision_mode_v2": "mixed_float16",
    "op_select_implmode": "high_precision", "op_precision_mode": "op_precision.ini",
    "optypelist_for_implmode": "Pooling,SoftmaxV2",
    "fusion_switch_file": "fusion_switch.cfg", "keep_dtype": "keep_dtype.cfg", "out_nodes": "MatMul_1:0;Add_2:0",
    "output_type": "FP16", "log": "error", "external_weight": "1", "host_env_os": "linux", "host_env_cpu": "aarch64",
}


def test_table_covers_every_field():
    assert set(OPTIONS) == set(EVERY_OPTION) == {f for f in AtcOptions.__dataclass_fields__}


@pytest.mark.parametrize("name", sorted(EVERY_OPTION))
def test_every_option_renders_and_parses_back(name):
    values = {**{k: str(v) for k, v in BASE.items()}, name: EVERY_OPTION[name]}
    o = AtcOptions.from_text_values(values)
    assert dict(o.items())[name] == EVERY_OPTION[name]
    assert parse_argv(o.argv()) == o
    script = "#!/bin/bash\nset -e\n\"${ATC_BIN:-atc}\" " + " \\\n  ".join(o.shell_lines()) + "\n"
    assert parse_script(script) == o


@pytest.mark.parametrize("values,needle", [
    ({"precision_mode": "fp17"}, "--precision_mode=fp17 is not an ATC value"),
    ({"precision_mode_v2": "allow_mix_precision"}, "precision_mode_v2"),
    ({"op_select_implmode": "fast"}, "op_select_implmode"),
    ({"soc_version": "Ascend910C"}, "soc_version"),
    ({"framework": "4"}, "framework"),
    ({"log": "verbose"}, "--log=verbose"),
    ({"dynamic_batch_size": "1,0"}, "positive"),
    ({"precison_mode": "force_fp16"}, "unknown ATC option --precison_mode"),
])
def test_unknown_keys_and_values_rejected(values, needle):
    with pytest.raises(UserError, match=needle):
        AtcOptions.from_text_values({**{k: str(v) for k, v in BASE.items()}, **values})


def test_missing_required_option():
    with pytest.raises(UserError, match="missing --soc_version"):
        AtcOptions.from_text_values({"model": "m.onnx", "framework": "5", "output": "o"})


def test_parse_argv_forms_and_errors():
    a = parse_argv(["--model", "m.onnx", "--framework=5", "--output=o", "--soc_version=Ascend910B3"])
    assert a.model == "m.onnx" and a.framework == 5
    with pytest.raises(UserError, match="given twice"):
        parse_argv(["--model=a.onnx", "--model=b.onnx"])
    with pytest.raises(UserError, match="unexpected argument"):
        parse_argv(["model.onnx"])
    with pytest.raises(UserError, match="has no value"):
        parse_argv(["--model"])


def test_parse_script_reads_cann_doc_style_lines():
    script = """# comment
export FOO=1
atc --model=model.onnx --framework=5 --output=out/model --soc_version=Ascend910B3 \\
    --input_format=ND --input_shape="input_ids:-1,-1;attention_mask:-1,-1" \\
    --dynamic_dims="1,128,1,128;1,512,1,512;4,512,4,512" \\
    --precision_mode=allow_mix_precision --op_select_implmode=high_performance \\
    --fusion_switch_file=fusion_switch.cfg --log=error
"""
    o = parse_script(script)
    assert o.dynamic_dims == ((1, 128, 1, 128), (1, 512, 1, 512), (4, 512, 4, 512))
    assert o.input_shape.render() == "input_ids:-1,-1;attention_mask:-1,-1"
    assert o.op_select_implmode == "high_performance"
    with pytest.raises(UserError, match="no atc command"):
        parse_script("echo hello\n")


# ---------------------------------------------------------------- combination rules (each one a row)

SHAPE2 = InputShape.parse("input_ids:-1,-1;attention_mask:-1,-1")
GEARS2 = ((1, 128, 1, 128), (4, 512, 4, 512))


@pytest.mark.parametrize("kw,rule,status", [
    (dict(input_format="ND", input_shape=SHAPE2, dynamic_dims=GEARS2), "one-dynamic-option", "pass"),
    (dict(input_format="ND", input_shape=SHAPE2, dynamic_dims=GEARS2, dynamic_batch_size=(1, 2)),
     "one-dynamic-option", "fail"),
    (dict(input_shape=InputShape.parse("x:1~4,8"), dynamic_batch_size=(1, 2)), "one-dynamic-option", "fail"),
    (dict(input_shape=SHAPE2, input_shape_range="x:[1~4]", dynamic_dims=GEARS2, input_format="ND"),
     "one-dynamic-option", "fail"),
    (dict(input_shape=SHAPE2), "dynamic-needs-gears", "fail"),  # -1 without gears: E10001
    (dict(input_shape=InputShape.parse("x:1,8"), dynamic_dims=((1,), (2,)), input_format="ND"),
     "dynamic-needs-gears", "fail"),
    (dict(input_format="NCHW", input_shape=SHAPE2, dynamic_dims=GEARS2), "dynamic-dims-nd", "fail"),
    (dict(input_format="ND", input_shape=SHAPE2, dynamic_dims=((1, 128), (4, 512))), "gear-width", "fail"),
    (dict(input_format="ND", input_shape=SHAPE2, dynamic_dims=(GEARS2[0], GEARS2[0])), "gear-unique", "fail"),
    (dict(input_format="ND", input_shape=SHAPE2, dynamic_dims=(GEARS2[0],)), "gear-count", "fail"),
    (dict(input_format="ND", input_shape=SHAPE2, dynamic_dims=tuple((1, s, 1, s) for s in range(1, 102))),
     "gear-count", "fail"),
    (dict(input_format="ND", input_shape=SHAPE2, dynamic_dims=tuple((1, s, 1, s) for s in range(1, 101))),
     "gear-count", "pass"),
    (dict(input_shape=InputShape.parse("x:-1,8;y:1,-1"), dynamic_batch_size=(1, 2)), "batch-only", "fail"),
    (dict(precision_mode="force_fp16", precision_mode_v2="fp16"), "precision-v1-v2", "fail"),
    (dict(op_select_implmode="high_precision_for_all", optypelist_for_implmode=("SoftmaxV2",)),
     "optypelist-implmode", "fail"),
    (dict(optypelist_for_implmode=("SoftmaxV2",)), "optypelist-implmode", "fail"),
    (dict(precision_mode="must_keep_origin_dtype", keep_dtype="k.cfg"), "keep-dtype-ignored", "warn"),
    (dict(precision_mode_v2="origin", keep_dtype="k.cfg"), "keep-dtype-ignored", "warn"),
    (dict(model="m.pb"), "framework", "warn"),
])
def test_combination_rules(kw, rule, status):
    assert statuses(opts(**kw)).get(rule) == status


def test_clean_command_has_no_failures():
    o = opts(input_format="ND", input_shape=SHAPE2, dynamic_dims=GEARS2, precision_mode="allow_mix_precision",
             op_select_implmode="high_precision", optypelist_for_implmode=("SoftmaxV2",))
    assert not [f for f in check_combinations(o) if f.status != "pass"]
