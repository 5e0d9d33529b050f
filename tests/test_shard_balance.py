"""Expert placement: DeepSeek's EPLB (against its published example and a skewed load), balanced-by-bytes, the
expert_load.json reader, the vLLM-Ascend expert map, and the balance check."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dsconv.checkpoint import Checkpoint
from dsconv.errors import UserError
from dsconv.shard import balance as B
from dsconv.shard import plan as P
from dsconv.shard.layout import make_layout
from dsconv.shard.memory import FitSettings
from dsconv.shard.placement import iter_tensor_ranks
from dsconv.shard.table import build_table

pytestmark = pytest.mark.cli

FIT = FitSettings(soc="Ascend910B3", card_bytes=64 * 2**30)


def test_eplb_reproduces_deepseeks_published_example():
    """EPLB README: 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs -> this physical-to-logical map."""
    w = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                  [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]], dtype=float)
    expected = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    for row, want in zip(w, expected):
        slots = B.eplb_layer(row, 16, 4, 2, 8)
        assert [e for gpu in slots for e in gpu] == want


def test_eplb_on_a_skewed_load_replicates_the_hottest_and_balances():
    rng = np.random.default_rng(0)
    load = rng.integers(10, 20, size=(3, 16)).astype(float)
    load[:, 0] = 400.0   # one very hot expert per layer
    load[:, 5] = 150.0
    ebytes = np.ones((3, 16), dtype=np.int64)
    before = B.place_experts("contiguous", 16, 4, ebytes, load=load)
    after = B.place_experts("eplb", 16, 4, ebytes, load=load, redundant=4)
    rep = after.load_report
    assert rep["before"]["balancedness"] < 0.45 < 0.8 < rep["after"]["balancedness"]
    assert rep["after"]["max_load"] < rep["before"]["max_load"]
    for layer in after.slots:
        assert [len(s) for s in layer] == [5, 5, 5, 5]                 # equal slots per EP rank
        flat = [e for s in layer for e in s]
        assert sorted(set(flat)) == list(range(16))                    # every expert somewhere
        assert flat.count(0) == 4 and flat.count(5) == 2                # 400 -> 4 copies of 100, 150 -> 2 of 75
    owners = after.owners(16)
    assert all(sorted(o[0]) == [0, 1, 2, 3] for o in owners)           # the 4 copies on 4 different EP ranks
    assert before.load_report["after"] == before.load_report["before"]  # contiguous: load reported, unchanged


def test_eplb_is_hierarchical_when_groups_divide_over_nodes():
    load = np.arange(1, 65, dtype=float).reshape(2, 32)
    p = B.place_experts("eplb", 32, 8, np.ones((2, 32), dtype=np.int64), load=load, redundant=8, num_groups=4,
                        num_nodes=2)
    assert p.hierarchical
    # node 0 holds EP ranks 0-3: the experts of two whole groups (of 8), replicas stay inside the node
    for layer in p.slots:
        node0 = {e // 8 for s in layer[:4] for e in s}
        node1 = {e // 8 for s in layer[4:] for e in s}
        assert len(node0) == 2 and len(node1) == 2 and not node0 & node1
    flat = B.place_experts("eplb", 32, 8, np.ones((2, 32), dtype=np.int64), load=load, redundant=8, num_groups=3,
                           num_nodes=2)
    assert not flat.hierarchical


def test_balanced_placement_evens_out_uneven_expert_bytes():
    ebytes = np.full((4, 8), 100, dtype=np.int64)
    ebytes[:, 0] = 400      # e.g. expert 0 kept in BF16 by the quantizer
    ebytes[:, 1] = 400
    cont = B.place_experts("contiguous", 8, 4, ebytes, load=None)
    bal = B.place_experts("balanced", 8, 4, ebytes, load=None)
    spread = lambda p: p.ep_bytes(ebytes).max() / p.ep_bytes(ebytes).mean()  # noqa: E731
    assert spread(cont) > 1.4 and spread(bal) < spread(cont)
    assert all(len(s) == 2 for layer in bal.slots for s in layer)


@pytest.mark.parametrize("kw, needle", [
    (dict(strategy="contiguous", redundant=2), "needs --placement eplb"),
    (dict(strategy="eplb"), "needs --expert-load"),
    (dict(strategy="eplb", redundant=3, load=np.ones((1, 16))), "do not divide over 4 EP ranks"),
    (dict(strategy="nope"), "unknown"),
])
def test_placement_option_errors(kw, needle):
    with pytest.raises(UserError, match=needle):
        B.place_experts(kw.pop("strategy"), 16, 4, np.ones((1, 16), dtype=np.int64), load=kw.pop("load", None),
                        **kw)


def test_read_expert_load_formats_and_errors(tmp_path):
    f = tmp_path / "expert_load.json"
    f.write_text(json.dumps({"layers": {"1": [5] * 4, "2": [1, 2, 3, 4]}, "tokens": 10}))
    load, missing = B.read_expert_load(f, 4, (1, 2, 3))
    assert missing == [3] and load[1].tolist() == [1, 2, 3, 4] and load[2].tolist() == [1, 1, 1, 1]
    f.write_text(json.dumps({"1": [1, 2, 3, 4]}))  # the bare map
    assert B.read_expert_load(f, 4, (1,))[0][0].tolist() == [1, 2, 3, 4]
    for bad, needle in (({"layers": {"9": [1] * 4}}, "layer 9 is not a MoE layer"),
                        ({"layers": {"1": [1, 2]}}, "must list 4 non-negative"),
                        ({"layers": {"x": [1] * 4}}, "not a layer number"),
                        ([1, 2], "expected")):
        f.write_text(json.dumps(bad))
        with pytest.raises(UserError, match=needle):
            B.read_expert_load(f, 4, (1,))
    f.write_text("{")
    with pytest.raises(UserError, match="invalid JSON"):
        B.read_expert_load(f, 4, (1,))


def test_expert_map_has_vllm_ascend_layout():
    p = B.place_experts("eplb", 8, 2, np.ones((1, 8), dtype=np.int64),
                        load=np.array([[50, 1, 1, 1, 1, 1, 1, 40]], dtype=float), redundant=2)
    m = B.expert_map(p)
    assert m["moe_layer_count"] == 1
    layer = m["layer_list"][0]
    assert layer["layer_id"] == 0 and layer["device_count"] == 2
    devs = layer["device_list"]
    assert [d["device_id"] for d in devs] == [0, 1] and all(len(d["device_expert"]) == 5 for d in devs)
    flat = [e for d in devs for e in d["device_expert"]]
    assert flat.count(0) == 2 and flat.count(7) == 2  # the two hot experts are the redundant ones


def test_check_balance_groups_cards_and_respects_tolerance():
    ok = B.check_balance(np.array([100, 101, 100, 99]), 0.02, str)
    assert ok.ok and ok.imbalance == pytest.approx(0.01)
    bad = B.check_balance(np.array([130, 130, 70, 70]), 0.02, lambda rs: f"ranks {rs}")
    assert not bad.ok and bad.imbalance == pytest.approx(0.3)
    assert bad.reasons[0].startswith("ranks [0, 1]") and "+30.0%" in bad.reasons[0]


def test_eplb_through_the_plan_on_the_tiny_model(tiny_model):
    ck = Checkpoint.open(tiny_model("deepseek_v3"))
    load = np.ones((2, 16))
    load[:, 3] = 100
    table = build_table(ck)
    lay = make_layout(4, 2, is_moe=True)
    plan = P.make_plan(table, lay, P.ShardOptions(placement="eplb", redundant=4, fit=FIT, load=load, num_groups=4))
    assert plan.ok, plan.reasons()
    holders = {}
    for name, kind, p, ranks in iter_tensor_ranks(table, plan.ev, plan.owners()):
        holders[name] = ranks
    hot = holders["model.layers.1.mlp.experts.3.up_proj.weight"]
    assert len(hot) >= 4 and len(hot) % 2 == 0  # two or more EP ranks, each of 2 cards (moe_tp 2)
    assert plan.balance.imbalance == 0  # equal slots per EP rank: equal bytes
