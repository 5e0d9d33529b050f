"""The bad-input catalog: one reproducer per class of hostile input, run through the real commands.

Every case must end with exit 2 (or 3 for a failed check) and ONE line naming the file, field or tensor - never a
traceback (exit 1) and never exit 0. The table at the bottom is the catalog; `test_catalog_size` keeps its count
honest. OS-level cases (a full disk, a read-only file system) mount a small tmpfs when the test runs as root with
CAP_SYS_ADMIN and are skipped elsewhere.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

pytestmark = pytest.mark.cli

LLAMA = "llama"


# ----------------------------------------------------------------------------------------------- helpers
def model_copy(tiny_model, tmp_path: Path, family: str = LLAMA) -> Path:
    d = tmp_path / "m"
    shutil.copytree(tiny_model(family), d)
    return d


def edit_config(d: Path, **changes) -> Path:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg, allow_nan=True))
    return d


def edit_weights(d: Path, fn: Callable[[dict], None]) -> Path:
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    fn(tensors)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return d


def raw_header(d: Path, header: bytes) -> Path:
    (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return d


def a_manifest_dir(tmp_path: Path, manifest: bytes | None = None) -> Path:
    from dsconv.io.writer import OutputDir

    out = tmp_path / "out"
    with OutputDir(out, stage="export") as o:
        o.write_json("config.json", {"a": 1})
    if manifest is not None:
        (out / "dsconv_manifest.json").write_bytes(manifest)
    return out


def quant_dir(tiny_model, tmp_path: Path, description: bytes) -> Path:
    d = model_copy(tiny_model, tmp_path)
    (d / "quant_model_description.json").write_bytes(description)
    return d


def workspace(tmp_path: Path, toml: bytes) -> Path:
    (tmp_path / "dsconv.toml").write_bytes(toml)
    return tmp_path


@pytest.fixture
def small_fs(tmp_path):
    """`small_fs(size, ro=False)` -> a fresh tmpfs mount point (a real full or read-only file system)."""
    mounts = []

    def make(size: str, ro: bool = False) -> Path:
        mp = tmp_path / f"fs{len(mounts)}"
        mp.mkdir()
        opts = f"size={size}" + (",ro" if ro else "")
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mp)],
                                               capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
        mounts.append(mp)
        return mp

    yield make
    for mp in mounts:
        subprocess.run(["umount", str(mp)], capture_output=True)


@dataclass
class Case:
    id: str
    cls: str  # the class of hostile input it reproduces
    run: Callable  # (tiny_model, tmp_path, small_fs) -> (argv, cwd or None)
    code: int
    needles: tuple[str, ...]


def _inspect(d):
    return ["inspect", "--model", d], None


def _inspect_config(d):
    return ["inspect", "--config", d / "config.json"], None


def _quant_weight_only(d, tmp_path):
    return ["quantize", "--model", d, "--scheme", "w8a16", "--output", tmp_path / "q"], None


def _export_st(d, out):
    return ["export", "--format", "safetensors", "--model", d, "--output", out], None


def _quant_dry(tm, *opts):
    return ["quantize", "--model", tm(LLAMA), "--dry-run", *opts], None


def _shard_config(tm, *opts):
    return ["shard", "--config", tm("deepseek_v3") / "config.json", *opts], None


def _expert_load(tp: Path) -> Path:
    """Tokens per expert of the tiny DeepSeek-V3's MoE layers (1 and 2, 16 experts)."""
    p = tp / "expert_load.json"
    p.write_text(json.dumps({"layers": {"1": list(range(16)), "2": [1] * 16}}))
    return p


BIG = "99999999999999999999999"


def _tiny_onnx(tp: Path) -> Path:
    from dsconv.atc.samples import tiny_lm

    return tiny_lm(tp / "m.onnx")


