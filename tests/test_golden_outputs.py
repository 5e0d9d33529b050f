"""Golden outputs: the bytes each stage writes for the demo and the tiny models, pinned by sha256.

A refactor must not change what users get. This runs the CLI on seeded tiny models and compares every output file's
hash (text files with the temporary root replaced by `<ROOT>`; manifests by their per-file hashes; reports without
timings) with `tests/golden_outputs.json`. An intended output change regenerates that file in the same commit:

    DSCONV_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden_outputs.py

so that the review shows which outputs changed. MindIR files are left out: MindSpore writes different bytes each run.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cli, pytest.mark.slow]

GOLDEN = Path(__file__).with_name("golden_outputs.json")
PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])  # the checkout: reports name bundled data files by path
# report keys that vary run to run: timings, free memory, float error figures, MindIR sizes
TIMING_KEYS = ("seconds", "time", "timing", "elapsed", "rss", "throughput", "created", "available", "versions", "command", "err",
               "mindir", "files", "where", "worst", "estimated")
NONDETERMINISTIC = (".mindir",)
BINARY = (".safetensors", ".onnx", ".onnx_data", ".data")  # text files may name the temporary root

# (case name, family, fused, [CLI args after the model]) - each case quantizes / exports / shards one tiny model
CASES: list[tuple[str, str, bool, list[str]]] = [
    ("llama-w4a16-gptq", "llama", False, ["quantize", "--scheme", "w4a16", "--group-size", "32", "--method", "gptq", "--calib-samples", "8"]),
    ("llama-w4a16-pc", "llama", False, ["quantize", "--scheme", "w4a16", "--group-size", "0", "--method", "rtn"]),
    ("qwen2-w8a8", "qwen2", False, ["quantize", "--bits", "8", "--calib-samples", "8"]),
    ("qwen3-w8a16", "qwen3", False, ["quantize", "--scheme", "w8a16"]),
    ("qwen3_moe-w8a8dyn", "qwen3_moe", False, ["quantize", "--scheme", "w8a8_dynamic"]),
    ("mixtral-fused-w8a8", "mixtral", True, ["quantize", "--bits", "8", "--calib-samples", "8"]),
    ("qwen2_moe-shard", "qwen2_moe", False, ["shard", "--ep", "2", "--tp", "2"]),
    ("llama-fp16", "llama", False, ["export", "--format", "safetensors", "--dtype", "fp16"]),
    ("qwen2-onnx", "qwen2", False, ["export", "--format", "onnx"]),
    ("deepseek_v3-w8a16-shard", "deepseek_v3", False, ["quantize", "--scheme", "w8a16"]),
]


def _normalised_hash(path: Path, root: Path) -> str:
    data = path.read_bytes()
    if path.name == "dsconv_manifest.json":
        files = json.loads(data)["files"]  # report-like files are compared normalised, on their own
        data = json.dumps({k: v["sha256"] if Path(k).suffix in BINARY else "-"
                           for k, v in sorted(files.items())}).encode()
    elif path.suffix in (".json", ".sh", ".txt", ".cfg", ".toml"):
        text = data.decode("utf-8").replace(str(root), "<ROOT>").replace(PACKAGE_ROOT, "<PACKAGE>")
        if path.suffix == ".json" and ("report" in path.name or "info" in path.name or path.name == "plan.json"):
            text = json.dumps(_drop_timings(json.loads(text)), sort_keys=True)
        data = text.encode()
    return hashlib.sha256(data).hexdigest()


def _drop_timings(obj):
    if isinstance(obj, dict):
        return {k: _drop_timings(v) for k, v in obj.items()
                if not (any(t in k.lower() for t in TIMING_KEYS) or k.endswith("_s"))}
    if isinstance(obj, list):
        return [_drop_timings(v) for v in obj]
    return obj


def _tree_hashes(out: Path, root: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): _normalised_hash(p, root) for p in sorted(out.rglob("*"))
            if p.is_file() and p.suffix not in NONDETERMINISTIC and p.name != "demo-stdout.txt"}


@pytest.fixture(scope="module")
def produced(tmp_path_factory, run_cli) -> dict[str, dict[str, str]]:
    from dsconv.bundled import calib_texts
    from dsconv.cli import cli
    from dsconv.demo import run_demo
    from dsconv.tiny import make_tiny, train_tokenizer

    root = base = tmp_path_factory.mktemp("golden")
    result: dict[str, dict[str, str]] = {}
    demo = root / "demo"
    run_demo(demo, cli, echo=lambda s: None)
    result["demo"] = _tree_hashes(demo / "out", base)
    tok = train_tokenizer(calib_texts(), vocab_size=384)
    for name, family, fused, args in CASES:
        model = make_tiny(family, root / "models" / name, fused=fused, dtype="bf16", tokenizer=tok)
        out = root / name
        r = run_cli([args[0], "--model", model, "--output", out, *args[1:]])
        assert r.code == 0, f"{name}: {r.err}"
        if name == "deepseek_v3-w8a16-shard":  # shard reads the quantized output: scales sliced with their weights
            r = run_cli(["shard", "--model", out, "--output", root / f"{name}-sharded", "--ep", "4", "--tp", "2"])
            assert r.code == 0, r.err
            result[f"{name}-sharded"] = _tree_hashes(root / f"{name}-sharded", base)
        result[name] = _tree_hashes(out, base)
    return result


def test_outputs_are_byte_identical_to_golden(produced):
    if os.environ.get("DSCONV_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(produced, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"golden hashes rewritten: {GOLDEN}")
    golden = json.loads(GOLDEN.read_text())
    diffs = []
    for case in sorted(set(golden) | set(produced)):
        g, p = golden.get(case, {}), produced.get(case, {})
        for f in sorted(set(g) | set(p)):
            if g.get(f) != p.get(f):
                diffs.append(f"{case}/{f}: {'missing' if f not in p else 'new' if f not in g else 'changed'}")
    assert not diffs, "outputs differ from tests/golden_outputs.json (intended? set DSCONV_UPDATE_GOLDEN=1):\n" + \
        "\n".join(diffs)
