"""Golden outputs: the bytes each stage writes for the demo and the tiny models, pinned by sha256.

A refactor must not change what users get. This runs the CLI on seeded tiny models and compares every output file's
hash (text files with the temporary root replaced by `<ROOT>`; manifests by their per-file hashes; reports without
the keys that vary run to run) with `tests/golden_outputs.json`. An intended output change regenerates that file in
the same commit:

    DSCONV_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden_outputs.py

so that the review shows which outputs changed. MindIR files are left out: MindSpore writes different bytes each run.

On a failure the message says, per case, which files are missing or new, and for each changed file what changed:
the outputs are rebuilt with the dsconv of the commit that last wrote golden_outputs.json (`git archive`, in a
child process) and compared tensor by tensor (name, max |difference|) and key by key. Set DSCONV_GOLDEN_DIFF=0 to
skip that rebuild.
"""
from __future__ import annotations

import contextlib
import difflib
import hashlib
import io
import json
import os
import subprocess
import sys
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest

from dsconv.io.digest import recorded

pytestmark = [pytest.mark.cli]

GOLDEN = Path(__file__).with_name("golden_outputs.json")
REPO = Path(__file__).resolve().parents[1]
PACKAGE_ROOT = str(REPO)  # the checkout: reports name bundled data files by path
# Report keys dropped before hashing, by exact name (a key not listed is hashed, wherever it sits in the report).
# VARYING: values that change run to run or host to host - timings, memory, float error figures (their last bits
# follow the thread count and the BLAS) and where the worst one sits, the MindIR export's file sizes.
VARYING = frozenset({
    "seconds", "seconds_per_layer", "layer_seconds", "expert_seconds", "timings", "mindspore_s", "peak_rss_bytes",
    "peak_rss_by_step", "available_bytes",
    "estimated_peak_bytes", "estimated_anonymous_bytes", "mindir_bytes", "files",
    "error", "error_by_alpha", "error_minmax", "error_off", "output_error", "weight_error", "weight_error_max",
    "weight_error_mean", "max_abs_err", "mean_abs_err", "logits_max_abs_err", "logits_max_abs_error",
    "logits_mean_abs_error", "logits_relative_error", "where", "worst",
    # the export checks' noise-derived tolerance: the reference's float noise, the bound, margin and scale it gives
    "noise", "bound", "margin", "max_abs_ref", "bf16_constants", "tolerance", "max_abs_err_vs_unrounded",
})
# Model-arithmetic figures hashed to 3 significant digits: their last digits follow the CPU's float kernels (the
# hashes an Intel host wrote failed on an AMD EPYC host for these figures alone, every tensor equal); a real change
# moves the first three. ppl_change_pct is the difference of two such perplexities, so its digits are float noise:
# dropped, the two perplexities kept.
ROUNDED = frozenset({"ppl_original", "ppl_quantized", "kl_divergence", "top1_agreement", "ref_max_abs", "noise_floor",
                     "atol"})
DROPPED_KEYS = VARYING | {"ppl_change_pct"}
NONDETERMINISTIC = (".mindir",)
BINARY = (".safetensors", ".onnx", ".onnx_data", ".data")  # text files may name the temporary root
REPORTS = ("report", "info")  # report-like JSON files (by name), plus plan.json

# (case name, family, fused, [CLI args after the model]) - each case quantizes / exports / shards one tiny model
CASES: list[tuple[str, str, bool, list[str]]] = [
    ("llama-w4a16-gptq", "llama", False, ["quantize", "--scheme", "w4a16", "--group-size", "64", "--method", "gptq", "--calib-samples", "8"]),
    ("llama-w4a16-pc", "llama", False, ["quantize", "--scheme", "w4a16", "--group-size", "0", "--method", "rtn"]),
    ("qwen2-w8a8", "qwen2", False, ["quantize", "--bits", "8", "--calib-samples", "8"]),
    ("qwen2-w8a8mix", "qwen2", False, ["quantize", "--scheme", "w8a8_mix", "--engine", "vllm-ascend", "--calib-samples", "8"]),
    ("qwen3-w8a16", "qwen3", False, ["quantize", "--scheme", "w8a16"]),
    ("qwen3_moe-w8a8dyn", "qwen3_moe", False, ["quantize", "--scheme", "w8a8_dynamic"]),
    ("mixtral-fused-w8a8", "mixtral", True, ["quantize", "--bits", "8", "--calib-samples", "8"]),
    ("qwen2_moe-shard", "qwen2_moe", False, ["shard", "--ep", "2", "--tp", "2"]),
    ("llama-fp16", "llama", False, ["export", "--format", "safetensors", "--dtype", "fp16"]),
    ("qwen2-onnx", "qwen2", False, ["export", "--format", "onnx"]),
    # MindIE builds DeepSeek's shared experts in no weight-only type: they stay float
    ("deepseek_v3-w8a16-shard", "deepseek_v3", False, ["quantize", "--scheme", "w8a16", "--ignore", "shared_expert"]),
]
SHARDED = "deepseek_v3-w8a16-shard"  # also sharded after quantizing: scales sliced with their weights


