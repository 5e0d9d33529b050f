"""The fusion switch file: profile defaults, the passes a quantized model needs off, then `--fusion` overrides.

ATC reads JSON `{"Switch": {"GraphFusion": {...}, "UBFusion": {...}}}` with lower-case on/off (the older one
`Pass:off` per line is still accepted, and `parse_switch_file` reads both). Every switch keeps where it came from,
for profile.json.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from dsconv.atc.profiles import SocProfile
from dsconv.errors import UserError

SECTIONS = ("GraphFusion", "UBFusion")
PASS_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


@dataclass
class FusionSwitches:
    switches: dict[str, dict[str, str]] = field(default_factory=lambda: {s: {} for s in SECTIONS})
    sources: dict[str, str] = field(default_factory=dict)  # "Section.Pass" -> where it came from

    def set(self, section: str, name: str, state: str, source: str) -> None:
        self.switches[section][name] = state
        self.sources[f"{section}.{name}"] = source

    def to_file_json(self) -> dict:
        return {"Switch": {s: dict(self.switches[s]) for s in SECTIONS}}

    def render(self) -> str:
        return json.dumps(self.to_file_json(), indent=2) + "\n"

    def state(self, section: str, name: str) -> str:
        sw = self.switches[section]
        return sw.get(name, sw.get("ALL", "on"))


def parse_override(text: str) -> tuple[str | None, str, str]:
    """`[GraphFusion.|UBFusion.]PassName=on|off` -> (section or None, pass, state)."""
    name, eq, state = text.partition("=")
    section = None
    if "." in name:
        section, _, name = name.partition(".")
        if section not in SECTIONS:
            raise UserError(f"--fusion {text}: section {section!r} is not GraphFusion or UBFusion",
                            hint="write --fusion PassName=off or --fusion UBFusion.PassName=off")
    state = state.strip().lower()
    if not eq or state not in ("on", "off"):
        raise UserError(f"--fusion {text}: expected PASS=on or PASS=off")
    if not PASS_NAME.fullmatch(name):
        raise UserError(f"--fusion {text}: {name!r} is not a fusion pass name")
    return section, name, state


def section_for(name: str, profile: SocProfile) -> tuple[str, str]:
    """Which section a pass belongs to, and why: known to the profile, else ATC's naming (Tbe* = UB fusion)."""
    if name in profile.fusion_ub or name in profile.quantized_off_ub:
        return "UBFusion", "listed under UBFusion in the profile"
    if name in profile.fusion_graph or name in profile.quantized_off_graph:
        return "GraphFusion", "listed under GraphFusion in the profile"
    if name == "ALL":
        return "GraphFusion", "ALL without a section means graph fusion"
    if name.startswith("Tbe"):
        return "UBFusion", "Tbe* passes are UB fusion passes"
    return "GraphFusion", "not a Tbe* pass: graph fusion"


def build_switches(profile: SocProfile, overrides: list[str], quantized: bool) -> tuple[FusionSwitches, list[str]]:
    """Profile defaults -> quantized passes off -> user overrides. Returns the switches and notes for warnings."""
    fs = FusionSwitches()
    notes: list[str] = []
    for name, state in profile.fusion_graph.items():
        fs.set("GraphFusion", name, state, profile.source)
    for name, state in profile.fusion_ub.items():
        fs.set("UBFusion", name, state, profile.source)
    quant_off = {("GraphFusion", n) for n in profile.quantized_off_graph} | {("UBFusion", n)
                                                                             for n in profile.quantized_off_ub}
    if quantized:
        for section, name in sorted(quant_off):
            fs.set(section, name, "off", f"{profile.source} quantized_off (the model is INT8)")
    for text in overrides:
        section, name, state = parse_override(text)
        why = "given" if section else None
        if section is None:
            section, why = section_for(name, profile)
        fs.set(section, name, state, f"--fusion {text} ({why})")
        if quantized and state == "on" and (section, name) in quant_off:
            notes.append(f"--fusion {text} turns on {name}, which {profile.soc_version} needs off for quantized "
                         "models (CANN fusion reference); keep it off to compare the quantized model's dumps")
    return fs, notes


def parse_switch_file(text: str) -> dict[str, dict[str, str]]:
    """Read a fusion switch file in either ATC format into {section: {pass: state}}."""
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise UserError(f"fusion switch file: invalid JSON at line {e.lineno}") from None
        if set(data) != {"Switch"} or not set(data["Switch"]) <= set(SECTIONS):
            raise UserError("fusion switch file: expected {\"Switch\": {\"GraphFusion\": ..., \"UBFusion\": ...}}")
        out = {s: dict(data["Switch"].get(s, {})) for s in SECTIONS}
    else:
        out = {"GraphFusion": {}, "UBFusion": {}}
        for line in stripped.splitlines():
            if not line.strip():
                continue
            name, _, state = line.strip().partition(":")
            out["UBFusion" if name.startswith("Tbe") else "GraphFusion"][name] = state.strip()
    for s, sw in out.items():
        for name, state in sw.items():
            if state not in ("on", "off"):
                raise UserError(f"fusion switch file: {s}.{name} is {state!r}", hint="use on or off (lower case)")
    return out
