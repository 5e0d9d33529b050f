"""The plain (fast) readers - safetensors headers (schemas.model._plain_header) and JSON documents
(schemas.core._plain_json) - against the strict reader they short-cut.

The property: whatever the bytes, a plain reader either declines or returns exactly what the strict reader returns;
so every input the strict reader rejects (duplicate keys, offsets out of range or overlapping, deep nesting, lone
surrogates, oversized integers, NaN) is still rejected with the strict reader's message.
"""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsconv import schemas
from dsconv.errors import UserError
from dsconv.schemas.core import _DECLINED, _plain_json
from dsconv.schemas.model import DTYPE_SIZES, _plain_header, _strict_header

pytestmark = pytest.mark.unit

SETTINGS = settings(max_examples=300, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

E = '"dtype": "F32", "shape": [2], "data_offsets": [0, 8]'
HOSTILE = [
    # (header bytes, data bytes, words of the strict reader's message)
    (b'{"a": {' + E.encode() + b'}, "a": {' + E.encode() + b'}}', 8, "twice"),
    (b'{"a": {"dtype": "F32", "dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', 8, "twice"),
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', 7, "past the end"),
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}, '
     b'"b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', 16, "overlap"),
    (b'{"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}', 8, "needs 12"),
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}', 8, "not [begin, end]"),
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": ' + b"[" * 40 + b"]" * 40 + b"}}", 8,
     "nested deeper"),
    (b"[" * 99999 + b"]" * 99999, 0, "nested deeper"),
    (b'{"a\\ud800": {' + E.encode() + b"}}", 8, "surrogate"),
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": ' + b"7" * 25 + b"}}", 8, "25 digits"),
    (b'{"a": {"dtype": "F32", "shape": [' + b"1" * 5000 + b'], "data_offsets": [0, 8]}}', 8, "5000 digits"),
    (b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 8]}}', 8, "NaN"),
    (b'{"a": {"dtype": "F32", "shape": [true, 2], "data_offsets": [0, 8]}}', 8, "shape"),
    (b'{"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}', 8, "shape"),
    (b'{"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}', 8, "dtype"),
    (b'{"__metadata__": {"k": 1}, "a": {' + E.encode() + b"}}", 8, "__metadata__"),
    (b'{"": {' + E.encode() + b"}}", 8, "0 characters"),
    (b"[1, 2]", 0, "not a JSON object"),
    (b'{"a": {' + E.encode() + b'}} {"b": 1}', 8, "invalid JSON"),
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": "F32"}', 8, "instead of an object"),
]


@pytest.mark.parametrize("raw,data_len,words", HOSTILE, ids=[h[2] for h in HOSTILE])
def test_hostile_headers_keep_the_strict_message(raw, data_len, words):
    assert _plain_header(raw, data_len) is None
    with pytest.raises(UserError, match=words.replace("[", r"\[").replace("]", r"\]")):
        schemas.safetensors_header(raw, "m.safetensors", data_len)


def test_plain_header_takes_the_usual_header():
    header = {"__metadata__": {"format": "pt"},
              "b": {"dtype": "BF16", "shape": [4, 2], "data_offsets": [8, 24]},
              "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "z": {"dtype": "I8", "shape": [0, 5], "data_offsets": [24, 24]}}
    raw = json.dumps(header).encode()
    plain = _plain_header(raw, 24)
    assert plain is not None and plain == _strict_header(raw, "m", 24)
    assert "__metadata__" not in plain
    # escapes (non-ASCII names as json.dumps writes them) take the strict path, with the same result
    raw = json.dumps({"é": header["a"]}).encode()
    assert _plain_header(raw, 8) is None and schemas.safetensors_header(raw, "m", 8) == {"é": header["a"]}


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=6))
values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=4), c,
                                                                                              max_size=3)), max_leaves=8)