# ------------------------------------------------------------------------------------------------ normalisation
def _is_report(path: Path) -> bool:
    return path.suffix == ".json" and (any(r in path.name for r in REPORTS) or path.name == "plan.json")


def _normalised(path: Path, root: Path, package: str = PACKAGE_ROOT) -> bytes:
    data = path.read_bytes()
    if path.name == "dsconv_manifest.json":
        files = json.loads(data)["files"]  # report-like files are compared normalised, on their own
        return json.dumps({k: recorded(v)[1] if Path(k).suffix in BINARY else "-"
                           for k, v in sorted(files.items())}).encode()
    if path.suffix in (".json", ".sh", ".txt", ".cfg", ".toml"):
        text = data.decode("utf-8").replace(str(root), "<ROOT>").replace(package, "<PACKAGE>")
        if _is_report(path):
            text = json.dumps(drop_varying(json.loads(text)), sort_keys=True)
        return text.encode()
    return data


def drop_varying(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _rounded(v) if k in ROUNDED else drop_varying(v) for k, v in obj.items() if k not in DROPPED_KEYS}
    if isinstance(obj, list):
        return [drop_varying(v) for v in obj]
    return obj


def _rounded(v: Any) -> Any:
    return float(f"{v:.3g}") if isinstance(v, float) else drop_varying(v)


def tree_hashes(out: Path, root: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(_normalised(p, root)).hexdigest() for p in sorted(out.rglob("*"))
            if p.is_file() and p.suffix not in NONDETERMINISTIC and p.name != "demo-stdout.txt"}


# ------------------------------------------------------------------------------------------------ the outputs
def produce_cases(root: Path, run_cli: Callable[[list], Any], names: set[str] | None = None) -> dict[str, Path]:
    """Run the tiny-model cases (all, or `names`) under `root`; case name -> its output directory."""
    from dsconv.bundled import calib_texts
    from dsconv.tiny import make_tiny, train_tokenizer

    tok = train_tokenizer(calib_texts(), vocab_size=384)
    dirs: dict[str, Path] = {}
    for name, family, fused, args in CASES:
        if names is not None and name not in names and not (name == SHARDED and f"{name}-sharded" in names):
            continue
        model = make_tiny(family, root / "models" / name, fused=fused, dtype="bf16", tokenizer=tok)
        out = root / name
        r = run_cli([args[0], "--model", model, "--output", out, *args[1:]])
        assert r.code == 0, f"{name}: {r.err}"
        dirs[name] = out
        if name == SHARDED:
            r = run_cli(["shard", "--model", out, "--output", root / f"{name}-sharded", "--ep", "4", "--tp", "2"])
            assert r.code == 0, r.err
            dirs[f"{name}-sharded"] = root / f"{name}-sharded"
    return dirs


@pytest.fixture(scope="module")
def produced(demo_workspace, tmp_path_factory, run_cli) -> tuple[dict[str, dict[str, str]], dict[str, tuple]]:
    """(case -> {file: normalised sha256}, case -> (output dir, the root its text files name)); the demo is the
    session's shared demo workspace, `<root>/demo`, as the golden file was made."""
    root = tmp_path_factory.mktemp("golden")
    hashes = {"demo": tree_hashes(demo_workspace / "out", demo_workspace.parent)}
    dirs = {"demo": (demo_workspace / "out", demo_workspace.parent)}
    for name, out in produce_cases(root, run_cli).items():
        hashes[name] = tree_hashes(out, root)
        dirs[name] = (out, root)
    return hashes, dirs


