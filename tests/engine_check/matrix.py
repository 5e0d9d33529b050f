"""`make engine-check`: what dsconv writes for each engine, loaded by that engine's own loader on a CPU host.

    python -m tests.engine_check.matrix [--engine all|vllm-ascend|mindie] [--out DIR] [--only SUBSTR] [--update]
                                        [--real DIR ...]

Runs in dsconv's environment: builds the tiny models (cases.py), runs `dsconv quantize --engine E` on each (a refusal,
exit 2, is a result too), then hands every written directory to the engine's loader in its own environment:
- vLLM-Ascend (setup_env.sh, vllm_loader.py): every family x scheme on bf16 per-expert checkpoints, the engine
  recipe also on fp16 and on fused experts; every tensor must land in its parameter.
- MindIE (MINDIE_LLM_SRC: a MindIE-LLM checkout, the atb_llm of a MindIE installation, or its source archive;
  mindie_setup.sh, mindie_loader.py): every family x scheme on bf16 and fp16 per-expert checkpoints and on fused
  experts, each at tp 1 and tp 2 (each rank in a process of its own), and DeepSeek's offline-sharded folders
  (`dsconv shard --engine mindie`) rank by rank. Every output must load, every linear must be built as its
  description type says, every quantized weight as MindIE holds it must dequantize to the float source within its
  scheme's rounding, with the scales written, and every checkpoint tensor must be read or explained.
Broken copies of written outputs (controls) must each be caught, or the check fails. The results must equal the
committed `results.json` (`--update` rewrites it), from which the README's engine table is generated
(tests/engine_contract/test_quantize_contract.py checks it in `make test`). `--real DIR ...` loads real checkpoints'
`--bits 8` outputs in vLLM-Ascend instead (`make engine-check-real`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.engine_check.cases import (ENGINES, FAMILIES, MOE, SCHEMES, build_source, quantize, source_name,
                                      tokenizer)

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.json"
PROBLEM_KEYS = ("class_mismatch", "value_mismatch", "lossy", "norms", "unread")
STABLE_DROP = ("reason", "seconds", "edits")  # not compared with the committed results


def cases(engine: str) -> list[dict]:
    """vLLM-Ascend: every scheme on bf16 per-expert checkpoints; the engine recipe (`--bits 8`: static and dynamic
    layers) also on fp16 inputs (int64 deq_scale, fp16 parameters) and on fused 3-D experts. MindIE: every scheme on
    bf16 and fp16 per-expert checkpoints and on bf16 fused experts, each loaded at tp 1 and tp 2."""
    out = []
    for f in FAMILIES:
        for s in SCHEMES:
            if engine == "vllm-ascend":
                out.append(dict(engine=engine, family=f, scheme=s, dtype="bf16", layout="per-expert"))
                continue
            for dtype, layout in (("bf16", "per-expert"), ("fp16", "per-expert"), ("bf16", "fused")):
                if layout == "fused" and f not in MOE:
                    continue
                for tp in (1, 2):
                    out.append(dict(engine=engine, family=f, scheme=s, dtype=dtype, layout=layout, tp=tp))
        if engine == "vllm-ascend":
            out.append(dict(engine=engine, family=f, scheme="bits8", dtype="fp16", layout="per-expert"))
            if f in MOE:
                out.append(dict(engine=engine, family=f, scheme="bits8", dtype="bf16", layout="fused"))
    return out


def output_id(c: dict) -> str:
    """The quantized directory of a case (tp is a way of loading it, not another output)."""
    return f"{c['engine']}/{c['family']}-{c['scheme']}-{c['dtype']}-{c['layout']}"


def case_id(c: dict) -> str:
    return output_id(c) + (f"-tp{c['tp']}" if "tp" in c else "")


def quantize_all(root: Path, todo: list[dict]) -> dict[str, Path]:
    """Quantize each distinct output once, two at a time (the sources are built first, in this process); the cases
    get `dsconv` (wrote / refused / failed) and `reason`."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing

    tok = tokenizer()
    jobs: dict[str, tuple] = {}
    for c in todo:
        oid = output_id(c)
        if oid not in jobs:
            src = build_source(root / "src", c["family"], c["dtype"], c["layout"], tok, c["scheme"])
            jobs[oid] = (str(src), str(root / "out" / oid), c["engine"], SCHEMES[c["scheme"]])
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork"), initializer=_one_thread) as ex:
        done = dict(zip(jobs, ex.map(_quantize_job, jobs.values())))
    written: dict[str, Path] = {}
    for oid, (code, _) in done.items():
        print(f"quantize {oid}: exit {code}", flush=True)
        if code == 0:
            written[oid] = root / "out" / oid
    for c in todo:
        code, last = done[output_id(c)]
        c["dsconv"] = "wrote" if code == 0 else ("refused" if code == 2 else f"failed (exit {code})")
        if code != 0:
            c["reason"] = last
    return written


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)  # two quantizations side by side on a 2-core host; tiny matmuls gain nothing from more


