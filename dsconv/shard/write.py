"""Write a plan: one directory per rank of size-capped safetensors, streamed one source tensor at a time.

Each source tensor is read once (`Checkpoint.load`, mmap, pages dropped after), and every rank's slice of it is
written before the next is read, so peak memory is about one tensor plus one slice, whatever the world size. Rank
tensors keep their original names (sliced shapes); quantized inputs keep the msModelSlim file names and each rank
gets the quant description of its own tensors. `plan.json` records every tensor's shape and slice rule, which is what
`dsconv verify` uses to reassemble every original tensor from the ranks and compare it byte for byte to the source.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from dsconv.executor import Executor
from dsconv.io.parts import PartLayout, PartWriter, Region

from dsconv.shard.placement import is_first_holder, iter_tensor_ranks, slice_for_rank, tensor_entry
from dsconv.shard.plan import ShardPlan

SLICE_RULE = ("a rank holds tensor T when ranks is 'all' or lists it; mode 'whole': the full tensor; mode 'split': "
              "piece (rank % group) // rep of `parts` equal pieces along `dim`; mode 'first': the full tensor on "
              "ranks with (rank % group) // rep == 0 and zeros on the other holders (a row-parallel bias, added once "
              "by the all-reduce)")
PER_RANK_FILES = ("config.json", "generation_config.json")


def rank_dir(rank: int, world: int) -> str:
    return f"rank_{rank:0{max(2, len(str(world - 1)))}d}"


def write_shards(src: Any, plan: ShardPlan, output: Path, *, head: dict[str, Any], files: dict[str, Any],
                 force: bool = False, max_shard_size: int, options: dict[str, Any],
                 progress: bool | None = None, executor: Executor | None = None) -> dict[str, Any]:
    """Write every rank directory plus plan.json and the cluster files (`files`: relative name -> JSON object).

    Each (rank, part) is a job (`copy_part`) through the executor: whole tensors and row slices are byte ranges of
    the source copied in the kernel, column slices gathered in large blocks; pickled sources go tensor by tensor."""
    from tqdm import tqdm

    from dsconv.io.writer import OutputDir
    from dsconv.tensors import TensorSpec

    world = plan.layout.world
    quant = getattr(src, "quant_description", None)
    prefix = "quant_model_weights" if quant is not None else "model"
    entries: dict[str, dict[str, Any]] = {}
    specs: list[list[TensorSpec]] = [[] for _ in range(world)]
    placed = []
    for name, kind, p, ranks in iter_tensor_ranks(plan.table, plan.ev, plan.owners()):
        entries[name] = tensor_entry(kind, p, ranks, world)
        spec = TensorSpec(name, kind.dtype, p.slice_shape(kind.shape))
        for r in ranks:
            specs[r].append(spec)
        placed.append((name, p, ranks))
    total_out = sum(s.nbytes for rank in specs for s in rank)
    if progress is None:
        progress = sys.stderr.isatty()
    ex = executor or Executor(1)
    with OutputDir(output, stage="shard", inputs=[src.root], force=force, options=options,
                   input_identity=src.identity()) as out:
        sets = [out.tensor_set(specs[r], prefix=prefix, subdir=rank_dir(r, world), max_shard_size=max_shard_size)
                for r in range(world)]
        bar = tqdm(total=total_out, unit="B", unit_scale=True, desc="shard", disable=not progress, file=sys.stderr)
        try:
            if getattr(src, "readable_by_path", False):
                jobs = copy_jobs(src, placed, sets)
                for job, digest in zip(jobs, ex.map(copy_part, jobs, work_bytes=total_out)):
                    sets[job.rank].adopt(job.index, [c.name for c in job.copies], digest)
                    bar.update(job.part.size - job.part.header)
            else:
                _write_loaded(src, placed, sets, bar)
        finally:
            bar.close()
        for r in range(world):
            d = rank_dir(r, world)
            for f in PER_RANK_FILES:
                if (src.root / f).is_file():
                    out.copy_in(src.root / f, f"{d}/{f}")
            if quant is not None:
                held = {s.name for s in specs[r]}
                desc = {k: v for k, v in quant.items() if k in held or k not in src.tensors}
                out.write_json(f"{d}/quant_model_description.json", desc)
        for f in src.copy_files():
            out.copy_in(f)
        doc = {**head, "slice_rule": SLICE_RULE, "rank_dirs": [rank_dir(r, world) for r in range(world)],
               "tensors": entries}
        out.write_text("plan.json", json.dumps(doc, indent=1 if len(entries) < 10000 else None,
                                               ensure_ascii=False) + "\n")
        for rel, obj in files.items():
            out.write_json(rel, obj)
    return {"output": str(Path(output).absolute()), "ranks": world, "bytes_written": total_out,
            "files_per_rank": [len(ts.files) for ts in sets], "execution": ex.summary()}


def _write_loaded(src: Any, placed: list, sets: list, bar: Any) -> None:
    """Tensor by tensor through memory (sources a task cannot read by path: pickled weights)."""
    import torch

    for name, p, ranks in placed:
        t = src.load(name)
        zeros = None
        for r in ranks:
            if p.mode == "split":
                lo, hi = p.bounds(tuple(t.shape), r)
                piece = t.narrow(p.dim, lo, hi - lo)
            elif p.mode == "first" and p.piece(r) != 0:
                zeros = torch.zeros_like(t) if zeros is None else zeros
                piece = zeros
            else:
                piece = t
            sets[r].write(name, piece)
            bar.update(piece.numel() * piece.element_size())
        del t, zeros


@dataclass(frozen=True)
class Copy:
    """One rank tensor as bytes of the source (a zero region for the non-first holders of a 'first' tensor)."""

    name: str
    region: Region


@dataclass(frozen=True)
class CopyJob:
    rank: int
    index: int           # the part's index in the rank's set
    part: PartLayout
    copies: tuple[Copy, ...]


def copy_jobs(src: Any, placed: list, sets: list) -> list[CopyJob]:
    """One job per (rank, part): every slot's source bytes, from headers alone."""
    ops: list[dict[str, Copy]] = [{} for _ in sets]
    for name, p, ranks in placed:
        info = src.info(name)
        shape = tuple(info.shape)
        elem = info.nbytes // max(1, math.prod(shape))
        for r in ranks:
            if p.mode == "split":
                lo, hi = p.bounds(shape, r)
                inner = math.prod(shape[p.dim + 1:]) * elem
                c = Copy(name, Region(str(info.file), info.start + lo * inner, (hi - lo) * inner,
                                      math.prod(shape[:p.dim]), shape[p.dim] * inner))
            elif p.mode == "first" and p.piece(r) != 0:
                c = Copy(name, Region(None, 0, info.nbytes))
            else:
                c = Copy(name, Region(str(info.file), info.start, info.nbytes))
            ops[r][name] = c
    return [CopyJob(r, i, part, tuple(ops[r][s.name] for s in part.slots))
            for r, ts in enumerate(sets) for i, part in enumerate(ts.layout())]


