"""Memory bounded by a chunk or a row block, not by the largest tensor: the chunked and row-block paths
write exactly the bytes the whole-tensor paths wrote, and the MoE export's dense experts equal transformers'."""
from __future__ import annotations

import hashlib
import shutil
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dsconv.checkpoint import Checkpoint
from dsconv.io import tensorfile
from dsconv.io.passthrough import copy_tensor
from dsconv.io.digest import file_digest
from dsconv.io.writer import TensorSetWriter
from dsconv.quant.algorithms import schemes
from dsconv.tensors import TensorSpec, torch_dtype

pytestmark = [pytest.mark.cli]


# ---------------------------------------------------------------------------------------------- writer
def test_write_chunks_equals_write_and_hashes_in_order(tmp_path):
    a = torch.arange(3000, dtype=torch.float32).reshape(30, 100)
    b = torch.arange(77, dtype=torch.int8)
    c = torch.arange(1 << 21, dtype=torch.float32)  # 8 MB: chunks of >= 1 MB are hashed on the helper thread
    specs = [TensorSpec("a", "F32", (30, 100)), TensorSpec("b", "I8", (77,)), TensorSpec("c", "F32", (1 << 21,))]
    whole = TensorSetWriter(tmp_path / "w", specs, "m", 1 << 30)
    whole.write("a", a)
    whole.write("b", b)
    whole.write("c", c)
    want = whole.close()
    raw = a.numpy().tobytes()
    chunked = TensorSetWriter(tmp_path / "c", specs, "m", 1 << 30)
    chunked.write_chunks("a", (raw[i:i + 1000] for i in range(0, len(raw), 1000)), "F32", (30, 100))
    chunked.write_chunks("b", [b.numpy()[:10], b.numpy()[10:]])
    chunked.write_chunks("c", (c.numpy()[i:i + (3 << 18)] for i in range(0, 1 << 21, 3 << 18)))
    got = chunked.close()
    assert got == want and got["m.safetensors"]["blake3"] == file_digest(tmp_path / "c" / "m.safetensors")


def test_write_chunks_refuses_a_wrong_byte_count(tmp_path):
    ts = TensorSetWriter(tmp_path, [TensorSpec("a", "I8", (10,))], "m", 1 << 30)
    with pytest.raises(ValueError, match="9 bytes written"):
        ts.write_chunks("a", [b"x" * 9])
    ts2 = TensorSetWriter(tmp_path / "2", [TensorSpec("a", "I8", (10,))], "m", 1 << 30)
    with pytest.raises(ValueError, match="more than"):
        ts2.write_chunks("a", [b"x" * 6, b"x" * 6], "I8", (10,))


# ---------------------------------------------------------------------------------------------- pass-through
@pytest.fixture
def odd_checkpoint(tiny_model, tmp_path):
    """A tiny Llama rewritten with the embedding after a 6-byte tensor, so that it starts off any page boundary
    and chunk boundaries fall mid-tensor."""
    src = tiny_model("llama")
    ck = Checkpoint.open(src)
    tensors = {n: ck.load(n) for n in ck.names()}
    d = tmp_path / "odd"
    d.mkdir()
    (d / "config.json").write_text((src / "config.json").read_text())
    first = "model.norm.weight"
    order = {first: tensors[first], **{n: t for n, t in tensors.items() if n != first}}
    _save_in_order(order, d / "model.safetensors")
    return d, tensors


