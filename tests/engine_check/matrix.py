"""`make engine-check`: every family x scheme dsconv offers vLLM-Ascend, quantized by dsconv and loaded by the engine.

    python -m tests.engine_check.matrix [--engine-python PY] [--out DIR] [--only SUBSTR] [--update] [--real DIR ...]

Runs in dsconv's environment: builds the tiny models (bf16 and fp16, per-expert and fused expert layouts), runs
`dsconv quantize --engine vllm-ascend` on each (a refusal, exit 2, is a result too), then hands every written
directory to `vllm_loader.py` in the engine environment (setup_env.sh) in one process, and compares:
- every output dsconv writes for vLLM-Ascend must load with every tensor in place (else exit 1);
- the results must equal the committed `results.json` (`--update` rewrites it), from which the README's vLLM
  column is generated (tests/test_engine_table.py checks the README against it in `make test`).
`--real DIR ...` checks real checkpoints' `--bits 8` outputs instead (`make engine-check-real`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.json"
FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3")
MOE = ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3")
# scheme label -> `dsconv quantize` options (the README table's rows)
SCHEMES = {
    "bits8": ["--bits", "8"],
    "w8a8": ["--scheme", "w8a8"],
    "w8a8_dynamic": ["--scheme", "w8a8_dynamic"],
    "w8a16": ["--scheme", "w8a16"],
    "w4a16": ["--scheme", "w4a16", "--group-size", "16"],
    "w4a16_pc": ["--scheme", "w4a16", "--group-size", "0"],
    "w4a8": ["--bits", "4", "--scheme", "w4a8_dynamic"],
    "bits8_c8": ["--bits", "8", "--kv-cache", "int8"],
    "w8a8_dynamic_c8": ["--scheme", "w8a8_dynamic", "--kv-cache", "int8"],
    "w4a8_c8": ["--bits", "4", "--scheme", "w4a8_dynamic", "--kv-cache", "int8"],
}
FAST = ["--calib-samples", "4", "--seq-len", "32"]


def cases() -> list[dict]:
    """(family, scheme, dtype, layout): every scheme on bf16 per-expert checkpoints; the engine recipe (`--bits 8`:
    static and dynamic layers) on fp16 inputs (int64 deq_scale, fp16 parameters) and, for MoE families, on
    checkpoints storing transformers' fused 3-D experts."""
    out = []
    for f in FAMILIES:
        for s in SCHEMES:
            out.append(dict(family=f, scheme=s, dtype="bf16", layout="per-expert"))
        out.append(dict(family=f, scheme="bits8", dtype="fp16", layout="per-expert"))
        if f in MOE:
            out.append(dict(family=f, scheme="bits8", dtype="bf16", layout="fused"))
    return out


def case_id(c: dict) -> str:
    return f"{c['family']}-{c['scheme']}-{c['dtype']}-{c['layout']}"


def build_sources(root: Path, need: set[tuple[str, str, str]]) -> dict[tuple[str, str, str], Path]:
    from dsconv.demo import calib_texts
    from dsconv.tiny import make_tiny, train_tokenizer

    tok = train_tokenizer(calib_texts(), vocab_size=384)
    out = {}
    for family, dtype, layout in sorted(need):
        d = root / "src" / f"{family}-{dtype}-{layout}"
        if not (d / "config.json").exists():
            make_tiny(family, d, dtype=dtype, tokenizer=tok, fused=layout == "fused")
        out[(family, dtype, layout)] = d
    return out


def quantize(src: Path, out: Path, options: list[str]) -> tuple[int, str]:
    """`dsconv quantize` through its CLI entry point, in this process (imports paid once): (exit code, last line of
    what it printed to stderr)."""
    import contextlib
    import io

    from dsconv.cli import main

    args = ["quantize", "-m", str(src), "-o", str(out), "--engine", "vllm-ascend", "--force", *options]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(args)  # always ends in SystemExit with the CLI's exit code
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code, (err.getvalue().strip().splitlines() or [""])[-1]


def engine_python() -> str:
    from_env = os.environ.get("DSCONV_ENGINE_PYTHON")
    if from_env:
        return from_env
    p = subprocess.run(["bash", str(HERE / "setup_env.sh"), "--print-python"], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"engine environment not ready: {p.stderr.strip()}")
    return p.stdout.strip()


def _is_moe(d: Path) -> bool:
    cfg = json.loads((d / "config.json").read_text())
    return any(cfg.get(k) for k in ("n_routed_experts", "num_experts", "num_local_experts"))


