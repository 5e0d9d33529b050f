"""Seeded tiny models of every family, built by transformers from a config (no hub): the demo model and test fixtures.

The weights are random but the checkpoints are real `save_pretrained` output (both MoE layouts), so every stage runs
its real loading code on them. `write_fp8_checkpoint` turns one into a DeepSeek-style FP8 block-scaled checkpoint.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dsconv.tensors import precision_torch_dtype
from dsconv.families import families

ROUTER_BIAS = next(f.row("router.bias").param for f in families() if f.has("router.bias"))
#: every registered family has a tiny model (its `tiny` config keys); MoE ones have a router row
FAMILIES = tuple(f.name for f in families())
MOE_FAMILIES = tuple(f.name for f in families() if f.has("router"))
#: the small widths every tiny model shares; each family's `tiny` adds or overrides its own keys
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, rms_norm_eps=1e-6)


def _family(name: str) -> Any:
    fam = next((f for f in families() if f.name == name), None)
    if fam is None:
        raise ValueError(f"unknown tiny family {name}")
    return fam


def tiny_config(family: str, vocab_size: int = 320, **overrides: Any):
    """A transformers config of `family` with a few layers and small widths (RoPE and MoE routing intact)."""
    from dsconv.families.facts import hf_config

    fam = _family(family)
    cfg = hf_config(fam.nest_config({"model_type": fam.model_types[0], "vocab_size": vocab_size, **COMMON, **fam.tiny}))
    for k, v in overrides.items():
        setattr(cfg.get_text_config(), k, v)
    return cfg


def build_model(family: str, seed: int = 0, **overrides: Any):
    """A randomly initialised tiny model (seeded; MoE routers get a spread so that routing varies by input)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    fam = _family(family)
    cfg = tiny_config(family, **overrides)
    model = getattr(transformers, fam.checkpoint_class).from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # non-trivial norms catch mis-mapped weights
            elif p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.05)  # non-zero biases: a bias mapped to the wrong projection must show
            if name.endswith("mlp.gate.weight") or name.endswith("router.weight"):
                # spread enough that routing varies by input, small enough that DeepSeek's sigmoid scores do not
                # saturate at 1.0, where fp16 cannot tell experts apart (real routers are not saturated either)
                p.normal_(0.0, fam.tiny_router_std)
        for name, b in model.named_buffers():
            if name.endswith(ROUTER_BIAS):  # DeepSeek's routing bias: a buffer in transformers
                b.normal_(0.0, 0.05)
    return model


def save_model(model, out: Path, fused: bool = False, dtype: str | None = None, tokenizer: Any | None = None) -> Path:
    """`save_pretrained` in the per-expert (default) or fused MoE layout, optionally cast to bf16/fp16."""
    out = Path(out)
    if dtype:
        model = model.to(precision_torch_dtype(dtype))
    model.save_pretrained(out, save_original_format=not fused)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def make_tiny(family: str, out: Path, seed: int = 0, fused: bool = False, dtype: str | None = None,
              tokenizer: Any | None = None, **overrides: Any) -> Path:
    if tokenizer is not None:
        overrides.setdefault("vocab_size", len(tokenizer))
    out = save_model(build_model(family, seed=seed, **overrides), out, fused=fused, dtype=dtype, tokenizer=tokenizer)
    saved = _family(family).tiny_saved
    if saved:  # the keys the family's real config.json carries that transformers' own config class does not write
        cfg_path = Path(out) / "config.json"
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **saved}, indent=2) + "\n")
    return out


def make_deep(out: Path, layers: int = 30, seed: int = 0, vocab_size: int = 1024, embed_std: float = 1.0,
              weight_std: float = 0.15) -> Path:
    """A deep, narrow Llama saved as a bf16 checkpoint with tied embeddings - the shape of a real 135M model (30
    layers, tied, bf16) at hidden size 64 - whose weights are scaled like a trained model's: the residual stream
    grows through the layers and the logits reach ~35. Its float32 rounding noise on the logits is ~2e-4, so a
    correct fp32 export differs from PyTorch by more than 1e-4: what a fixed absolute tolerance cannot take and
    the noise-derived one (convert/tolerance.py) must."""
    import torch

    from dsconv.families.llama import Llama

    model = build_model(Llama.name, seed=seed, num_hidden_layers=layers, vocab_size=vocab_size, tie_word_embeddings=True,
                        intermediate_size=256)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "model.embed_tokens.weight":  # also the lm_head (tied)
                p.copy_(torch.randn(p.shape, generator=g) * embed_std)
            elif name == "model.norm.weight":
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * weight_std)
    return save_model(model, out, dtype="bf16")


