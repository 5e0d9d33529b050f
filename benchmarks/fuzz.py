"""`make fuzz` (= `python -m benchmarks.fuzz`): mutation fuzzing of every parser dsconv runs on untrusted input.

Each target starts from a valid seed file (a real tiny DeepSeek-V3 checkpoint's config.json, safetensors header and
index, a real output manifest and quant description, dsconv.toml, a calibration set, expert load, hosts files, an ATC
profile, and the config.json of every family's tiny model), mutates it (bytes and JSON structure, with the values
hostile users reach for: deep nesting, 5000-digit integers, NaN, lone surrogates, wrong types, negatives, huge sizes)
and runs the same code a command runs on it. UserError/CheckFailed is the correct outcome for bad input; anything else
is a failure, grouped by signature (target, exception type, innermost dsconv frame). Prints cases run and distinct
failures; exit 1 if any.

Config targets: before the random cases, a sweep sets every key every family reads (its `Family.config_keys`, so a
key a family starts reading is covered without editing this file) to null, to a value of the wrong type and removes
it; the random cases then aim half their mutations at those keys.

    python -m benchmarks.fuzz [--cases 12000] [--seed 0] [--out bench-results/fuzz]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import resource
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

HOSTILE: list[Any] = [None, True, False, 0, -1, -3, 1, 2, 2.5, 1e308, -1e308, 2**63, 2**64 + 1, 1099511627776,
                      "", "2", "x", "\ud800", "\udfff", [], {}, [[]], [1, 2], {"a": 1}, "../../etc/passwd",
                      "/etc/passwd", "BF16", "I8", "W8A8", "a" * 5000]
RAW_TOKENS = [b"[" * 2000, b"{" * 2000, b"]" * 50, b"1" * 5000, b"NaN", b"Infinity", b"-Infinity", b"1e999",
              b'"\\ud800"', b"\xff\xfe", b"\x00", b"null", b"[]", b"{}", b'"', b",", b":", b"-0", b"9" * 25,
              b"\xed\xa0\x80", b"\xef\xbb\xbf", b"\n", b"#", b"=", b"[[", b"]]"]


# ----------------------------------------------------------------------------------------------- mutations
def hostile(rng: random.Random) -> Any:
    """A fresh copy of a hostile value (a shared list would be mutated in place and end up containing itself)."""
    return copy.deepcopy(rng.choice(HOSTILE))


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if len(prefix) > 12:
        return out
    if isinstance(doc, dict):
        for k, v in list(doc.items())[:200]:
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:50]):
            out += _paths(v, prefix + (i,))
    return out


def _set(doc: Any, path: tuple, value: Any, delete: bool = False) -> Any:
    if not path:
        return value
    node = doc
    for p in path[:-1]:
        node = node[p]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


def mutate_json(rng: random.Random, doc: Any) -> bytes:
    doc = json.loads(json.dumps(doc))
    for _ in range(rng.randint(1, 3)):
        paths = _paths(doc)
        path = rng.choice(paths)
        r = rng.random()
        if r < 0.15 and path:
            doc = _set(doc, path, None, delete=True)
        elif r < 0.25:
            deep: Any = 1
            for _ in range(rng.choice([40, 500])):
                deep = [deep]
            doc = _set(doc, path, deep)
        elif r < 0.35 and isinstance(doc, dict):
            doc[rng.choice(["extra", "__metadata__", "weight_map", "files", "layers", "\ud800"])] = hostile(rng)
        else:
            doc = _set(doc, path, hostile(rng))
    return json.dumps(doc, allow_nan=True, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        r = rng.random()
        pos = rng.randrange(len(b) + 1)
        if r < 0.3 and b:
            b[min(pos, len(b) - 1)] = rng.randrange(256)
        elif r < 0.55:
            b[pos:pos] = rng.choice(RAW_TOKENS)
        elif r < 0.75 and b:
            del b[pos:pos + rng.randint(1, 64)]
        elif r < 0.9 and b:
            a = rng.randrange(len(b))
            b[pos:pos] = b[a:a + rng.randint(1, 64)]
        else:
            b = b[:pos]
    return bytes(b)


def config_mutants(doc: dict[str, Any], keys: Iterable[str]) -> Iterator[tuple[str, bytes]]:
    """(label, config bytes): each key set to null, to a value of another JSON type, and removed."""
    for key in keys:
        wrong = 7 if isinstance(doc.get(key), str) else "x"
        for label, value in (("null", None), ("wrong type", wrong), ("missing", KeyError)):
            d = dict(doc)
            if value is KeyError:
                d.pop(key, None)
            else:
                d[key] = value
            yield f"{key} {label}", json.dumps(d).encode()


def mutate_config(rng: random.Random, seed: bytes, keys: list[str]) -> bytes:
    """Half the time 1-3 of the keys a family reads get null, a hostile value or removed; else `mutate`."""
    if rng.random() < 0.5:
        return mutate(rng, seed)
    doc = json.loads(seed)
    for _ in range(rng.randint(1, 3)):
        key, r = rng.choice(keys), rng.random()
        if r < 0.3:
            doc.pop(key, None)
        else:
            doc[key] = None if r < 0.6 else hostile(rng)
    return json.dumps(doc, allow_nan=True).encode("utf-8", "surrogatepass")


def mutate(rng: random.Random, seed: bytes) -> bytes:
    try:
        doc = json.loads(seed)
    except (ValueError, UnicodeDecodeError):
        doc = None
    if doc is not None and rng.random() < 0.6:
        return mutate_json(rng, doc)
    return mutate_bytes(rng, seed)


# ----------------------------------------------------------------------------------------------- targets
class Targets:
    """Seeds and the code each command runs on them, built once in a scratch directory."""

    def __init__(self, root: Path) -> None:
        from dsconv.demo import write_demo_model
        from dsconv.io.writer import OutputDir
        from dsconv.runner.texts import load_tokenizer

        self.root = root
        self.model = write_demo_model(root / "model")
        self.tokenizer = load_tokenizer(self.model)
        st = self.model / "model.safetensors"
        raw = st.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        self.header, self.data = raw[8:8 + n], raw[8 + n:]
        names = list(json.loads(self.header))
        self.index = json.dumps({"metadata": {"total_size": len(self.data)},
                                 "weight_map": {k: "model.safetensors" for k in names if k != "__metadata__"}}).encode()
        out = root / "out"
        with OutputDir(out, stage="fuzz", options={"x": 1}) as o:
            o.write_json("a.json", {"a": 1})
            o.write_text("b/c.txt", "c")
        self.manifest = (out / "dsconv_manifest.json").read_bytes()
        self.description = json.dumps({"model_quant_type": "W8A8", "version": "1.0.0", "group_size": 0,
                                       "model.layers.0.self_attn.o_proj.weight": "W8A8",
                                       "model.norm.weight": "FLOAT"}).encode()
        self.toml = b'[workspace]\nmodel = "model"\noutput = "dsconv-out"\n\n[defaults]\nbits = 8\n'
        from dsconv.bundled import bundled_calib_path
        self.calib = b"\n".join(bundled_calib_path().read_bytes().splitlines()[:4]) + b"\n"
        self.expert_load = json.dumps({"layers": {"1": [5, 1, 0, 3] * 4, "2": [1] * 16}}).encode()
        self.hosts_json = json.dumps({"servers": [{"server_ip": "10.0.0.1", "device_ips": ["10.1.0.1", "10.1.0.2"]},
                                                  {"server_ip": "10.0.0.2", "device_ips": ["10.1.0.3", "10.1.0.4"]}]
                                      }).encode()
        self.hosts_text = b"10.0.0.1 10.1.0.1 10.1.0.2  # node a\n10.0.0.2 10.1.0.3 10.1.0.4\n"
        import dsconv
        self.profile = (Path(dsconv.__file__).parent / "atc_profiles" / "Ascend910B3.json").read_bytes()
        self.work = root / "work"
        self.work.mkdir()
        self.config = (self.model / "config.json").read_bytes()
        from dsconv.families import families
        from dsconv.tiny import tiny_config

        #: family -> (its tiny model's full config.json, the keys it reads): the config-only targets
        self.family_configs = {f.name: (json.dumps(tiny_config(f.name).to_dict()).encode(), sorted(f.config_keys))
                               for f in families()}

    def table(self) -> dict[str, tuple[bytes, Callable[[bytes], Any]]]:
        return {
            **{f"config.json ({name})": (seed, self.plan_from_config)
               for name, (seed, _) in self.family_configs.items()},
            "config.json": (self.config, self.open_with_config),
            "safetensors header": (self.header, self.open_with_header),
            "index.json": (self.index, self.open_with_index),
            "dsconv_manifest.json": (self.manifest, self.read_manifest),
            "quant_model_description.json": (self.description, self.read_description),
            "dsconv.toml": (self.toml, self.read_toml),
            "calibration .jsonl": (self.calib, lambda b: self.read_calib(b, ".jsonl")),
            "calibration .json": (json.dumps([json.loads(x)["question"] for x in self.calib.splitlines()]).encode(),
                                  lambda b: self.read_calib(b, ".json")),
            "expert_load.json": (self.expert_load, self.read_expert_load),
            "hosts (JSON)": (self.hosts_json, self.read_hosts),
            "hosts (text)": (self.hosts_text, self.read_hosts),
            "ATC profile": (self.profile, self.read_profile),
        }

    def _model_with(self, files: dict[str, bytes]) -> Path:
        d = self.work / "m"
        if d.exists():
            shutil.rmtree(d)
        d.mkdir()
        for f in ("config.json", "model.safetensors"):
            if f not in files:
                os.link(self.model / f, d / f)  # a hard link: symlinks out of the model dir are refused
        for f, data in files.items():
            (d / f).write_bytes(data)
        return d

    @staticmethod
    def _open(d: Path) -> None:
        from dsconv.checkpoint import Checkpoint
        from dsconv.inspect import inspect_model

        with Checkpoint.open(d) as ck:
            inspect_model(ck)  # the inspect command's report reads every fact

    def open_with_config(self, b: bytes) -> None:
        self._open(self._model_with({"config.json": b}))
        from dsconv.checkpoint import ConfigOnly
        from dsconv.inspect import inspect_model

        inspect_model(ConfigOnly.open(self.work / "m" / "config.json"))

    def plan_from_config(self, b: bytes) -> None:
        """What `dsconv inspect --config` and `dsconv shard --config` run: facts, the synthesized tensors, the plan
        and each card's memory estimate."""
        from dsconv.checkpoint import ConfigOnly
        from dsconv.inspect import inspect_model
        from dsconv.shard.stage import ShardRequest, run

        p = self._file("config.json", b)
        inspect_model(ConfigOnly.open(p))
        run(ShardRequest(config=p, dry_run=True, progress=False))

    def config_keys(self, target: str) -> list[str] | None:
        """The keys the family of a config target reads (None for the other targets)."""
        if target == "config.json":
            return self.family_configs["deepseek_v3"][1]
        name = target[len("config.json ("):-1] if target.startswith("config.json (") else None
        return self.family_configs[name][1] if name in self.family_configs else None

    def open_with_header(self, b: bytes) -> None:
        n = len(b) if random.random() < 0.9 else random.choice([0, 7, len(b) + 1, 2**63, 2**40])
        self._open(self._model_with({"model.safetensors": n.to_bytes(8, "little") + b + self.data}))

    def open_with_index(self, b: bytes) -> None:
        self._open(self._model_with({"model.safetensors.index.json": b}))

    def _file(self, name: str, b: bytes) -> Path:
        p = self.work / name
        p.write_bytes(b)
        return p

    def read_manifest(self, b: bytes) -> None:
        from dsconv.io.writer import verify_files

        d = self.work / "out"
        if d.exists():
            shutil.rmtree(d)
        shutil.copytree(self.root / "out", d)
        (d / "dsconv_manifest.json").write_bytes(b)
        verify_files(d)

    def read_description(self, b: bytes) -> None:
        from dsconv.quant.formats.msmodelslim import check_description
        from dsconv.schemas import quant_description

        check_description(quant_description(self._file("quant_model_description.json", b)), {})

    def read_toml(self, b: bytes) -> None:
        from dsconv import workspace

        ws = workspace.load(self._file("dsconv.toml", b))
        ws.stage_dir("quantize")

    def read_calib(self, b: bytes, suffix: str) -> None:
        from dsconv.quant.calibrate.data import tokenize
        from dsconv.runner.texts import read_texts

        texts = read_texts(self._file("calib" + suffix, b), self.tokenizer)
        tokenize(texts, self.tokenizer, 64, "fuzz")

    def read_expert_load(self, b: bytes) -> None:
        from dsconv.shard.balance import read_expert_load

        read_expert_load(self._file("expert_load.json", b), 16, (1, 2))

    def read_hosts(self, b: bytes) -> None:
        from dsconv.shard.ranktable import build_rank_table, read_hosts

        build_rank_table(read_hosts(self._file("hosts.txt", b)))

    def read_profile(self, b: bytes) -> None:
        from dsconv.atc.profiles import load_profile

        p = self._file("Ascend910B3.json", b)
        load_profile(profile=p)