@st.composite
def headers(draw):
    """Mostly valid headers, then bent: an entry's field replaced or added, metadata, offsets moved, bytes changed
    (each bend in about one case of four)."""
    bend = st.integers(0, 3).map(lambda i: i == 0)
    chars = st.characters(codec="ascii") if draw(st.booleans()) else st.characters()
    header, offset = {}, 0
    for name in draw(st.lists(st.text(chars, min_size=0 if draw(bend) else 1, max_size=6), max_size=5, unique=True)):
        dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        n = math.prod(shape) * DTYPE_SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    if header and draw(bend):
        name = draw(st.sampled_from(sorted(header)))
        header[name][draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))] = draw(values)
    if draw(bend):
        header["__metadata__"] = draw(st.one_of(st.dictionaries(st.text(max_size=4), st.text(max_size=4)), values))
    raw = json.dumps(header, allow_nan=True).encode("utf-8", "surrogatepass")
    if raw and draw(bend):
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + draw(st.binary(min_size=1, max_size=3)) + raw[i + 1:]
    return raw, max(0, offset + draw(st.sampled_from([0, 0, 0, -1, 1, -4])))


@SETTINGS
@given(headers())
def test_plain_header_agrees_with_the_strict_reader(case):
    raw, data_len = case
    plain = _plain_header(raw, data_len)
    try:
        strict = _strict_header(raw, "m", data_len)
    except UserError:
        assert plain is None
        return
    assert plain is None or plain == strict


hostile_json = st.one_of(
    values.map(lambda v: json.dumps(v, allow_nan=True).encode("utf-8", "surrogatepass")),
    st.builds(lambda d, s: d * b"[" + s + d * b"]", st.integers(0, 40), st.sampled_from([b"", b"1", b'"a"', b"{}"])),
    st.builds(lambda n: b'{"a": [' + b"7" * n + b"]}", st.integers(1, 30)),
    st.binary(max_size=60),
)


@SETTINGS
@given(hostile_json, st.data())
def test_plain_json_agrees_with_the_strict_reader(raw, data):
    if raw and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + data.draw(st.binary(min_size=1, max_size=2)) + raw[i + 1:]
    plain = _plain_json(raw, schemas.core.MAX_DEPTH)
    try:
        strict = schemas.parse_json(bytearray(raw), "f.json", "fix it")  # bytearray: the strict path only
    except UserError:
        assert plain is _DECLINED
        return
    assert plain is _DECLINED or plain == strict


@pytest.mark.parametrize("raw,words", [
    (b'{"a": 1, "a": 2}', "twice"), (b'{"a": [' + b"1" * 21 + b"]}", "21 digits"), (b'{"a": NaN}', "NaN"),
    (b'{"a": "\\udc00"}', "surrogate"), (b"[" * 33 + b"]" * 33, "nested deeper"), (b'{"a": 1e999}', "infinity"),
    (b'{"a": 0.' + b"1" * 400 + b"}", "400 characters"),
])
def test_plain_json_declines_what_the_strict_reader_rejects(raw, words):
    assert _plain_json(raw, schemas.core.MAX_DEPTH) is _DECLINED
    with pytest.raises(UserError, match=words):
        schemas.parse_json(raw, "f.json", "fix it")


def test_plain_json_takes_an_index():
    doc = {"metadata": {"total_size": 2**60, "note": None}, "weight_map": {f"t{i}": "a.safetensors" for i in range(9)}}
    raw = json.dumps(doc).encode()
    assert _plain_json(raw, schemas.core.MAX_DEPTH) == doc == schemas.parse_json(raw, "f.json", "fix it")
    deep = b"[" * 32 + b"]" * 32  # 32 levels pass, 33 do not, on both paths
    assert _plain_json(deep, 32) == json.loads(deep) == schemas.parse_json(bytearray(deep), "f", "h", max_depth=32)
    assert _plain_json(b"[" + deep + b"]", 32) is _DECLINED
