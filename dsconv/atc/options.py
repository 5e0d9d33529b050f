"""The ATC command-line grammar as typed data: one option table, a typed command, render, parse back, combine-check.

Why a table: every option dsconv writes (and every option a user's hand-edited atc.sh may hold) is parsed by the same
rules, so `render(parse(x)) == x` can be tested and an unknown option or value is rejected with its name instead of
reaching a 20-minute compile that fails with E10001. Values follow docs/commands/atc.md
and the CANN ATC parameter reference.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Sequence

from dsconv.atc.findings import FAIL, PASS, WARN, Finding
from dsconv.errors import UserError

SOC_VERSIONS: tuple[str, ...] = (
    "Ascend910B1", "Ascend910B2", "Ascend910B2C", "Ascend910B3", "Ascend910B4", "Ascend910B4-1",
    "Ascend310P1", "Ascend310P2", "Ascend310P3", "Ascend310P4", "Ascend310P5", "Ascend310P7",
    "Ascend310B1", "Ascend310B2", "Ascend310B3", "Ascend310B4",
    "Ascend910_9391", "Ascend910_9392", "Ascend910_9381", "Ascend910_9382", "Ascend910_9372", "Ascend910_9362",
)
PRECISION_MODES = ("force_fp16", "force_fp32", "cube_fp16in_fp32out", "allow_fp32_to_fp16", "must_keep_origin_dtype",
                   "allow_mix_precision", "allow_mix_precision_fp16", "allow_mix_precision_bf16",
                   "allow_fp32_to_bf16")
PRECISION_MODES_V2 = ("fp16", "origin", "cube_fp16in_fp32out", "mixed_float16", "mixed_bfloat16")
IMPLMODES = ("high_performance", "high_precision", "high_precision_for_all", "high_performance_for_all")
IMPLMODES_FOR_OPTYPELIST = ("high_performance", "high_precision")  # CANN: the list takes only these two
LOG_LEVELS = ("debug", "info", "warning", "error", "null")
KEEP_DTYPE_IGNORED_WITH = ("must_keep_origin_dtype", "origin")
DYNAMIC_OPTIONS = ("dynamic_batch_size", "dynamic_image_size", "dynamic_dims", "input_shape_range")

Dim = int | tuple[int, int]  # a size, -1 (dynamic, needs gears) or (lo, hi) for the range form "lo~hi"


# ---------------------------------------------------------------- --input_shape


@dataclass(frozen=True)
class InputShape:
    """`name:d0,d1;name2:...` with -1 for a gear dimension and `lo~hi` for a range dimension."""

    entries: tuple[tuple[str, tuple[Dim, ...]], ...]

    @classmethod
    def parse(cls, text: str, option: str = "--input_shape") -> "InputShape":
        entries: list[tuple[str, tuple[Dim, ...]]] = []
        for part in text.strip().strip('"').split(";"):
            if not part.strip():
                continue
            name, sep, dims_text = part.rpartition(":")
            if not sep or not name:
                raise UserError(f"{option}: {part!r} is not name:d0,d1,...",
                                hint='write it like "input_ids:-1,-1;attention_mask:-1,-1"')
            dims: list[Dim] = []
            for d in dims_text.split(","):
                d = d.strip()
                m = re.fullmatch(r"(\d+)~(\d+)", d)
                if m:
                    lo, hi = int(m.group(1)), int(m.group(2))
                    if not 0 < lo <= hi:
                        raise UserError(f"{option}: range {d} of {name} must be 1 <= lo <= hi")
                    dims.append((lo, hi))
                elif re.fullmatch(r"-1|\d+", d):
                    v = int(d)
                    if v == 0:
                        raise UserError(f"{option}: dimension 0 of {name} is not allowed", hint="use -1 or a size")
                    dims.append(v)
                else:
                    raise UserError(f"{option}: {d!r} in {name} is not a size, -1 or lo~hi")
            if any(n == name for n, _ in entries):
                raise UserError(f"{option}: input {name} is listed twice")
            entries.append((name, tuple(dims)))
        if not entries:
            raise UserError(f"{option} is empty")
        return cls(tuple(entries))

    def render(self) -> str:
        def one(d: Dim) -> str:
            return f"{d[0]}~{d[1]}" if isinstance(d, tuple) else str(d)

        return ";".join(f"{n}:{','.join(one(d) for d in dims)}" for n, dims in self.entries)

    @property
    def dynamic_count(self) -> int:
        return sum(1 for _, dims in self.entries for d in dims if d == -1)

    @property
    def has_ranges(self) -> bool:
        return any(isinstance(d, tuple) for _, dims in self.entries for d in dims)

    def as_dict(self) -> dict[str, tuple[Dim, ...]]:
        return dict(self.entries)


# ---------------------------------------------------------------- value kinds


def _int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.strip().strip('"').split(",") if v.strip())
    except ValueError:
        raise UserError(f"--{option}={text}: not a comma-separated list of integers") from None
    if not vals or any(v <= 0 for v in vals):
        raise UserError(f"--{option}={text}: values must be positive integers")
    return vals


def parse_gears(text: str, option: str = "dynamic_dims") -> tuple[tuple[int, ...], ...]:
    """`1,128;4,512` -> ((1, 128), (4, 512))."""
    gears = tuple(_int_list(g, option) for g in text.strip().strip('"').split(";") if g.strip())
    if not gears:
        raise UserError(f"--{option} is empty")
    return gears


def render_gears(gears: Sequence[Sequence[int]]) -> str:
    return ";".join(",".join(str(v) for v in g) for g in gears)


def _image_sizes(text: str, option: str) -> tuple[tuple[int, ...], ...]:
    gears = parse_gears(text, option)
    if any(len(g) != 2 for g in gears):
        raise UserError(f"--{option}={text}: each gear is h,w")
    return gears


@dataclass(frozen=True)
class OptionSpec:
    """One ATC option: how its text is read and written and which values it allows."""

    name: str
    parse: Callable[[str, str], Any]
    render: Callable[[Any], str]
    choices: tuple[str, ...] = ()
    help: str = ""


def _text(text: str, option: str) -> str:
    if not text:
        raise UserError(f"--{option} needs a value")
    return text


def _choice(choices: Sequence[str]) -> Callable[[str, str], str]:
    def parse(text: str, option: str) -> str:
        if text not in choices:
            raise UserError(f"--{option}={text} is not an ATC value", hint=f"use one of {', '.join(choices)}")
        return text

    return parse


def _int_choice(choices: Sequence[int]) -> Callable[[str, str], int]:
    def parse(text: str, option: str) -> int:
        if not re.fullmatch(r"\d+", text) or int(text) not in choices:
            raise UserError(f"--{option}={text} is not an ATC value",
                            hint=f"use one of {', '.join(map(str, choices))}")
        return int(text)

    return parse


def _names(text: str, option: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise UserError(f"--{option} is empty")
    return names


_S = str
OPTIONS: dict[str, OptionSpec] = {o.name: o for o in (
    OptionSpec("model", _text, _S, help="the ONNX file"),
    OptionSpec("framework", _int_choice((0, 1, 3, 5)), _S, ("0", "1", "3", "5"), "5 = ONNX"),
    OptionSpec("output", _text, _S, help="path prefix of the .om"),
    OptionSpec("soc_version", _choice(SOC_VERSIONS), _S, SOC_VERSIONS),
    OptionSpec("input_format", _choice(("ND", "NCHW", "NHWC", "NCDHW", "NDHWC")), _S,
               ("ND", "NCHW", "NHWC", "NCDHW", "NDHWC")),
    OptionSpec("input_shape", lambda t, o: InputShape.parse(t, f"--{o}"), lambda v: v.render()),
    OptionSpec("dynamic_dims", parse_gears, render_gears),
    OptionSpec("dynamic_batch_size", _int_list, lambda v: ",".join(map(str, v))),
    OptionSpec("dynamic_image_size", _image_sizes, render_gears),
    OptionSpec("input_shape_range", _text, _S, help="deprecated: ranges now go in --input_shape"),
    OptionSpec("precision_mode", _choice(PRECISION_MODES), _S, PRECISION_MODES),
    OptionSpec("precision_mode_v2", _choice(PRECISION_MODES_V2), _S, PRECISION_MODES_V2),
    OptionSpec("op_select_implmode", _choice(IMPLMODES), _S, IMPLMODES),
    OptionSpec("op_precision_mode", _text, _S, help="ini file: per-op precision modes (e.g. high_precision)"),
    OptionSpec("optypelist_for_implmode", _names, lambda v: ",".join(v)),
    OptionSpec("fusion_switch_file", _text, _S),
    OptionSpec("keep_dtype", _text, _S),
    OptionSpec("out_nodes", _text, _S),
    OptionSpec("output_type", _choice(("FP16", "FP32", "INT8", "UINT8")), _S, ("FP16", "FP32", "INT8", "UINT8")),
    OptionSpec("log", _choice(LOG_LEVELS), _S, LOG_LEVELS),
    OptionSpec("external_weight", _int_choice((0, 1, 2)), _S, ("0", "1", "2")),
    OptionSpec("host_env_os", _choice(("linux",)), _S, ("linux",)),
    OptionSpec("host_env_cpu", _choice(("x86_64", "aarch64")), _S, ("x86_64", "aarch64")),
)}
REQUIRED = ("model", "framework", "output", "soc_version")


@dataclass(frozen=True)
class AtcOptions:
    """One atc invocation, typed. Field names are ATC's option names; None = not passed."""

    model: str
    framework: int
    output: str
    soc_version: str
    input_format: str | None = None
    input_shape: InputShape | None = None
    dynamic_dims: tuple[tuple[int, ...], ...] | None = None
    dynamic_batch_size: tuple[int, ...] | None = None
    dynamic_image_size: tuple[tuple[int, ...], ...] | None = None
    input_shape_range: str | None = None
    precision_mode: str | None = None
    precision_mode_v2: str | None = None
    op_select_implmode: str | None = None
    op_precision_mode: str | None = None
    optypelist_for_implmode: tuple[str, ...] | None = None
    fusion_switch_file: str | None = None
    keep_dtype: str | None = None
    out_nodes: str | None = None
    output_type: str | None = None
    log: str | None = None
    external_weight: int | None = None
    host_env_os: str | None = None
    host_env_cpu: str | None = None

    # ---- construction
    @classmethod
    def from_text_values(cls, values: dict[str, str], where: str = "atc command") -> "AtcOptions":
        """Build from option -> text (as on a command line); unknown options and bad values are rejected."""
        typed: dict[str, Any] = {}
        for name, text in values.items():
            spec = OPTIONS.get(name)
            if spec is None:
                raise UserError(f"{where}: unknown ATC option --{name}",
                                hint="dsconv knows " + ", ".join(f"--{k}" for k in OPTIONS))
            typed[name] = spec.parse(text, name)
        missing = [k for k in REQUIRED if k not in typed]
        if missing:
            raise UserError(f"{where}: missing {', '.join('--' + k for k in missing)}")
        return cls(**typed)

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "profile.json atc_options") -> "AtcOptions":
        """Inverse of to_json: the values are the texts ATC sees."""
        return cls.from_text_values({k: str(v) for k, v in data.items()}, where)

    def with_(self, **changes: Any) -> "AtcOptions":
        return replace(self, **changes)

    # ---- rendering
    def items(self) -> list[tuple[str, str]]:
        """(option, text) in table order, only the options that are set."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out.append((f.name, OPTIONS[f.name].render(value)))
        return out

    def argv(self) -> list[str]:
        """Arguments for subprocess (no shell quoting)."""
        return [f"--{k}={v}" for k, v in self.items()]

    def to_json(self) -> dict[str, str]:
        return dict(self.items())

    def shell_lines(self) -> list[str]:
        """`--key=value` tokens quoted for a shell script, the way CANN's docs write them."""
        return [f"--{k}={shell_quote(v)}" for k, v in self.items()]