def train_tokenizer(texts: list[str], vocab_size: int = 512):
    """A small byte-level BPE trained on `texts` (the bundled calibration set), as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", padding_side="left")


def add_mtp_layer(model_dir: Path, seed: int = 0) -> None:
    """Append an MTP module to a saved tiny checkpoint as the published one stores it: DeepSeek's and GLM's as layer
    num_hidden_layers, Qwen3-Next's as `mtp.*`; transformers ignores it, dsconv must account for it."""
    import torch
    from safetensors.torch import load_file, save_file

    from dsconv.families import family_for

    cfg = json.loads((model_dir / "config.json").read_text())
    fam = family_for(cfg)
    g = torch.Generator().manual_seed(seed)
    existing = load_file(model_dir / "model.safetensors")
    dtype = next(iter(existing.values())).dtype
    if fam.mtp_prefixes:  # Qwen3-Next: mtp.fc, its norms and a copy of a full-attention layer's layout as mtp.layers.0
        facts = fam.facts(cfg)
        full = next(i for i in range(facts.num_layers) if not facts.layer_kinds or
                    facts.layer_kinds[i] == "full_attention")
        p, h = fam.mtp_prefixes[0], facts.hidden_size
        shapes = {f"{p}fc.weight": (h, 2 * h), **{f"{p}{n}.weight": (h,) for n in
                                                   ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
        layer = f"{fam.layer_prefix}{full}."
        shapes.update({f"{p}layers.0.{n[len(layer):]}": tuple(t.shape) for n, t in existing.items()
                       if n.startswith(layer)})
        for name, shape in shapes.items():
            existing[name] = (torch.randn(shape, generator=g) * 0.05).to(dtype)
        save_file(existing, model_dir / "model.safetensors", metadata={"format": "pt"})
        if "mtp_num_hidden_layers" in fam.config_keys:  # Qwen3.5 announces its block (vLLM's drafter reads it)
            (cfg.get(fam.config_section) or cfg)["mtp_num_hidden_layers"] = 1
            (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))
        return
    cfg["num_nextn_predict_layers"] = 1
    facts = fam.facts(cfg)
    shared = {fam.tensor("mtp.embed", facts.num_layers): "model.embed_tokens.weight",
              fam.tensor("mtp.head", facts.num_layers): "lm_head.weight"}
    for spec in fam.synthesize(cfg):
        if spec.name not in existing and fam.classify(spec.name, facts).layer == facts.num_layers:
            if existing.get(shared.get(spec.name, "")) is not None:  # DeepSeek's MTP module shares the embedding and
                existing[spec.name] = existing[shared[spec.name]].clone()  # the head; its checkpoint stores copies
            else:
                existing[spec.name] = (torch.randn(spec.shape, generator=g) * 0.05).to(dtype)
    save_file(existing, model_dir / "model.safetensors", metadata={"format": "pt"})
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))


def write_fp8_checkpoint(src: Path, out: Path, block: tuple[int, int] = (128, 128), max_part_tensors: int = 0) -> Path:
    """Re-save a tiny DeepSeek-V3 checkpoint the way DeepSeek publishes V3/R1: quantizable linear weights as
    float8_e4m3fn with a float32 `weight_scale_inv` per 128x128 block, config with quantization_config.

    With `max_part_tensors`, tensors are spread over several parts with an index, and each scale is put in the part
    after its weight so that readers must look scales up across parts.
    """
    import torch
    from safetensors.torch import load_file, save_file

    from dsconv.families import family_for

    cfg = json.loads((src / "config.json").read_text())
    fam = family_for(cfg)
    facts = fam.facts(cfg)
    tensors = load_file(src / "model.safetensors")
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        r = fam.classify(name, facts)
        fp8 = r.role.quantized_by_default or any(fam.tensor(k, r.layer) == name for k in fam.fp8_keys)
        if fp8 and r.param == "weight" and t.dim() == 2:
            w = t.float()
            rows, cols = w.shape
            sr, sc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
            scale = torch.empty(sr, sc)
            q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
            for i in range(sr):
                for j in range(sc):
                    blk = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
                    s = blk.abs().max().clamp(min=1e-12) / 448.0
                    scale[i, j] = s
                    q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (blk / s).to(
                        torch.float8_e4m3fn)
            result[name] = q
            result[name + "_scale_inv"] = scale
        else:
            result[name] = t.to(torch.bfloat16) if t.is_floating_point() and t.dtype != torch.float32 else t
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": list(block)}
    cfg["torch_dtype"] = "bfloat16"
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / extra).is_file():
            (out / extra).write_bytes((src / extra).read_bytes())
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if not max_part_tensors:
        save_file(result, out / "model.safetensors", metadata={"format": "pt"})
        return out
    names = [n for n in result if not n.endswith("_scale_inv")]
    parts: list[list[str]] = [names[i:i + max_part_tensors] for i in range(0, len(names), max_part_tensors)]
    n = len(parts) + 1
    files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map: dict[str, str] = {}
    contents: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    for i, part in enumerate(parts):
        for name in part:
            contents[i][name] = result[name]
            weight_map[name] = files[i]
            if name + "_scale_inv" in result:  # the scale lives in the next part
                contents[i + 1][name + "_scale_inv"] = result[name + "_scale_inv"]
                weight_map[name + "_scale_inv"] = files[i + 1]
    for i, c in enumerate(contents):
        save_file(c, out / files[i], metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in result.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return out
