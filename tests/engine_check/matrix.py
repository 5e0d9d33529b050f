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
import subprocess
import sys
import time
from pathlib import Path

from dsconv.engines.loader_check import (merge_ranks, mindie_env, mindie_load, vllm_load, vllm_python,
                                         vllm_summary)
from tests.engine_check.cases import (CAST, CAST_OPTIONS, CAST_SCHEMES, ENGINES, FAMILIES, MINDIE_MTP, MOE, MTP,
                                      MTP_SCHEMES, ROTATED, ROTATED_SCHEMES, SCHEMES, build_source, quantize,
                                      source_name, tokenizer)

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.json"
STABLE_DROP = ("reason", "seconds", "edits")  # not compared with the committed results


def cases(engine: str) -> list[dict]:
    """vLLM-Ascend: every scheme on bf16 per-expert checkpoints; the engine recipe (`--bits 8`: static and dynamic
    layers) also on fp16 inputs (int64 deq_scale, fp16 parameters) and on fused 3-D experts, and with an MTP layer
    (loaded by the engine's MTP drafter) where the family has one. MindIE: every scheme on
    bf16 and fp16 per-expert checkpoints and on bf16 fused experts, and DeepSeek's with an MTP layer (its MTP graph
    built), each loaded at tp 1 and tp 2."""
    out = []
    for f in FAMILIES:
        for s in SCHEMES:
            if engine == "vllm-ascend":
                out.append(dict(engine=engine, family=f, scheme=s, dtype="bf16", layout="per-expert"))
                continue
            for dtype, layout in (("bf16", "per-expert"), ("fp16", "per-expert"), ("bf16", "fused"), ("bf16", "mtp"),
                                  ("bf16", "rotated"), ("fp32", "per-expert")):
                if layout == "fused" and f not in MOE or layout == "mtp" and (f not in MINDIE_MTP or
                                                                             s not in MTP_SCHEMES):
                    continue
                if layout == "rotated" and (f not in ROTATED or s not in ROTATED_SCHEMES):
                    continue
                if dtype == "fp32" and (f not in CAST or s not in CAST_SCHEMES):
                    continue
                for tp in (1, 2):
                    out.append(dict(engine=engine, family=f, scheme=s, dtype=dtype, layout=layout, tp=tp))
        if engine == "vllm-ascend":
            out.append(dict(engine=engine, family=f, scheme="bits8", dtype="fp16", layout="per-expert"))
            if f in MOE:
                out.append(dict(engine=engine, family=f, scheme="bits8", dtype="bf16", layout="fused"))
            if f in MTP:  # the MTP layer through the engine's own MTP drafter (vllm_loader.mtp_names)
                out += [dict(engine=engine, family=f, scheme=s, dtype="bf16", layout="mtp") for s in MTP_SCHEMES]
            if f in ROTATED:
                out += [dict(engine=engine, family=f, scheme=s, dtype="bf16", layout="rotated")
                        for s in ROTATED_SCHEMES]
            if f in CAST:
                out += [dict(engine=engine, family=f, scheme=s, dtype="fp32", layout="per-expert")
                        for s in CAST_SCHEMES]
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
            if c["dtype"] == "fp32":  # the bf16 twin MindIE's load_case compares with (the same values, cast)
                build_source(root / "src", c["family"], "bf16", c["layout"], tok, c["scheme"])
            jobs[oid] = (str(src), str(root / "out" / oid), c["engine"],
                         SCHEMES[c["scheme"]] + (CAST_OPTIONS if c["dtype"] == "fp32" else []))
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
def vllm_controls(written: dict[str, Path], root: Path, only: str | None) -> tuple[dict[str, Path], list[str]]:
    """controls.py's copies of written vLLM-Ascend outputs; a control whose output was not written is a failure."""
    from tests.engine_check import controls as cc

    out, missing = {}, []
    for name, (of, _) in cc.VLLM_CONTROLS.items():
        base = written.get(f"vllm-ascend/{of}-bf16-per-expert")
        if base is None:
            if not only:
                missing.append(f"control {name}: its output vllm-ascend/{of}-bf16-per-expert was not written")
            continue
        family, scheme = of.split("-", 1)
        out[name] = cc.make(name, base, root.parent / "src" / source_name(family, "bf16", "per-expert", scheme), root)
    return out, missing


