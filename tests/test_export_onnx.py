"""`dsconv export` (ONNX): every family exported and proven equal to PyTorch, KV cache (MLA latent for DeepSeek),
MoE routing variety, external data, opsets, and the error paths (exit 2 / exit 3, nothing written).

The export's own check compares onnxruntime with the traced wrapper; these tests also compare the written files
with transformers used independently (its default sdpa attention and grouped_mm experts, its own DynamicCache)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from dsconv.convert import tolerance
from dsconv.convert.onnx import export_onnx
from dsconv.errors import CheckFailed
from dsconv.tiny import FAMILIES
from conftest import hf_from_pretrained

# granitemoe (False): Granite's own 3-D input_linear/output_linear experts on disk
CASES = [("llama", False), ("qwen2", False), ("qwen3", False), ("qwen2_moe", True), ("qwen3_moe", False),
         ("mixtral", True), ("deepseek_v3", False), ("gemma3", False), ("granitemoe", False), ("glm4_moe", True),
         ("kimi_k2", False)]
MOE = {"qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "granitemoe", "glm4_moe", "kimi_k2"}
# families whose graph ONNX cannot express: refused with the reason before any work (test below)
REFUSED = {"deepseek_v32": "scatter", "qwen3_next": "solve_triangular", "qwen3_5_moe": "solve_triangular"}


pytestmark = [pytest.mark.cli, pytest.mark.usefixtures("one_torch_thread")]


def session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def hf_model(model_dir: Path, dtype=torch.float32):
    """transformers' model with its default implementations (not the ones the export uses)."""
    return hf_from_pretrained(model_dir, dtype=dtype)


def gen_positions(mask: np.ndarray) -> np.ndarray:
    pos = np.cumsum(mask, -1) - 1
    pos[mask == 0] = 1
    return pos


def left_padded(vocab: int, seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(2, 6), dtype=np.int64)
    mask = np.ones((2, 6), dtype=np.int64)
    mask[0, :2] = 0
    return ids, mask


@pytest.fixture(scope="module")
def exported(tiny_model, tmp_path_factory):
    """family/layout -> (model dir, output dir, summary), default options (fp32, opset 14)."""
    out = {}
    for family, fused in CASES:
        d = tiny_model(family, fused=fused)
        o = tmp_path_factory.mktemp("onnx") / f"{family}-{int(fused)}"
        out[(family, fused)] = (d, o, export_onnx(d, o))
    return out


