"""Running transformers' own decoder layers one at a time, with weights read from the checkpoint on demand.

The model skeleton is built on the meta device from config.json (no memory); `materialise(i)` gives layer i real
storage and copies its weights in from `Checkpoint.load(..., dequantize=True)` (FP8 is dequantized on read), and
`release(i)` sends it back to meta. Routed experts are never materialised as the fused 3-D tensors transformers keeps
in memory: an `ExpertLoop` replaces the experts module's forward and runs one expert at a time, loading that expert's
weights only when it runs, so a DeepSeek-V3 MoE layer (22 GB in BF16) needs one expert (88 MB) at a time.

Names: transformers' in-memory names differ from the checkpoint's only where the family says so (its
`fused_renames`, and the fused experts `fused_experts.gate_up_proj/down_proj` vs the per-expert `expert_modules`
templates), exactly as `Checkpoint` normalises them; no other name is interpreted here.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from dsconv.errors import UserError
from dsconv.families.roles import Role

SLOTS = ("gate", "up", "down")


def hf_config(config: dict[str, Any], attn: str = "sdpa"):
    """A transformers config from config.json's dict (FP8 quantization_config dropped: weights arrive dequantized)."""
    from transformers import AutoConfig

    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    model_type = cfg.pop("model_type")
    try:
        hf = AutoConfig.for_model(model_type, **cfg)
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"config.json: transformers cannot build a {model_type} config ({e})",
                        hint="check config.json against the model's published one") from None
    hf._attn_implementation = attn
    if hasattr(hf, "_experts_implementation"):
        hf._experts_implementation = "eager"  # replaced by ExpertLoop wherever dsconv runs experts
    return hf


