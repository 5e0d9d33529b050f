"""`dsconv quantize --kv-cache int8`: the C8 cache scales, where they come from, where they go, and where they are
refused. The engines' own loaders are the judges elsewhere (tests/engine_check: vLLM-Ascend's loader fills
attn.k_cache_scale... for Qwen3; tests/engine_contract: both engines' readers); here: the numbers against an
independent reference - transformers' own DynamicCache filled by the whole model - and the CLI's contract."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.cli]

FAST = ["--calib-samples", "6", "--seq-len", "40"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from dsconv.bundled import calib_texts
    from dsconv.tiny import make_tiny, train_tokenizer

    tok = train_tokenizer(calib_texts(), vocab_size=384)
    root = tmp_path_factory.mktemp("c8models")
    return {f: make_tiny(f, root / f, dtype="bf16", tokenizer=tok) for f in ("qwen3", "llama", "qwen2_moe",
                                                                                "deepseek_v3")}


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    t = {}
    for f in sorted(out.glob("*.safetensors")):
        t.update(load_file(str(f)))
    return t


def _bf16_up(x: torch.Tensor) -> torch.Tensor:
    """The next bf16 value at or above each float32 (written here from the bit layout, not taken from dsconv)."""
    bits = x.float().numpy().view(np.uint32).astype(np.uint64)
    return torch.from_numpy(((bits + 0xFFFF) & 0xFFFF0000).astype(np.uint32).view(np.float32))


def test_scales_are_the_maxima_of_what_transformers_caches(models, run_cli, tmp_path):
    """Every scale is max |state| / 127 of the keys/values transformers' DynamicCache holds after a whole-model
    forward (post-rope, post-k_norm), over the same calibration tokens, per channel (heads outermost), rounded up
    onto bf16 - within one bf16 step, which the float32 layer-by-layer and whole-model forwards may straddle."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from dsconv.quant.calibrate.data import load_calib

    src, out = models["qwen3"], tmp_path / "q"
    r = run_cli(["quantize", "-m", src, "-o", out, "--bits", "8", "--kv-cache", "int8", "--engine", "vllm-ascend",
                 *FAST])
    assert r.code == 0, r.err
    calib = load_calib(None, AutoTokenizer.from_pretrained(src), 6, 40)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    kmax: dict[int, torch.Tensor] = {}
    vmax: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for ids in calib.samples:
            cache = DynamicCache(config=model.config)
            model(torch.tensor([ids]), cache=cache, use_cache=True)
            for i, layer in enumerate(cache.layers):
                for store, x in ((kmax, layer.keys), (vmax, layer.values)):  # [1, heads, seq, head_dim]
                    m = x[0].transpose(0, 1).reshape(x.shape[2], -1).abs().amax(0)
                    store[i] = m if i not in store else torch.maximum(store[i], m)
    got = _tensors(out)
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert desc["kv_cache_type"] == desc["kv_quant_type"] == "C8"
    for i in kmax:
        for proj, ref in (("k_proj", kmax[i]), ("v_proj", vmax[i])):
            name = f"model.layers.{i}.self_attn.{proj}.kv_cache_scale"
            scale = got[name]
            assert scale.dtype == torch.float32 and scale.shape == ref.shape
            assert torch.equal(scale.to(torch.bfloat16).float(), scale)  # the engine holds it in bf16 unchanged
            want = _bf16_up(ref / 127)
            assert torch.all((scale >= want / (1 + 2**-7)) & (scale <= want * (1 + 2**-7))), (name, scale, want)
            off = got[name.replace("scale", "offset")]
            assert off.shape == ref.shape and not off.any()
            assert desc[name] == desc[name.replace("scale", "offset")] == "C8"
    assert r.code == 0 and run_cli(["verify", out]).code == 0


