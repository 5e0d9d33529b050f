"""The export stage: HF checkpoint -> ONNX (checked against PyTorch in onnxruntime), safetensors in another dtype
(FP8 -> BF16 streamed tensor by tensor), MindIR (convert/mindir.py, its own issue).

Modules, each small and named for what it does:
  stage.py        `run(ExportRequest) -> ExportResult`: the stage, dispatching on the format, and its text
  fp8.py          `export_safetensors`: dtype rewrite and FP8 block dequantization, streamed, part layout kept
  hf_model.py     the torch model for tracing (dsconv.model.torch_builder) and the MoE routing recorder
  onnx_wrapper.py the traced nn.Module: documented input/output names, KV cache as flat tensors
  onnx_graph.py   post-export graph work: weights streamed into the file (or external data), integer types
  onnx_opset.py   opset lowering when the exporter cannot emit the requested opset
  onnx_check.py   the parity check (PyTorch vs onnxruntime on several shapes; MoE routing variety)
  onnx.py         `export_onnx`: from memory estimate to committed output
  checks.py       `dsconv verify` hooks for the outputs of this stage

Importing this package is cheap (no torch/onnx): the heavy imports happen inside the stage functions.
"""
from __future__ import annotations

from dsconv.tensors import PRECISIONS

DTYPES = tuple(PRECISIONS)  # the --dtype choices