class Skeleton:
    """The model on the meta device plus the maps between its parameters and the checkpoint's tensors."""

    def __init__(self, ck: Any, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM

        self.ck = ck
        self.family = ck.family
        self.dtype = dtype
        self.config = hf_config(ck.config)
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(self.config, dtype=dtype)
        self.model.eval()
        self.base = self.model.get_decoder()
        self.layers = self.base.layers
        self.num_layers = len(self.layers)
        self.module_names = {m: n for n, m in self.model.named_modules()}
        self.rotary = type(self.base.rotary_emb)(config=self.config)  # built on CPU: inv_freq is computed, not loaded
        self.embed_name = next((n for n, r in ck.roles.items() if r.role == Role.EMBED and r.layer is None
                                and r.param == "weight"), None)
        if self.embed_name is None:
            raise UserError(f"{ck.root}: no embedding tensor", hint="the checkpoint is incomplete")
        rel = self.family.fused_experts
        self._experts_rel = rel

    # ---- names ------------------------------------------------------------------------------------------------
    def ck_name(self, mem_name: str) -> str:
        """Checkpoint name of an in-memory parameter/buffer (the family's renames, as Checkpoint applies them)."""
        for old, new in self.family.fused_renames.items():
            if f".{old}." in mem_name:
                mem_name = mem_name.replace(f".{old}.", f".{new}.")
        return mem_name

    def layer_prefix(self, i: int) -> str:
        return self.module_names[self.layers[i]] + "."

    def experts_module(self, i: int) -> nn.Module | None:
        """The fused experts module of layer i (None for a dense layer)."""
        try:
            m = self.layers[i].get_submodule(self._experts_rel)
        except AttributeError:
            return None
        return m if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) else None

    def expert_weight_names(self, i: int, e: int) -> dict[str, str]:
        """Checkpoint tensor names of expert e's gate/up/down weights in layer i."""
        prefix = self.layer_prefix(i)
        return {slot: prefix + self.family.expert_modules[slot].replace("{E}", str(e)) + ".weight" for slot in SLOTS}

    def expert_module_names(self, i: int, e: int) -> dict[str, str]:
        return {slot: n[: -len(".weight")] for slot, n in self.expert_weight_names(i, e).items()}

    # ---- data ---------------------------------------------------------------------------------------------------
    def load(self, ck_name: str) -> torch.Tensor:
        return self.ck.load(ck_name, dequantize=True).to(self.dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of `ids` only (the table is read once, gathered, freed)."""
        table = self.ck.load(self.embed_name, dequantize=True)
        out = table[ids].to(self.dtype)
        del table
        return out

    def materialise(self, i: int, load: Callable[[str], torch.Tensor] | None = None,
                    with_experts: bool = False) -> nn.Module:
        """Give layer i real CPU storage and its checkpoint weights (experts only when `with_experts`)."""
        layer = self.layers[i]
        load = load or self.load
        experts = self.experts_module(i)
        for mod in layer.modules():
            if mod is experts and not with_experts:
                continue
            mod.to_empty(device="cpu", recurse=False)
        prefix = self.layer_prefix(i)
        with torch.no_grad():
            for mod in layer.modules():
                if mod is experts:
                    if with_experts:
                        self._fill_experts(i, experts, load)
                    continue
                mname = self.module_names[mod]
                for pname, p in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
                    full = f"{mname}.{pname}"
                    src = self.ck_name(full)
                    if src not in self.ck:
                        raise UserError(f"{self.ck.root}: {src} is missing (layer {i} needs it)",
                                        hint="the checkpoint is incomplete")
                    t = load(src)
                    if tuple(t.shape) != tuple(p.shape):
                        raise UserError(f"{src} has shape {list(t.shape)}, config implies {list(p.shape)}",
                                        hint="config.json and the weights disagree")
                    p.copy_(t)
        del prefix
        return layer

    def _fill_experts(self, i: int, experts: nn.Module, load: Callable[[str], torch.Tensor]) -> None:
        for e in range(experts.gate_up_proj.shape[0]):
            names = self.expert_weight_names(i, e)
            g, u, d = (load(names[s]) for s in SLOTS)
            experts.gate_up_proj[e].copy_(torch.cat([g, u], dim=0))
            experts.down_proj[e].copy_(d)

    def release(self, i: int) -> None:
        self.layers[i].to("meta")

    def layer_inputs(self, x: torch.Tensor) -> dict[str, Any]:
        """Keyword arguments of a decoder layer for a right-padded batch [B, L, H]: positions from 0, causal mask.

        Right padding never reaches a real token under a causal mask, so padded batches compute real tokens exactly
        as unpadded ones."""
        from transformers.masking_utils import create_causal_mask

        B, L = x.shape[:2]
        pos = torch.arange(L).unsqueeze(0).expand(B, L)
        mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=None, cache=None,
                                  position_ids=pos)
        return {"attention_mask": mask, "position_ids": pos, "position_embeddings": self.rotary(x, pos)}


def load_full_model(ck: Any, dtype: torch.dtype = torch.float32,
                    load: Callable[[str], torch.Tensor] | None = None) -> tuple[nn.Module, Skeleton]:
    """The whole model in memory (evaluation and tests only: small models), experts in their fused form."""
    sk = Skeleton(ck, dtype)
    model = sk.model
    load = load or sk.load
    model.to_empty(device="cpu")
    model.get_decoder().rotary_emb = sk.rotary
    names = {m: n for n, m in model.named_modules()}
    fused = {sk.experts_module(i): i for i in range(sk.num_layers)}
    fused.pop(None, None)
    out_emb = model.get_output_embeddings()
    with torch.no_grad():
        for mod in model.modules():
            if mod is sk.rotary:
                continue
            if mod in fused:
                sk._fill_experts(fused[mod], mod, load)
                continue
            for pname, p in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
                src = sk.ck_name(f"{names[mod]}.{pname}")
                if src not in ck:
                    if mod is out_emb and getattr(sk.config, "tie_word_embeddings", False):
                        continue
                    raise UserError(f"{ck.root}: {src} is missing", hint="the checkpoint is incomplete")
                p.copy_(load(src))
        if out_emb is not None and sk.ck_name(names[out_emb] + ".weight") not in ck:
            out_emb.weight = model.get_input_embeddings().weight
    model.eval()
    return model, sk


# ------------------------------------------------------------------------------------------------ experts
ExpertLinear = Callable[[int, str, torch.Tensor, torch.Tensor], torch.Tensor]


def plain_linear(e: int, slot: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.T


class ExpertLoop:
    """A drop-in forward for transformers' fused experts: routed tokens go through one expert at a time.

    `weights(e) -> {"gate": [I, H], "up": [I, H], "down": [H, I]}` supplies an expert's weights when it runs;
    `linear(e, slot, x, w)` computes one projection (quantized variants for evaluation); `observe(e, x, act, rows,
    weights)` sees each expert's inputs (x: the tokens it computed on, act: act(gate) * up, the down_proj input).
    With `all_tokens`, every expert computes on every token (for statistics) while only routed tokens contribute to
    the output. The gate nonlinearity is the module's own `_apply_gate` (act(gate) * up for these families).
    """

    def __init__(self, module: nn.Module, num_experts: int, weights: Callable[[int], dict[str, torch.Tensor]],
                 linear: ExpertLinear = plain_linear, observe: Callable[..., None] | None = None,
                 all_tokens: bool = False) -> None:
        self.module = module
        self.num_experts = num_experts
        self.weights = weights
        self.linear = linear
        self.observe = observe
        self.all_tokens = all_tokens
        self.counts = torch.zeros(num_experts, dtype=torch.long)

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        self.counts += torch.bincount(top_k_index.reshape(-1), minlength=self.num_experts)[: self.num_experts]
        for e in range(self.num_experts):
            rows, pos = torch.where(top_k_index == e)
            if rows.numel() == 0 and not (self.all_tokens and self.observe is not None):
                if self.observe is not None:
                    self.observe(e, None, None, rows, None)
                continue
            w = self.weights(e)
            x = hidden if self.all_tokens else hidden[rows]
            gate = self.linear(e, "gate", x, w["gate"])
            up = self.linear(e, "up", x, w["up"])
            act = self.module._apply_gate(torch.cat([gate, up], dim=-1))
            y = self.linear(e, "down", act, w["down"])
            if self.observe is not None:
                self.observe(e, x, act, rows, w)
            if self.all_tokens:
                y = y[rows]
            out.index_add_(0, rows, (y * top_k_weights[rows, pos, None]).to(out.dtype))
        return out


def install_forward(module: nn.Module, fn: Callable[..., torch.Tensor]) -> None:
    """Route `module(...)` to `fn` (an instance attribute shadows the class's forward)."""
    module.forward = fn  # type: ignore[method-assign]
