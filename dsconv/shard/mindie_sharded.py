"""MindIE's offline-sharded DeepSeek-V3/R1 layout, written without NPUs.

MindIE's own sharder (`examples.convert.weight_sharder`) loads the model on every NPU and dumps each rank's module
state, so the files hold MindIE's *processed* tensors: k_b/v_b split from kv_b_proj, gate/up fused, routed experts
stacked, rope rows permuted, dynamic-quant offsets negated, an embedding pad row. This module
re-applies those transforms offline. Each output tensor is an `Item`: which source rows/columns it takes and which
transforms follow, so the writer streams one output tensor at a time and `verify` can invert every exact transform
to reassemble the source tensors bit for bit (the lossy ones - casts to a narrower float, the min-shifted
correction bias - are checked by recomputing them). Which items each rank folder holds is mindie_planner.py. Rules
and sources: docs/engine_rules.md A.1-A.5; each function's docstring names the MindIE code it mirrors.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from dsconv.errors import UserError
from dsconv.io.parts import Region
from dsconv.tensors import DTYPE_SIZES

FOLDER_KINDS = ("moe", "dense", "attn", "model", "norm")  # the loader's order (weights.py::Weights.__init__)
METADATA = "model_sharded_metadata.json"
DESCRIPTION = "quant_model_description.json"
MAX_SHARD = 10 * 10**9  # BaseModel.save_state_dict: shard_checkpoint(max_shard_size="10GB")
COPY_MARKS = ("tokenizer", "tokenization", "special_token_map", "generation", "configuration")  # copy_tokenizer_files
SUPPORTED = ("FLOAT", "W8A8", "W8A8_DYNAMIC", "W8A16")
MIN_RUN = 256 * 2**10  # mean bytes per region of permuted rows below which `make` gathers them instead
# casts that lose information (checked by recomputation, not inverted): narrower floats, and a float input_offset
# cast to int8 (w8a8.py::W8A8LinearStatic), which drops the sign of a -0.0 offset
NARROWING = {("F32", "BF16"), ("F32", "F16"), ("BF16", "F16"), ("F16", "BF16"), ("F32", "I8"), ("BF16", "I8"),
             ("F16", "I8")}


# ------------------------------------------------------------------------------------------------ ranks
@dataclass(frozen=True)
class Ranks:
    """Sub-ranks of a world rank (atb/utils/mapping.py::Mapping.get_tp_group / get_dp_group): tp-type groups are
    contiguous (rank % g), dp-type strided (rank // (W / g))."""

    world: int
    tp: int      # attention TP
    moe_tp: int
    moe_ep: int

    @property
    def dp(self) -> int:
        return self.world // self.tp

    def attn_tp(self, r: int) -> int:
        return r % self.tp

    def moe_tp_rank(self, r: int) -> int:
        return r % self.moe_tp

    def moe_ep_rank(self, r: int) -> int:
        return r // self.moe_tp

    def folders(self, r: int) -> dict[str, str]:
        """BaseModel.save_sharded: the five folders of rank r (str(x).zfill(3)); the dense folder uses the attn_tp
        rank."""
        a, t, e = self.attn_tp(r), self.moe_tp_rank(r), self.moe_ep_rank(r)
        return {"moe": f"model-moe-tp-{t:03d}-ep-{e:03d}", "dense": f"model-dense-tp-{a:03d}",
                "attn": f"model-attn-tp-{a:03d}", "model": f"model-{r:03d}", "norm": "model-norm"}


def check_ranks(rk: Ranks) -> None:
    """atb/utils/mapping.py::Mapping.validate: tp x dp == W; moe_ep x moe_tp == W (or moe_tp == W)."""
    if rk.world % rk.tp or rk.moe_tp * rk.moe_ep != rk.world:
        raise UserError(f"MindIE needs tp x dp == world and moe_ep x moe_tp == world (tp {rk.tp}, moe_tp "
                        f"{rk.moe_tp}, moe_ep {rk.moe_ep}, world {rk.world})")


def assign_experts(n: int, ep: int) -> list[range]:
    """atb/utils/moe_utils.py::assign: contiguous blocks of ceil(n / ep), the last EP rank gets the remainder."""
    per = -(-n // ep)
    return [range(min(n, i * per), min(n, (i + 1) * per)) for i in range(ep)]


# ------------------------------------------------------------------------------------------------ items
@dataclass(slots=True)
class Part:
    src: str
    shape: tuple[int, ...]                # shape of the selection
    # dim-0 index into the source (None: all). A range for a contiguous slice, as most are (TP cuts of 2,048 rows
    # per expert): a plan of the full DeepSeek-V3 has 189k parts, and an index array each was 0.7 GB and 1.5 s
    rows: np.ndarray | range | None = None
    cols: tuple[int, int] | None = None   # dim-1 range (None: all)


def row_index(rows: np.ndarray | range) -> np.ndarray | slice:
    """A part's rows as a numpy index: a slice for a range (no index array), else the array itself."""
    if isinstance(rows, range):
        return slice(rows.start, rows.stop, rows.step)
    return np.asarray(rows)


class LazyGroups(Sequence):
    """An Item's groups, built on first use by `build()`; its length is known before. A dry run never builds them
    (the plan is made for its checks), a write builds each folder's when it plans the folder's parts. Pickles and
    compares as the list it stands for."""

    __slots__ = ("_build", "_n", "_groups")

    def __init__(self, build: Callable[[], list[list[Part]]], n: int) -> None:
        self._build, self._n, self._groups = build, n, None

    def _get(self) -> list[list[Part]]:
        if self._groups is None:
            self._groups = self._build()
            self._build = None
        return self._groups

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        return self._get()[i]

    def __iter__(self):
        return iter(self._get())

    def __eq__(self, other: object) -> bool:
        return list(self) == (list(other) if isinstance(other, (list, LazyGroups)) else other)

    def __reduce__(self):
        return list, (self._get(),)

    def __repr__(self) -> str:
        return repr(self._get())


@dataclass
class Item:
    """One dumped tensor: cat(parts) per group along dim 0 (stacked over groups when `stacked`), then pad / reshape /
    transpose / shift / negate / zero, then cast to `dtype`."""

    name: str
    dtype: str
    groups: list[list[Part]] | LazyGroups
    src_dtype: str
    stacked: bool = False
    pad_row: bool = False
    reshape: tuple[int, ...] | None = None
    transpose12: bool = False
    negate: bool = False
    shift_min: bool = False
    zeros: bool = False
    qtype: str | None = None  # the owning linear's type for the description (None: no linear parent)

    @property
    def exact(self) -> bool:
        """Whether the source bytes can be recovered from the dumped tensor."""
        return not (self.shift_min or self.zeros or (self.src_dtype, self.dtype) in NARROWING)

    @property
    def shape(self) -> tuple[int, ...]:
        g = self.groups[0]
        shape = (sum(p.shape[0] for p in g),) + tuple(g[0].shape[1:])
        if self.pad_row:
            shape = (shape[0] + 1,) + shape[1:]
        if self.stacked:
            shape = (len(self.groups),) + shape
        if self.reshape is not None:
            shape = self.reshape
        if self.transpose12:
            shape = (shape[0], shape[2], shape[1])
        return tuple(shape)


def select(t, p: Part):
    """A part's rows and columns of its source tensor."""
    import torch

    if isinstance(p.rows, range) and p.rows.step == 1:
        t = t.narrow(0, p.rows.start, len(p.rows))
    elif p.rows is not None:
        t = t.index_select(0, torch.as_tensor(np.asarray(p.rows), dtype=torch.long))
    if p.cols is not None:
        t = t.narrow(1, p.cols[0], p.cols[1] - p.cols[0])
    return t


def make(item: Item, load: Callable[[str], Any]):
    """The dumped tensor, from the source tensors (`load(name)`)."""
    import torch

    from dsconv.tensors import torch_dtype

    gs = [torch.cat([select(load(p.src), p) for p in g], 0) for g in item.groups]
    if item.pad_row:  # tensor_embedding.py::TensorParallelEmbedding: F.pad(weight, (0, 0, 0, 1))
        gs = [torch.nn.functional.pad(t, (0, 0, 0, 1)) for t in gs]
    t = torch.stack(gs) if item.stacked else gs[0]
    if item.reshape is not None:
        t = t.reshape(item.reshape)
    if item.transpose12:
        t = t.transpose(1, 2)
    if item.shift_min:  # weights.py::correct_tensor_dtype: e_score_correction_bias - min
        t = t.float()
        t = t - t.min()
    if item.negate:  # w8a8_dynamic.py / w8a16.py: weight_offset stored negated
        t = -t
    if item.zeros:
        t = torch.zeros_like(t)
    return t.to(torch_dtype(item.dtype)).contiguous()


def invert(item: Item, stored) -> list[tuple[Part, Any]]:
    """(part, its selection of the source, in the source dtype) for an exact item; [] for a lossy one."""
    from dsconv.tensors import torch_dtype

    if not item.exact:
        return []
    t = stored.to(torch_dtype(item.src_dtype))
    if item.negate:
        t = -t
    if item.transpose12:
        t = t.transpose(1, 2)
    out = []
    for gi, g in enumerate(item.groups):
        rows = sum(p.shape[0] for p in g)
        gt = (t.reshape((len(item.groups), -1))[gi] if item.stacked else t)
        gt = gt.reshape((rows + int(item.pad_row),) + tuple(g[0].shape[1:]))
        if item.pad_row:
            gt = gt[:-1]
        at = 0
        for p in g:
            out.append((p, gt[at:at + p.shape[0]]))
            at += p.shape[0]
    return out


def regions(item: Item, infos: dict[str, Any]) -> list[Region] | None:
    """The dumped tensor as byte regions of its (unquantized) sources, when no transform touches the values: the
    source bytes in order (row runs, column slices), a zero row per group for the embedding pad; None when `make`
    must compute it (a cast, transpose, negation, shift or dequantization). `infos`: source name -> TensorInfo."""
    if item.transpose12 or item.negate or item.shift_min or item.zeros or item.dtype != item.src_dtype:
        return None
    out: list[Region] = []
    for g in item.groups:
        for p in g:
            info = infos.get(p.src)
            if info is None or info.dtype != item.dtype or not info.shape:
                return None
            row = info.nbytes // max(1, info.shape[0])
            inner = row // max(1, info.shape[1]) if len(info.shape) > 1 else row
            c0, c1 = p.cols or (0, info.shape[1] if len(info.shape) > 1 else 1)
            width = (c1 - c0) * inner
            rows = range(info.shape[0]) if p.rows is None else p.rows
            if isinstance(rows, range) and rows.step == 1:
                runs = [(rows.start, len(rows))] if len(rows) else []
            else:  # runs of consecutive source rows: one region each
                rows = np.asarray(rows)
                cuts = np.flatnonzero(np.diff(rows) != 1) + 1
                runs = [(int(run[0]), len(run)) for run in np.split(rows, cuts) if len(run)]
            for first, n in runs:
                out.append(Region(str(info.file), info.start + first * row + c0 * inner, width, n, row))
        if item.pad_row:
            out.append(Region(None, 0, math.prod(g[0].shape[1:]) * DTYPE_SIZES[item.dtype]))
    # permuted rows (the rope rows) come in runs of a row or two: one gather in memory beats a syscall per run
    permuted = len(out) > sum(len(g) + int(item.pad_row) for g in item.groups)
    return None if permuted and sum(r.nbytes for r in out) < MIN_RUN * len(out) else out


# ------------------------------------------------------------------------------------------------ the plan
@dataclass
class MindiePlan:
    ranks: Ranks
    folders: dict[str, list[Item]]           # folder -> items (each folder written once)
    rank_folders: list[dict[str, str]]       # world rank -> kind -> folder
    description: dict[str, Any] | None
    dropped: dict[str, str] = field(default_factory=dict)  # source tensor -> why it is not in the layout
    mtp: bool = False                                       # the MTP layer placed (`shard --mtp`)

    def items(self) -> Iterator[tuple[str, Item]]:
        for f, items in self.folders.items():
            for it in items:
                yield f, it


# ------------------------------------------------------------------------------------------------ rope rows
def rope_rows(first: int, heads: int, nope: int, rope: int) -> np.ndarray:
    """process_mla_linear.py::trans_rope_weight: in each head's last `rope` rows, even rows first, then odd."""
    d = nope + rope
    base = first + d * np.arange(heads, dtype=np.int64)[:, None]  # one row of indices per head
    return np.concatenate([base + np.arange(nope), base + nope + np.arange(0, rope, 2),
                           base + nope + np.arange(1, rope, 2)], axis=1).reshape(-1)