@pytest.mark.parametrize("family,fused", CASES)
def test_every_family_exports_and_matches_transformers(exported, family, fused):
    model_dir, out, summary = exported[(family, fused)]
    check = summary["check"]
    assert check["passed"] and check["worst"]["max_abs_err"] < 1e-4
    # the default bound: from the reference's own float32 noise (against float64), passed with a margin
    assert check["rule"] == "noise" and summary["atol"] is None and 0 < check["noise"]["logits"] < 1e-5
    assert check["bound"]["logits"] == pytest.approx(tolerance.bound(check["noise"]["logits"],
                                                                     check["max_abs_ref"]["logits"]))
    assert check["max_abs_err"]["logits"] <= check["bound"]["logits"] and check["margin"] > 3
    assert len(check["cases"]) >= 3
    assert {c["tokens"] for c in check["cases"]} >= {1, 9, 33}
    assert any(c["batch"] > 1 for c in check["cases"])
    # the file itself: opset 14, documented names, dynamic batch and sequence, int64 index math only
    m = onnx.load(str(out / "model.onnx"))
    assert next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) == 14
    assert [i.name for i in m.graph.input] == ["input_ids", "attention_mask"]
    assert m.graph.output[0].name == "logits"
    assert all(i.type.tensor_type.elem_type == onnx.TensorProto.INT64 for i in m.graph.input)
    dims = [d.dim_param for d in m.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch_size", "sequence_length"]
    assert summary["integer_types"] == ["int64"]
    inferred = onnx.shape_inference.infer_shapes(m)
    elem = {v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    assert onnx.TensorProto.INT32 not in elem
    assert (out / "dsconv_manifest.json").is_file() and (out / "config.json").is_file()
    info = json.loads((out / "export_info.json").read_text())
    assert info["check"]["passed"] and info["io"]["inputs"][0]["name"] == "input_ids"
    # independent: transformers' default implementations on a left-padded batch, logits at real tokens
    ref_model = hf_model(model_dir)
    ids, mask = left_padded(ref_model.config.vocab_size)
    with torch.no_grad():
        want = ref_model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                         position_ids=torch.from_numpy(gen_positions(mask))).logits.numpy()
    got = session(out / "model.onnx").run(["logits"], {"input_ids": ids, "attention_mask": mask})[0]
    assert np.abs(got - want)[mask == 1].max() < 1e-4
    if family in MOE:
        moe = check["moe"]
        assert moe["routing_differs"] and moe["distinct_sets"] >= 2
        assert len(set(moe["experts_hit_per_input"])) >= 2 or moe["distinct_sets"] >= 2


def test_weights_are_named_and_transposes_folded(exported):
    _, out, summary = exported[("llama", False)]
    m = onnx.load(str(out / "model.onnx"))
    names = {t.name for t in m.graph.initializer}
    assert "model.embed_tokens.weight" in names
    assert "model.layers.0.mlp.down_proj.weight.T" in names  # stored [in, out] for MatMul
    assert summary["weights"]["transposed"] > 0
    consumers = {n.op_type for n in m.graph.node if "model.layers.0.mlp.down_proj.weight.T" in n.input}
    assert consumers == {"MatMul"}


def test_tied_embeddings_store_one_matrix(tiny_model, tmp_path):
    d = tiny_model("qwen2", tie_word_embeddings=True)
    s = export_onnx(d, tmp_path / "o")
    assert s["check"]["passed"]
    m = onnx.load(str(tmp_path / "o" / "model.onnx"))
    vocab_hidden = [t for t in m.graph.initializer if list(t.dims) in ([320, 64], [64, 320])]
    assert len(vocab_hidden) == 1  # embedding and head share one tensor


@pytest.mark.parametrize("dtype,elem,opset", [("fp16", onnx.TensorProto.FLOAT16, 14),
                                              ("bf16", onnx.TensorProto.BFLOAT16, 16)])
def test_half_precision(tiny_model, tmp_path, dtype, elem, opset):
    s = export_onnx(tiny_model("deepseek_v3"), tmp_path / dtype, dtype=dtype)
    check = s["check"]
    assert check["passed"] and s["opset"] == opset
    assert check["worst"]["max_abs_err"] <= {"fp16": 5e-2, "bf16": 1e-3}[dtype]
    # fp16: PyTorch computes in fp16 too, so the noise is fp16's; bf16: the widened graph against float32, so
    # float32's, plus what the graph's bf16-rounded constants move (DeepSeek's 24^-0.5 attention scale)
    noise = check["noise"]["logits"]
    assert 1e-4 < noise < 2e-2 if dtype == "fp16" else noise < 1e-5
    if dtype == "bf16":
        assert 0 < check["bf16_constants"]["logits"] < 1e-2
        assert check["max_abs_err"]["logits"] > tolerance.NOISE_K * noise  # float32 noise alone would refuse it
    m = onnx.load(str(tmp_path / dtype / "model.onnx"))
    matrices = {t.name: t.data_type for t in m.graph.initializer if len(t.dims) == 2}
    assert {t for n, t in matrices.items() if ".mlp.gate." not in n} == {elem}
    assert {t for n, t in matrices.items() if ".mlp.gate." in n} == {onnx.TensorProto.FLOAT}  # fp32 routers
    assert m.graph.output[0].type.tensor_type.elem_type == elem


@pytest.mark.parametrize("family,position_ids", [("deepseek_v3", False), ("llama", False), ("qwen2_moe", True)])
def test_kv_cache_prefill_and_two_decode_steps_match_pytorch_cache(tiny_model, tmp_path, family, position_ids):
    """The with-past graph against transformers' own DynamicCache: prefill (left-padded) + two decode steps."""
    d = tiny_model(family)
    s = export_onnx(d, tmp_path / "o", with_past=True, position_ids=position_ids)
    assert s["check"]["passed"] and len(s["check"]["cases"]) >= 4
    model = hf_model(d)
    layers = model.config.num_hidden_layers
    sess = session(tmp_path / "o" / "model.onnx")
    in_names = [i.name for i in sess.get_inputs()]
    first = ["input_ids", "attention_mask"] + (["position_ids"] if position_ids else [])
    assert in_names[:len(first)] == first
    assert in_names[len(first):len(first) + 2] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert len(in_names) == len(first) + 2 * layers

    def with_positions(feeds: dict, mask: np.ndarray, seq: int) -> dict:
        if position_ids:
            feeds["position_ids"] = gen_positions(mask)[:, -seq:]
        return feeds

    out_names = [o.name for o in sess.get_outputs()]
    assert out_names[0] == "logits" and out_names[1:3] == ["present.0.key", "present.0.value"]
    ids, mask = left_padded(model.config.vocab_size)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                    position_ids=torch.from_numpy(gen_positions(mask)), use_cache=True)
    cache = ref.cache
    feeds = {"input_ids": ids, "attention_mask": mask}
    for i, layer in enumerate(cache.layers):
        feeds[f"past_key_values.{i}.key"] = np.zeros((2, layer.keys.shape[1], 0, layer.keys.shape[3]), np.float32)
        feeds[f"past_key_values.{i}.value"] = np.zeros((2, layer.values.shape[1], 0, layer.values.shape[3]),
                                                       np.float32)
    outs = sess.run(None, with_positions(feeds, mask, ids.shape[1]))
    assert np.abs(outs[0] - ref.logits.numpy())[mask == 1].max() < 1e-4
    rng = np.random.default_rng(3)
    for _ in range(2):
        nxt = rng.integers(0, model.config.vocab_size, size=(2, 1), dtype=np.int64)
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        with torch.no_grad():
            ref = model(input_ids=torch.from_numpy(nxt), attention_mask=torch.from_numpy(mask),
                        position_ids=torch.from_numpy(gen_positions(mask)[:, -1:]), cache=cache, use_cache=True)
        cache = ref.cache
        feeds = {"input_ids": nxt, "attention_mask": mask}
        for i in range(layers):
            feeds[f"past_key_values.{i}.key"], feeds[f"past_key_values.{i}.value"] = outs[1 + 2 * i], outs[2 + 2 * i]
        outs = sess.run(None, with_positions(feeds, mask, 1))
        assert np.abs(outs[0] - ref.logits.numpy()).max() < 1e-4
        real = (mask == 1)[:, None, :, None]  # cache entries of padding tokens are never attended to
        for i, layer in enumerate(cache.layers):
            assert np.abs(outs[1 + 2 * i] - layer.keys.numpy())[np.broadcast_to(real, outs[1].shape)].max() < 1e-4
            assert np.abs(outs[2 + 2 * i] - layer.values.numpy())[np.broadcast_to(real, outs[2].shape)].max() < 1e-4
    if family == "deepseek_v3":  # the MLA latent cache: kv_lora_rank and rope dims, one "head"
        cfg = model.config
        assert outs[1].shape == (2, 1, mask.shape[1], cfg.kv_lora_rank)
        assert outs[2].shape == (2, 1, mask.shape[1], cfg.qk_rope_head_dim)
        assert s["cache"]["reduction"] > 1