def check_choice(value: str | None, choices: Sequence[str], flag: str) -> None:
    """A user's value for an enumerated ATC option, rejected with the flag's name and the allowed values."""
    if value is not None and value not in choices:
        raise UserError(f"{flag} {value} is not an ATC value", hint=f"use one of {', '.join(choices)}")


def shell_quote(value: str) -> str:
    if re.fullmatch(r"[A-Za-z0-9_./:,=~+@%-]+", value):
        return value
    if not re.search(r'["$`\\!]', value):
        return f'"{value}"'
    return shlex.quote(value)


# ---------------------------------------------------------------- parsing a command line back


def parse_argv(tokens: Sequence[str], where: str = "atc command") -> AtcOptions:
    """`--key=value` (or `--key value`) tokens -> AtcOptions; duplicates and stray tokens are errors."""
    values: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--"):
            raise UserError(f"{where}: unexpected argument {tok!r}", hint="ATC options look like --name=value")
        key, eq, value = tok[2:].partition("=")
        if not eq:
            if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                raise UserError(f"{where}: --{key} has no value")
            value = tokens[i + 1]
            i += 1
        if key in values:
            raise UserError(f"{where}: --{key} given twice")
        values[key] = value
        i += 1
    return AtcOptions.from_text_values(values, where)


