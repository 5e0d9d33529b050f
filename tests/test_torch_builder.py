"""The one torch-model builder (dsconv/model/torch_builder.py) against transformers' own `from_pretrained`.

Export traces whatever the builder returns, so "the same model" must hold exactly: the same class, the same config,
the same parameter and buffer names, dtypes and values (tied weights tied), for every family, both MoE layouts, each
export dtype, and FP8 checkpoints (dequantized in-stream, no scratch copy)."""
from __future__ import annotations

import pytest
import torch

from dsconv.checkpoint import Checkpoint
from dsconv.errors import UserError
from dsconv.model import torch_builder
from dsconv.tiny import FAMILIES, MOE_FAMILIES
from conftest import hf_from_pretrained

pytestmark = pytest.mark.cli

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def reference(model_dir, dtype, experts):
    """transformers' own loading (conftest.hf_from_pretrained)."""
    kwargs = {"experts_implementation": experts} if experts else {}
    return hf_from_pretrained(model_dir, dtype=dtype, attn_implementation="eager", **kwargs)


def assert_same_model(got, want):
    assert type(got) is type(want)
    assert got.config.to_dict() == want.config.to_dict()
    g, w = got.state_dict(keep_vars=True), want.state_dict(keep_vars=True)
    assert list(g) == list(w)
    for name in w:
        assert g[name].dtype == w[name].dtype, name
        assert torch.equal(g[name], w[name]), name
    gb, wb = dict(got.named_buffers()), dict(want.named_buffers())
    assert list(gb) == list(wb)
    for name in wb:
        assert torch.equal(gb[name], wb[name]), name
    emb, head = got.get_input_embeddings(), got.get_output_embeddings()
    if got.config.tie_word_embeddings:
        assert head.weight is emb.weight


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_builder_equals_from_pretrained(tiny_model, family, dtype):
    d = tiny_model(family, fused=family in ("mixtral", "qwen2_moe"), dtype="bf16")
    experts = "batched_mm" if family in MOE_FAMILIES else None
    with Checkpoint.open(d) as ck:
        model, unused = torch_builder.build(ck, DTYPES[dtype], experts=experts)
    assert unused == []
    assert_same_model(model, reference(d, DTYPES[dtype], experts))


def test_tied_and_fp16(tiny_model):
    d = tiny_model("qwen2", tie_word_embeddings=True)
    with Checkpoint.open(d) as ck:
        model, _ = torch_builder.build(ck, torch.float16)
    assert_same_model(model, reference(d, torch.float16, None))


def test_fp8_is_dequantized_in_stream(tiny_model, tmp_path):
    """FP8 weights come out of the reader dequantized straight to the target dtype; nothing is written to disk."""
    from dsconv.checkpoint import dequant_fp8_block
    from dsconv.tiny import write_fp8_checkpoint

    src = write_fp8_checkpoint(tiny_model("deepseek_v3"), tmp_path / "fp8", block=(16, 16), max_part_tensors=9)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with Checkpoint.open(src) as ck:
        model, unused = torch_builder.build(ck, torch.float32, experts="batched_mm")
        name = "model.layers.0.self_attn.kv_b_proj.weight"
        want = dequant_fp8_block(ck.load(name), ck.load(name + "_scale_inv"), (16, 16), out_dtype=torch.float32)
    assert unused == []
    assert torch.equal(model.get_parameter(name), want)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_missing_tensor_is_an_error(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    from conftest import copy_model

    d = copy_model(tiny_model("llama"), tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="up_proj.weight is missing"):  # Checkpoint.open's inventory check sees it
        with Checkpoint.open(d) as ck:
            torch_builder.build(ck, torch.float32)


@pytest.mark.parametrize("family", ["deepseek_v3", "llama"])
def test_the_layer_forward_runs_transformers_sdpa(tiny_model, family, monkeypatch):
    """The skeleton's attention (model/attention.py) is transformers' SDPA. MLA's value heads (DeepSeek-V3: 16 wide
    here, keys 24) reach torch padded to the key width, which lets the CPU flash kernel take them: the logits equal
    plain SDPA's to float32 rounding. One head width (Llama) is passed through untouched: bit for bit."""
    from dsconv.model import attention
    from dsconv.runner.layers import load_full_model

    model, _ = load_full_model(Checkpoint.open(tiny_model(family)))
    assert model.config._attn_implementation == attention.NAME
    widths = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        widths.append((k.shape[-1], v.shape[-1]))
        return sdpa(q, k, v, *args, **kwargs)

    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), monkeypatch.context() as m:
        m.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        ours = model(ids).logits
        model.set_attn_implementation("sdpa")
        plain = model(ids).logits
    n = model.config.num_hidden_layers
    assert all(k == v for k, v in widths[:n])  # ours: one width
    mla = family == "deepseek_v3"
    assert all((k != v) == mla for k, v in widths[n:])  # plain SDPA: MLA's narrower values
    if mla:
        torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(ours, plain)
