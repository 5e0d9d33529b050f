"""The fast safetensors header check (schemas.model._plain_header) against the strict reader it short-cuts.

The property: whatever the bytes, the plain pass either declines (None) or returns exactly what the strict reader
returns; so every header the strict reader rejects (duplicate keys, offsets out of range or overlapping, deep nesting,
lone surrogates, oversized integers, NaN) is still rejected with the strict reader's message.
"""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsconv import schemas
from dsconv.errors import UserError
from dsconv.schemas.model import DTYPE_SIZES, _plain_header, _strict_header

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