# ------------------------------------------------------------------------------------------------ the comparison
def key_list_differences(golden: dict[str, dict[str, str]], got: dict[str, dict[str, str]]) -> list[str]:
    """The exact case and file lists, compared before any hash."""
    out = [f"case {c}: {'missing' if c not in got else 'new (not in the golden file)'}"
           for c in sorted(set(golden) ^ set(got))]
    for c in sorted(set(golden) & set(got)):
        missing, new = sorted(set(golden[c]) - set(got[c])), sorted(set(got[c]) - set(golden[c]))
        out += [f"{c}/{f}: missing" for f in missing] + [f"{c}/{f}: new" for f in new]
    return out


def tensor_differences(ref: Path, new: Path, limit: int = 12) -> list[str]:
    """Per tensor of two safetensors files: names only in one, dtype/shape changes, and max |difference|."""
    from safetensors.torch import load_file

    a, b = load_file(str(ref)), load_file(str(new))
    out = [f"  {n}: only in the golden run" for n in sorted(set(a) - set(b))]
    out += [f"  {n}: new" for n in sorted(set(b) - set(a))]
    changed = []
    for n in sorted(set(a) & set(b)):
        x, y = a[n], b[n]
        if x.dtype != y.dtype or x.shape != y.shape:
            out.append(f"  {n}: {x.dtype} {list(x.shape)} -> {y.dtype} {list(y.shape)}")
        elif not x.equal(y):
            diff = (x.double() - y.double()).abs()
            changed.append((float(diff.max()), n, int((diff > 0).sum()), x.numel()))
    for d, n, k, size in sorted(changed, reverse=True)[:limit]:
        out.append(f"  {n}: max |difference| {d:.6g} ({k} of {size} elements differ)")
    if len(changed) > limit:
        out.append(f"  ... and {len(changed) - limit} more tensors differ")
    return out


def text_differences(ref: Path, ref_root: Path, ref_package: Path, new: Path, new_root: Path, limit: int = 12
                     ) -> list[str]:
    a = _normalised(ref, ref_root, str(ref_package)).decode("utf-8", "replace")
    b = _normalised(new, new_root).decode("utf-8", "replace")
    if _is_report(new) or new.suffix == ".json":
        a, b = (json.dumps(json.loads(t), indent=1, sort_keys=True) for t in (a, b))
    lines = [f"  {d}" for d in difflib.unified_diff(a.splitlines(), b.splitlines(), "golden", "now", n=0,
                                                      lineterm="")][2:]
    return lines[:limit] + ([f"  ... {len(lines) - limit} more lines"] if len(lines) > limit else [])