# ----------------------------------------------------------------------------------------------- driver
def signature(target: str, e: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/dsconv/" in f.filename]
    where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
    return f"{target}: {type(e).__name__} at {where}"


def run(cases: int, seed: int, out: Path, budget_s: float) -> dict[str, Any]:
    from dsconv.errors import DsconvError

    resource.setrlimit(resource.RLIMIT_AS, (16 * 2**30, resource.RLIM_INFINITY))  # a blow-up is a failure
    rng = random.Random(seed)
    random.seed(seed)
    scratch = Path(tempfile.mkdtemp(prefix="dsconv-fuzz-"))
    try:
        targets = Targets(scratch)
        table = targets.table()
        names = sorted(table)
        counts = dict.fromkeys(names, 0)
        rejected = dict.fromkeys(names, 0)
        failures: dict[str, dict[str, Any]] = {}

        def one(name: str, data: bytes, what: str | None = None) -> None:
            counts[name] += 1
            try:
                table[name][1](data)
            except DsconvError:
                rejected[name] += 1
            except BaseException as e:  # noqa: BLE001 - that is what a fuzzer looks for
                if isinstance(e, KeyboardInterrupt):
                    raise
                sig = signature(name, e)
                f = failures.setdefault(sig, {"count": 0, "example": None, "message": str(e)[:300], "case": what})
                f["count"] += 1
                if f["example"] is None:
                    out.mkdir(parents=True, exist_ok=True)
                    ex = out / f"failure-{len(failures):03d}.bin"
                    ex.write_bytes(data)
                    f["example"] = str(ex)

        t0 = time.perf_counter()
        swept = 0
        for name in names:  # every key every family reads: null, wrong type, missing
            keys = targets.config_keys(name)
            if keys is not None:
                for what, data in config_mutants(json.loads(table[name][0]), keys):
                    one(name, data, what)
                    swept += 1
        for i in range(cases):
            name = names[i % len(names)]
            keys = targets.config_keys(name)
            seed_bytes = table[name][0]
            one(name, mutate_config(rng, seed_bytes, keys) if keys else mutate(rng, seed_bytes))
            if time.perf_counter() - t0 > budget_s:
                break
        elapsed = time.perf_counter() - t0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"cases": sum(counts.values()), "config_key_sweep": swept, "seconds": round(elapsed, 1),
            "per_target": counts, "rejected_per_target": rejected, "distinct_failures": len(failures),
            "failures": failures}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=12000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=float, default=900.0, help="stop after this many seconds")
    ap.add_argument("--out", type=Path, default=Path("bench-results") / "fuzz")
    a = ap.parse_args(argv)
    result = run(a.cases, a.seed, a.out, a.budget)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"fuzz: {result['cases']} cases ({result['config_key_sweep']} of them the config key sweep) in "
          f"{result['seconds']}s over {len(result['per_target'])} targets; "
          f"{sum(result['rejected_per_target'].values())} rejected with a one-line error; "
          f"{result['distinct_failures']} distinct failures")
    for sig, f in sorted(result["failures"].items(), key=lambda kv: -kv[1]["count"]):
        case = f" [{f['case']}]" if f.get("case") else ""
        print(f"  {f['count']:5d}  {sig}{case}: {f['message']}  (example: {f['example']})")
    return 1 if result["distinct_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
