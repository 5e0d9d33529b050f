"""The float source through MindIE's own loader: the position every held row must take.

Runs in the MindIE environment (imports nothing from dsconv). MindIE moves what it reads: it fuses q/k/v and gate/up
in its own order, permutes DeepSeek's rope rows, slices for TP, picks each EP rank's experts and stacks them. Rather
than restate any of that, the check loads the float source with the same loader, the same config.json, description
keys and parallel settings, and takes what MindIE holds there as the expected layout: every held quantized row must
dequantize to the row MindIE holds at the same position of the same module in the float load (mindie_match.py).

The reference directory is the quantized output with every quantized linear described FLOAT and its weight the float
source's (its quantization tensors dropped), the norms, embeddings, routers and biases the source's, and what only
the quantized output has (the int8 cache's scales) kept: MindIE then takes the same path through its model code (the
legacy Qwen modules with an int8 cache, DeepSeek's MLA), and an offline-sharded output is compared with MindIE's own
online sharding of the float source at the same parallel settings. Its config.json takes every key the source's has
from the source, so a writer's change to one (head counts, rope dims) is not followed by the float load.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

# msModelSlim's tensors that belong to a quantized linear (docs/formats.md), dropped with its quantization
QUANT_AUX = ("weight_scale", "weight_offset", "deq_scale", "quant_bias", "input_scale", "input_offset", "scale_bias",
             "weight_scale_second", "weight_offset_second")
FLOAT_TYPES = ("FLOAT", "FLOAT16", "BFLOAT16")
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
          "special_tokens_map.json", "vocab.json", "merges.txt")


# per-expert projection names: transformers' (gate_proj, up_proj, down_proj) or Mixtral's (w1, w3, w2)
EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def source_tensors(paths: list[Path], read: Any, written: Any = ()) -> dict[str, torch.Tensor]:
    """The float source by name, in its own dtype; transformers' fused 3-D experts as per-expert names (gate rows
    first: transformers 5's `gate_up_proj` is [E, 2I, H], gate then up), in the convention the written output
    names them by (Mixtral's w1 / w3 / w2 where it has them)."""
    out: dict[str, torch.Tensor] = {}
    prefixes = {k.rsplit(".", i)[0] for k in written for i in range(1, k.count(".") + 1)}
    for name, t in _dequantized(read(paths), paths).items():
        if not (name.endswith(("experts.gate_up_proj", "experts.down_proj")) and t.dim() == 3):
            out[_as_written(name, prefixes)] = t
            continue
        base = _as_written(name.rsplit(".", 1)[0], prefixes)
        gate, up, down = EXPERT_NAMES[f"{base}.0.w1.weight" in written or f"{base}.0.w2.weight" in written]
        for e in range(t.shape[0]):
            if name.endswith("gate_up_proj"):
                half = t.shape[1] // 2
                out[f"{base}.{e}.{gate}.weight"], out[f"{base}.{e}.{up}.weight"] = t[e, :half], t[e, half:]
            else:
                out[f"{base}.{e}.{down}.weight"] = t[e]
    return out


def _dequantized(tensors: dict[str, torch.Tensor], paths: list[Path]) -> dict[str, torch.Tensor]:
    """An FP8 source (DeepSeek's published form) as the float weights it stands for: each F8_E4M3 weight times its
    `weight_scale_inv` over blocks of config.json's quantization_config.weight_block_size, in float32 (exact), the
    scales dropped; any other source unchanged."""
    scales = [n for n, t in tensors.items() if n.endswith(".weight_scale_inv")]
    if not scales or not paths:
        return tensors
    cfg = json.loads((Path(paths[0]).parent / "config.json").read_text())
    br, bc = (cfg.get("quantization_config") or {}).get("weight_block_size") or (128, 128)
    out = dict(tensors)
    for name in scales:
        weight = name[:-len("_scale_inv")]
        w = out.get(weight)
        if w is None or w.dtype != torch.float8_e4m3fn:
            continue
        s = out.pop(name).float().repeat_interleave(br, 0).repeat_interleave(bc, 1)
        out[weight] = w.float() * s[:w.shape[0], :w.shape[1]]
    return out


# config.json keys that make MindIE's model code build quantized modules whatever the description says (DeepSeek's
# MLA reads quant_bias under mla_quantize): dropped for the second, plain float, reference
QUANT_CONFIG = ("quantize", "attn_quantize", "mla_quantize", "moe_quantize")


def _as_written(name: str, prefixes: set[str]) -> str:
    """transformers 5 names Mixtral's MoE block `mlp` (mlp.gate, mlp.experts); its checkpoints, and MindIE, name it
    `block_sparse_moe`: the written name where the output uses that one (`prefixes`: the written names' dotted
    prefixes)."""
    alt = name.replace(".mlp.", ".block_sparse_moe.")
    return alt if alt != name and alt.rsplit(".", 1)[0] in prefixes else name


def build(plain: Path, parallel_from: Path, source: dict[str, torch.Tensor], written: dict[str, torch.Tensor],
          out: Path, source_config: dict[str, Any], keep_config: bool = True) -> Path:
    """The reference directory for the quantized output `plain` (an offline-sharded output: the quantized directory
    it was sharded from, with the sharded folder's mindie_parallel.json). keep_config: config.json as written (MindIE
    takes the quantized model's path through its code: the int8 cache's modules), else without QUANT_CONFIG (a float
    model: for the model code that builds quantized modules from config.json alone)."""
    from safetensors.torch import save_file

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for name in COPIED:
        if (plain / name).is_file():
            shutil.copy(plain / name, out / name)
    # every key the float source's config.json has, with the source's value: a writer that changed one (head
    # counts, rope dims, tied embeddings) must not have the float load follow it
    cfg = json.loads((out / "config.json").read_text())
    cfg.update({k: v for k, v in source_config.items() if k != "quantization_config"})
    if not keep_config:
        cfg = {k: v for k, v in cfg.items() if k not in QUANT_CONFIG}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    if (parallel_from / "mindie_parallel.json").is_file():
        shutil.copy(parallel_from / "mindie_parallel.json", out / "mindie_parallel.json")
    desc_file = next(iter(sorted(plain.glob("quant_model_description*.json"))), None)
    desc = json.loads(desc_file.read_text()) if desc_file else {}
    quantized = {k[:-len(".weight")] for k, v in desc.items()
                 if k.endswith(".weight") and isinstance(v, str) and v not in FLOAT_TYPES}
    tensors: dict[str, torch.Tensor] = {}
    for name, t in written.items():
        base, _, leaf = name.rpartition(".")
        if base in quantized and leaf in QUANT_AUX:
            continue
        if name in source:
            tensors[name] = source[name].contiguous()
        elif leaf == "bias" and (base in quantized or "norm" in base):
            continue  # a float bias the source lacks, an anti-outlier norm's bias: the float model has none
        else:
            tensors[name] = t.contiguous()  # what only the quantized output has (the int8 cache's scales)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if desc_file is not None and keep_config:
        ref_desc = {}
        for k, v in desc.items():
            base, _, leaf = k.rpartition(".")
            if base in quantized and leaf in QUANT_AUX or k.endswith(".module.weight") or k.endswith(".module.bias"):
                continue
            ref_desc[k] = "FLOAT" if k[:-len(".weight")] in quantized and leaf == "weight" else v
        (out / desc_file.name).write_text(json.dumps(ref_desc, indent=1))
    return out


def capture(model: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]], desc_of: Any
            ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """What the float load holds, before init_ascend_weight: every linear's weight as held (raw array, its transpose
    flag) and every 1-D float weight (the norms), by module name."""
    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {"linears": {}, "norms": []}
    for name, m in modules:
        kind, transposed = desc_of(m)
        arrays[f"w::{name}"] = m.weight.detach().to(torch.float64).numpy()
        meta["linears"][name] = {"kind": kind, "transposed": transposed}
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 1 and w.is_floating_point():
            arrays[f"n::{name}"] = w.detach().to(torch.float64).numpy()
            meta["norms"].append(name)
    return arrays, meta


def slots(graph: list[Any], weights: dict[str, torch.Tensor]) -> list[str | None]:
    """For each position of the weight list handed to the ATB graph, the module whose weight sits there (by
    storage, else by bytes: init_ascend_weight may cast a weight's format into a new tensor), else None."""
    by_ptr = {(t.data_ptr(), tuple(t.shape)): n for n, t in weights.items() if t.numel()}
    by_bytes = {(str(t.dtype), tuple(t.shape), digest(t)): n for n, t in weights.items() if t.numel()}
    out: list[str | None] = []
    for t in graph:
        if not isinstance(t, torch.Tensor) or not t.numel():
            out.append(None)
            continue
        out.append(by_ptr.get((t.data_ptr(), tuple(t.shape)))
                   or by_bytes.get((str(t.dtype), tuple(t.shape), digest(t))))
    return out


def digest(t: torch.Tensor) -> int:
    return hash(t.detach().contiguous().view(torch.uint8).numpy().tobytes()) if t.numel() else 0