def _save_in_order(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors in the given order (save_file sorts by alignment, which would hide unaligned offsets)."""
    from dsconv.tensors import safetensors_dtype

    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": safetensors_dtype(t), "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))


@pytest.mark.parametrize("out_dtype", ["BF16", "F16", "F32"])
def test_passthrough_in_small_chunks_writes_the_whole_tensor_bytes(odd_checkpoint, tmp_path, out_dtype):
    d, tensors = odd_checkpoint
    name = "model.embed_tokens.weight"
    assert tensors[name].dtype == torch.float32  # tiny models are fp32: BF16/F16 are casts, F32 is a copy
    ck = Checkpoint.open(d)
    start = ck.info(name).start
    assert start % 4096 != 0
    spec = [TensorSpec(name, out_dtype, tuple(tensors[name].shape))]
    want_dir, got_dir = tmp_path / "want", tmp_path / "got"
    ts = TensorSetWriter(want_dir, spec, "m", 1 << 30)
    ts.write(name, tensors[name].to(torch_dtype(out_dtype)))
    ts.close()
    ts = TensorSetWriter(got_dir, spec, "m", 1 << 30)
    copy_tensor(ts.write_chunks, ck, name, out_dtype, chunk=4096)
    ts.close()
    assert (want_dir / "m.safetensors").read_bytes() == (got_dir / "m.safetensors").read_bytes()


def test_iter_bytes_chunks_are_bounded_and_cover_the_tensor(odd_checkpoint):
    d, tensors = odd_checkpoint
    ck = Checkpoint.open(d)
    name = "model.embed_tokens.weight"
    pieces = [bytes(p) for p in ck.iter_bytes(name, 8192)]
    assert len(pieces) > 3 and max(len(p) for p in pieces) <= 8192
    assert b"".join(pieces) == tensors[name].numpy().tobytes()


# ---------------------------------------------------------------------------------------------- row blocks
@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few rows and two threads even for small tensors: many blocks, out-of-order completion."""
    monkeypatch.setattr(schemes, "BLOCK_ELEMS", 3 * 64)
    monkeypatch.setattr(schemes, "THREAD_MIN_ELEMS", 1)


@pytest.mark.parametrize("group_size,bits", [(0, 8), (0, 4), (32, 4), (64, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_blocks_equal_whole_tensor_quantization(small_blocks, group_size, bits, dtype):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(37 if group_size == 0 else 38, 64, generator=g) * 0.05).to(dtype)
    w[3] = 0  # an all-zero row: scale 1.0
    want_q, want_s, _ = schemes.quantize_weight_per_group(w, group_size, bits)
    done = []
    blocks = list(schemes.iter_quantized_rows(w, bits, group_size, done=lambda a, b: done.append((a, b))))
    assert len(blocks) > 4 and all((e - s) % 2 == 0 for s, e, _, _ in blocks[:-1])
    assert [(s, e) for s, e, _, _ in blocks] == done
    assert np.array_equal(np.concatenate([q for _, _, q, _ in blocks]), want_q)
    assert np.array_equal(np.concatenate([s for _, _, _, s in blocks]), want_s)


def _quantize(model: Path, out: Path, scheme: str, group_size: int | None = None) -> dict:
    from dsconv.quant.plan.options import QuantOptions
    from dsconv.quant.stage import QuantRequest, run

    # DeepSeek's shared experts stay float for MindIE's weight-only types (it builds them in no such type)
    opts = QuantOptions(scheme=scheme, method="rtn", group_size=group_size if scheme == "w4a16" else None,
                        ignore=("shared_experts",))
    return run(QuantRequest(model, out, opts, force=True, progress=False)).summary


def _files(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if p.suffix == ".safetensors" or p.name.startswith("quant_model_description")}


@pytest.mark.parametrize("family,scheme", [("llama", "w8a16"), ("qwen3_moe", "w8a16"), ("llama", "w4a16"),
                                           ("mixtral", "w4a16"), ("deepseek_v3", "w8a16")])
def test_weight_only_quantize_with_tiny_chunks_and_blocks_writes_the_same_bytes(
        tiny_model, tmp_path, monkeypatch, family, scheme):
    model = tiny_model(family, dtype="bf16")
    _quantize(model, tmp_path / "default", scheme, 64)
    monkeypatch.setattr(tensorfile, "COPY_CHUNK", 4096)
    monkeypatch.setattr(schemes, "BLOCK_ELEMS", 2 * 64)
    monkeypatch.setattr(schemes, "THREAD_MIN_ELEMS", 1)
    _quantize(model, tmp_path / "small", scheme, 64)
    a, b = _files(tmp_path / "default"), _files(tmp_path / "small")
    assert a and a == b
    report_a = json.loads((tmp_path / "default" / "dsconv_manifest.json").read_text())["files"]
    report_b = json.loads((tmp_path / "small" / "dsconv_manifest.json").read_text())["files"]
    assert {k: v for k, v in report_a.items() if k.endswith(".safetensors")} == \
        {k: v for k, v in report_b.items() if k.endswith(".safetensors")}


def test_weight_only_matches_whole_tensor_reference(tiny_model, tmp_path):
    """The streamed linear equals quantize_weight + emit_linear on the whole tensor (the pre-streaming path)."""
    from safetensors import safe_open

    from dsconv.quant.formats.msmodelslim import LinearResult, emit_linear
    from dsconv.quant.plan.plan import make_plan
    from dsconv.quant.weights import quantize_weight

    model = tiny_model("llama", dtype="bf16")
    _quantize(model, tmp_path / "q", "w4a16", 64)
    ck = Checkpoint.open(model)
    plan = make_plan(ck, "w4a16", group_size=64)
    lp = next(iter(plan.linears.values()))
    q, scale = quantize_weight(lp, ck.load(lp.weight), plan, None, 0.0)
    want = dict(emit_linear(lp.module, lp.qtype, LinearResult(q=q, scale=scale), plan.deq_dtype))
    part = next((tmp_path / "q").glob("*.safetensors"))
    with safe_open(str(part), framework="np") as f:
        for name, arr in want.items():
            assert np.array_equal(f.get_tensor(name), np.asarray(arr)), name


_NO_TORCH = """
import json, sys
class NoTorch:  # any import of torch fails the run
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("the weight-only path imported torch")
sys.meta_path.insert(0, NoTorch())
from dsconv.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert not e.code, e.code
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
"""


@pytest.mark.parametrize("dtype", ["bf16", None])
def test_weight_only_quantize_never_imports_torch(tiny_model, tmp_path, dtype):
    """Its 2 s import was a sixth of a weight-only run (docs/performance.md): the same bytes with torch blocked."""
    import subprocess
    import sys

    model = tiny_model("deepseek_v3", dtype=dtype)
    args = ["quantize", "-m", str(model), "--scheme", "w8a16", "--method", "rtn", "--engine", "vllm-ascend",
            "--moe-scheme", "w8a8_dynamic", "--force"]
    from dsconv.cli import main
    with pytest.raises(SystemExit) as done:
        main([*args, "-o", str(tmp_path / "with")])
    assert not done.value.code
    res = subprocess.run([sys.executable, "-c", _NO_TORCH, *args, "-o", str(tmp_path / "without")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []
    assert _files(tmp_path / "with") == _files(tmp_path / "without")


# ---------------------------------------------------------------------------------------------- MoE export
@pytest.mark.parametrize("family,fused", [("qwen3_moe", False), ("deepseek_v3", False), ("mixtral", True),
                                          ("qwen2_moe", False)])
def test_dense_experts_equal_batched_mm_and_share_storage(tiny_model, family, fused):
    from dsconv.convert import hf_model
    from dsconv.model import torch_builder

    ck = Checkpoint.open(tiny_model(family, fused=fused))
    dense, report = hf_model.load_for_export(ck, "fp32")
    assert report["experts"]["blocks_split"] == len(ck.facts.moe_layers) and report["experts"]["blocks_batched_mm"] == 0
    ref, _ = torch_builder.build(ck, torch.float32, attn="eager", experts="batched_mm")
    # no copy: every parameter byte is the model's weights once (the per-expert views share the fused storage)
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in dense.parameters()}
    assert sum(storages.values()) == sum(p.numel() * 4 for p in ref.parameters())
    ids = torch.randint(0, ref.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ref(input_ids=ids).logits, dense(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    blocks = hf_model.experts_modules(dense, ck.family)
    assert len(blocks) == len(ck.facts.moe_layers)


def test_moe_graph_multiplies_per_expert_initializers(tiny_model, tmp_path):
    import onnx

    from dsconv.convert.onnx import export_onnx

    s = export_onnx(tiny_model("qwen3_moe"), tmp_path / "o")
    assert s["check"]["passed"]
    m = onnx.load(str(tmp_path / "o" / "model.onnx"))
    names = {t.name for t in m.graph.initializer}
    assert any(n.startswith("model.layers.0.mlp.experts.0.gate_proj.weight") for n in names), sorted(names)[:20]
    assert not any("gate_up_proj" in n for n in names)
    gathered = {i for node in m.graph.node if node.op_type == "Gather" for i in node.input[:1]}
    assert not gathered & {n for n in names if ".experts." in n}  # no per-token weight gathers
    # ATC computes TopK indices as int32: the routing must not compare them with int64 (E89999)
    from dsconv.atc.graph import read_model
    from dsconv.atc.preflight import check_mixed_int

    findings = check_mixed_int(read_model(tmp_path / "o" / "model.onnx"))
    assert [(f.rule, f.status) for f in findings] == [("mixed-int", "pass")], findings[:2]


# ---------------------------------------------------------------------------------------------- FP8 -> BF16
@pytest.fixture(scope="module")
def fp8_model(tiny_model, tmp_path_factory) -> Path:
    from dsconv.tiny import write_fp8_checkpoint

    out = tmp_path_factory.mktemp("fp8") / "model"
    write_fp8_checkpoint(tiny_model("deepseek_v3"), out, block=(16, 16), max_part_tensors=9)
    return out


def test_streamed_fp8_export_in_small_stripes_equals_whole_tensors(fp8_model, tmp_path, monkeypatch):
    from dsconv.convert import fp8

    fp8.export_safetensors(fp8_model, tmp_path / "whole", dtype="bf16", pipeline=True)  # whole tensors
    monkeypatch.setattr(fp8, "STRIPE_ROWS", 4)  # 4-row stripes inside 16-row blocks, two threads
    monkeypatch.setattr(tensorfile, "COPY_CHUNK", 4096)
    fp8.export_safetensors(fp8_model, tmp_path / "striped", dtype="bf16")
    for f in sorted((tmp_path / "whole").glob("*.safetensors")):
        assert (tmp_path / "striped" / f.name).read_bytes() == f.read_bytes(), f.name


def test_streamed_fp8_export_refuses_a_nan_scale_by_element(fp8_model, tmp_path):
    from safetensors.torch import load_file

    from dsconv.convert.fp8 import export_safetensors
    from dsconv.errors import UserError

    bad = tmp_path / "bad"
    shutil.copytree(fp8_model, bad)
    part = next(p for p in sorted(bad.glob("*.safetensors")) if any(k.endswith("_scale_inv") for k in load_file(p)))
    tensors = load_file(part)
    name = next(k for k in tensors if k.endswith("_scale_inv"))
    tensors[name][0, 0] = float("nan")
    _save_in_order(tensors, part)
    with pytest.raises(UserError, match=r"holds nan at element 0"):
        export_safetensors(bad, tmp_path / "o", dtype="bf16")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("dtype,bits", [("BF16", np.uint16), ("F16", np.uint16), ("F32", np.uint32)])
def test_first_nonfinite_on_bit_patterns(dtype, bits):
    from dsconv.io.passthrough import first_nonfinite

    t = torch.randn(1000).to(torch_dtype(dtype))
    raw = t.view({np.uint16: torch.int16, np.uint32: torch.int32}[bits]).numpy()
    assert first_nonfinite(raw, dtype) is None
    for value in (float("inf"), float("-inf"), float("nan")):
        u = t.clone()
        u[700] = value
        u[900] = value
        assert first_nonfinite(u.view({np.uint16: torch.int16, np.uint32: torch.int32}[bits]).numpy(), dtype) == 700