def test_latent_cache_is_71x_smaller_for_the_real_deepseek_v3():
    from types import SimpleNamespace

    from dsconv.convert.onnx import cache_summary
    from dsconv.convert.onnx_wrapper import CacheLayer, IOSpec
    from dsconv.families import family_for

    config = json.loads((Path(__file__).parent / "data" / "deepseek_v3_config.json").read_text())
    ck = SimpleNamespace(facts=family_for(config).facts(config))
    f = ck.facts
    spec = IOSpec(True, False, [CacheLayer(1, f.kv_lora_rank, 1, f.qk_rope_head_dim)] * f.num_layers)
    c = cache_summary(ck, spec, "bf16")
    assert c["bytes_per_token"] == 70_272  # docs/formats.md: 576 x 2 B x 61 layers
    assert 70 < c["reduction"] < 72


def test_baked_in_routing_cannot_pass(tiny_model, tmp_path, monkeypatch):
    """transformers' `eager` experts trace only the experts the tracing input hit; the check must refuse that."""
    import dsconv.convert.hf_model as hf

    real = hf.load_for_export

    def eager_experts(*args, **kwargs):
        model, report = real(*args, **kwargs)
        model.set_experts_implementation("eager")
        return model, report

    monkeypatch.setattr(hf, "load_for_export", eager_experts)
    monkeypatch.setattr(hf, "split_experts", lambda model, family: {})  # eager reads the fused parameters
    with pytest.raises(CheckFailed):
        export_onnx(tiny_model("qwen3_moe"), tmp_path / "o")
    assert not (tmp_path / "o").exists()
    assert not [p for p in tmp_path.iterdir()]  # no temporary sibling left either