def _quantize_job(job: tuple) -> tuple[int, str]:
    src, out, engine, options = job
    return quantize(Path(src), Path(out), engine, [*options, "--workers", "1"])


# ------------------------------------------------------------------------------------------------ vLLM-Ascend
def vllm_python() -> str:
    from_env = os.environ.get("DSCONV_ENGINE_PYTHON")
    if from_env:
        return from_env
    p = subprocess.run(["bash", str(HERE / "setup_env.sh"), "--print-python"], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"vLLM-Ascend environment not ready: {p.stderr.strip()}")
    return p.stdout.strip()


def _is_moe(d: Path) -> bool:
    cfg = json.loads((d / "config.json").read_text())
    return any(cfg.get(k) for k in ("n_routed_experts", "num_experts", "num_local_experts"))


def vllm_load(py: str, dirs: list[Path], jsonl: Path) -> dict[str, dict]:
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
        out[str(Path(r["dir"]).resolve())] = r
    return out


def vllm_summary(r: dict | None) -> dict:
    if r is None:
        return {"load": "not run"}
    if not r["loaded"]:
        return {"load": "refused by the engine", "error": r["error"]}
    clean = not (r["mismatched"] or r["unmapped"] or r["unfilled"] or r["lossy"])
    return {"load": "ok" if clean else "wrong", "tensors": r["tensors"], "bit_exact": r["bit_exact"],
            "after_cast": r["after_cast"], "lossy": len(r["lossy"]), "mismatched": len(r["mismatched"]),
            "unmapped": len(r["unmapped"]), "unfilled": len(r["unfilled"]),
            **({"problems": (r["mismatched"] + r["unmapped"] + r["unfilled"] + r["lossy"])[:6]} if not clean else {})}


# Controls: copies of one loadable output, each broken in one way the check must catch (else it proves nothing).
VLLM_CONTROLS = {  # name -> (case the copy is made of, what the check must report)
    "drop-weight-scale": ("llama-bits8", "unfilled"),      # a dynamic layer's weight_scale removed
    "rename-tensor": ("llama-bits8", "unmapped"),          # a weight under a name the model has no parameter for
    "scale-off-grid": ("llama-bits8", "lossy"),            # an input_scale the model dtype cannot hold
    "w4a8-drop-scale-bias": ("qwen3_moe-w4a8", "unfilled"),  # a W4A8 expert's scale_bias removed
    "c8-drop-cache-scale": ("qwen3-bits8_c8", "unfilled"),   # a layer's v_proj.kv_cache_scale removed
    "fa-drop-k-scale": ("deepseek_v3-w4a8_c8", "unfilled"),  # a DeepSeek layer's fa_k.scale removed
    "mix-drop-weight-scale": ("llama-w8a8_mix", "unfilled"),  # a PD-mix linear's prefill scale removed
}


