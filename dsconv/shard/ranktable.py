"""The cluster files a plan produces: the HCCL rank table (v1.0) and MindIE's parallel settings.

`--hosts FILE` gives the addresses, in either form:

* JSON: `{"servers": [{"server_ip": "10.0.0.1", "device_ips": ["192.168.100.101", ...]}, ...]}`
  (`container_ip` optional per server, default the server_ip);
* text: one server per line, `SERVER_IP DEVICE_IP DEVICE_IP ...` (device IPs in device-id order, as
  `hccn_tool -i N -ip -g` prints them), `#` starts a comment.

Every address must be IPv4 (HCCL v1.0), server and device addresses unique, one line per node, cards per node devices
each. Without `--hosts` the table uses documentation addresses (RFC 5737: servers 192.0.2.x, devices 198.51.100.x then
203.0.113.x) that are valid but can never be real, and the command warns: replace them before launching.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsconv import schemas
from dsconv.errors import UserError

PLACEHOLDER_SERVERS = ipaddress.ip_network("192.0.2.0/24")
PLACEHOLDER_DEVICES = (ipaddress.ip_network("198.51.100.0/24"), ipaddress.ip_network("203.0.113.0/24"))


@dataclass(frozen=True)
class Host:
    server_ip: str
    device_ips: tuple[str, ...]
    container_ip: str | None = None


def _ipv4(text: Any, where: str) -> str:
    try:
        ip = ipaddress.ip_address(str(text).strip())
    except ValueError:
        raise UserError(f"{where}: {text!r} is not an IP address", hint="write dotted IPv4, e.g. 10.0.0.1") from None
    if ip.version != 4:
        raise UserError(f"{where}: {ip} is IPv6; the HCCL v1.0 rank table takes IPv4", hint="give the IPv4 address")
    if ip.is_unspecified or ip.is_multicast or ip.is_loopback:
        raise UserError(f"{where}: {ip} cannot be a server or NPU address", hint="give the host's/NPU's real IPv4")
    return str(ip)


def read_hosts(path: Path) -> list[Host]:
    """Servers and device IPs from `--hosts` (JSON or text, see the module docstring); validated here."""
    path = Path(path)
    hosts = [Host(_ipv4(server, where), tuple(_ipv4(d, f"{where}.device_ips[{j}]") for j, d in enumerate(devices)),
                  _ipv4(container, where) if container else None)
             for server, devices, container, where in schemas.hosts_file(path)]
    seen: dict[str, str] = {}
    for i, h in enumerate(hosts):
        for ip, what in [(h.server_ip, f"server {i + 1}")] + [(d, f"server {i + 1} device {j}")
                                                              for j, d in enumerate(h.device_ips)]:
            if ip in seen:
                raise UserError(f"{path}: {ip} is used twice ({seen[ip]} and {what})",
                                hint="every server and NPU needs its own address")
            seen[ip] = what
    counts = {len(h.device_ips) for h in hosts}
    if len(counts) > 1:
        raise UserError(f"{path}: servers list different numbers of devices ({sorted(counts)})",
                        hint="MindIE needs the same number of cards on every node")
    return hosts


def placeholder_hosts(nodes: int, cards_per_node: int) -> list[Host]:
    servers = list(PLACEHOLDER_SERVERS.hosts())
    devices = [ip for net in PLACEHOLDER_DEVICES for ip in net.hosts()]
    if nodes > len(servers) or nodes * cards_per_node > len(devices):
        raise UserError(f"{nodes * cards_per_node} cards exceed the placeholder addresses",
                        hint="pass --hosts FILE with the real server and NPU addresses")
    return [Host(str(servers[n]), tuple(str(devices[n * cards_per_node + d]) for d in range(cards_per_node)))
            for n in range(nodes)]


def build_rank_table(hosts: list[Host]) -> dict[str, Any]:
    """HCCL rank table v1.0: every value a string, rank ids server by server, card by card."""
    table = {"version": "1.0", "server_count": str(len(hosts)), "server_list": [], "status": "completed"}
    rank = 0
    for h in hosts:
        devices = []
        for d, ip in enumerate(h.device_ips):
            devices.append({"device_id": str(d), "device_ip": ip, "rank_id": str(rank)})
            rank += 1
        table["server_list"].append({"server_id": h.server_ip, "container_ip": h.container_ip or h.server_ip,
                                     "device": devices})
    validate_rank_table(table)
    return table


def validate_rank_table(table: dict[str, Any]) -> None:
    """Check a v1.0 table as HCCL reads it: strings everywhere, consecutive rank ids, unique addresses."""
    def fail(msg: str) -> None:
        raise UserError(f"rank table: {msg}", hint="fix --hosts")

    if table.get("version") != "1.0" or table.get("status") != "completed":
        fail("version must be \"1.0\" and status \"completed\"")
    servers = table.get("server_list")
    if not isinstance(servers, list) or table.get("server_count") != str(len(servers)):
        fail("server_count must be the number of servers, as a string")
    expect, ips = 0, set()
    for s in servers:
        for key in ("server_id", "container_ip"):
            if not isinstance(s.get(key), str):
                fail(f"{key} must be a string")
        for d_i, d in enumerate(s.get("device", [])):
            if not all(isinstance(d.get(k), str) for k in ("device_id", "device_ip", "rank_id")):
                fail("device_id, device_ip and rank_id must be strings")
            if d["device_id"] != str(d_i) or d["rank_id"] != str(expect):
                fail(f"server {s['server_id']}: device {d['device_id']} has rank {d['rank_id']}, expected device "
                     f"{d_i} rank {expect}")
            ipaddress.IPv4Address(d["device_ip"])
            if d["device_ip"] in ips:
                fail(f"device ip {d['device_ip']} repeats")
            ips.add(d["device_ip"])
            expect += 1


def mindie_parallel(layout: Any, is_moe: bool, family: Any) -> dict[str, Any]:
    """The ModelConfig keys MindIE reads for parallelism (config.json of mindie-service); the family's model section
    sets ep_level 1 (AllGather EP: runs on any interconnect; 2, AllToAll, needs a switch between servers)."""
    cfg: dict[str, Any] = {"worldSize": layout.world, "tp": layout.tp, "dp": layout.dp}
    if is_moe:
        cfg.update(moe_tp=layout.moe_tp, moe_ep=layout.ep)
        if family.mindie_ep_section and layout.ep > 1:
            cfg["models"] = {family.mindie_ep_section: {"ep_level": 1}}
    return cfg
