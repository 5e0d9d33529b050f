"""MindIR export: every family against PyTorch, dynamic shapes, left padding, dtypes, the CLI, failures.

One export per (family, dtype) per module (cached), each real: MindSpore builds, exports, reloads the file with
`mindspore.load` + `nn.GraphCell`, and transformers gives the reference. The tests re-run the exported graphs on
shapes the built-in check never used.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mindspore")

from dsconv.checkpoint import Checkpoint  # noqa: E402
from dsconv.convert import mindir, tolerance  # noqa: E402
from dsconv.convert.mindir import export_mindir  # noqa: E402
from dsconv.errors import UserError  # noqa: E402
from dsconv.families import families  # noqa: E402
from dsconv.tiny import FAMILIES, MOE_FAMILIES  # noqa: E402

pytestmark = [pytest.mark.cli, pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # tiny references


@pytest.fixture(scope="module")
def cwd_dir(tmp_path_factory) -> Path:
    """The working directory every export of this module runs from: it must stay empty (no MindSpore debris)."""
    return tmp_path_factory.mktemp("cwd")


# Variants ride along with a family so each costs no extra export: llama3 rope scaling (Llama), tied embeddings
# (Qwen3), transformers' fused expert layout on disk (gate_up_proj [E, 2I, H], Qwen3-MoE), a 4-token sliding window
# (Mixtral), yarn with mscale/mscale_all_dim as DeepSeek-V3 ships it (positions past original_max_position_embeddings
# in the 64-token check); Llama also gets biases on q/k/v/o and the MLP. A bf16 checkpoint (the demo's dtype) is the
# CLI test's.
VARIANTS = {
    "llama": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 16},
              "attention_bias": True, "mlp_bias": True},
    "qwen3": {"tie_word_embeddings": True},
    "qwen3_moe": {"fused": True},
    "mixtral": {"sliding_window": 4},
    "deepseek_v3": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0,
                                        "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
                                        "mscale": 1.0, "mscale_all_dim": 1.0}},
}


def randomize_biases(model_dir: Path, seed: int = 0) -> Path:
    """dsconv.tiny leaves biases at transformers' init (zeros), where a bias given to the wrong projection would
    still match: give every bias random values (in place, in the checkpoint's dtype)."""
    import torch
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(seed)
    for part in model_dir.glob("*.safetensors"):
        tensors = load_file(part)
        biases = [n for n in tensors if n.endswith(".bias")]
        for n in biases:
            tensors[n] = (torch.randn(tensors[n].shape, generator=g) * 0.2).to(tensors[n].dtype)
        if biases:
            save_file(tensors, part, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def export(tmp_path_factory, cwd_dir):
    """`export(family, dtype="fp32")` -> (model dir, output dir, summary) of the family's variant, cached."""
    from dsconv.tiny import make_tiny

    cache: dict[tuple, tuple[Path, Path, dict]] = {}
    models: dict[str, Path] = {}

    def get(family: str, dtype: str = "fp32"):
        if family not in models:
            models[family] = randomize_biases(make_tiny(family, tmp_path_factory.mktemp(family),
                                                        **VARIANTS.get(family, {})))
        if (family, dtype) not in cache:
            out = tmp_path_factory.mktemp("mindir") / f"{family}-{dtype}"
            old = Path.cwd()
            os.chdir(cwd_dir)
            try:
                summary = export_mindir(models[family], out, dtype=dtype)
            finally:
                os.chdir(old)
            cache[(family, dtype)] = (models[family], out, summary)
        return cache[(family, dtype)]

    return get


def run_graph(path: Path, ids: np.ndarray, mask: np.ndarray, cwd: Path) -> np.ndarray:
    """Run an exported MindIR the way a deployer would: mindspore.load + nn.GraphCell (graph mode)."""
    import mindspore as ms
    from mindspore import Tensor, nn

    old_mode, old_cwd = ms.get_context("mode"), Path.cwd()
    ms.set_context(mode=ms.GRAPH_MODE)
    os.chdir(cwd)
    try:
        cell = nn.GraphCell(ms.load(str(path)))
        return cell(Tensor(ids), Tensor(mask)).asnumpy()
    finally:
        os.chdir(old_cwd)
        ms.set_context(mode=old_mode)


def graph_signature(path: Path) -> tuple[list, list]:
    """([(input name, dtype, dims)], [(dtype, dims)]) as stored in the MindIR file."""
    import mindspore as ms

    graph = ms.load_mindir(str(path)).graph
    name = lambda t: type(t).DataType.Name(t.data_type)  # noqa: E731
    inputs = [(i.name.split(":")[-1], name(t), list(t.dims)) for i in graph.input for t in i.tensor]
    return inputs, [(name(t), list(t.dims)) for o in graph.output for t in o.tensor]


def torch_logits(model_dir: Path, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    positions = torch.from_numpy(np.maximum(mask.cumsum(1) - 1, 0))
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                     position_ids=positions).logits.numpy()


# ------------------------------------------------------------------------------------------------ every family
# families the MindSpore builder has a network for; the others are refused (test below)
BUILT = tuple(f.name for f in families() if not f.mindir_refused)


def test_families_without_a_network_are_refused(tiny_model, run_cli, tmp_path):
    refused = [f for f in FAMILIES if f not in BUILT]
    assert sorted(refused) == ["deepseek_v32", "granitemoe", "qwen3_5_moe", "qwen3_next"]
    r = run_cli(["export", "--model", tiny_model("granitemoe"), "--output", tmp_path / "m", "--format", "mindir"])
    assert r.code == 2 and "no Granite block" in r.err and not (tmp_path / "m").exists()


@pytest.mark.parametrize("family", BUILT)
def test_every_family_matches_pytorch(export, family):
    model, out, s = export(family)
    check = s["check"]
    assert check["passed"] and check["max_abs_err"] < 1e-4, check
    names = [c["name"] for c in check["shapes"]]
    assert names[:2] == ["batch 2, left-padded", "single token"] and len(names) == 3
    assert {tuple(c["shape"]) for c in check["shapes"]} == {(2, 12), (1, 1), (1, 64)}
    assert all(c["top1_agreement"] == 1.0 and c["finite"] for c in check["shapes"])
    # default bound: from the reference's own float32 noise (against float64), the same for every shape
    assert check["rule"] == "noise" and check["noise_dtype"] == "fp32" and 0 < check["noise"] < 1e-4
    assert check["bound"] == pytest.approx(tolerance.bound(check["noise"], check["max_abs_ref"]))
    assert check["margin"] == pytest.approx(check["bound"] / check["max_abs_err"]) and check["margin"] > 1
    assert check["max_abs_ref"] == max(c["ref_max_abs"] for c in check["shapes"])
    for c in check["shapes"]:
        assert c["tolerance"] == check["bound"] and 0 < c["noise"] <= check["noise"]
    assert check["shapes"][0]["real_tokens"] == 12 + 7  # row 1 is left-padded by 5
    assert (out / "model.mindir").stat().st_size == s["files"]["model.mindir"] > s["parameter_bytes"] * 0.9
    assert oct((out / "model.mindir").stat().st_mode & 0o777) == "0o644"  # MindSpore writes 0400
    for name in ("config.json", "dsconv_manifest.json", "export_report.json"):
        assert (out / name).is_file()
    report = json.loads((out / "export_report.json").read_text())
    assert report["check"]["max_abs_err"] == check["max_abs_err"] and report["family"] == s["family"]
    assert s["inputs"] == {"input_ids": "int64 [batch, seq]", "attention_mask": "int64 [batch, seq]"}
    assert s["with_past"] is False and s["dtype"] == s["compute_dtype"] == "fp32"
    config = json.loads((model / "config.json").read_text())
    if family in ("llama", "qwen2"):  # biases present, non-zero, and each checked through the logits
        biases = [n for n in Checkpoint.open(model).tensors if n.endswith(".bias")]
        assert len(biases) == (14 if family == "llama" else 6)
    if config.get("tie_word_embeddings"):  # no lm_head on disk: the graph reuses the embedding
        assert not any(n.startswith("lm_head") for n in Checkpoint.open(model).tensors)
    inputs, outputs = graph_signature(out / "model.mindir")
    assert inputs == [("input_ids", "INT64", [-1, -1]), ("attention_mask", "INT64", [-1, -1])]
    assert outputs == [("FLOAT", [-1, -1, 320])]  # logits float32 [batch, seq, vocab], both dims dynamic
    manifest = json.loads((out / "dsconv_manifest.json").read_text())
    assert manifest["stage"] == "mindir" and "model.mindir" in manifest["files"]
    if family in MOE_FAMILIES:  # the check inputs exercised the routing, not one fixed set of experts
        hit = check["experts_hit"]
        import json as _json

        top_k = _json.loads((model / "config.json").read_text())["num_experts_per_tok"]
        assert top_k < hit["num_experts"]
        assert hit["min_per_layer"] > top_k, hit
        assert s["moe"].startswith("every expert")
    else:
        assert "experts_hit" not in check


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_parameters_carry_the_checkpoint_names(export, family):
    """Cells do not prefix their parameters: each MindIR parameter is named as the checkpoint tensor the family table
    gave it (routed experts: one stack per projection), so the MindSpore builder restates no name."""
    import mindspore as ms

    from dsconv.checkpoint import Checkpoint

    model, out, s = export(family)
    names = {p.name.split(":")[-1] for p in ms.load_mindir(str(out / s["mindir"])).graph.parameter}
    with Checkpoint.open(model) as ck:
        dense = {n for n, r in ck.roles.items() if r.expert is None}
        stacks = {ck.family.module(f"expert.{slot}", layer, "all") for slot in ("gate", "up", "down")
                  for layer in ck.facts.moe_layers}
    assert names == dense | stacks


def test_render_summary(export):
    _, out, s = export("deepseek_v3", "bf16")
    text = mindir.render(s)
    assert f"{out}/model.mindir" in text and "bf16 weights, fp32 compute" in text
    assert "bound" in text and "noise" in text and "margin" in text
    assert "batch 2, left-padded" in text and "what bf16 costs" in text


def test_no_mindspore_debris_in_the_working_directory(export, cwd_dir):
    export("llama")
    export("deepseek_v3")
    assert list(cwd_dir.iterdir()) == []
    for parent in {export("llama")[1].parent, export("deepseek_v3")[1].parent}:
        leftovers = [p.name for p in parent.iterdir() if "scratch" in p.name or "dsconv-tmp" in p.name]
        assert leftovers == []


# ------------------------------------------------------------------------------------------------ the graph itself
@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_exported_graph_takes_new_shapes_and_ignores_left_padding(export, family, tmp_path):
    """Shapes the built-in check never ran (batch 3, odd lengths); a left-padded row equals the row alone."""
    model, out, _ = export(family)
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 320, (3, 9), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :8] = 0  # one real token
    got = run_graph(out / "model.mindir", ids, mask, tmp_path)
    ref = torch_logits(model, ids, mask)
    assert got.shape == (3, 9, 320) and got.dtype == np.float32
    real = mask.astype(bool)
    assert np.abs(got[real] - ref[real]).max() < 1e-4
    assert np.isfinite(got).all()  # padding rows too: no NaN can leak through the values
    alone = run_graph(out / "model.mindir", ids[0:1, 4:], np.ones((1, 5), np.int64), tmp_path)
    assert np.abs(alone[0] - got[0, 4:]).max() < 1e-4
    long = rng.integers(0, 320, (2, 37), dtype=np.int64)
    assert run_graph(out / "model.mindir", long, np.ones_like(long), tmp_path).shape == (2, 37, 320)


# ------------------------------------------------------------------------------------------------ the tolerance
@pytest.fixture(scope="module")
def deep(tmp_path_factory, cwd_dir):
    """(model dir, output dir, summary, the MindIR's logits per check case): the deep narrow bf16 Llama
    (dsconv.tiny.make_deep: 30 layers, tied, logits ~35), exported to MindIR fp32 with the default check. The
    logits MindSpore computed for the check are kept (compare_with_reference watched, not replaced), so a fault
    test can compare them with another reference without running MindSpore again."""
    from dsconv.tiny import make_deep

    root = tmp_path_factory.mktemp("deep")
    model = make_deep(root / "model")
    seen: list = []
    real = mindir.compare_with_reference

    def watch(ck, scratch, outputs, dtype, atol):
        seen.append([o.copy() for o in outputs])
        return real(ck, scratch, outputs, dtype, atol)

    old = Path.cwd()
    os.chdir(cwd_dir)
    mindir.compare_with_reference = watch
    try:
        return model, root / "mindir", export_mindir(model, root / "mindir"), seen[0]
    finally:
        mindir.compare_with_reference = real
        os.chdir(old)


def one_weight_off(name: str, factor: float):
    """A reference_loader whose reference gets `name` scaled by `factor`: the MindIR and PyTorch then compute
    different functions, as a mis-loaded weight would make them."""
    real = mindir.reference_loader

    def loader(ck):
        load = real(ck)
        return lambda n, dtype: load(n, dtype) * factor if n == name else load(n, dtype)

    return loader


def test_deep_model_passes_by_its_own_noise(deep):
    _, out, s, _ = deep
    check = s["check"]
    assert check["passed"] and (out / "model.mindir").is_file()
    assert check["rule"] == "noise" and check["atol"] is None and check["noise_dtype"] == "fp32"
    assert check["bound"] == pytest.approx(tolerance.bound(check["noise"], check["max_abs_ref"]))
    assert check["max_abs_err"] > 1e-4 and check["max_abs_ref"] > 20  # a fixed 1e-4 would refuse this correct export
    assert check["margin"] > 3
    assert "x the reference's fp32 noise" in mindir.render(s) and "margin" in mindir.render(s)


def test_deep_model_fault_fails_far_past_the_bound(deep, tmp_path, monkeypatch):
    """The MindIR's logits against the right reference (passes, as in the export) and against one whose mid-depth
    MLP weight is 1% off (fails by far: the bound is no loophole for it)."""
    model, out, s, outputs = deep
    with Checkpoint.open(model) as ck:
        good = mindir.compare_with_reference(ck, tmp_path, outputs, "fp32", None)
        monkeypatch.setattr(mindir, "reference_loader", one_weight_off("model.layers.15.mlp.down_proj.weight", 1.01))
        bad = mindir.compare_with_reference(ck, tmp_path, outputs, "fp32", None)
    assert good["passed"] and good["max_abs_err"] == s["check"]["max_abs_err"]
    assert not bad["passed"] and bad["max_abs_err"] > 10 * bad["bound"] and bad["margin"] < 0.1


def test_fault_exits_3_and_writes_nothing(tiny_model, run_cli, tmp_path, monkeypatch):
    monkeypatch.setattr(mindir, "reference_loader", one_weight_off("model.layers.1.mlp.down_proj.weight", 1.01))
    r = run_cli(["export", "--format", "mindir", "--model", tiny_model("llama"), "--output", tmp_path / "o"],
                cwd=tmp_path)
    assert r.code == 3 and "nothing written" in r.err and "x the reference's fp32 noise" in r.err, r.err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ dtypes
def test_bf16_stores_bf16_and_computes_fp32(export):
    _, _, fp32 = export("deepseek_v3")
    _, out, s = export("deepseek_v3", "bf16")
    check = s["check"]
    assert s["dtype"] == "bf16" and s["compute_dtype"] == "fp32"
    assert "rounded to bf16" in check["reference"]
    assert check["passed"] and check["max_abs_err"] < 1e-4  # same math as the rounded reference
    assert check["max_abs_err_vs_unrounded"] > check["max_abs_err"]  # what bf16 costs is reported too
    # bf16 weights (routers stay float32): a bit over half the float32 parameter bytes
    assert 0.5 <= s["parameter_bytes"] / fp32["parameter_bytes"] < 0.6
    assert s["mindir_bytes"] < fp32["mindir_bytes"] * 0.75


def test_fp16_computes_in_fp16(export):
    _, _, fp32 = export("qwen2_moe")
    _, _, s = export("qwen2_moe", "fp16")
    check = s["check"]
    assert s["compute_dtype"] == "fp16" and check["passed"]
    assert 1e-5 < check["max_abs_err"] < 2e-2  # activations rounded to fp16: not the fp32 math
    # the noise is fp16's (the reference computing in fp16 against float64), so the bound follows fp16's rounding
    assert check["noise_dtype"] == "fp16" and 1e-4 < check["noise"] < 2e-2
    assert check["bound"] == pytest.approx(tolerance.bound(check["noise"], check["max_abs_ref"]))
    assert s["parameter_bytes"] < fp32["parameter_bytes"] * 0.6


# ------------------------------------------------------------------------------------------------ failures, options
@pytest.mark.parametrize("kwargs, message", [
    ({"with_past": True}, "--with-past is not supported for MindIR"),
    ({"dtype": "int8"}, "--dtype 'int8'"),
    ({"atol": 0.0}, "--atol 0.0 must be positive"),
])
def test_bad_options_are_user_errors(tiny_model, tmp_path, kwargs, message):
    with pytest.raises(UserError, match=message):
        export_mindir(tiny_model("llama"), tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_unsupported_activation_is_a_user_error(tiny_model, tmp_path):
    import shutil

    model = shutil.copytree(tiny_model("llama"), tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "mistral", "hidden_act": "gelu"}))
    with pytest.raises(UserError, match="hidden_act 'gelu'"):
        export_mindir(model, tmp_path / "out")