def _edit_tensors(d: Path, edit) -> None:
    """Rewrite every safetensors file of `d` (one directory, no index) through `edit(dict) -> None`."""
    from safetensors.torch import load_file, save_file

    for f in sorted(d.glob("*.safetensors")):
        t = load_file(str(f))
        edit(t)
        save_file(t, str(f), metadata={"format": "pt"})


def _copy(base: Path, root: Path, name: str) -> Path:
    d = root / f"control-{name}"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(base, d)
    return d


def vllm_controls(written: dict[str, Path], root: Path) -> dict[str, Path]:
    import torch

    def first(t: dict, suffix: str) -> str:
        return next(k for k in sorted(t) if k.endswith(suffix))

    edits = {
        "drop-weight-scale": lambda t: t.pop(first(t, "down_proj.weight_scale")),
        "w4a8-drop-scale-bias": lambda t: t.pop(first(t, "experts.1.down_proj.scale_bias")),
        "fa-drop-k-scale": lambda t: t.pop(first(t, "layers.1.self_attn.fa_k.scale")),
        "mix-drop-weight-scale": lambda t: t.pop(first(t, "o_proj.weight_scale")),
        "c8-drop-cache-scale": lambda t: t.pop(first(t, "layers.1.self_attn.v_proj.kv_cache_scale")),
        "rename-tensor": lambda t: t.__setitem__(first(t, "o_proj.weight").replace("o_proj", "oo_proj"),
                                                 t.pop(first(t, "o_proj.weight"))),
        "scale-off-grid": lambda t: t.__setitem__(first(t, "o_proj.input_scale"), t[first(t, "o_proj.input_scale")]
                                                  * torch.tensor(1.0 + 2.0 ** -12, dtype=torch.float32)),
    }
    out = {}
    for name, (of, _) in VLLM_CONTROLS.items():
        base = written.get(f"vllm-ascend/{of}-bf16-per-expert")
        if base is not None:
            out[name] = _copy(base, root, name)
            _edit_tensors(out[name], edits[name])
    return out


def run_vllm(root: Path, only: str | None) -> tuple[list[dict], list[str]]:
    todo = [c for c in cases("vllm-ascend") if not only or only in case_id(c)]
    t0 = time.perf_counter()
    written = quantize_all(root, todo)
    t1 = time.perf_counter()
    controls = vllm_controls(written, root / "vllm-controls")
    loaded = vllm_load(vllm_python(), [*written.values(), *controls.values()], root / "vllm-loads.jsonl")
    for c in todo:
        if c["dsconv"] == "wrote":
            c.update(vllm_summary(loaded.get(str(written[output_id(c)].resolve()))))
    print(f"vLLM-Ascend: quantize {t1 - t0:.0f} s, engine {time.perf_counter() - t1:.0f} s for {len(written)} "
          f"checkpoints and {len(controls)} broken controls")
    bad = []
    for name, d in controls.items():
        r, field = loaded.get(str(d.resolve())), VLLM_CONTROLS[name][1]
        caught = r is not None and (r.get(field) if r.get("loaded") else field == "unmapped" and r.get("error"))
        if not caught:
            bad.append(f"control {name}: the check did not report it as {field} ({r and r.get('error')})")
    return todo, bad


# ------------------------------------------------------------------------------------------------ MindIE
def mindie_env() -> tuple[str, str] | None:
    """(python, MindIE-LLM source root) from mindie_setup.sh; None when MINDIE_LLM_SRC is not set."""
    if not os.environ.get("MINDIE_LLM_SRC"):
        return None
    p = subprocess.run(["bash", str(HERE / "mindie_setup.sh")], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"MindIE environment not ready: {p.stderr.strip()}")
    py, src = p.stdout.split()
    return py, src


