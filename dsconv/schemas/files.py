"""What dsconv's own files and the user's side files must be: manifests, quant descriptions, dsconv.toml,
calibration sets, expert-load statistics, hosts files and ATC profiles.

Each reader returns plain data of checked types; the module that uses it keeps the meaning (IP rules, MoE layers,
profile keys). A failure is one line naming the file, the key or line, and the fix.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from dsconv.errors import UserError
from dsconv.io.digest import ALGORITHMS
from dsconv.schemas.core import (Fields, decode_utf8, is_finite, is_int, parse_json, read_bytes, read_json, read_toml,
                                 show, type_name)

HEX256 = re.compile(r"[0-9a-f]{64}")


def safe_relpath(rel: Any) -> bool:
    """A path a manifest or index may name: relative, forward slashes, no `..`, no empty parts."""
    if not isinstance(rel, str) or not rel or len(rel) > 4096 or rel.startswith("/") or "\\" in rel or "\0" in rel:
        return False
    return all(p not in ("", ".", "..") for p in rel.split("/"))


# ------------------------------------------------------------------------------------------- manifest
def manifest(path: Path) -> dict[str, Any]:
    """A `dsconv_manifest.json`: the stage that wrote it and a digest (blake3, or sha256
    before 2026-12) and size per file (at least one file)."""
    hint = "the output is damaged; rerun the stage that wrote it"
    data = read_json(path, "manifest", hint)
    f = Fields(data, str(path), hint, what="an object (a dsconv manifest)")
    f.str("stage", max_len=64)
    files = f.obj("files")
    if not files:
        raise UserError(f"{path}: \"files\" is empty", hint="a dsconv output always lists its files; " + hint)
    for rel, info in files.items():
        if not safe_relpath(rel):
            raise UserError(f"{path}: file {show(rel)} is not a relative path inside the directory", hint=hint)
        e = Fields(info, f"{path}: files[{rel!r}]", hint)
        e.int("size", 0, 2**63)
        named = [k for k in ALGORITHMS if k in info]
        if len(named) != 1:
            raise e.fail(" or ".join(ALGORITHMS), "present, exactly one of them (the file's digest)")
        digest = e.str(named[0], max_len=64)
        if not HEX256.fullmatch(digest):
            raise e.fail(named[0], "64 lower-case hex digits", digest)
    for key in ("options", "input_identity", "versions"):
        f.obj(key, default=None)
    return data


# ------------------------------------------------------------------------------------------- quant description
DESCRIPTION_GLOBALS = ("model_quant_type", "version", "group_size", "kv_quant_type", "kv_cache_type", "fa_quant_type",
                       "reduce_quant_type", "metadata")


def quant_description(path: Path) -> dict[str, Any]:
    """A `quant_model_description*.json`: global keys plus tensor name -> quantization type (a short string)."""
    hint = "the quantized output is damaged; rerun `dsconv quantize`"
    data = read_json(path, "quant description", hint)
    f = Fields(data, str(path), hint, what="an object (tensor name -> type)")
    f.int("group_size", 0, 2**16, default=None)
    f.str("model_quant_type", default=None, max_len=32)
    for name, t in data.items():
        if name in DESCRIPTION_GLOBALS:
            continue
        if not name or not isinstance(t, str) or not t or len(t) > 32:
            raise UserError(f"{path}: {show(name)} has type {show(t)}; a type is a short name like W8A8 or FLOAT",
                            hint=hint)
    return data


# ------------------------------------------------------------------------------------------- dsconv.toml
def workspace_toml(path: Path) -> dict[str, Any]:
    """dsconv.toml: [workspace] model (required) and output (strings), [defaults] (a table)."""
    hint = "fix the file or rerun `dsconv init --model DIR --force`"
    data = read_toml(path, "workspace file", hint)
    top = Fields(data, str(path), hint)
    top.only(("workspace", "defaults"))
    ws = Fields(top.obj("workspace", default={}), f"{path}: [workspace]", hint)
    ws.only(("model", "output"))
    if "model" not in ws.data:
        raise UserError(f"{path} has no [workspace] model", hint="rerun `dsconv init --model DIR`")
    ws.str("model")
    ws.str("output", default=None)
    top.obj("defaults", default=None)
    return data


# ------------------------------------------------------------------------------------------- calibration
def calibration_rows(path: Path, text: str) -> list[tuple[str, Any]]:
    """(where, row) per record of a .jsonl (one JSON value per line) or .json (one list) calibration file."""
    if path.suffix == ".json":
        data = parse_json(text, str(path), "a .json calibration file is one list of strings")
        if not isinstance(data, list):
            raise UserError(f"{path}: a .json calibration file must hold a list of strings, got {type_name(data)}",
                            hint="use .jsonl for one object per line")
        return [(f"{path}: item {i}", row) for i, row in enumerate(data)]
    if path.suffix == ".jsonl":
        return [(f"{path}:{n}", parse_json(line, str(path), "each line must be one JSON object", line=n))
                for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    raise UserError(f"{path}: unknown calibration format {path.suffix or '(no suffix)'}",
                    hint="use .jsonl (one object per line) or .json (a list of strings)")


# ------------------------------------------------------------------------------------------- expert load
def expert_load(path: Path) -> dict[int, list[float]]:
    """`{"layers": {"<layer>": [tokens per expert]}}` (or the bare map) -> {layer: counts}; counts finite, >= 0."""
    hint = "pass the expert_load.json that `dsconv quantize` wrote"
    data = read_json(path, "expert load file", hint)
    layers = data.get("layers", data) if isinstance(data, dict) else None
    if not isinstance(layers, dict):
        raise UserError(f"{path}: expected {{\"layers\": {{\"<layer>\": [tokens per expert]}}}}",
                        hint="see `dsconv shard --help` for the format")
    out: dict[int, list[float]] = {}
    for key, row in layers.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 4):
            raise UserError(f"{path}: layer key {show(key)} is not a layer number",
                            hint="keys are model layer indices, e.g. \"3\"")
        if not isinstance(row, list) or not row or not all(is_finite(v) and v >= 0 for v in row):
            raise UserError(f"{path}: layer {key} must list non-negative token counts, got {show(row)}",
                            hint="one number per routed expert, in expert order")
        out[int(key)] = [float(v) for v in row]
    return out


# ------------------------------------------------------------------------------------------- hosts
def hosts_file(path: Path) -> list[tuple[str, list[str], str | None, str]]:
    """(server, devices, container or None, where) per server of a `--hosts` file: JSON
    `{"servers": [{"server_ip", "device_ips", "container_ip"?}]}` or text lines `SERVER DEVICE...` (# comments)."""
    hint = "pass a hosts file (see `dsconv shard --help`)"
    text = decode_utf8(read_bytes(path, "hosts file", hint), str(path))
    out: list[tuple[str, list[str], str | None, str]] = []
    if text.lstrip().startswith("{"):
        data = parse_json(text, str(path), "fix the hosts file")
        servers = data.get("servers") if isinstance(data, dict) else None
        if not isinstance(servers, list) or not servers:
            raise UserError(f"{path}: expected {{\"servers\": [{{\"server_ip\": ..., \"device_ips\": [...]}}]}}")
        for i, s in enumerate(servers):
            where = f"{path}: servers[{i}]"
            if not isinstance(s, dict) or "server_ip" not in s or not isinstance(s.get("device_ips"), list):
                raise UserError(f"{where} needs server_ip and a device_ips list")
            f = Fields(s, where, "allowed: server_ip, device_ips, container_ip")
            f.only(("server_ip", "device_ips", "container_ip"))
            f.str("server_ip", max_len=64)
            f.list("device_ips", lambda v: isinstance(v, str) and 0 < len(v) <= 64, "a list of IPv4 strings",
                   max_len=4096)
            out.append((s["server_ip"], list(s["device_ips"]), f.str("container_ip", default=None, max_len=64), where))
        return out
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if fields:
            if len(fields) < 2:
                raise UserError(f"{path}:{n}: a server line is SERVER_IP DEVICE_IP [DEVICE_IP ...]")
            out.append((fields[0], fields[1:], None, f"{path}:{n}"))
    if not out:
        raise UserError(f"{path} lists no server", hint="one line per server: SERVER_IP DEVICE_IP ...")
    return out


# ------------------------------------------------------------------------------------------- ATC profile
def atc_profile(path: Path, schema: int) -> dict[str, Any]:
    """An ATC SoC profile file: a JSON object of the supported schema version (its keys are checked by atc)."""
    data = read_json(path, "profile", "fix the profile file or pass another with --profile")
    if not isinstance(data, dict):
        raise UserError(f"{path}: a profile is a JSON object", hint="see dsconv/atc_profiles/Ascend310P3.json")
    if data.get("schema", schema) != schema:
        raise UserError(f"{path}: schema {show(data.get('schema'))} is not supported", hint=f"use schema {schema}")
    parent = data.get("extends")
    if parent is not None and not (isinstance(parent, str) and parent.endswith(".json") and len(parent) <= 255
                                   and "/" not in parent and "\\" not in parent and "\0" not in parent):
        raise UserError(f"{path}: \"extends\" must name a profile file beside it, e.g. _common_910b.json, got "
                        f"{show(parent)}", hint="fix the profile file")
    return data


# ------------------------------------------------------------------------------------------- shard plan.json
SHARD_FORMATS = ("ranks", "mindie", "plan")
SLICE_MODES = ("whole", "split", "first")


def shard_plan(path: Path) -> dict[str, Any]:
    """A shard output's `plan.json`, as `dsconv verify` reads it: the layout's world size, the rank directories (inside
    the output), and every tensor's shape, slice rule and ranks in range, so the checks index nothing out of bounds.
    Its digest matching the manifest proves only that it is the file the stage wrote, not that it was sane."""
    hint = "the shard output is damaged; rerun `dsconv shard`"
    data = read_json(path, "plan", hint)
    f = Fields(data, str(path), hint, what="an object (a shard plan)")
    fmt = f.str("format", default="ranks", choices=SHARD_FORMATS)
    layout = Fields(f.obj("layout"), f"{path}: layout", hint)
    world = layout.int("world", 1, 1 << 20)
    if fmt == "mindie":
        for key in ("ep", "tp", "nodes", "cards_per_node"):
            layout.int(key, 1, world)
        folders = f.list("rank_folders", lambda fo: isinstance(fo, dict) and all(map(safe_relpath, fo.values())),
                         "a list of objects of relative folder names inside the output")
        if len(folders) != world:
            raise f.fail("rank_folders", f"one entry per rank ({world})", f"{len(folders)} entries")
        return data
    if fmt == "plan":
        return data
    dirs = f.list("rank_dirs", safe_relpath, "a list of relative directory names inside the output", default=None)
    if dirs is not None and len(dirs) != world:
        raise f.fail("rank_dirs", f"one directory per rank ({world})", f"{len(dirs)} entries")
    for name, entry in f.obj("tensors").items():
        _plan_tensor(Fields(entry, f"{path}: tensors[{show(name)}]", hint), world)
    return data


def _plan_tensor(e: Fields, world: int) -> None:
    shape = e.list("shape", is_int(0, 1 << 62), "a list of sizes", max_len=16)
    mode = e.str("mode", choices=SLICE_MODES)
    ranks = e.data.get("ranks")
    if ranks != "all" and not (isinstance(ranks, list) and ranks and all(map(is_int(0, world - 1), ranks))):
        raise e.fail("ranks", f"\"all\" or a non-empty list of ranks in 0..{world - 1}", ranks)
    if mode == "whole":
        return
    parts, rep, group = e.int("parts", 1, world), e.int("rep", 1, world), e.int("group", 1, world)
    if mode == "first":  # a row-parallel bias: "dim" is its weight's, only group and rep place it
        return
    if not shape:
        raise e.fail("shape", "at least one dimension for mode 'split'", shape)
    dim = e.int("dim", 0, len(shape) - 1)
    if (group - 1) // rep >= parts:
        raise e.fail("group", f"at most parts * rep = {parts * rep} (a rank's piece index is in range)", group)
    if shape[dim] % parts:
        raise e.fail("parts", f"a divisor of shape[{dim}] = {shape[dim]}", parts)