def run_vllm(root: Path, only: str | None) -> tuple[list[dict], list[str]]:
    todo = [c for c in cases("vllm-ascend") if not only or only in case_id(c)]
    t0 = time.perf_counter()
    written = quantize_all(root, todo)
    t1 = time.perf_counter()
    from tests.engine_check import controls as cc

    controls, bad = vllm_controls(written, root / "vllm-controls", only)
    loaded = vllm_load(vllm_python(), [*written.values(), *controls.values()], root / "vllm-loads.jsonl")
    for c in todo:
        if c["dsconv"] == "wrote":
            c.update(vllm_summary(loaded.get(str(written[output_id(c)].resolve()))))
    print(f"vLLM-Ascend: quantize {t1 - t0:.0f} s, engine {time.perf_counter() - t1:.0f} s for {len(written)} "
          f"checkpoints and {len(controls)} broken controls")
    for name, d in controls.items():
        r, expect = loaded.get(str(d.resolve())), cc.VLLM_CONTROLS[name][1]
        if not cc.vllm_caught(expect, r):
            bad.append(f"control {name}: the check did not report it as {expect} ({r and (r.get('error') or r)})")
        else:
            what = (r.get("error") or (r.get(expect) or [""])[0]) if expect != "ok" else "loaded clean"
            print(f"control {name}: {'caught' if expect != 'ok' else 'passed'} ({expect}): {what}"[:300])
    bad += verify_cli("vllm-ascend", written.get("vllm-ascend/llama-bits8-bf16-per-expert"),
                      controls.get("gate-up-swapped"))
    if not only or "rotated" in only:  # `quantize --rotate` as a user runs it: verify rebuilds its rotated source
        rotated = rotated_by_quantize(root, "llama")
        bad += verify_cli("vllm-ascend", rotated, None) if rotated else ["quantize --rotate of llama failed"]
    return todo, bad


def rotated_by_quantize(root: Path, family: str) -> Path | None:
    """`dsconv quantize --bits 8 --rotate` of the tiny `family`: its manifest names the unrotated model and the seed."""
    src = build_source(root / "src", family, "bf16", "per-expert", tokenizer())
    out = root / "out" / f"vllm-ascend/{family}-bits8-rotate-flag"
    code, last = quantize(src, out, "vllm-ascend", ["--bits", "8", "--rotate", "5"])
    print(f"quantize --rotate {family}: exit {code} {last}"[:200])
    return out if code == 0 else None


# ------------------------------------------------------------------------------------------------ MindIE
def mindie_controls(written: dict[str, Path], sharded: dict[str, Path], root: Path, only: str | None
                   ) -> tuple[dict[str, Path], list[str]]:
    """controls.py's copies of written outputs; a control whose output was not written is a failure (it
    would prove nothing silently), unless --only left its case out."""
    from tests.engine_check import controls as mc

    out, missing = {}, []
    for name, (family, scheme, dtype, layout, _, _) in mc.CONTROLS.items():
        base = (sharded if layout.startswith("sharded") else written).get(f"mindie/{family}-{scheme}-{dtype}-{layout}")
        if base is None:
            if not only:
                missing.append(f"control {name}: its output mindie/{family}-{scheme}-{dtype}-{layout} was not written")
            continue
        src = root.parent / "src" / source_name(family, dtype, "per-expert", scheme)
        out[name] = mc.make(name, base, src, root)
    return out, missing


# MindIE's offline-sharded layouts the check loads: (layout name, `dsconv shard` options, world size, schemes)
SHARDINGS = (("sharded", ["--tp", "2", "--ep", "1", "--world", "2"], 2, None),
             ("sharded-ep4", ["--ep", "4", "--tp", "2"], 8, ("bits8",)),
             # an output with an MTP layer, its MTP layer placed (`shard --mtp`)
             ("sharded-mtp", ["--tp", "2", "--ep", "1", "--world", "2", "--mtp"], 2, None))


def shard_mindie(root: Path, written: dict[str, Path], todo: list[dict]) -> dict[str, Path]:
    """`dsconv shard --engine mindie` (MindIE's offline-sharded folders, DeepSeek) of the written bf16 per-expert
    DeepSeek outputs, at tp 2 and at ep 4 x tp 2; the sharded cases join `todo`."""
    import contextlib
    import io

    from dsconv.cli import main

    from dsconv.families import families

    # the families MindIE loads from offline-sharded folders (DeepSeek-V3 and Kimi-K2, which runs DeepSeek's code)
    sharded = [f.name for f in families() if "mindie" in f.offline_sharded and f.name in FAMILIES]
    out = {}
    for oid, d in sorted(written.items()):
        family = oid.split("/")[1].split("-")[0]
        source = next((s for s in ("per-expert", "mtp") if oid.endswith(f"-bf16-{s}")), None)
        if family not in sharded or source is None:
            continue
        scheme = oid.split("/")[1][len(family) + 1:-len(f"-bf16-{source}")]
        for layout, options, world, schemes in SHARDINGS:
            if schemes is not None and scheme not in schemes or layout.endswith("mtp") != (source == "mtp"):
                continue
            key = f"mindie/{family}-{scheme}-bf16-{layout}"
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    main(["shard", "-m", str(d), "-o", str(root / "out" / key), "--engine", "mindie", "--format",
                          "mindie", *options, "--force"])
                    code = 0
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else 1
            c = dict(engine="mindie", family=family, scheme=scheme, dtype="bf16", layout=layout, tp=world,
                     dsconv="wrote" if code == 0 else ("refused" if code == 2 else f"failed (exit {code})"))
            if code:
                c["reason"] = (err.getvalue().strip().splitlines() or [""])[-1]
            else:
                out[key] = root / "out" / key
            todo.append(c)
            print(f"shard {key}: exit {code}", flush=True)
    return out


