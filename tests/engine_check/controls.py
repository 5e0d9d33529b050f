"""Broken copies of real written outputs that each engine's check must fail, and one correct copy it must pass.

Runs in dsconv's environment, but edits the written files with safetensors and numpy only, by the format's rules
(docs/formats.md, docs/formats/w4a8.md), never through dsconv's writer: a control that dsconv's code built would
agree with dsconv by construction. A check is only as good as the faults it has been shown to catch: each fault a
layout writer can make gets a control here, and matrix.py fails when one is not caught (or when the correct copy is
refused).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

L0 = "model.layers.0"
# name -> (family, scheme, dtype, layout of the copied output, tp, what the check must report): a field of the
# result that must be non-empty, ("refused", exception type, message part) for a refusal that MindIE's own code must
# raise, or "ok" for a correct copy built by a reference writer that must load clean
CONTROLS: dict[str, tuple] = {
    "drop-deq-scale": ("llama", "bits8", "bf16", "per-expert", 1,
                       ("refused", "AssertionError", f"weight {L0}.self_attn.o_proj.deq_scale does not exist")),
    "describe-other-type": ("llama", "w8a8_dynamic", "bf16", "per-expert", 1, "class_mismatch"),
    "transpose-square": ("llama", "bits8", "bf16", "per-expert", 1, "value_mismatch"),
    "deq-scale-dtype": ("llama", "bits8", "fp16", "per-expert", 1, "lossy"),
    "swap-rank-file": ("deepseek_v3", "bits8", "bf16", "sharded", 2, "value_mismatch"),
    "mix-drop-input-scale": ("qwen2", "w8a8_mix", "bf16", "per-expert", 1,
                             ("refused", "ValueError", "Weight file was not found for tensor named with "
                              f"{L0}.self_attn.o_proj.input_scale")),
    "mix-prefill-scale-off": ("qwen2", "w8a8_mix", "bf16", "per-expert", 1, "value_mismatch"),
    "gate-up-swapped": ("llama", "bits8", "bf16", "per-expert", 1, "value_mismatch"),
    "q-rows-in-head": ("llama", "bits8", "bf16", "per-expert", 2, "value_mismatch"),
    "k-v-swapped": ("llama", "w8a8_dynamic", "bf16", "per-expert", 1, "value_mismatch"),
    "experts-exchanged": ("qwen3_moe", "w8a8_dynamic", "bf16", "per-expert", 1, "value_mismatch"),
    "mla-rope-unpermuted": ("deepseek_v3", "bits8", "bf16", "sharded", 2, "value_mismatch"),
    "weight-scale-div8": ("llama", "w8a16", "bf16", "per-expert", 1, "value_mismatch"),
    "int4-nibbles-swapped": ("llama", "w4a16", "bf16", "per-expert", 1, "value_mismatch"),
    "w4a8-nibbles-swapped": ("deepseek_v3", "w4a8", "bf16", "per-expert", 1, "value_mismatch"),
    "norm-held-differs": ("llama", "w8a16", "bf16", "per-expert", 1, "norms"),
    "w4a8-reference-packed": ("deepseek_v3", "w4a8", "bf16", "per-expert", 1, "ok"),
    "head-rows-swapped": ("llama", "bits8", "bf16", "per-expert", 1, "value_mismatch"),  # a float tensor
    # GLM-4.5's fused q/k/v with biases and partial rotary, sharded by MindIE at tp 2
    "glm-q-rows-in-head": ("glm4_moe", "bits8", "bf16", "per-expert", 2, "value_mismatch"),
    "glm-k-v-swapped": ("glm4_moe", "w8a8", "bf16", "per-expert", 1, "value_mismatch"),
}
# controls that make another control's edit on another family's output
SAME_EDIT = {"glm-q-rows-in-head": "q-rows-in-head", "glm-k-v-swapped": "k-v-swapped"}


# vLLM-Ascend: name -> (output "family-scheme", bf16 per-expert, the copy is made of; what the check must report: a
# non-empty field of vllm_loader's result, "ok" for a correct copy, or "refused": an exception vLLM's or vLLM-Ascend's
# own code raised)
VLLM_CONTROLS: dict[str, tuple[str, str]] = {
    "drop-weight-scale": ("llama-bits8", "unfilled"),      # a dynamic layer's weight_scale removed
    "rename-tensor": ("llama-bits8", "refused"),           # a weight under a name the model has no parameter for
    "scale-off-grid": ("llama-bits8", "lossy"),            # an input_scale the model dtype cannot hold
    "w4a8-drop-scale-bias": ("qwen3_moe-w4a8", "unfilled"),  # a W4A8 expert's scale_bias removed
    "c8-drop-cache-scale": ("qwen3-bits8_c8", "unfilled"),   # a layer's v_proj.kv_cache_scale removed
    "fa-drop-k-scale": ("deepseek_v3-w4a8_c8", "unfilled"),  # a DeepSeek layer's fa_k.scale removed
    "mix-drop-weight-scale": ("llama-w8a8_mix", "unfilled"),  # a PD-mix linear's prefill scale removed
    # the layout faults: each tensor lands where its name says, so only the comparison with the source sees them
    "gate-up-swapped": ("llama-bits8", "source"),
    "q-rows-in-head": ("llama-bits8", "source"),
    "k-v-swapped": ("llama-w8a8_dynamic", "source"),
    "experts-exchanged": ("qwen3_moe-w8a8_dynamic", "source"),
    "mla-rope-permuted": ("deepseek_v3-bits8", "source"),   # MindIE's rope-row order leaked into a vLLM output
    "weight-scale-div8": ("llama-w8a16", "source"),
    "w4a8-nibbles-swapped": ("deepseek_v3-w4a8", "source"),  # (vLLM-Ascend loads no W4A16: no int4 linear control)
    "norm-held-differs": ("llama-w8a16", "lossy"),
    "w4a8-reference-packed": ("deepseek_v3-w4a8", "ok"),
    "transpose-square": ("llama-bits8", "source"),
    "mix-prefill-scale-off": ("llama-w8a8_mix", "source"),
    "describe-other-type": ("llama-w8a8_dynamic", "unfilled"),  # the static params it then declares
    "head-rows-swapped": ("llama-bits8", "source"),
    # the new families' own layouts: Qwen3-Next's in_proj_qkvz (one key head's rows reversed), DeepSeek-V3.2's
    # indexer wk (a float matrix vLLM fuses with weights_proj: two rows exchanged)
    "qkvz-rows-in-head": ("qwen3_next-w8a8_dynamic", "source"),
    "indexer-wk-rows-swapped": ("deepseek_v32-bits8", "source"),
    # Qwen3.5's VL checkpoint: its split in_proj_b / in_proj_a exchanged (same shape, one fused in_proj_ba in the
    # engine), and two rows of a float vision-tower matrix exchanged
    "in-proj-b-a-swapped": ("qwen3_5_moe-w8a8_dynamic", "source"),
    "vision-qkv-rows-swapped": ("qwen3_5_moe-w8a8_dynamic", "source"),
    # W4A4_DYNAMIC's int4 values stored in int8: a row's values doubled and its scale halved dequantizes to the same
    # weight, but the engine packs the int8 to int4 at load, which cannot hold them
    "w4a4-beyond-int4": ("llama-w4a4", "source"),
}
VL0 = "model.language_model.layers.0"


def _load(f: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(f))


def _save(f: Path, t: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in t.items()}, str(f), metadata={"format": "pt"})


def _edit(d: Path, edit: Callable[[dict], None], pattern: str = "*.safetensors") -> None:
    for f in sorted(d.glob(pattern)):
        t = _load(f)
        edit(t)
        _save(f, t)


def _f64(a: torch.Tensor) -> np.ndarray:
    return a.to(torch.float64).numpy()


def _swap_groups(t: dict, a: str, b: str) -> None:
    """Every tensor of module a under module b's name and the other way round (a writer that mixed two names up)."""
    ka = [k for k in t if k.startswith(a + ".")]
    kb = [k for k in t if k.startswith(b + ".")]
    moved = {b + k[len(a):]: t.pop(k) for k in ka}
    moved.update({a + k[len(b):]: t.pop(k) for k in kb})
    t.update(moved)