def mindie_load(env: tuple[str, str], jobs: list[tuple[int, int, list[dict]]], root: Path, at_once: int = 3
                ) -> dict[tuple, dict]:
    """Every (rank, world size, cases) job in a process of its own, `at_once` side by side (each imports MindIE
    once, then forks a child per case); (id, rank, world) -> result."""
    py, src = env
    todo = [j for j in jobs if j[2]]
    running: list = []
    results = {}

    def reap(p: subprocess.Popen, out: Path, log: Any) -> None:
        p.wait()
        log.close()
        for line in out.read_text().splitlines() if out.exists() else []:
            r = json.loads(line)
            results[(r["id"], r["rank"], r["world_size"])] = r

    while todo or running:
        while todo and len(running) < at_once:
            rank, world, loads = todo.pop(0)
            spec = root / f"mindie-loads-r{rank}-w{world}.json"
            spec.write_text(json.dumps(loads))
            out = spec.with_suffix(".jsonl")
            out.unlink(missing_ok=True)
            log = open(spec.with_suffix(".log"), "w")
            p = subprocess.Popen([py, str(HERE / "mindie_loader.py"), str(spec), "--mindie", src, "--rank", str(rank),
                                  "--world-size", str(world), "--json", str(out)],
                                 stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": ""})
            running.append((p, out, log))
        p, out, log = running.pop(0)
        reap(p, out, log)
    return results


def merge_ranks(rs: list[dict | None]) -> dict:
    """One load's result over its ranks: problems of any rank, tensors no rank read, source rows no rank holds, and
    row-parallel biases summed over the ranks' parts."""
    if any(r is None for r in rs):
        return {"load": "not run"}
    failed = [r for r in rs if not r["loaded"]]
    if failed:
        return {"load": "refused by the engine", "error": failed[0]["error"]}
    problems: dict[str, list] = {k: [] for k in PROBLEM_KEYS}
    for r in rs:
        for k in PROBLEM_KEYS[:-1]:
            problems[k] += [x for x in r[k] if x not in problems[k]]
    problems["unread"] = sorted(set.intersection(*(set(r["unread"]) for r in rs)))
    covered: dict[str, dict[str, list[set]]] = {}  # name -> chunks -> per chunk, the source rows some rank holds
    for r in rs:
        for name, by_m in r["covered"].items():
            for m, per_chunk in by_m.items():
                for s, js in zip(covered.setdefault(name, {}).setdefault(m, [set() for _ in per_chunk]), per_chunk):
                    s.update(js)
    uncovered = []
    for name, n in sorted(rs[0]["rows_of"].items()):
        missing = min((n * len(got) - sum(len(s) for s in got) for got in covered.get(name, {}).values()), default=n)
        if missing:
            uncovered.append(f"{name}: {missing} source rows (or column chunks of them) held by no rank")
    bias: dict[str, list] = {}
    for r in rs:
        for key, (val, tol, chunks, want, m) in r["bias_parts"].items():
            b = bias.setdefault(key, [0.0, 0.0, set(), want, m])
            b[0] += val
            b[1] += tol
            b[2].update(chunks)
    for key, (val, tol, chunks, want, m) in sorted(bias.items()):
        if len(chunks) == m and abs(val - want) > tol:
            problems["value_mismatch"].append(f"bias of {key.replace('|', '[')}] summed over the ranks is "
                                              f"{val:.6g}, the source's {want:.6g}")
    retried = [x for r in rs for x in r.get("retried", [])]
    listed = [f"{k}: {x}" for k in PROBLEM_KEYS for x in problems[k]] + \
        [f"uncovered: {x}" for x in uncovered] + [f"retried: {x}" for x in retried]
    out = {"load": "ok" if not listed else "wrong", "path": rs[0]["path"], "linears": rs[0]["linears"],
           "rows": sum(r["rows"] for r in rs), "tensors": rs[0]["tensors"],
           "unread_explained": sum(sum(r["unread_explained"].values()) for r in rs[:1]),
           **{k: len(v) for k, v in problems.items()}, "uncovered": len(uncovered)}
    if listed:
        out["problems"] = listed[:8]
    out["edits"] = sorted({e for r in rs for e in r.get("edits", [])})
    return out


MINDIE_CONTROLS = {  # name -> (family, scheme, dtype, layout of the copied output, tp, what the check must report)
    "drop-deq-scale": ("llama", "bits8", "bf16", "per-expert", 1, "refused by the engine"),  # a scale removed
    "describe-other-type": ("llama", "w8a8_dynamic", "bf16", "per-expert", 1, "class_mismatch"),  # a type changed
    "transpose-square": ("llama", "bits8", "bf16", "per-expert", 1, "value_mismatch"),  # a square int8 weight
    "deq-scale-dtype": ("llama", "bits8", "fp16", "per-expert", 1, "lossy"),  # fp16 model, deq_scale float32
    "swap-rank-file": ("deepseek_v3", "bits8", "bf16", "sharded", 2, "value_mismatch"),  # two ranks' files swapped
    "mix-drop-input-scale": ("qwen2", "w8a8_mix", "bf16", "per-expert", 1, "refused by the engine"),  # decode side
    "mix-prefill-scale-off": ("qwen2", "w8a8_mix", "bf16", "per-expert", 1, "value_mismatch"),  # sides disagree
}


def mindie_controls(written: dict[str, Path], sharded: dict[str, Path], root: Path) -> dict[str, Path]:
    import torch

    out = {}
    for name, (family, scheme, dtype, layout, _, _) in MINDIE_CONTROLS.items():
        base = (sharded if layout == "sharded" else written).get(f"mindie/{family}-{scheme}-{dtype}-{layout}")
        if base is None:
            continue
        d = out[name] = _copy(base, root, name)
        if name == "drop-deq-scale":
            _edit_tensors(d, lambda t: t.pop("model.layers.0.self_attn.o_proj.deq_scale"))
        elif name == "transpose-square":
            _edit_tensors(d, lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.weight",
                                                     t["model.layers.0.self_attn.o_proj.weight"].T.contiguous()))
        elif name == "deq-scale-dtype":
            def to_float(t: dict) -> None:
                for k in [k for k in t if k.endswith("deq_scale")]:
                    t[k] = (t[k] & 0xFFFFFFFF).to(torch.int32).view(torch.float32).clone()
            _edit_tensors(d, to_float)
        elif name == "mix-drop-input-scale":
            _edit_tensors(d, lambda t: t.pop("model.layers.0.self_attn.o_proj.input_scale"))
        elif name == "mix-prefill-scale-off":  # weight_scale doubled: the decode side still matches the source
            _edit_tensors(d, lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.weight_scale",
                                                     t["model.layers.0.self_attn.o_proj.weight_scale"] * 2))
        elif name == "describe-other-type":
            f = d / "quant_model_description.json"
            desc = json.loads(f.read_text())
            desc["model.layers.0.self_attn.o_proj.weight"] = "W8A8"
            f.write_text(json.dumps(desc, indent=2))
        elif name == "swap-rank-file":
            a, b = d / "model-attn-tp-000" / "model.safetensors", d / "model-attn-tp-001" / "model.safetensors"
            tmp = a.with_suffix(".swap")
            a.rename(tmp)
            b.rename(a)
            tmp.rename(b)
    return out


