"""MindIE's offline-sharded DeepSeek-V3/R1 layout, written without NPUs.

MindIE's own sharder (`examples.convert.weight_sharder`) loads the model on every NPU and dumps each rank's module
state, so the files hold MindIE's *processed* tensors: k_b/v_b split from kv_b_proj, gate/up fused, routed experts
stacked, rope rows permuted, dynamic-quant offsets negated, router rows rotated, an embedding pad row. This module
re-applies those transforms offline. Each output tensor is an `Item`: which source rows/columns it takes and which
transforms follow, so the writer streams one output tensor at a time and `verify` can invert every exact transform
to reassemble the source tensors bit for bit (the lossy ones - casts to a narrower float, the min-shifted
correction bias - are checked by recomputing them). Rules and sources: docs/engine_rules.md A.1-A.5; each
function's docstring names the MindIE code it mirrors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from dsconv.errors import UserError
from dsconv.parts import Region
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
@dataclass
class Part:
    src: str
    shape: tuple[int, ...]                # shape of the selection
    rows: np.ndarray | None = None        # dim-0 index into the source (None: all)
    cols: tuple[int, int] | None = None   # dim-1 range (None: all)


@dataclass
class Item:
    """One dumped tensor: cat(parts) per group along dim 0 (stacked over groups when `stacked`), then pad / reshape /
    transpose / shift / negate / zero, then cast to `dtype`."""

    name: str
    dtype: str
    groups: list[list[Part]]
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

    if p.rows is not None:
        t = t.index_select(0, torch.as_tensor(p.rows, dtype=torch.long))
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
            rows = np.arange(info.shape[0]) if p.rows is None else np.asarray(p.rows)
            # runs of consecutive source rows: one region each
            cuts = np.flatnonzero(np.diff(rows) != 1) + 1
            for run in np.split(rows, cuts):
                if len(run):
                    out.append(Region(str(info.file), info.start + int(run[0]) * row + c0 * inner, width,
                                      len(run), row))
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

    def items(self) -> Iterator[tuple[str, Item]]:
        for f, items in self.folders.items():
            for it in items:
                yield f, it
# ------------------------------------------------------------------------------------------------ dtypes
def target_dtype(param: str, src_dtype: str, qtype: str, model_dtype: str) -> str:
    """weights.py::Weights.correct_tensor_dtype + the quant modules: floats to the model dtype, except deq_scale
    (kept float32 for bf16 models) and, for fp16 models, W8A8_DYNAMIC weight_scale (float32); input_offset int8
    (w8a8.py::W8A8LinearStatic); integers kept."""
    if param == "input_offset":
        return "I8"
    if src_dtype not in ("F32", "BF16", "F16"):
        return src_dtype
    if param == "deq_scale":
        return src_dtype if model_dtype == "BF16" else "I64"
    if param == "weight_scale" and qtype == "W8A8_DYNAMIC" and model_dtype != "BF16":
        return "F32"
    return model_dtype


PARAMS = {"FLOAT": ("weight",), "W8A8": ("weight", "input_scale", "input_offset", "deq_scale", "quant_bias"),
          "W8A8_DYNAMIC": ("weight", "weight_scale", "weight_offset"),
          "W8A16": ("weight", "weight_scale", "weight_offset")}
PER_TENSOR = ("input_scale", "input_offset")


def rope_rows(first: int, heads: int, nope: int, rope: int) -> np.ndarray:
    """process_mla_linear.py::trans_rope_weight: in each head's last `rope` rows, even rows first, then odd."""
    d = nope + rope
    idx = []
    for h in range(heads):
        b = first + h * d
        idx += list(range(b, b + nope)) + list(range(b + nope, b + d, 2)) + list(range(b + nope + 1, b + d, 2))
    return np.asarray(idx, np.int64)


