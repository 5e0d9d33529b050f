"""The torch model the exporter traces (dsconv.model.torch_builder: transformers' own module, weights from the
reader), and the MoE routing recorder.

Why transformers' module: it is the code users run, so the exported graph is the model they know (fused experts,
tied embeddings, fp32 routers, rope scaling); tests/test_torch_builder.py proves it equal to `from_pretrained`'s.
MoE experts run as `dense_experts_forward` (registered as transformers experts implementation "dsconv_dense"):
`grouped_mm` (the default) cannot be exported, `eager` bakes the experts hit during tracing into the graph
(docs/formats.md), and `batched_mm` gathers a copy of the expert weights for every (token, expert)
pair - in PyTorch and in onnxruntime alike - which put the export's peak at 2.63x the fp32 weights. The dense form
runs every expert on every token with its routing weight (zero where not routed): static shapes, plain MatMul on
per-expert initializers (the fused [E, 2I, H] tensors are split into per-expert views, no copy, named as the
checkpoint's per-expert linears), no weight ever copied; it costs E/k times the experts' FLOPs, which the check's
few tokens do not notice. Attention is `eager` (plain matmul + softmax, exportable at any opset). FP8 checkpoints
are dequantized by the reader as each tensor is copied in (exact in float32); a missing or mis-shaped tensor is an
error, never left random.
"""
from __future__ import annotations

from typing import Any

from dsconv.errors import UserError
from dsconv.model.quiet import quiet_transformers
from dsconv.tensors import precision_torch_dtype




EXPERTS_IMPL = "dsconv_dense"


def load_for_export(ck, dtype: str) -> tuple[Any, dict[str, Any]]:
    """(model in eval mode, loading report), built by the one torch builder from the open Checkpoint."""
    from dsconv.model import torch_builder

    if ck.is_quantized:
        raise UserError(f"{ck.root} is a quantized (msModelSlim layout) output",
                        hint="export the float checkpoint; ATC takes quantization through its own options")
    experts = register_dense_experts() if ck.facts.is_moe else None
    loader = _ViewLoader(ck)
    with quiet_transformers():
        try:
            model, unused = torch_builder.build(ck, precision_torch_dtype(dtype), attn="eager", experts=experts,
                                                load=loader)
        finally:
            loader.done()
    unused = loader.unused(unused)
    report: dict[str, Any] = {"source": str(ck.root), "fp8_dequantized": bool(ck.fp8_scales),
                              "unused_tensors": unused}
    if ck.facts.is_moe:
        if model.config._experts_implementation != EXPERTS_IMPL:
            raise RuntimeError(f"MoE experts loaded as {model.config._experts_implementation!r}, not {EXPERTS_IMPL}")
        report["experts"] = split_experts(model, ck.family)
    return model, report


class _ViewLoader:
    """The torch builder's tensor source for export: a stored float tensor is handed over as a zero-copy view of the
    checkpoint, which the builder's `param.copy_` casts straight into the parameter (no fresh copy in the stored
    dtype, no temporary in the export dtype: ~3x the largest tensor's bf16 bytes off the load's peak); its pages are
    dropped from this process when the next tensor is asked for. FP8 (dequantized) and pickled tensors are loaded
    as the builder itself would."""

    def __init__(self, ck) -> None:
        self.ck = ck
        self.viewed: list[str] = []
        self.released: list[str] = []
        self.read_fp8: set[str] = set()

    def __call__(self, name: str, dtype):
        self.done()
        ck = self.ck
        scale = ck.fp8_scales.get(name)
        if scale is not None:
            from dsconv.io.tensorfile import dequant_fp8_block

            self.read_fp8.add(name)
            return dequant_fp8_block(ck.load(name), ck.load(scale), ck.facts.fp8_block or (128, 128),
                                     out_dtype=dtype)
        if not ck.readable_by_path or ck.info(name).dtype not in ck.VIEWABLE or ck.info(name).numel == 0:
            return ck.load(name).to(dtype)
        self.viewed.append(name)
        return ck.view(name)

    def done(self) -> None:
        """Drop the pages of the views handed out so far (the parameters hold their own copies by now), and again
        those of the call before: the builder concatenates an expert's gate and up views after asking for both,
        which faults the gate's pages back in after their first release."""
        for name in self.viewed + self.released:
            self.ck.release(name)
        self.released, self.viewed = self.viewed, []

    def unused(self, unused: list[str]) -> list[str]:
        """The builder's unused list, minus the scales of the FP8 weights read here (its own reader marks them)."""
        scales = {self.ck.fp8_scales[n] for n in self.read_fp8}
        return [n for n in unused if n not in scales]