def test_external_data_path(tiny_model, tmp_path):
    s = export_onnx(tiny_model("mixtral", fused=True), tmp_path / "o", external_data_threshold=100_000)
    assert s["external_data"] and s["files"] == ["model.onnx", "model.onnx_data"]
    out = tmp_path / "o"
    m = onnx.load(str(out / "model.onnx"), load_external_data=False)
    external = [t for t in m.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert external and all(t.data_location == onnx.TensorProto.EXTERNAL
                            for t in m.graph.initializer if np.prod(t.dims) * 4 >= 1024)
    for t in external:
        entries = {e.key: e.value for e in t.external_data}
        assert entries["location"] == "model.onnx_data" and int(entries["offset"]) % 4096 == 0
    assert (out / "model.onnx").stat().st_size < 200_000 < (out / "model.onnx_data").stat().st_size
    onnx.checker.check_model(str(out / "model.onnx"))
    ids, mask = left_padded(320)
    assert np.isfinite(session(out / "model.onnx").run(["logits"], {"input_ids": ids, "attention_mask": mask})[0]).all()
    manifest = json.loads((out / "dsconv_manifest.json").read_text())
    assert "model.onnx_data" in manifest["files"]


@pytest.mark.parametrize("family,opset", [("deepseek_v3", 11), ("qwen2_moe", 17)])
def test_other_opsets(tiny_model, tmp_path, family, opset):
    s = export_onnx(tiny_model(family), tmp_path / "o", opset=opset)
    assert s["check"]["passed"]
    m = onnx.load(str(tmp_path / "o" / "model.onnx"))
    assert next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) == opset
    if family == "deepseek_v3":  # the dense experts need no repeat_interleave (opset 13): emitted at 11 directly
        assert s["opset_emitted"] == 11 and s["opset_method"] == "exporter"


def test_fp8_checkpoint_exports(tiny_model, tmp_path):
    from dsconv.tiny import write_fp8_checkpoint

    src = write_fp8_checkpoint(tiny_model("deepseek_v3"), tmp_path / "fp8", block=(16, 16), max_part_tensors=9)
    s = export_onnx(src, tmp_path / "o")
    assert s["check"]["passed"] and s["load"]["fp8_dequantized"]
    assert not list(tmp_path.glob(".*dsconv-fp8*"))  # dequantized in-stream: no scratch copy


def test_check_failure_exit_3_and_nothing_written(tiny_model, tmp_path, run_cli):
    r = run_cli(["export", "--model", tiny_model("llama"), "--output", tmp_path / "o", "--atol", "1e-12"])
    assert r.code == 3, r.err
    assert "logits max |onnx - torch|" in r.err and "position" in r.err and "Traceback" not in r.err
    assert not (tmp_path / "o").exists() and list(tmp_path.iterdir()) == []


def test_missing_weight_is_a_user_error(tiny_model, tmp_path, run_cli):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), d)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    r = run_cli(["export", "--model", d, "--output", tmp_path / "o"])
    assert r.code == 2 and "model.layers.1.mlp.up_proj.weight" in r.err, r.err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args,needle", [(["--opset", "10"], "outside 11..18"),
                                         (["--dtype", "bf16", "--opset", "14"], "opset 16"),
                                         (["--format", "safetensors", "--opset", "14"], "does not apply"),
                                         (["--atol", "0"], "must be positive")])
def test_bad_options_exit_2(tiny_model, tmp_path, run_cli, args, needle):
    r = run_cli(["export", "--model", tiny_model("llama"), "--output", tmp_path / "o", *args])
    assert r.code == 2 and needle in r.err, r.err
    assert not (tmp_path / "o").exists()