def golden_commit() -> str | None:
    """The commit that last wrote golden_outputs.json (its code produced those hashes), if git can say."""
    try:
        p = subprocess.run(["git", "log", "-1", "--format=%H", "--", str(GOLDEN.relative_to(REPO))], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() or None


def rebuild_reference(commit: str, cases: set[str], work: Path) -> Path:
    """The given cases' outputs as the golden commit's dsconv writes them (this file's harness, that dsconv)."""
    src = work / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit, "dsconv"], cwd=REPO, capture_output=True, timeout=120,
                             check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as t:
        t.extractall(src)
    env = {**os.environ, "PYTHONPATH": str(src), "GLOG_v": "3", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([sys.executable, __file__, "--produce", str(work / "out"), ",".join(sorted(cases))], env=env,
                   cwd=work, capture_output=True, text=True, timeout=1800, check=True)
    return work / "out"


def explain(golden: dict[str, dict[str, str]], got: dict[str, dict[str, str]], dirs: dict[str, tuple[Path, Path]]
            ) -> list[str]:
    changed = {(c, f) for c in golden if c in got for f in golden[c] if f in got[c] and golden[c][f] != got[c][f]}
    lines = key_list_differences(golden, got)
    if not changed:
        return lines
    ref = None
    commit = golden_commit() if os.environ.get("DSCONV_GOLDEN_DIFF", "1") != "0" else None
    work = Path(tempfile.mkdtemp(prefix="dsconv-golden-ref-"))
    if commit is not None:
        try:
            ref = rebuild_reference(commit, {c for c, _ in changed}, work)
            lines.append(f"(details: against the outputs of {commit[:12]}, the commit that last wrote the golden file)")
        except (OSError, subprocess.SubprocessError) as e:
            lines.append(f"(no per-tensor detail: rebuilding the outputs of {commit[:12]} failed: "
                         f"{getattr(e, 'stderr', '') or e})"[-2000:])
    try:
        lines += _details(sorted(changed), dirs, ref, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return lines


def _details(changed: list[tuple[str, str]], dirs: dict[str, tuple[Path, Path]], ref: Path | None, work: Path
             ) -> list[str]:
    lines = []
    for c, f in changed:
        lines.append(f"{c}/{f}: changed")
        out, root = dirs[c]
        if ref is None:
            continue
        ref_root = ref.parent / "demo-root" if c == "demo" else ref
        ref_file = (ref_root / "demo" / "out" / f) if c == "demo" else ref / c / f
        if not ref_file.is_file():
            continue
        if Path(f).suffix == ".safetensors":
            lines += tensor_differences(ref_file, out / f)
        elif Path(f).suffix not in BINARY:
            lines += text_differences(ref_file, ref_root, work / "src", out / f, root)
    return lines


def test_outputs_are_byte_identical_to_golden(produced):
    hashes, dirs = produced
    if os.environ.get("DSCONV_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"golden hashes rewritten: {GOLDEN}")
    golden = json.loads(GOLDEN.read_text())
    if golden == hashes:
        return
    pytest.fail("outputs differ from tests/golden_outputs.json (intended? set DSCONV_UPDATE_GOLDEN=1):\n"
                + "\n".join(explain(golden, hashes, dirs)), pytrace=False)


# ------------------------------------------------------------------------------------------------ the diff's pieces
def test_key_lists_are_compared_exactly():
    golden = {"a": {"x": "1", "y": "2"}, "b": {"z": "3"}}
    got = {"a": {"x": "1", "w": "4"}, "c": {}}
    assert key_list_differences(golden, got) == ["case b: missing", "case c: new (not in the golden file)",
                                                 "a/y: missing", "a/w: new"]


def test_only_the_listed_report_keys_are_dropped():
    """By exact name: a key that merely contains a listed one ("errors", "elapsed_time", "rss_limit") is hashed."""
    report = {"seconds": 1.5, "errors": ["x"], "elapsed_time": 2, "max_abs_err": 1e-7, "timings": {"a": 1},
              "nested": [{"peak_rss_bytes": 5, "rss_limit": 7, "kept": True}]}
    assert drop_varying(report) == {"errors": ["x"], "elapsed_time": 2, "nested": [{"rss_limit": 7, "kept": True}]}


def test_tensor_differences_name_each_tensor(tmp_path):
    import torch
    from safetensors.torch import save_file

    a = {"w": torch.zeros(4, 3), "q": torch.ones(2, dtype=torch.int8), "gone": torch.zeros(1)}
    b = {"w": torch.zeros(4, 3), "q": torch.tensor([1, 3], dtype=torch.int8), "added": torch.zeros(1)}
    b["w"][1, 2] = 0.25
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    lines = tensor_differences(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert lines == ["  gone: only in the golden run", "  added: new",
                     "  q: max |difference| 2 (1 of 2 elements differ)",
                     "  w: max |difference| 0.25 (1 of 12 elements differ)"]


def _main(argv: list[str]) -> None:
    """`python tests/test_golden_outputs.py --produce OUT case,...`: the cases' outputs under OUT (the demo under
    OUT/../demo-root/demo), with whichever dsconv is on the path (the golden commit's, for a failure's detail)."""
    out, names = Path(argv[1]), set(argv[2].split(","))
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import _run_cli  # noqa: E402 - the same in-process CLI runner as the tests

    out.mkdir(parents=True)
    if "demo" in names:
        from dsconv.cli import cli
        from dsconv.demo import run_demo

        with contextlib.redirect_stdout(io.StringIO()):
            run_demo(out.parent / "demo-root" / "demo", cli, echo=lambda s: None)
    produce_cases(out, _run_cli, names - {"demo"})


if __name__ == "__main__" and sys.argv[1:2] == ["--produce"]:
    _main(sys.argv[1:])
