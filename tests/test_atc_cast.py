"""`--cast-fp16`: the FP16 copy is a valid model, runs in onnxruntime, and matches the original within tolerance;
a copy that does not is refused with exit 3 and nothing written."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from dsconv.atc.cast import FP16_MAX, cast_model, check_fp16
from dsconv.atc.samples import tiny_lm
from dsconv.cli import main
from dsconv.errors import CheckFailed

pytestmark = pytest.mark.cli


class TinyLM(torch.nn.Module):
    """Embedding -> LayerNorm -> Linear -> GELU (+ a float arange, exported as Range) -> Linear, masked."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, 50)

    def forward(self, input_ids, attention_mask):
        h = torch.nn.functional.gelu(self.fc(self.norm(self.emb(input_ids))))
        pos = torch.arange(input_ids.shape[1], dtype=h.dtype)
        h = h + pos[None, :, None] * 0.01
        return self.out(h) * attention_mask[..., None].to(h.dtype)


def export_tiny(path: Path, dtype=torch.float32) -> Path:
    torch.manual_seed(0)
    m = TinyLM().eval().to(dtype)
    ids = torch.randint(0, 50, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)
    axes = {0: "batch", 1: "seq"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (ids, mask), str(path), dynamo=False, opset_version=14,
                          input_names=["input_ids", "attention_mask"], output_names=["logits"],
                          dynamic_axes={"input_ids": axes, "attention_mask": axes, "logits": axes})
    return path


def float_types(path: Path) -> set[int]:
    m = onnx.load(str(path), load_external_data=False)
    return {t.data_type for t in m.graph.initializer if t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16,
                                                                         TensorProto.BFLOAT16)}


def test_torch_export_fp32_cast_checked_in_onnxruntime(tmp_path):
    src = export_tiny(tmp_path / "tiny.onnx")
    res = cast_model(src, tmp_path / "fp16.onnx")
    onnx.checker.check_model(str(tmp_path / "fp16.onnx"), full_check=True)
    assert float_types(tmp_path / "fp16.onnx") == {TensorProto.FLOAT16}
    assert any("Range" in n for n in res.fp32_nodes)  # Range has no float16 in the ONNX schema: kept fp32
    fig = check_fp16(src, tmp_path / "fp16.onnx")
    assert fig["reference"] == "the original model" and 0 < fig["worst_rel_err"] < 1e-2
    # the copy really computes in fp16: its output is float16 and close to the original
    sess = ort.InferenceSession(str(tmp_path / "fp16.onnx"), providers=["CPUExecutionProvider"])
    assert sess.get_outputs()[0].type == "tensor(float16)"


def test_torch_export_bf16_compared_through_fp32_upcast(tmp_path):
    src = export_tiny(tmp_path / "tiny_bf16.onnx", dtype=torch.bfloat16)
    assert float_types(src) == {TensorProto.BFLOAT16}
    cast_model(src, tmp_path / "fp16.onnx")
    assert float_types(tmp_path / "fp16.onnx") == {TensorProto.FLOAT16}
    fig = check_fp16(src, tmp_path / "fp16.onnx")
    assert fig["reference"] == "fp32 upcast of the BF16 original" and fig["worst_rel_err"] < 1e-2


def test_external_data_streamed_to_a_new_data_file(tmp_path):
    src = tiny_lm(tmp_path / "src" / "m.onnx", external_data=True, vocab=256, hidden=32)
    dst = tmp_path / "out" / "m_fp16.onnx"
    cast_model(src, dst)
    data = dst.parent / "m_fp16.onnx.data"
    assert data.stat().st_size == 2 * 256 * 32 * 2  # the two fp16 weights; small constants stay inline
    assert dst.stat().st_size < 2000
    check_fp16(src, dst)


def _graph_model(path: Path, nodes, inits, out_type=TensorProto.FLOAT) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])
    y = helper.make_tensor_value_info("y", out_type, ["batch", "seq"])
    g = helper.make_graph(nodes, "g", [x], [y], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def _scalar(name: str, v: float):
    return numpy_helper.from_array(np.array(v, np.float32), name)


def test_overflowing_initializer_kept_fp32_and_isolated(tmp_path):
    src = _graph_model(tmp_path / "m.onnx", [helper.make_node("Div", ["x", "big"], ["small"], name="div"),
                                              helper.make_node("Mul", ["small", "k"], ["y"], name="mul")],
                       [_scalar("big", 1e5), _scalar("k", 1e3)])
    res = cast_model(src, tmp_path / "fp16.onnx")
    assert res.kept_fp32 == ["big"] and res.fp32_nodes == ["div"]
    m = onnx.load(str(tmp_path / "fp16.onnx"))
    types = {t.name: t.data_type for t in m.graph.initializer}
    assert types == {"big": TensorProto.FLOAT, "k": TensorProto.FLOAT16} and 1e5 > FP16_MAX
    assert check_fp16(src, tmp_path / "fp16.onnx")["worst_rel_err"] < 1e-2


def test_cancellation_beyond_tolerance_fails(tmp_path):
    src = _graph_model(tmp_path / "m.onnx", [helper.make_node("Add", ["x", "c"], ["t"], name="add"),
                                              helper.make_node("Sub", ["t", "c"], ["y"], name="sub")],
                       [_scalar("c", 2048.0)])
    cast_model(src, tmp_path / "fp16.onnx")
    with pytest.raises(CheckFailed, match=r"output y max error .* \(tolerance 1.00%\)") as e:
        check_fp16(src, tmp_path / "fp16.onnx")
    assert e.value.exit_code == 3 and "rel_err" in e.value.details and "fp16 rounding emulated" in str(e.value)


def test_fp16_overflow_to_inf_fails(tmp_path):
    src = _graph_model(tmp_path / "m.onnx", [helper.make_node("Mul", ["x", "k"], ["t"], name="m1"),
                                              helper.make_node("Mul", ["t", "k"], ["y"], name="m2")],
                       [_scalar("k", 1000.0)])
    cast_model(src, tmp_path / "fp16.onnx")
    with pytest.raises(CheckFailed, match="inf/NaN in output y"):
        check_fp16(src, tmp_path / "fp16.onnx")


def test_cli_cast_failure_exit_3_nothing_written(tmp_path, capsys):
    src = _graph_model(tmp_path / "m.onnx", [helper.make_node("Add", ["x", "c"], ["t"], name="add"),
                                              helper.make_node("Sub", ["t", "c"], ["y"], name="sub")],
                       [_scalar("c", 2048.0)])
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["atc", "--onnx", str(src), "--soc", "Ascend310P3", "-o", str(out), "--batch", "1,2", "--seq",
              "4,8", "--cast-fp16"])
    err = capsys.readouterr().err
    assert e.value.code == 3 and "error: the FP16 copy of m.onnx differs" in err
    assert not out.exists() and not list(tmp_path.glob(".out.dsconv-tmp"))


