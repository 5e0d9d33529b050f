"""The one torch-model builder: transformers' own module tree, weights streamed from the one reader.

Export (ONNX tracing), quantization and evaluation all run transformers' modeling code, so the graph is the model
users know (fused experts, tied embeddings, fp32 routers, rope scaling). They differ only in how much of it is real
at a time: export materialises everything, quantization one decoder layer at a time. Both go through here:

1. `skeleton()` builds the `*ForCausalLM` from config.json on the meta device (no memory), exactly as
   `from_pretrained` does (`from_config` under the requested dtype, attention and experts implementations);
2. `Materialiser.fill(module)` gives one module subtree real CPU storage and copies each parameter in from
   `Checkpoint` one tensor at a time. FP8 block-scaled weights are dequantized in-stream straight to the target dtype
   (no scratch copy on disk); fused 3-D experts are assembled from the per-expert tensors the reader presents;
3. non-persistent buffers (rotary `inv_freq`, Gemma's embedding scale) are computed by the model's own
   `initialize_weights()`, which skips every tensor marked loaded - again what `from_pretrained` does - and tied
   weights are re-tied.

Names: an in-memory parameter's checkpoint name differs only where the family says so (`fused_renames`, and the fused
experts `fused_experts` + `fused_params` vs the per-expert `expert_modules` templates); nothing else here
interprets a name. A parameter the checkpoint lacks is an error, never left random.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from dsconv.errors import UserError
from dsconv.families import Family
from dsconv.families.facts import hf_config

SLOTS = ("gate", "up", "down")

Loader = Callable[[str, torch.dtype], torch.Tensor]


def skeleton(config: dict[str, Any], dtype: torch.dtype, attn: str = "eager", experts: str | None = None) -> nn.Module:
    """transformers' causal LM for `config` on the meta device, in eval mode."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attn}
    if experts is not None:
        kwargs["experts_implementation"] = experts
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(config), **kwargs)
    return model.eval()


def is_fused_experts(module: nn.Module, family: Family) -> bool:
    """A module holding the family's fused 3-D expert parameters (transformers' experts block)."""
    p = getattr(module, next(iter(family.fused_params)), None)
    return isinstance(p, torch.Tensor) and p.dim() == 3


