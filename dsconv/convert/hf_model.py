"""The torch model the exporter traces (dsconv.model.torch_builder: transformers' own module, weights from the
reader), and the MoE routing recorder.

Why transformers' module: it is the code users run, so the exported graph is the model they know (fused experts,
tied embeddings, fp32 routers, rope scaling); tests/test_torch_builder.py proves it equal to `from_pretrained`'s.
MoE models are built with `experts_implementation="batched_mm"`: `grouped_mm` (the default) cannot be exported and
`eager` bakes the experts hit during tracing into the graph (reference/toolchain_notes.md). Attention is `eager`
(plain matmul + softmax, exportable at any opset). FP8 checkpoints are dequantized by the reader as each tensor is
copied in (exact in float32); a missing or mis-shaped tensor is an error, never left random.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from dsconv.tensors import precision_torch_dtype
from dsconv.errors import UserError


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No progress bars or info chatter from transformers while dsconv drives it (restored afterwards)."""
    import warnings

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def load_for_export(ck, dtype: str) -> tuple[Any, dict[str, Any]]:
    """(model in eval mode, loading report), built by the one torch builder from the open Checkpoint."""
    from dsconv.model import torch_builder

    if ck.is_quantized:
        raise UserError(f"{ck.root} is a quantized (msModelSlim layout) output",
                        hint="export the float checkpoint; ATC takes quantization through its own options")
    experts = "batched_mm" if ck.facts.is_moe else None
    with quiet_transformers():
        model, unused = torch_builder.build(ck, precision_torch_dtype(dtype), attn="eager", experts=experts)
    report: dict[str, Any] = {"source": str(ck.root), "fp8_dequantized": bool(ck.fp8_scales),
                              "unused_tensors": unused}
    if ck.facts.is_moe and model.config._experts_implementation != "batched_mm":
        raise RuntimeError(f"MoE experts loaded as {model.config._experts_implementation!r}, not batched_mm")
    return model, report


def experts_modules(model, family) -> list[tuple[str, Any]]:
    """transformers' fused expert blocks (the family's 3-D `fused_params`), in layer order."""
    from dsconv.model.torch_builder import is_fused_experts

    return [(name, module) for name, module in model.named_modules() if is_fused_experts(module, family)]


class ExpertHits:
    """Records which (expert block, expert) pairs each forward pass routes to, from the experts' `top_k_index`
    argument (every transformers MoE calls `experts(hidden_states, top_k_index, top_k_weights)`)."""

    def __init__(self, model, family) -> None:
        self.blocks = experts_modules(model, family)
        self.current: set[tuple[int, int]] = set()
        self._handles: list[Any] = []

    def __enter__(self) -> "ExpertHits":
        for i, (_, module) in enumerate(self.blocks):
            self._handles.append(module.register_forward_pre_hook(self._hook(i), with_kwargs=True))
        return self

    def _hook(self, block: int):
        def hook(module, args, kwargs):
            idx = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            if idx is not None:
                self.current.update((block, int(e)) for e in idx.reshape(-1).unique().tolist())
        return hook

    def take(self) -> frozenset[tuple[int, int]]:
        """The pairs hit since the last take()."""
        hit, self.current = frozenset(self.current), set()
        return hit

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def release(model) -> None:
    """Drop a model's tensors now (export holds the whole model; the onnxruntime check should not stack on it)."""
    import gc

    for p in list(model.parameters()) + list(model.buffers()):
        p.data = p.data.new_empty(0)
    gc.collect()
