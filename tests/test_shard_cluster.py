"""Cluster files: the HCCL v1.0 rank table from --hosts (JSON or text) or placeholders, its validation, and MindIE's
parallel settings."""
from __future__ import annotations

import json

import pytest

from dsconv.errors import UserError
from dsconv.shard import ranktable as R
from dsconv.shard.layout import make_layout

pytestmark = pytest.mark.cli


def test_rank_table_matches_the_reference_shape():
    hosts = [R.Host("10.0.0.1", ("192.168.100.101", "192.168.100.102")),
             R.Host("10.0.0.2", ("192.168.100.111", "192.168.100.112"))]
    t = R.build_rank_table(hosts)
    assert t["version"] == "1.0" and t["server_count"] == "2" and t["status"] == "completed"
    s1 = t["server_list"][1]
    assert s1["server_id"] == "10.0.0.2" and s1["container_ip"] == "10.0.0.2"
    assert s1["device"][0] == {"device_id": "0", "device_ip": "192.168.100.111", "rank_id": "2"}

    def strings(o):
        if isinstance(o, dict):
            return all(strings(v) for v in o.values())
        if isinstance(o, list):
            return all(strings(v) for v in o)
        return isinstance(o, str)

    assert strings(t)


def test_placeholders_are_documentation_addresses():
    t = R.build_rank_table(R.placeholder_hosts(4, 8))
    assert [s["server_id"] for s in t["server_list"]] == ["192.0.2.1", "192.0.2.2", "192.0.2.3", "192.0.2.4"]
    ips = [d["device_ip"] for s in t["server_list"] for d in s["device"]]
    assert len(set(ips)) == 32 and all(ip.startswith("198.51.100.") for ip in ips)
    assert [d["rank_id"] for d in t["server_list"][3]["device"]][-1] == "31"
    big = R.placeholder_hosts(40, 8)  # 320 cards spill into the second documentation range
    assert big[-1].device_ips[-1].startswith("203.0.113.")


def test_read_hosts_text_and_json(tmp_path):
    txt = tmp_path / "hosts.txt"
    txt.write_text("# cluster\n10.0.0.1 192.168.1.1 192.168.1.2  # node 0\n\n10.0.0.2 192.168.1.3 192.168.1.4\n")
    hosts = R.read_hosts(txt)
    assert [h.server_ip for h in hosts] == ["10.0.0.1", "10.0.0.2"] and hosts[1].device_ips[1] == "192.168.1.4"
    js = tmp_path / "hosts.json"
    js.write_text(json.dumps({"servers": [{"server_ip": "10.0.0.1", "container_ip": "172.17.0.2",
                                           "device_ips": ["192.168.1.1"]}]}))
    h = R.read_hosts(js)
    assert h[0].container_ip == "172.17.0.2"
    assert R.build_rank_table(h)["server_list"][0]["container_ip"] == "172.17.0.2"


@pytest.mark.parametrize("text, needle", [
    ("10.0.0.1 192.168.1.300\n", "is not an IP address"),
    ("10.0.0.1 fe80::1\n", "IPv6"),
    ("10.0.0.1 192.168.1.1\n10.0.0.2 192.168.1.1\n", "used twice"),
    ("10.0.0.1 192.168.1.1 192.168.1.2\n10.0.0.2 192.168.1.3\n", "different numbers of devices"),
    ("10.0.0.1\n", "SERVER_IP DEVICE_IP"),
    ("0.0.0.0 192.168.1.1\n", "cannot be a server"),
    ('{"servers": [{"server_ip": "10.0.0.1", "device_ips": ["192.168.1.1"], "port": 1}]}', "unknown key"),
    ("# nothing\n", "lists no server"),
])
def test_bad_hosts_files(tmp_path, text, needle):
    f = tmp_path / "hosts"
    f.write_text(text)
    with pytest.raises(UserError, match=needle):
        R.read_hosts(f)


def test_validate_rank_table_rejects_non_strings_and_gaps():
    t = R.build_rank_table([R.Host("10.0.0.1", ("192.168.1.1", "192.168.1.2"))])
    t["server_list"][0]["device"][1]["rank_id"] = 1
    with pytest.raises(UserError, match="must be strings"):
        R.validate_rank_table(t)
    t["server_list"][0]["device"][1]["rank_id"] = "5"
    with pytest.raises(UserError, match="expected device 1 rank 1"):
        R.validate_rank_table(t)


def test_mindie_parallel_settings():
    from dsconv.families.deepseek_v3 import DeepseekV3
    from dsconv.families.llama import Llama

    cfg = R.mindie_parallel(make_layout(8, 4), True, DeepseekV3())
    assert cfg == {"worldSize": 32, "tp": 4, "dp": 8, "moe_tp": 4, "moe_ep": 8,
                   "models": {"deepseekv2": {"ep_level": 1}}}
    assert cfg["tp"] * cfg["dp"] == cfg["worldSize"] == cfg["moe_tp"] * cfg["moe_ep"]
    assert R.mindie_parallel(make_layout(None, 8, is_moe=False), False, Llama()) == {"worldSize": 8, "tp": 8, "dp": 1}


def test_hosts_through_the_cli(run_cli, tiny_model, tmp_path):
    model = tiny_model("deepseek_v3", dtype="bf16")
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("".join(f"10.0.0.{n + 1} " + " ".join(f"192.168.{n}.{d + 1}" for d in range(4)) + "\n"
                             for n in range(2)))
    out = tmp_path / "sh"
    res = run_cli(["shard", "--format", "ranks", "-m", model, "--ep", "4", "--tp", "2", "--hosts", hosts, "-o", out])
    assert res.code == 0, res.err
    assert "placeholder" not in res.err
    t = json.loads((out / "ranktable.json").read_text())
    assert t["server_count"] == "2" and t["server_list"][1]["device"][3] == {
        "device_id": "3", "device_ip": "192.168.1.4", "rank_id": "7"}
    plan = json.loads((out / "plan.json").read_text())
    assert (plan["layout"]["nodes"], plan["layout"]["cards_per_node"]) == (2, 4)
    bad = run_cli(["shard", "--format", "ranks", "-m", model, "--ep", "4", "--tp", "2", "--hosts", hosts, "--nodes", "4", "--dry-run"])
    assert bad.code == 2 and "lists 2 servers x 4 devices" in bad.err
