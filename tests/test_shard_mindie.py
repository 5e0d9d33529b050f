"""MindIE's offline-sharded DeepSeek layout: one test per rule taken from MindIE-LLM (sources in each docstring;
docs/engine_rules.md A.1-A.5), each computed independently from the source checkpoint with torch."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dsconv.shard.mindie_sharded import Ranks, assign_experts, rope_rows

pytestmark = pytest.mark.cli

EP, TP = 4, 2  # world 8: attn tp 2 x dp 4; moe_ep 4 x moe_tp 2


def _load(d, folder, name):
    with safe_open(str(d / folder / "model.safetensors"), "pt") as h:
        return h.get_tensor(name)


def _names(d, folder):
    with safe_open(str(d / folder / "model.safetensors"), "pt") as h:
        return set(h.keys())


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, run_cli):
    from dsconv.checkpoint import Checkpoint
    from dsconv.demo import write_demo_model

    root = tmp_path_factory.mktemp("mindie")
    model = write_demo_model(root / "model")
    q = root / "q"
    r = run_cli(["quantize", "-m", model, "--bits", "8", "--calib-samples", "4", "--seq-len", "32", "-o", q])
    assert r.code == 0, r.err
    out = root / "sh"
    r = run_cli(["shard", "-m", q, "--ep", EP, "--tp", TP, "-o", out])
    assert r.code == 0, r.err
    return out, Checkpoint.open(q)


def test_sub_ranks_and_folder_names():
    """atb/utils/mapping.py::Mapping.get_tp_group/get_dp_group (the notes' example: dp 2, tp 8, moe_tp 4, moe_ep 4,
    rank 13 -> attn_tp 5, moe_tp 1, moe_ep 3); model_utils.py::BaseModel.save_sharded (zfill(3), dense by attn_tp)."""
    rk = Ranks(world=16, tp=8, moe_tp=4, moe_ep=4)
    assert (rk.attn_tp(13), 13 // rk.tp, rk.moe_tp_rank(13), rk.moe_ep_rank(13)) == (5, 1, 1, 3)
    assert rk.folders(13) == {"moe": "model-moe-tp-001-ep-003", "dense": "model-dense-tp-005",
                              "attn": "model-attn-tp-005", "model": "model-013", "norm": "model-norm"}


def test_expert_assignment_contiguous_blocks():
    """atb/utils/moe_utils.py::assign: ceil(E / ep) per rank, the last gets the remainder."""
    assert [list(r) for r in assign_experts(10, 4)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_rope_rows_even_then_odd():
    """process_mla_linear.py::trans_rope_weight: per head, the last rope rows even first then odd."""
    assert rope_rows(0, 2, 2, 4).tolist() == [0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]


def test_metadata_and_root_files(sharded):
    """model_utils.py::BaseModel.save_sharded_metadata (world_size, parallel_option, os.walk listing);
    convert_utils.py::modify_config (only torch_dtype rewritten) and ::copy_tokenizer_files."""
    d, src = sharded
    meta = json.loads((d / "model_sharded_metadata.json").read_text())
    assert meta["world_size"] == 8 and meta["parallel_option"] == {"dp": 4, "tp": 2, "moe_tp": 2, "moe_ep": 4}
    for folder, files in meta["model_sharded"].items():
        if folder != ".":
            assert sorted(p.name for p in (d / folder).iterdir() if not p.name.startswith(".")) == files
    assert len([f for f in meta["model_sharded"] if f != "."]) == 8 + 2 + 2 + 8 + 1
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["quantize"] == "w8a8_dynamic" and cfg["mla_quantize"] == "w8a8"
    assert {p.name for p in d.iterdir()} >= {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}


def test_folder_routing(sharded):
    """flash_causal_deepseekv2.py::get_module_save_dir: "norm" -> model-norm; "self_attn" -> attn; mlp of MoE layers
    -> moe, of dense layers -> dense; the rest (embed, lm_head) -> model-{rank}."""
    d, src = sharded
    assert all("norm" in n for n in _names(d, "model-norm"))
    assert all("self_attn" in n and "norm" not in n for n in _names(d, "model-attn-tp-001"))
    assert all(n.startswith("model.layers.0.mlp.") for n in _names(d, "model-dense-tp-000"))
    assert all(".mlp." in n and not n.startswith("model.layers.0.") for n in _names(d, "model-moe-tp-001-ep-002"))
    assert _names(d, "model-005") == {"model.embed_tokens.weight", "lm_head.weight"}


def test_k_b_v_b_split_of_kv_b(sharded):
    """modeling_deepseekv2.py L173-188 + process_mla_linear.py::preprocess_kv_weights: rank a's heads of kv_b,
    reshaped [h, nope+v, lora]; k_b = [:, :nope], v_b = [:, nope:].transpose(1, 2)."""
    d, src = sharded
    f = src.facts
    kv = src.load("model.layers.1.self_attn.kv_b_proj.weight")
    hl = f.num_heads // TP
    a = 1
    block = kv.reshape(f.num_heads, f.qk_nope_head_dim + f.v_head_dim, f.kv_lora_rank)[a * hl:(a + 1) * hl]
    k_b = _load(d, "model-attn-tp-001", "model.layers.1.self_attn.k_b_proj.weight")
    v_b = _load(d, "model-attn-tp-001", "model.layers.1.self_attn.v_b_proj.weight")
    assert torch.equal(k_b, block[:, :f.qk_nope_head_dim])
    assert torch.equal(v_b, block[:, f.qk_nope_head_dim:].transpose(1, 2))
    assert "model.layers.1.self_attn.kv_b_proj.weight" not in _names(d, "model-attn-tp-001")


def test_q_b_cut_and_rope_permutation(sharded):
    """TensorParallelColumnLinear.load_multi(projq) + preprocess_linear_for_rope: heads cut over attn tp, rope rows
    even-then-odd; W8A8 deq_scale / quant_bias permuted alike; input_scale/offset whole (input_offset int8)."""
    d, src = sharded
    f = src.facts
    P = "model.layers.1.self_attn.q_b_proj"
    D = f.qk_nope_head_dim + f.qk_rope_head_dim
    hl = f.num_heads // TP
    w = src.load(P + ".weight")[hl * D:2 * hl * D].reshape(hl, D, -1)
    nope = w[:, :f.qk_nope_head_dim]
    rope = w[:, f.qk_nope_head_dim:]
    want = torch.cat([nope, rope[:, 0::2], rope[:, 1::2]], 1).reshape(hl * D, -1)
    assert torch.equal(_load(d, "model-attn-tp-001", P + ".weight"), want)
    deq = src.load(P + ".deq_scale")[hl * D:2 * hl * D].reshape(hl, D)
    want_deq = torch.cat([deq[:, :f.qk_nope_head_dim], deq[:, f.qk_nope_head_dim::2][:, :f.qk_rope_head_dim // 2],
                          deq[:, f.qk_nope_head_dim + 1::2]], 1).reshape(-1)
    assert torch.equal(_load(d, "model-attn-tp-001", P + ".deq_scale"), want_deq)
    off = _load(d, "model-attn-tp-001", P + ".input_offset")
    assert off.dtype == torch.int8 and off.item() == int(src.load(P + ".input_offset").item())


def test_kv_a_replicated_with_rope_rows(sharded):
    """TensorReplicatedLinear.load: kv_a_proj_with_mqa whole, its last rope rows even-then-odd."""
    d, src = sharded
    f = src.facts
    w = src.load("model.layers.2.self_attn.kv_a_proj_with_mqa.weight")
    lora = f.kv_lora_rank
    want = torch.cat([w[:lora], w[lora::2], w[lora + 1::2]])
    for a in ("000", "001"):
        assert torch.equal(_load(d, f"model-attn-tp-{a}", "model.layers.2.self_attn.kv_a_proj_with_mqa.weight"), want)


def test_o_proj_row_cut_and_quant_bias_on_rank0(sharded):
    """weights.py::get_multi_weights_row (W8A8): weight cut on dim 1, deq_scale whole, quant_bias whole on TP rank 0
    and zeros on the others."""
    d, src = sharded
    P = "model.layers.1.self_attn.o_proj"
    w = src.load(P + ".weight")
    k = w.shape[1] // TP
    assert torch.equal(_load(d, "model-attn-tp-001", P + ".weight"), w[:, k:])
    assert torch.equal(_load(d, "model-attn-tp-001", P + ".deq_scale"), src.load(P + ".deq_scale"))
    assert torch.equal(_load(d, "model-attn-tp-000", P + ".quant_bias"), src.load(P + ".quant_bias"))
    assert not _load(d, "model-attn-tp-001", P + ".quant_bias").any()


def test_dense_gate_up_fused_and_dynamic_offsets(sharded):
    """DeepseekMLP: gate_up_proj = [gate_r; up_r] (rows of attn tp rank r); W8A8LinearDynamic: weight_scale
    flattened [n], weight_offset negated and flattened."""
    d, src = sharded
    p = "model.layers.0.mlp."
    g, u = src.load(p + "gate_proj.weight"), src.load(p + "up_proj.weight")
    n = g.shape[0] // TP
    assert torch.equal(_load(d, "model-dense-tp-001", p + "gate_up_proj.weight"), torch.cat([g[n:], u[n:]]))
    sc = torch.cat([src.load(p + "gate_proj.weight_scale")[n:], src.load(p + "up_proj.weight_scale")[n:]])
    got = _load(d, "model-dense-tp-001", p + "gate_up_proj.weight_scale")
    assert got.shape == (2 * n,) and torch.equal(got, sc.reshape(-1).to(torch.bfloat16))
    off = _load(d, "model-dense-tp-001", p + "gate_up_proj.weight_offset")
    assert off.shape == (2 * n,) and torch.equal(off.float(), -torch.cat([
        src.load(p + "gate_proj.weight_offset")[n:], src.load(p + "up_proj.weight_offset")[n:]]).reshape(-1))


def test_routed_experts_stacked_and_router_in_source_order(sharded):
    """DeepseekMoE.init_experts + TensorParallelColumnLinear.load_moe / RowLinear.load_moe: the EP rank's experts
    stacked, each cut by moe_tp; router (noaux_tc): weight float32, bias = correction bias - min, rows in source
    order on every EP rank: MindIE-LLM atb_llm/models/deepseek/modeling_deepseek.py DeepseekMoE.__init__ rotates
    them itself at load (`temp_list[self.device_expert[0]:] + temp_list[:self.device_expert[0]]`, then
    `self.gate.weight.data[temp_list]`) without checking weights.sharded; stored rotated they would turn twice."""
    d, src = sharded
    f = src.facts
    t, e = 1, 2
    folder = f"model-moe-tp-{t:03d}-ep-{e:03d}"
    local = list(assign_experts(f.num_experts, EP)[e])
    p = "model.layers.2.mlp."
    I = f.moe_intermediate_size // 2
    gu = _load(d, folder, p + "gate_up_proj.weight")
    assert gu.shape == (len(local), 2 * I, f.hidden_size)
    for j, x in enumerate(local):
        g = src.load(f"{p}experts.{x}.gate_proj.weight")[t * I:(t + 1) * I]
        u = src.load(f"{p}experts.{x}.up_proj.weight")[t * I:(t + 1) * I]
        assert torch.equal(gu[j], torch.cat([g, u]))
        dn = src.load(f"{p}experts.{x}.down_proj.weight")[:, t * I:(t + 1) * I]
        assert torch.equal(_load(d, folder, p + "down_proj.weight")[j], dn)
    assert local[0] > 0  # an EP rank where a rotation would show
    gw = _load(d, folder, p + "gate.weight")
    assert gw.dtype == torch.float32 and torch.equal(gw, src.load(p + "gate.weight").float())
    b = src.load(p + "gate.e_score_correction_bias").float()
    assert torch.equal(_load(d, folder, p + "gate.bias"), (b - b.min()).to(torch.bfloat16))


def test_embedding_and_lm_head_per_rank(sharded):
    """TensorParallelEmbedding: hidden cut (attention TP group, UNCONFIRMED) plus one zero row; lm_head: vocab rows
    of the world rank (load_column_multi lm_head=True over the MLP group)."""
    d, src = sharded
    r = 5
    emb = src.load("model.embed_tokens.weight")
    H = emb.shape[1] // TP
    got = _load(d, f"model-{r:03d}", "model.embed_tokens.weight")
    assert torch.equal(got[:-1], emb[:, (r % TP) * H:(r % TP + 1) * H]) and not got[-1].any()
    head = src.load("lm_head.weight")
    V = head.shape[0] // 8
    assert torch.equal(_load(d, f"model-{r:03d}", "lm_head.weight"), head[r * V:(r + 1) * V])


def test_description_uses_mindie_names(sharded):
    """flash_causal_deepseekv2.py::generate_description: MindIE-internal names (k_b/v_b, gate_up pack entries), the
    linear's type, the global type for tensors without a linear parent, QuantizationConfig fields."""
    d, _ = sharded
    desc = json.loads((d / "quant_model_description.json").read_text())
    assert desc["model_quant_type"] == "W8A8_DYNAMIC" and desc["version"] == "1.0.0"
    assert desc["model.layers.1.self_attn.k_b_proj.weight"] == "FLOAT"
    assert desc["model.layers.1.mlp.gate_up_proj.weight"] == "W8A8_DYNAMIC"
    assert desc["model.layers.1.self_attn.q_b_proj.weight"] == "W8A8"
    assert desc["model.layers.1.input_layernorm.weight"] == "W8A8_DYNAMIC"
    assert "model.layers.1.self_attn.kv_b_proj.weight" not in desc
    assert {"group_size", "kv_quant_type", "fa_quant_type", "reduce_quant_type"} <= set(desc)


