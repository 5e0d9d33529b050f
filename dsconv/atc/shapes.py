"""From the ONNX graph inputs to `--input_shape` and its gears.

Every dynamic input dimension gets a role, and the gears are the product of the role values:
  batch  axis 0 of every input                                   <- --batch
  seq    axis 1 of token inputs (input_ids, attention_mask, ...)  <- --seq (the tokens fed in this call)
  past   the length axis (rank-2) of KV-cache inputs [b, heads, past, dim]  <- --past
  total  past + seq: attention_mask of a model with a KV cache (HF masks cover cache + new tokens)
Names from the exporter (dim_param "batch", "sequence", "past_sequence", "past_sequence + sequence") win over
positions. A dynamic dimension no rule explains is an error naming the input and axis: ATC needs a size for every -1.

Why these roles: an LLM decode step feeds [batch, seq] tokens against a [batch, heads, past, dim] cache, so gears
over (batch, seq, past) are what a serving engine selects from; `total` keeps mask and cache consistent per gear.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Sequence

from dsconv.atc.findings import FAIL, PASS, WARN, Finding
from dsconv.atc.graph import ValueInfo
from dsconv.atc.options import Dim, InputShape, gear_count_finding


class Role(str, Enum):
    BATCH = "batch"
    SEQ = "seq"
    PAST = "past"
    TOTAL = "total"
    STATIC = "static"
    UNKNOWN = "unknown"


KV_NAME = re.compile(r"past|cache|present|(^|\.)(key|value)s?(\.|$)", re.I)
TOKEN_NAMES = ("input_ids", "attention_mask", "position_ids", "token_type_ids", "inputs_embeds", "cache_position")


@dataclass(frozen=True)
class DimInfo:
    input: str
    axis: int
    role: Role
    size: int | None  # static size
    param: str  # the exporter's dim_param, if any
    reason: str

    def to_json(self) -> dict:
        d = {"input": self.input, "axis": self.axis, "role": self.role.value, "why": self.reason}
        if self.size is not None:
            d["size"] = self.size
        if self.param:
            d["dim_param"] = self.param
        return d


def _role_from_param(param: str) -> Role | None:
    p = param.lower()
    if "past" in p and ("+" in p or "total" in p):
        return Role.TOTAL
    if "total" in p or "all_seq" in p:
        return Role.TOTAL
    if "past" in p or "cache" in p:
        return Role.PAST
    if "batch" in p:
        return Role.BATCH
    if re.search(r"seq|sequence|length|len\b|tokens?", p):
        return Role.SEQ
    return None


def is_kv_input(v: ValueInfo) -> bool:
    return len(v.dims) >= 3 and bool(KV_NAME.search(v.name)) and v.name not in TOKEN_NAMES


def classify(inputs: Sequence[ValueInfo]) -> list[DimInfo]:
    """A role for every input dimension (see the module docstring for the rules)."""
    has_kv = any(is_kv_input(v) for v in inputs)
    out: list[DimInfo] = []
    for v in inputs:
        kv = is_kv_input(v)
        rank = len(v.dims)
        for axis, d in enumerate(v.dims):
            if isinstance(d, int):
                out.append(DimInfo(v.name, axis, Role.STATIC, d, "", "static in the model"))
                continue
            param = d or ""
            role = _role_from_param(param) if param else None
            if role is not None:
                reason = f"dim_param {param!r}"
                if role == Role.SEQ and kv and axis == rank - 2:
                    role, reason = Role.PAST, f"dim_param {param!r} on the length axis of a KV-cache input"
                if role == Role.SEQ and has_kv and "mask" in v.name.lower():
                    role, reason = Role.TOTAL, f"dim_param {param!r}: the mask covers cache + new tokens"
            elif axis == 0:
                role, reason = Role.BATCH, "axis 0"
            elif kv and axis == rank - 2:
                role, reason = Role.PAST, "length axis of a KV-cache input [batch, heads, past, dim]"
            elif axis == 1 and (rank == 2 or v.name == "inputs_embeds"):
                if has_kv and "mask" in v.name.lower():
                    role, reason = Role.TOTAL, "attention mask of a KV-cache model covers past + seq"
                else:
                    role, reason = Role.SEQ, "axis 1 of a token input [batch, seq]"
            else:
                role, reason = Role.UNKNOWN, "dynamic, and no rule tells what it is"
            out.append(DimInfo(v.name, axis, role, None, param, reason))
    return out


@dataclass
class ShapePlan:
    mode: str  # static | dynamic_dims | dynamic_batch_size | range
    input_shape: InputShape
    dynamic_dims: tuple[tuple[int, ...], ...] | None
    dynamic_batch_size: tuple[int, ...] | None
    values: dict[str, tuple[int, ...]]  # role -> values used
    dims: list[DimInfo]
    gears: list[dict[str, int]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    note: str = ""

    @property
    def dynamic(self) -> bool:
        """Whether the compiled model takes more than one shape (gears or ranges)."""
        return self.input_shape.dynamic_count > 0 or self.input_shape.has_ranges

    def to_json(self) -> dict:
        return {"mode": self.mode, "input_shape": self.input_shape.render(), "values": self.values,
                "gears": self.gears, "dims": [d.to_json() for d in self.dims], "note": self.note}


def _value(role: Role, b: int, s: int, p: int) -> int:
    return {Role.BATCH: b, Role.SEQ: s, Role.PAST: p, Role.TOTAL: p + s}[role]


def plan_shapes(inputs: Sequence[ValueInfo], *, batch: Sequence[int], seq: Sequence[int], past: Sequence[int],
                mode: str = "dynamic_dims", user_shape: InputShape | None = None, max_gears: int = 100,
                min_gears: int = 2, max_dims_per_gear: int = 4) -> ShapePlan:
    """The --input_shape and gears for these graph inputs; problems are Findings (fail = ATC would fail)."""
    dims = classify(inputs)
    findings: list[Finding] = []
    by_input = {v.name: v for v in inputs}
    # what each dimension is: a fixed size, a role (-> -1 or a range), or a user range
    chosen: dict[tuple[str, int], Dim | Role] = {}
    for d in dims:
        chosen[(d.input, d.axis)] = d.size if d.role == Role.STATIC else d.role
    if user_shape is not None:
        findings += _apply_user_shape(user_shape, inputs, dims, chosen)
    unknown = [d for d in dims if chosen.get((d.input, d.axis)) == Role.UNKNOWN]
    for d in unknown:
        findings.append(Finding("dynamic-dim-role", FAIL,
                                f"input {d.input} axis {d.axis} is dynamic ({d.param or 'no name'}) and dsconv cannot "
                                "tell whether it is batch, seq or past",
                                f"pass --input-shape with a size for it, e.g. {d.input}:" +
                                ",".join("-1" if i == d.axis else "N" for i in range(len(by_input[d.input].dims)))))
        chosen[(d.input, d.axis)] = 1  # placeholder so planning goes on; the failure above stops the compile
    if not unknown:
        findings.append(Finding("dynamic-dim-role", PASS, "every dynamic input dimension has a role"))
    roles_used = [r for r in (Role.BATCH, Role.SEQ, Role.PAST, Role.TOTAL) if r in chosen.values()]
    need = {Role.BATCH: bool({Role.BATCH} & set(roles_used)), Role.SEQ: bool({Role.SEQ, Role.TOTAL} & set(roles_used)),
            Role.PAST: bool({Role.PAST, Role.TOTAL} & set(roles_used))}
    b_vals = tuple(sorted(set(batch))) if need[Role.BATCH] else (1,)
    s_vals = tuple(sorted(set(seq))) if need[Role.SEQ] else (0,)
    p_vals = tuple(sorted(set(past))) if need[Role.PAST] else (0,)
    values = {r.value: v for r, v, n in ((Role.BATCH, b_vals, need[Role.BATCH]), (Role.SEQ, s_vals, need[Role.SEQ]),
                                         (Role.PAST, p_vals, need[Role.PAST])) if n}
    has_ranges = any(isinstance(c, tuple) for c in chosen.values())
    order = [(v.name, axis) for v in inputs for axis in range(len(v.dims))]

    def shape_with(fn) -> InputShape:
        entries = []
        for v in inputs:
            entries.append((v.name, tuple(fn(chosen[(v.name, a)]) for a in range(len(v.dims)))))
        return InputShape(tuple(entries))

    if not roles_used:
        plan_mode = "range" if has_ranges else "static"
        return ShapePlan(plan_mode, shape_with(lambda c: c), None, None, {}, dims, [], findings,
                         "no dynamic dimension")
    single = all(len(v) == 1 for v in values.values())
    if single and mode != "range" and mode != "dynamic_batch_size":
        b, s, p = b_vals[0], s_vals[0], p_vals[0]
        shape = shape_with(lambda c: _value(c, b, s, p) if isinstance(c, Role) else c)
        findings.append(Finding("gear-count", PASS, "one value per dimension: static shapes, no gears"))
        return ShapePlan("range" if has_ranges else "static", shape, None, None, values, dims,
                         [{"batch": b, "seq": s, "past": p}], findings,
                         "single --batch/--seq/--past values compile static shapes")
    if has_ranges and mode != "range":
        findings.append(Finding("one-dynamic-option", FAIL, "--input-shape mixes ranges (lo~hi) with gear dimensions",
                                "use either ranges for every dynamic dimension or -1 with gears"))
    if mode == "range":
        lo = {Role.BATCH: b_vals[0], Role.SEQ: s_vals[0], Role.PAST: p_vals[0]}
        hi = {Role.BATCH: b_vals[-1], Role.SEQ: s_vals[-1], Role.PAST: p_vals[-1]}

        def rng(c):
            if not isinstance(c, Role):
                return c
            a, z = _value(c, lo[Role.BATCH], lo[Role.SEQ], lo[Role.PAST]), _value(c, hi[Role.BATCH], hi[Role.SEQ],
                                                                                     hi[Role.PAST])
            return a if a == z else (a, z)

        findings.append(Finding("gear-count", PASS, "shape ranges instead of gears"))
        return ShapePlan("range", shape_with(rng), None, None, values, dims, [], findings,
                         "ranges lo~hi from the smallest and largest --batch/--seq/--past values")
    if mode == "dynamic_batch_size":
        s, p = s_vals[-1], p_vals[-1]
        shape = shape_with(lambda c: -1 if c == Role.BATCH else (_value(c, 0, s, p) if isinstance(c, Role) else c))
        note = "--dynamic-batch-size: only the batch is dynamic"
        if need[Role.SEQ] or need[Role.PAST]:
            note += f"; seq fixed to the largest --seq ({s})" + (f", past to the largest --past ({p})"
                                                                  if need[Role.PAST] else "")
        findings.append(gear_count_finding(len(b_vals), min_gears, max_gears))
        return ShapePlan("dynamic_batch_size", shape, None, b_vals, values, dims,
                         [{"batch": b} for b in b_vals], findings, note)
    # dynamic_dims: the product of the role values, one value per -1 in --input_shape order
    shape = shape_with(lambda c: -1 if isinstance(c, Role) else c)
    dyn = [chosen[k] for k in order if isinstance(chosen[k], Role)]
    gears, gear_dicts = [], []
    for b, s, p in itertools.product(b_vals, s_vals, p_vals):
        gears.append(tuple(_value(r, b, s, p) for r in dyn))
        gd = {"batch": b}
        if need[Role.SEQ]:
            gd["seq"] = s
        if need[Role.PAST]:
            gd["past"] = p
        gear_dicts.append(gd)
    findings.append(gear_count_finding(len(gears), min_gears, max_gears))
    if len(dyn) > max_dims_per_gear:
        findings.append(Finding("dims-per-gear", WARN,
                                f"{len(dyn)} dynamic dimensions per gear; CANN releases up to 7.0 accept at most "
                                f"{max_dims_per_gear}",
                                "on older CANN fix the KV-cache/extra inputs with --input-shape, or use "
                                "--dynamic-batch-size or --input-shape-range"))
    else:
        findings.append(Finding("dims-per-gear", PASS, f"{len(dyn)} dynamic dimensions per gear"))
    return ShapePlan("dynamic_dims", shape, tuple(gears), None, values, dims, gear_dicts, findings,
                     "gears = every combination of the --batch, --seq and --past values the inputs use")


def _apply_user_shape(user: InputShape, inputs: Sequence[ValueInfo], dims: list[DimInfo],
                      chosen: dict[tuple[str, int], Dim | Role]) -> list[Finding]:
    """Check a user --input-shape against the graph inputs (names, ranks, static sizes) and apply it."""
    out: list[Finding] = []
    graph = {v.name: v for v in inputs}
    role_of = {(d.input, d.axis): d.role for d in dims}
    extra = [n for n, _ in user.entries if n not in graph]
    if extra:
        out.append(Finding("input-names", FAIL, f"--input-shape names {', '.join(extra)}, which the model does not "
                           f"have (inputs: {', '.join(graph)})", "use the model's input names"))
    given = user.as_dict()
    missing = [v.name for v in inputs if v.name not in given and any(not isinstance(d, int) for d in v.dims)]
    if missing:
        out.append(Finding("input-names", FAIL, f"--input-shape leaves out dynamic input(s) {', '.join(missing)}",
                           "give every model input a shape"))
    if not extra and not missing:
        out.append(Finding("input-names", PASS, "--input-shape names match the model inputs"))
    rank_ok = True
    for name, udims in user.entries:
        v = graph.get(name)
        if v is None:
            continue
        if len(udims) != len(v.dims):
            rank_ok = False
            out.append(Finding("input-rank", FAIL, f"--input-shape gives {name} rank {len(udims)}, the model has "
                               f"rank {len(v.dims)}", f"write {len(v.dims)} dimensions for {name}"))
            continue
        for axis, (u, m) in enumerate(zip(udims, v.dims)):
            if isinstance(m, int):
                if u != m:
                    rank_ok = False
                    out.append(Finding("input-rank", FAIL, f"--input-shape sets {name} axis {axis} to {u}; the "
                                       f"model fixes it to {m}", f"use {m}"))
                continue
            if u == -1:
                chosen[(name, axis)] = role_of[(name, axis)]
            else:
                chosen[(name, axis)] = u
    if rank_ok:
        out.append(Finding("input-rank", PASS, "--input-shape ranks and static sizes match the model"))
    return out
