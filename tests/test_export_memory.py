"""Memory behaviour of the exports: the ONNX writer never copies a whole transposed weight, the export's
torch model is filled from checkpoint views whose pages leave the process, the FP8 cast jobs stream every tensor in
stripes, and `--workers` says so when a format does not use it."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.cli]


# ---- ONNX: transposed weights in blocks ------------------------------------------------------------------------
def test_transposed_weight_is_written_in_blocks_of_the_scratch():
    from dsconv.convert.onnx_graph import Weight

    src = torch.arange(100 * 37, dtype=torch.float32).reshape(100, 37)
    w = Weight("x.T", src, (1, 0))
    scratch = torch.empty(1000, dtype=torch.uint8)  # 2 rows of the [37, 100] result per block
    blocks = []
    for b in w.chunks(scratch):
        assert np.shares_memory(np.frombuffer(b, dtype=np.uint8), scratch.numpy())  # never a fresh copy
        blocks.append(bytes(b))
    assert len(blocks) == 19
    assert b"".join(blocks) == w.data().numpy().tobytes()
    plain = Weight("y", src)
    (only,) = list(plain.chunks(scratch))
    assert np.shares_memory(np.frombuffer(only, dtype=np.uint8), src.numpy())  # its own memory, no copy


def test_onnx_bytes_do_not_depend_on_the_block_size(tiny_model, tmp_path, monkeypatch):
    from dsconv.convert import onnx_graph
    from dsconv.convert.onnx import export_onnx

    model = tiny_model("qwen2")
    export_onnx(model, tmp_path / "a", progress=False, external_data_threshold=0)
    monkeypatch.setattr(onnx_graph, "BLOCK", 512)  # every transposed weight now takes many blocks
    export_onnx(model, tmp_path / "b", progress=False, external_data_threshold=0)
    for name in ("model.onnx", "model.onnx_data"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


# ---- ONNX: the torch model from views ---------------------------------------------------------------------------
def _mapped_rss_kb(path: Path) -> int:
    """This process's resident pages of the mappings of `path` (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.parametrize("family,fused", [("qwen3_moe", True), ("llama", False)])
def test_export_model_from_views_equals_the_builder_and_drops_pages(tiny_model, family, fused):
    from dsconv.checkpoint import Checkpoint
    from dsconv.convert import hf_model
    from dsconv.model import torch_builder

    # MB-sized tensors: the kernel maps whole page-cache folios around a fault, which on KB-sized tensors maps
    # most of the file whatever is released
    big = dict(hidden_size=512, intermediate_size=1024, vocab_size=320)
    if fused:
        big.update(moe_intermediate_size=1024, num_experts=4)
    root = tiny_model(family, fused=fused, dtype="bf16", **big)
    with Checkpoint.open(root) as ck:
        model, report = hf_model.load_for_export(ck, "fp32")
        files = sorted(set(i.file for i in ck.tensors.values()))
        left = sum(_mapped_rss_kb(f) for f in files) * 1024
        stored = sum(i.nbytes for i in ck.tensors.values())
        assert left < stored / 4, (left, stored)  # 8% here; every page stayed before the views were released
        with hf_model.quiet_transformers():
            ref, unused = torch_builder.build(ck, torch.float32, attn="eager",
                                              experts=hf_model.register_dense_experts() if fused else None)
        if fused:
            hf_model.split_experts(ref, ck.family)
    assert report["unused_tensors"] == unused
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


# ---- FP8 cast jobs stream --------------------------------------------------------------------------------------
def test_cast_jobs_stream_fp8_weights_in_stripes(tiny_model, tmp_path, monkeypatch):
    from dsconv.checkpoint import Checkpoint
    from types import SimpleNamespace

    from dsconv.convert import cast_parts, fp8
    from dsconv.executor import Executor
    from dsconv.io.writer import OutputDir
    from dsconv.tiny import write_fp8_checkpoint

    src = write_fp8_checkpoint(tiny_model("deepseek_v3", intermediate_size=512), tmp_path / "fp8", block=(16, 16))
    loaded: list[str] = []
    original_load = cast_parts._ByPath.load

    def recording_load(self, name, dequantize=False):
        loaded.append(name)
        return original_load(self, name, dequantize)

    monkeypatch.setattr(cast_parts._ByPath, "load", recording_load)
    chunks: dict[str, list[int]] = {}

    def recording_write(write_chunks, ck, t, threads=2):
        def sink(name, pieces):
            sizes = chunks.setdefault(name, [])

            def counted():
                for p in pieces:
                    sizes.append(np.asarray(p).nbytes if isinstance(p, np.ndarray) else memoryview(p).nbytes)
                    yield p
            write_chunks(name, counted())
        return fp8.write_converted(sink, ck, t, threads)

    with Checkpoint.open(src) as ck, OutputDir(tmp_path / "out", stage="safetensors") as out:
        plan = fp8.plan_rewrite(ck, "bf16")
        sets = {}
        for part in plan.parts:
            from dsconv.tensors import TensorSpec

            specs = [TensorSpec(t.name, t.out_dtype, t.shape) for t in part.tensors]
            sets[part.file] = out.tensor_set(specs, prefix=part.file[:-len(".safetensors")],
                                             max_shard_size=sum(s.nbytes for s in specs) + 1)
        jobs = cast_parts.cast_jobs(ck, plan, sets, 1, recording_write)
        cast_parts.run_cast_jobs(Executor(1), jobs, sets, SimpleNamespace(update=lambda n: None))
        big = next(t for t in plan.tensors if t.action == "dequantize" and t.shape[0] == 512)
    fp8_names = {t.name for t in plan.tensors if t.action == "dequantize"}
    assert fp8_names and not fp8_names & set(loaded)  # FP8 weights are read from views, never loaded whole
    stripe = fp8.STRIPE_ROWS * big.shape[1] * 2
    assert len(chunks[big.name]) == 512 // fp8.STRIPE_ROWS and max(chunks[big.name]) <= stripe


def test_cast_job_output_equals_the_whole_tensor_path(tiny_model, tmp_path):
    from dsconv.convert.fp8 import export_safetensors
    from dsconv.executor import ExecOptions
    from dsconv.tiny import write_fp8_checkpoint

    src = write_fp8_checkpoint(tiny_model("deepseek_v3", intermediate_size=512), tmp_path / "fp8", block=(16, 16),
                               max_part_tensors=9)
    export_safetensors(src, tmp_path / "jobs", progress=False, execution=ExecOptions(workers=2))
    export_safetensors(src, tmp_path / "whole", progress=False, pipeline=True)
    files = sorted(p.name for p in (tmp_path / "whole").glob("*.safetensors"))
    assert len(files) >= 2
    for f in files:
        assert (tmp_path / "jobs" / f).read_bytes() == (tmp_path / "whole" / f).read_bytes(), f


# ---- --workers where it does nothing -----------------------------------------------------------------------------
def test_workers_with_onnx_says_it_is_not_used(tiny_model, tmp_path, run_cli):
    model = tiny_model("qwen2")
    r = run_cli(["export", "-m", str(model), "-o", str(tmp_path / "o"), "--format", "onnx", "--workers", "2"])
    assert r.code == 0, r.err
    notes = [line for line in r.err.splitlines() if "--workers" in line]
    assert len(notes) == 1 and "not used" in notes[0] and "--format onnx" in notes[0]
    r = run_cli(["export", "-m", str(model), "-o", str(tmp_path / "s"), "--format", "safetensors", "--workers", "2"])
    assert r.code == 0 and "not used" not in r.err
