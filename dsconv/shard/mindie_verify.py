"""`dsconv verify` of MindIE's offline-sharded DeepSeek layout, one dumped tensor at a time.

It checks what MindIE's loader checks (the metadata file; five folders per rank, each with safetensors; no name twice
among a rank's folders), then re-plans from the source and, for every dumped tensor, compares its bytes with MindIE's
transform of the source (`make`) and inverts every exact transform to compare each piece with the source rows and
columns it claims to hold. Coverage (every element of every source tensor in some folder) is tracked per row and
column segment, so memory is one dumped tensor and its sources, not the model: a DeepSeek-R1 layout verifies on a host
with far less RAM than 1.3 TB.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from dsconv.shard.mindie_sharded import FOLDER_KINDS, METADATA, Part, invert, make, row_index, select
from dsconv.shard.mindie_write import CachedLoader, build_plan


def loader_problems(directory: Path, rank_folders: list[dict[str, str]]) -> list[str]:
    """What MindIE's loader checks before reading a tensor (atb/utils/weights.py::Weights.__init__ L76-92,
    ::load_routing L148-165): the metadata file exists; each rank's five folders exist and hold safetensors; no name
    in two of a rank's files."""
    from dsconv.io.tensorfile import read_tensor_infos

    problems = []
    if not (directory / METADATA).is_file():
        problems.append(f"{METADATA} is missing: MindIE would load the directory as unsharded")
    names: dict[str, set[str]] = {}
    for folder in sorted({f for fo in rank_folders for f in fo.values()}):
        files = sorted(p for p in (directory / folder).glob("*.safetensors") if not p.name.startswith("."))
        if not files:
            problems.append(f"{folder}: no safetensors ('No local weights found')")
        names[folder] = set()
        for f in files:
            names[folder].update(read_tensor_infos(f))
    for r, fo in enumerate(rank_folders):
        seen: dict[str, str] = {}
        for kind in FOLDER_KINDS:
            for n in names.get(fo[kind], ()):
                if n in seen:
                    problems.append(f"rank {r}: {n} in {seen[n]} and {fo[kind]} ('routing weight key error')")
                seen[n] = fo[kind]
    return problems


def uncovered(shape: tuple[int, ...], parts: list[Part]) -> int:
    """How many elements of a source tensor of `shape` none of `parts` (row index sets x column ranges) holds,
    counted on a [rows, column segments] mask: a few bytes per row, not per element."""
    rows = shape[0] if shape else 1
    width = shape[1] if len(shape) > 1 else 1
    cuts = sorted({0, width, *(c for p in parts if p.cols for c in p.cols)})
    seg = np.diff(cuts) * (int(np.prod(shape[2:])) if len(shape) > 2 else 1)
    mask = np.zeros((rows, len(seg)), dtype=bool)
    for p in parts:
        c0, c1 = p.cols or (0, width)
        cols = slice(cuts.index(c0), cuts.index(c1))
        mask[slice(None) if p.rows is None else row_index(p.rows), cols] = True
    return int((~mask * seg).sum())


def verify(directory: Path, manifest: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    """The problems of a MindIE-layout output (`doc`: its plan.json); [] when it is what MindIE's sharder would write
    from the source (or, with the source gone, when the loader's rules hold: then a warning says so)."""
    from dsconv.shard.layout import make_layout
    from dsconv.shard.write import open_source

    problems = loader_problems(directory, doc["rank_folders"])
    if problems:
        return problems
    src, changed = open_source(manifest, "MindIE's loader rules and the manifest's hashes")
    if src is None:
        return changed
    try:
        lay = doc["layout"]
        plan = build_plan(src, make_layout(lay["ep"], lay["tp"], lay["world"], lay["nodes"], lay["cards_per_node"]),
                          mtp=bool(doc.get("mtp")))
        return _check_folders(directory, src, plan)[:50]
    finally:
        src.close()


def _check_folders(directory: Path, src: Any, plan: Any) -> list[str]:
    from dsconv.io.tensorfile import TensorReader, read_tensor_infos
    from dsconv.shard.write import same_bytes

    load = CachedLoader(src)
    held: dict[str, list[Part]] = defaultdict(list)  # source tensor -> the pieces the layout holds of it
    lossy: set[str] = set()
    problems: list[str] = []
    for folder, items in plan.folders.items():
        where = {}
        for f in sorted((directory / folder).glob("*.safetensors")):
            where.update(read_tensor_infos(f))
        planned = {it.name for it in items}
        if set(where) != planned:
            problems.append(f"{folder}: {len(planned - set(where))} planned tensors missing, "
                            f"{len(set(where) - planned)} unplanned")
            continue
        reader = TensorReader()  # one per folder: its files are unmapped when the folder is done
        try:
            for it in items:
                stored = reader.read(where[it.name])
                # the item's sources, held while it is checked (a stacked item reads each expert for make and again
                # for its pieces): memory is one dumped tensor and its sources
                srcs = {n: load(n) for n in dict.fromkeys(p.src for g in it.groups for p in g)}
                if not same_bytes(stored, make(it, srcs.__getitem__)):
                    problems.append(f"{folder}/{it.name}: differs from MindIE's transform of the source")
                    continue
                pieces = invert(it, stored)
                if not pieces:
                    lossy.update(p.src for g in it.groups for p in g)
                for part, vals in pieces:
                    want = select(srcs[part.src], part).contiguous()
                    if not same_bytes(want, vals.reshape(want.shape).contiguous()):
                        problems.append(f"{part.src}: {folder}/{it.name} does not give back its rows of the source")
                    held[part.src].append(part)
        finally:
            reader.close()
        if len(problems) >= 50:
            return problems
    if problems:
        return problems
    for name in src.names():
        if name in plan.dropped:
            continue
        if name in held:
            missing = uncovered(tuple(src.info(name).shape), held[name])
            if missing:
                problems.append(f"{name}: {missing} elements are in no folder")
        elif name not in lossy:
            problems.append(f"{name}: not in the layout")
    return problems
