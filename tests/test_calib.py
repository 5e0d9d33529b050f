"""Calibration sets: every accepted format, every error (file and line named), tokenization and limits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsconv.errors import UserError
from dsconv.quant.calibrate.data import CalibSet, load_calib, min_tokens_warning, tokenize
from dsconv.runner.texts import read_texts, text_of

pytestmark = pytest.mark.unit


class CharTokenizer:
    """A stand-in with the HF call signature: one id per character (+ BOS), and an optional chat template."""

    def __init__(self, chat_template: str | None = None) -> None:
        self.chat_template = chat_template

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) % 500 + 3 for c in text]}

    def apply_chat_template(self, messages, tokenize: bool = False) -> str:
        return "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)


def write(tmp_path: Path, name: str, content: str) -> Path:
    p = tmp_path / name
    p.write_text(content, encoding="utf-8")
    return p


@pytest.mark.parametrize("row,want", [
    ({"inputs_pretokenized": "a b"}, "a b"),
    ({"text": "plain"}, "plain"),
    ({"prompt": "do it"}, "do it"),
    ({"question": "Q?", "answer": "A."}, "Q?\nA."),
    ({"question": "only Q"}, "only Q"),
    ("a bare string", "a bare string"),
])
def test_text_keys(row, want):
    assert text_of(row, "f:1") == want


def test_messages_use_the_chat_template_when_there_is_one():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert text_of({"messages": msgs}, "f:1", CharTokenizer("x")) == "<|user|>hi<|end|><|assistant|>hello<|end|>"
    assert text_of({"messages": msgs}, "f:1", CharTokenizer(None)) == "user: hi\nassistant: hello"


def test_jsonl_every_format_in_one_file(tmp_path):
    lines = [{"inputs_pretokenized": "one"}, {"text": "two"}, {"prompt": "three"}, {"question": "q", "answer": "a"},
             {"messages": [{"role": "user", "content": "five"}]}]
    p = write(tmp_path, "c.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert read_texts(p, CharTokenizer()) == ["one", "two", "three", "q\na", "user: five"]


def test_json_list_of_strings(tmp_path):
    p = write(tmp_path, "c.json", json.dumps(["x", "y", {"text": "z"}]))
    assert read_texts(p) == ["x", "y", "z"]


@pytest.mark.parametrize("content,fragment", [
    ('{"text": "ok"}\n{"text": "ok"\n', "c.jsonl:2: invalid JSON"),
    ('{"text": "ok"}\n{"txt": "x"}\n', "c.jsonl:2: no calibration text (keys: txt)"),
    ('{"text": 5}\n', "c.jsonl:1: \"text\" must be a string"),
    ('{"text": "   "}\n', "c.jsonl:1: empty calibration text"),
    ('[1, 2]\n', "c.jsonl:1: expected a string or an object"),
    ('{"messages": [{"role": "user"}]}\n', "c.jsonl:1: \"messages\" must be a non-empty list"),
    ('{"question": 3, "answer": "a"}\n', "c.jsonl:1: \"question\" and \"answer\" must be strings"),
])
def test_malformed_lines_name_file_and_line(tmp_path, content, fragment):
    p = write(tmp_path, "c.jsonl", content)
    with pytest.raises(UserError) as e:
        read_texts(p)
    assert fragment in e.value.message


def test_file_level_errors(tmp_path):
    with pytest.raises(UserError, match="is empty"):
        read_texts(write(tmp_path, "e.jsonl", "\n\n"))
    with pytest.raises(UserError, match="is empty"):
        read_texts(write(tmp_path, "e.json", "[]"))
    with pytest.raises(UserError, match="must hold a list of strings"):
        read_texts(write(tmp_path, "d.json", '{"text": "x"}'))
    with pytest.raises(UserError, match=r"d2.json:1: invalid JSON"):
        read_texts(write(tmp_path, "d2.json", "[oops"))
    with pytest.raises(UserError, match="unknown calibration format .txt"):
        read_texts(write(tmp_path, "c.txt", "hello"))
    with pytest.raises(UserError, match="does not exist"):
        read_texts(tmp_path / "missing.jsonl")
    bad = tmp_path / "bin.jsonl"
    bad.write_bytes(b'{"text": "\xff\xfe"}\n')
    with pytest.raises(UserError, match="not UTF-8"):
        read_texts(bad)
    with pytest.raises(UserError, match="item 1"):
        read_texts(write(tmp_path, "i.json", json.dumps(["ok", 3])))


def test_tokenize_truncates_and_counts(tmp_path):
    p = write(tmp_path, "c.jsonl", "\n".join(json.dumps({"text": "x" * n}) for n in (3, 10, 5)))
    cs = load_calib(p, CharTokenizer(), samples=2, seq_len=8)
    assert [len(s) for s in cs.samples] == [4, 8]  # BOS + 3; 11 cut to 8
    assert cs.truncated == 1 and cs.tokens == 12
    assert cs.describe() == {"source": str(p), "samples": 2, "tokens": 12, "seq_len": 8, "truncated_samples": 1}
    with pytest.raises(UserError, match="--calib-samples 0"):
        load_calib(p, CharTokenizer(), samples=0)
    with pytest.raises(UserError, match="--seq-len 1"):
        load_calib(p, CharTokenizer(), seq_len=1)


def test_default_is_the_bundled_set():
    cs = load_calib(None, CharTokenizer(), samples=3, seq_len=64)
    assert cs.source == "bundled qa.jsonl" and len(cs.samples) == 3


def test_too_few_tokens_is_a_warning_not_an_error():
    cs = CalibSet("x", [[1, 2, 3]] * 10, 8)
    w = min_tokens_warning(cs, {"static activation ranges": 512})
    assert w and "only 30 tokens" in w and "512" in w
    assert min_tokens_warning(cs, {"ranges": 10}) is None


def test_tokenizing_to_nothing_is_an_error():
    class Empty(CharTokenizer):
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": []}

    with pytest.raises(UserError, match="tokenize to nothing"):
        tokenize(["abc"], Empty(), 16, "src")
