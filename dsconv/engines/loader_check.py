"""An output through an engine's own weight loader on this CPU host: `dsconv verify OUTPUT --engine E`.

The engines' code runs in environments of its own (dsconv/engine_check/: setup scripts with frozen requirements,
the loaders and the comparison, which import nothing from dsconv): vLLM-Ascend 0.23.0.post1 from PyPI, MindIE-LLM from
its sources (not on PyPI: a checkout, an installation's atb_llm, or its source archive). This module starts them and
reads what they report; `make engine-check` (tests/engine_check/matrix.py) runs the same over every case and control.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from dsconv.errors import UserError

SCRIPTS = Path(__file__).resolve().parents[1] / "engine_check"
PROBLEM_KEYS = ("class_mismatch", "value_mismatch", "lossy", "norms", "unread")
MINDIE_SRC_HINT = ("MindIE-LLM is not on PyPI: pass --mindie-src (a MindIE-LLM checkout, the atb_llm of a MindIE "
                   "installation, or its source archive) or set MINDIE_LLM_SRC")


def _setup(script: str, *args: str, env: dict | None = None) -> str:
    """Run an environment's setup script (creates its cached venv the first time: minutes, PyPI needed); its
    stdout."""
    print(f"engine environment: {script} (the first run installs it under ~/.cache/dsconv: minutes; then cached)",
          file=sys.stderr, flush=True)
    p = subprocess.run(["bash", str(SCRIPTS / script), *args], capture_output=True, text=True,
                       env={**os.environ, **(env or {})})
    if p.returncode != 0:
        raise UserError(f"the engine environment could not be set up ({script}): "
                        f"{(p.stderr.strip().splitlines() or ['no message'])[-1]}",
                        hint="it installs frozen requirements from PyPI into ~/.cache/dsconv (DSCONV_ENGINE_CACHE)")
    return p.stdout.strip()


def vllm_python() -> str:
    """The vLLM-Ascend environment's python (DSCONV_ENGINE_PYTHON, else setup_env.sh's cached venv)."""
    return os.environ.get("DSCONV_ENGINE_PYTHON") or _setup("setup_env.sh", "--print-python")


def mindie_env(src: str | Path | None = None) -> tuple[str, str] | None:
    """(python, MindIE-LLM source root) from mindie_setup.sh; None without sources (`src` or MINDIE_LLM_SRC)."""
    src = str(src or os.environ.get("MINDIE_LLM_SRC") or "")
    if not src:
        return None
    py, root = _setup("mindie_setup.sh", env={"MINDIE_LLM_SRC": str(Path(src).resolve())}).split()
    return py, root


def _is_moe(d: Path) -> bool:
    from dsconv.families import family_for

    cfg = json.loads((d / "config.json").read_text())
    cfg = family_for(cfg).flat_config(cfg)  # a vision-language config keeps them in text_config
    return any(cfg.get(k) for k in ("n_routed_experts", "num_experts", "num_local_experts"))


def vllm_load(py: str, dirs: list[Path], jsonl: Path, source: Path | None = None) -> dict[str, dict]:
    """One engine process for the dense directories and one for the MoE ones (the engine's import and start-up take
    ~10 s once; vLLM creates its expert-parallel group only when the first model it is initialised with is MoE)."""
    jsonl.unlink(missing_ok=True)
    env = {**os.environ, "DSCONV_NPU_STUBS": "1", "PYTHONPATH": str(SCRIPTS), "VLLM_LOGGING_LEVEL": "ERROR",
           "TOKENIZERS_PARALLELISM": "false"}
    for group in ([d for d in dirs if not _is_moe(d)], [d for d in dirs if _is_moe(d)]):
        if group:
            subprocess.run([py, str(SCRIPTS / "vllm_loader.py"), *map(str, group), "--json", str(jsonl),
                            *(["--source", str(source)] if source else [])], env=env)
    out = {}
    for line in jsonl.read_text().splitlines() if jsonl.exists() else []:
        r = json.loads(line)
        out[str(Path(r["dir"]).resolve())] = r
    return out


def vllm_summary(r: dict | None) -> dict:
    """One vLLM-Ascend load: ok when every tensor landed where it must, every parameter element was filled, no cast
    changed a value, and every written weight decodes to its source (the `source` comparison)."""
    if r is None:
        return {"load": "not run"}
    if not r["loaded"]:
        return {"load": "refused by the engine", "error": r["error"]}
    kinds = ("mismatched", "unmapped", "unfilled", "lossy", "source")
    clean = not any(r.get(k) for k in kinds)
    return {"load": "ok" if clean else "wrong", "tensors": r["tensors"], "bit_exact": r["bit_exact"],
            "after_cast": r["after_cast"], **{k: len(r.get(k) or []) for k in kinds},
            "clipped_max": r.get("clipped_max", 0.0),
            **({"problems": [x for k in kinds for x in r.get(k) or []][:6]} if not clean else {})}


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
            p = subprocess.Popen([py, str(SCRIPTS / "mindie_loader.py"), str(spec), "--mindie", src, "--rank",
                                  str(rank), "--world-size", str(world), "--json", str(out)],
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
        crashed = str(failed[0]["error"]).startswith(("check crashed", "the loading process died"))
        return {"load": "check failed" if crashed else "refused by the engine", "error": failed[0]["error"],
                "error_type": failed[0].get("error_type"), "raised_in": failed[0].get("raised_in")}
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
           "clipped_max": max((f for r in rs for f in (r.get("clipped") or {}).values()), default=0.0),
           **{k: len(v) for k, v in problems.items()}, "uncovered": len(uncovered)}
    if listed:
        out["problems"] = listed[:8]
    out["edits"] = sorted({e for r in rs for e in r.get("edits", [])})
    return out


def _manifest(d: Path) -> dict:
    f = d / "dsconv_manifest.json"
    if not f.is_file():
        raise UserError(f"{d}: no dsconv_manifest.json", hint="pass a directory dsconv quantize or shard wrote")
    return json.loads(f.read_text())


def origins(directory: Path, source: Path | None = None) -> tuple[Path, Path]:
    """(the float source, the quantized directory) of a quantize output or of a shard of one, from the manifests'
    inputs (or `source`)."""
    m = _manifest(directory)
    plain = directory
    if m.get("stage") == "shard":
        plain = Path(m["inputs"][0])
        m = _manifest(plain)
    if m.get("stage") != "quantize":
        raise UserError(f"{directory}: a {m.get('stage')} output; --engine checks what `dsconv quantize` (or a shard "
                        f"of it) wrote", hint="pass a quantize or shard output")
    src = source or Path(m["inputs"][0])
    if not (src / "config.json").is_file():
        raise UserError(f"{src}: the float source this output was made from is not there",
                        hint="pass --source DIR (the checkpoint quantize read)")
    return src, plain


def rotation_origin(directory: Path) -> tuple[Path, int] | None:
    """(the model the manifest names, the seed) where `quantize --rotate` made this output (or the one it was
    sharded from), else None: its float source is then that model rotated again (the CLI's verify does)."""
    src, plain = origins(directory)
    seed = _manifest(plain).get("options", {}).get("rotate")
    return None if seed is None else (src, int(seed))


def cast_origin(directory: Path) -> tuple[Path, str] | None:
    """(the model the manifest names, the dtype) where `quantize --dtype` made this output, else None: its float
    source is that model cast again (MindIE's float load runs bf16 and fp16 only; the CLI's verify rebuilds it)."""
    src, plain = origins(directory)
    dtype = _manifest(plain).get("options", {}).get("dtype")
    return None if dtype is None else (src, str(dtype))


def check(directory: Path, engine: str, source: Path | None = None, mindie_src: str | None = None) -> dict:
    """One output through `engine`'s loader, compared with its float source: the merged result (load "ok" or not,
    counts, the first problems)."""
    directory = directory.resolve()
    src, plain = origins(directory, source)
    with tempfile.TemporaryDirectory(prefix="dsconv-engine-check-") as tmp:
        if engine == "vllm-ascend":
            r = vllm_load(vllm_python(), [directory], Path(tmp) / "loads.jsonl", src).get(str(directory))
            return vllm_summary(r)
        env = mindie_env(mindie_src)
        if env is None:
            raise UserError("--engine mindie needs MindIE-LLM's sources", hint=MINDIE_SRC_HINT)
        f = directory / "mindie_parallel.json"
        world = int(json.loads(f.read_text()).get("worldSize", 1)) if f.is_file() else 1
        case = {"id": "output", "dir": str(directory), "source": str(src), "plain": str(plain.resolve())}
        loaded = mindie_load(env, [(r, world, [case]) for r in range(world)], Path(tmp))
        return {**merge_ranks([loaded.get(("output", r, world)) for r in range(world)]), "world_size": world}
