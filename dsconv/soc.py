"""SoC facts every stage shares - names, device memory, which dtypes the chip computes in - and how a `--soc` name
resolves to a chip (layer 0).

The facts are data in `dsconv/atc_profiles/*.json` (one file per chip variant; a family file such as
`Ascend910B.json` names the variant it `assumes`); this module reads the few that inspect (cards needed), shard (HBM
per card) and atc (the compile profile, atc/profiles.py, which reads the rest) all need, so neither inspect nor shard
imports the atc stage.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsconv.errors import UserError

PROFILE_DIR = Path(__file__).resolve().parent / "atc_profiles"
SCHEMA = 1
_FAMILY_KEYS: dict[str, Any] = {"schema": int, "family": str, "assumes": str, "variants": list, "note": str,
                                "sources": list}


@dataclass(frozen=True)
class Soc:
    """What a stage other than atc needs to know of a chip."""

    soc_version: str
    family: str
    device_memory_mb: int
    usable_memory_mb: int
    fp16: bool
    bf16: bool
    int8: bool
    assumed_from: str | None = None  # the family the user named, when a variant was assumed


@dataclass(frozen=True)
class FamilyFile:
    family: str
    assumes: str
    variants: tuple[str, ...]
    note: str = ""


def check_types(data: dict[str, Any], table: dict[str, Any], where: str) -> None:
    """Every key known and of its type (a typo must not silently fall back to a default)."""
    for key, value in data.items():
        if key not in table:
            raise UserError(f"{where}: unknown key {key!r}",
                            hint=f"allowed keys are {', '.join(sorted(table))}; fix the spelling or remove it")
        want = table[key]
        if isinstance(value, bool) and want in (int, (int, float)):
            raise UserError(f"{where}: {key} must be a number, not {value!r}")
        if not isinstance(value, want):
            names = "/".join(t.__name__ for t in want) if isinstance(want, tuple) else want.__name__
            raise UserError(f"{where}: {key} must be {names}, got {type(value).__name__}")


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"profile {path} does not exist", hint="pass an existing file to --profile") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}", hint="fix the profile file") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a profile is a JSON object", hint="see dsconv/atc_profiles/Ascend310P3.json")
    if data.get("schema", SCHEMA) != SCHEMA:
        raise UserError(f"{path}: schema {data.get('schema')} is not supported", hint=f"use schema {SCHEMA}")
    return data


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep merge for tables, replacement for lists and scalars (a variant replaces a whole gear list)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def resolve_extends(path: Path, keys: dict[str, Any] | None = None, seen: tuple[Path, ...] = (),
                    read: Callable[[Path], dict[str, Any]] | None = None) -> tuple[dict[str, Any], tuple[str, ...]]:
    """A variant file merged over the files it `extends` (each checked against `keys` when given), and the files,
    most specific first. `read` parses each file (atc passes the validated reader of dsconv.schemas for a user's
    --profile; this layer-0 module cannot import it)."""
    data = (read or read_json)(path)
    if "assumes" in data:
        raise UserError(f"{path} is a family file", hint="point --profile at a variant file such as Ascend910B3.json")
    if keys is not None:
        check_types(data, keys, str(path))
    parent = data.pop("extends", None)
    if parent is None:
        return data, (str(path),)
    cand = path.parent / parent
    if not cand.is_file():
        cand = PROFILE_DIR / parent
    if cand.resolve() in seen:
        raise UserError(f"{path}: extends {parent} makes a cycle", hint="remove the cycle")
    base, files = resolve_extends(cand, keys, seen + (path.resolve(),), read)
    return merge(base, data), (str(path),) + files


def bundled() -> dict[str, Path]:
    """Canonical SoC name -> bundled file (files starting with '_' are shared bases, not SoCs)."""
    return {p.stem: p for p in sorted(PROFILE_DIR.glob("*.json")) if not p.name.startswith("_")}


def available_socs() -> list[str]:
    return list(bundled())


def load_family(path: Path) -> FamilyFile:
    data = read_json(path)
    check_types(data, _FAMILY_KEYS, str(path))
    for k in ("family", "assumes", "variants"):
        if k not in data:
            raise UserError(f"{path}: family file needs {k}")
    if data["assumes"] not in data["variants"]:
        raise UserError(f"{path}: assumes {data['assumes']} is not one of its variants")
    return FamilyFile(data["family"], data["assumes"], tuple(data["variants"]), data.get("note", ""))


def resolve_soc(soc: str | None) -> tuple[Path, str | None]:
    """The bundled variant file of `--soc` (a variant or a family, any case) and the family when a variant was
    assumed."""
    if not soc:
        raise UserError("no --soc given", hint=f"pass --soc {'|'.join(available_socs())} (or --profile FILE)")
    files = bundled()
    canon = {name.lower(): name for name in files}
    name = canon.get(soc.strip().lower())
    if name is None:
        raise UserError(f"no dsconv profile for SoC {soc!r}",
                        hint=f"use one of {', '.join(files)}, or copy dsconv/atc_profiles/Ascend310P3.json, edit it "
                             "and pass --profile FILE")
    data = read_json(files[name])
    if "assumes" in data:
        fam = load_family(files[name])
        variant = files.get(fam.assumes)
        if variant is None:
            raise UserError(f"{files[name]}: assumed variant {fam.assumes} has no profile file")
        return variant, fam.family
    return files[name], None


def soc_facts(soc: str | None) -> Soc:
    """The facts of a bundled SoC named by `--soc`."""
    path, assumed_from = resolve_soc(soc)
    data, _ = resolve_extends(path)
    dtypes = data.get("dtypes", {})
    return Soc(soc_version=data["soc_version"], family=data.get("family", data["soc_version"]),
               device_memory_mb=data["device_memory_mb"], usable_memory_mb=data["usable_memory_mb"],
               fp16=dtypes.get("fp16", True), bf16=dtypes.get("bf16", False), int8=dtypes.get("int8", True),
               assumed_from=assumed_from)