def register_dense_experts() -> str:
    """Make "dsconv_dense" a transformers experts implementation (idempotent); returns its name."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS[EXPERTS_IMPL] = dense_experts_forward
    return EXPERTS_IMPL


def _linear(weight):
    """A module holding one expert linear's weight (a view), so it gets a checkpoint-like name in the state dict."""
    import torch

    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(weight, requires_grad=False)
    return holder


def _splittable(module) -> bool:
    from transformers.integrations.moe import _default_apply_gate

    return (getattr(module, "has_gate", False) and getattr(module, "is_concatenated", True)
            and not getattr(module, "is_transposed", False) and not getattr(module, "has_bias", False)
            and not getattr(module, "has_post_expert_norm", False)
            and getattr(type(module)._apply_gate, "__code__", None) is _default_apply_gate.__code__)


def split_experts(model, family) -> dict[str, Any]:
    """Replace every fused experts block's 3-D parameters by per-expert 2-D views of the same storage (no copy),
    registered as `<block>.<e>.<gate|up|down leaf>.weight` (the leaf names of the family's per-expert linears), so
    the graph multiplies by per-expert initializers instead of gathering them. Blocks of a kind the dense forward
    does not cover (biases, transposed or interleaved weights, custom gates) keep `batched_mm`."""
    import torch

    from dsconv.model.torch_builder import is_fused_experts

    leaves = {slot: family.expert_modules[slot].split("{E}.", 1)[1] for slot in ("gate", "up", "down")}
    split = kept = 0
    for _, module in list(model.named_modules()):
        if not is_fused_experts(module, family):
            continue
        if not _splittable(module):
            kept += 1
            continue
        gate_up, down = module.gate_up_proj.data, module.down_proj.data
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            expert = torch.nn.Module()
            expert.add_module(leaves["gate"], _linear(gate_up[e, :inter]))
            expert.add_module(leaves["up"], _linear(gate_up[e, inter:]))
            expert.add_module(leaves["down"], _linear(down[e]))
            module.add_module(str(e), expert)
        del module._parameters["gate_up_proj"], module._parameters["down_proj"]
        module._dsconv_dense = (gate_up.shape[0], leaves["gate"], leaves["up"], leaves["down"])
        split += 1
    return {"implementation": EXPERTS_IMPL, "blocks_split": split, "blocks_batched_mm": kept}


def dense_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Every expert on every token, scaled by the token's routing weight for it (0 where not routed) and summed:
    the same function as transformers' experts, without per-token weight copies (see the module docstring)."""
    spec = getattr(self, "_dsconv_dense", None)
    if spec is None:
        from transformers.integrations.moe import batched_mm_experts_forward

        return batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    import torch
    import torch.nn.functional as F

    n, gate, up, down = spec
    # accumulate as batched_mm does: in the promoted dtype of the states and the routing weights (fp32 routers)
    out = torch.zeros(hidden_states.shape, dtype=torch.promote_types(hidden_states.dtype, top_k_weights.dtype))
    # [tokens, experts] routing weights, 0 where not routed. The expert ids are compared as float32 (exact for any
    # expert count < 2^24) right after TopK: ATC computes TopK indices as int32, and an int32/int64 comparison is
    # its E89999 (the atc preflight's topk-indices rule)
    ids = torch.arange(n, dtype=torch.float32)
    hit = (top_k_index.to(torch.float32).unsqueeze(-1) == ids).to(top_k_weights.dtype)  # [tokens, k, experts]
    routed = (top_k_weights.unsqueeze(-1) * hit).sum(dim=1)
    for e in range(n):
        expert = self._modules[str(e)]
        h = self.act_fn(F.linear(hidden_states, getattr(expert, gate).weight)) * \
            F.linear(hidden_states, getattr(expert, up).weight)
        out = out + F.linear(h, getattr(expert, down).weight) * routed[:, e:e + 1]
    return out.to(hidden_states.dtype)


def experts_modules(model, family) -> list[tuple[str, Any]]:
    """transformers' expert blocks (fused 3-D parameters, or split by `split_experts`), in layer order."""
    from dsconv.model.torch_builder import is_fused_experts

    return [(name, module) for name, module in model.named_modules()
            if hasattr(module, "_dsconv_dense") or is_fused_experts(module, family)]


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
    trim_heap()


def trim_heap() -> None:
    """Give malloc's free heap pages back to the system (glibc keeps freed small and mid-sized blocks, e.g. the
    model's many small tensors, in its arenas, where they would sit under onnxruntime's session)."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)  # the process's own symbols: glibc's, without a library search
    except (OSError, AttributeError):  # not glibc
        pass
