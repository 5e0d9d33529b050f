"""Load quantized checkpoints with vLLM-Ascend's real weight loader on a CPU host and check where every tensor landed.

Runs inside the engine-check environment (vLLM 0.23.0 + vLLM-Ascend 0.23.0.post1, see setup_env.sh), never in
dsconv's own: it imports nothing from dsconv, so it cannot agree with dsconv by construction.

    python vllm_loader.py DIR [DIR ...] --json results.jsonl

For each directory: `EngineArgs(quantization="ascend")` -> `initialize_model` on CPU -> the engine's
`DefaultModelLoader.load_weights`. vLLM skips its own "weights not initialized" check for quantized models, so the
check is ours: every parameter is first filled with a sentinel, every checkpoint tensor is then compared with the
part of the parameter it must land in (fused q/k/v, gate/up and q_a/kv_a slices, stacked `w13_*` / `w2_*`
experts), and every parameter element must have been claimed by some checkpoint tensor. A tensor counts as
bit-exact (same dtype and bytes), after-cast (the engine's parameter has another dtype and holds exactly the cast
value, e.g. a float32 input_scale in a bf16 parameter: lossy when that cast changes a value, which is a failure:
the engine would compute with another number than the one written) or mismatched; a tensor with no parameter is
unmapped.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import npu_stubs  # noqa: E402
from frames import raised_in  # noqa: E402

npu_stubs.install()

import torch  # noqa: E402

# Fused vLLM modules -> the checkpoint modules stacked into them, in order along the output dim. Restated from the
# engine models (vllm/model_executor/models/{llama,qwen2,qwen3,qwen2_moe,qwen3_moe,mixtral,deepseek_v2}.py
# `stacked_params_mapping`), not imported, so a change in the engine shows up as a failure here.
STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
           "q_a_proj": ("fused_qkv_a_proj", 0), "kv_a_proj_with_mqa": ("fused_qkv_a_proj", 1),
           # DeepSeek-V3.2's indexer (deepseek_v2.py: ("wk_weights_proj", "wk", 0), ("wk_weights_proj",
           # "weights_proj", 1))
           "wk": ("wk_weights_proj", 0), "weights_proj": ("wk_weights_proj", 1),
           # Qwen3.5's split DeltaNet projections (qwen3_5.py: ("in_proj_qkvz", "in_proj_qkv", (0, 1, 2)),
           # ("in_proj_qkvz", "in_proj_z", 3), ("in_proj_ba", "in_proj_b", 0), ("in_proj_ba", "in_proj_a", 1))
           "in_proj_qkv": ("in_proj_qkvz", 0), "in_proj_z": ("in_proj_qkvz", 1),
           "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1)}
STACK_ORDER = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
               "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"), "wk_weights_proj": ("wk", "weights_proj"),
               "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}
# a vision-language checkpoint's names -> the engine model's (vllm/model_executor/models/qwen3_vl.py
# Qwen3VLForConditionalGeneration.hf_to_vllm_mapper, which Qwen3.5's VL model inherits; modelslim_config.py
# apply_vllm_mapper renames the description's keys the same way)
VL_PREFIXES = (("model.visual.", "visual."), ("model.language_model.", "language_model.model."),
               ("lm_head.", "language_model.lm_head."))
# routed experts: checkpoint projection -> (fused parameter, half of w13 or None)
EXPERT_RE = re.compile(r"^(?P<moe>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.(?P<param>\w+)$")
EXPERT_SLOT = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
               "down_proj": ("w2", None), "w2": ("w2", None)}
# C8 KV-cache scales: checkpoint suffix -> the attention layer's parameter (restated from vllm-ascend
# quantization/modelslim_config.py::AscendModelSlimConfig.get_cache_scale, which only the model classes patched by
# patch/worker/patch_gqa_c8.py call: elsewhere the names reach the model's own loader, and the check shows what follows)
C8_SCALES = {"k_proj.kv_cache_scale": "attn.k_cache_scale", "k_proj.kv_cache_offset": "attn.k_cache_offset",
             "v_proj.kv_cache_scale": "attn.v_cache_scale", "v_proj.kv_cache_offset": "attn.v_cache_offset"}
# MLA FA quant (DeepSeek int8 latent cache): `<attn>.fa_{q,k,v}.{scale,offset}` -> the MLA attention layer's own
# parameters (restated from vllm-ascend patch/worker/patch_weight_utils.py::patch_deepseek, which extends
# maybe_remap_kv_scale_name with `mla_attn.mla_attn.<name>`)
FA_PARAMS = ("fa_q", "fa_k", "fa_v")
FA_ATTN = "mla_attn.mla_attn"
# per-tensor parameters of a fused layer hold one value for all its shards (vLLM-Ascend W8A8 static:
# get_pertensor_param creates input_scale/input_offset of shape [1])
PER_TENSOR = ("input_scale", "input_offset")

_PATCHED = False
_BOOTED = False


def boot() -> None:
    """The NPU worker's start-up, once per process (vllm_ascend/worker/worker.py and the platform's init)."""
    global _PATCHED
    if _PATCHED:
        return
    from vllm_ascend.utils import adapt_patch, register_ascend_customop

    adapt_patch(True)
    adapt_patch()
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    register_ascend_customop()
    _PATCHED = True


def init_parallel(vllm_config: Any) -> None:
    """One process, world size 1: vLLM's groups, then vLLM-Ascend's (else "mc2 group is not initialized"). Runs
    under the first checkpoint's config (vLLM-Ascend sizes its HCCL options from it); later ones reuse it."""
    global _BOOTED
    if _BOOTED:
        return
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    port = 20000 + os.getpid() % 20000
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 1)
    # the W8A8-dynamic MoE method asks the process group for an "npu" backend and only catches AttributeError
    pg = torch.distributed.ProcessGroup
    real = pg._get_backend

    def _get_backend(self, device):
        if getattr(device, "type", device) == "npu":
            return _StandInBackend()
        return real(self, device)

    pg._get_backend = _get_backend
    from vllm_ascend.distributed.parallel_state import init_ascend_model_parallel

    init_ascend_model_parallel(vllm_config.parallel_config)
    _BOOTED = True


