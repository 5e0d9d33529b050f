"""Load dsconv outputs with MindIE-LLM's own loader on a CPU host and compare what it holds with the float source.

Runs in the MindIE environment (mindie_setup.sh: CPU torch, transformers 4.57, MindIE-LLM's Python sources), never
in dsconv's: it imports nothing from dsconv, so it cannot agree with dsconv by construction.

    python mindie_loader.py --mindie ROOT --rank R --world-size W --json OUT.jsonl CASES.json

CASES.json is a list of {"id", "dir" (what MindIE loads), "source" (the float HF checkpoint)}. One process loads
every case at one rank: MindIE keeps process-wide parallel state, so each rank of a tp > 1 load runs in a process of
its own (matrix.py starts them). Per case, the path is MindIE's: `ModelRunner(**what mindie_llm's ATB wrapper
passes)` -> `load_weights()` (its router picks the model class and the loader: the `Weights` path or the runtime's
preallocating `DefaultModelLoader`) -> the model's `init_ascend_weight()` (what its first forward does: the weight
list handed to the ATB graph). Then mindie_held.py compares every linear MindIE built with the source.

Stand-ins (mindie_stubs.py) replace only what needs an NPU. In-memory config edits the tiny test models need, never
written to the checkpoint, are reported per case ("edits").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import mindie_stubs  # noqa: E402
from mindie_mtp import mtp_shared_copies, speculative_tokens  # noqa: E402
from frames import raised_in  # noqa: E402

READS: set[tuple[str, str]] = set()   # (file, tensor name) whose data MindIE read
OPENED: set[str] = set()              # safetensors files MindIE opened
REAL_SAFE_OPEN: Any = None  # safetensors.safe_open itself, for this module's own reads (not recorded)
PROBLEM_KEYS = ("class_mismatch", "value_mismatch", "lossy", "norms", "unread")
EDITS: list[str] = []       # in-memory config edits of the current case
RETRIES: list[str] = []     # ModelRunner.load_weights' TypeError retries (a stand-in leaking into MindIE's logic)


def record_reads() -> None:
    """Wrap safetensors.safe_open (before MindIE imports it) so every tensor whose data is read is recorded."""
    import safetensors

    global REAL_SAFE_OPEN
    real = REAL_SAFE_OPEN = safetensors.safe_open

    class Slice:
        def __init__(self, s: Any, key: tuple[str, str]) -> None:
            self._s, self._key = s, key

        def __getitem__(self, idx: Any) -> Any:
            READS.add(self._key)
            return self._s[idx]

        def __getattr__(self, a: str) -> Any:
            return getattr(self._s, a)

    class RecordingSafeOpen:
        def __init__(self, filename: Any, framework: str = "pt", device: Any = "cpu") -> None:
            self._h = real(filename, framework=framework, device=device)
            self._file = str(Path(filename).resolve())
            OPENED.add(self._file)

        def __enter__(self) -> "RecordingSafeOpen":
            self._h.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            return self._h.__exit__(*exc)

        def get_tensor(self, name: str) -> Any:
            READS.add((self._file, name))
            return self._h.get_tensor(name)

        def get_slice(self, name: str) -> Slice:
            return Slice(self._h.get_slice(name), (self._file, name))

        def __getattr__(self, a: str) -> Any:
            return getattr(self._h, a)

    safetensors.safe_open = RecordingSafeOpen


def setup(root: Path, rank: int, world_size: int) -> None:
    """Environment MindIE reads, the stand-ins, MindIE's sources on sys.path, the config edits."""
    home = Path(tempfile.mkdtemp(prefix="mindie-home-"))
    (home / "lib").mkdir()
    prof = home / "profiling"
    prof.mkdir(mode=0o750)
    os.environ.update(BIND_CPU="0", MINDIE_LLM_HOME_PATH=str(home), ATB_SPEED_HOME_PATH=str(home),
                      PROFILING_FILEPATH=str(prof), WORLD_SIZE=str(world_size), RANK=str(rank),
                      LOCAL_RANK=str(rank), MINDIE_LOG_TO_STDOUT="0", MINDIE_LOG_TO_FILE="0",
                      TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    os.chmod(home, 0o750)
    mindie_stubs.install()
    record_reads()
    atb, llm = find_sources(root)
    sys.path[:0] = [str(llm), str(atb)]
    from atb_llm.models.base.config import BaseConfig  # noqa: E402

    real = BaseConfig.from_dict.__func__

    def from_dict(cls: Any, config_dict: dict, **kw: Any) -> Any:
        """Validation limits a tiny vocabulary cannot meet (BaseConfig sets top_k = 1000 and then requires it below
        the vocabulary; Qwen3 configs default their reasoning token ids to 151667/151668)."""
        v = int(config_dict.get("vocab_size") or 0)
        if "top_k" not in config_dict and v < 1000:
            config_dict["top_k"] = v - 1
            EDITS.append(f"top_k={v - 1} (vocabulary {v} < BaseConfig's default top_k 1000)")
        for k in ("start_reasoning_token_id", "end_reasoning_token_id"):
            if k not in config_dict and isinstance(getattr(cls, k, None), int) and getattr(cls, k) >= v:
                config_dict[k] = v - 1
                EDITS.append(f"{k}={v - 1} (class default {getattr(cls, k)} is outside the vocabulary)")
        if config_dict.get("eos_token_id") is None and v:
            config_dict["eos_token_id"] = 2
            EDITS.append("eos_token_id=2 (config.json has null; the tiny tokenizer's </s>)")
        return real(cls, config_dict, **kw)

    BaseConfig.from_dict = classmethod(from_dict)

    from atb_llm.runner import model_runner  # noqa: E402

    warn = model_runner.logger.warning

    def warning(msg: Any, *a: Any, **k: Any) -> Any:
        if "Retrying with reduced argument list" in str(msg):
            RETRIES.append(str(msg)[:300])
        return warn(msg, *a, **k)

    model_runner.logger.warning = warning


def find_sources(root: Path) -> tuple[Path, Path]:
    """(directory holding atb_llm/, directory holding mindie_llm/) under a MindIE-LLM checkout, an unpacked source
    archive, or a MindIE installation (atb-models beside the mindie_llm package)."""
    root = root.resolve()
    atb = llm = None
    for base in [root, root.parent, *sorted(root.glob("*")), *sorted(root.glob("*/*"))]:
        if atb is None:
            for c in (base / "examples" / "atb_models", base):
                if (c / "atb_llm" / "runner" / "model_runner.py").is_file():
                    atb = c
                    break
        if llm is None and (base / "mindie_llm" / "__init__.py").is_file():
            llm = base
    if atb is None or llm is None:
        try:
            import importlib.util

            spec = importlib.util.find_spec("mindie_llm")
            if llm is None and spec and spec.origin:
                llm = Path(spec.origin).parents[1]
        except (ImportError, ValueError):
            pass
    if atb is None or llm is None:
        sys.exit(f"MindIE-LLM sources not found under {root}: need atb_llm/ and mindie_llm/")
    return atb, llm


def parallel(directory: Path, world_size: int) -> dict[str, int]:
    """The parallel settings MindIE runs a layout with: dsconv shard's mindie_parallel.json (what a deployment puts in
    MindIE's config), else everything tensor-parallel over the world."""
    f = directory / "mindie_parallel.json"
    cfg = json.loads(f.read_text()) if f.is_file() else {}
    return {k: int(cfg.get(k, d)) for k, d in (("dp", 1), ("tp", world_size), ("moe_tp", world_size), ("moe_ep", 1))}


def load(directory: Path, rank: int, world_size: int) -> Any:
    """MindIE's path from a directory to a model with its weights loaded, as mindie_llm's ATB wrapper drives it
    (mindie_llm/modeling/model_wrapper/atb/atb_model_wrapper.py), its MTP layer built where it has one
    (speculative_tokens)."""
    from atb_llm.models import InferenceMode
    from atb_llm.runner.model_runner import ModelRunner

    runner = ModelRunner(model_name_or_path=str(directory), rank=rank, local_rank=rank, npu_id=rank,
                         world_size=world_size, is_flash_causal_lm=True, enable_edge=False, trust_remote_code=False,
                         load_tokenizer=True, tokenizer_path=None, inference_mode=InferenceMode.REGRESSION,
                         max_position_embeddings=None, lora_modules=None, max_loras=0, max_lora_rank=0,
                         plugin_params=None, num_speculative_tokens=speculative_tokens(directory), sp=-1, cp=-1,
                         **parallel(directory, world_size), distributed_enable=False, max_batch_size=-1, models_dict=None,
                         num_lccl_comm_shards=1, lccl_comm_shard_id=0, model_role="standard")
    runner.load_weights()
    return runner


def hand_to_graph(runner: Any) -> dict[str, list[Any]]:
    """What the model's first forward does before running: init_ascend_weight builds the weight list it hands to
    the ATB graph (the stand-in graph object records it). The list, in order, by graph: "prefill" (every model's
    one list) and "decode" where the model builds the decode graph's own (a PD-mix model: flash_causal_llama.py /
    flash_causal_qwen2.py `decode_weight`, from the W8A8 side of each W8A8_PDMIX linear). DeepSeek's MTP layer has
    a graph of its own (flash_causal_deepseekv2.py::init_ascend_weight `ascend_weight_mtp`): it joins "prefill", the
    lists a forward hands its graphs."""
    model = runner.model
    if not hasattr(model, "init_ascend_weight"):
        return {}
    model.init_ascend_weight()
    out = {"prefill": [*(getattr(model, "ascend_weight", None) or []), *(getattr(model, "ascend_weight_mtp", None)
                                                                          or [])]}
    if getattr(model, "decode_weight", None):
        out["decode"] = model.decode_weight
    return {k: [t for t in v if hasattr(t, "data_ptr")] for k, v in out.items()}


def read_all(paths: list[Path]) -> dict[str, Any]:
    """name -> torch tensor over safetensors files (this module's own reads, not MindIE's)."""
    out: dict[str, Any] = {}
    for f in paths:
        with REAL_SAFE_OPEN(str(f), framework="pt") as h:
            for name in h.keys():
                out[name] = h.get_tensor(name)
    return out


def written_names(d: Path) -> set[tuple[str, str]]:
    """(file, name) of every tensor written under `d` (an offline-sharded layout's folders included)."""
    out = set()
    for f in sorted(d.rglob("*.safetensors")):
        with REAL_SAFE_OPEN(str(f), framework="pt") as h:
            out.update((str(f.resolve()), n) for n in h.keys())
    return out


def source_tensors(src: Path, written: Any = ()) -> dict[str, Any]:
    """The float source as float64 arrays, transformers' fused 3-D experts as per-expert names."""
    import torch

    import mindie_reference as mr

    out: dict[str, Any] = {}
    for name, t in mr.source_tensors(sorted(src.glob("*.safetensors")), read_all, written).items():
        out[name] = t.to(torch.float64).numpy() if t.is_floating_point() else t.numpy()
    return out


def description(d: Path) -> dict[str, str]:
    for f in sorted(d.rglob("quant_model_description*.json")):
        return {k: v for k, v in json.loads(f.read_text()).items() if isinstance(v, str)}
    return {}


def plain_dir(case: dict) -> Path:
    """The quantized directory a case's output was made from (itself, or the one an offline-sharded output was
    sharded from)."""
    return Path(case.get("plain") or case["dir"]).resolve()


def reference(case: dict, rank: int, world_size: int, tmp: Path) -> dict:
    """The float source loaded by MindIE with the output's config and parallel settings (mindie_reference.py): what
    each module holds, saved to tmp/reference.npz, and the module at each position of the graph's weight list."""
    import numpy as np

    import mindie_held as mh
    import mindie_reference as mr

    plain = plain_dir(case)
    written = read_all(sorted(plain.glob("*.safetensors")))
    src = mr.source_tensors(sorted(Path(case["source"]).glob("*.safetensors")), read_all, written)
    errors = []
    for keep_config in (True, False):  # the quantized output's config.json, then a plain float one
        ref = mr.build(plain, Path(case["dir"]), src, written, tmp / "reference",
                       json.loads((Path(case["source"]) / "config.json").read_text()), keep_config)
        try:
            runner = load(ref, rank, world_size)
            modules = mh.linear_modules(runner.model)
            weights = {n: m.weight for n, m in modules}
            graph = hand_to_graph(runner)
            arrays, meta = mr.capture(runner.model, modules, mh._desc_of)  # after it, as the quantized load's
        except Exception as e:  # noqa: BLE001 - reported: without the float load nothing can be compared in place
            errors.append(f"{type(e).__name__}: {e}".splitlines()[0][:300])
            continue
        np.savez(tmp / "reference.npz", **arrays)
        meta["slots"] = mr.slots(graph.get("prefill", []), weights)
        meta["config"] = "as written" if keep_config else "float"
        return {"ok": True, "file": str(tmp / "reference.npz"), "meta": meta}
    return {"ok": False, "error": " / ".join(errors)}


def run(case: dict, rank: int, world_size: int, ref: dict | None = None) -> dict:
    """One load and its comparison with the float load `ref` (reference()): a dict of counts and the problems
    found."""
    import numpy as np

    import mindie_held as mh
    import mindie_match as mm
    import mindie_reference as mr

    READS.clear()
    OPENED.clear()
    EDITS.clear()
    RETRIES.clear()
    d, started = Path(case["dir"]).resolve(), time.perf_counter()
    res: dict[str, Any] = {"id": case["id"], "rank": rank, "world_size": world_size, "loaded": False, "error": None}
    try:
        runner = load(d, rank, world_size)
    except Exception as e:  # MindIE refused the checkpoint: that IS the result
        res["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:400]
        res["error_type"], res["raised_in"] = type(e).__name__, raised_in(e, ("atb_llm", "mindie_llm"))
        res["traceback"] = traceback.format_exc(limit=-6)
        res["edits"] = sorted(set(EDITS))
        res["seconds"] = round(time.perf_counter() - started, 2)
        return res
    res.update(loaded=True, retried=RETRIES[:1], edits=sorted(set(EDITS)), model=type(runner.model).__name__,
               path="runtime DefaultModelLoader" if runner.prealloc_weight_mem_on_npu else "Weights")
    modules = mh.linear_modules(runner.model)
    weights = {n: m.weight for n, m in modules}  # before init_ascend_weight may replace them
    try:
        graph = hand_to_graph(runner)
    except Exception as e:  # noqa: BLE001 - MindIE's own code failed on what it loaded
        res.update(loaded=False, error=f"init_ascend_weight: {type(e).__name__}: {e}".splitlines()[0][:400],
                   traceback=traceback.format_exc(limit=-6), seconds=round(time.perf_counter() - started, 2))
        return res
    res["graph_tensors"] = sum(len(v) for v in graph.values())
    held, problems = mh.held_linears(modules, runner.dtype)
    # what this rank was given: every file it opened (an offline-sharded layout: its own folders)
    written = read_all(sorted(Path(f) for f in OPENED))
    plain = written if plain_dir(case) == d else read_all(sorted(plain_dir(case).glob("*.safetensors")))
    if ref is None or not ref.get("ok"):
        res["value_mismatch"] = [f"the float source's own load failed, so nothing can be compared in place: "
                                 f"{(ref or {}).get('error')}"]
        for k in ("class_mismatch", "lossy", "norms", "unread"):
            res[k] = []
        res.update(linears=0, rows=0, tensors=len(written), covered={}, bias_parts={}, rows_of={},
                   unread_explained={}, clipped={}, caches=0, seconds=round(time.perf_counter() - started, 2))
        return res
    reference_held = mm.Reference.load(ref["file"], ref["meta"])
    src = mm.Source(source_tensors(Path(case["source"]), plain), plain, description(d), dtype=runner.dtype,
                    norm_offset=mm.norm_offset(json.loads((plain_dir(case) / "config.json").read_text())))
    norms = src.held_norms(reference_held, runner.model, runner.dtype)
    out = mm.compare(held, reference_held, src)
    res["linears"], res["rows"] = out.linears, out.rows
    res["class_mismatch"] = out.class_mismatch
    res["value_mismatch"] = problems + out.value_mismatch + (mh.graph_problems(held, graph) if graph else []) \
        + (mm.slot_problems(ref["meta"]["slots"], mr.slots(graph.get("prefill", []), weights))
           if graph and ref["meta"]["config"] == "as written" else [])  # a float model's graph is another graph
    res["lossy"] = out.lossy
    res["norms"] = norms
    res["clipped"] = out.clipped
    res["caches"], cache = mh.cache_problems(runner.model, written, runner.dtype, rank)
    res["value_mismatch"] += cache
    res["covered"] = {n: {str(m): [np.nonzero(v[:, c])[0].tolist() for c in range(m)] for m, v in by_m.items()}
                      for n, by_m in out.covered.items()}
    res["bias_parts"] = out.bias_parts
    shared = mtp_shared_copies(written, d) | mtp_shared_copies(src.weights, d)
    res["rows_of"] = {n: int(a.shape[0]) for n, a in src.weights.items() if a.ndim == 2 and n not in shared}
    res["unread"], res["unread_explained"] = unread(written_names(d), written, src.desc, d, shared)
    res["tensors"] = len(written)
    res["seconds"] = round(time.perf_counter() - started, 2)
    return res


# Checkpoint tensors a MindIE path legitimately never reads, and the check that the reason holds.
def unread(names: set[tuple[str, str]], written: dict[str, Any], desc: dict[str, str], d: Path,
           shared: set[str] = frozenset()) -> tuple[list[str], dict[str, int]]:
    """Written tensors this rank did not read: explained (reason -> count), or not ("file: name (type)"). A tp > 1
    load's lists are intersected over its ranks by the driver (a rank reads only its own folders)."""
    unexplained, explained = [], {}
    for f, n in sorted(names):
        if (f, n) in READS:
            continue
        module, _, leaf = n.rpartition(".")
        kind = desc.get(module + ".weight")
        t = written.get(n)
        if n in shared:
            reason = "the MTP layer's copy of the main embedding / LM head: MindIE runs the main one"
        elif leaf == "weight_offset" and kind == "W4A8_DYNAMIC" and t is not None and not bool(t.abs().max() > 0):
            reason = "W4A8_DYNAMIC weight_offset (zeros): W4A8LinearDynamic takes no offset"
        elif leaf == "bias" and kind == "W8A8" and any(k == (f, module + ".quant_bias") for k in READS):
            reason = "float bias of a W8A8 linear: folded into quant_bias (checked against the source bias)"
        elif module.endswith((".fa_q", ".fa_k", ".fa_v")) and (leaf == "offset" and t is not None
                                                                and not bool(t.abs().max() > 0)
                                                                or module.endswith(".fa_v") and leaf == "scale"):
            reason = "FA quant fa_v.scale and the zero offsets: FA3.load_mla reads fa_q.scale and fa_k.scale only"
        else:
            unexplained.append(f"{Path(f).relative_to(d.resolve())}: {n} ({desc.get(n, '?')})")
            continue
        explained[reason] = explained.get(reason, 0) + 1
    return unexplained, explained


def line(r: dict) -> str:
    head = f"{r['id']} rank {r['rank']}/{r['world_size']}: "
    if not r["loaded"]:
        return head + f"refused: {r['error']}"
    bad = {k: len(r[k]) for k in PROBLEM_KEYS if r[k]}
    return head + (f"loaded ({r['path']}, {r['model']}), {r['linears']} linears, {r['rows']} rows, "
                   f"{r['tensors']} tensors, {sum(r['unread_explained'].values())} unread explained"
                   + (f"; PROBLEMS {bad}" if bad else "") + (f"; RETRIED" if r["retried"] else "")
                   + f" ({r['seconds']} s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", type=Path)
    ap.add_argument("--mindie", type=Path, required=True, help="MindIE-LLM sources (checkout, archive, install)")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--json", type=Path, required=True, help="append one JSON line per case")
    a = ap.parse_args()
    setup(a.mindie, a.rank, a.world_size)
    preload()
    for case in json.loads(a.cases.read_text()):
        with tempfile.TemporaryDirectory(prefix="mindie-ref-") as tmp:
            ref = in_child(case, reference, a.rank, a.world_size, Path(tmp))
            r = in_child(case, run, a.rank, a.world_size, ref)
            with open(a.json, "a") as f:
                f.write(json.dumps(r) + "\n")
            print(line(r), flush=True)
        for k in PROBLEM_KEYS:
            for x in (r.get(k) or [])[:6]:
                print(f"     {k}: {x}")
    return 0


def preload() -> None:
    """Import what every load uses once, in the parent (~3 s); each case then runs in a forked child. Then prove the
    checker's int4 decoding against MindIE's own: MindIE has no unpacking function, but it packs int4 pairs itself
    (atb/utils/quantize/low_bit_utils.py::int42int8, W4A16's older layout), so the checker's unpacking must be its
    exact inverse, or nothing this check says about int4 weights holds."""
    import atb_llm.runner.model_runner  # noqa: F401
    import mindie_llm.runtime.utils.loader.default_model_loader  # noqa: F401
    import numpy as np
    import torch
    from atb_llm.utils.quantize.low_bit_utils import int42int8

    from mindie_held import unpack_int4

    x = torch.from_numpy(np.random.default_rng(0).integers(-8, 8, size=(3, 6, 16)).astype(np.int8))
    if not np.array_equal(unpack_int4(int42int8(x).numpy()), x.numpy()):
        sys.exit("the checker's int4 unpacking is not the inverse of MindIE's int42int8: fix mindie_held.unpack_int4")

    import mindie_match  # noqa: F401
    import mindie_reference  # noqa: F401


def in_child(case: dict, fn: Any, rank: int, world_size: int, *args: Any) -> dict:
    """Run one case in a forked child: MindIE keeps process-wide state (its parallel-info manager, class-level
    quantization settings) that one load leaves behind for the next; a fork starts every case from the state after
    import, at a few milliseconds instead of a new interpreter's seconds."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(rfd)
        code = 0
        try:
            payload = json.dumps(fn(case, rank, world_size, *args)).encode()
        except BaseException as e:  # noqa: BLE001 - a bug of this check, reported as such
            payload = json.dumps({"id": case["id"], "rank": rank, "world_size": world_size, "loaded": False,
                                  "error": f"check crashed: {type(e).__name__}: {e}",
                                  "traceback": traceback.format_exc(limit=-8)}).encode()
            code = 1
        with os.fdopen(wfd, "wb") as w:
            w.write(payload)
        os._exit(code)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as r:
        data = r.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        return {"id": case["id"], "rank": rank, "world_size": world_size, "loaded": False,
                "error": f"the loading process died (wait status {status})"}
    return json.loads(data)


if __name__ == "__main__":
    sys.exit(main())
