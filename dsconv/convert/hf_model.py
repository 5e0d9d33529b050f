"""The torch model the exporter traces, built with transformers' own loading code, and the MoE routing recorder.

Why from_pretrained: it is the code users run, so the exported graph is the model they know (fused experts, tied
embeddings, fp32 routers, rope scaling). MoE models load with `experts_implementation="batched_mm"`: `grouped_mm`
(the default) cannot be exported and `eager` bakes the experts hit during tracing into the graph
(reference/toolchain_notes.md). Attention is `eager` (plain matmul + softmax, exportable at any opset).

FP8 checkpoints: transformers' FP8 loader needs `accelerate` and a GPU, so the checkpoint is first rewritten with
`dsconv export --format safetensors`'s streaming path into a scratch directory in the export dtype (exact for fp32),
and that is loaded. Loading must see every tensor: a missing or mis-shaped one is an error, never left random.
"""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
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


def load_for_export(ck, dtype: str, scratch_parent: Path, allow_pickle: bool = False) -> tuple[Any, dict[str, Any]]:
    """(model in eval mode, loading report). Raises UserError when transformers would leave weights random."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = dict(dtype=precision_torch_dtype(dtype), attn_implementation="eager", trust_remote_code=False,
                                  output_loading_info=True)
    if ck.facts.is_moe:
        kwargs["experts_implementation"] = "batched_mm"
    if ck.is_quantized:
        raise UserError(f"{ck.root} is a quantized (msModelSlim layout) output",
                        hint="export the float checkpoint; ATC takes quantization through its own options")
    report: dict[str, Any] = {"source": str(ck.root), "fp8_dequantized": False}
    scratch = None
    src = ck.root
    try:
        if ck.fp8_scales:
            from dsconv.convert.fp8 import export_safetensors

            scratch_parent.mkdir(parents=True, exist_ok=True)
            scratch = scratch_parent / f".{ck.root.name}.dsconv-fp8-{dtype}"
            export_safetensors(ck.root, scratch, dtype=dtype, force=True, allow_pickle=allow_pickle,
                               stage="export-scratch")
            src = scratch
            report["fp8_dequantized"] = True
        with quiet_transformers():
            model, info = AutoModelForCausalLM.from_pretrained(src, **kwargs)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)  # mapped pages stay valid until the model drops them
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(info.get("mismatched_keys") or [])
    if missing:
        raise UserError(f"{ck.root}: {len(missing)} weight(s) the model needs are not in the checkpoint, e.g. "
                        f"{missing[0]}", hint="the checkpoint is incomplete; transformers would initialise them "
                                              "randomly, so nothing is exported")
    if mismatched:
        first = mismatched[0]
        raise UserError(f"{ck.root}: {len(mismatched)} weight(s) have the wrong shape for config.json, e.g. {first}",
                        hint="config.json does not describe these weights")
    report["unused_tensors"] = sorted(info.get("unexpected_keys") or [])
    model.eval()
    if ck.facts.is_moe and model.config._experts_implementation != "batched_mm":
        raise RuntimeError(f"MoE experts loaded as {model.config._experts_implementation!r}, not batched_mm")
    return model, report


def experts_modules(model) -> list[tuple[str, Any]]:
    """transformers' fused expert blocks (a 3-D `gate_up_proj`), in layer order."""
    out = []
    for name, module in model.named_modules():
        p = getattr(module, "gate_up_proj", None)
        if p is not None and getattr(p, "dim", lambda: 0)() == 3:
            out.append((name, module))
    return out


class ExpertHits:
    """Records which (expert block, expert) pairs each forward pass routes to, from the experts' `top_k_index`
    argument (every transformers MoE calls `experts(hidden_states, top_k_index, top_k_weights)`)."""

    def __init__(self, model) -> None:
        self.blocks = experts_modules(model)
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