def test_verify_catches_a_changed_byte_and_a_duplicate(sharded, run_cli, tmp_path):
    """dsconv verify: loader rules (weights.py::load_routing duplicates) and bit-exact reassembly of the source."""
    import shutil

    d, _ = sharded
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    f = bad / "model-attn-tp-000" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01
    f.write_bytes(bytes(data))
    from dsconv.shard.mindie_verify import verify

    manifest = json.loads((d / "dsconv_manifest.json").read_text())
    doc = json.loads((d / "plan.json").read_text())
    assert any("differs" in p for p in verify(bad, manifest, doc))
    shutil.copy(d / "model-norm" / "model.safetensors", bad / "model-000" / "extra.safetensors")
    assert any("routing weight key error" in p for p in verify(bad, manifest, doc))
    r = run_cli(["verify", d])
    assert r.code == 0, r.out + r.err


def test_other_engines_and_families_write_plan_only(run_cli, tiny_model, tmp_path):
    """Families an engine shards at load time: plan.json + cluster files, no weight copies, and it says so;
    --format mindie where MindIE has no offline layout is exit 2."""
    m = tiny_model("qwen3_moe", dtype="bf16")
    r = run_cli(["shard", "-m", m, "--ep", "2", "--tp", "2", "-o", tmp_path / "p"])
    assert r.code == 0 and "shards qwen3_moe at load time" in r.err and "no weight copies" in r.out
    assert not list((tmp_path / "p").rglob("*.safetensors"))
    assert (tmp_path / "p" / "plan.json").is_file() and (tmp_path / "p" / "ranktable.json").is_file()
    r = run_cli(["verify", tmp_path / "p"])
    assert r.code == 0, r.out + r.err
    r = run_cli(["shard", "-m", m, "--ep", "2", "--tp", "2", "--format", "mindie", "-o", tmp_path / "x"])
    assert r.code == 2 and "deepseek_v3" in r.err
    r = run_cli(["shard", "-m", tiny_model("deepseek_v3", dtype="bf16"), "--engine", "vllm-ascend", "--ep", "2",
                 "--tp", "2", "-o", tmp_path / "v"])
    assert r.code == 0 and "vllm-ascend shards deepseek_v3 at load time" in r.err