def load_all(py: str, dirs: list[Path], jsonl: Path) -> dict[str, dict]:
    """One engine process for the dense directories and one for the MoE ones (the engine's import and start-up take
    ~10 s once; vLLM creates its expert-parallel group only when the first model it is initialised with is MoE)."""
    jsonl.unlink(missing_ok=True)
    env = {**os.environ, "DSCONV_NPU_STUBS": "1", "PYTHONPATH": str(HERE), "VLLM_LOGGING_LEVEL": "ERROR",
           "TOKENIZERS_PARALLELISM": "false"}
    for group in ([d for d in dirs if not _is_moe(d)], [d for d in dirs if _is_moe(d)]):
        if group:
            subprocess.run([py, str(HERE / "vllm_loader.py"), *map(str, group), "--json", str(jsonl)], env=env)
    out = {}
    for line in jsonl.read_text().splitlines() if jsonl.exists() else []:
        r = json.loads(line)
        out[Path(r["dir"]).name] = r
    return out


def summarize(r: dict | None) -> dict:
    if r is None:
        return {"load": "not run"}
    if not r["loaded"]:
        return {"load": "refused by the engine", "error": r["error"]}
    clean = not (r["mismatched"] or r["unmapped"] or r["unfilled"] or r["lossy"])
    return {"load": "ok" if clean else "wrong", "tensors": r["tensors"], "bit_exact": r["bit_exact"],
            "after_cast": r["after_cast"], "lossy": len(r["lossy"]), "mismatched": len(r["mismatched"]),
            "unmapped": len(r["unmapped"]), "unfilled": len(r["unfilled"]),
            **({"problems": (r["mismatched"] + r["unmapped"] + r["unfilled"] + r["lossy"])[:6]} if not clean else {})}


def run_matrix(root: Path, only: str | None) -> tuple[list[dict], list[str]]:
    """The matrix's results, and what the broken controls show about the check itself (failures)."""
    todo = [c for c in cases() if not only or only in case_id(c)]
    t0 = time.perf_counter()
    srcs = build_sources(root, {(c["family"], c["dtype"], c["layout"]) for c in todo})
    written = []
    for c in todo:
        out = root / "out" / case_id(c)
        code, last = quantize(srcs[(c["family"], c["dtype"], c["layout"])], out, [*SCHEMES[c["scheme"]], *FAST])
        c["dsconv"] = "wrote" if code == 0 else ("refused" if code == 2 else f"failed (exit {code})")
        if code != 0:
            c["reason"] = last
        else:
            written.append(out)
        print(f"quantize {case_id(c)}: {c['dsconv']}", flush=True)
    t1 = time.perf_counter()
    controls = make_controls({d.name: d for d in written}, root / "out")
    loaded = load_all(engine_python(), written + controls, root / "loads.jsonl")
    for c in todo:
        if c["dsconv"] == "wrote":
            c.update(summarize(loaded.get(case_id(c))))
    print(f"quantize {t1 - t0:.0f} s, engine {time.perf_counter() - t1:.0f} s for {len(written)} checkpoints "
          f"and {len(controls)} broken controls")
    return todo, check_controls(loaded, {d.name for d in controls}) if controls else []


# Controls: copies of one loadable output, each broken in one way the check must catch (else it proves nothing).
CONTROL_OF = "llama-bits8-bf16-per-expert"
W4A8_CONTROL_OF = "qwen3_moe-w4a8-bf16-per-expert"
C8_CONTROL_OF = "qwen3-bits8_c8-bf16-per-expert"
FA_CONTROL_OF = "deepseek_v3-w4a8_c8-bf16-per-expert"
CONTROLS = {
    "drop-weight-scale": "unfilled",      # a dynamic layer's weight_scale removed: its parameter stays unfilled
    "rename-tensor": "unmapped",          # a weight under a name the model has no parameter for (or a refusal)
    "scale-off-grid": "lossy",            # an input_scale the model dtype cannot hold: the engine would round it
    "w4a8-drop-scale-bias": "unfilled",   # a W4A8 expert's scale_bias removed: w2_scale_bias keeps the sentinel
    "c8-drop-cache-scale": "unfilled",    # a layer's v_proj.kv_cache_scale removed: attn.v_cache_scale keeps it
    "fa-drop-k-scale": "unfilled",        # a DeepSeek layer's fa_k.scale removed: mla_attn.mla_attn.fa_k.scale keeps it
}
CONTROL_BASE = {"w4a8": W4A8_CONTROL_OF, "c8": C8_CONTROL_OF, "fa": FA_CONTROL_OF}


