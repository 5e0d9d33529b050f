"""SoC compile profiles: the facts ATC needs per chip, kept as data in `dsconv/atc_profiles/*.json`.

Why data and not code: the allowed precision modes, default gears, accepted opsets and the ONNX operator list change
with CANN releases and differ per chip; a user fixes them by pointing `--profile FILE` at an edited copy, not by
patching dsconv. Every key is typed and unknown keys are rejected (a typo must not silently fall back to a default).

A variant file may `extend` another file (the 910B variants share `_common_910b.json`); a family file
(`Ascend910B.json`) names the variant it `assumes`, which is recorded as a decision wherever it is used.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsconv import schemas
from dsconv.errors import UserError
from dsconv.soc import SCHEMA, check_types, resolve_extends, resolve_soc

# key -> python type(s); nested tables are checked by their own key tables below
_PROFILE_KEYS: dict[str, Any] = {
    "schema": int, "extends": str, "soc_version": str, "family": str, "product": str, "note": str,
    "sources": list, "device_memory_mb": int, "usable_memory_mb": int, "memory_warn_fraction": (int, float),
    "dtypes": dict, "precision": dict, "implmode": dict, "gears": dict, "opset": dict, "onnx_ops": list,
    "onnx_ops_min_opset": dict, "onnx_ops_doubtful": dict, "fusion": dict, "log": str,
}
_NESTED: dict[str, dict[str, Any]] = {
    "dtypes": {"fp16": bool, "bf16": bool, "int8": bool},
    "precision": {"modes": list, "default": str, "default_bf16_model": (str, type(None)), "modes_v2": list},
    "implmode": {"default": str, "optypelist": list},
    "gears": {"batch": list, "seq": list, "past": list, "min_gears": int, "max_gears": int,
              "max_dims_per_gear": int},
    "opset": {"min": int, "max": int, "safe_min": int, "safe_max": int},
    "fusion": {"GraphFusion": dict, "UBFusion": dict, "quantized_off": dict},
}
_REQUIRED = ("soc_version", "device_memory_mb", "usable_memory_mb", "dtypes", "precision", "implmode", "gears",
             "opset", "onnx_ops", "fusion")


@dataclass(frozen=True)
class SocProfile:
    """One SoC's compile facts (see the JSON files for what each value means and where it came from)."""

    soc_version: str
    family: str
    product: str
    device_memory_mb: int
    usable_memory_mb: int
    memory_warn_fraction: float
    fp16: bool
    bf16: bool
    int8: bool
    precision_modes: tuple[str, ...]
    precision_default: str
    precision_default_bf16_model: str | None
    precision_modes_v2: tuple[str, ...]
    implmode_default: str
    optypelist_default: tuple[str, ...]
    gear_batch: tuple[int, ...]
    gear_seq: tuple[int, ...]
    gear_past: tuple[int, ...]
    min_gears: int
    max_gears: int
    max_dims_per_gear: int
    opset_min: int
    opset_max: int
    opset_safe_min: int
    opset_safe_max: int
    onnx_ops: frozenset[str]
    onnx_ops_min_opset: dict[str, int]
    onnx_ops_doubtful: dict[str, str]  # op -> why it is only a warning
    fusion_graph: dict[str, str]
    fusion_ub: dict[str, str]
    quantized_off_graph: tuple[str, ...]
    quantized_off_ub: tuple[str, ...]
    log: str
    path: Path
    files: tuple[str, ...] = ()  # the files merged into this profile, most specific first
    note: str = ""
    sources: tuple[str, ...] = ()
    assumed_from: str | None = None  # the family the user named, when a variant was assumed

    @property
    def source(self) -> str:
        """How profile.json names where a profile default came from."""
        return f"profile {self.path.name}"


def _int_list(values: list, where: str) -> tuple[int, ...]:
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise UserError(f"{where} must be a non-empty list of positive integers, got {values!r}")
    return tuple(values)


