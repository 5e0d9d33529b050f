"""A preflight finding: one rule's verdict, one line, with the fix in the same line.

Why one type for every rule: preflight.json, the readable summary, the stderr warnings and the UserError that stops a
compile that would certainly fail are all printed from the same records, so they cannot disagree.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable

from dsconv.errors import UserError

PASS, WARN, FAIL = "pass", "warn", "fail"


@dataclass(frozen=True)
class Finding:
    rule: str      # stable rule id, e.g. "opset", "gear-count"
    status: str    # pass | warn | fail
    message: str   # what and where (file, input, node, option)
    fix: str = ""  # what to do; empty for a pass

    def line(self) -> str:
        text = self.message.rstrip(".")
        return f"{text}; {self.fix}" if self.fix else text

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def failures(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.status == FAIL]


def raise_failures(findings: Iterable[Finding], where: str = "") -> None:
    """Stop with the first failed rule as a one-line UserError; the others go in its details."""
    bad = failures(findings)
    if not bad:
        return
    first = bad[0]
    prefix = f"{where}: " if where else ""
    details = "\n".join(f"  also [{f.rule}] {f.line()}" for f in bad[1:]) or None
    raise UserError(f"{prefix}[{first.rule}] {first.message}", hint=first.fix or None, details=details)


def summary_text(findings: Iterable[Finding], header: str) -> str:
    """The readable preflight summary (preflight.txt)."""
    lines = [header, ""]
    marks = {PASS: "PASS", WARN: "WARN", FAIL: "FAIL"}
    for f in findings:
        lines.append(f"{marks[f.status]:4}  {f.rule:<22} {f.line()}")
    return "\n".join(lines) + "\n"