def test_folder_files_are_what_safetensors_save_file_writes(sharded, tmp_path):
    """model_utils.py::BaseModel.save_state_dict saves each folder with safetensors' save_file (metadata
    {"format": "pt"}): tensors sorted by dtype then name (safetensors tensor.rs::prepare), header padded to 8 bytes.
    dsconv's files are byte-identical to save_file of the same tensors."""
    from safetensors.torch import load_file, save_file

    d, _ = sharded
    for f in sorted(d.glob("model-*/model.safetensors")):
        ref = tmp_path / "ref.safetensors"
        save_file(load_file(str(f)), str(ref), metadata={"format": "pt"})
        assert f.read_bytes() == ref.read_bytes(), f


@pytest.mark.parametrize("min_run,fp8", [(None, False), (0, False), (None, True)],
                         ids=["default", "every-permutation-by-region", "fp8-source"])
def test_unchanged_tensors_are_copied_as_byte_regions_of_the_source(tiny_model, monkeypatch, tmp_path, min_run, fp8):
    """Most of the layout's bytes are source bytes in another order (experts stacked, row and column cuts, the padded
    embedding): the writer copies those by byte region (parts.Region: kernel copies, window gathers) instead of
    computing them. Every such tensor's regions, read back with numpy, equal MindIE's transform (`make`); the ones
    left to `make` are exactly those a transform touches (cast, negation, transpose, shift) or, by default, whose
    rows are permuted into short runs (the rope rows). From an FP8 checkpoint the dequantized linears are made, the
    rest (embedding, norms, head) still copied."""
    import numpy as np

    from dsconv.checkpoint import Checkpoint
    from dsconv.shard import mindie_sharded as M
    from dsconv.shard.layout import make_layout
    from dsconv.shard.mindie_write import build_plan

    if min_run is not None:
        monkeypatch.setattr(M, "MIN_RUN", min_run)
    model = tiny_model("deepseek_v3", dtype="bf16")
    if fp8:
        from dsconv.tiny import write_fp8_checkpoint

        model = write_fp8_checkpoint(model, tmp_path / "fp8", block=(16, 16))
    src = Checkpoint.open(model)
    plan = build_plan(src, make_layout(EP, TP))
    copied = made = 0
    for _, it in plan.items():
        want = M.make(it, src.load).contiguous().view(torch.uint8).numpy().tobytes()
        rg = M.regions(it, {p.src: src.info(p.src) for g in it.groups for p in g})
        fp8_src = any(p.src in src.fp8_scales for g in it.groups for p in g)
        touched = it.transpose12 or it.negate or it.shift_min or it.zeros or it.dtype != it.src_dtype or fp8_src
        if rg is None:
            assert touched or (min_run is None and any(p.rows is not None for g in it.groups for p in g)), it.name
            made += len(want)
            continue
        assert not touched, it.name
        got = b""
        for r in rg:
            if r.file is None:
                got += bytes(r.nbytes)
                continue
            raw = np.fromfile(r.file, np.uint8, count=(r.rows - 1) * r.stride + r.width, offset=r.start)
            got += np.lib.stride_tricks.as_strided(raw, (r.rows, r.width), (r.stride, 1)).tobytes() \
                if r.rows > 1 else raw.tobytes()
        assert got == want, it.name
        copied += len(want)
    assert copied > (0.15 if fp8 else 0.8) * (copied + made), (copied, made)
    src.close()


