"""Shard planning from headers: split rules per family against hand-computed slices, every rejection path,
MindIE's rules, and the full DeepSeek-V3 per-card figures against the reference's accounting."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsconv.checkpoint import Checkpoint, ConfigOnly
from dsconv.errors import UserError
from dsconv.io.tensorfile import TensorInfo
from dsconv.shard import plan as P
from dsconv.shard.layout import Layout, layout_violations, make_layout
from dsconv.shard.memory import FitSettings
from dsconv.shard.placement import iter_tensor_ranks, slice_for_rank, tensor_entry
from dsconv.shard.table import build_table

pytestmark = [pytest.mark.cli]

DATA = Path(__file__).parent / "data"
GiB = 2**30


def fit(**kw) -> FitSettings:
    return FitSettings(**{"soc": "Ascend910B3", "card_bytes": 64 * GiB, **kw})


def plan_for(src, ep, tp, world=None, nodes=None, cards=None, dp_attention=False, **opts) -> P.ShardPlan:
    table = build_table(src)
    layout = make_layout(ep, tp, world, nodes, cards, dp_attention, src.facts.is_moe)
    o = P.ShardOptions(fit=opts.pop("fit", fit()), **opts)
    return P.make_plan(table, layout, o)


def entries(plan: P.ShardPlan) -> dict[str, tuple[dict, list[int]]]:
    out = {}
    for name, kind, p, ranks in iter_tensor_ranks(plan.table, plan.ev, plan.owners()):
        out[name] = (tensor_entry(kind, p, ranks, plan.layout.world), ranks)
    return out


def rank_slice(entry: dict, rank: int):
    dim, lo, hi = slice_for_rank(entry, rank)
    return None if dim is None else (dim, lo, hi)


class SpecSource:
    """A headers-only source from a list of (name, dtype, shape): lets tests state any layout (int4, odd groups)."""

    def __init__(self, config: dict, specs: list[tuple[str, str, tuple]], quant: dict | None = None) -> None:
        from dsconv.families import family_for

        self.config = config
        self.family = family_for(config)
        self.facts = self.family.facts(config)
        self.root = Path(".")
        self.quant_description = quant
        self.tensors = {n: TensorInfo(n, d, tuple(s), Path("x"), 0, 0, n) for n, d, s in specs}
        self.roles = {n: self.family.classify(n, self.facts) for n in self.tensors}


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def llama(tiny_model):
    return Checkpoint.open(tiny_model("llama"))  # heads 4, kv heads 2, hidden 64, head_dim 16, vocab 320


@pytest.fixture(scope="module")
def deepseek(tiny_model):
    return Checkpoint.open(tiny_model("deepseek_v3"))  # MLA, 4 heads, 16 experts, layer 0 dense


@pytest.fixture(scope="module")
def full_fp8():
    return ConfigOnly.open(DATA / "deepseek_v3_config.json")


@pytest.fixture(scope="module")
def full_bf16(tmp_path_factory):
    cfg = json.loads((DATA / "deepseek_v3_config.json").read_text())
    cfg.pop("quantization_config")
    d = tmp_path_factory.mktemp("ds-bf16")
    (d / "config.json").write_text(json.dumps(cfg))
    return ConfigOnly.open(d / "config.json")


# ------------------------------------------------------------------------------------------------ layout options
def test_world_defaults_to_ep_times_tp_and_fills_nodes_of_eight():
    lay = make_layout(8, 4)
    assert (lay.world, lay.nodes, lay.cards_per_node, lay.dp, lay.moe_tp) == (32, 4, 8, 8, 4)
    lay = make_layout(4, 2)
    assert (lay.world, lay.nodes, lay.cards_per_node) == (8, 1, 8)
    lay = make_layout(8, 4, world=None, nodes=2, cards_per_node=16)
    assert (lay.world, lay.moe_tp, lay.dp) == (32, 4, 8)
    lay = make_layout(32, 4, world=32)
    assert (lay.moe_tp, lay.dp) == (1, 8)
    assert make_layout(None, 4, world=32, expert_tp=2).ep == 16


@pytest.mark.parametrize("kw, needle", [
    (dict(ep=8, tp=4, world=16, nodes=4, cards_per_node=8), "--world 16 but --nodes 4"),
    (dict(ep=8, tp=4, world=20), "does not fill nodes of 8"),
    (dict(ep=0, tp=4), "--ep 0 must be a positive"),
    (dict(ep=8, tp=4, expert_tp=2), "moe_ep x moe_tp == worldSize"),
])
def test_contradicting_options_are_user_errors(kw, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(")):
        make_layout(kw.pop("ep"), kw.pop("tp"), **kw)


def test_ep_on_a_dense_model_is_a_user_error():
    with pytest.raises(UserError, match="no routed experts"):
        make_layout(4, 2, is_moe=False)


def test_mindie_rules():
    assert layout_violations(Layout(32, 4, 8, 4, 8), True) == []
    bad = layout_violations(Layout(8, 4, 2, 4, 2), True)  # tp 4 and moe_tp 4 > 2 cards per node
    assert any("tp 4 exceeds the 2 cards per node" in b for b in bad)
    assert any("moe_tp 4" in b for b in bad)
    assert layout_violations(Layout(8, 8, 1, 4, 2), True) == []  # tp == world is allowed
    assert any("ep 5 does not divide world size 12" in b for b in layout_violations(Layout(12, 4, 5, 1, 12), True))


# ------------------------------------------------------------------------------------------------ split rules
def test_llama_gqa_slices_by_hand(llama):
    plan = plan_for(llama, None, 4)
    assert plan.ok and plan.layout.world == 4
    e = entries(plan)
    q, _ = e["model.layers.0.self_attn.q_proj.weight"]      # [64, 64]: 4 heads of 16 rows
    assert [rank_slice(q, r) for r in range(4)] == [(0, 0, 16), (0, 16, 32), (0, 32, 48), (0, 48, 64)]
    k, _ = e["model.layers.0.self_attn.k_proj.weight"]      # [32, 64]: 2 KV heads over tp 4 -> each on 2 cards
    assert [rank_slice(k, r) for r in range(4)] == [(0, 0, 16), (0, 0, 16), (0, 16, 32), (0, 16, 32)]
    assert any("each KV head" in n and "replicated on 2 cards" in n for n in plan.ev.notes)
    o, _ = e["model.layers.0.self_attn.o_proj.weight"]      # [64, 64] columns
    assert [rank_slice(o, r) for r in range(4)] == [(1, 0, 16), (1, 16, 32), (1, 32, 48), (1, 48, 64)]
    emb, _ = e["model.embed_tokens.weight"]                 # [320, 64] vocab rows
    assert rank_slice(emb, 3) == (0, 240, 320)
    down, _ = e["model.layers.1.mlp.down_proj.weight"]      # [64, 128] columns
    assert rank_slice(down, 1) == (1, 32, 64)
    norm, ranks = e["model.norm.weight"]
    assert norm["mode"] == "whole" and ranks == [0, 1, 2, 3]


def test_deepseek_mla_and_experts_by_hand(deepseek):
    plan = plan_for(deepseek, 4, 2)  # world 8: tp 2 x dp 4, ep 4 x moe_tp 2
    assert plan.ok, plan.reasons()
    e = entries(plan)
    qb, _ = e["model.layers.0.self_attn.q_b_proj.weight"]   # [96, 32] = 4 heads x 24: 2 heads per rank
    assert [rank_slice(qb, r) for r in (0, 1, 2, 3)] == [(0, 0, 48), (0, 48, 96), (0, 0, 48), (0, 48, 96)]
    kvb, _ = e["model.layers.0.self_attn.kv_b_proj.weight"]  # [128, 32] = 4 heads x (16 + 16)
    assert rank_slice(kvb, 5) == (0, 64, 128)
    for latent in ("q_a_proj", "kv_a_proj_with_mqa"):
        ent, ranks = e[f"model.layers.0.self_attn.{latent}.weight"]
        assert ent["mode"] == "whole" and len(ranks) == 8
    router, ranks = e["model.layers.1.mlp.gate.weight"]
    assert router["mode"] == "whole" and len(ranks) == 8
    # contiguous: EP rank i (cards 2i, 2i+1) owns experts 4i..4i+3, each split in two by expert-TP
    up5, ranks = e["model.layers.1.mlp.experts.5.up_proj.weight"]   # [32, 64]
    assert ranks == [2, 3] and rank_slice(up5, 2) == (0, 0, 16) and rank_slice(up5, 3) == (0, 16, 32)
    d5, _ = e["model.layers.1.mlp.experts.5.down_proj.weight"]      # [64, 32] columns
    assert rank_slice(d5, 3) == (1, 16, 32)
    sh, ranks = e["model.layers.1.mlp.shared_experts.gate_proj.weight"]
    assert len(ranks) == 8 and rank_slice(sh, 1) == (0, 16, 32)
    # bytes: every card the same (16 experts / 4 EP ranks)
    assert plan.balance.imbalance == 0


def test_dp_attention_splits_dense_parts_over_the_world(deepseek):
    plan = plan_for(deepseek, 4, 2, dp_attention=True)
    e = entries(plan)
    emb, _ = e["model.embed_tokens.weight"]  # vocab 320 over 8 cards
    assert emb["parts"] == 8 and rank_slice(emb, 7) == (0, 280, 320)
    qb, _ = e["model.layers.0.self_attn.q_b_proj.weight"]  # attention still tp 2
    assert qb["parts"] == 2
    base = plan_for(deepseek, 4, 2)
    assert plan.rank_bytes.max() < base.rank_bytes.max()


def test_mixtral_and_qwen2_moe_experts(tiny_model):
    mix = Checkpoint.open(tiny_model("mixtral"))  # 8 experts (w1/w2/w3)
    plan = plan_for(mix, 8, 1)
    e = entries(plan)
    w1, ranks = e["model.layers.0.block_sparse_moe.experts.6.w1.weight"]
    assert ranks == [6] and w1["mode"] == "whole"
    q2 = Checkpoint.open(tiny_model("qwen2_moe"))
    plan = plan_for(q2, 2, 2)  # shared_expert follows tp; shared_expert_gate is a router
    e = entries(plan)
    assert e["model.layers.0.mlp.shared_expert.up_proj.weight"][0]["parts"] == 2
    assert e["model.layers.0.mlp.shared_expert_gate.weight"][0]["mode"] == "whole"
    assert e["model.layers.0.mlp.experts.7.down_proj.weight"][1] == [2, 3]


# ------------------------------------------------------------------------------------------------ rejections
def reasons(plan) -> str:
    return "\n".join(plan.reasons())


def test_heads_not_divisible_by_tp_names_the_tensor(llama):
    plan = plan_for(llama, None, 8)
    assert not plan.ok
    assert "self_attn.q_proj.weight" in reasons(plan) and "4 attention heads cannot be split over tp 8" in reasons(plan)


def test_kv_heads_neither_divide_nor_are_divided(tiny_model):
    ck = Checkpoint.open(tiny_model("llama", num_attention_heads=12, num_key_value_heads=4, hidden_size=96))
    plan = plan_for(ck, None, 6)  # 12 heads ok, 4 KV heads vs tp 6: neither divides
    assert "k_proj.weight" in reasons(plan) and "4 KV heads cannot be split over tp 6" in reasons(plan)


def test_vocab_not_divisible(tiny_model):
    plan = plan_for(Checkpoint.open(tiny_model("llama", vocab_size=322)), None, 4)
    r = reasons(plan)
    assert "model.embed_tokens.weight: 322 vocab rows cannot be split evenly over tp 4" in r
    assert "lm_head.weight" in r


def test_fewer_experts_than_ep_ranks(tiny_model):
    plan = plan_for(Checkpoint.open(tiny_model("qwen2_moe")), 16, 1)
    assert "8 routed experts cannot fill 16 EP ranks: 8 EP ranks (8 cards) would hold no expert" in reasons(plan)


def test_uneven_experts_are_a_balance_rejection(deepseek):
    plan = plan_for(deepseek, 6, 1)
    assert not plan.ok and not plan.balance.ok
    r = reasons(plan)
    assert "16 experts do not divide over ep 6: EP ranks hold 3 or 2 experts" in r
    assert "ranks 0-3 (4 cards)" in r  # the four EP ranks with 3 experts are named
    assert plan_for(deepseek, 6, 1, tolerance=0.5).ok


def test_fp8_blocks_vs_split_on_full_config(full_fp8):
    # 256 % 32 == 0, but an expert's 2048 rows are 16 FP8 blocks: moe_tp 32 (ep 1) cannot split them
    plan = plan_for(full_fp8, 1, 32)
    r = reasons(plan)
    assert "mlp.experts.0.gate_proj.weight" in r and "16 FP8 128-blocks along rows cannot be split over moe_tp 32" in r
    assert "mlp.gate_proj.weight" in r and "144 FP8 128-blocks" in r  # dense MLP over tp 32


def test_int4_groups_and_packing_follow_the_split():
    cfg = json.loads((DATA / "deepseek_v3_config.json").read_text())
    cfg.update(num_hidden_layers=1, first_k_dense_replace=1, num_nextn_predict_layers=0, vocab_size=1024,
               hidden_size=512, intermediate_size=1024, num_attention_heads=8, q_lora_rank=64, kv_lora_rank=64)
    cfg.pop("quantization_config")
    L = "model.layers.0."
    specs = [("model.embed_tokens.weight", "BF16", (1024, 512)), ("lm_head.weight", "BF16", (1024, 512)),
             ("model.norm.weight", "BF16", (512,)),
             (L + "mlp.down_proj.weight", "I8", (256, 1024)),        # W4A16 packed rows [n/2, k]
             (L + "mlp.down_proj.weight_scale", "F32", (512, 8)),    # groups of 128 along k: 8 groups
             (L + "mlp.down_proj.weight_offset", "F32", (512, 8)),
             (L + "mlp.gate_proj.weight", "I8", (512, 512)),         # packed rows of 1024
             (L + "mlp.gate_proj.weight_scale", "F32", (1024, 4)),
             (L + "self_attn.o_proj.weight", "I8", (512, 1024)),     # W8A8 static, column split
             (L + "self_attn.o_proj.deq_scale", "F32", (512,)),
             (L + "self_attn.o_proj.quant_bias", "I32", (512,)),
             (L + "self_attn.o_proj.input_scale", "F32", (1,)),
             (L + "self_attn.o_proj.input_offset", "F32", (1,))]
    src = SpecSource(cfg, specs, quant={"model_quant_type": "W4A16", "group_size": 128})
    ok = plan_for(src, None, 8)
    assert ok.ok, ok.reasons()
    e = entries(ok)
    assert rank_slice(e[L + "mlp.down_proj.weight_scale"][0], 3) == (1, 3, 4)    # one group per rank
    assert rank_slice(e[L + "mlp.gate_proj.weight"][0], 1) == (0, 64, 128)        # 64 packed rows = 128 rows
    assert rank_slice(e[L + "mlp.gate_proj.weight_scale"][0], 1) == (0, 128, 256)
    assert e[L + "self_attn.o_proj.deq_scale"][0]["mode"] == "whole"              # per output channel: replicated
    assert e[L + "self_attn.o_proj.quant_bias"][0]["mode"] == "first"             # added once after all-reduce
    assert e[L + "self_attn.o_proj.input_scale"][0]["mode"] == "whole"
    bad = plan_for(src, None, 16, world=16, nodes=2, cards=8)                     # 8 groups over 16
    assert "mlp.down_proj.weight: 8 groups of 128 along columns cannot be split over tp 16" in reasons(bad)


def test_mindie_rule_rejection_lists_valid_alternatives(llama):
    table = build_table(llama)
    lay = make_layout(None, 4, world=8, nodes=4, cards_per_node=2, is_moe=False)
    plan = P.make_plan(table, lay, P.ShardOptions(fit=fit()))
    assert not plan.ok and "exceeds the 2 cards per node" in reasons(plan)
    alts = P.find_alternatives(table, lay, P.ShardOptions(fit=fit()))
    assert alts and all(a["tp"] in (1, 2, 8) for a in alts) and alts[0]["command"].startswith("--ep 1 --tp")


def test_fit_rejection_reports_kv_room(deepseek):
    plan = plan_for(deepseek, 4, 2, fit=fit(max_context=1_000_000, batch=300))
    assert not plan.ok and not plan.fit.ok
    assert "all 8 cards: needs" in reasons(plan) and "KV tokens asked" in reasons(plan)
    small = plan_for(deepseek, 4, 2)
    assert small.fit.ranks[0]["kv_tokens_left"] > 0


# ------------------------------------------------------------------------------------------------ full DeepSeek-V3
def test_full_deepseek_per_card_bytes_match_the_reference(full_fp8, full_bf16):
    """Reference: 24.9 GiB (W8A8/FP8) and 48.5 GiB (BF16) per card for ep 8 x moe_tp 4, tp 4 x dp 8, routed experts
    19.36 / 38.72 GiB of it. dsconv also places the MTP layer's own copies of the embedding and head
    (model.layers.61.embed_tokens / shared_head.head, 1.73 GiB each, /4 by tp): add those 0.86 GiB to the reference."""
    mtp_copies = 2 * 129280 * 7168 * 2 / 4
    for src, ref_total, ref_experts in ((full_fp8, 24.9, 19.36), (full_bf16, 48.5, 38.72)):
        plan = plan_for(src, 8, 4)
        assert plan.layout.world == 32 and plan.balance.imbalance == 0
        experts = (plan.rank_bytes[0] - plan.ev.common_bytes) / GiB
        assert experts == pytest.approx(ref_experts, abs=0.01)
        assert (plan.rank_bytes[0] - mtp_copies) / GiB == pytest.approx(ref_total, abs=0.05)
    assert full_fp8.facts.kv_bytes_per_token(2, 4) == 70272


def test_full_deepseek_alternatives_are_fast_and_valid(full_bf16):
    plan = plan_for(full_bf16, 8, 4)  # 49.3 GiB of BF16 weights + workspace > 0.8 x 64 GiB
    assert not plan.ok and not plan.fit.ok
    table = plan.table
    alts = P.find_alternatives(table, plan.layout, plan.options)
    assert alts and all(a["min_kv_tokens"] > 0 for a in alts)
    assert alts == sorted(alts, key=lambda a: -a["min_kv_tokens"])


def test_stage_returns_a_rejected_plan_as_a_result_and_renders_it():
    """run() never raises for a rejected plan: the command prints the plan first, then raises result.failure."""
    from dsconv.errors import CheckFailed
    from dsconv.shard.stage import ShardRequest, render, run

    ok = run(ShardRequest(config=DATA / "deepseek_v3_config.json", ep=8, tp=4))
    assert ok.failure is None and ok.plan["ok"] and ok.written is None  # --config: plan only
    assert render(ok) == ok.text and "plan OK" in ok.text
    bad = run(ShardRequest(config=DATA / "deepseek_v3_config.json", ep=1, tp=1, max_context=10**7))
    assert isinstance(bad.failure, CheckFailed) and not bad.plan["ok"] and bad.plan["rejections"]
    assert "rejected" in bad.failure.one_line()