def run_mindie(root: Path, only: str | None, env: tuple[str, str]) -> tuple[list[dict], list[str]]:
    from tests.engine_check import controls as mc

    todo = [c for c in cases("mindie") if not only or only in case_id(c)]
    t0 = time.perf_counter()
    written = quantize_all(root, todo)
    sharded = shard_mindie(root, written, todo) if not only or "sharded" in only or "deepseek" in only or \
        "kimi" in only else {}
    controls, bad = mindie_controls(written, sharded, root / "mindie-controls", only)
    t1 = time.perf_counter()
    def load_case(cid: str, d: Path, c: dict) -> dict:
        # a sharded layout's source: the per-expert one (the mtp one for sharded-mtp)
        layout = c["layout"] if c["layout"] in ("fused", "mtp", "rotated") else "mtp" if c["layout"].endswith("mtp") \
            else "per-expert"
        # `--dtype bf16` of an fp32 source: MindIE's float load of the source in bf16, which the bf16 tiny model is
        dtype = "bf16" if c["dtype"] == "fp32" else c["dtype"]
        return {"id": cid, "dir": str(d), "source": str(root / "src" / source_name(c["family"], dtype, layout,
                                                                                    c["scheme"])),
                "plain": str(written[f"mindie/{c['family']}-{c['scheme']}-{c['dtype']}-{layout}"])}

    by_world: dict[int, list[dict]] = {}
    for c in todo:
        if c["dsconv"] == "wrote":
            d = (sharded if c["layout"].startswith("sharded") else written)[output_id(c)]
            by_world.setdefault(c["tp"], []).append(load_case(case_id(c), d, c))
    for name, d in controls.items():
        family, scheme, dtype, layout, tp, _ = mc.CONTROLS[name]
        by_world.setdefault(tp, []).append({"id": f"control-{name}", "dir": str(d), "source": str(
            root / "src" / source_name(family, dtype, "per-expert", scheme)), **({"plain": str(
                written[f"mindie/{family}-{scheme}-{dtype}-per-expert"])} if layout.startswith("sharded") else {})})
    loaded = mindie_load(env, [(r, w, cs) for w, cs in sorted(by_world.items()) for r in range(w)], root)
    for c in todo:
        if c["dsconv"] == "wrote":
            c.update(merge_ranks([loaded.get((case_id(c), r, c["tp"])) for r in range(c["tp"])]))
    print(f"MindIE: quantize and shard {t1 - t0:.0f} s, engine {time.perf_counter() - t1:.0f} s for "
          + ", ".join(f"{len(cs)} loads at world {w}" for w, cs in sorted(by_world.items())) + " (controls included)")
    for name in controls:
        *_, tp, expect = mc.CONTROLS[name]
        r = merge_ranks([loaded.get((f"control-{name}", k, tp)) for k in range(tp)])
        if not mc.caught(expect, r):
            bad.append(f"control {name}: the check did not report it as {expect} ({r.get('load')}: "
                       f"{r.get('error_type')} raised in {r.get('raised_in')}: {r.get('error') or r.get('problems')})")
        else:
            print(f"control {name}: {'loaded clean' if expect == 'ok' else 'caught'} ({expect}): "
                  f"{r.get('error') or (r.get('problems') or [''])[0]}"[:300])
    bad += verify_cli("mindie", sharded.get("mindie/deepseek_v3-bits8-bf16-sharded"), controls.get("gate-up-swapped"))
    return todo, bad


def verify_cli(engine: str, good: Path | None, bad: Path | None) -> list[str]:
    """`dsconv verify --engine` as a user runs it, on one written output (exit 0) and on one broken control whose
    manifest was rewritten to match (exit 3: the engine's check, not the file hashes, must catch it)."""
    from tests.engine_check import controls as cc

    out = []
    for d, want in ((good, 0), (bad, 3)):
        if d is None:
            continue
        if want:
            cc.rehash(d)
        p = subprocess.run([sys.executable, "-m", "dsconv", "verify", str(d), "--engine", engine],
                           capture_output=True, text=True)
        lines = p.stdout.strip().splitlines() + [x for x in p.stderr.splitlines() if x.startswith("error:")]
        line = (lines or [""])[-1]
        print(f"dsconv verify --engine {engine} {d.name}: exit {p.returncode}: {line}"[:300])
        if p.returncode != want or want and f"{engine}'s loader: wrong" not in p.stderr:
            out.append(f"dsconv verify --engine {engine} {d}: exit {p.returncode}, want {want} from the engine's "
                       f"check: {p.stderr.strip()[-300:]}")
    return out


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
                if a.engine == "mindie" or os.environ.get("CI"):  # CI never skips an engine
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
