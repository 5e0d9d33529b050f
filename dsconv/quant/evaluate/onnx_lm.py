"""A fake-quant ONNX model (`dsconv export` of a quantize output) as `dsconv eval`'s quantized model: onnxruntime
behind the call the metrics make (`model(ids).logits`).

Why eval takes it: the fake-quant file is what a user ships to accuracy checks off-device; measuring it with the same
text, perplexity and top-1 metrics as the quantize output proves the file, not only the simulation behind it.
Batches are right-padded and causal (see evaluate.compare), so an all-ones attention mask gives every real token the
logits it has alone.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

FAKEQUANT = "model_fakequant.onnx"  # convert/quant_onnx.py writes it (stages do not import each other)
#: onnxruntime's default optimizations fuse QuantizeLinear/DequantizeLinear + MatMul into int8 kernels whose results
#: differ from the ONNX semantics of the fake-quant graph (max logits error 0.49 on the tiny DeepSeek-V3, 1e-6 with
#: `session.disable_quant_qdq`); the fake-quant model simulates the device in float, so it runs without that fusion.
QDQ_NOTE = "session.disable_quant_qdq=1"


def fakequant_path(path: Path) -> Path | None:
    """The fake-quant ONNX named by `path` (the file, or an export directory holding it), else None."""
    path = Path(path)
    if path.is_file() and path.suffix == ".onnx":
        return path
    if path.is_dir() and (path / FAKEQUANT).is_file():
        return path / FAKEQUANT
    return None


class OnnxLM:
    """Callable like a transformers causal LM on input ids [batch, seq] (torch), returning `.logits` (torch)."""

    def __init__(self, path: Path) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.add_session_config_entry("session.disable_quant_qdq", "1")  # see QDQ_NOTE
        self.path = Path(path)
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        names = [i.name for i in self.session.get_inputs()]
        if names[:2] != ["input_ids", "attention_mask"] or any(n.startswith("past_key_values") for n in names):
            from dsconv.errors import UserError

            raise UserError(f"{path}: inputs {names} are not a causal LM without KV cache",
                            hint="evaluate the fake-quant model exported without --with-past")
        self.position_ids = "position_ids" in names

    def __call__(self, ids: Any) -> SimpleNamespace:
        import torch

        x = ids.numpy().astype(np.int64)
        feeds = {"input_ids": x, "attention_mask": np.ones_like(x)}
        if self.position_ids:
            feeds["position_ids"] = np.broadcast_to(np.arange(x.shape[1], dtype=np.int64), x.shape).copy()
        return SimpleNamespace(logits=torch.from_numpy(self.session.run(["logits"], feeds)[0]))

    def describe(self) -> tuple[str | None, dict[str, int]]:
        """(model_quant_type, linears per type) from the export's export_info.json, when it is there."""
        info = self.path.parent / "export_info.json"
        if not info.is_file():
            return None, {}
        data = json.loads(info.read_text())
        return data.get("model_quant_type"), dict(data.get("linears", {}))