# MindIE's offline-sharded layouts the check loads: (layout name, `dsconv shard` options, world size, schemes)
SHARDINGS = (("sharded", ["--tp", "2", "--ep", "1", "--world", "2"], 2, None),
             ("sharded-ep4", ["--ep", "4", "--tp", "2"], 8, ("bits8",)))


def shard_mindie(root: Path, written: dict[str, Path], todo: list[dict]) -> dict[str, Path]:
    """`dsconv shard --engine mindie` (MindIE's offline-sharded folders, DeepSeek) of the written bf16 per-expert
    DeepSeek outputs, at tp 2 and at ep 4 x tp 2; the sharded cases join `todo`."""
    import contextlib
    import io

    from dsconv.cli import main

    out = {}
    for oid, d in sorted(written.items()):
        if not (oid.startswith("mindie/deepseek_v3-") and oid.endswith("-bf16-per-expert")):
            continue
        scheme = oid.split("/")[1][len("deepseek_v3-"):-len("-bf16-per-expert")]
        for layout, options, world, schemes in SHARDINGS:
            if schemes is not None and scheme not in schemes:
                continue
            key = f"mindie/deepseek_v3-{scheme}-bf16-{layout}"
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    main(["shard", "-m", str(d), "-o", str(root / "out" / key), "--engine", "mindie", "--format",
                          "mindie", *options, "--force"])
                    code = 0
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else 1
            c = dict(engine="mindie", family="deepseek_v3", scheme=scheme, dtype="bf16", layout=layout, tp=world,
                     dsconv="wrote" if code == 0 else ("refused" if code == 2 else f"failed (exit {code})"))
            if code:
                c["reason"] = (err.getvalue().strip().splitlines() or [""])[-1]
            else:
                out[key] = root / "out" / key
            todo.append(c)
            print(f"shard {key}: exit {code}", flush=True)
    return out