ATC_PROGRAMS = ("atc", "$ATC_BIN", "${ATC_BIN}", "${ATC_BIN:-atc}")


def parse_script(text: str, where: str = "atc.sh") -> AtcOptions:
    """Read the atc invocation out of a shell script (backslash continuations, comments and other lines ignored)."""
    logical: list[str] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if not buf and line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    if buf:
        logical.append(buf)
    for line in logical:
        try:
            tokens = shlex.split(line, comments=True, posix=True)
        except ValueError as e:
            raise UserError(f"{where}: cannot read a line ({e})") from None
        while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0]):
            tokens = tokens[1:]  # VAR=value prefixes
        if tokens and tokens[0] == "exec":
            tokens = tokens[1:]
        if tokens and (tokens[0] in ATC_PROGRAMS or tokens[0].endswith("/atc")):
            return parse_argv(tokens[1:], where)
    raise UserError(f"{where}: no atc command found", hint="the script must run atc (or \"$ATC_BIN\") --model=...")


# ---------------------------------------------------------------- combination rules (profile-independent)


def check_combinations(o: AtcOptions) -> list[Finding]:
    """The rules ATC itself enforces between options; each a Finding (fail = ATC would reject the command)."""
    out: list[Finding] = []
    shape = o.input_shape
    dyn_opts = [k for k in DYNAMIC_OPTIONS if getattr(o, k) is not None]
    if shape is not None and shape.has_ranges:
        dyn_opts.append("input_shape ranges (lo~hi)")
    if len(dyn_opts) > 1:
        out.append(Finding("one-dynamic-option", FAIL, f"{' and '.join('--' + k for k in dyn_opts)} are combined",
                           "ATC takes only one of dynamic_batch_size / dynamic_image_size / dynamic_dims / shape "
                           "ranges per model; keep one"))
    else:
        out.append(Finding("one-dynamic-option", PASS, f"dynamic shape option: {dyn_opts[0] if dyn_opts else 'none'}"))
    n_dyn = shape.dynamic_count if shape is not None else 0
    if n_dyn and not (o.dynamic_dims or o.dynamic_batch_size or o.dynamic_image_size):
        out.append(Finding("dynamic-needs-gears", FAIL,
                           f"--input_shape has {n_dyn} dynamic dimension(s) (-1) but no gears (E10001)",
                           "give --dynamic_dims gears (dsconv: --batch/--seq) or fixed sizes/ranges"))
    elif (o.dynamic_dims or o.dynamic_batch_size or o.dynamic_image_size) and not n_dyn:
        out.append(Finding("dynamic-needs-gears", FAIL, "gears are given but --input_shape has no -1",
                           "mark the dynamic dimensions with -1 in --input_shape"))
    else:
        out.append(Finding("dynamic-needs-gears", PASS, f"{n_dyn} dynamic dimension(s), each with gears"))
    if o.dynamic_dims is not None:
        if o.input_format != "ND":
            out.append(Finding("dynamic-dims-nd", FAIL, f"--dynamic_dims needs --input_format=ND, got {o.input_format}",
                               "pass --input_format=ND"))
        bad = [i for i, g in enumerate(o.dynamic_dims) if len(g) != n_dyn]
        if bad:
            out.append(Finding("gear-width", FAIL,
                               f"gear {bad[0]} of --dynamic_dims has {len(o.dynamic_dims[bad[0]])} values for "
                               f"{n_dyn} -1 dimension(s) in --input_shape",
                               "give one value per -1, in --input_shape order"))
        if len(set(o.dynamic_dims)) != len(o.dynamic_dims):
            out.append(Finding("gear-unique", FAIL, "--dynamic_dims lists a gear twice", "remove the duplicate"))
    gears = o.dynamic_dims or o.dynamic_batch_size or o.dynamic_image_size
    if gears is not None:
        out.append(gear_count_finding(len(gears)))
    if o.dynamic_batch_size is not None and shape is not None:
        off = [n for n, dims in shape.entries for i, d in enumerate(dims) if d == -1 and i != 0]
        if off:
            out.append(Finding("batch-only", FAIL, f"--dynamic_batch_size with -1 outside axis 0 of {off[0]}",
                               "use --dynamic_dims, or fix every dimension but the batch"))
    if o.precision_mode is not None and o.precision_mode_v2 is not None:
        out.append(Finding("precision-v1-v2", FAIL, "--precision_mode and --precision_mode_v2 are both given",
                           "pass only one of them"))
    if o.optypelist_for_implmode is not None and o.op_select_implmode not in IMPLMODES_FOR_OPTYPELIST:
        out.append(Finding("optypelist-implmode", FAIL,
                           f"--optypelist_for_implmode needs --op_select_implmode high_precision or high_performance, "
                           f"got {o.op_select_implmode}", "set --op_select_implmode=high_precision"))
    mode = o.precision_mode or o.precision_mode_v2
    if o.keep_dtype is not None and mode in KEEP_DTYPE_IGNORED_WITH:
        out.append(Finding("keep-dtype-ignored", WARN, f"--keep_dtype is ignored with precision mode {mode}",
                           "drop --keep_dtype or choose another precision mode"))
    if o.framework == 5 and not o.model.lower().endswith(".onnx"):
        out.append(Finding("framework", WARN, f"--framework=5 (ONNX) with model {o.model}",
                           "point --model at the .onnx file"))
    return out


def gear_count_finding(n: int, lo: int = 2, hi: int = 100) -> Finding:
    if not lo <= n <= hi:
        return Finding("gear-count", FAIL, f"{n} gear(s); ATC accepts {lo} to {hi}",
                       "use fewer --batch/--seq/--past values" if n > hi else
                       "give at least two gears, or single values for a static compile")
    return Finding("gear-count", PASS, f"{n} gears (ATC accepts {lo}-{hi})")
