"""Writing shards end to end through the CLI: BF16, FP8 (scales in other parts) and msModelSlim-quantized inputs
reassemble bit-exactly (`dsconv verify`), hand-checked slices, size caps, rejections that write nothing, --json,
--plot, EPLB with the expert map, the workspace default input, and verify catching changed bytes."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsconv.checkpoint import Checkpoint
from dsconv.families.roles import Role

pytestmark = pytest.mark.cli


def make_quantized(src: Path, out: Path, seed: int = 1) -> Path:
    """A msModelSlim-layout output of a tiny model (random codes): W8A8 static on row-parallel layers (o_proj, expert
    down_proj: quant_bias!), W4A16 group-8 packed rows on dense and shared down_proj (two groups or more per rank at
    tp 2, as MindIE's sharding needs), W8A8_DYNAMIC elsewhere, latents FLOAT."""
    ck = Checkpoint.open(src)
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    desc: dict[str, str | int] = {"model_quant_type": "W8A8", "version": "1.0.0", "group_size": 8}

    def put(name: str, t: torch.Tensor, typ: str) -> None:
        tensors[name] = t.contiguous()
        desc[name] = typ

    for name in ck.names():
        r = ck.role(name)
        t = ck.load(name)
        if r.param != "weight" or not r.role.quantized_by_default or r.role is Role.ATTN_LATENT:
            put(name, t, "FLOAT")
            continue
        n, k = t.shape
        p = r.module
        if r.role in (Role.ATTN_OUT, Role.EXPERT_OUT):
            put(p + ".weight", torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), "W8A8")
            put(p + ".input_scale", torch.rand(1, generator=g), "W8A8")
            put(p + ".input_offset", torch.randint(-5, 5, (1,), generator=g).float(), "W8A8")
            put(p + ".deq_scale", torch.rand(n, generator=g), "W8A8")
            put(p + ".quant_bias", torch.randint(-2**20, 2**20, (n,), generator=g, dtype=torch.int32), "W8A8")
        elif r.role is Role.MLP_OUT:
            put(p + ".weight", torch.randint(-128, 128, (n // 2, k), generator=g, dtype=torch.int8), "W4A16")
            put(p + ".weight_scale", torch.rand(n, k // 8, generator=g), "W4A16")
            put(p + ".weight_offset", torch.zeros(n, k // 8), "W4A16")
        else:
            put(p + ".weight", torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), "W8A8_DYNAMIC")
            put(p + ".weight_scale", torch.rand(n, 1, generator=g), "W8A8_DYNAMIC")
            put(p + ".weight_offset", torch.zeros(n, 1), "W8A8_DYNAMIC")
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "quant_model_weights.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "quant_model_description.json").write_text(json.dumps(desc))
    return out


def rank_tensors(rank_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(rank_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def ds_bf16(tiny_model):
    return tiny_model("deepseek_v3", dtype="bf16")


@pytest.fixture(scope="module")
def ds_fp8(ds_bf16, tmp_path_factory):
    from dsconv.tiny import write_fp8_checkpoint

    return write_fp8_checkpoint(ds_bf16, tmp_path_factory.mktemp("fp8") / "m", block=(16, 16), max_part_tensors=40)


@pytest.fixture(scope="module")
def ds_quant(ds_bf16, tmp_path_factory):
    return make_quantized(ds_bf16, tmp_path_factory.mktemp("quant") / "q")


@pytest.fixture(scope="module")
def sharded_bf16(run_cli, ds_bf16, tmp_path_factory):
    out = tmp_path_factory.mktemp("s") / "shard"
    res = run_cli(["shard", "--format", "ranks", "-m", ds_bf16, "--ep", "4", "--tp", "2", "-o", out, "--json"])
    assert res.code == 0, res.err
    return out, json.loads(res.out)


# ------------------------------------------------------------------------------------------------ BF16
def test_bf16_json_summary_and_rank_dirs(sharded_bf16):
    out, obj = sharded_bf16
    assert obj["ok"] and obj["layout"]["world"] == 8 and len(obj["ranks"]) == 8
    r = obj["ranks"][5]
    assert {"rank", "node", "device", "bytes", "hbm_bytes", "kv_tokens_left"} <= set(r)
    assert (r["rank"], r["node"], r["device"], r["ep_rank"]) == (5, 0, 5, 2)
    assert obj["balance"]["max_over_mean"] == 1.0
    assert obj["mindie"] == {"worldSize": 8, "tp": 2, "dp": 4, "moe_tp": 2, "moe_ep": 4,
                             "models": {"deepseekv2": {"ep_level": 1}}}
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [f"rank_{i:02d}" for i in range(8)]
    for f in ("plan.json", "ranktable.json", "mindie_parallel.json", "dsconv_manifest.json", "config.json"):
        assert (out / f).is_file()
    assert (out / "rank_00" / "config.json").is_file()


def test_bf16_slices_by_hand(sharded_bf16, ds_bf16):
    out, _ = sharded_bf16
    src = load_file(ds_bf16 / "model.safetensors")
    r3 = rank_tensors(out / "rank_03")  # tp rank 1, EP rank 1 (experts 4-7), moe_tp rank 1
    qb = "model.layers.0.self_attn.q_b_proj.weight"
    assert torch.equal(r3[qb], src[qb][48:96])
    up = "model.layers.2.mlp.experts.6.up_proj.weight"
    assert torch.equal(r3[up], src[up][16:32])
    down = "model.layers.2.mlp.experts.6.down_proj.weight"
    assert torch.equal(r3[down], src[down][:, 16:32])
    assert "model.layers.2.mlp.experts.0.up_proj.weight" not in r3
    assert torch.equal(r3["model.norm.weight"], src["model.norm.weight"])
    with safe_open(str(out / "rank_03" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_verify_reassembles_bit_exactly_and_catches_changed_source(run_cli, sharded_bf16, ds_bf16, tmp_path):
    out, _ = sharded_bf16
    assert run_cli(["verify", out]).code == 0
    # a copy of the source and of the shards, then one source byte changes (same size: only reassembly sees it)
    src = shutil.copytree(ds_bf16, tmp_path / "src")
    res = run_cli(["shard", "--format", "ranks", "-m", src, "--ep", "4", "--tp", "2", "-o", tmp_path / "sh"])
    assert res.code == 0, res.err
    st = src / "model.safetensors"
    data = bytearray(st.read_bytes())
    data[-3] ^= 0x55
    st.write_bytes(bytes(data))
    bad = run_cli(["verify", tmp_path / "sh"])
    assert bad.code == 3 and "differs from the source" in bad.err
    shutil.rmtree(src)  # source gone: the ranks are still checked against each other and the plan
    gone = run_cli(["verify", tmp_path / "sh"])
    assert gone.code == 0 and "is gone" in gone.err


def test_verify_catches_a_replica_that_disagrees(run_cli, sharded_bf16, tmp_path):
    out = shutil.copytree(sharded_bf16[0], tmp_path / "sh")
    f = out / "rank_06" / "model.safetensors"
    t = load_file(f)
    t["model.norm.weight"] = t["model.norm.weight"] + 1
    save_file(t, f, metadata={"format": "pt"})
    from dsconv.io.digest import file_digest

    m = json.loads((out / "dsconv_manifest.json").read_text())  # re-hash: only the shard check can see it
    # a pre-BLAKE3 entry
    m["files"]["rank_06/model.safetensors"] = {"sha256": file_digest(f, "sha256"), "size": f.stat().st_size}
    (out / "dsconv_manifest.json").write_text(json.dumps(m))
    res = run_cli(["verify", out])
    assert res.code == 3 and "model.norm.weight: rank_06's copy differs" in res.err


# ------------------------------------------------------------------------------------------------ FP8 and quantized
def test_fp8_scales_split_with_their_blocks(run_cli, ds_fp8, ds_bf16, tmp_path):
    out = tmp_path / "sh"
    res = run_cli(["shard", "--format", "ranks", "-m", ds_fp8, "--ep", "4", "--tp", "2", "-o", out, "--max-shard-size", "30KB"])
    assert res.code == 0, res.err
    r1 = rank_tensors(out / "rank_01")
    qb = "model.layers.0.self_attn.q_b_proj.weight"
    assert r1[qb].dtype == torch.float8_e4m3fn and r1[qb].shape == (48, 32)
    assert r1[qb + "_scale_inv"].shape == (3, 2)  # 6 row blocks of 16 over tp 2
    assert len(list((out / "rank_01").glob("model-*-of-*.safetensors"))) > 1  # size-capped parts + index
    assert (out / "rank_01" / "model.safetensors.index.json").is_file()
    assert run_cli(["verify", out]).code == 0
    # the same model in 128-blocks cannot be split by tp 2: rejected, naming the tensor, nothing written
    from dsconv.tiny import write_fp8_checkpoint

    big = write_fp8_checkpoint(ds_bf16, tmp_path / "b128")
    res = run_cli(["shard", "--format", "ranks", "-m", big, "--ep", "4", "--tp", "2", "-o", tmp_path / "nope"])
    assert res.code == 3 and "q_b_proj.weight" in res.err and "FP8 128-blocks" in res.err
    assert not (tmp_path / "nope").exists()


def test_quantized_input_keeps_layout_and_row_parallel_bias(run_cli, ds_quant, tmp_path):
    out = tmp_path / "sh"
    res = run_cli(["shard", "--format", "ranks", "-m", ds_quant, "--ep", "4", "--tp", "2", "-o", out, "--json"])
    assert res.code == 0, res.err
    assert json.loads(res.out)["source"]["kind"] == "quantized"
    src = load_file(ds_quant / "quant_model_weights.safetensors")
    r0, r1 = rank_tensors(out / "rank_00"), rank_tensors(out / "rank_01")
    assert (out / "rank_00" / "quant_model_weights.safetensors").is_file()
    o = "model.layers.0.self_attn.o_proj"
    assert torch.equal(r0[o + ".weight"], src[o + ".weight"][:, :32])
    assert torch.equal(r0[o + ".quant_bias"], src[o + ".quant_bias"])           # first TP rank: the whole bias
    assert not r1[o + ".quant_bias"].any()                                       # others: zeros (added once)
    assert torch.equal(r1[o + ".deq_scale"], src[o + ".deq_scale"])             # per output channel: replicated
    d = "model.layers.0.mlp.down_proj"                                           # W4A16 packed, column split
    assert torch.equal(r1[d + ".weight"], src[d + ".weight"][:, 64:])
    assert torch.equal(r1[d + ".weight_scale"], src[d + ".weight_scale"][:, 8:])  # groups of 8 follow
    g = "model.layers.0.mlp.gate_proj"                                           # W8A8_DYNAMIC, row split
    assert torch.equal(r1[g + ".weight_scale"], src[g + ".weight_scale"][64:])
    desc = json.loads((out / "rank_05" / "quant_model_description.json").read_text())
    r5 = rank_tensors(out / "rank_05")
    assert desc["model_quant_type"] == "W8A8" and desc["group_size"] == 8
    assert set(k for k in desc if k not in ("model_quant_type", "version", "group_size")) == set(r5)
    assert run_cli(["verify", out]).code == 0


# ------------------------------------------------------------------------------------------------ CLI behaviour
def test_rejection_exits_3_writes_nothing_and_json_lists_alternatives(run_cli, tiny_model, tmp_path):
    model = tiny_model("deepseek_v3", dtype="bf16", n_routed_experts=12)
    out = tmp_path / "sh"
    res = run_cli(["shard", "--format", "ranks", "-m", model, "--ep", "8", "--tp", "1", "-o", out])  # 12 experts over 8 EP ranks
    assert res.code == 3 and not out.exists()
    for needle in ("unbalanced", "12 experts do not divide over ep 8", "ranks 0-3 (4 cards)",
                   "valid layouts for world 8", "--ep 4 --tp"):
        assert needle in res.err
    res = run_cli(["shard", "--format", "ranks", "-m", model, "--ep", "8", "--tp", "1", "-o", out, "--json"])
    obj = json.loads(res.out)
    assert res.code == 3 and obj["ok"] is False and not out.exists()
    assert obj["alternatives"] and all(12 % a["ep"] == 0 for a in obj["alternatives"])
    assert any("unbalanced" in r for r in obj["rejections"])


def test_fit_rejection_through_the_cli(run_cli, ds_bf16, tmp_path):
    res = run_cli(["shard", "--format", "ranks", "-m", ds_bf16, "--ep", "4", "--tp", "2", "--soc", "Ascend310P3", "--max-context",
                   "1000000", "--batch", "100", "--dry-run"])
    assert res.code == 3 and "Ascend310P3" in res.err and "KV tokens asked" in res.err


def test_dry_run_and_config_write_nothing_but_plot(run_cli, ds_bf16, tmp_path):
    png = tmp_path / "chart.png"
    res = run_cli(["shard", "--format", "ranks", "-m", ds_bf16, "--ep", "4", "--tp", "2", "--dry-run", "--plot", png,
                   "-o", tmp_path / "sh"])
    assert res.code == 0 and not (tmp_path / "sh").exists()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "rank   7 n0/c7" in res.out and "plan OK" in res.out
    res = run_cli(["shard", "--format", "ranks", "--config", ds_bf16 / "config.json", "--ep", "4", "--tp", "2"])
    assert res.code == 0 and "printing the plan only" in res.err


def test_eplb_from_the_input_dirs_expert_load_writes_the_expert_map(run_cli, ds_quant, tmp_path):
    q = shutil.copytree(ds_quant, tmp_path / "q")
    load = {str(layer): [1000 if e == 2 else 10 for e in range(16)] for layer in (1, 2)}
    (q / "expert_load.json").write_text(json.dumps({"layers": load}))
    res = run_cli(["shard", "--format", "ranks", "-m", q, "--ep", "4", "--tp", "2", "--placement", "eplb", "--redundant-experts", "4",
                   "-o", tmp_path / "sh"])
    assert res.code == 0, res.err
    assert "balancedness" in res.out and "expert_load.json" in res.err
    m = json.loads((tmp_path / "sh" / "expert_map.json").read_text())
    assert m["moe_layer_count"] == 2 and len(m["layer_list"][0]["device_list"]) == 4
    flat = [e for d in m["layer_list"][0]["device_list"] for e in d["device_expert"]]
    assert len(flat) == 20 and flat.count(2) >= 2
    assert run_cli(["verify", tmp_path / "sh"]).code == 0


def test_workspace_default_input_is_the_quantize_output(run_cli, ds_bf16, ds_quant, tmp_path):
    assert run_cli(["init", "--model", ds_bf16, "--output", "out"], cwd=tmp_path).code == 0
    res = run_cli(["shard", "--format", "ranks", "--ep", "2", "--tp", "2", "--dry-run", "--json"], cwd=tmp_path)
    assert res.code == 0 and json.loads(res.out)["source"]["kind"] == "checkpoint"
    q = shutil.copytree(ds_quant, tmp_path / "out" / "quant")
    (q / "dsconv_manifest.json").write_text(json.dumps({"stage": "quantize", "files": {}}))
    res = run_cli(["shard", "--format", "ranks", "--ep", "2", "--tp", "2", "--json"], cwd=tmp_path)
    assert res.code == 0, res.err
    assert json.loads(res.out)["source"]["kind"] == "quantized"
    assert (tmp_path / "out" / "shard" / "rank_03" / "quant_model_weights.safetensors").is_file()


def test_bad_options_exit_2(run_cli, ds_bf16, tmp_path):
    for args, needle in ((["--ep", "4", "--tp", "2", "--world", "16", "--nodes", "1", "--cards-per-node", "8"],
                          "--world 16 but"),
                         (["--ep", "4", "--tp", "2", "--placement", "eplb"], "needs --expert-load"),
                         (["--ep", "4", "--tp", "2", "--soc", "Ascend999"], "no dsconv profile"),
                         (["--ep", "4", "--tp", "2", "--memory-fraction", "1.5"], "out of range")):
        res = run_cli(["shard", "--format", "ranks", "-m", ds_bf16, "--dry-run", *args])
        assert res.code == 2 and needle in res.err and "Traceback" not in res.err


def test_dense_gqa_with_bias_replicates_kv_heads(run_cli, tiny_model, tmp_path):
    model = tiny_model("qwen2", dtype="bf16")  # 4 heads, 2 KV heads, q/k/v biases
    out = tmp_path / "sh"
    res = run_cli(["shard", "--format", "ranks", "-m", model, "--tp", "4", "-o", out])
    assert res.code == 0, res.err
    assert "each KV head (k_proj/v_proj) is replicated on 2 cards" in res.out
    src = load_file(model / "model.safetensors")
    r2, r3 = rank_tensors(out / "rank_02"), rank_tensors(out / "rank_03")
    k = "model.layers.1.self_attn.k_proj"
    assert torch.equal(r3[k + ".bias"], src[k + ".bias"][16:32]) and torch.equal(r2[k + ".weight"], r3[k + ".weight"])
    assert torch.equal(r3["model.layers.1.self_attn.q_proj.bias"], src["model.layers.1.self_attn.q_proj.bias"][48:])
    assert json.loads((out / "mindie_parallel.json").read_text()) == {"worldSize": 4, "tp": 4, "dp": 1}
    assert run_cli(["verify", out]).code == 0