def test_refuses_to_overwrite_without_force(export):
    model, out, _ = export("qwen2")
    with pytest.raises(UserError, match="already holds a dsconv output"):
        export_mindir(model, out)


def test_child_process_path(tiny_model, tmp_path, monkeypatch):
    """Large checkpoints export and check in child processes (memory back after each); same result."""
    monkeypatch.setattr(mindir, "ISOLATE_ABOVE_BYTES", 0)
    monkeypatch.chdir(tmp_path)
    s = export_mindir(tiny_model("qwen3"), tmp_path / "out")
    assert s["mindspore_in_child_process"] is True
    assert s["check"]["passed"] and s["check"]["max_abs_err"] < 1e-4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_child_process_reports_user_errors(tmp_path):
    """A UserError raised in the child comes back as the same one-line UserError (exit 2), not as a crash."""
    with pytest.raises(UserError, match="is not a directory"):
        mindir._run_child("export", tmp_path, {"model_dir": str(tmp_path / "missing"), "dtype": "fp32",
                                               "export_dir": str(tmp_path / "export"), "allow_pickle": False})


def test_length_dependent_rope_is_refused(tiny_model, tmp_path):
    import shutil

    model = shutil.copytree(tiny_model("llama"), tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}))
    with pytest.raises(UserError, match="rope_type 'dynamic' is not supported"):
        export_mindir(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ CLI, workspace
def test_cli_in_a_workspace_as_the_demo_runs_it(tiny_model, run_cli, tmp_path):
    """`dsconv export --format mindir` as the demo types it, on a bf16 checkpoint (the demo's dtype): a failed
    check exits 3 with the figures and writes nothing; then the export, `dsconv verify`, and --with-past refused."""
    from dsconv.demo import STEPS

    assert ("export mindir", ["export", "--format", "mindir"]) in STEPS
    ws = tmp_path / "ws"
    ws.mkdir()
    assert run_cli(["init", "--model", tiny_model("llama", dtype="bf16")], cwd=ws).code == 0
    failed = run_cli(["export", "--format", "mindir", "--atol", "1e-12"], cwd=ws)
    assert failed.code == 3 and "nothing written" in failed.err and "bound 1e-12 (--atol 1e-12)" in failed.err
    assert "left-padded" in failed.err and "Traceback" not in failed.err  # the per-shape figures come along
    assert not (ws / "dsconv-out" / "mindir").exists()
    assert sorted(p.name for p in ws.iterdir()) == ["dsconv-out", "dsconv.toml"]
    assert list((ws / "dsconv-out").iterdir()) == []  # no scratch left behind
    done = run_cli(["export", "--format", "mindir", "--json"], cwd=ws)
    assert done.code == 0, done.err
    summary = json.loads(done.out)
    assert summary["check"]["passed"] and summary["check"]["max_abs_err"] < 1e-4  # bf16 widened to fp32: exact
    assert (ws / "dsconv-out" / "mindir" / "model.mindir").is_file()
    assert sorted(p.name for p in ws.iterdir()) == ["dsconv-out", "dsconv.toml"]
    verified = run_cli(["verify", ws / "dsconv-out" / "mindir"])
    assert verified.code == 0, verified.err
    assert mindir.verify_mindir(ws / "dsconv-out" / "mindir", {}) == []
    assert run_cli(["export", "--format", "mindir", "--with-past"], cwd=ws).code == 2