def test_memory_estimate_refuses_then_force_exports(tiny_model, tmp_path, monkeypatch, run_cli):
    import dsconv.convert.onnx as onnx_stage

    monkeypatch.setattr(onnx_stage, "RAM_BASE", 10**15)
    d = tiny_model("llama")
    r = run_cli(["export", "--model", d, "--output", tmp_path / "o"])
    assert r.code == 2 and "GB of RAM" in r.err and "--force" in r.err
    assert not (tmp_path / "o").exists()
    r = run_cli(["export", "--model", d, "--output", tmp_path / "o", "--force", "--json"])
    assert r.code == 0, r.err
    assert json.loads(r.out)["memory"]["peak_rss_bytes"] > 0


def test_workspace_defaults_json_dry_run_and_verify(tiny_model, tmp_path, run_cli):
    d = tiny_model("qwen3")
    assert run_cli(["init", "--model", d, "--output", "out"], cwd=tmp_path).code == 0
    r = run_cli(["export", "--dry-run", "--json"], cwd=tmp_path)
    assert r.code == 0 and json.loads(r.out)["dry_run"] and not (tmp_path / "out" / "onnx").exists()
    r = run_cli(["export", "--json"], cwd=tmp_path)
    assert r.code == 0, r.err
    summary = json.loads(r.out)
    assert summary["check"]["passed"] and Path(summary["output"]).resolve() == (tmp_path / "out" / "onnx").resolve()
    assert run_cli(["verify", tmp_path / "out" / "onnx"]).code == 0
    r = run_cli(["export"], cwd=tmp_path)
    assert r.code == 2 and "--force" in r.err  # an existing output is not replaced silently
    r = run_cli(["export", "--force"], cwd=tmp_path)
    assert r.code == 0 and "check passed" in r.out and "x noise" in r.out and "margin" in r.out


def test_mindir_dispatch_without_the_module(tiny_model, tmp_path, run_cli, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "dsconv.convert.mindir", None)  # import now raises ImportError
    r = run_cli(["export", "--model", tiny_model("llama"), "--output", tmp_path / "m", "--format", "mindir"])
    assert r.code == 2 and "MindIR export is unavailable" in r.err


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_graphs_onnx_cannot_express_are_refused_before_any_work(tiny_model, run_cli, tmp_path, family):
    r = run_cli(["export", "--model", tiny_model(family), "--output", tmp_path / "o", "--format", "onnx"])
    assert r.code == 2 and "cannot be exported to ONNX" in r.err and REFUSED[family] in r.err
    assert "Traceback" not in r.err and not (tmp_path / "o").exists()


def test_all_families_are_covered():
    assert {f for f, _ in CASES} | set(REFUSED) == set(FAMILIES) and not {f for f, _ in CASES} & set(REFUSED)
    assert {f for f, fused in CASES if fused} & MOE and {f for f, fused in CASES if not fused} & MOE


def test_lean_shape_inference_leaves_the_graph_unchanged(tiny_model, monkeypatch):
    """The exporter's whole-graph shape inference runs without the weights (they would be copied into a temporary
    protobuf); the graph must be node for node the one torch exports with them."""
    from dsconv.convert import hf_model, onnx_graph
    from dsconv.checkpoint import Checkpoint
    from dsconv.convert.onnx_wrapper import ExportWrapper, IOSpec, cache_geometry, trace_inputs

    ck = Checkpoint.open(tiny_model("deepseek_v3"))
    model, _ = hf_model.load_for_export(ck, "fp32")
    spec = IOSpec(True, False, cache_geometry(model))
    wrapper = ExportWrapper(model, spec).eval()
    args = trace_inputs(spec, model.config.vocab_size, torch.float32)
    graphs = []
    for lean in (True, False):
        monkeypatch.setattr(onnx_graph, "LEAN_SHAPE_INFERENCE", lean)
        g, _ = onnx_graph.trace_to_onnx(wrapper, args, spec.input_names, spec.output_names, spec.dynamic_axes(), 14)
        graphs.append([(n.op_type, list(n.input), list(n.output), n.attribute) for n in g.graph.node])
    assert graphs[0] == graphs[1]