class Planner:
    """The items of one folder kind for one sub-rank (headers only)."""

    def __init__(self, src: Any, rk: Ranks) -> None:
        self.src, self.rk = src, rk
        self.f = src.facts
        self.shapes = {n: tuple(i.shape) for n, i in src.tensors.items()}
        self.dtypes = {n: i.dtype for n, i in src.tensors.items()}
        self.desc = src.quant_description or {}
        self.model_dtype = self.f.dtype if self.f.dtype in ("BF16", "F16") else "BF16"

    def qtype(self, module: str) -> str:
        w = module + ".weight"
        if self.dtypes.get(w, "BF16") in ("BF16", "F16", "F32", "F8_E4M3"):
            return "FLOAT"
        t = self.desc.get(w, "FLOAT")
        if t not in SUPPORTED:
            raise UserError(f"{module} is {t}: MindIE's sharded layout is written for {', '.join(SUPPORTED)} only",
                            hint="quantize with --bits 8 (or w8a8_dynamic / w8a16), or shard with --format ranks")
        return t

    def _src_dtype(self, name: str) -> str:
        dt = self.dtypes[name]
        return self.model_dtype if dt.startswith("F8_") else dt  # FP8 weights are dequantized on load

    def _part(self, name: str, rows: np.ndarray | None = None, cols: tuple[int, int] | None = None) -> Part:
        shape = list(self.shapes[name])
        if rows is not None:
            shape[0] = len(rows)
        if cols is not None:
            shape[1] = cols[1] - cols[0]
        return Part(name, tuple(shape), rows, cols)

    def linear(self, out: str, groups: list[list[str]], cut: str, rank: int, size: int, *,
               perm: Callable[[str, np.ndarray], np.ndarray] | None = None, dense_module: bool = True) -> list[Item]:
        """One MindIE linear (`out`), from source modules fused along dim 0 per group (stacked when several groups).

        cut "col": TensorParallelColumnLinear (weights.py::get_multi_weights_col): dim-0 params cut, per-tensor
        params whole (fused parts share them: the first part's); "row": TensorParallelRowLinear
        (get_multi_weights_row): weight dim 1, per-channel scales whole, W8A8 deq_scale whole, quant_bias on rank 0
        and zeros elsewhere; "rep": TensorReplicatedLinear (get_replicated_weights): whole. `dense_module`: the
        W8A8_DYNAMIC module flattens weight_scale/weight_offset and negates the offset; W8A16 negates it
        (w8a8_dynamic.py::W8A8LinearDynamic, w8a16.py) - not applied to stacked experts (not pinned for MoE)."""
        qtypes = {self.qtype(m) for g in groups for m in g}
        if len(qtypes) > 1:
            raise UserError(f"{out}: its parts are {sorted(qtypes)}: MindIE fuses/stacks them into one module",
                            hint="quantize them alike")
        qtype = qtypes.pop()
        stacked = len(groups) > 1 or not dense_module
        items = []
        for param in PARAMS[qtype] + (("bias",) if f"{groups[0][0]}.bias" in self.shapes else ()):
            parts_g, zeros = [], False
            for g in groups:
                parts = []
                for m in (g[:1] if param in PER_TENSOR else g):
                    name = f"{m}.{param}"
                    n = self.shapes[name][0]
                    if param in PER_TENSOR or cut == "rep" and perm is None:
                        parts.append(self._part(name))
                    elif cut == "rep":
                        parts.append(self._part(name, perm(name, np.arange(n))))
                    elif cut == "col":
                        if n % size:
                            raise UserError(f"{name}: {n} rows do not split over {size} ranks",
                                            hint="choose a --tp / --ep that divides the heads and widths")
                        rows = np.arange(rank * n // size, (rank + 1) * n // size)
                        parts.append(self._part(name, perm(name, rows) if perm else rows))
                    elif param == "weight":
                        k = self.shapes[name][1]
                        if k % size:
                            raise UserError(f"{name}: {k} columns do not split over {size} ranks",
                                            hint="choose a --tp / --ep that divides the widths")
                        parts.append(self._part(name, cols=(rank * k // size, (rank + 1) * k // size)))
                    else:
                        parts.append(self._part(name))
                        zeros = param in ("quant_bias", "bias") and rank != 0
                parts_g.append(parts)
            src_dtype = self._src_dtype(parts_g[0][0].src)
            it = Item(f"{out}.{param}", target_dtype(param, src_dtype, qtype, self.model_dtype), parts_g, src_dtype,
                      stacked=stacked, zeros=zeros, qtype=qtype)
            if dense_module and param in ("weight_scale", "weight_offset") and qtype == "W8A8_DYNAMIC":
                it.reshape = (it.shape[0],)
            if dense_module and param == "weight_offset" and qtype in ("W8A8_DYNAMIC", "W8A16"):
                it.negate = True
            items.append(it)
        return items

    # ---- folders ---------------------------------------------------------------------------------------------
    def attn(self, a: int) -> list[Item]:
        """modeling_deepseekv2.py::FlashDeepseekV2Attention.__init__ (L146-200): q_a / kv_a replicated (kv_a rope rows
        permuted), q_b (or q_proj) column-parallel in heads with rope rows permuted, kv_b split into k_b / v_b, o_proj
        row-parallel, all over the attention TP group."""
        f, tp = self.f, self.rk.tp
        if f.num_heads % tp:
            raise UserError(f"{f.num_heads} attention heads do not split over tp {tp}", hint="choose a --tp dividing them")
        hl, nope, rope, v, lora = f.num_heads // tp, f.qk_nope_head_dim, f.qk_rope_head_dim, f.v_head_dim, f.kv_lora_rank
        items: list[Item] = []
        for L in self.layers():
            p = f"model.layers.{L}.self_attn."

            def q_perm(name: str, rows: np.ndarray) -> np.ndarray:
                return rope_rows(int(rows[0]), hl, nope, rope)

            def kv_a_perm(name: str, rows: np.ndarray) -> np.ndarray:
                return np.concatenate([np.arange(lora), lora + np.arange(0, rope, 2), lora + np.arange(1, rope, 2)])

            if p + "q_a_proj.weight" in self.shapes:
                items += self.linear(p + "q_a_proj", [[p + "q_a_proj"]], "rep", 0, 1)
                items += self.linear(p + "q_b_proj", [[p + "q_b_proj"]], "col", a, tp, perm=q_perm)
            else:
                items += self.linear(p + "q_proj", [[p + "q_proj"]], "col", a, tp, perm=q_perm)
            items += self.linear(p + "kv_a_proj_with_mqa", [[p + "kv_a_proj_with_mqa"]], "rep", 0, 1, perm=kv_a_perm)
            kv = p + "kv_b_proj"
            if self.qtype(kv) != "FLOAT":
                raise UserError(f"{kv} is quantized: MindIE reshapes only its weight into k_b/v_b "
                                "(process_mla_linear.py::preprocess_kv_weights)", hint="re-quantize: dsconv keeps it float")
            d = nope + v
            base = [a * hl * d + h * d for h in range(hl)]
            k_rows = np.concatenate([np.arange(b, b + nope) for b in base])
            v_rows = np.concatenate([np.arange(b + nope, b + d) for b in base])
            src_dt = self._src_dtype(kv + ".weight")
            items.append(Item(p + "k_b_proj.weight", self.model_dtype, [[self._part(kv + ".weight", k_rows)]], src_dt,
                              reshape=(hl, nope, lora), qtype="FLOAT"))
            items.append(Item(p + "v_b_proj.weight", self.model_dtype, [[self._part(kv + ".weight", v_rows)]], src_dt,
                              reshape=(hl, v, lora), transpose12=True, qtype="FLOAT"))
            items += self.linear(p + "o_proj", [[p + "o_proj"]], "row", a, tp)
        return items

    def layers(self) -> range:
        return range(self.f.num_layers)  # MTP only with DEEPSEEK_MTP=1 (weight_sharder.py L36-37): left out

    def dense(self, a: int) -> list[Item]:
        """modeling_deepseek.py::DeepseekMLP.__init__: gate_up_proj = [gate_r; up_r] column-parallel, down_proj
        row-parallel, over the attention TP group (dense_mlp_local_tp unset)."""
        items: list[Item] = []
        for L in self.layers():
            if L in self.f.moe_layers:
                continue
            p = f"model.layers.{L}.mlp."
            items += self.linear(p + "gate_up_proj", [[p + "gate_proj", p + "up_proj"]], "col", a, self.rk.tp)
            items += self.linear(p + "down_proj", [[p + "down_proj"]], "row", a, self.rk.tp)
        return items

    def moe(self, t: int, e: int) -> list[Item]:
        """modeling_deepseek.py::DeepseekMoE.__init__/init_experts: router (float32 weight; bias = correction bias
        - min, rows rotated to the EP rank's first expert with EP), shared experts over the MLP group (world; ep_level
        1), routed experts of this EP rank stacked ([E_local, 2I/moe_tp, H] gate_up, [E_local, H, I/moe_tp] down)."""
        rk, items = self.rk, []
        r = e * rk.moe_tp + t  # the one world rank of this folder
        for L in self.layers():
            if L not in self.f.moe_layers:
                continue
            p = f"model.layers.{L}.mlp."
            E = self.f.num_experts
            local = assign_experts(E, rk.moe_ep)[e]
            rows = np.arange(E)
            if rk.moe_ep > 1:
                rows = np.concatenate([np.arange(local.start, E), np.arange(0, local.start)])
            gw = p + "gate.weight"
            items.append(Item(p + "gate.weight", "F32", [[self._part(gw, rows)]], self._src_dtype(gw), qtype="FLOAT"))
            cb = p + "gate.e_score_correction_bias"
            if cb in self.shapes:
                items.append(Item(p + "gate.bias", self.model_dtype, [[self._part(cb, rows)]], self._src_dtype(cb),
                                  shift_min=True, qtype="FLOAT"))
            sh = p + "shared_experts."
            if sh + "gate_proj.weight" in self.shapes:
                items += self.linear(sh + "gate_up_proj", [[sh + "gate_proj", sh + "up_proj"]], "col", r, rk.world)
                items += self.linear(sh + "down_proj", [[sh + "down_proj"]], "row", r, rk.world)
            ex = [f"{p}experts.{i}." for i in local]
            items += self.linear(p + "gate_up_proj", [[x + "gate_proj", x + "up_proj"] for x in ex], "col", t, rk.moe_tp,
                                 dense_module=False)
            items += self.linear(p + "down_proj", [[x + "down_proj"] for x in ex], "row", t, rk.moe_tp,
                                 dense_module=False)
        return items

    def model(self, r: int) -> list[Item]:
        """model-{rank}: embed_tokens cut on dim 1 over the attention TP group plus a zero row
        (TensorParallelEmbedding; group UNCONFIRMED), lm_head vocab rows over the world (flash_causal_deepseekv2.py
        L234-252, load_column_multi lm_head=True)."""
        items = []
        emb = "model.embed_tokens.weight"
        tp, a = self.rk.tp, self.rk.attn_tp(r)
        V, H = self.shapes[emb]
        if H % tp:
            raise UserError(f"{emb}: hidden {H} does not split over tp {tp}")
        items.append(Item(emb, self.model_dtype, [[self._part(emb, cols=(a * H // tp, (a + 1) * H // tp))]],
                          self._src_dtype(emb), pad_row=True))
        if "lm_head.weight" in self.shapes:
            items += self.linear("lm_head", [["lm_head"]], "col", r, self.rk.world)
        return items

    def norm(self) -> list[Item]:
        """get_module_save_dir: every tensor whose name contains "norm" (incl. q_a/kv_a layernorms), cast to the model
        dtype. (The zero `.bias` MindIE adds to W8A8 layer norms is optional on load and not written.)"""
        out = []
        for n in self.src.names():
            r = self.src.role(n)
            if "norm" in n and r.layer is not None and r.layer >= self.f.num_layers:
                continue
            if "norm" in n:
                out.append(Item(n, self.model_dtype, [[self._part(n)]], self._src_dtype(n)))
        return out
