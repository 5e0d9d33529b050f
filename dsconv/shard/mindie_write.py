"""Write MindIE's offline-sharded DeepSeek layout (the items come from mindie_planner.Planner; `dsconv verify` of it
is mindie_verify.py).

Writing streams one dumped tensor at a time: tensors MindIE leaves unchanged are copied as byte regions of the source,
the others are made from their source tensors (mmapped, a few cached).
"""
from __future__ import annotations

import json
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsconv.executor import Executor
from dsconv.io.parts import PartLayout, PartWriter

from dsconv.errors import UserError
from dsconv.shard.mindie_planner import Planner
from dsconv.shard.mindie_sharded import (COPY_MARKS, DESCRIPTION, FOLDER_KINDS, MAX_SHARD, METADATA, Item, MindiePlan,
                                         Ranks, check_ranks, make, regions)

TORCH_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
# safetensors' Dtype enum order: its serializer sorts tensors by dtype (descending), then name
# (safetensors tensor.rs::prepare), which is how MindIE's save_file lays each folder's file out
ST_DTYPE_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64",
                  "I64", "U64")


def build_plan(src: Any, layout: Any, mtp: bool = False) -> MindiePlan:
    """Every folder's items for the layout (headers only). DeepSeek's model code only (the layout's documented scope:
    DeepSeek-V3/R1, and Kimi-K2, which MindIE runs with the same code).

    One deliberate difference: MindIE's get_module_save_dir sends `mlp` tensors of layers > 2 to the moe folder
    (hard-coded for first_k_dense_replace = 3). dsconv routes by the model's own dense/MoE layers, which is the
    same for V3/R1; for smaller models the hard-coded rule would make ranks of different EP ranks write different
    experts into one dense folder. The loader reads the union of a rank's five folders, so it loads either way."""
    if "mindie" not in src.family.offline_sharded:
        raise UserError(f"MindIE's offline-sharded layout exists for DeepSeek's model code only (DeepSeek-V3/R1, "
                        f"Kimi-K2), not {src.facts.model_type}",
                        hint="MindIE shards this family at load time: drop --format mindie (plan and cluster files "
                             "only), or --format ranks for per-rank copies")
    rk = Ranks(world=layout.world, tp=layout.tp, moe_tp=layout.moe_tp, moe_ep=layout.ep)
    check_ranks(rk)
    if mtp and not src.facts.num_mtp_layers:
        raise UserError(f"{src.root}: --mtp, but the checkpoint has no MTP layer (tensors of layer "
                        f"{src.facts.num_layers})", hint="drop --mtp")
    pl = Planner(src, rk, mtp=mtp)
    folders: dict[str, list[Item]] = {}
    rank_folders = [rk.folders(r) for r in range(rk.world)]
    for r, fo in enumerate(rank_folders):
        a = rk.attn_tp(r)
        build = {"moe": lambda: pl.moe(rk.moe_tp_rank(r), rk.moe_ep_rank(r)), "dense": lambda: pl.dense(a),
                 "attn": lambda: pl.attn(a), "model": lambda: pl.model(r), "norm": pl.norm}
        for kind in FOLDER_KINDS:
            if fo[kind] not in folders:
                folders[fo[kind]] = sorted(build[kind](), key=lambda it: (-ST_DTYPE_ORDER.index(it.dtype), it.name))
                if not folders[fo[kind]]:
                    raise UserError(f"{fo[kind]} would be empty: MindIE's loader needs every rank folder to hold "
                                    "a safetensors file (weights.py::Weights.__init__)")
    placed = {it.name for items in folders.values() for it in items}
    dropped = {n: ("the MTP layer's copy of the main embedding / head: MindIE runs the main one" if mtp else
                   "MTP layer (placed with --mtp: MindIE builds it with num_speculative_tokens > 0)")
               for n, r in src.roles.items() if (r.layer or 0) >= src.facts.num_layers and n not in placed
               and not r.is_aux}
    dropped.update({n: "FP8 scale (weights are dequantized)" for n in src.fp8_scales.values()})
    plan = MindiePlan(rk, folders, rank_folders, None, dropped, mtp=mtp)
    plan.description = description(src, plan) if src.quant_description else None
    return plan