class _StandInBackend:
    def get_hccl_comm_name(self, rank: int) -> str:
        return "stand-in"


def build_and_load(directory: Path, dtype: str, mtp: bool = False) -> Any:
    """The engine's own path from a checkpoint directory to a model with its weights loaded; with `mtp`, the MTP
    drafter vLLM builds for speculative decoding (`speculative_config` method "mtp": the draft model config names
    DeepSeekMTPModel / Glm4MoeMTPModel, built with the target's config and loaded from the same directory)."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}} if mtp else {}
    args = EngineArgs(model=str(directory), quantization="ascend", load_format="safetensors", dtype=dtype,
                      enforce_eager=True, tensor_parallel_size=1, skip_tokenizer_init=True, max_model_len=256, **spec)
    vllm_config = args.create_engine_config()
    model_config = vllm_config.speculative_config.draft_model_config if mtp else vllm_config.model_config
    with set_current_vllm_config(vllm_config):
        init_parallel(vllm_config)
        # BaseModelLoader.load_model up to process_weights_after_loading (which runs NPU kernels)
        with set_default_torch_dtype(model_config.dtype):
            with torch.device("cpu"), _cpu_buffers():
                model = initialize_model(vllm_config=vllm_config, model_config=model_config)
            params = dict(model.named_parameters())
            ZERO_NORM_BIASES.clear()
            ZERO_NORM_BIASES.update(n for n, p in params.items() if _zero_norm_bias(model, n, p))
            for p in params.values():
                _fill_sentinel(p.data)
            get_model_loader(vllm_config.load_config).load_weights(model, model_config)
    return model, params


# DeepSeek's and GLM's MTP drafters (vllm/model_executor/models/deepseek_mtp.py and glm4_moe_mtp.py
# `_rewrite_spec_layer_name`, restated): an MTP layer's own modules keep their names, its decoder layer moves under
# `mtp_block`, its embed_tokens is the drafter's (shared) embedding; GLM's MTP layer, which stores neither, reads the
# main model's embed_tokens and lm_head (as shared_head.head). Qwen3-Next's block is stored as mtp.*, read as model.*
MTP_OWN = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")
LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def mtp_names(ck: dict[str, torch.Tensor], n_layers: int) -> dict[str, str]:
    """checkpoint name -> the drafter's name, for the MTP layers' tensors (and the main ones GLM's drafter reads)."""
    out: dict[str, str] = {}
    if any(n.startswith("mtp.") for n in ck):  # Qwen3-Next (qwen3_next_mtp.py::load_weights): mtp.* -> model.*,
        out = {n: "model." + n[len("mtp."):] for n in ck if n.startswith("mtp.")}  # the embedding and head shared
        out.update({n: n for n in ("model.embed_tokens.weight", "lm_head.weight") if n in ck})
        if "model.language_model.embed_tokens.weight" in ck:  # Qwen3.5's VL checkpoint (qwen3_5_mtp.py
            out["model.language_model.embed_tokens.weight"] = "model.embed_tokens.weight"  # remap_weight_names)
        return out
    first = None
    for name in ck:
        m = LAYER_RE.match(name)
        if not m or int(m[1]) < n_layers:
            continue
        layer, rest = int(m[1]), m[2]
        first = layer if first is None else min(first, layer)
        head = rest.split(".")[0]
        out[name] = f"model.{rest}" if head == "embed_tokens" else name if head in MTP_OWN else \
            f"model.layers.{layer}.mtp_block.{rest}"
    if first is not None and not any(n.endswith(".shared_head.head.weight") for n in out):
        out["lm_head.weight"] = f"model.layers.{first}.shared_head.head.weight"
        out["model.embed_tokens.weight"] = "model.embed_tokens.weight"
    return out


def vl_name(name: str) -> str:
    """A vision-language checkpoint's tensor (or description key) under the engine model's name (VL_PREFIXES)."""
    return next((new + name[len(old):] for old, new in VL_PREFIXES if name.startswith(old)), name)


#: RMSNorm biases the engine created as zeros (filled per model by build_and_load)
ZERO_NORM_BIASES: set[str] = set()


def _zero_norm_bias(model: Any, name: str, p: torch.Tensor) -> bool:
    """vLLM-Ascend gives every RMSNorm a zero `bias` parameter once any description key holds "norm.bias" (for
    msModelSlim's m4 anti-outlier biases; vllm_ascend/ops/layernorm.py AscendRMSNorm.__init__): DeepSeek-V3.2's
    indexer k_norm (a LayerNorm) has one. A norm the checkpoint gives no bias keeps those zeros, which is the
    norm without a bias; the check accepts exactly that: an RMSNorm's bias, all zeros as built, never written."""
    module = model.get_submodule(name.rsplit(".", 1)[0])
    return name.endswith(".bias") and type(module).__name__.endswith("RMSNorm") and not bool(p.data.any())


@contextlib.contextmanager
def _cpu_buffers():
    """Model construction with the platform's device type "cpu": DeepSeek-V3.2's model allocates its indexer's
    top-k buffer on `current_platform.device_type` explicitly (vllm/model_executor/models/deepseek_v2.py
    DeepseekV2Model.__init__), which on this host has no allocator. Loading never touches that buffer."""
    from vllm.platforms import current_platform

    real = current_platform.device_type
    current_platform.device_type = "cpu"
    try:
        yield
    finally:
        current_platform.device_type = real


def _fill_sentinel(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(False)
    else:
        t.fill_(torch.iinfo(t.dtype).min + 3)


def _checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included): the loader copies bytes, it never computes."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _destination(name: str, ck: dict[str, torch.Tensor], params: dict) -> tuple[str, Any] | None:
    """(parameter name, index into it) where the engine must put checkpoint tensor `name`, or None."""
    m = EXPERT_RE.match(name)
    if m and m["proj"] in EXPERT_SLOT:
        fused, half = EXPERT_SLOT[m["proj"]]
        pname = f"{m['moe']}.{fused}_{m['param']}"
        if pname not in params:
            return None
        e = int(m["e"])
        if half is None:
            return pname, (e,)
        rows = ck[name].shape[0]
        return pname, (e, slice(half * rows, (half + 1) * rows))
    module, _, param = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    if leaf in FA_PARAMS:
        pname = f"{parent}.{FA_ATTN}.{leaf}.{param}"
        return (pname, ()) if pname in params else None
    c8 = C8_SCALES.get(f"{leaf}.{param}")
    if c8 is not None:
        pname = f"{parent}.{c8}"
        return (pname, ()) if pname in params else None
    if leaf in STACKED:
        fused, idx = STACKED[leaf]
        pname = f"{parent}.{fused}.{param}"
        if pname not in params:
            return None
        if param in PER_TENSOR:
            return pname, ()
        start = sum(ck[f"{parent}.{s}.{param}"].shape[0] for s in STACK_ORDER[fused][:idx]
                    if f"{parent}.{s}.{param}" in ck)
        return pname, (slice(start, start + ck[name].shape[0]),)
    if name in params:
        return name, ()
    return None


def check(directory: Path, dtype: str | None = None, source: Path | None = None) -> dict:
    """Load `directory` with the engine and compare every tensor with the parameter part it must land in, then every
    written weight with its float source (written_source.py); a dict of counts and the problems found."""
    cfg = json.loads((directory / "config.json").read_text())
    dtype = dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    started = time.perf_counter()
    res: dict[str, Any] = {"dir": str(directory), "dtype": dtype, "loaded": False, "tensors": 0, "bit_exact": 0,
                           "after_cast": 0, "lossy": [], "mismatched": [], "unmapped": [], "unfilled": [], "source": [],
                           "error": None}
    try:
        boot()
        model, params = build_and_load(directory, dtype)
    except Exception as e:  # the engine refused the checkpoint: that IS the result
        res["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:400]
        res["error_type"], res["raised_in"] = type(e).__name__, raised_in(e, ("vllm_ascend", "vllm"))
        res["traceback"] = traceback.format_exc(limit=-4)
        res["seconds"] = round(time.perf_counter() - started, 2)
        return res
    res["loaded"] = True
    ck = _checkpoint(directory)
    desc_file = directory / "quant_model_description.json"
    desc = json.loads(desc_file.read_text()) if desc_file.exists() else {}
    n_layers = int((cfg.get("text_config") or cfg)["num_hidden_layers"])  # a VL config keeps it in text_config
    mtp = mtp_names(ck, n_layers)
    own = {n: t for n, t in ck.items() if not n.startswith("mtp.") and (LAYER_RE.match(n) is None or int(
        LAYER_RE.match(n)[1]) < n_layers)}
    if "vision_config" in cfg:
        own, own_desc = {vl_name(n): t for n, t in own.items()}, {vl_name(n): v for n, v in desc.items()}
    else:
        own_desc = desc
    _place(res, own, own_desc, params, tied=bool(cfg.get("tie_word_embeddings")))
    if mtp:  # the MTP layer's tensors, where the engine's drafter puts them
        try:
            _, draft = build_and_load(directory, dtype, mtp=True)
        except Exception as e:  # the engine's MTP path refused the checkpoint
            res["loaded"] = False
            res["error"] = f"MTP drafter: {type(e).__name__}: {e}".splitlines()[0][:400]
            res["error_type"], res["raised_in"] = type(e).__name__, raised_in(e, ("vllm_ascend", "vllm"))
            res["seconds"] = round(time.perf_counter() - started, 2)
            return res
        res["tensors"] -= sum(1 for n in mtp if n in own)  # the main tensors GLM's drafter reads, counted once
        _place(res, {mtp[n]: ck[n] for n in mtp}, {mtp[n]: desc.get(n) for n in mtp}, draft, tied=False,
               where="MTP drafter: ")
        res["mtp_tensors"] = len(mtp)
    from written_source import source_problems

    try:
        res["source"], res["clipped_max"], res["source_checked"] = source_problems(
            directory, ck, desc, dtype, source, engine_norm_offset(model))
    except Exception as e:  # noqa: BLE001 - the comparison's own failure is a failed check, not the batch's end
        res["source"], res["clipped_max"], res["source_checked"] = \
            [f"the comparison with the source failed: {type(e).__name__}: {e}"], 0.0, True
    if not res["source_checked"]:
        res["source"] = ["no float source to compare with: the manifest names none that exists (pass --source)"]
    res["seconds"] = round(time.perf_counter() - started, 2)
    return res


def _place(res: dict, ck: dict[str, torch.Tensor], desc: dict, params: dict, tied: bool, where: str = "") -> None:
    """Every tensor of `ck` compared with the part of the parameter it must land in; then every parameter element
    must have been claimed by some tensor (counts and problems into `res`)."""
    mix: set[str] = set()  # the engine modules holding W8A8_MIX linears
    claimed = {n: torch.zeros(p.shape, dtype=torch.bool) for n, p in params.items()}
    for name, t in sorted(ck.items()):
        res["tensors"] += 1
        dest = _destination(name, ck, params)
        if dest is None:
            res["unmapped"].append(where + name)
            continue
        pname, index = dest
        if desc.get(name) == "W8A8_MIX":
            mix.add(pname.rpartition(".")[0])
        got = params[pname].data[index] if index else params[pname].data
        if got.shape != t.shape and got.numel() == t.numel():
            got = got.reshape(t.shape)  # [n] vs [n, 1] scales: the same values
        if same_bytes(got, t):
            res["bit_exact"] += 1
        elif got.shape == t.shape and same_bytes(got, t.to(got.dtype)):
            res["after_cast"] += 1
            changed = int((t.to(got.dtype).to(t.dtype) != t).sum())  # values, so -0.0 -> 0 is no change
            if changed:  # the engine keeps another value than the one written
                res["lossy"].append(f"{where}{name}: {t.dtype} -> {got.dtype} changes {changed} of {t.numel()} values")
        else:
            res["mismatched"].append(f"{where}{name} -> {pname}{_fmt(index)}: {tuple(t.shape)} {t.dtype} vs "
                                     f"{tuple(got.shape)} {got.dtype}")
            continue
        if index:
            claimed[pname][index] = True
        else:
            claimed[pname][...] = True
    for pname, mask in claimed.items():
        if bool(mask.all()):
            continue
        if tied and pname == "lm_head.weight":
            continue  # the same tensor as the embedding (vLLM ties the parameter)
        if pname.endswith((".weight_scale", ".weight_offset")) and _static_w8a8(pname, params, mix):
            continue  # static W8A8 declares them for another format; nothing reads them for msModelSlim's
        if pname in ZERO_NORM_BIASES and not mask.any():
            continue  # the engine's own zeros: an RMSNorm with no bias in the checkpoint computes without one
        res["unfilled"].append(f"{where}{pname}: {int((~mask).sum())} of {mask.numel()} elements")


def engine_norm_offset(model: Any) -> float | None:
    """1.0 where the engine's own norms multiply by (1 + weight): vLLM's GemmaRMSNorm, which Gemma 3 and Qwen3-Next
    use (vllm/model_executor/models/qwen3_next.py imports it as Qwen3NextRMSNorm); else None (config.json decides)."""
    gemma = any(c.__name__.endswith("GemmaRMSNorm") for m in model.modules() for c in type(m).__mro__)
    return 1.0 if gemma else None


def _static_w8a8(pname: str, params: dict, mix: set[str]) -> bool:
    """A static W8A8 linear (it has deq_scale): vLLM-Ascend w8a8_static.py::get_perchannel_param declares
    weight_scale/weight_offset beside it, used only for compressed-tensors checkpoints (process_weights_after_loading
    reads them only when ascend_quant_method is compressed-tensors). Not a W8A8_MIX one: its prefill path
    (w8a8_dynamic.py) computes with weight_scale, so an unfilled one is a broken prefill instance."""
    module = pname.rpartition(".")[0]
    return module not in mix and module + ".deq_scale" in params


def _fmt(index: Any) -> str:
    if not index:
        return ""
    parts = [f"{i.start}:{i.stop}" if isinstance(i, slice) else str(i) for i in index]
    return "[" + ", ".join(parts) + "]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--dtype", default=None, help="model dtype (default: config.json's)")
    ap.add_argument("--json", type=Path, default=None, help="append one JSON line per directory")
    ap.add_argument("--source", type=Path, default=None, help="the float source (default: each manifest's input)")
    a = ap.parse_args()
    bad = 0
    for d in a.dirs:
        r = check(d, a.dtype, a.source)
        ok = r["loaded"] and not (r["mismatched"] or r["unmapped"] or r["unfilled"] or r["lossy"] or r["source"])
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {d.name}: " + (f"loaded, {r['tensors']} tensors: {r['bit_exact']} bit-exact, "
              f"{r['after_cast']} after cast ({len(r['lossy'])} lossy), {len(r['mismatched'])} mismatched, {len(r['unmapped'])} unmapped, "
              f"{len(r['unfilled'])} unfilled params ({r['seconds']} s)" if r["loaded"] else f"refused: {r['error']}"),
              flush=True)
        for k in ("lossy", "mismatched", "unmapped", "unfilled", "source"):
            for line in r[k][:8]:
                print(f"     {k}: {line}")
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps({k: v for k, v in r.items() if k != "traceback"}) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