def _permute_rows(t: dict, module: str, perm: np.ndarray) -> None:
    """Rows of module's weight and of its per-row tensors (scales, offsets, biases) in another order."""
    n = t[module + ".weight"].shape[0]
    for k in [k for k in t if k.startswith(module + ".")]:
        if t[k].dim() >= 1 and t[k].shape[0] == n:
            t[k] = t[k][torch.as_tensor(perm)].contiguous()


def _source(src: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        out.update(_load(f))
    return out


def _config(d: Path) -> dict[str, Any]:
    return json.loads((d / "config.json").read_text())


def _weight_scale_div8(d: Path, src: Path) -> None:
    """o_proj re-quantized from the source with a per-channel scale 8x too small (a writer's wrong max): most
    elements clip at +-127 and every clipped one lies 'beyond the clip', so only the clip bound can catch it."""
    def edit(t: dict) -> None:
        name = f"{L0}.self_attn.o_proj"
        scale = t[name + ".weight_scale"]
        s = _f64(scale).reshape(-1, 1) / 8
        w = _f64(_source(src)[name + ".weight"])
        t[name + ".weight"] = torch.from_numpy(np.clip(np.round(w / s), -127, 127).astype(np.int8))
        t[name + ".weight_scale"] = (scale.to(torch.float64) / 8).to(scale.dtype)
    _edit(d, edit)


def _nibbles(t: dict, name: str) -> None:
    u = t[name].view(torch.uint8)
    t[name] = (((u & 0x0F) << 4) | (u >> 4)).view(torch.int8)


def _norm_off_grid(t: dict) -> None:
    """A norm written in float32 with values between bf16's: a bf16 model holds it rounded, not as written."""
    name = f"{L0}.input_layernorm.weight"
    t[name] = t[name].to(torch.float32) * (1 + 2 ** -12)


def _rope_permuted(d: Path) -> None:
    """q_b_proj's rope rows in MindIE's order (each head's even rows first, then odd) in an output for an engine
    that takes the checkpoint's order."""
    cfg = _config(d)
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    head = np.concatenate([np.arange(nope), nope + np.r_[np.arange(0, rope, 2), np.arange(1, rope, 2)]])

    def edit(t: dict) -> None:
        name = f"{L0}.self_attn.q_b_proj"
        n = t[name + ".weight"].shape[0]
        _permute_rows(t, name, (np.arange(n // (nope + rope))[:, None] * (nope + rope) + head).reshape(-1))
    _edit(d, edit)


def _rope_unpermuted(d: Path) -> None:
    """dsconv's offline-sharded writer permutes each head's rope rows of q_b_proj as MindIE's loader would (even rows
    first, then odd); this copy writes rank 0's in the checkpoint's order, as a writer that forgot it would."""
    cfg = _config(d)
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    f = d / "model-attn-tp-000" / "model.safetensors"
    t = _load(f)
    name = f"{L0}.self_attn.q_b_proj"
    n = t[name + ".weight"].shape[0]
    head = np.concatenate([np.arange(nope), nope + np.argsort(np.r_[np.arange(0, rope, 2), np.arange(1, rope, 2)])])
    perm = (np.arange(n // (nope + rope))[:, None] * (nope + rope) + head).reshape(-1)
    _permute_rows(t, name, perm)
    _save(f, t)


def _first_moe_layer(t: dict) -> str:
    k = next(k for k in sorted(t) if ".experts.0." in k)
    return k.split(".experts.0.")[0]


def _w4a8_reference(d: Path, src: Path) -> None:
    """One routed expert's gate_proj rewritten by a reference writer from the format description alone
    (docs/formats/w4a8.md §1-3): q = clamp(round(w / s), -8, 7) per output channel with the written scale, w the
    source weight times the norm ratio SmoothQuant moved (source norm / written norm, along the input);
    packed[j, k] = (q[2j, k] & 0xF) | (q[2j+1, k] << 4); scale_bias = 8 * s * sum_k q. If the checker decoded the
    nibbles or the correction the way dsconv wrote them instead of as the format says, this copy would fail."""
    source = _source(src)

    def edit(t: dict) -> None:
        moe = _first_moe_layer(t)
        name = f"{moe}.experts.0.gate_proj"
        layer = moe.rsplit(".", 1)[0]
        norm = f"{layer}.post_attention_layernorm.weight"
        w = _f64(source[name + ".weight"]) * (_f64(source[norm]) / _f64(t[norm]))[None, :]
        s = _f64(t[name + ".weight_scale"]).reshape(-1, 1)
        q = np.clip(np.round(w / s), -8, 7).astype(np.int64)
        packed = (q[0::2] & 0xF) | ((q[1::2] & 0xF) << 4)
        t[name + ".weight"] = torch.from_numpy(packed.astype(np.uint8).view(np.int8))
        t[name + ".scale_bias"] = torch.from_numpy((8 * s * q.sum(axis=1, keepdims=True)).astype(np.float32))
    _edit(d, edit)


def make(name: str, base: Path, src: Path, root: Path) -> Path:
    """A copy of the written output `base` (made from the float source `src`) with control `name`'s edit."""
    d = root / f"control-{name}"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(base, d)
    o = f"{L0}.self_attn.o_proj"
    if name == "qkvz-rows-in-head":  # layer 0 is linear attention: its first key head's q rows reversed
        hd = int(_config(d)["linear_key_head_dim"])

        def qkvz(t: dict) -> None:
            n = t[f"{L0}.linear_attn.in_proj_qkvz.weight"].shape[0]
            _permute_rows(t, f"{L0}.linear_attn.in_proj_qkvz", np.r_[np.arange(hd)[::-1], np.arange(hd, n)])
        _edit(d, qkvz)
        return d
    name = SAME_EDIT.get(name, name)
    if name == "drop-deq-scale":
        _edit(d, lambda t: t.pop(o + ".deq_scale"))
    elif name == "transpose-square":
        _edit(d, lambda t: t.__setitem__(o + ".weight", t[o + ".weight"].T.contiguous()))
    elif name == "deq-scale-dtype":
        def to_float(t: dict) -> None:
            for k in [k for k in t if k.endswith("deq_scale")]:
                t[k] = (t[k] & 0xFFFFFFFF).to(torch.int32).view(torch.float32).clone()
        _edit(d, to_float)
    elif name == "mix-drop-input-scale":
        _edit(d, lambda t: t.pop(o + ".input_scale"))
    elif name == "mix-prefill-scale-off":  # weight_scale doubled: the decode side still matches the source
        _edit(d, lambda t: t.__setitem__(o + ".weight_scale", t[o + ".weight_scale"] * 2))
    elif name == "describe-other-type":
        f = d / "quant_model_description.json"
        desc = json.loads(f.read_text())
        desc[o + ".weight"] = "W8A8"
        f.write_text(json.dumps(desc, indent=2))
    elif name == "swap-rank-file":
        a, b = d / "model-attn-tp-000" / "model.safetensors", d / "model-attn-tp-001" / "model.safetensors"
        tmp = a.with_suffix(".swap")
        a.rename(tmp)
        b.rename(a)
        tmp.rename(b)
    elif name == "gate-up-swapped":
        _edit(d, lambda t: _swap_groups(t, f"{L0}.mlp.gate_proj", f"{L0}.mlp.up_proj"))
    elif name == "k-v-swapped":
        _edit(d, lambda t: _swap_groups(t, f"{L0}.self_attn.k_proj", f"{L0}.self_attn.v_proj"))
    elif name == "q-rows-in-head":  # head 0's rows reversed: the same rows, the same head, another order
        hd = int(_config(d).get("head_dim") or _config(d)["hidden_size"] // _config(d)["num_attention_heads"])

        def edit(t: dict) -> None:
            n = t[f"{L0}.self_attn.q_proj.weight"].shape[0]
            _permute_rows(t, f"{L0}.self_attn.q_proj", np.r_[np.arange(hd)[::-1], np.arange(hd, n)])
        _edit(d, edit)
    elif name == "experts-exchanged":
        _edit(d, lambda t: _swap_groups(t, f"{_first_moe_layer(t)}.experts.0", f"{_first_moe_layer(t)}.experts.1"))
    elif name == "mla-rope-unpermuted":
        _rope_unpermuted(d)
    elif name == "weight-scale-div8":
        _weight_scale_div8(d, src)
    elif name == "int4-nibbles-swapped":
        _edit(d, lambda t: _nibbles(t, o + ".weight"))
    elif name == "w4a8-nibbles-swapped":
        _edit(d, lambda t: _nibbles(t, f"{_first_moe_layer(t)}.experts.0.gate_proj.weight"))
    elif name == "norm-held-differs":
        _edit(d, _norm_off_grid)
    elif name == "w4a8-reference-packed":
        _w4a8_reference(d, src)
    elif name == "head-rows-swapped":  # two vocabulary rows of the (float) lm_head exchanged
        def swap(t: dict) -> None:
            n = t["lm_head.weight"].shape[0]
            _permute_rows(t, "lm_head", np.r_[1, 0, np.arange(2, n)])
        _edit(d, swap)
    elif name == "mla-rope-permuted":
        _rope_permuted(d)
    elif name == "indexer-wk-rows-swapped":
        def wk(t: dict) -> None:
            n = t[f"{L0}.self_attn.indexer.wk.weight"].shape[0]
            _permute_rows(t, f"{L0}.self_attn.indexer.wk", np.r_[1, 0, np.arange(2, n)])
        _edit(d, wk)
    elif name == "in-proj-b-a-swapped":
        _edit(d, lambda t: _swap_groups(t, f"{VL0}.linear_attn.in_proj_b", f"{VL0}.linear_attn.in_proj_a"))
    elif name == "vision-qkv-rows-swapped":
        def vision(t: dict) -> None:
            qkv = "model.visual.blocks.0.attn.qkv"
            _permute_rows(t, qkv, np.r_[1, 0, np.arange(2, t[qkv + ".weight"].shape[0])])
        _edit(d, vision)
    elif name == "w4a4-beyond-int4":
        def beyond(t: dict) -> None:
            q = _first(t, "q_proj.weight")
            w, s = t[q].clone(), t[q + "_scale"].clone()
            w[0], s[0] = w[0] * 2, s[0] / 2
            t[q], t[q + "_scale"] = w, s
        _edit(d, beyond)
    elif name == "drop-weight-scale":
        _edit(d, lambda t: t.pop(_first(t, "down_proj.weight_scale")))
    elif name == "w4a8-drop-scale-bias":
        _edit(d, lambda t: t.pop(_first(t, "experts.1.down_proj.scale_bias")))
    elif name == "fa-drop-k-scale":
        _edit(d, lambda t: t.pop(_first(t, "layers.1.self_attn.fa_k.scale")))
    elif name == "mix-drop-weight-scale":
        _edit(d, lambda t: t.pop(_first(t, "o_proj.weight_scale")))
    elif name == "c8-drop-cache-scale":
        _edit(d, lambda t: t.pop(_first(t, "layers.1.self_attn.v_proj.kv_cache_scale")))
    elif name == "rename-tensor":
        _edit(d, lambda t: t.__setitem__(_first(t, "o_proj.weight").replace("o_proj", "oo_proj"),
                                         t.pop(_first(t, "o_proj.weight"))))
    elif name == "scale-off-grid":
        _edit(d, lambda t: t.__setitem__(_first(t, "o_proj.input_scale"),
                                         t[_first(t, "o_proj.input_scale")] * (1.0 + 2.0 ** -12)))
    else:
        raise KeyError(name)
    return d


def _first(t: dict, suffix: str) -> str:
    return next(k for k in sorted(t) if k.endswith(suffix))


def vllm_caught(expect: str, r: dict | None) -> bool:
    """Whether a vLLM-Ascend control's raw result is what it must be: "ok" clean as vllm_summary judges a case,
    "refused" raised in vLLM's or vLLM-Ascend's own code (never a crash of the check), else that field non-empty."""
    if r is None:
        return False
    if expect == "ok":
        from dsconv.engines.loader_check import vllm_summary

        return vllm_summary(r)["load"] == "ok"
    if expect == "refused":
        return not r.get("loaded") and str(r.get("raised_in", "")).startswith(("vllm/", "vllm_ascend/"))
    return bool(r.get("loaded")) and bool(r.get(expect))


def caught(expect: Any, r: dict) -> bool:
    """Whether a control's merged result (matrix.merge_ranks) is what it must be: a refusal only when MindIE's own
    code raised the named exception with the named message (never a crash of the check or a stand-in)."""
    if expect == "ok":
        return r.get("load") == "ok"
    if isinstance(expect, tuple):
        _, etype, message = expect
        return (r.get("load") == "refused by the engine" and r.get("error_type") == etype
                and message in (r.get("error") or "") and str(r.get("raised_in", "")).startswith(("atb_llm/",
                                                                                                   "mindie_llm/")))
    return r.get(expect, 0) > 0


def rehash(d: Path) -> None:
    """The manifest of a control rewritten to its edited files: what a writer with that bug would have written, so
    that `dsconv verify --engine` meets the fault in the engine's load, not in the file hashes."""
    from dsconv.io.digest import entry, file_digest

    f = d / "dsconv_manifest.json"
    m = json.loads(f.read_text())
    for name in list(m["files"]):
        p = d / name
        if p.is_file():
            m["files"][name] = entry(file_digest(p), p.stat().st_size)
    f.write_text(json.dumps(m, indent=1))