def test_verify_without_the_source_checks_the_loader_rules_and_says_so(run_cli, tiny_model, tmp_path):
    """The source moved: verify still checks MindIE's loader rules and the manifest's hashes, warns that it could not
    compare with the source, and passes; a source whose files changed size is a failure."""
    import shutil

    model = shutil.copytree(tiny_model("deepseek_v3", dtype="bf16"), tmp_path / "m")
    out = tmp_path / "sh"
    assert run_cli(["shard", "-m", model, "--ep", EP, "--tp", TP, "-o", out]).code == 0
    f = next(model.glob("*.safetensors"))
    f.write_bytes(f.read_bytes() + b"\0" * 8)
    r = run_cli(["verify", out])
    assert r.code != 0 and "changed since it was sharded" in r.out + r.err
    shutil.rmtree(model)
    r = run_cli(["verify", out])
    assert r.code == 0 and "is gone" in r.err, r.out + r.err


def test_coverage_is_counted_per_row_and_column_segment():
    """verify's coverage (mindie_verify.uncovered): every element of a source tensor must be in some folder; the
    count of the missing ones is exact for row sets x column ranges, 1-D and 3-D tensors included."""
    import numpy as np

    from dsconv.shard.mindie_sharded import Part
    from dsconv.shard.mindie_verify import uncovered

    full = [Part("w", (6, 4), None, (0, 4))]
    assert uncovered((6, 4), full) == 0
    halves = [Part("w", (6, 2), None, (0, 2)), Part("w", (5, 2), np.array([0, 1, 2, 4, 5]), (2, 4))]
    assert uncovered((6, 4), halves) == 2  # row 3, columns 2..3
    assert uncovered((6, 4), halves[:1]) == 12
    assert uncovered((10,), [Part("b", (7,), np.arange(7))]) == 3
    assert uncovered((2, 3, 5), [Part("e", (2, 1, 5), None, (0, 1))]) == 20  # 2 rows x 2 columns x 5
