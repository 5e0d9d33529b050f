"""Rotation (dsconv/quant/rotate.py, quant/algorithms/hadamard.py): the Hadamard constructions, the fast transform
against the dense matrix, and the rotated float model against the original on every family it applies to - the
same logits within float noise, before any rounding - then `quantize --rotate` end to end and its refusals."""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import hf_from_pretrained
from dsconv.quant.algorithms.hadamard import Rotation, hadamard
from dsconv.tiny import FAMILIES

pytestmark = pytest.mark.cli
REFUSED = {"gemma3": "post_attention_layernorm", "granitemoe": "not quantized for an engine", "qwen3_5_moe": "vision tower"}


@pytest.mark.parametrize("n", [1, 2, 12, 20, 28, 64, 640, 896, 1536])
def test_hadamard_orders_of_real_widths(n):
    """2^k times 1, 2 or a Paley order: Qwen2.5-0.5B's 896 = 32 x 28 (Paley II, q = 13), Gemma-3's 640 = 32 x 20
    (Paley I, q = 19), 1536 = 128 x 12."""
    h = hadamard(n)
    assert h is not None and set(h.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=h.dtype))


@pytest.mark.parametrize("n", [28, 896, 100])
def test_fast_transform_is_the_matrix(n):
    """x @ Q by butterflies and the small Paley factor equals the dense product; Q is orthogonal; no Hadamard of
    order 100 (25 has no construction) gives a seeded random orthogonal matrix."""
    r = Rotation(n, seed=5)
    q = r.matrix().double()
    assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-6)
    x = torch.randn(7, n)
    assert torch.allclose(r.right(x).double(), x.double() @ q, atol=1e-4)
    if n != 100:
        assert r.kind == "hadamard" and torch.allclose(q.abs(), torch.full_like(q, 1 / math.sqrt(n)), atol=1e-6)
    else:
        assert r.kind == "random orthogonal"
    assert torch.equal(Rotation(n, seed=5).matrix(), r.matrix()) and not torch.equal(Rotation(n, seed=6).matrix(),
                                                                                      r.matrix())


@pytest.mark.parametrize("family", FAMILIES)
def test_rotated_model_computes_the_same_function(family, tiny_model, run_cli, tmp_path):
    """Norms folded, the residual rotated: transformers' own model of the rotated checkpoint gives the original's
    logits within float noise (fp32; no rounding anywhere), and the activations entering the layers are rotated."""
    tied = family in ("qwen2", "llama")
    src = tiny_model(family, tie_word_embeddings=tied) if tied else tiny_model(family)
    out = tmp_path / "rot"
    r = run_cli(["rotate", "-m", src, "-o", out, "--seed", "3", "--json"])
    if family in REFUSED:
        assert r.code == 2 and REFUSED[family] in r.err and "Traceback" not in r.err and not out.exists()
        return
    assert r.code == 0, r.err
    summary = json.loads(r.out)
    assert summary["rotation"] == "hadamard" and summary["untied"] == tied and summary["folded"] >= 5
    # v -> o per head, except through MLA's kv_b and Qwen3-Next's gated attention output
    assert (summary["head_rotation"] is None) == (family in ("deepseek_v3", "deepseek_v32", "kimi_k2", "qwen3_next"))
    a, b = (hf_from_pretrained(d, dtype=torch.float32).eval() for d in (src, out))
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
        ea, eb = a.get_input_embeddings()(ids), b.get_input_embeddings()(ids)
    assert (la - lb).abs().max() <= 2e-5 * max(1.0, float(la.abs().max())) * 10, float((la - lb).abs().max())
    assert not torch.allclose(ea, eb, atol=1e-3)  # the stream itself is rotated
    assert torch.allclose(ea.norm(dim=-1), eb.norm(dim=-1), rtol=1e-4)  # ... by an orthogonal matrix
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and (b.get_output_embeddings().weight is not
                                                    b.get_input_embeddings().weight)


def test_quantize_rotate_end_to_end(tiny_model, run_cli, tmp_path):
    """`quantize --rotate`: the rotated scratch is quantized and removed; the manifest names the model given and the
    seed; every norm is written as ones (folded; no SmoothQuant here to scale them again); eval compares the output
    with the original float model."""
    from dsconv.bundled import calib_texts
    from dsconv.tiny import make_tiny, train_tokenizer

    src = make_tiny("qwen2", tmp_path / "src", dtype="bf16", tie_word_embeddings=True,
                    tokenizer=train_tokenizer(calib_texts(), vocab_size=384))
    q = tmp_path / "q"
    r = run_cli(["quantize", "-m", src, "-o", q, "--bits", "8", "--recipe", "uniform", "--fallback", "0", "--rotate",
                 "7", "--smooth-quant", "off", "--calib-samples", "8", "--seq-len", "64", "--json"])
    assert r.code == 0, r.err
    assert json.loads(r.out)["rotation"]["seed"] == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "src"]  # no scratch left
    manifest = json.loads((q / "dsconv_manifest.json").read_text())
    assert manifest["inputs"] == [str(src)] and manifest["options"]["rotate"] == 7
    from dsconv.checkpoint import Checkpoint

    out = Checkpoint.open(q)
    norms = [n for n in out.names() if out.role(n).role.value == "norm"]
    assert norms and all(bool((out.load(n) == 1).all()) for n in norms)
    assert "lm_head.weight" in out.tensors
    r = run_cli(["eval", "-m", src, "-q", q, "--samples", "2", "--seq-len", "64", "--json"])
    assert r.code == 0, r.err
    assert json.loads(r.out)["kl_divergence"] < 0.05


def test_rotate_refusals_before_any_work(tiny_model, run_cli, tmp_path):
    """An MTP layer (two streams into eh_proj) is refused before anything is written; so is what the engine would not
    load (the plan's refusals run on the user's model first, naming it, and leave no scratch behind); 4-bit weights
    get the measured warning."""
    from dsconv.tiny import add_mtp_layer
    from conftest import copy_model

    d = copy_model(tiny_model("deepseek_v3"), tmp_path / "ds")
    add_mtp_layer(d)
    r = run_cli(["quantize", "-m", d, "-o", tmp_path / "q", "--bits", "8", "--rotate"])
    assert r.code == 2 and "MTP" in r.err and not (tmp_path / "q").exists()
    r = run_cli(["quantize", "-m", tiny_model("qwen3_moe"), "-o", tmp_path / "q2", "--scheme", "w8a8", "--engine",
                 "vllm-ascend", "--rotate"])
    assert r.code == 2 and "W8A8" in r.err
    assert not list(tmp_path.glob(".q2*")) and not (tmp_path / "q2").exists()
    r = run_cli(["quantize", "-m", tiny_model("llama"), "-o", tmp_path / "q3", "--bits", "8", "--rotate"])
    assert r.code == 2 and "model dtype fp32" in r.err and str(tiny_model("llama")) in r.err and ".dsconv-rotated" not in r.err
    r = run_cli(["quantize", "-m", tiny_model("llama", dtype="bf16"), "-o", tmp_path / "q4", "--scheme", "w4a16",
                 "--group-size", "64", "--method", "rtn", "--rotate"])
    assert r.code == 0 and "made W4A16 and W4A8 worse" in r.err, r.err