class Materialiser:
    """Fills modules of a meta skeleton from a Checkpoint; records which checkpoint tensors were consumed."""

    def __init__(self, ck: Any, model: nn.Module, load: Loader | None = None) -> None:
        self.ck = ck
        self.family: Family = ck.family
        self.model = model
        self.names = {m: n for n, m in model.named_modules()}
        self.load = load or self.read
        self.used: set[str] = set()

    # ---- names ------------------------------------------------------------------------------------------------
    def ck_name(self, mem_name: str) -> str:
        """Checkpoint name of an in-memory parameter/buffer (the family's renames, as Checkpoint applies them; the
        text model's "model." as the family's `text_prefix`, for a vision-language checkpoint)."""
        prefix = self.family.text_prefix
        if prefix != "model." and mem_name.startswith("model.") and not mem_name.startswith(prefix):
            mem_name = prefix + mem_name[len("model."):]
        for old, new in self.family.fused_renames.items():
            if f".{old}." in mem_name and f".{new}." not in mem_name:
                mem_name = mem_name.replace(f".{old}.", f".{new}.")
        return mem_name

    def expert_names(self, layer_prefix: str, e: int) -> dict[str, str]:
        """Checkpoint names of expert e's gate/up/down weights in the in-memory layer at `layer_prefix`
        ("model.layers.3.")."""
        return {slot: self.ck_name(layer_prefix) + self.family.expert_modules[slot].replace("{E}", str(e)) + ".weight"
                for slot in SLOTS}

    # ---- data -------------------------------------------------------------------------------------------------
    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """One checkpoint tensor in `dtype`; FP8 dequantized straight to it (exact in float32)."""
        from dsconv.checkpoint import dequant_fp8_block

        scale = self.ck.fp8_scales.get(name)
        if scale is None:
            return self.ck.load(name).to(dtype)
        self.used.add(scale)
        return dequant_fp8_block(self.ck.load(name), self.ck.load(scale), self.ck.facts.fp8_block or (128, 128),
                                 out_dtype=dtype)

    def take(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], needed_by: str) -> torch.Tensor:
        if name not in self.ck:
            raise UserError(f"{self.ck.root}: {name} is missing ({needed_by} needs it)",
                            hint="the checkpoint is incomplete; transformers would initialise it randomly")
        t = self.load(name, dtype)
        if tuple(t.shape) != tuple(shape):
            raise UserError(f"{name} has shape {list(t.shape)}, config.json implies {list(shape)}",
                            hint="config.json does not describe these weights")
        self.used.add(name)
        return t

    def fill(self, root: nn.Module, skip: Callable[[nn.Module], bool] = lambda m: False,
             load: Loader | None = None) -> None:
        """Real CPU storage and checkpoint weights for every module under `root` (those `skip` names excepted);
        `load` replaces the reader for this call (evaluation feeds dequantized int8 weights)."""
        if load is not None:
            saved, self.load = self.load, load
            try:
                return self.fill(root, skip)
            finally:
                self.load = saved
        tied = set(getattr(self.model, "all_tied_weights_keys", None) or {})
        with torch.no_grad():
            for mod in root.modules():
                if skip(mod):
                    continue
                mod.to_empty(device="cpu", recurse=False)
                mname = self.names[mod]
                if is_fused_experts(mod, self.family):
                    self._fill_experts(mod)
                    continue
                for pname, p in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
                    full = f"{mname}.{pname}" if mname else pname
                    if pname in mod._non_persistent_buffers_set:
                        continue  # computed by the model's own init (rotary inv_freq)
                    if full in tied and self.ck_name(full) not in self.ck:
                        continue  # re-tied afterwards
                    p.copy_(self.take(self.ck_name(full), p.dtype, tuple(p.shape), full))
                    p._is_hf_initialized = True

    def _fill_experts(self, experts: nn.Module) -> None:
        """The family's fused parameters ([E, 2I, H] gate+up, [E, H, I] down) from the per-expert tensors, one expert
        at a time."""
        fused = self.family.fused_params
        for e in range(getattr(experts, next(iter(fused))).shape[0]):
            names = self.expert_names(self.names[experts][: -len(self.family.fused_experts)], e)
            for pname, slots in fused.items():
                p = getattr(experts, pname)
                parts = [self.take(names[s], p.dtype, (p.shape[1] // len(slots), p.shape[2]), self.names[experts])
                         for s in slots]
                p[e].copy_(torch.cat(parts, dim=0) if len(parts) > 1 else parts[0])
        for p in experts.parameters(recurse=False):
            p._is_hf_initialized = True

    def finish(self) -> None:
        """Compute what the checkpoint does not hold (non-persistent buffers) and tie tied weights."""
        self.model.initialize_weights()
        self.model.tie_weights()

    def unused(self) -> list[str]:
        """Checkpoint tensors the model did not consume (DeepSeek's MTP layers: transformers has no module); a
        vision tower is not the causal LM's and is never counted."""
        towers = self.family.tower_prefixes
        return sorted(n for n in self.ck.tensors if n not in self.used and not (towers and n.startswith(towers)))


def build(ck: Any, dtype: torch.dtype, attn: str = "eager", experts: str | None = None,
          load: Loader | None = None) -> tuple[nn.Module, list[str]]:
    """(the whole model in memory, checkpoint tensors it did not use). Export and evaluation: small models."""
    model = skeleton(ck.config, dtype, attn, experts)
    model.config._name_or_path = str(ck.root)  # as from_pretrained records it
    mat = Materialiser(ck, model, load)
    mat.fill(model)
    mat.finish()
    return model.eval(), mat.unused()
