"""`dsconv verify` checks for this stage's outputs (run after the manifest hashes match).

export (ONNX)  onnx's checker on model.onnx (external data included), then onnxruntime maps one token
               to finite logits of the config's vocabulary (the full parity check ran at export time; bf16 graphs,
               which onnxruntime cannot run on CPU, get the checker only).
safetensors    the directory opens as a checkpoint (headers, index, every part), holds no FP8 weight or scale,
               and config.json has no quantization_config.
Cheap to import: onnx/onnxruntime load only when a check runs.
"""
from __future__ import annotations

from pathlib import Path

from dsconv import schemas


def verify_onnx(directory: Path, manifest: dict) -> list[str]:
    import numpy as np
    import onnx
    import onnxruntime as ort

    path = directory / "model.onnx"
    if not path.is_file():
        return ["model.onnx: missing"]
    try:
        onnx.checker.check_model(str(path))
    except Exception as e:  # ValidationError, or protobuf/IO errors for a damaged file
        return [f"model.onnx: not valid ONNX ({str(e).splitlines()[0][:200]})"]
    graph = onnx.load(str(path), load_external_data=False).graph
    if any(t.data_type == onnx.TensorProto.BFLOAT16 for t in graph.initializer):
        return []  # onnxruntime has no bfloat16 CPU kernels; the checker passed (export checked it widened)
    del graph
    ort.set_default_logger_severity(4)
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    try:
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types
        return [f"model.onnx: onnxruntime cannot load it ({str(e).splitlines()[0][:200]})"]
    feeds = {}
    for inp in session.get_inputs():
        if inp.name in ("input_ids", "attention_mask", "position_ids"):
            feeds[inp.name] = np.zeros((1, 1), np.int64) if inp.name != "attention_mask" else np.ones((1, 1), np.int64)
        else:  # an empty cache
            dtype = np.float16 if "float16" in inp.type else np.float32
            feeds[inp.name] = np.zeros([1, inp.shape[1], 0, inp.shape[3]], dtype)
    try:
        logits = session.run(["logits"], feeds)[0]
    except Exception as e:  # onnxruntime raises its own exception types
        return [f"model.onnx: onnxruntime cannot run one token ({str(e).splitlines()[0][:200]})"]
    config = directory / "config.json"
    vocab = schemas.config(schemas.read_json(config, "config", "rerun the export"), str(config))["vocab_size"] \
        if config.is_file() else None
    problems = []
    if vocab is not None and tuple(logits.shape) != (1, 1, vocab):
        problems.append(f"model.onnx: logits shape {list(logits.shape)}, expected [1, 1, {vocab}]")
    if not np.isfinite(logits.astype(np.float32)).all():
        problems.append("model.onnx: non-finite logits for one token")
    return problems


def verify_safetensors(directory: Path, manifest: dict) -> list[str]:
    from dsconv.checkpoint import Checkpoint
    from dsconv.errors import UserError

    try:
        ck = Checkpoint.open(directory)
    except UserError as e:
        return [e.one_line()]
    problems = [f"{n}: still {ck.info(n).dtype}" for n in ck.names() if ck.info(n).dtype.startswith("F8")]
    problems += [f"{n}: FP8 scale left behind" for n in ck.names() if ck.role(n).param == "weight_scale_inv"]
    if "quantization_config" in ck.config:
        problems.append("config.json: quantization_config still present")
    return problems


def verify_onnx_int8(directory: Path, manifest: dict) -> list[str]:
    """A quantized export: the fake-quant model passes the ONNX checker and runs one token in onnxruntime; the deploy
    model (not runnable off-device) reads back with every external tensor in place and the AscendQuant /
    AscendDequant count export_info.json records."""
    import json

    import onnx

    from dsconv.convert.quant_onnx import DEPLOY, FAKEQUANT
    from dsconv.io.onnx_data import external_location

    fq = directory / FAKEQUANT
    if not fq.is_file():
        return [f"{FAKEQUANT}: missing"]
    problems = _run_one_token(fq, directory)
    path = directory / DEPLOY
    if not path.is_file():
        return problems + [f"{DEPLOY}: missing"]
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises DecodeError and friends
        return problems + [f"{DEPLOY}: not readable ({type(e).__name__})"]
    for t in model.graph.initializer:
        ext = external_location(t)
        if ext is None:
            continue
        f = directory / (ext[0] or "")
        if not f.is_file() or f.stat().st_size < ext[1] + (ext[2] or 0):
            problems.append(f"{DEPLOY}: external tensor {t.name} is not in {ext[0]}")
            break
    info = json.loads((directory / "export_info.json").read_text()) if (directory / "export_info.json").is_file() \
        else {}
    want = info.get("deploy", {}).get("AscendQuant")
    got = sum(1 for n in model.graph.node if n.op_type == "AscendQuant")
    if want is not None and got != want:
        problems.append(f"{DEPLOY}: {got} AscendQuant nodes, export_info.json records {want}")
    return problems


def _run_one_token(path: Path, directory: Path) -> list[str]:
    import numpy as np
    import onnx
    import onnxruntime as ort

    try:
        onnx.checker.check_model(str(path))
    except Exception as e:  # ValidationError, or protobuf/IO errors for a damaged file
        return [f"{path.name}: not valid ONNX ({str(e).splitlines()[0][:200]})"]
    ort.set_default_logger_severity(4)
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    opts.add_session_config_entry("session.disable_quant_qdq", "1")  # the graph's float semantics (quant_onnx.py)
    try:
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        feeds = {}
        for inp in session.get_inputs():
            if inp.name in ("input_ids", "attention_mask", "position_ids"):
                feeds[inp.name] = np.ones((1, 1), np.int64) if inp.name == "attention_mask" else \
                    np.zeros((1, 1), np.int64)
            else:
                feeds[inp.name] = np.zeros([1, inp.shape[1], 0, inp.shape[3]], np.float32)
        logits = session.run(["logits"], feeds)[0]
    except Exception as e:  # onnxruntime raises its own exception types
        return [f"{path.name}: onnxruntime cannot run one token ({str(e).splitlines()[0][:200]})"]
    return [] if np.isfinite(logits).all() else [f"{path.name}: non-finite logits for one token"]