def load_profile_file(path: Path, assumed_from: str | None = None) -> SocProfile:
    """Read one variant profile (following `extends`), check every key, return the typed profile."""
    path = Path(path)
    data, files = resolve_extends(path, _PROFILE_KEYS, read=lambda p: schemas.atc_profile(p, SCHEMA))
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise UserError(f"{path}: missing {', '.join(missing)}", hint="copy a bundled profile and edit it")
    for key, table in _NESTED.items():
        if key in data:
            check_types(data[key], table, f"{path}: {key}")
    where = str(path)
    prec, impl, gears, opset, fusion = (data[k] for k in ("precision", "implmode", "gears", "opset", "fusion"))
    for k in ("modes", "default", "modes_v2"):
        if k not in prec:
            raise UserError(f"{where}: precision.{k} is missing")
    if prec["default"] not in prec["modes"]:
        raise UserError(f"{where}: precision.default {prec['default']} is not in precision.modes")
    dbf = prec.get("default_bf16_model")
    if dbf is not None and dbf not in prec["modes"]:
        raise UserError(f"{where}: precision.default_bf16_model {dbf} is not in precision.modes")
    for section in ("GraphFusion", "UBFusion"):
        for name, state in fusion.get(section, {}).items():
            if state not in ("on", "off"):
                raise UserError(f"{where}: fusion.{section}.{name} is {state!r}", hint="use \"on\" or \"off\"")
    qoff = fusion.get("quantized_off", {})
    check_types(qoff, {"GraphFusion": list, "UBFusion": list}, f"{where}: fusion.quantized_off")
    if not (opset.get("min", 0) <= opset.get("safe_min", 0) <= opset.get("safe_max", 0) <= opset.get("max", 0)):
        raise UserError(f"{where}: opset must satisfy min <= safe_min <= safe_max <= max")
    ops = data["onnx_ops"]
    if not all(isinstance(o, str) for o in ops):
        raise UserError(f"{where}: onnx_ops must be a list of operator type names")
    for op, since in data.get("onnx_ops_min_opset", {}).items():
        if not isinstance(since, int) or op not in ops:
            raise UserError(f"{where}: onnx_ops_min_opset.{op} must be an integer for an operator in onnx_ops")
    from dsconv.atc.options import IMPLMODES, LOG_LEVELS, PRECISION_MODES, PRECISION_MODES_V2

    for key, values, known in (("precision.modes", prec["modes"], PRECISION_MODES),
                               ("precision.modes_v2", prec["modes_v2"], PRECISION_MODES_V2),
                               ("implmode.default", [impl.get("default", "high_performance")], IMPLMODES),
                               ("log", [data.get("log", "error")], LOG_LEVELS)):
        bad = [v for v in values if v not in known]
        if bad:
            raise UserError(f"{where}: {key} has {', '.join(map(str, bad))}, which ATC does not know",
                            hint=f"use {', '.join(known)}")
    doubtful = data.get("onnx_ops_doubtful", {})
    both = sorted(set(doubtful) & set(ops))
    if both or not all(isinstance(v, str) and v for v in doubtful.values()):
        raise UserError(f"{where}: onnx_ops_doubtful must map ops that are not in onnx_ops to a reason"
                        + (f" ({', '.join(both)} is in both)" if both else ""))
    dtypes = data["dtypes"]
    if not dtypes.get("bf16", False):
        bad = [m for m in prec["modes"] + prec["modes_v2"] if "bf16" in m or "bfloat16" in m]
        if bad:
            raise UserError(f"{where}: dtypes.bf16 is false but precision modes {', '.join(bad)} are listed",
                            hint="remove the bf16 modes or set dtypes.bf16")
    return SocProfile(
        soc_version=data["soc_version"], family=data.get("family", data["soc_version"]),
        product=data.get("product", ""), device_memory_mb=data["device_memory_mb"],
        usable_memory_mb=data["usable_memory_mb"], memory_warn_fraction=float(data.get("memory_warn_fraction", 0.8)),
        fp16=dtypes.get("fp16", True), bf16=dtypes.get("bf16", False), int8=dtypes.get("int8", True),
        precision_modes=tuple(prec["modes"]), precision_default=prec["default"], precision_default_bf16_model=dbf,
        precision_modes_v2=tuple(prec["modes_v2"]), implmode_default=impl.get("default", "high_performance"),
        optypelist_default=tuple(impl.get("optypelist", [])),
        gear_batch=_int_list(gears.get("batch", []), f"{where}: gears.batch"),
        gear_seq=_int_list(gears.get("seq", []), f"{where}: gears.seq"),
        gear_past=_int_list(gears.get("past", [1]), f"{where}: gears.past"),
        min_gears=gears.get("min_gears", 2), max_gears=gears.get("max_gears", 100),
        max_dims_per_gear=gears.get("max_dims_per_gear", 4),
        opset_min=opset["min"], opset_max=opset["max"], opset_safe_min=opset["safe_min"],
        opset_safe_max=opset["safe_max"], onnx_ops=frozenset(ops),
        onnx_ops_min_opset=dict(data.get("onnx_ops_min_opset", {})), onnx_ops_doubtful=dict(doubtful),
        fusion_graph=dict(fusion.get("GraphFusion", {})), fusion_ub=dict(fusion.get("UBFusion", {})),
        quantized_off_graph=tuple(qoff.get("GraphFusion", [])), quantized_off_ub=tuple(qoff.get("UBFusion", [])),
        log=data.get("log", "error"), path=path, files=files, note=data.get("note", ""),
        sources=tuple(data.get("sources", [])), assumed_from=assumed_from,
    )


def load_profile(soc: str | None = None, profile: Path | None = None) -> SocProfile:
    """The profile for `--soc` (a variant or a family) or `--profile FILE`; both given must agree."""
    if profile is not None:
        prof = load_profile_file(Path(profile))
        if soc is not None and soc.lower() != prof.soc_version.lower() and soc.lower() != prof.family.lower():
            raise UserError(f"--soc {soc} does not match {profile} (soc_version {prof.soc_version})",
                            hint="drop --soc or point --profile at the matching file")
        return prof
    path, assumed_from = resolve_soc(soc)
    return load_profile_file(path, assumed_from=assumed_from)

@dataclass
class Decision:
    """One value in profile.json and where it came from (a CLI option, the profile, the model, or a rule)."""

    key: str
    value: Any
    source: str
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        d = {"value": self.value, "source": self.source}
        if self.note:
            d["note"] = self.note
        return d


@dataclass
class Decisions:
    items: dict[str, Decision] = field(default_factory=dict)

    def set(self, key: str, value: Any, source: str, note: str = "") -> Any:
        self.items[key] = Decision(key, value, source, note)
        return value

    def to_json(self) -> dict[str, Any]:
        return {k: d.to_json() for k, d in self.items.items()}