def description(src: Any, plan: MindiePlan) -> dict[str, Any]:
    """flash_causal_deepseekv2.py::generate_description: model_quant_type, version, every dumped tensor with its
    linear's type (FLOAT for float linears; the global type for tensors without a linear parent), then MindIE's
    QuantizationConfig fields."""
    q = src.quant_description
    mqt = (src.config.get("quantize") or q.get("model_quant_type", "FLOAT")).upper()
    out: dict[str, Any] = {"model_quant_type": mqt, "version": q.get("version", "0.0.0")}
    for _, it in plan.items():
        out.setdefault(it.name, it.qtype or mqt)
    out.update({"group_size": int(q.get("group_size", 0) or 0), "kv_quant_type": q.get("kv_quant_type"),
                "fa_quant_type": q.get("fa_quant_type"), "reduce_quant_type": q.get("reduce_quant_type")})
    return out


class CachedLoader:
    """src.load with a small LRU (fused and stacked tensors read the same source several times), bounded by count and
    by bytes (the newest tensor always stays, however big)."""

    def __init__(self, src: Any, size: int = 16, budget: int = 2**30) -> None:
        self.src, self.size, self.budget, self.cache = src, size, budget, OrderedDict()
        self.held = 0

    def __call__(self, name: str):
        t = self.cache.pop(name, None)
        if t is None:
            t = self.src.load(name, dequantize=True)
            self.held += t.numel() * t.element_size()
        self.cache[name] = t
        while len(self.cache) > 1 and (len(self.cache) > self.size or self.held > self.budget):
            _, old = self.cache.popitem(last=False)
            self.held -= old.numel() * old.element_size()
        return t


@dataclass(frozen=True)
class FolderJob:
    """One part of one folder: its items and the byte ranges of every source tensor they read."""

    folder: str
    index: int
    part: PartLayout
    items: tuple[Item, ...]
    infos: dict[str, Any]    # source name -> TensorInfo (FP8 scales included)
    scales: dict[str, str]   # FP8 weight -> its scale
    block: tuple[int, int]


class _PathLoad(CachedLoader):
    """CachedLoader by byte ranges (a task's: no checkpoint object), FP8 dequantized like Checkpoint.load."""

    def __init__(self, job: FolderJob) -> None:
        from dsconv.io.tensorfile import TensorReader

        self.job, self.reader = job, TensorReader()
        super().__init__(self)

    def load(self, name: str, dequantize: bool = True):
        from dsconv.io.tensorfile import dequant_fp8_block

        t = self.reader.read(self.job.infos[name])
        scale = self.job.scales.get(name)
        return t if scale is None else dequant_fp8_block(t, self.reader.read(self.job.infos[scale]), self.job.block)


def folder_part(job: FolderJob) -> str | None:
    """Write one folder part's tensors by path; its digest. Tensors whose values MindIE leaves alone (most of the
    bytes: experts, row and column slices, the padded embedding) are copied from the source's byte ranges in the
    kernel; the rest are made (cast, transposed, dequantized, ...) and written."""
    load = _PathLoad(job)
    out = PartWriter(job.part)
    try:
        for it in job.items:
            dequantized = any(q.src in job.scales for g in it.groups for q in g)
            rg = None if dequantized else regions(it, job.infos)
            if rg is None:
                out.write(it.name, make(it, load))
            else:
                out.write_regions(it.name, rg)
        return out.close()
    except BaseException:
        out.abort()
        raise
    finally:
        load.reader.close()


