"""Bounded parsing of untrusted JSON/TOML/text, and typed field access that fails with one line.

Why not bare `json.loads`: it raises five exception types for hostile input (RecursionError on deep nesting,
ValueError past 4300-digit integers, UnicodeDecodeError on non-UTF-8, and it accepts NaN/Infinity and lone surrogates
that crash later, far from the file). Everything here turns each of those into a UserError naming the file and the fix,
and bounds what it accepts (size, depth, integer width), so later code can trust the types it is handed.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Iterable

from dsconv.errors import UserError

MAX_FILE = 64 * 2**20      # a config, manifest, index or profile larger than this is not one (DeepSeek's index: 9 MB)
MAX_DEPTH = 32             # no input of dsconv nests deeper than 5; 32 leaves room and stays far from the C stack
MAX_INT_DIGITS = 20        # 2**64 has 20 digits: every integer dsconv reads fits in 64 bits
MISSING: Any = object()


class _Bad(ValueError):
    """Raised inside json hooks; carries the message for the UserError."""


def os_reason(e: OSError) -> str:
    """'permission denied', 'no space left on device': the OS's own words, lower case, no errno noise."""
    return (e.strerror or type(e).__name__).lower()


def read_bytes(path: Path, what: str, hint: str, limit: int = MAX_FILE) -> bytes:
    """A whole small input file, or a one-line error: missing, a directory, unreadable, or too large."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if path.is_dir():
            raise UserError(f"{what} {path} is a directory", hint=hint)
        if size > limit:
            raise UserError(f"{what} {path} is {size} bytes (limit {limit})",
                            hint="this is not the file dsconv expects; " + hint)
        with open(path, "rb") as f:
            return f.read(limit + 1)
    except FileNotFoundError:
        raise UserError(f"{what} {path} does not exist", hint=hint) from None
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {os_reason(e)}", hint="check its permissions") from None


def decode_utf8(raw: bytes, where: str, hint: str = "save the file as UTF-8", kind: str = "text") -> str:
    """Strict UTF-8 (a leading BOM is tolerated, as editors on Windows write one)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: not UTF-8 {kind} (byte {e.start})", hint=hint) from None
    return text[1:] if text.startswith("\ufeff") else text


def _int(s: str) -> int:
    if len(s.lstrip("-")) > MAX_INT_DIGITS:
        raise _Bad(f"an integer of {len(s.lstrip('-'))} digits is out of range")
    return int(s)


def _float(s: str) -> float:
    if len(s) > 400:
        raise _Bad("a number of more than 400 characters")
    v = float(s)
    if not math.isfinite(v):
        raise _Bad(f"the number {s[:30]} overflows to infinity")
    return v


def _constant(name: str) -> Any:
    raise _Bad(f"{name} is not valid JSON (only finite numbers are)")


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _Bad(f"key {k[:80]!r} appears twice")
            seen.add(k)
    return out


def check_tree(data: Any, max_depth: int = MAX_DEPTH) -> str | None:
    """The first problem of a parsed document (too deep, a lone surrogate in a string), or None. Iterative."""
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if not node.isascii():
                try:
                    node.encode("utf-8")
                except UnicodeEncodeError:
                    return f"the string {node[:40]!r} holds a lone surrogate (not text)"
        elif isinstance(node, (dict, list)):
            if depth >= max_depth:
                return f"nested deeper than {max_depth} levels"
            if isinstance(node, dict):
                stack.extend((k, depth + 1) for k in node)
                stack.extend((v, depth + 1) for v in node.values())
            else:
                stack.extend((v, depth + 1) for v in node)
    return None


class Duplicate(Exception):
    """A key appears twice (raised by `no_duplicates` inside json.loads; the strict reader says which)."""


