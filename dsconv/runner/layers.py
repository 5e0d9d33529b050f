"""Running transformers' own decoder layers one at a time, with weights read from the checkpoint on demand.

The model skeleton is dsconv.model.torch_builder's (transformers' module on the meta device, no memory);
`materialise(i)` gives layer i real storage and copies its weights in from `Checkpoint.load(..., dequantize=True)`
(FP8 is dequantized on read), and `release(i)` sends it back to meta. Routed experts are never materialised as the fused 3-D tensors transformers keeps
in memory: an `ExpertLoop` replaces the experts module's forward and runs one expert at a time, loading that expert's
weights only when it runs, so a DeepSeek-V3 MoE layer (22 GB in BF16) needs one expert (88 MB) at a time.

Names: transformers' in-memory names differ from the checkpoint's only where the family says so (its
`fused_renames`, and the fused experts `fused_experts.gate_up_proj/down_proj` vs the per-expert `expert_modules`
templates), exactly as `Checkpoint` normalises them; no other name is interpreted here.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from dsconv.errors import UserError
from dsconv.families.roles import Role
from dsconv.model import attention, torch_builder

SLOTS = torch_builder.SLOTS


class Skeleton:
    """The model on the meta device (dsconv.model.torch_builder) plus per-layer materialisation from the checkpoint."""

    def __init__(self, ck: Any, dtype: torch.dtype = torch.float32) -> None:
        self.ck = ck
        self.family = ck.family
        self.dtype = dtype
        # SDPA, MLA's values padded to the key width (model/attention.py); experts: ExpertLoop
        self.model = torch_builder.skeleton(ck.config, dtype, attn=attention.register(), experts="eager")
        self.config = self.model.config
        self.base = self.model.get_decoder()
        self.layers = self.base.layers
        self.num_layers = len(self.layers)
        self.mat = torch_builder.Materialiser(ck, self.model, load=lambda name, dtype: self.load(name))
        self.module_names = self.mat.names
        self.rotary = type(self.base.rotary_emb)(config=self.config)  # built on CPU: inv_freq is computed, not loaded
        self._rope_by_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self._index = {layer: i for i, layer in enumerate(self.layers)}
        self.embed_name = next((n for n, r in ck.roles.items() if r.role == Role.EMBED and r.layer is None
                                and r.param == "weight"), None)
        if self.embed_name is None:
            raise UserError(f"{ck.root}: no embedding tensor", hint="the checkpoint is incomplete")

    # ---- names ------------------------------------------------------------------------------------------------
    def ck_name(self, mem_name: str) -> str:
        return self.mat.ck_name(mem_name)

    def own_weights(self, layer: nn.Module) -> dict[nn.Module, tuple[str, Role]]:
        """module -> (checkpoint name, role) of each module of `layer` with a direct weight in the checkpoint: the
        norms, linears and routers the smoothing and awq folds rewrite."""
        own = {}
        for mod in layer.modules():
            if "weight" in dict(mod.named_parameters(recurse=False)):
                name = self.ck_name(self.module_names[mod] + ".weight")
                if name in self.ck:
                    own[mod] = (name, self.ck.role(name).role)
        return own

    def layer_prefix(self, i: int) -> str:
        return self.module_names[self.layers[i]] + "."

    def experts_module(self, i: int) -> nn.Module | None:
        """The fused experts module of layer i (None for a dense layer)."""
        try:
            m = self.layers[i].get_submodule(self.family.fused_experts)
        except AttributeError:
            return None
        return m if torch_builder.is_fused_experts(m, self.family) else None

    def expert_weight_names(self, i: int, e: int) -> dict[str, str]:
        """Checkpoint tensor names of expert e's gate/up/down weights in layer i."""
        return self.mat.expert_names(self.layer_prefix(i), e)

    def expert_module_names(self, i: int, e: int) -> dict[str, str]:
        return {slot: n[: -len(".weight")] for slot, n in self.expert_weight_names(i, e).items()}

    # ---- data ---------------------------------------------------------------------------------------------------
    def load(self, ck_name: str) -> torch.Tensor:
        return self.ck.load(ck_name, dequantize=True).to(self.dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of `ids` only (the table is read once, gathered, freed), times the embedding module's
        constant scale where it has one (Gemma: sqrt(hidden), in the model dtype as transformers multiplies)."""
        table = self.ck.load(self.embed_name, dequantize=True)
        out = table[ids].to(self.dtype)
        del table
        scale = getattr(self.model.get_input_embeddings(), "scalar_embed_scale", None)
        return out if scale is None else out * torch.tensor(scale, dtype=self.dtype)

    def materialise(self, i: int, load: Callable[[str], torch.Tensor] | None = None,
                    with_experts: bool = False) -> nn.Module:
        """Give layer i real CPU storage and its checkpoint weights (experts only when `with_experts`)."""
        layer = self.layers[i]
        experts = self.experts_module(i)
        skip = (lambda m: False) if with_experts else (lambda m: m is experts)
        self.mat.fill(layer, skip, load=None if load is None else (lambda name, dtype: load(name)))
        return layer

    def release(self, i: int) -> None:
        self.layers[i].to("meta")

    def layer_inputs(self, x: torch.Tensor, layer: nn.Module | None = None, cache: Any = None) -> dict[str, Any]:
        """Keyword arguments of a decoder layer for a right-padded batch [B, L, H]: positions from 0, causal mask.

        Right padding never reaches a real token under a causal mask, so padded batches compute real tokens exactly
        as unpadded ones. Where config.layer_types marks `layer` as sliding, its mask is the sliding-window one, and
        a rotary with per-type tables (Gemma 3: local and global bases) gives that type's cos/sin. A `cache` is
        passed on as the layer's (its attention hands it the states it would cache: calibrate/kv_cache.py)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        B, L = x.shape[:2]
        pos = torch.arange(L).unsqueeze(0).expand(B, L)
        types = getattr(self.config, "layer_types", None)
        kind = types[self._index[layer]] if types and layer is not None else None
        make = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
        # DeepSeek-V3.2's indexer reads the mask itself (never the SDPA is_causal shortcut's None); a linear-attention
        # layer (Qwen3-Next) takes only a 2-D padding mask, and its causal scan needs none for right padding
        skip = {"allow_is_causal_skip": False} if kind == "indexed_attention" else {}
        mask = None if kind == "linear_attention" else make(config=self.config, inputs_embeds=x, attention_mask=None,
                                                             cache=None, position_ids=pos, **skip)
        rope = self.rotary(x, pos, kind) if self._rope_by_type else self.rotary(x, pos)
        inputs = {"attention_mask": mask, "position_ids": pos, "position_embeddings": rope}
        if cache is not None:
            inputs["cache"] = cache
        return inputs


def load_full_model(ck: Any, dtype: torch.dtype = torch.float32,
                    load: Callable[[str], torch.Tensor] | None = None) -> tuple[nn.Module, Skeleton]:
    """The whole model in memory (evaluation and tests only: small models), experts in their fused form."""
    sk = Skeleton(ck, dtype)
    sk.mat.fill(sk.model, load=None if load is None else (lambda name, dtype: load(name)))
    sk.mat.finish()
    return sk.model.eval(), sk


# ------------------------------------------------------------------------------------------------ experts
ExpertLinear = Callable[[int, str, torch.Tensor, torch.Tensor], torch.Tensor]


def plain_linear(e: int, slot: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An expert's projection as `F.linear` (the same sgemm as x @ w.T; the calibration forward's oneDNN mode sees
    it as a linear)."""
    return F.linear(x, w)


def expert_forward(module: nn.Module, e: int, x: torch.Tensor, w: dict[str, torch.Tensor],
                   linear: ExpertLinear = plain_linear, outputs: dict[str, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One routed expert on rows x: (act(gate) * up - the down_proj input -, its output), the gate nonlinearity the
    fused module's own `_apply_gate`. Shared by the in-process loop and the calibrated path's expert jobs, which
    take the gate and up projections' outputs too (`outputs`)."""
    gate = linear(e, "gate", x, w["gate"])
    up = linear(e, "up", x, w["up"])
    if outputs is not None:
        outputs.update(gate=gate, up=up)
    act = module._apply_gate(torch.cat([gate, up], dim=-1))
    return act, linear(e, "down", act, w["down"])


class ExpertLoop:
    """A drop-in forward for transformers' fused experts: routed tokens go through one expert at a time.

    `weights(e) -> {"gate": [I, H], "up": [I, H], "down": [H, I]}` supplies an expert's weights when it runs;
    `linear(e, slot, x, w)` computes one projection (quantized variants for evaluation; it also sees each
    projection's input). The gate nonlinearity is the module's own `_apply_gate` (act(gate) * up for these families).
    """

    def __init__(self, module: nn.Module, num_experts: int, weights: Callable[[int], dict[str, torch.Tensor]],
                 linear: ExpertLinear = plain_linear) -> None:
        self.module = module
        self.num_experts = num_experts
        self.weights = weights
        self.linear = linear
        self.counts = torch.zeros(num_experts, dtype=torch.long)

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        self.counts += torch.bincount(top_k_index.reshape(-1), minlength=self.num_experts)[: self.num_experts]
        for e in range(self.num_experts):
            rows, pos = torch.where(top_k_index == e)
            if rows.numel() == 0:
                continue
            _, y = expert_forward(self.module, e, hidden[rows], self.weights(e), self.linear)
            out.index_add_(0, rows, (y * top_k_weights[rows, pos, None]).to(out.dtype))
        return out


def install_forward(module: nn.Module, fn: Callable[..., torch.Tensor]) -> None:
    """Route `module(...)` to `fn` (an instance attribute shadows the class's forward)."""
    module.forward = fn  # type: ignore[method-assign]
