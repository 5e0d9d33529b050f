"""`dsconv eval` a layer at a time: the streamed pass gives the in-memory path's figures on every family and scheme,
with every linear and the vocabulary cut into many blocks; `--qa` compares answers; bad QA input, a prompt too long
and an output of another model exit 2 before any work."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsconv.checkpoint import Checkpoint
from dsconv.quant import stage
from dsconv.quant.evaluate import engine_linear
from dsconv.quant.evaluate.fidelity import eval_chunks, compare, load_original_model, load_quantized_model
from dsconv.quant.evaluate.qa import divergence, exact_match
from dsconv.quant.evaluate.streamed import StreamedModel, run_pass
from dsconv.runner.metrics import HeadStats, text_metrics
from dsconv.quant.plan.options import QuantOptions
from dsconv.quant.stage import QuantRequest

pytestmark = [pytest.mark.cli]

SMALL = dict(calib_samples=8, seq_len=48)
# family, scheme, engine, kv cache: every kind of quantized linear the eval computes (static and dynamic int8
# activations, weight-only, the W4A8 kernel), MoE experts per family, and both int8 caches (C8, FA quant)
CASES = [
    ("qwen2", "w8a8", "mindie", None),
    ("deepseek_v3", "w4a8_dynamic", "mindie", None),
    ("deepseek_v3", "w8a8_dynamic", "vllm-ascend", "int8"),
    ("qwen3", "w8a8", "vllm-ascend", "int8"),
    ("mixtral", "w8a8_dynamic", "mindie", None),
    ("qwen2_moe", "w8a8_dynamic", "mindie", None),
    ("gemma3", "w8a8", "vllm-ascend", None),
    ("llama", "w8a16", "mindie", None),
]


@pytest.fixture(scope="module")
def tok():
    from dsconv.bundled import calib_texts
    from dsconv.tiny import train_tokenizer

    return train_tokenizer(calib_texts(), vocab_size=384)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, tok):
    from dsconv.tiny import make_tiny

    root = tmp_path_factory.mktemp("streamed")
    models, outs = {}, {}
    for fam, scheme, engine, kv in CASES:
        if fam not in models:
            models[fam] = make_tiny(fam, root / fam, dtype="bf16", tokenizer=tok)
        opts = QuantOptions(**SMALL, scheme=scheme, engine=engine, **({"kv_cache": kv} if kv else {}))
        out = root / f"{fam}-{scheme}-{kv}"
        stage.run(QuantRequest(models[fam], out, opts, progress=False))
        outs[(fam, scheme, engine, kv)] = out
    return models, outs


@pytest.mark.parametrize("case", CASES, ids=["-".join(str(x) for x in c) for c in CASES])
def test_streamed_pass_equals_in_memory_path(outputs, case, monkeypatch):
    """Every metric equal to float rounding; 8 KiB blocks cut every linear and the vocabulary into many pieces."""
    models, outs = outputs
    ck, qck = Checkpoint.open(models[case[0]]), Checkpoint.open(outs[case])
    chunks, _ = eval_chunks(ck, None, 64, 5)
    want = compare(load_original_model(ck), load_quantized_model(qck)[0], chunks, progress=False)
    monkeypatch.setattr(engine_linear, "BLOCK_BYTES", 8 * 1024)
    got = text_metrics(run_pass(StreamedModel(ck, False), StreamedModel(qck, True), chunks, 4096, progress=False))
    assert want["tokens"] == got["tokens"] and want["predicted_tokens"] == got["predicted_tokens"]
    for k, v in want.items():
        # ppl_change_pct is the difference of two nearly equal perplexities, each held to 2e-4 relative: its
        # tolerance is theirs in percent points, not a fraction of itself. On the tiny DeepSeek W4A8 case the two
        # paths' float32 sums (whole linears against 8 KiB blocks) tip a few per-token int8 activation codes: on an
        # AMD EPYC host the quantized perplexity differs by 4.8e-5 relative (1.1333 against 1.1285 points), on the
        # Intel host by less than 2e-5
        tol = dict(abs=100 * 2e-4) if k == "ppl_change_pct" else dict(rel=2e-4, abs=2e-6)
        assert got[k] == pytest.approx(v, **tol), k
    assert want["ppl_change_pct"] != 0.0  # the quantization did something to compare


def test_head_stats_blocks_equal_one_pass():
    """Online log-sum-exp, KL, arg-max (first of equals) and target logits over vocabulary blocks = a full softmax."""
    g = torch.Generator().manual_seed(0)
    lo = torch.randn(7, 50, generator=g) * 4
    lq = lo + torch.randn(7, 50, generator=g) * 0.3
    lo[2, 13] = lo[2, 40] = lo[2].max() + 1  # a tie: the first index wins, as torch.argmax
    targets = torch.tensor([0, 49, 13, -1, 25, 24, 26])
    st = HeadStats(7)
    for s in range(0, 50, 12):
        st.add(lo[:, s:s + 12], lq[:, s:s + 12], s, targets)
    lpo, lpq = torch.log_softmax(lo.double(), -1), torch.log_softmax(lq.double(), -1)
    assert torch.allclose(st.kl(), (lpo.exp() * (lpo - lpq)).sum(-1), atol=1e-9)
    assert torch.equal(st.arg["o"], lo.argmax(-1)) and torch.equal(st.arg["q"], lq.argmax(-1))
    assert torch.allclose(st.lse("o"), torch.logsumexp(lo.double(), -1))
    has = targets >= 0
    assert torch.allclose(st.target["q"][has], lq[has, targets[has]].double())


def test_divergence_and_exact_match():
    assert divergence([1, 2, 3], [1, 2, 3]) is None
    assert divergence([1, 2, 3], [1, 5, 3]) == 1
    assert divergence([1, 2, 3], [1, 2]) == 2 and divergence([1, 2], [1, 2, 3]) == 2
    assert exact_match("Paris", "The capital is Paris.\nMore text")
    assert exact_match("北京", "北京") and not exact_match("Paris", "Lyon\nParis")
    assert not exact_match("10", "100")


# ------------------------------------------------------------------------------------------------ CLI
def _pair(outputs):
    models, outs = outputs
    return models["qwen3"], outs[("qwen3", "w8a8", "vllm-ascend", "int8")]


def test_cli_qa_teacher_forced_and_free_running(outputs, run_cli, tmp_path):
    """--qa --generate: the summary and report; free-running answers leave the float ones where teacher forcing
    says they do (both are greedy over the same logits, through the same int8 cache)."""
    model, q = _pair(outputs)
    qa = tmp_path / "qa.jsonl"
    qa.write_text("\n".join(json.dumps({"question": f"What is {i} plus {i}?", "answer": str(2 * i)})
                            for i in range(6)) + "\n")
    r = run_cli(["eval", "--model", model, "-q", q, "--qa", qa, "--generate", "--max-new-tokens", "12",
                 "--samples", "2", "--seq-len", "64", "--json", "-o", tmp_path / "ev"])
    assert r.code == 0, r.err
    s = json.loads(r.out)["qa"]
    assert s["questions"] == 6 and s["teacher_forced"]["of"] == 6 and s["free_running"]["of"] == 6
    assert s["exact_match"]["questions"] == 6 and "quantized" in s["exact_match"]
    report = json.loads((tmp_path / "ev" / "eval_report.json").read_text())
    assert report["qa"]["changed"] == s["changed"]
    same = sum(row["teacher_forced_divergence"] == row["free_running_divergence"] for row in s["changed"])
    assert same >= len(s["changed"]) - 1  # a near-tie may round either way once
    for row in s["changed"]:
        assert row["where"].startswith(str(qa))
    # the limit: every changed answer counts
    changed = 100.0 * (6 - s["free_running"]["identical"]) / 6
    if changed > 0:
        r = run_cli(["eval", "--model", model, "-q", q, "--qa", qa, "--max-new-tokens", "12", "--samples", "2",
                     "--seq-len", "64", "--max-answer-change", f"{changed / 2}"])
        assert r.code == 3 and "answers changed" in r.err


def test_cli_qa_default_is_the_bundled_held_out_set(outputs, run_cli):
    model, q = _pair(outputs)
    r = run_cli(["eval", "--model", model, "-q", q, "--qa", "--max-new-tokens", "4", "--samples", "1", "--json"])
    assert r.code == 0, r.err
    s = json.loads(r.out)["qa"]
    assert "qa_heldout.jsonl" in s["source"] and s["questions"] >= 30
    assert s["chat_template"] is False  # the tiny tokenizer has none, and the report says so
    from dsconv.bundled import bundled_calib_path

    calib = {json.loads(x)["question"] for x in bundled_calib_path().read_text().splitlines() if x.strip()}
    held = Path(__import__("dsconv.quant.evaluate.qa", fromlist=["x"]).bundled_qa_path())
    assert not calib & {json.loads(x)["question"] for x in held.read_text().splitlines() if x.strip()}


@pytest.mark.parametrize("line,expect", [
    ('{"question": "ok"}\n{"question": ', ":2"),
    ('{"question": "ok"}\n{"answer": "no question"}', ":2: no question"),
    ('{"question": "ok", "answer": 5}', ":1: \"answer\" must be a string"),
])
def test_cli_qa_bad_line_names_file_and_line(outputs, run_cli, tmp_path, line, expect):
    model, q = _pair(outputs)
    qa = tmp_path / "bad.jsonl"
    qa.write_text(line)
    r = run_cli(["eval", "--model", model, "-q", q, "--qa", qa, "-o", tmp_path / "ev"])
    assert r.code == 2 and str(qa) + expect in r.err and "Traceback" not in r.err
    assert not (tmp_path / "ev").exists()


def test_cli_qa_prompt_too_long_names_the_question(outputs, run_cli, tmp_path):
    model, q = _pair(outputs)
    qa = tmp_path / "long.jsonl"
    qa.write_text(json.dumps({"question": "short"}) + "\n" + json.dumps({"question": "word " * 200}) + "\n")
    r = run_cli(["eval", "--model", model, "-q", q, "--qa", qa, "--seq-len", "128"])
    assert r.code == 2 and f"{qa}:2: the prompt is" in r.err and "--seq-len (128)" in r.err


def test_cli_output_of_another_model_exits_2_before_work(outputs, run_cli, tmp_path, tok):
    """A quantize output of a different model (another width, other layer shapes, another family) is refused by
    config, shape or name before anything is computed."""
    from dsconv.tiny import make_tiny

    models, outs = outputs
    q = outs[("qwen2", "w8a8", "mindie", None)]
    wide = make_tiny("qwen2", tmp_path / "wide", dtype="bf16", tokenizer=tok, hidden_size=96)
    r = run_cli(["eval", "--model", wide, "-q", q])
    assert r.code == 2 and "is not a quantization of" in r.err and "hidden_size" in r.err
    other = make_tiny("qwen2", tmp_path / "other", dtype="bf16", tokenizer=tok, intermediate_size=80)
    r = run_cli(["eval", "--model", other, "-q", q])
    assert r.code == 2 and "mlp" in r.err and "has shape" in r.err
    r = run_cli(["eval", "--model", models["llama"], "-q", outs[("qwen2", "w8a8", "mindie", None)]])
    assert r.code == 2 and "is not a quantization of" in r.err


def test_cli_generate_needs_qa(outputs, run_cli):
    model, q = _pair(outputs)
    r = run_cli(["eval", "--model", model, "-q", q, "--generate"])
    assert r.code == 2 and "--qa" in r.err


def test_cli_eval_split_over_workers_equals_one_process(outputs, run_cli, tmp_path):
    """--workers 2: runs of sequences in two processes, each streaming both checkpoints; the figures equal one
    process's to float rounding (only the batches' composition differs), answers included."""
    model, q = _pair(outputs)
    base = ["eval", "--model", model, "-q", q, "--samples", "6", "--seq-len", "64", "--qa", "--max-new-tokens", "6",
            "--json"]
    one = json.loads(run_cli(base + ["--workers", "1"]).out)
    two = json.loads(run_cli(base + ["--workers", "2"]).out)
    for k in ("tokens", "predicted_tokens", "ppl_original", "ppl_quantized", "kl_divergence", "top1_agreement"):
        assert two[k] == pytest.approx(one[k], rel=2e-4, abs=2e-6), k
    assert two["qa"]["teacher_forced"] == one["qa"]["teacher_forced"]