CASES: list[Case] = [
    # -- parse errors other than JSONDecodeError ------------------------------------------------------------------
    Case("header-deep-nesting", "parse", lambda tm, tp, fs: _inspect(raw_header(
        model_copy(tm, tp), b"[" * 99999 + b"]" * 99999)), 2, ("model.safetensors", "nested deeper")),
    Case("config-5000-digit-int", "parse", lambda tm, tp, fs: _inspect(_with_file(
        model_copy(tm, tp), "config.json", b'{"model_type": "llama", "num_hidden_layers": ' + b"1" * 5000 + b"}")),
        2, ("config.json", "5000 digits")),
    Case("index-not-utf8", "parse", lambda tm, tp, fs: _inspect(_with_file(
        model_copy(tm, tp), "model.safetensors.index.json", b'{"weight_map": {"\xff": 1}}')), 2,
        ("model.safetensors.index.json", "UTF-8")),
    Case("manifest-not-utf8", "parse", lambda tm, tp, fs: (["verify", a_manifest_dir(tp, b'{"files": "\xfe"}')],
                                                             None), 2, ("dsconv_manifest.json", "UTF-8")),
    Case("description-not-utf8", "parse", lambda tm, tp, fs: _inspect(quant_dir(tm, tp, b'{"a": "\xff"}')), 2,
         ("quant_model_description.json", "UTF-8")),
    Case("toml-not-utf8", "parse", lambda tm, tp, fs: (["inspect"], workspace(tp, b'[workspace]\nmodel = "\xff"\n')),
         2, ("dsconv.toml", "UTF-8")),
    Case("calib-lone-surrogate", "parse", lambda tm, tp, fs: (
        ["quantize", "--bits", "8", "--engine", "vllm-ascend", "--model", with_tokenizer(tm, tp), "--calib", _with_file(tp, "c.jsonl", b'{"text": "a\\ud800b"}\n') /
         "c.jsonl", "--output", tp / "q"], None), 2, ("c.jsonl:1", "surrogate")),
    # -- JSON of the wrong shape or type ------------------------------------------------------------------------
    Case("manifest-is-list", "shape", lambda tm, tp, fs: (["verify", a_manifest_dir(tp, b"[]")], None), 2,
         ("dsconv_manifest.json", "got a list")),
    Case("manifest-no-files", "shape", lambda tm, tp, fs: (["verify", a_manifest_dir(tp, b'{"stage": "export"}')],
                                                           None), 2, ("dsconv_manifest.json", '"files" is missing')),
    Case("manifest-entry-no-digest", "shape", lambda tm, tp, fs: (["verify", a_manifest_dir(
        tp, b'{"stage": "export", "files": {"config.json": {"size": 9}}}')], None), 2,
         ('"blake3 or sha256" must be present',)),
    Case("description-is-list", "shape", lambda tm, tp, fs: _inspect(quant_dir(tm, tp, b"[]")), 2,
         ("quant_model_description.json", "got a list")),
    Case("toml-workspace-is-int", "shape", lambda tm, tp, fs: (["inspect"], workspace(tp, b"workspace = 1\n")), 2,
         ("dsconv.toml", '"workspace" must be an object')),
    Case("toml-model-is-list", "shape", lambda tm, tp, fs: (["inspect"], workspace(
        tp, b"[workspace]\nmodel = []\n")), 2, ("dsconv.toml", '"model" must be a non-empty string')),
    Case("config-layers-string", "shape", lambda tm, tp, fs: _inspect(edit_config(
        model_copy(tm, tp), num_hidden_layers="2")), 2, ("config.json", '"num_hidden_layers"', "'2'")),
    Case("config-layers-float", "shape", lambda tm, tp, fs: _inspect(edit_config(
        model_copy(tm, tp), num_hidden_layers=2.5)), 2, ("config.json", '"num_hidden_layers"', "2.5")),
    Case("config-model-type-list", "shape", lambda tm, tp, fs: _inspect(edit_config(
        model_copy(tm, tp), model_type=[])), 2, ("config.json", '"model_type"')),
    Case("config-kv-heads-string", "shape", lambda tm, tp, fs: _inspect(edit_config(
        model_copy(tm, tp), num_key_value_heads="2")), 2, ("config.json", '"num_key_value_heads"')),
    Case("config-infinity", "shape", lambda tm, tp, fs: _inspect(edit_config(
        model_copy(tm, tp, "deepseek_v3"), n_shared_experts=float("inf"))), 2, ("config.json", "Infinity")),
    # -- unbounded sizes --------------------------------------------------------------------------------------------
    Case("config-terabyte-layers", "size", lambda tm, tp, fs: _inspect_config(edit_config(
        model_copy(tm, tp), num_hidden_layers=1099511627776)), 2, ('"num_hidden_layers"', "1..1024")),
    Case("max-shard-size-inf", "size", lambda tm, tp, fs: (["quantize", "--model", tm(LLAMA), "--dry-run",
                                                            "--bits", "8", "--max-shard-size", "inf"], None), 2, ("inf",)),
    # an option naming its problem up front (a bare "size '0' must be positive" named no option)
    Case("max-shard-size-zero", "size", lambda tm, tp, fs: _quant_dry(tm, "--bits", "8", "--max-shard-size", "0"), 2,
         ("--max-shard-size", "'0'")),
    Case("external-data-threshold-zero", "size", lambda tm, tp, fs: (
        ["export", "--model", tm(LLAMA), "--output", tp / "o", "--external-data-threshold", "0"], None), 2,
        ("--external-data-threshold", "'0'")),
    Case("group-size-negative", "size", lambda tm, tp, fs: _quant_dry(tm, "--scheme", "w4a16", "--group-size", "-1"),
         2, ("--group-size", "-1")),
    # --scheme plans from a config: given with --model it named a missing import instead (a traceback)
    Case("shard-scheme-without-config", "parse", lambda tm, tp, fs: (
        ["shard", "--model", tm(LLAMA), "--output", tp / "o", "--scheme", "w8a8", "--ep", "1", "--tp", "1"], None), 2,
        ("--scheme", "--config")),
    # huge counts: a MemoryError building 10^23 per-rank records or chart cells, a pool semaphore's OverflowError
    Case("nodes-huge", "size", lambda tm, tp, fs: _shard_config(tm, "--nodes", BIG), 2, ("--nodes", BIG)),
    Case("world-from-nodes-huge", "size", lambda tm, tp, fs: _shard_config(tm, "--nodes", "10000"), 2,
         ("world size 80000", "65536")),
    Case("max-context-huge", "size", lambda tm, tp, fs: _shard_config(tm, "--max-context", BIG), 3,
         ("rejected", "needs")),
    Case("workspace-gb-huge", "size", lambda tm, tp, fs: _shard_config(tm, "--workspace-gb", "1e300"), 2,
         ("--workspace-gb",)),
    Case("atc-gear-huge", "size", lambda tm, tp, fs: (["atc", "--onnx", _tiny_onnx(tp), "--soc", "Ascend910B",
                                                        "--seq", BIG, "--output", tp / "atc"], None), 2,
         ("--seq", "up to 2147483647")),
    Case("workers-huge", "size", lambda tm, tp, fs: (_quant_weight_only(tm(LLAMA), tp)[0] + ["--workers", BIG], None),
         2, ("--workers", BIG)),
    # -- OS errors at the boundary ----------------------------------------------------------------------------------
    Case("output-parent-is-file", "os", lambda tm, tp, fs: _export_st(tm(LLAMA), _with_file(
        tp, "afile", b"x") / "afile" / "out"), 2, ("afile", "not a directory")),
    Case("output-read-only-fs", "os", lambda tm, tp, fs: _export_st(tm(LLAMA), fs("64k", ro=True) / "out"), 2,
         ("read-only file system",)),
    Case("model-file-unreadable", "os", lambda tm, tp, fs: _inspect(_weights_dir(model_copy(tm, tp))), 2,
         ("model.safetensors", "is a directory")),
    Case("disk-too-small", "os", lambda tm, tp, fs: _export_st(tm(LLAMA), fs("256k") / "out"), 2,
         ("not enough space", "free space")),
    # the ONNX/MindIR export checks the weights' bytes up front (before tracing), not mid-write at 96k
    Case("onnx-disk-too-small", "os", lambda tm, tp, fs: (["export", "--format", "onnx", "--model", tm(LLAMA),
                                                           "--output", fs("96k") / "out"], None), 2,
         ("not enough space", "bytes", "free space")),
    Case("mindir-disk-too-small", "os", lambda tm, tp, fs: (["export", "--format", "mindir", "--model", tm(LLAMA),
                                                             "--output", fs("256k") / "sub" / "out"], None), 2,
         ("not enough space", "bytes", "free space")),
    # -- silently accepted before (exit 0) --------------------------------------------------------------------------
    Case("weight-only-missing-down-proj", "accepted", lambda tm, tp, fs: _quant_weight_only(edit_weights(
        model_copy(tm, tp), lambda t: t.pop("model.layers.1.mlp.down_proj.weight")), tp), 2,
        ("model.layers.1.mlp.down_proj.weight", "missing")),
    Case("weight-only-wrong-q-proj", "accepted", lambda tm, tp, fs: _quant_weight_only(edit_weights(
        model_copy(tm, tp), lambda t: t.update({"model.layers.0.self_attn.q_proj.weight":
                                                t["model.layers.0.self_attn.q_proj.weight"][:32]})), tp), 2,
        ("model.layers.0.self_attn.q_proj.weight", "[32, 64]", "[64, 64]")),
    Case("config-more-layers-than-weights", "accepted", lambda tm, tp, fs: _quant_weight_only(edit_config(
        model_copy(tm, tp), num_hidden_layers=4), tp), 2, ("model.layers.2.", "missing")),
    Case("config-fewer-layers-than-weights", "accepted", lambda tm, tp, fs: _quant_weight_only(edit_config(
        model_copy(tm, tp), num_hidden_layers=1), tp), 2, ("layer 1", "num_hidden_layers 1")),
    Case("heads-do-not-divide-hidden", "accepted", lambda tm, tp, fs: _quant_weight_only(edit_config(
        model_copy(tm, tp), num_attention_heads=5, num_key_value_heads=5, head_dim=None), tp), 2,
        ('"num_attention_heads"', "hidden_size 64")),
    Case("heads-disagree-with-weights", "accepted", lambda tm, tp, fs: _quant_weight_only(edit_config(
        model_copy(tm, tp), num_attention_heads=5, num_key_value_heads=5), tp), 2,
        ("q_proj.weight has shape [64, 64]", "[80, 64]")),
    Case("vocab-size-zero", "accepted", lambda tm, tp, fs: _quant_weight_only(edit_config(
        model_copy(tm, tp), vocab_size=0), tp), 2, ('"vocab_size"', "got 0")),
    Case("verify-extra-file", "accepted", lambda tm, tp, fs: (["verify", _with_file(
        a_manifest_dir(tp), "stray.bin", b"x")], None), 3, ("stray.bin", "not in the manifest")),
    Case("verify-empty-files", "accepted", lambda tm, tp, fs: (["verify", a_manifest_dir(
        tp, b'{"stage": "export", "files": {}}')], None), 2, ('"files" is empty',)),
    Case("fallback-threshold-nan", "accepted", lambda tm, tp, fs: (["quantize", "--model", tm(LLAMA), "--dry-run",
                                                                    "--bits", "8", "--fallback-threshold", "nan"], None), 2,
         ("--fallback-threshold", "nan")),
    Case("dry-run-negative-seq-len", "accepted", lambda tm, tp, fs: (["quantize", "--model", tm(LLAMA), "--dry-run",
                                                                      "--bits", "8", "--seq-len", "-5"], None), 2,
         ("--seq-len", "-5")),
    Case("inspect-config-negative-layers", "accepted", lambda tm, tp, fs: _inspect_config(edit_config(
        model_copy(tm, tp), num_hidden_layers=-3)), 2, ('"num_hidden_layers"', "got -3")),
    Case("fallback-negative", "accepted", lambda tm, tp, fs: _quant_dry(tm, "--bits", "8", "--fallback", "-1"), 2,
         ("--fallback", "-1")),
    Case("smooth-quant-alpha-above-1", "accepted", lambda tm, tp, fs: _quant_dry(tm, "--bits", "8", "--smooth-quant",
                                                                                 "1.5"), 2, ("--smooth-quant", "1.5")),
    Case("smooth-quant-alpha-nan", "accepted", lambda tm, tp, fs: _quant_dry(tm, "--bits", "8", "--smooth-quant",
                                                                             "nan"), 2, ("--smooth-quant", "nan")),
    Case("workspace-gb-negative", "accepted", lambda tm, tp, fs: _shard_config(tm, "--workspace-gb", "-1"), 2,
         ("--workspace-gb", "-1")),
    Case("max-ppl-increase-negative", "accepted", lambda tm, tp, fs: (
        ["eval", "--model", tm(LLAMA), "--quantized", tp / "q", "--max-ppl-increase", "-1"], None), 2,
        ("--max-ppl-increase", "-1")),
    Case("redundant-experts-more-than-every-rank", "accepted", lambda tm, tp, fs: _shard_config(
        tm, "--ep", "4", "--placement", "eplb", "--expert-load", _expert_load(tp), "--redundant-experts", "1000"), 2,
        ("--redundant-experts 1000", "at most 48")),
    Case("export-nan-weights", "accepted", lambda tm, tp, fs: _export_st(edit_weights(
        model_copy(tm, tp), lambda t: t["model.norm.weight"].__setitem__(3, float("nan"))), tp / "o"), 2,
        ("model.norm.weight", "nan")),
]