def test_cli_cast_success_records_the_check(tmp_path, capsys):
    src = export_tiny(tmp_path / "tiny_bf16.onnx", dtype=torch.bfloat16)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["atc", "--onnx", str(src), "--soc", "Ascend310P3", "-o", str(out), "--cast-fp16", "--json"])
    assert e.value.code == 0
    sd = out / "Ascend310P3"
    prof = json.loads((sd / "profile.json").read_text())
    assert prof["cast_fp16"]["check"]["reference"] == "fp32 upcast of the BF16 original"
    assert prof["atc_options"]["model"] == "model_fp16.onnx" and (sd / "model_fp16.onnx").is_file()
    pre = json.loads((sd / "preflight.json").read_text())
    assert any(f["rule"] == "fp16-check" and f["status"] == "pass" for f in pre["findings"])
    # the BF16 model's default precision on a chip without BF16 is the profile's fp16 default
    assert prof["decisions"]["precision_mode"]["value"] == "allow_mix_precision"


def _figs(errs, tolerance=0.01):
    import numpy as np

    errs = np.asarray(errs, dtype=float)
    return {"runs": {"onnxruntime fp16": {"logits": {"rel_err": float(errs.max()), "position_rel_errs": errs}}}}


def test_isolated_routing_flip_is_reported_not_failed():
    """One position of 40 far off, every other within tolerance: what an MoE router flip at an fp16 tie looks like."""
    from dsconv.atc.cast import _isolated_flips

    flips = _isolated_flips(_figs([0.002] * 39 + [0.3]), 0.01)
    assert flips is not None and flips["positions"] == 1 and flips["of"] == 40
    assert flips["rest_max_rel_err"] == 0.002


def test_many_positions_off_still_fail():
    from dsconv.atc.cast import _isolated_flips

    assert _isolated_flips(_figs([0.002] * 30 + [0.3] * 10), 0.01) is None  # 25% of positions: systematic
    assert _isolated_flips(_figs([0.02] * 40), 0.01) is None  # everything slightly off: a precision loss



def test_router_scores_stay_fp32(tmp_path):
    """The float chain feeding a TopK (MatMul -> Sigmoid -> Add bias), i.e. an MoE router, is computed in fp32 in the
    FP16 copy; a MatMul that feeds no selection is cast to fp16."""
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["t", 8])
    idx = helper.make_tensor_value_info("idx", TensorProto.INT64, ["t", 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["t", 8])
    inits = [numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "router_w"),
             numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "bias"),
             numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "proj_w"),
             numpy_helper.from_array(np.array([2], dtype=np.int64), "k")]
    nodes = [helper.make_node("MatMul", ["x", "router_w"], ["logits"], name="router_matmul"),
             helper.make_node("Sigmoid", ["logits"], ["scores"], name="router_sigmoid"),
             helper.make_node("Add", ["scores", "bias"], ["biased"], name="router_bias"),
             helper.make_node("TopK", ["biased", "k"], ["vals", "idx"], name="router_topk"),
             helper.make_node("MatMul", ["x", "proj_w"], ["y"], name="proj")]
    m = helper.make_model(helper.make_graph(nodes, "g", [x], [idx, y], inits),
                          opset_imports=[helper.make_opsetid("", 14)])
    src = tmp_path / "router.onnx"
    onnx.save(m, src)
    res = cast_model(src, tmp_path / "router16.onnx")
    assert {"router_matmul", "router_sigmoid", "router_bias", "router_topk"} <= set(res.fp32_nodes)
    assert "proj" not in res.fp32_nodes
    out = onnx.load(tmp_path / "router16.onnx")
    assert {o.name: o.type.tensor_type.elem_type for o in out.graph.output}["y"] == TensorProto.FLOAT16
    sess = ort.InferenceSession(str(tmp_path / "router16.onnx"), providers=["CPUExecutionProvider"])
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    feed = rng.standard_normal((16, 8)).astype(np.float32)
    assert np.array_equal(sess.run(["idx"], {"x": feed.astype(np.float16)})[0],
                          ref.run(["idx"], {"x": feed.astype(np.float16).astype(np.float32)})[0])