def make_controls(written: dict[str, Path], root: Path) -> list[Path]:
    """Broken copies of the outputs named CONTROL_OF / W4A8_CONTROL_OF among `written` (case id -> directory)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out = []
    for name in CONTROLS:
        base = written.get(CONTROL_BASE.get(name.split("-")[0], CONTROL_OF))
        if base is None:
            continue
        d = root / f"control-{name}"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(base, d)
        (f,) = sorted(d.glob("*.safetensors"))
        t = load_file(str(f))
        if name == "drop-weight-scale":
            del t[next(k for k in sorted(t) if k.endswith("down_proj.weight_scale"))]
        elif name == "w4a8-drop-scale-bias":
            del t[next(k for k in sorted(t) if k.endswith("experts.1.down_proj.scale_bias"))]
        elif name == "fa-drop-k-scale":
            del t[next(k for k in sorted(t) if k.endswith("layers.1.self_attn.fa_k.scale"))]
        elif name == "c8-drop-cache-scale":
            del t[next(k for k in sorted(t) if k.endswith("layers.1.self_attn.v_proj.kv_cache_scale"))]
        elif name == "rename-tensor":
            k = next(k for k in sorted(t) if k.endswith("o_proj.weight"))
            t[k.replace("o_proj", "oo_proj")] = t.pop(k)
        else:
            k = next(k for k in sorted(t) if k.endswith("o_proj.input_scale"))
            t[k] = t[k] * torch.tensor(1.0 + 2.0 ** -12, dtype=torch.float32)
        save_file(t, str(f), metadata={"format": "pt"})
        out.append(d)
    return out


def check_controls(loaded: dict[str, dict], made: set[str] | None = None) -> list[str]:
    bad = []
    for name, field in CONTROLS.items():
        if made is not None and f"control-{name}" not in made:
            continue
        r = loaded.get(f"control-{name}")
        caught = r is not None and (r.get(field) if r.get("loaded") else field == "unmapped" and r.get("error"))
        if not caught:
            bad.append(f"control {name}: the check did not report it as {field} ({r and r.get('error')})")
    return bad


def run_real(root: Path, models: list[Path]) -> list[dict]:
    out = []
    written = []
    for m in models:
        o = root / "real" / m.name
        # what is checked is where tensors land, not accuracy: 32 calibration prompts are enough
        code, last = quantize(m, o, ["--bits", "8", "--calib-samples", "32"])
        out.append(dict(model=m.name, dsconv="wrote" if code == 0 else f"exit {code}: {last}"))
        print(f"quantize {m.name}: {out[-1]['dsconv']}", flush=True)
        if code == 0:
            written.append(o)
    loaded = load_all(engine_python(), written, root / "real-loads.jsonl")
    for c in out:
        if c["dsconv"] == "wrote":
            c.update(summarize(loaded.get(c["model"])))
    return out


def failures(results: list[dict]) -> list[str]:
    bad = []
    for c in results:
        name = case_id(c) if "family" in c else c["model"]
        if c["dsconv"] == "wrote" and c.get("load") != "ok":
            bad.append(f"{name}: dsconv wrote it but the engine {c.get('load')}: "
                       f"{c.get('error') or '; '.join(c.get('problems', []))}")
        elif c["dsconv"].startswith("failed") or c["dsconv"].startswith("exit 1"):
            bad.append(f"{name}: dsconv {c['dsconv']}: {c.get('reason', '')}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("engine-check-out"))
    ap.add_argument("--only", default=None, help="run the cases whose id contains this")
    ap.add_argument("--update", action="store_true", help="rewrite results.json from this run")
    ap.add_argument("--real", type=Path, nargs="*", default=None, help="real checkpoints (engine-check-real)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    control_failures: list[str] = []
    if a.real is not None:
        results = run_real(a.out, a.real)
        (a.out / "real-results.json").write_text(json.dumps(results, indent=1) + "\n")
    else:
        results, control_failures = run_matrix(a.out, a.only)
    for c in results:
        print(json.dumps(c))
    bad = failures(results) + control_failures
    for b in bad:
        print("FAIL", b)
    if a.real is None and not a.only:
        stable = [{k: v for k, v in c.items() if k != "reason"} for c in results]
        if a.update:
            RESULTS.write_text(json.dumps(stable, indent=1) + "\n")
        elif json.loads(RESULTS.read_text()) != stable:
            print(f"FAIL results differ from {RESULTS.relative_to(HERE.parents[1])}: rerun with --update, "
                  "then `DSCONV_UPDATE_README=1 make test` to regenerate the README table, and commit both")
            return 1
    print(f"engine-check: {sum(c.get('load') == 'ok' for c in results)} loaded, "
          f"{sum(c['dsconv'] == 'refused' for c in results)} refused by dsconv, {len(bad)} failures")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