def copy_part(job: CopyJob) -> str | None:
    """Fill one rank part by path; its digest."""
    out = PartWriter(job.part)
    try:
        for c in job.copies:
            out.write_regions(c.name, [c.region])
        return out.close()
    except BaseException:
        out.abort()
        raise


# ------------------------------------------------------------------------------------------------ verify
class _RankReader:
    """The tensors of one rank directory, through the foundation's header validation and tensor reader."""

    def __init__(self, directory: Path) -> None:
        from dsconv.io.tensorfile import TensorReader, read_tensor_infos

        self.dir = directory
        self.where = {}
        for f in sorted(directory.glob("*.safetensors")):
            self.where.update(read_tensor_infos(f))
        self._reader = TensorReader()

    def get(self, name: str):
        return self._reader.read(self.where[name])

    def close(self) -> None:
        self._reader.close()


def same_bytes(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if not a.numel():
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def open_source(manifest: dict[str, Any], checked: str) -> tuple[Any, list[str]]:
    """The checkpoint a shard output was made from, for `dsconv verify`: (None, []) and a warning saying what was
    still checked (`checked`) when it is gone; (None, [problem]) when its files changed size since; else (it, [])."""
    from dsconv.checkpoint import Checkpoint
    from dsconv.errors import warn

    inputs = manifest.get("inputs") or []
    source = Path(inputs[0]) if inputs else None
    if source is None or not source.is_dir():
        warn(f"the source {source} is gone: checked {checked}, not against the source")
        return None, []
    src = Checkpoint.open(source)
    sizes = {p.name: p.stat().st_size for p in src.files}
    if sizes != manifest.get("input_identity", {}).get("files", sizes):
        src.close()
        return None, [f"the source {source} changed since it was sharded (file sizes differ)"]
    return src, []


def verify_shard(directory: Path, manifest: dict[str, Any], plan: dict[str, Any]) -> list[str]:
    """Every rank holds exactly the plan's tensors, replicas agree, and each original tensor reassembles bit-exactly
    from the ranks (compared to the source when it is still there; said so when it is not). `plan`: plan.json as
    schemas.shard_plan validated it."""
    directory = Path(directory)
    world = plan["layout"]["world"]
    dirs = plan.get("rank_dirs") or [rank_dir(r, world) for r in range(world)]
    readers = [_RankReader(directory / d) for d in dirs]
    problems: list[str] = []
    expected: list[set[str]] = [set() for _ in range(world)]
    for name, e in plan["tensors"].items():
        for r in (range(world) if e["ranks"] == "all" else e["ranks"]):
            expected[r].add(name)
    for r, rd in enumerate(readers):
        extra, missing = set(rd.where) - expected[r], expected[r] - set(rd.where)
        if extra or missing:
            problems.append(f"{dirs[r]}: {len(missing)} planned tensors missing, {len(extra)} unplanned "
                            f"(e.g. {next(iter(missing or extra))})")
    src = None
    try:
        if problems:
            return problems
        src, changed = open_source(manifest, "the ranks against each other and the plan")
        if changed:
            return changed
        load = src.load if src is not None else None
        for name, e in plan["tensors"].items():
            bad = _check_tensor(name, e, world, readers, dirs, load, src)
            if bad:
                problems.append(bad)
                if len(problems) >= 50:
                    break
    finally:
        for rd in readers:
            rd.close()
        if src is not None:
            src.close()
    return problems


def _check_tensor(name: str, e: dict[str, Any], world: int, readers: list[_RankReader], dirs: list[str], load,
                  src: Any) -> str | None:
    """One tensor: replicas agree, non-first holders of a row-parallel bias are zero, every slice is there, and the
    slices are the source's bytes. Holds one rank copy per distinct slice plus the source tensor."""
    import torch

    ranks = list(range(world)) if e["ranks"] == "all" else e["ranks"]
    pieces: dict[int, Any] = {}
    for r in ranks:
        t = readers[r].get(name)
        if list(t.shape) != list(_slice_shape(e)):
            return f"{name}: {dirs[r]} holds shape {list(t.shape)}, the plan says {_slice_shape(e)}"
        if e["mode"] == "first" and not is_first_holder(e, r):
            if t.numel() and bool(torch.any(t.contiguous().reshape(-1).view(torch.uint8) != 0)):
                return f"{name}: {dirs[r]} should hold zeros (row-parallel bias lives on the first TP rank)"
            continue
        dim, lo, _ = slice_for_rank(e, r)
        key = lo if dim is not None else 0
        if key in pieces:
            if not same_bytes(pieces[key], t):
                return f"{name}: {dirs[r]}'s copy differs from the other ranks holding the same slice"
        else:
            pieces[key] = t
    if e["mode"] == "split" and len(pieces) != e["parts"]:
        return f"{name}: {len(pieces)} of its {e['parts']} slices are on the ranks"
    if src is None:
        return None
    if name not in src.tensors:
        return f"{name}: not in the source {src.root}"
    whole = load(name)
    if list(whole.shape) != e["shape"]:
        return f"{name}: the source has shape {list(whole.shape)}, the plan says {e['shape']}"
    for lo, piece in pieces.items():
        ref = whole.narrow(e["dim"], lo, piece.shape[e["dim"]]) if e["mode"] == "split" else whole
        if not same_bytes(piece, ref):
            return f"{name}: reassembled tensor differs from the source"
    return None


def _slice_shape(e: dict[str, Any]) -> list[int]:
    shape = list(e["shape"])
    if e["mode"] == "split":
        shape[e["dim"]] //= e["parts"]
    return shape
