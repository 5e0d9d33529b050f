"""`dsconv atc` as a user runs it: every generated option, atc.sh parsed back == profile.json, files, exit codes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsconv.atc.fusion import parse_switch_file
from dsconv.atc.options import AtcOptions, parse_script
from dsconv.atc.samples import tiny_lm
from dsconv.cli import main

pytestmark = pytest.mark.cli


def run(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def generate(tmp_path: Path, capsys, args: list[str], model_kw: dict | None = None, soc: str = "Ascend910B"):
    onnx = tiny_lm(tmp_path / "model.onnx", **(model_kw or {}))
    out = tmp_path / "out"
    code, stdout, stderr = run(["atc", "--onnx", str(onnx), "--soc", soc, "-o", str(out), "--json", *args], capsys)
    assert code == 0, stderr
    summary = json.loads(stdout)  # --json: stdout is one JSON object, nothing else
    soc_dir = Path(summary["soc_dir"])
    opts = parse_script((soc_dir / "atc.sh").read_text())
    prof = json.loads((soc_dir / "profile.json").read_text())
    # the generated atc.sh parsed back equals the profile, option by option and decision by decision
    assert opts == AtcOptions.from_json(prof["atc_options"])
    dec = prof["decisions"]
    assert opts.soc_version == dec["soc_version"]["value"]
    assert opts.op_select_implmode == dec["op_select_implmode"]["value"]
    assert opts.log == dec["log"]["value"]
    assert opts.precision_mode == dec.get("precision_mode", {}).get("value")
    assert opts.precision_mode_v2 == dec.get("precision_mode_v2", {}).get("value")
    assert (opts.optypelist_for_implmode or None) == (tuple(dec["optypelist_for_implmode"]["value"])
                                                      if "optypelist_for_implmode" in dec else None)
    assert parse_switch_file((soc_dir / opts.fusion_switch_file).read_text()) == prof["fusion"]["switches"]
    assert prof["command"] == "atc " + " ".join(__import__("shlex").quote(a) for a in opts.argv())
    return opts, prof, summary, stderr


G_DEFAULT = "1,128,1,128;1,512,1,512;1,1024,1,1024;1,2048,1,2048;4,128,4,128;4,512,4,512;4,1024,4,1024;" \
            "4,2048,4,2048;8,128,8,128;8,512,8,512;8,1024,8,1024;8,2048,8,2048"

# (id, soc, cli args, model kwargs, {atc option: expected text}, absent options)
ROWS = [
    ("defaults-910b", "Ascend910B", [], {},
     {"soc_version": "Ascend910B3", "framework": "5", "output": "model", "input_format": "ND",
      "input_shape": "input_ids:-1,-1;attention_mask:-1,-1", "dynamic_dims": G_DEFAULT,
      "precision_mode": "allow_mix_precision", "op_select_implmode": "high_precision",
      "optypelist_for_implmode": "SoftmaxV2", "fusion_switch_file": "fusion_switch.cfg", "log": "error"},
     ["precision_mode_v2", "keep_dtype", "dynamic_batch_size"]),
    ("defaults-310p3", "Ascend310P3", [], {},
     {"soc_version": "Ascend310P3", "dynamic_dims": "1,128,1,128;1,512,1,512;1,1024,1,1024;4,128,4,128;"
                                                   "4,512,4,512;4,1024,4,1024"}, []),
    ("gears", "Ascend910B2", ["--batch", "4,1", "--seq", "128,512,1024"], {},
     {"soc_version": "Ascend910B2",
      "dynamic_dims": "1,128,1,128;1,512,1,512;1,1024,1,1024;4,128,4,128;4,512,4,512;4,1024,4,1024"}, []),
    ("static", "Ascend910B", ["--batch", "1", "--seq", "128"], {},
     {"input_shape": "input_ids:1,128;attention_mask:1,128"}, ["dynamic_dims", "dynamic_batch_size"]),
    ("dynamic-batch-size", "Ascend910B", ["--dynamic-batch-size", "--batch", "1,2,4", "--seq", "128,256"], {},
     {"input_shape": "input_ids:-1,256;attention_mask:-1,256", "dynamic_batch_size": "1,2,4"}, ["dynamic_dims"]),
    ("shape-range", "Ascend910B", ["--input-shape-range", "--batch", "1,8", "--seq", "16,512"], {},
     {"input_shape": "input_ids:1~8,16~512;attention_mask:1~8,16~512"}, ["dynamic_dims", "dynamic_batch_size"]),
    ("user-input-shape", "Ascend910B", ["--input-shape", "input_ids:1,-1;attention_mask:1,-1", "--seq", "128,256"],
     {}, {"input_shape": "input_ids:1,-1;attention_mask:1,-1", "dynamic_dims": "128,128;256,256"}, []),
    ("kv-cache", "Ascend910B", ["--batch", "1", "--seq", "1,16", "--past", "64"], {"kv_cache": True},
     {"input_shape": "input_ids:-1,-1;attention_mask:-1,-1;past_key_values.0.key:-1,2,-1,8",
      "dynamic_dims": "1,1,1,65,1,64;1,16,1,80,1,64"}, []),
    ("precision-v2", "Ascend910B", ["--precision-mode-v2", "mixed_bfloat16"], {},
     {"precision_mode_v2": "mixed_bfloat16"}, ["precision_mode"]),
    ("precision", "Ascend310P3", ["--precision-mode", "force_fp16"], {}, {"precision_mode": "force_fp16"}, []),
    ("bf16-model-default", "Ascend910B", [], {"dtype": "bfloat16"},
     {"precision_mode": "allow_mix_precision_bf16"}, []),
    ("implmode-for-all", "Ascend910B", ["--implmode", "high_precision_for_all"], {},
     {"op_select_implmode": "high_precision_for_all"}, ["optypelist_for_implmode"]),
    ("optypelist", "Ascend910B", ["--implmode", "high_performance", "--optypelist", "SoftmaxV2,Pooling"], {},
     {"op_select_implmode": "high_performance", "optypelist_for_implmode": "SoftmaxV2,Pooling"}, []),
    ("keep-dtype", "Ascend910B", ["--keep-dtype", "lm_head", "--keep-dtype", "MatMul::lm_head"], {},
     {"keep_dtype": "keep_dtype.cfg"}, []),
    ("log", "Ascend910B", ["--log", "info"], {}, {"log": "info"}, []),
    ("cast-fp16", "Ascend310P3", ["--cast-fp16"], {"dtype": "bfloat16"}, {"model": "model_fp16.onnx"}, []),
]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_generated_options(tmp_path, capsys, row):
    _, soc, args, model_kw, expect, absent = row
    opts, prof, summary, _ = generate(tmp_path, capsys, args, model_kw, soc)
    got = opts.to_json()
    for k, v in expect.items():
        assert got[k] == v, k
    for k in absent:
        assert k not in got, k
    if "model" not in expect:
        assert got["model"] == str((tmp_path / "model.onnx").absolute())


def test_keep_dtype_file(tmp_path, capsys):
    _, _, summary, _ = generate(tmp_path, capsys, ["--keep-dtype", "lm_head", "--keep-dtype", "MatMul::x"])
    assert (Path(summary["soc_dir"]) / "keep_dtype.cfg").read_text() == "lm_head\nMatMul::x\n"


def test_keep_dtype_ignored_warning(tmp_path, capsys):
    _, _, _, stderr = generate(tmp_path, capsys, ["--keep-dtype", "lm_head", "--precision-mode",
                                                  "must_keep_origin_dtype"])
    assert "warning: [keep-dtype-ignored]" in stderr


def test_family_decision_is_recorded(tmp_path, capsys):
    _, prof, _, _ = generate(tmp_path, capsys, [])
    d = prof["decisions"]["soc_version"]
    assert d["value"] == "Ascend910B3" and "family Ascend910B assumes Ascend910B3" in d["source"]
    assert "npu-smi" in d["note"]
    assert prof["decisions"]["batch"]["source"] == "profile Ascend910B3.json"
    assert prof["decisions"]["precision_mode"]["note"] == "precision.default"


def test_cli_sources_are_recorded(tmp_path, capsys):
    _, prof, _, _ = generate(tmp_path, capsys, ["--batch", "1,2", "--precision-mode", "force_fp16"])
    assert prof["decisions"]["batch"] == {"value": [1, 2], "source": "--batch"}
    assert prof["decisions"]["precision_mode"]["source"] == "--precision-mode"


@pytest.mark.parametrize("args,model_kw,soc,expect", [
    ([], {}, "Ascend910B", {"GraphFusion": {"ALL": "on"}, "UBFusion": {"ALL": "on"}}),
    (["--fusion", "SoftmaxFusionPass=off", "--fusion", "TbeEltwiseFusionPass=off"], {}, "Ascend910B",
     {"GraphFusion": {"ALL": "on", "SoftmaxFusionPass": "off"}, "UBFusion": {"ALL": "on", "TbeEltwiseFusionPass": "off"}}),
    (["--fusion", "UBFusion.ALL=off"], {}, "Ascend910B", {"GraphFusion": {"ALL": "on"}, "UBFusion": {"ALL": "off"}}),
    (["--batch", "1", "--seq", "128"], {"int8": True}, "Ascend910B",
     {"GraphFusion": {"ALL": "on", "V100RequantFusionPass": "off"},
      "UBFusion": {"ALL": "on", "TbePool2dQuantFusionPass": "off"}}),
    (["--batch", "1", "--seq", "128"], {"int8": True}, "Ascend310P3",
     {"GraphFusion": {"ALL": "on", "V200RequantFusionPass": "off"},
      "UBFusion": {"ALL": "on", "TbePool2dQuantFusionPass": "off"}}),
])
def test_fusion_switch_file(tmp_path, capsys, args, model_kw, soc, expect):
    _, prof, summary, _ = generate(tmp_path, capsys, args, model_kw, soc)
    text = (Path(summary["soc_dir"]) / "fusion_switch.cfg").read_text()
    assert json.loads(text) == {"Switch": expect}


def test_fusion_override_errors(tmp_path, capsys):
    onnx = tiny_lm(tmp_path / "m.onnx")
    for bad, words in (("Foo=maybe", "expected PASS=on or PASS=off"), ("XFusion.Foo=on", "section 'XFusion'")):
        code, _, err = run(["atc", "--onnx", str(onnx), "--soc", "Ascend910B", "-o", str(tmp_path / "o"),
                            "--fusion", bad], capsys)
        assert code == 2 and words in err


def test_files_manifest_and_preflight_summary(tmp_path, capsys):
    _, _, summary, _ = generate(tmp_path, capsys, [])
    soc_dir = Path(summary["soc_dir"])
    assert summary["files"] == ["atc.sh", "fusion_switch.cfg", "preflight.json", "preflight.txt", "profile.json"]
    assert (soc_dir / "atc.sh").stat().st_mode & 0o111
    pre = json.loads((soc_dir / "preflight.json").read_text())
    assert pre["counts"]["fail"] == 0 and pre["counts"]["pass"] >= 12
    txt = (soc_dir / "preflight.txt").read_text()
    assert "PASS  opset" in txt and "PASS  onnx-ops" in txt
    manifest = json.loads((soc_dir.parent / "dsconv_manifest.json").read_text())
    assert manifest["stage"] == "atc" and "Ascend910B3/atc.sh" in manifest["files"]


def test_both_socs_share_one_output(tmp_path, capsys):
    onnx = tiny_lm(tmp_path / "m.onnx")
    out = tmp_path / "atc"
    base = ["atc", "--onnx", str(onnx), "-o", str(out)]
    assert run(base + ["--soc", "Ascend910B"], capsys)[0] == 0
    assert run(base + ["--soc", "Ascend310P3"], capsys)[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["Ascend310P3", "Ascend910B3", "dsconv_manifest.json"]
    manifest = json.loads((out / "dsconv_manifest.json").read_text())
    assert "Ascend910B3/atc.sh" in manifest["files"] and "Ascend310P3/atc.sh" in manifest["files"]
    code, _, err = run(base + ["--soc", "Ascend310P3"], capsys)
    assert code == 2 and "already exists; pass --force" in err
    code, _, _ = run(base + ["--soc", "Ascend310P3", "--force", "--seq", "64,128"], capsys)
    assert code == 0 and (out / "Ascend910B3" / "atc.sh").is_file()
    assert '"1,64,1,64;' in (out / "Ascend310P3" / "atc.sh").read_text()


def test_human_summary_and_warnings_on_stderr(tmp_path, capsys):
    onnx = tiny_lm(tmp_path / "m.onnx", opset=16)
    code, out, err = run(["atc", "--onnx", str(onnx), "--soc", "Ascend910B", "-o", str(tmp_path / "o")], capsys)
    assert code == 0
    assert "atc profile for Ascend910B3 (family Ascend910B assumes Ascend910B3)" in out
    assert "where CANN is installed: bash" in out
    assert "warning: [opset] opset 16 is outside 11-15" in err and "warning: " not in out


@pytest.mark.parametrize("args,words", [
    (["--soc", "Ascend310P1"], "no dsconv profile for SoC 'Ascend310P1'"),
    ([], "no --soc given"),
    (["--soc", "Ascend910B", "--batch", "1,x"], "expected comma-separated integers"),
    (["--soc", "Ascend910B", "--batch", "0,4"], "positive"),
    (["--soc", "Ascend910B", "--precision-mode", "bf16"], "--precision-mode bf16 is not an ATC value"),
    (["--soc", "Ascend910B", "--implmode", "fast"], "--implmode fast is not an ATC value"),
    (["--soc", "Ascend910B", "--input-shape", "input_ids"], "--input-shape: 'input_ids' is not name:d0"),
    (["--soc", "Ascend310P3", "--precision-mode", "allow_mix_precision_bf16"], "[precision-mode-soc]"),
])
def test_user_errors_exit_2_one_line(tmp_path, capsys, args, words):
    onnx = tiny_lm(tmp_path / "m.onnx")
    code, out, err = run(["atc", "--onnx", str(onnx), "-o", str(tmp_path / "o"), *args], capsys)
    assert code == 2 and words in err and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1
    assert not (tmp_path / "o").exists()  # nothing written


def test_missing_onnx_file(tmp_path, capsys):
    code, _, err = run(["atc", "--onnx", str(tmp_path / "nope.onnx"), "--soc", "Ascend910B", "-o",
                        str(tmp_path / "o")], capsys)
    assert code == 2 and "does not exist" in err


def test_workspace_defaults(tmp_path, capsys, monkeypatch):
    (tmp_path / "dsconv.toml").write_text('[workspace]\nmodel = "model"\noutput = "out"\n')
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["atc", "--soc", "Ascend310P3"], capsys)
    assert code == 2 and "pass --onnx FILE or run `dsconv export` first" in err
    export = tmp_path / "out" / "onnx"
    tiny_lm(export / "model.onnx")
    (export / "dsconv_manifest.json").write_text('{"stage": "export"}')
    code, out, err = run(["atc", "--soc", "Ascend310P3"], capsys)
    assert code == 0, err
    script = (tmp_path / "out" / "atc" / "Ascend310P3" / "atc.sh").read_text()
    assert parse_script(script).model == str(export / "model.onnx")