def run_mindie(root: Path, only: str | None, env: tuple[str, str]) -> tuple[list[dict], list[str]]:
    todo = [c for c in cases("mindie") if not only or only in case_id(c)]
    t0 = time.perf_counter()
    written = quantize_all(root, todo)
    sharded = shard_mindie(root, written, todo) if not only or "sharded" in only or "deepseek" in only else {}
    controls = mindie_controls(written, sharded, root / "mindie-controls")
    t1 = time.perf_counter()
    def load_case(cid: str, d: Path, c: dict) -> dict:
        layout = "fused" if c["layout"] == "fused" else "per-expert"  # a sharded layout's source: the per-expert one
        return {"id": cid, "dir": str(d), "source": str(root / "src" / source_name(c["family"], c["dtype"], layout,
                                                                                    c["scheme"]))}

    by_world: dict[int, list[dict]] = {}
    for c in todo:
        if c["dsconv"] == "wrote":
            d = (sharded if c["layout"].startswith("sharded") else written)[output_id(c)]
            by_world.setdefault(c["tp"], []).append(load_case(case_id(c), d, c))
    for name, d in controls.items():
        family, scheme, dtype, _, tp, _ = MINDIE_CONTROLS[name]
        by_world.setdefault(tp, []).append({"id": f"control-{name}", "dir": str(d), "source": str(
            root / "src" / source_name(family, dtype, "per-expert", scheme))})
    loaded = mindie_load(env, [(r, w, cs) for w, cs in sorted(by_world.items()) for r in range(w)], root)
    for c in todo:
        if c["dsconv"] == "wrote":
            c.update(merge_ranks([loaded.get((case_id(c), r, c["tp"])) for r in range(c["tp"])]))
    print(f"MindIE: quantize and shard {t1 - t0:.0f} s, engine {time.perf_counter() - t1:.0f} s for "
          + ", ".join(f"{len(cs)} loads at world {w}" for w, cs in sorted(by_world.items())) + " (controls included)")
    bad = []
    for name in controls:
        *_, tp, field = MINDIE_CONTROLS[name]
        r = merge_ranks([loaded.get((f"control-{name}", k, tp)) for k in range(tp)])
        caught = r["load"] == field if field.startswith("refused") else r.get(field, 0) > 0
        if not caught:
            bad.append(f"control {name}: the check did not report it as {field} ({r.get('load')}: "
                       f"{r.get('error') or r.get('problems')})")
        else:
            print(f"control {name}: caught ({field})")
    return todo, bad


