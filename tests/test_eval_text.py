"""`dsconv eval`'s default text is text no calibration default uses (dsconv/eval_data), and eval says so when the
text it scores is the calibration set the quantize output was fitted on."""
from __future__ import annotations

import json

import pytest

from dsconv.bundled import calib_texts, eval_text_paths, eval_texts

pytestmark = pytest.mark.cli
# a passage: this many characters in a row (whitespace collapsed). The longest run the two texts share today is 24
# characters ("f an exception is raised"), a phrase, not a passage
PASSAGE = 40


def _flat(texts: list[str]) -> str:
    return " ".join(" ".join(t.split()) for t in texts)


def test_default_eval_text_shares_no_passage_with_the_default_calibration_set():
    ev, cal = _flat(eval_texts()), _flat(calib_texts())
    seen = {cal[i:i + PASSAGE] for i in range(len(cal) - PASSAGE + 1)}
    shared = [ev[i:i + PASSAGE] for i in range(len(ev) - PASSAGE + 1) if ev[i:i + PASSAGE] in seen]
    assert not shared, shared[:3]


def test_default_eval_text_is_english_and_chinese_and_long_enough():
    """Each language alone fills a 2,048-token window: on the real fixtures' tokenizers English takes 4.4 characters
    per token (Qwen2.5: 6,515 tokens) and Chinese 1.45 (Qwen2.5: 2,553 tokens; Gemma 3: 2,730), so these counts
    hold with room."""
    en, zh = eval_texts()
    assert all(p.name.endswith(".txt") for p in eval_text_paths())
    assert sum(c.isascii() for c in en) / len(en) > 0.99 and len(en) > 4.4 * 2048 * 2
    han = sum("\u4e00" <= c <= "\u9fff" for c in zh)
    assert han / len(zh) > 0.8 and len(zh) > 1.45 * 2048


def test_eval_reports_the_default_text_and_flags_the_calibration_set(tiny_model, run_cli, tmp_path):
    """Default: the bundled evaluation text, no note. --text the very file quantize calibrated on: a note in the
    summary and in --json."""
    from dsconv.bundled import bundled_calib_path
    from dsconv.tiny import make_tiny, train_tokenizer

    src = make_tiny("llama", tmp_path / "src", dtype="bf16", tokenizer=train_tokenizer(calib_texts(), vocab_size=384))
    q = tmp_path / "q"
    assert run_cli(["quantize", "-m", src, "-o", q, "--bits", "8", "--calib-samples", "8", "--seq-len", "32"]).code == 0
    r = run_cli(["eval", "-m", src, "-q", q, "--samples", "2", "--seq-len", "32", "--json"])
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert out["text"].startswith("bundled eval_data") and "calibration_overlap" not in out
    own = tmp_path / "calib-copy.jsonl"
    own.write_bytes(bundled_calib_path().read_bytes())  # the same content under another name
    r = run_cli(["eval", "-m", src, "-q", q, "--samples", "2", "--seq-len", "32", "--text", own])
    assert r.code == 0, r.err
    assert f"note: --text {own} is the calibration set this output was fitted on" in r.out


def test_eval_dry_run_gives_the_plan_and_the_run_prints_it_first(tiny_model, run_cli, tmp_path):
    """--dry-run: windows, tokens, passes, questions and an estimate, nothing evaluated or written; a run prints the
    same plan line first (to stderr), and its windows and tokens are the ones it then scores."""
    from dsconv.tiny import make_tiny, train_tokenizer

    src = make_tiny("llama", tmp_path / "src", dtype="bf16", tokenizer=train_tokenizer(calib_texts(), vocab_size=384))
    q = tmp_path / "q"
    assert run_cli(["quantize", "-m", src, "-o", q, "--scheme", "w8a16"]).code == 0
    args = ["eval", "-m", src, "-q", q, "--samples", "3", "--seq-len", "64", "--qa", "--max-new-tokens", "8"]
    r = run_cli([*args, "--dry-run", "--json", "-o", tmp_path / "ev"])
    assert r.code == 0, r.err
    p = json.loads(r.out)["plan"]
    assert p["windows"] == 3 and p["tokens"] == 3 * 64 and p["questions"] == 32 and p["passes"] == 2
    assert p["estimate_s"] > 0 and p["host_gflops"] > 0 and not (tmp_path / "ev").exists()
    r = run_cli(args)
    assert r.code == 0, r.err
    assert r.err.startswith("plan: ") and "3 windows, 192 tokens; 32 questions x up to 8 answer tokens" in r.err
    assert "3 samples, 192 tokens" in r.out


@pytest.mark.parametrize("family,tied", [("gemma3", True), ("llama", False)])
def test_plan_counts_the_vocabulary_projection_once(tmp_path, family, tied):
    """The estimate's weights a token meets include the vocabulary projection: the lm_head, or the embedding where it
    is also the head (tied: Gemma 3); an untied embedding is a lookup."""
    from dsconv.checkpoint import Checkpoint
    from dsconv.families.roles import Role
    from dsconv.quant.evaluate.plan import active_params
    from dsconv.tiny import make_tiny

    ck = Checkpoint.open(make_tiny(family, tmp_path / family, dtype="bf16"))
    total, active = active_params(ck)
    assert (not any(ck.role(n).role == Role.LM_HEAD for n in ck.names())) == tied
    embed_in = sum(ck.info(n).numel for n in ck.names() if ck.role(n).role == Role.EMBED) if tied else 0
    matmul = sum(ck.info(n).numel for n in ck.names() if ck.role(n).role not in (Role.EMBED, Role.TOWER)
                 and not ck.role(n).is_aux)
    assert active == matmul + embed_in and total >= active
