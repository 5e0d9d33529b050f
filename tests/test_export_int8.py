"""`dsconv export --format onnx` of a quantize output: the fake-quant ONNX equals dsconv's simulation of
the quantized model in onnxruntime, the AMCT deploy model holds the quantize output's int8 weights byte for byte with
AscendQuant/AscendDequant carrying its scales, `dsconv atc` compiles it static per gear and refuses what AMCT's ATC
constraints forbid, and `dsconv eval` measures the fake-quant file."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper, numpy_helper

from dsconv.checkpoint import Checkpoint
from dsconv.convert.quant_graph import deq_scale_uint64
from dsconv.io.onnx_data import external_location
from dsconv.quant import stage
from dsconv.quant.evaluate import fakequant as quant_model
from dsconv.quant.formats.msmodelslim import quantized_modules, read_linear
from dsconv.quant.plan.options import QuantOptions
from dsconv.quant.stage import QuantRequest

DENSE = ("llama", "qwen2", "qwen3", "gemma3")
FAMILIES = DENSE + ("deepseek_v3",)


pytestmark = [pytest.mark.cli, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """family -> (float model dir, W8A8 quantize output dir) for every dense family and DeepSeek-V3 (MindIE recipe:
    DeepSeek's attention static W8A8 with kv_b_proj float, MLP and experts W8A8_DYNAMIC)."""
    from dsconv.bundled import calib_texts
    from dsconv.tiny import make_tiny, train_tokenizer

    root = tmp_path_factory.mktemp("int8")
    tok = train_tokenizer(calib_texts(), vocab_size=384)
    out = {}
    for fam in FAMILIES:
        model = make_tiny(fam, root / fam, dtype="bf16", tokenizer=tok)
        q = root / f"{fam}-q"
        # Gemma 3: vLLM-Ascend's recipe (MindIE has no Gemma model: Family.engine_refused)
        engine = "vllm-ascend" if fam == "gemma3" else "mindie"
        stage.run(QuantRequest(model, q, QuantOptions(calib_samples=6, seq_len=32, fallback=0, bits_default=True,
                                                      engine=engine), progress=False))
        out[fam] = (model, q)
    return out


@pytest.fixture(scope="module")
def exported(quantized, tmp_path_factory, run_cli):
    """family -> export dir, written through the CLI (--quantized beside --model)."""
    root = tmp_path_factory.mktemp("int8-onnx")
    out = {}
    for fam, (model, q) in quantized.items():
        r = run_cli(["export", "--model", model, "--quantized", q, "--output", root / fam, "--json"])
        assert r.code == 0, r.err
        out[fam] = root / fam
    return out


def _session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.disable_quant_qdq", "1")  # the graph's float semantics
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("fam", FAMILIES)
def test_fakequant_matches_simulation(quantized, exported, fam):
    """Independently of the export's own check: onnxruntime on the file vs `dsconv eval`'s quantized model."""
    from dsconv.quant.evaluate.fidelity import load_quantized_model

    info = json.loads((exported[fam] / "export_info.json").read_text())
    assert info["check"]["passed"]
    # the tolerance is --atol unless the simulation's own float noise floor (measured by nudging the embeddings by
    # 1e-6) is higher: on tiny models it is ~1e-6, so --atol rules and a broken scale (below) still fails
    c = info["check"]
    assert c["atol"] == max(c["atol_requested"], 3 * c["noise_floor"]) and c["atol_requested"] == info["atol"]
    # a nudge may flip a routing tie or an int8 rounding that sits on a tie (Gemma-3 and DeepSeek-V3 here): the
    # floor then loosens the bound, so the export's own error is held to the requested atol as well - or, where the
    # simulation itself sits on such a tie, to the size of that one flip (the per-token check below still fails a
    # graph that moves every token)
    assert 0 < c["noise_floor"] < 5e-2
    assert c["worst"]["max_abs_err"] <= max(c["atol_requested"], 2 * c["noise_floor"]), c["worst"]
    sim, _ = load_quantized_model(Checkpoint.open(quantized[fam][1]))
    rng = np.random.default_rng(3)
    ids = rng.integers(0, sim.config.vocab_size, size=(2, 11), dtype=np.int64)
    with torch.no_grad():
        want = sim(torch.from_numpy(ids)).logits.numpy()
    got = _session(exported[fam] / "model_fakequant.onnx").run(
        ["logits"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
    per_token = np.abs(got - want).max(-1)
    # a static rounding or routing tie flips one value and moves the tokens after it (attention carries it on);
    # a wrong graph moves every token
    assert (per_token < 2e-3).mean() >= 0.5 and np.median(per_token) < 2e-3, per_token
    # and it is not the float model: quantization moved the logits
    assert info["linears"].get("W8A8", 0) > 0


@pytest.mark.parametrize("fam", FAMILIES)
def test_fakequant_nodes_carry_the_written_scales(quantized, exported, fam):
    qck = Checkpoint.open(quantized[fam][1])
    types = quantized_modules(qck.quant_description)
    m = onnx.load(str(exported[fam] / "model_fakequant.onnx"))
    inits = {t.name: t for t in m.graph.initializer}
    consts = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in m.graph.node if n.op_type == "Constant"}
    consts.update({k: numpy_helper.to_array(t) for k, t in inits.items() if not t.dims})
    q_nodes = [n for n in m.graph.node if n.op_type == "QuantizeLinear"]
    static = [P for P, t in types.items() if t == "W8A8"]
    assert len(q_nodes) == len(static) > 0
    got = sorted((float(consts[n.input[1]]), int(consts[n.input[2]])) for n in q_nodes)
    want = sorted((float(np.float32(read_linear(qck, P, "W8A8").input_scale)),
                   int(read_linear(qck, P, "W8A8").input_offset)) for P in static)
    assert got == want
    w_dq = [n for n in m.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    expert_params = {n.input[0] for n in w_dq if n.input[0].endswith(("gate_up_proj", "down_proj"))
                     and ".experts." in n.input[0]}
    dense = [P for P in types if ".experts." not in P]
    assert len(w_dq) == len(dense) + len(expert_params)
    for P in dense[:3]:
        ql = read_linear(qck, P, types[P])
        t = inits[P + ".weight.T"]
        assert t.data_type == onnx.TensorProto.INT8
        assert np.array_equal(numpy_helper.to_array(t).T, ql.q)


@pytest.mark.parametrize("fam", FAMILIES)
def test_deploy_model_int8_weights_and_ascend_ops(quantized, exported, fam):
    """Node counts match the static linears; the .external bytes are the quantize output's int8 weights; the
    AscendQuant/AscendDequant attributes and deq_scale are the written scales."""
    d = exported[fam]
    qck = Checkpoint.open(quantized[fam][1])
    types = quantized_modules(qck.quant_description)
    static = sorted(P for P, t in types.items() if t == "W8A8")
    m = onnx.load(str(d / "model_deploy.onnx"), load_external_data=False)
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("AscendQuant") == ops.count("AscendDequant") == len(static) > 0
    assert "QuantizeLinear" not in ops and "DequantizeLinear" not in ops
    inits = {t.name: t for t in m.graph.initializer}
    raw = (d / "model_deploy.external").read_bytes()

    def data(name: str) -> np.ndarray:
        t = inits[name]
        ext = external_location(t)
        if ext is None:
            return numpy_helper.to_array(t)
        _, off, length = ext
        dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
        return np.frombuffer(raw[off:off + length], dtype=dtype).reshape(tuple(t.dims))

    nodes = {n.name: n for n in m.graph.node}
    for P in static:
        ql = read_linear(qck, P, "W8A8")
        stored = qck.load(P + ".weight").numpy()
        w = data(P + ".weight.T")
        assert w.dtype == np.int8 and w.T.tobytes() == stored.tobytes()  # the quantize output's bytes
        assert np.ascontiguousarray(stored.T).tobytes() in raw
        attrs = {a.name: helper.get_attribute_value(a) for a in nodes[f"{P}/AscendQuant"].attribute}
        assert attrs["offset"] == ql.input_offset and attrs["sqrt_mode"] == 0 and attrs["round_mode"] == b"Round"
        assert np.float32(attrs["scale"]) == np.float32(1.0 / ql.input_scale)
        deq = data(P + ".deq_scale")
        assert deq.dtype == np.uint64 and np.array_equal(deq, deq_scale_uint64(ql.deq_scale))
        assert np.array_equal((deq & 0xFFFFFFFF).astype(np.uint32).view(np.float32), ql.deq_scale)
        assert not np.any(deq >> 32)
        assert np.array_equal(data(P + ".quant_bias"), ql.quant_bias.astype(np.int32))
        dq = {a.name: helper.get_attribute_value(a) for a in nodes[f"{P}/AscendDequant"].attribute}
        assert dq == {"sqrt_mode": 0, "relu_flag": 0, "dtype": 0}
    record = (d / "amct_record.txt").read_text()
    assert record.count("record {") == len(static) and f'key: "{static[0]}"' in record


@pytest.mark.parametrize("fam", ["qwen2", "deepseek_v3"])
def test_deploy_passes_preflight_static_per_gear(exported, fam, tmp_path):
    from dsconv.atc.stage import AtcRequest, run

    res = run(AtcRequest(onnx=exported[fam] / "model_deploy.onnx", output=tmp_path / "atc", soc="Ascend310P3"))
    prof = json.loads((res.soc_dir / "profile.json").read_text())
    assert prof["int8"]["precision"] == "INT8" and prof["int8"]["AscendQuant"] > 0
    assert len(prof["int8"]["gears"]) == 6  # 310P3 default gears: batch 1,4 x seq 128,512,1024
    for g in prof["int8"]["gears"]:
        assert "-1" not in g["input_shape"] and "--dynamic_dims" not in g["command"]
        assert (res.soc_dir / g["script"]).is_file()
    assert not [f for f in res.findings if f.status == "fail"]
    assert any(f.rule == "int8-gears" for f in res.findings)
    assert prof["decisions"]["op_select_implmode"]["value"] == "high_performance"


@pytest.mark.parametrize("args,words", [
    (["--dynamic-batch-size"], "[int8-dynamic]"),
    (["--input-shape-range"], "[int8-dynamic]"),
    (["--input-shape", "input_ids:-1,-1;attention_mask:-1,-1"], "[int8-dynamic]"),
    (["--precision-mode", "force_fp32"], "[int8-precision]"),
    (["--precision-mode", "must_keep_origin_dtype"], "[int8-precision]"),
    (["--precision-mode-v2", "origin"], "[int8-precision]"),
])
def test_atc_refuses_for_int8(exported, run_cli, tmp_path, args, words):
    r = run_cli(["atc", "--onnx", exported["qwen2"] / "model_deploy.onnx", "--soc", "Ascend310P3",
                 "--output", tmp_path / "a", *args])
    assert r.code == 2 and words in r.err and "Traceback" not in r.err, r.err
    assert not (tmp_path / "a").exists()


def test_atc_refuses_high_precision_op_mode_and_wrong_opset(exported, run_cli, tmp_path):
    deploy = exported["qwen2"] / "model_deploy.onnx"
    ini = tmp_path / "op.ini"
    ini.write_text("MatMulV2=high_precision\n")
    r = run_cli(["atc", "--onnx", deploy, "--soc", "Ascend310P3", "--output", tmp_path / "a",
                 "--op-precision-mode", ini])
    assert r.code == 2 and "[int8-op-precision]" in r.err
    ini.write_text("MatMulV2=high_performance\n")
    r = run_cli(["atc", "--onnx", deploy, "--soc", "Ascend310P3", "--output", tmp_path / "b",
                 "--op-precision-mode", ini, "--batch", "1", "--seq", "64"])
    assert r.code == 0, r.err
    copy = tmp_path / "m"
    shutil.copytree(exported["qwen2"], copy)
    m = onnx.load(str(copy / "model_deploy.onnx"), load_external_data=False)
    m.opset_import[0].version = 17
    (copy / "model_deploy.onnx").write_bytes(m.SerializeToString())
    r = run_cli(["atc", "--onnx", copy / "model_deploy.onnx", "--soc", "Ascend910B", "--output", tmp_path / "c"])
    assert r.code == 2 and "[int8-opset]" in r.err


@pytest.mark.parametrize("fam", ["qwen2", "deepseek_v3"])  # deepseek_v3: the MoE noise floor (routing) is ~1e-2
def test_broken_scale_fails_the_check(quantized, run_cli, tmp_path, monkeypatch, fam):
    """A wrong input_scale (or a flipped offset sign) in what the export writes is exit 3, nothing written."""
    model, q = quantized[fam]
    real = quant_model.read_layers

    def broken(qck):
        layers = real(qck)
        L = next(L for L in layers.values() if L.qtype == "W8A8")
        L.input_scale *= 0.2
        return layers

    monkeypatch.setattr(quant_model, "read_layers", broken)
    r = run_cli(["export", "--model", q, "--output", tmp_path / "x"])
    assert r.code == 3 and "fake-quant ONNX differs from dsconv's simulation" in r.err, r.err
    assert not (tmp_path / "x").exists()

    def flipped(qck):
        layers = real(qck)
        for L in layers.values():
            if L.qtype == "W8A8" and L.input_offset:
                L.input_offset = -L.input_offset
                break
        return layers

    monkeypatch.setattr(quant_model, "read_layers", flipped)
    r = run_cli(["export", "--model", q, "--output", tmp_path / "y"])
    assert r.code == 3 and not (tmp_path / "y").exists()


def test_eval_accepts_fakequant_onnx(quantized, exported, run_cli):
    model, q = quantized["qwen2"]
    a = run_cli(["eval", "-m", model, "-q", q, "--samples", "3", "--seq-len", "32", "--json"])
    b = run_cli(["eval", "-m", model, "-q", exported["qwen2"], "--samples", "3", "--seq-len", "32", "--json"])
    assert a.code == 0 and b.code == 0, a.err + b.err
    ra, rb = json.loads(a.out), json.loads(b.out)
    assert rb["runtime"].startswith("onnxruntime") and rb["model_quant_type"] == ra["model_quant_type"]
    assert abs(ra["ppl_quantized"] - rb["ppl_quantized"]) < 1e-3 * ra["ppl_quantized"]
    assert abs(ra["top1_agreement"] - rb["top1_agreement"]) <= 0.02


def test_verify_and_refusals(quantized, exported, run_cli, tmp_path):
    r = run_cli(["verify", exported["llama"]])
    assert r.code == 0, r.err
    model, q = quantized["llama"]
    r = run_cli(["export", "--model", model, "--quantized", model, "--output", tmp_path / "x"])
    assert r.code == 2 and "not a dsconv quantize output" in r.err
    r = run_cli(["export", "--model", model, "--quantized", q, "--format", "safetensors", "--output", tmp_path / "x"])
    assert r.code == 2 and "--quantized goes with --format onnx" in r.err
    r = run_cli(["export", "--model", quantized["qwen2"][0], "--quantized", q, "--output", tmp_path / "x"])
    assert r.code == 2 and "is not a quantization of" in r.err


def test_deploy_rewrite_on_a_hand_built_graph():
    """x -> Q/DQ -> MatMul(DQ(int8 W^T)) -> Add(bias) becomes AscendQuant -> MatMul -> Add(int32) -> AscendDequant,
    the bias Add folded into quant_bias; a weight-only layer keeps Cast+Mul; nothing else is left behind."""
    from types import SimpleNamespace

    from onnx import TensorProto

    from dsconv.convert.quant_graph import int8_weights, record_text, to_deploy

    rng = np.random.default_rng(0)
    q = rng.integers(-127, 128, size=(3, 4), dtype=np.int8)
    static = SimpleNamespace(qtype="W8A8", q=q, weight_scale=np.full(3, 0.01, np.float32), input_scale=0.05,
                             input_offset=-3.0, deq_scale=np.full(3, 0.0005, np.float32),
                             quant_bias=np.array([7, -8, 9], np.int32))
    wonly = SimpleNamespace(qtype="W8A16", q=q[:, :4].copy(), weight_scale=np.full(3, 0.02, np.float32))
    nodes = [helper.make_node("Constant", [], ["s"], value=numpy_helper.from_array(np.array(0.05, np.float32))),
             helper.make_node("Constant", [], ["z"], value=numpy_helper.from_array(np.array(-3, np.int8))),
             helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             helper.make_node("MatMul", ["xd", "a.weight.T"], ["mm"]),
             helper.make_node("Add", ["mm", "a.bias"], ["ya"]),
             helper.make_node("MatMul", ["ya", "b.weight.T"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    arrays = {"a.weight.T": np.zeros((4, 3), np.float32), "a.bias": np.zeros(3, np.float32),
              "b.weight.T": np.zeros((3, 3), np.float32)}
    wonly.q = q[:, :3].copy()
    layers = {"a": static, "b": wonly}
    assert int8_weights(model, arrays, layers, {}) == {"a.weight.T": "a", "b.weight.T": "b"}
    assert arrays["a.weight.T"].dtype == np.int8 and np.array_equal(arrays["a.weight.T"].T, q)
    counts = to_deploy(model, arrays, layers, {})
    assert counts == {"AscendQuant": 1, "AscendDequant": 1, "int8_matmul": 1, "weight_dequant": 1}
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["Cast", "Mul", "AscendQuant", "MatMul", "Add", "AscendDequant", "MatMul"]
    deq_node = model.graph.node[5]
    assert deq_node.output[0] == "ya" and list(deq_node.input) == ["a/acc_bias_int32", "a.deq_scale"]
    aq = {a.name: helper.get_attribute_value(a) for a in model.graph.node[2].attribute}
    assert aq["scale"] == pytest.approx(20.0) and aq["offset"] == -3.0 and aq["sqrt_mode"] == 0
    assert set(arrays) == {"a.weight.T", "a.quant_bias", "a.deq_scale", "b.weight.T", "b.weight_scale"}
    assert arrays["a.deq_scale"].dtype == np.uint64 and arrays["a.deq_scale"][0] == np.float32(0.0005).view(np.uint32)
    text = record_text(layers)
    assert text.count("record {") == 1 and 'key: "a"' in text and "offset_d: -3" in text
    assert text.count("scale_w:") == text.count("offset_w: 0") == 3