def _folder_jobs(src: Any, folder: str, items: list[Item], ts: Any) -> list[FolderJob]:
    by_name = {it.name: it for it in items}
    jobs = []
    for i, part in enumerate(ts.layout()):
        chosen = tuple(by_name[s.name] for s in part.slots)
        names = {p.src for it in chosen for g in it.groups for p in g}
        scales = {n: src.fp8_scales[n] for n in names if n in src.fp8_scales}
        infos = {n: src.info(n) for n in (*names, *scales.values())}
        jobs.append(FolderJob(folder, i, part, chosen, infos, scales, tuple(src.facts.fp8_block or (128, 128))))
    return jobs


def write(src: Any, plan: MindiePlan, output: Path, *, head: dict[str, Any], files: dict[str, Any], force: bool,
          options: dict[str, Any], progress: bool | None = None, executor: Executor | None = None) -> dict[str, Any]:
    """Every folder (its parts as jobs through the executor when the source is readable by path), then the
    metadata, description, config and the small files."""
    from tqdm import tqdm

    from dsconv.io.writer import OutputDir
    from dsconv.tensors import TensorSpec

    load = CachedLoader(src)
    ex = executor or Executor(1)
    total = sum(TensorSpec(it.name, it.dtype, it.shape).nbytes for _, it in plan.items())
    listing: dict[str, list[str]] = {}
    with OutputDir(output, stage="shard", inputs=[src.root], force=force, options=options,
                   input_identity=src.identity()) as out:
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="shard (mindie)", file=sys.stderr,
                   disable=not (sys.stderr.isatty() if progress is None else progress))
        jobs, sets = [], {}
        for folder, items in plan.folders.items():
            specs = [TensorSpec(it.name, it.dtype, it.shape) for it in items]
            # MindIE writes no index inside the folders; ours (only for > 10 GB) is hidden, which its loader skips
            ts = out.tensor_set(specs, prefix="model", subdir=folder, max_shard_size=MAX_SHARD,
                                index_name=".model.safetensors.index.json")
            sets[folder] = ts
            if getattr(src, "readable_by_path", False):
                jobs += _folder_jobs(src, folder, items, ts)
            else:
                for it, spec in zip(items, specs):
                    ts.write(it.name, make(it, load))
                    bar.update(spec.nbytes)
            listing[folder] = list(ts.files)
        for job, digest in zip(jobs, ex.map(folder_part, jobs, work_bytes=total)):
            sets[job.folder].adopt(job.index, [it.name for it in job.items], digest)
            bar.update(job.part.size - job.part.header)
        bar.close()
        if plan.description is not None:
            out.write_json(DESCRIPTION, plan.description)
        rk = plan.ranks
        meta = {"world_size": rk.world, "parallel_option": {"dp": rk.dp, "tp": rk.tp, "moe_tp": rk.moe_tp,
                                                            "moe_ep": rk.moe_ep},
                "model_sharded": {".": [DESCRIPTION] if plan.description is not None else [],
                                  **{f: sorted(v) for f, v in sorted(listing.items())}}}
        out.write_text(METADATA, json.dumps(meta, indent=4) + "\n")
        # convert_utils.py::modify_config rewrites only torch_dtype; the keys transformers 5 renamed go back too
        cfg = src.family.engine_config(dict(src.config))
        cfg["torch_dtype"] = TORCH_DTYPE_NAMES[Planner(src, rk).model_dtype]
        out.write_text("config.json", json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
        for f in sorted(Path(src.root).iterdir()):  # convert_utils.py::copy_tokenizer_files
            if f.is_file() and any(m in f.name for m in COPY_MARKS):
                out.copy_in(f)
        doc = {**head, "format": "mindie", **({"mtp": True} if plan.mtp else {}),
               "folders": {f: len(v) for f, v in plan.folders.items()},
               "rank_folders": plan.rank_folders, "dropped": plan.dropped}
        out.write_text("plan.json", json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        for rel, obj in files.items():
            out.write_json(rel, obj)
    return {"output": str(Path(output).absolute()), "ranks": rk.world, "bytes_written": total,
            "folders": len(plan.folders), "format": "mindie", "execution": ex.summary()}