def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """object_pairs_hook of the plain paths: a dict, or Duplicate."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise Duplicate
    return out


_DECLINED: Any = object()
_PLAIN_LEAVES = frozenset({str, bool, type(None)})
_INT_LIMIT = 10 ** MAX_INT_DIGITS  # _int's bound: at most MAX_INT_DIGITS digits


def _plain_json(raw: bytes, max_depth: int) -> Any:
    """The document when the strict reader would return it unchanged and it is plain - no \\u escape (the only way
    to a lone surrogate), no float (whose literal the strict reader bounds), every integer within
    MAX_INT_DIGITS digits, no duplicate key, nested less than `max_depth` - else _DECLINED (the strict reader then
    accepts or rejects it with its message). One C-level parse and a walk of the containers only: the strict
    reader's hooks and tree walk cost 0.2 s over DeepSeek-V3's 9 MB index."""
    import json

    if b"\\u" in raw:
        return _DECLINED
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except Exception:  # every parse failure (duplicates included) is the strict reader's to report
        return _DECLINED
    stack = [(data, 0)] if type(data) in (dict, list) else []
    if not stack and not _plain_leaf(data):
        return _DECLINED
    while stack:
        node, depth = stack.pop()
        if depth >= max_depth:
            return _DECLINED
        values = node.values() if type(node) is dict else node
        if set(map(type, values)) <= _PLAIN_LEAVES:  # e.g. the index's 91,991 file names: no walk
            continue
        for v in values:
            if type(v) in (dict, list):
                stack.append((v, depth + 1))
            elif not _plain_leaf(v):
                return _DECLINED
    return data


def _plain_leaf(v: Any) -> bool:
    return type(v) in _PLAIN_LEAVES or (type(v) is int and -_INT_LIMIT < v < _INT_LIMIT)


def parse_json(text: str | bytes, where: str, hint: str, max_depth: int = MAX_DEPTH, line: int | None = None) -> Any:
    """Strict, bounded JSON: UTF-8, no NaN/Infinity, no duplicate keys, 64-bit integers, bounded nesting, real text.

    Errors read `FILE:LINE: ...` (`line` is where `text` starts in its file, for one-record-per-line formats).
    Bytes take a plain path first (`_plain_json`), which accepts only what the strict reader accepts, unchanged."""
    import json

    if isinstance(text, bytes):
        data = _plain_json(text, max_depth)
        if data is not _DECLINED:
            return data
    at = f":{line}" if line is not None else ""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = decode_utf8(bytes(text), where, hint, kind="JSON")
    try:
        data = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant,
                          object_pairs_hook=_pairs)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}:{(line or 1) + e.lineno - 1}: invalid JSON ({e.msg} at column {e.colno})",
                        hint=hint) from None
    except _Bad as e:
        raise UserError(f"{where}{at}: {e}", hint=hint) from None
    except RecursionError:
        raise UserError(f"{where}{at}: nested deeper than {max_depth} levels", hint=hint) from None
    except (ValueError, OverflowError, MemoryError) as e:  # int() past sys.get_int_max_str_digits, and kin
        raise UserError(f"{where}{at}: unreadable JSON ({type(e).__name__})", hint=hint) from None
    problem = check_tree(data, max_depth)
    if problem:
        raise UserError(f"{where}{at}: {problem}", hint=hint)
    return data


def read_json(path: Path, what: str, hint: str, limit: int = MAX_FILE) -> Any:
    """read_bytes + parse_json: the way in for every small JSON file dsconv reads."""
    return parse_json(read_bytes(path, what, hint, limit), str(path), hint)


def read_toml(path: Path, what: str, hint: str) -> dict[str, Any]:
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    text = decode_utf8(read_bytes(path, what, hint), str(path))
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: invalid TOML ({e})", hint=hint) from None
    except (RecursionError, ValueError) as e:
        raise UserError(f"{path}: unreadable TOML ({type(e).__name__})", hint=hint) from None
    problem = check_tree(data)
    if problem:
        raise UserError(f"{path}: {problem}", hint=hint)
    return data


def type_name(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


class Fields:
    """Typed, bounded access to one JSON object: every getter fails with `WHERE: "key" must be ...; HINT`.

    `null` counts as absent (HF writes `"head_dim": null`), so optional getters return the default for it.
    """

    def __init__(self, data: Any, where: str, hint: str, what: str = "an object") -> None:
        if not isinstance(data, dict):
            raise UserError(f"{where}: expected {what}, got {type_name(data)}", hint=hint)
        self.data = data
        self.where = where
        self.hint = hint

    def fail(self, key: str, must: str, value: Any = MISSING) -> UserError:
        got = "" if value is MISSING else f", got {show(value)}"
        return UserError(f"{self.where}: \"{key}\" must be {must}{got}", hint=self.hint)

    def _get(self, key: str, default: Any, must: str) -> Any:
        v = self.data.get(key)
        if v is None:
            if default is MISSING:
                what = "null" if key in self.data else "missing"
                raise UserError(f"{self.where}: \"{key}\" is {what} (it must be {must})", hint=self.hint)
            return default
        return v

    def _checked(self, key: str, default: Any, must: str, ok: Callable[[Any], bool]) -> Any:
        """The value of `key` if `ok` accepts it; the default when absent; else the one-line error."""
        v = self._get(key, default, must)
        if v is default and default is not MISSING:
            return v
        if not ok(v):
            raise self.fail(key, must, v)
        return v

    def int(self, key: str, lo: int, hi: int, default: Any = MISSING) -> Any:
        return self._checked(key, default, f"an integer in {lo}..{hi}", is_int(lo, hi))

    def number(self, key: str, lo: float, hi: float, default: Any = MISSING) -> Any:
        return self._checked(key, default, f"a finite number in {lo:g}..{hi:g}",
                             lambda v: not isinstance(v, bool) and isinstance(v, (int, float))
                             and math.isfinite(v) and lo <= v <= hi)

    def str(self, key: str, default: Any = MISSING, choices: Iterable[str] | None = None, max_len: int = 4096) -> Any:
        allowed = tuple(choices) if choices is not None else None
        must = f"one of {', '.join(allowed)}" if allowed else "a non-empty string"
        return self._checked(key, default, must, lambda v: isinstance(v, str) and 0 < len(v) <= max_len
                             and (not allowed or v in allowed))

    def bool(self, key: str, default: Any = MISSING) -> Any:
        return self._checked(key, default, "true or false", lambda v: isinstance(v, bool))

    def obj(self, key: str, default: Any = MISSING) -> Any:
        return self._checked(key, default, "an object", lambda v: isinstance(v, dict))

    def list(self, key: str, item: Callable[[Any], bool], must: str, default: Any = MISSING,
             max_len: int = 1 << 20) -> Any:
        return self._checked(key, default, must, lambda v: isinstance(v, list) and len(v) <= max_len
                             and all(item(x) for x in v))

    def only(self, allowed: Iterable[str]) -> None:
        """Unknown keys are typos until proven otherwise (onnxruntime's stringly options are the counter-example)."""
        allowed = set(allowed)
        unknown = sorted(k for k in self.data if k not in allowed)
        if unknown:
            raise UserError(f"{self.where}: unknown key {unknown[0]!r}",
                            hint=f"allowed keys are {', '.join(sorted(allowed))}; fix the spelling or remove it")


def is_int(lo: int, hi: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def is_finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
