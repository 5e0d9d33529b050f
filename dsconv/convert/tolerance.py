"""The export checks' default tolerance, derived from the reference's own float noise (docs/export.md).

A correct export and the PyTorch reference compute the same function with different summation orders (onnxruntime's
MLAS or MindSpore's kernels against PyTorch's), so they differ by float rounding, and how much depends on the model:
depth, width, logit scale. A fixed absolute tolerance is either too tight for a deep model with large logits (a real
135M Llama's correct fp32 export differs by 1.2e-4) or too loose to catch a mis-mapped weight on a small one. So the
check measures the rounding noise of the reference itself on the check inputs and scales the tolerance with it:

    noise  = max |reference in the compute dtype - the same reference in float64|, over the check inputs, at real
             (non-padding) positions, per output kind (logits; cache outputs)
    bound  = NOISE_K x noise + NOISE_FLOOR x max |reference output|
    pass   iff max |export - reference| <= bound          margin = bound / observed

The float64 run uses the same weights (as stored, or rounded to the export dtype) and the same inputs; only the
arithmetic is exact(er). transformers casts to float32 on purpose in a few places (RMSNorm's statistics, softmax,
rope's cos/sin): those roundings are in both runs, so the figure is the accumulation noise of the matmuls and sums -
the part that grows with depth and width. For a half-precision computation (onnx --dtype fp16, mindir --dtype fp16)
the noise is that of the reference run in that dtype, so the bound scales with the dtype's own rounding.

Cost: one more forward pass per check input, in float64. The model is not copied: each decoder layer (and each module
outside the layers) is widened to float64 just before it runs and narrowed back just after (exact: the values came
from the narrower dtype), so the extra memory is one layer's weights in float64 (or the lm_head's, whichever is
larger), whatever the model's size; the extra time is a float64 forward per check input plus casting every weight
to float64 and back once per input (measured: 0.1-0.4 s on the 30-layer test model, as long as the float32
reference). `--atol` replaces the rule by an absolute bound and skips the float64 run.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

#: bound = NOISE_K x noise + NOISE_FLOOR x max |reference output| (+ a bf16 graph's constants term, onnx_check.py).
#: Chosen from measurements (docs/export.md, `python -m benchmarks tolerance`): correct exports of every family's tiny
#: model (fp32, fp32 with the KV cache, fp16, bf16) and of a deep narrow bf16 Llama differ from the reference by
#: 0.67-1.8x its noise in onnxruntime (bf16 graphs with rounded constants aside: their own term) and 0.76-3.1x in
#: MindSpore; K = 16 leaves a margin of 5 over the worst of them, while the faults measured (a 1% scale on one
#: weight, a transposed square weight, a dropped bias, a rope base 10% off) move the logits by 500-2,300,000x the
#: noise: 30x past the bound at the least.
NOISE_K = 16.0
#: a few float32 ulps of the largest output (2^-23 ~ 1.2e-7 relative per ulp): the tolerance never falls below the
#: rounding of the output values themselves, even where the measured noise happens to be ~0.
NOISE_FLOOR = 1e-6
RULE = "max |export - reference| <= {k:g} x noise{extra} + {floor:g} x max |reference|, noise = max |reference - " \
       "float64 reference| on the check inputs"


def rule_text(extra: str | None = None) -> str:
    """The rule in words, for reports; `extra` names an additive term (a bf16 graph's constants)."""
    return RULE.format(k=NOISE_K, floor=NOISE_FLOOR, extra=f" + {extra}" if extra else "")


def bound(noise: float, scale: float, extra: float = 0.0) -> float:
    """The default tolerance for an output whose reference noise is `noise` and largest |value| is `scale`; `extra`
    is a difference the export legitimately has on top of it, estimated at its worst (a bf16 graph's rounded
    constants), added as is."""
    return NOISE_K * noise + extra + NOISE_FLOOR * scale


def margin(bound_: float, observed: float) -> float:
    """bound / observed (inf for an exact match): above 1 passes; how far from failing a correct export is."""
    if observed == 0:
        return float("inf")
    return bound_ / observed


def bound_text(check: dict[str, Any]) -> str:
    """Where a MindIR check's bound comes from, one clause: the rule's figures, or --atol."""
    if check["rule"] == "atol":
        return f"--atol {check['atol']:g}"
    c = check["constants"]
    return (f"{c['K']:g} x the reference's {check['noise_dtype']} noise {check['noise']:.2g} (measured against "
            f"float64) + {c['floor']:g} x max |logit| {check['max_abs_ref']:.3g}")


def json_margin(m: float) -> float | None:
    """A margin as JSON writes it: JSON has no infinity, so an exact match's margin is null."""
    return None if m == float("inf") else m


# ------------------------------------------------------------------------------------------------ float64 run
def _units(model) -> list[tuple[Any, bool]]:
    """(module, recurse) pairs that are widened as one: every element of the first ModuleList on each path down
    (the decoder layers, whole), and every other module owning tensors itself (final norm, lm_head, rotary
    embedding: their own tensors only). The input embedding stays as it is: its lookup is exact, and its float32
    output keeps transformers' attention mask at float32's minimum - float64's would overflow to -inf in the float32
    softmax, turning fully masked (padding) rows into NaN that the next layer's 0-weighted values carry on."""
    from torch import nn

    units: list[tuple[Any, bool]] = []

    def walk(module) -> None:
        if isinstance(module, nn.ModuleList):
            units.extend((child, True) for child in module)
            return
        if isinstance(module, nn.Embedding):
            return
        if module._parameters or module._buffers:
            units.append((module, False))
        for child in module.children():
            walk(child)

    walk(model)
    return units


def _slots(module, recurse: bool) -> Iterator[tuple[dict, str]]:
    """(the dict holding a floating tensor, its key) for the module's parameters and buffers."""
    for m in (module.modules() if recurse else [module]):
        for store in (m._parameters, m._buffers):
            for name, t in store.items():
                if t is not None and t.is_floating_point():
                    yield store, name


@contextlib.contextmanager
def in_float64(model) -> Iterator[None]:
    """Run `model` in float64 one unit at a time (see the module docstring): inside the block, each decoder layer's
    tensors (and those of each module outside the layers) are float64 while it runs and back in their own dtype,
    bit for bit, as soon as it returns. Shared (tied) parameters are widened by whichever module runs."""
    import torch

    originals = {(id(store), name): store[name].dtype for store, name in _slots(model, True)}

    def cast(module, recurse: bool, to_float64: bool) -> None:
        for store, name in _slots(module, recurse):
            t = store[name]
            want = torch.float64 if to_float64 else originals.get((id(store), name), t.dtype)
            if t.dtype == want:
                continue
            if isinstance(t, torch.nn.Parameter):
                t.data = t.data.to(want)  # the same Parameter object: ties and references stay
            else:
                store[name] = t.to(want)

    def widen(t):
        return t.to(torch.float64) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def enter(module, args, kwargs, recurse: bool):
        cast(module, recurse, True)
        if not recurse:
            return None
        # a decoder layer: its hidden states in float64 too (the first layer gets the embedding's float32, and some
        # norms return their input's dtype); the attention mask stays as built (see _units)
        if "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": widen(kwargs["hidden_states"])}
        return tuple(widen(a) for a in args), kwargs

    handles = []
    units = _units(model)
    for module, recurse in units:
        handles.append(module.register_forward_pre_hook(lambda m, args, kwargs, r=recurse: enter(m, args, kwargs, r),
                                                        with_kwargs=True))
        handles.append(module.register_forward_hook(lambda m, args, out, r=recurse: cast(m, r, False)))
    # transformers' default MoE experts (grouped_mm) have no float64 kernel: its plain per-expert loop computes the
    # same function
    experts = getattr(getattr(model, "config", None), "_experts_implementation", None)
    if experts == "grouped_mm":
        model.set_experts_implementation("eager")
    try:
        yield
    finally:
        if experts == "grouped_mm":
            model.set_experts_implementation(experts)
        for h in handles:
            h.remove()
        for module, recurse in units:  # after an exception inside a forward
            cast(module, recurse, False)