def with_tokenizer(tiny_model, tmp_path: Path) -> Path:
    """A tiny Llama with a tokenizer (calibration reads text through it)."""
    from dsconv.bundled import calib_texts
    from dsconv.tiny import train_tokenizer

    d = model_copy(tiny_model, tmp_path)
    tok = train_tokenizer(calib_texts()[:20], vocab_size=300)
    tok.save_pretrained(d)
    return d


def _with_file(d: Path, name: str, data: bytes) -> Path:
    (d / name).write_bytes(data)
    return d


def _weights_dir(d: Path) -> Path:
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()
    return d


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, tiny_model, tmp_path, small_fs, run_cli):
    argv, cwd = case.run(tiny_model, tmp_path, small_fs)
    r = run_cli(argv, cwd=cwd)
    assert r.code == case.code, (r.code, r.err[-2000:])
    lines = [ln for ln in r.err.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert lines and "Traceback" not in r.err, r.err[-2000:]
    # our errors are one line; click's usage errors print "Usage:", "Try ..." and then the "Error:" line
    first = next((ln for ln in lines if ln.lower().startswith("error")), lines[0])
    for needle in case.needles:
        assert needle.lower() in first.lower(), (needle, first)
    leftovers = [p for p in tmp_path.rglob("*") if ".dsconv-tmp" in p.name or ".dsconv-old" in p.name]
    assert not leftovers, leftovers


def test_catalog_size():
    """One reproducer per class the issue lists (the count the closing note reports)."""
    assert len(CASES) == len({c.id for c in CASES}) >= 38
    assert {c.cls for c in CASES} == {"parse", "shape", "size", "os", "accepted"}


# ----------------------------------------------------------------------------------------------- shard plan.json
@pytest.fixture(scope="module")
def a_shard(tiny_model, tmp_path_factory, run_cli):
    """A 2-rank `--format ranks` shard output of the tiny Llama (verify reads every key of its plan.json)."""
    out = tmp_path_factory.mktemp("shard") / "s"
    r = run_cli(["shard", "-m", tiny_model(LLAMA), "-o", out, "--tp", "2", "--format", "ranks"])
    assert r.code == 0, r.err[-2000:]
    return out


def _first_split(plan: dict) -> dict:
    return next(e for e in plan["tensors"].values() if e["mode"] == "split")


PLAN_EDITS = [
    ("world-a-string", lambda p: p["layout"].__setitem__("world", "2"), ('"world"',)),
    ("rank-dir-escapes", lambda p: p["rank_dirs"].__setitem__(1, "../elsewhere"), ('"rank_dirs"',)),
    ("rank-dirs-short", lambda p: p["rank_dirs"].pop(), ('"rank_dirs"', "one directory per rank")),
    ("rank-out-of-range", lambda p: next(iter(p["tensors"].values())).__setitem__("ranks", [0, 7]), ('"ranks"',)),
    ("dim-out-of-range", lambda p: _first_split(p).__setitem__("dim", 5), ('"dim"', "got 5")),
    ("parts-not-a-divisor", lambda p: _first_split(p).__setitem__("parts", 3), ('"parts"',)),
    ("group-too-large", lambda p: _first_split(p).__setitem__("group", 2) or _first_split(p).__setitem__("rep", 1)
     or _first_split(p).__setitem__("parts", 1), ('"group"',)),
    ("shape-negative", lambda p: next(iter(p["tensors"].values())).__setitem__("shape", [-1, 64]), ('"shape"',)),
    ("mode-unknown", lambda p: next(iter(p["tensors"].values())).__setitem__("mode", "rows"), ('"mode"',)),
    ("tensors-a-list", lambda p: p.__setitem__("tensors", []), ('"tensors"',)),
]


@pytest.mark.parametrize("edit,needles", [(e, n) for _, e, n in PLAN_EDITS], ids=[i for i, _, _ in PLAN_EDITS])
def test_verify_rejects_a_malformed_plan_json(edit, needles, a_shard, tmp_path, run_cli):
    """plan.json whose sha256 matches the manifest (rewritten with it) but whose content is not a plan: exit 2, one
    line naming plan.json and the key, never a KeyError/IndexError traceback or a read outside the directory."""
    import hashlib

    out = tmp_path / "s"
    shutil.copytree(a_shard, out)
    plan = json.loads((out / "plan.json").read_text())
    edit(plan)
    raw = json.dumps(plan).encode()
    (out / "plan.json").write_bytes(raw)
    manifest = json.loads((out / "dsconv_manifest.json").read_text())
    manifest["files"]["plan.json"] = {"sha256": hashlib.sha256(raw).hexdigest(), "size": len(raw)}
    (out / "dsconv_manifest.json").write_text(json.dumps(manifest))
    r = run_cli(["verify", out])
    assert r.code == 2, (r.code, r.err[-2000:])
    lines = [ln for ln in r.err.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert len(lines) == 1 and "Traceback" not in r.err, r.err[-2000:]
    for needle in ("plan.json",) + needles:
        assert needle.lower() in lines[0].lower(), (needle, lines[0])


def test_verify_accepts_the_untouched_shard(a_shard, run_cli):
    assert run_cli(["verify", a_shard]).code == 0


# ----------------------------------------------------------------------------------------------- config.json keys
def _family_keys() -> list[tuple[str, str, str]]:
    """(family, key, mutation) for every key every family reads: taken from the declarations (Family.config_keys),
    so a key a family starts reading is covered here without editing this list."""
    from dsconv.families import families

    return [(f.name, key, m) for f in families() for key in f.config_keys for m in ("null", "string", "missing")]


@pytest.mark.parametrize("family,key,mutation", _family_keys(), ids=["-".join(k) for k in _family_keys()])
def test_config_key_null_wrong_type_or_missing(family, key, mutation, tiny_model, tmp_path, run_cli):
    """A null (`"intermediate_size": null` for DeepSeek, `"num_experts_per_tok": null` for the Qwen MoEs), a string
    or a missing key of those a family reads: before, TypeErrors in a shape formula (families/base.py T.dims) or the
    workspace estimate (shard/memory.py). Now the key's default where the family has one (null counts as absent, as
    HF writes it), else exit 2 with one line naming config.json and the key. shard --config reads every fact, the
    synthesized tensor list and the memory estimate."""
    from dsconv.families import families
    from dsconv.schemas.model import REQUIRED, _STRS

    fam = next(f for f in families() if f.name == family)
    required = fam.config_keys[key] is REQUIRED
    cfg = json.loads((tiny_model(family) / "config.json").read_text())
    # a vision-language config keeps the text model's keys in its section (text_config): the key wherever it is
    places = [d for d in (cfg, cfg.get(fam.config_section or "")) if isinstance(d, dict) and key in d] or [cfg]
    for where in places:
        if mutation == "missing":
            where.pop(key, None)
        else:
            where[key] = None if mutation == "null" else "x"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    r = run_cli(["shard", "--config", path, "--json"])
    lines = [ln for ln in r.err.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert "Traceback" not in r.err, r.err[-2000:]
    if (mutation == "string" and key not in _STRS) or (mutation != "string" and required):
        assert r.code == 2 and len(lines) == 1, (r.code, r.err[-2000:])
        assert str(path) in lines[0] and f'"{key}"' in lines[0], lines[0]
    else:  # a default, or a string where a string belongs (an unknown model_type or dtype has its own message)
        assert r.code in (0, 2, 3), (r.code, r.err[-2000:])


# ----------------------------------------------------------------------------------------------- --max-shard-size
def _tensors(d: Path) -> dict[str, bytes]:
    from safetensors import safe_open

    out = {}
    for f in sorted(d.rglob("*.safetensors")):
        with safe_open(f, "np") as s:
            out.update({k: s.get_tensor(k).tobytes() for k in s.keys()})
    return out


@pytest.mark.parametrize("size", ["1B", "100KB"])
def test_max_shard_size_below_a_linear_cuts_between_its_components(size, tiny_model, tmp_path, run_cli):
    """A part boundary between a linear's weight and its scales (any size can cut there; 1B cuts everywhere) was a
    ValueError traceback from the weight-only writer. HF's convention: a tensor larger than the cap is a part of its
    own. The output is the same tensors, bytes included, as with the default cap."""
    args = ["quantize", "--model", tiny_model(LLAMA), "--bits", "8", "--scheme", "w8a16", "--method", "rtn",
            "--engine", "vllm-ascend"]  # a float32 model: MindIE runs fp16/bf16 only
    small = run_cli([*args, "--max-shard-size", size, "--output", tmp_path / "small", "--workers", "1"])
    assert small.code == 0 and "Traceback" not in small.err, small.err[-2000:]
    assert run_cli([*args, "--output", tmp_path / "default", "--workers", "1"]).code == 0
    assert run_cli(["verify", tmp_path / "small"]).code == 0
    parts = list((tmp_path / "small").glob("quant_model_weights-*.safetensors"))
    assert len(parts) > 1
    assert _tensors(tmp_path / "small") == _tensors(tmp_path / "default")


# ----------------------------------------------------------------------------------------------- transactions
def _export(run_cli, model: Path, out: Path, *extra):
    return run_cli(["export", "--format", "safetensors", "--model", model, "--output", out, *extra])


def _fail_after_first_tensor(monkeypatch, exc: BaseException) -> None:
    """The second tensor written fails, whichever writes it: the driver's set or a job's part (dsconv.io.parts)."""
    from dsconv.io import parts, writer

    calls = []

    def failing(real):
        def write(self, name, *args, **kwargs):
            calls.append(name)
            if len(calls) > 1:
                raise exc
            return real(self, name, *args, **kwargs)
        return write

    # TensorSetWriter.write goes through write_chunks
    monkeypatch.setattr(writer.TensorSetWriter, "write_chunks", failing(writer.TensorSetWriter.write_chunks))
    monkeypatch.setattr(parts.PartWriter, "write_chunks", failing(parts.PartWriter.write_chunks))


def test_force_keeps_the_old_output_until_the_new_one_is_complete(tiny_model, tmp_path, run_cli, monkeypatch):
    model, out = tiny_model(LLAMA), tmp_path / "out"
    assert _export(run_cli, model, out).code == 0
    before = (out / "dsconv_manifest.json").read_bytes()
    _fail_after_first_tensor(monkeypatch, OSError(28, "No space left on device", str(out / "x")))
    r = _export(run_cli, model, out, "--force")
    assert r.code == 2 and "no space left on device" in r.err and "Traceback" not in r.err
    monkeypatch.undo()
    assert (out / "dsconv_manifest.json").read_bytes() == before
    assert run_cli(["verify", out]).code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("exchange", [True, False], ids=["rename-exchange", "rename-aside"])
def test_force_replaces_and_leaves_nothing_behind(tiny_model, tmp_path, run_cli, monkeypatch, exchange):
    from dsconv.io import writer

    used = []
    real = writer.exchange
    monkeypatch.setattr(writer, "exchange", lambda a, b: used.append(1) or (real(a, b) if exchange else False))
    model, out = tiny_model(LLAMA), tmp_path / "out"
    assert _export(run_cli, model, out).code == 0
    (out / "marker").write_text("old")  # tells the old output from the new one
    assert _export(run_cli, model, out, "--force").code == 0
    assert used and not (out / "marker").exists()
    assert run_cli(["verify", out]).code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_crash_between_renames_is_undone_by_the_next_run(tiny_model, tmp_path, run_cli):
    """The rename-aside fallback killed after its first rename: old output at .out.dsconv-old, nothing at out."""
    model, out = tiny_model(LLAMA), tmp_path / "out"
    assert _export(run_cli, model, out).code == 0
    out.rename(tmp_path / ".out.dsconv-old")
    (tmp_path / ".out.dsconv-tmp").mkdir()
    r = _export(run_cli, model, out)  # no --force: the recovered output must not be replaced silently
    assert r.code == 2 and "already holds a dsconv output" in r.err
    assert run_cli(["verify", out]).code == 0
    assert _export(run_cli, model, out, "--force").code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_ctrl_c_exits_130_with_one_line_and_no_temp_dir(tiny_model, tmp_path, run_cli, monkeypatch):
    _fail_after_first_tensor(monkeypatch, KeyboardInterrupt())
    r = _export(run_cli, tiny_model(LLAMA), tmp_path / "out")
    assert r.code == 130
    assert r.err.strip().splitlines() == ["interrupted: nothing was written"]
    assert list(tmp_path.iterdir()) == []


def test_sigint_of_a_real_process(tiny_model, tmp_path):
    """A real Ctrl-C (SIGINT) while the output is being written: exit 130, one line, no temporary directory."""
    import signal
    import sys
    import time

    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    def as_from_a_shell() -> None:
        # the child gets Ctrl-C as a user's terminal delivers it, whatever earlier tests (a local Ray, worker pools)
        # left in this pytest process: an inherited SIG_IGN or blocked SIGINT would make Python ignore it
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    p = subprocess.Popen([sys.executable, "-m", "dsconv", "export", "--format", "onnx", "--model",
                          str(tiny_model(LLAMA)), "--output", str(out)], env=env, stderr=subprocess.PIPE, text=True,
                         preexec_fn=as_from_a_shell)
    tmp = tmp_path / ".out.dsconv-tmp"
    deadline = time.monotonic() + 120
    while not tmp.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    if p.poll() is not None:
        pytest.skip(f"the export ended ({p.returncode}) before it could be interrupted: {p.stderr.read()[-300:]}")
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "interrupted: nothing was written" and "Traceback" not in err
    assert not tmp.exists() and not out.exists()