# ------------------------------------------------------------------------------------------------ driver
def run_real(root: Path, models: list[Path]) -> list[dict]:
    out, written = [], {}
    for m in models:
        o = root / "real" / m.name
        # what is checked is where tensors land, not accuracy: 32 calibration prompts are enough
        code, last = quantize(m, o, "vllm-ascend", ["--bits", "8", "--calib-samples", "32"])
        out.append(dict(model=m.name, dsconv="wrote" if code == 0 else f"exit {code}: {last}"))
        print(f"quantize {m.name}: {out[-1]['dsconv']}", flush=True)
        if code == 0:
            written[m.name] = o
    loaded = vllm_load(vllm_python(), list(written.values()), root / "real-loads.jsonl")
    for c in out:
        if c["dsconv"] == "wrote":
            c.update(vllm_summary(loaded.get(str(written[c["model"]].resolve()))))
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


def stable(results: list[dict]) -> list[dict]:
    return [{k: v for k, v in c.items() if k not in STABLE_DROP and k != "problems"} for c in results]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("all", *ENGINES), default="all")
    ap.add_argument("--out", type=Path, default=Path("engine-check-out"))
    ap.add_argument("--only", default=None, help="run the cases whose id contains this")
    ap.add_argument("--update", action="store_true", help="rewrite results.json's rows of the engines run")
    ap.add_argument("--real", type=Path, nargs="*", default=None, help="real checkpoints (engine-check-real)")
    a = ap.parse_args()
    # absolute: MindIE's offline-sharded loader joins the folder names onto the model path it holds, and a relative
    # model path came out doubled (out/x/out/x/model-moe-...) on a clean clone's relative --out
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # quantize_all forks after the tokenizer is trained
    if a.real is not None:
        results = run_real(a.out, a.real)
        (a.out / "real-results.json").write_text(json.dumps(results, indent=1) + "\n")
        bad = failures(results)
        for b in bad:
            print("FAIL", b)
        return 1 if bad else 0
    engines = ENGINES if a.engine == "all" else (a.engine,)
    results: list[dict] = []
    bad: list[str] = []
    ran = []
    for engine in engines:
        if engine == "mindie":
            env = mindie_env()
            if env is None:
                msg = "MindIE part skipped: set MINDIE_LLM_SRC to a MindIE-LLM checkout, an installation's atb_llm " \
                      "or its source archive"
                if a.engine == "mindie":
                    print("FAIL", msg)
                    return 1
                print(msg)
                continue
            todo, control_bad = run_mindie(a.out, a.only, env)
        else:
            todo, control_bad = run_vllm(a.out, a.only)
        results += todo
        bad += control_bad
        ran.append(engine)
    (a.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    for c in results:
        print(json.dumps({k: v for k, v in c.items() if k != "edits"}))
    bad = failures(results) + bad
    for b in bad:
        print("FAIL", b)
    if not a.only:
        committed = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
        kept = [c for c in committed if c.get("engine", "vllm-ascend") not in ran]
        if a.update:
            RESULTS.write_text(json.dumps(kept + stable(results), indent=1) + "\n")
        elif [c for c in committed if c.get("engine", "vllm-ascend") in ran] != stable(results):
            print(f"FAIL results differ from {RESULTS.relative_to(HERE.parents[1])}: rerun with --update, "
                  "then `DSCONV_UPDATE_README=1 make test` to regenerate the README table, and commit both")
            return 1
    for engine in ran:
        rs = [c for c in results if c["engine"] == engine]
        print(f"engine-check {engine}: {sum(c.get('load') == 'ok' for c in rs)} loaded, "
              f"{sum(c['dsconv'] == 'refused' for c in rs)} refused by dsconv, "
              f"{sum(1 for b in bad if b.startswith(engine) or engine in b)} failures")
    print(f"engine-check: {len(bad)} failures")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