def test_rtn_weights_are_unchanged_by_the_cache_scales(models, run_cli, tmp_path):
    """--kv-cache adds four tensors per layer and nothing else: the weight-only RTN output is otherwise the same
    bytes (the cache needs a calibration forward; the linears do not see it)."""
    src = models["llama"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_cli(["quantize", "-m", src, "-o", a, "--scheme", "w8a16", "--method", "rtn"]).code == 0
    r = run_cli(["quantize", "-m", src, "-o", b, "--scheme", "w8a16", "--method", "rtn", "--kv-cache", "int8",
                 *FAST])
    assert r.code == 0, r.err
    ta, tb = _tensors(a), _tensors(b)
    extra = sorted(set(tb) - set(ta))
    assert extra == sorted(f"model.layers.{i}.self_attn.{p}_proj.kv_cache_{x}" for i in range(2) for p in "kv"
                           for x in ("scale", "offset"))
    assert all(torch.equal(ta[n], tb[n]) for n in ta)


def test_awq_sees_the_cache_before_its_own_passes(models, run_cli, tmp_path):
    """--method awq replaces the statistics pass with its probe; the cache is measured by a float pass of its own,
    so its scales equal those of a run whose statistics pass measured them."""
    src = models["llama"]
    a, b = tmp_path / "rtn", tmp_path / "awq"
    common = ["--scheme", "w8a16", "--kv-cache", "int8", "--engine", "mindie", *FAST]
    assert run_cli(["quantize", "-m", src, "-o", a, "--method", "rtn", *common]).code == 0
    r = run_cli(["quantize", "-m", src, "-o", b, "--method", "awq", *common])
    assert r.code == 0, r.err
    ta, tb = _tensors(a), _tensors(b)
    names = [n for n in ta if "kv_cache" in n]
    assert len(names) == 8 and all(torch.equal(ta[n], tb[n]) for n in names)


@pytest.mark.parametrize("family,args,says", [
    ("llama", ["--engine", "vllm-ascend"], "not loaded for llama models"),          # KeyError in its loader
    ("qwen2_moe", ["--engine", "vllm-ascend"], "not loaded for qwen2_moe models"),  # scales silently unset
    ("qwen2_moe", ["--engine", "mindie"], "not loaded for qwen2_moe models"),       # not wired in the MoE models
    ("qwen3", ["--engine", "mindie", "--scheme", "w8a8_dynamic"], "pairs with W8A16 / W8A8 linears"),
    ("deepseek_v3", [], "caches an MLA latent"),
])
def test_refused_where_the_engine_would_not_use_it(models, run_cli, tmp_path, family, args, says):
    args = args if "--scheme" in args else [*args, "--bits", "8"]
    r = run_cli(["quantize", "-m", models[family], "-o", tmp_path / "o", "--kv-cache", "int8", *args, *FAST])
    assert r.code == 2 and says in r.err, r.err
    assert len(r.err.strip().splitlines()) <= 2 and "Traceback" not in r.err
    assert not (tmp_path / "o").exists()


def test_float32_models_are_refused(tiny_model, run_cli, tmp_path):
    src = tiny_model("qwen3")  # float32 weights
    r = run_cli(["quantize", "-m", src, "-o", tmp_path / "o", "--bits", "8", "--kv-cache", "int8", *FAST])
    assert r.code == 2 and "needs fp16 or bf16 weights" in r.err, r.err


def test_shard_counts_the_cache_in_int8(models, run_cli, tmp_path):
    """A C8 output's KV cache is budgeted at one byte per element unless --kv-bits says otherwise."""
    src = models["qwen3"]
    c8, plain = tmp_path / "c8", tmp_path / "plain"
    assert run_cli(["quantize", "-m", src, "-o", c8, "--bits", "8", "--kv-cache", "int8", *FAST]).code == 0
    assert run_cli(["quantize", "-m", src, "-o", plain, "--bits", "8", *FAST]).code == 0

    def kv(model: Path, *extra: str) -> int:
        r = run_cli(["shard", "-m", model, "--tp", "2", "--dry-run", "--json", *extra])
        assert r.code == 0, r.err
        return json.loads(r.out)["memory"]["kv_bytes_per_token"]

    assert kv(c8) * 2 == kv(plain) == kv(c8, "--kv-bits", "16")
    for model, cache in ((c8, "int8"), (plain, "bf16")):
        r = run_cli(["inspect", "-m", model, "--json"])
        assert r.code == 0 and json.loads(r.out)["kv_cache"] == cache
    dry = run_cli(["quantize", "-m", src, "--bits", "8", "--kv-cache", "int8", "--dry-run", "--json"])
    assert json.loads(dry.out)["kv_cache"] == {"type": "C8", "layers": 2, "channels": 2 * 2 * 32}


def test_shard_splits_the_cache_scales_with_their_heads(models, run_cli, tmp_path):
    """TP 2 over 2 KV heads: each rank holds its head's k/v channels of every cache tensor, as k_proj's rows."""
    src, out, sh = models["qwen3"], tmp_path / "q", tmp_path / "s"
    assert run_cli(["quantize", "-m", src, "-o", out, "--bits", "8", "--kv-cache", "int8", *FAST]).code == 0
    r = run_cli(["shard", "-m", out, "-o", sh, "--tp", "2", "--format", "ranks"])
    assert r.code == 0, r.err
    whole = _tensors(out)
    for rank in range(2):
        part = _tensors(sh / f"rank_{rank:02d}")
        names = [n for n in whole if "kv_cache" in n]
        assert len(names) == 8
        for name in names:
            half = whole[name].shape[0] // 2
            assert torch.equal(part[name], whole[name][rank * half:(rank + 1) * half]), name


def test_description_check_knows_c8():
    from dsconv.quant.formats.msmodelslim import check_description

    tensors = {"a.k_proj.kv_cache_scale": ("F32", (4,)), "a.k_proj.weight": ("BF16", (4, 4))}
    ok = {"model_quant_type": "FLOAT", "version": "1.0.0", "group_size": 0, "a.k_proj.kv_cache_scale": "C8",
          "a.k_proj.weight": "FLOAT"}
    assert check_description(ok, tensors) == []
    bad = {**ok, "a.k_proj.weight": "C8"}
    assert any("C8 is the type of the KV-cache tensors" in p for p in check_description(bad, tensors))


def test_eval_passes_the_cache_through_int8(models, run_cli, tmp_path):
    """`dsconv eval` of a C8 output rounds every key and value with the stored scales: the same output with its
    scales coarsened 32x scores clearly worse, and the C8 output scores below the one without the int8 cache."""
    import shutil

    from safetensors.torch import save_file

    src, out = models["qwen3"], tmp_path / "q"
    assert run_cli(["quantize", "-m", src, "-o", out, "--bits", "8", "--kv-cache", "int8", *FAST]).code == 0
    plain = tmp_path / "plain"
    assert run_cli(["quantize", "-m", src, "-o", plain, "--bits", "8", *FAST]).code == 0

    def kl(d: Path) -> float:
        r = run_cli(["eval", "-m", src, "-q", d, "--samples", "8", "--json"])
        assert r.code == 0, r.err
        return json.loads(r.out)["kl_divergence"]

    def rescaled(factor: float) -> Path:
        d = tmp_path / f"x{factor}"
        shutil.copytree(out, d)
        (f,) = sorted(d.glob("*.safetensors"))
        t = _tensors(d)
        for n in t:
            if n.endswith("kv_cache_scale"):
                t[n] = t[n] * factor
        save_file(t, str(f), metadata={"format": "pt"})
        (d / "dsconv_manifest.json").unlink()
        return d

    base, none, coarse = kl(out), kl(plain), kl(rescaled(32.0))
    assert coarse > 3 * base and base > none, (none, base, coarse)
