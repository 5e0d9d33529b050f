"""The MindIE offline-sharded plan of DeepSeek-V3/R1: which source rows and columns each dumped tensor of each rank
folder takes (`Planner`, headers only), and the dtype MindIE gives it. The items and their byte regions are
mindie_sharded.py; the writer is mindie_write.py.

A plan of the full DeepSeek-V3 at --ep 8 --tp 4 has 189k parts, mostly routed experts: their checks are made when the
plan is made (a dry run needs them), the parts themselves built when a write asks for them (LazyGroups).
"""
from __future__ import annotations

from functools import partial
from itertools import chain
from typing import Any, Callable

import numpy as np

from dsconv.errors import UserError
from dsconv.shard.mindie_sharded import SUPPORTED, Item, LazyGroups, Part, Ranks, assign_experts, rope_rows


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


# Why W4A8 has no offline-sharded form here: MindIE's weight_sharder dumps the loader's buffers after NPU ops
# (npu_trans_quant_param on the scales, the MoE bias summed from scale_bias), which a CPU host cannot reproduce bit
# for bit without re-deriving those kernels; the load-time path reads msModelSlim's files as written.
W4A8_WHY = (": its W4A8 buffers are dumped after NPU transforms (npu_trans_quant_param, scale_bias summed into the MoE "
            "bias; MindIE-LLM atb/utils/quantize/w4a8.py::W4A8LinearDynamic) that a CPU host does not reproduce")


# Why an int8 latent cache (FA quant) has no offline-sharded form here: MindIE's pre-sharded path reads derived
# buffers, `<attn>.fa3.{q_scale,k_scale,qk_scale,fa3_v_scale,kv_offset}` (the inverted query scale, the products of
# query and latent scales per head), not the msModelSlim tensors; copying fa_q/fa_k would leave them unread, and the
# loader then falls back to scale 1 without an error (atb/utils/layers/attention/fa3.py::FA3.load_mla).
FA3_WHY = ("its offline-sharded weights carry FA3's derived buffers (fa3.q_scale = 1 / fa_q, fa3.qk_scale, "
           "fa3.fa3_v_scale), read with a silent fallback to scale 1 when absent (MindIE-LLM atb/utils/layers/"
           "attention/fa3.py::FA3.load_mla), which dsconv does not derive")


class Planner:
    """The items of one folder kind for one sub-rank (headers only)."""

    def __init__(self, src: Any, rk: Ranks, mtp: bool = False) -> None:
        self.src, self.rk = src, rk
        self.mtp = mtp  # place the MTP layer too (`shard --mtp`: MindIE builds it with num_speculative_tokens > 0)
        self.f = src.facts
        if (src.quant_description or {}).get("fa_quant_type"):
            raise UserError(f"{src.root}: an int8 latent cache (FA quant) has no MindIE offline-sharded form here: "
                            f"{FA3_WHY}", hint="shard with --format ranks or plan: MindIE loads the quantize output "
                            "itself and shards it at load time")
        self.shapes = {n: tuple(i.shape) for n, i in src.tensors.items()}
        self.dtypes = {n: i.dtype for n, i in src.tensors.items()}
        self.desc = src.quant_description or {}
        self.model_dtype = self.f.dtype if self.f.dtype in ("BF16", "F16") else "BF16"
        self._qtypes: dict[str, str] = {}
        # a layer's expert groups per EP rank, shared by its moe_tp folders, and what was checked of them (by id;
        # the groups are held here, so no id is reused)
        self._expert_groups: dict[tuple[int, int, int], tuple[list[list[str]], list[list[str]]]] = {}
        self._checked: dict[int, tuple[list[list[str]], dict[Any, Any]]] = {}

    def qtype(self, module: str) -> str:
        t = self._qtypes.get(module)
        if t is None:
            t = self._qtypes[module] = self._qtype(module)
        return t

    def _qtype(self, module: str) -> str:
        w = module + ".weight"
        if self.dtypes.get(w, "BF16") in ("BF16", "F16", "F32", "F8_E4M3"):
            return "FLOAT"
        t = self.desc.get(w, "FLOAT")
        if t not in SUPPORTED:
            why = W4A8_WHY if t == "W4A8_DYNAMIC" else ""
            raise UserError(f"{module} is {t}: MindIE's sharded layout is written for {', '.join(SUPPORTED)} only"
                            f"{why}", hint="shard with --format ranks or plan (MindIE shards at load time), or "
                            "quantize with --bits 8 (or w8a8_dynamic / w8a16)")
        return t

    def _src_dtype(self, name: str) -> str:
        dt = self.dtypes[name]
        return self.model_dtype if dt.startswith("F8_") else dt  # FP8 weights are dequantized on load

    def _part(self, name: str, rows: np.ndarray | range | None = None, cols: tuple[int, int] | None = None) -> Part:
        shape = self.shapes[name]
        if rows is not None:
            shape = (len(rows),) + shape[1:]
        if cols is not None:
            shape = shape[:1] + (cols[1] - cols[0],) + shape[2:]
        return Part(name, shape, rows, cols)

    def _check_cut(self, groups: list[list[str]], param: str, cut: str, size: int) -> None:
        """The errors `_parts` would meet (a cut that does not divide, a missing tensor), in the order it meets them:
        checked when the plan is made, though stacked experts' parts are built only when used."""
        per_tensor, shapes = param in PER_TENSOR, self.shapes
        names = [m + "." + param for g in groups for m in (g[:1] if per_tensor else g)]
        try:  # the shapes are few (one per stacked linear): check each once; the loop below names the culprit
            whole = per_tensor or cut == "rep"
            if all(len(sh) > 0 and (whole or (sh[0] % size == 0 if cut == "col" else
                                              param != "weight" or sh[1] % size == 0))
                   for sh in set(map(shapes.__getitem__, names))):
                return
        except (KeyError, IndexError):
            pass
        for g in groups:
            for m in (g[:1] if per_tensor else g):
                name = m + "." + param
                shape = shapes[name]
                n = shape[0]
                if per_tensor or cut == "rep":
                    continue
                if cut == "col":
                    if n % size:
                        raise UserError(f"{name}: {n} rows do not split over {size} ranks",
                                        hint="choose a --tp / --ep that divides the heads and widths")
                elif param == "weight" and shape[1] % size:
                    raise UserError(f"{name}: {shape[1]} columns do not split over {size} ranks",
                                    hint="choose a --tp / --ep that divides the widths")

    def _parts(self, groups: list[list[str]], param: str, cut: str, rank: int, size: int,
               perm: Callable[[str, range], np.ndarray] | None) -> list[list[Part]]:
        """The parts of one param of a linear (see `linear`), per group; `_check_cut` has passed."""
        per_tensor, shapes = param in PER_TENSOR, self.shapes
        out = []
        for g in groups:
            parts = []
            for m in (g[:1] if per_tensor else g):
                name = m + "." + param
                shape = shapes[name]
                n = shape[0]
                if per_tensor or cut == "rep" and perm is None:
                    parts.append(Part(name, shape))
                elif cut == "rep":
                    parts.append(self._part(name, perm(name, range(n))))
                elif cut == "col":
                    rows = range(rank * n // size, (rank + 1) * n // size)
                    parts.append(self._part(name, perm(name, rows)) if perm else
                                 Part(name, (len(rows),) + shape[1:], rows))
                elif param == "weight":
                    cols = (rank * shape[1] // size, (rank + 1) * shape[1] // size)
                    parts.append(Part(name, (n, cols[1] - cols[0]) + shape[2:], None, cols))
                else:
                    parts.append(Part(name, shape))
            out.append(parts)
        return out

    def linear(self, out: str, groups: list[list[str]], cut: str, rank: int, size: int, *,
               perm: Callable[[str, range], np.ndarray] | None = None, dense_module: bool = True) -> list[Item]:
        """One MindIE linear (`out`), from source modules fused along dim 0 per group (stacked when several groups).

        cut "col": TensorParallelColumnLinear (weights.py::get_multi_weights_col): dim-0 params cut, per-tensor
        params whole (fused parts share them: the first part's); "row": TensorParallelRowLinear
        (get_multi_weights_row): weight dim 1, per-channel scales whole, W8A8 deq_scale whole, quant_bias on rank 0
        and zeros elsewhere; "rep": TensorReplicatedLinear (get_replicated_weights): whole. `dense_module`: the
        W8A8_DYNAMIC module flattens weight_scale/weight_offset and negates the offset; W8A16 negates it
        (w8a8_dynamic.py::W8A8LinearDynamic, w8a16.py) - not applied to stacked experts (not pinned for MoE)."""
        memo: dict[Any, Any] = {}
        if len(groups) > 1:  # stacked experts: their moe_tp folders share the groups, checked once
            held, memo = self._checked.setdefault(id(groups), (groups, {}))
            assert held is groups
        qtype = memo.get("qtype")
        if qtype is None:
            qtypes = set(map(self._qtypes.get, chain.from_iterable(groups)))  # known modules: one C-level pass
            if None in qtypes:
                qtypes = {self.qtype(m) for g in groups for m in g}
            if len(qtypes) > 1:
                raise UserError(f"{out}: its parts are {sorted(qtypes)}: MindIE fuses/stacks them into one module",
                                hint="quantize them alike")
            qtype = memo["qtype"] = qtypes.pop()
        stacked = len(groups) > 1 or not dense_module
        items = []
        for param in PARAMS[qtype] + (("bias",) if f"{groups[0][0]}.bias" in self.shapes else ()):
            if (param, cut, size) not in memo:
                self._check_cut(groups, param, cut, size)
                memo[(param, cut, size)] = True
            parts_g: list[list[Part]] | LazyGroups
            if len(groups) > 1:  # stacked experts: 189k parts for DeepSeek-V3 at --ep 8 --tp 4, built when used
                parts_g = LazyGroups(partial(self._parts, groups, param, cut, rank, size, perm), len(groups))
            else:
                parts_g = self._parts(groups, param, cut, rank, size, perm)
            zeros = cut == "row" and param in ("quant_bias", "bias") and rank != 0  # whole on rank 0, else zero
            src_dtype = self._src_dtype(f"{groups[0][0]}.{param}")
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

            def q_perm(name: str, rows: range) -> np.ndarray:
                return rope_rows(int(rows[0]), hl, nope, rope)

            def kv_a_perm(name: str, rows: range) -> np.ndarray:
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
        """The decoder layers; the MTP layer's too with `mtp` (MindIE builds it as FlashDeepseekV2DecoderLayer with
        its own layer id only with num_speculative_tokens > 0: modeling_deepseekv2.py)."""
        return range(self.f.num_layers + (self.f.num_mtp_layers if self.mtp else 0))

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
        - min; rows in source order), shared experts over the MLP group (world; ep_level 1), routed experts of this
        EP rank stacked ([E_local, 2I/moe_tp, H] gate_up, [E_local, H, I/moe_tp] down).

        The router rows stay unrotated in every EP folder: DeepseekMoE.__init__ rotates gate.weight/gate.bias rows to
        the rank's first expert at load time (ep_level 1) whether or not the weights were sharded offline
        (nothing there checks weights.sharded; FastLinear.load reads the stored `gate.weight`), so rows stored
        rotated, as MindIE's own weight_sharder dumps them, would be rotated twice on EP ranks >= 1."""
        rk, items = self.rk, []
        r = e * rk.moe_tp + t  # the one world rank of this folder
        for L in self.layers():
            if L not in self.f.moe_layers:
                continue
            p = f"model.layers.{L}.mlp."
            E = self.f.num_experts
            local = assign_experts(E, rk.moe_ep)[e]
            gw = p + "gate.weight"
            items.append(Item(p + "gate.weight", "F32", [[self._part(gw)]], self._src_dtype(gw), qtype="FLOAT"))
            cb = p + "gate.e_score_correction_bias"
            if cb in self.shapes:
                items.append(Item(p + "gate.bias", self.model_dtype, [[self._part(cb)]], self._src_dtype(cb),
                                  shift_min=True, qtype="FLOAT"))
            sh = p + "shared_experts."
            if sh + "gate_proj.weight" in self.shapes:
                items += self.linear(sh + "gate_up_proj", [[sh + "gate_proj", sh + "up_proj"]], "col", r, rk.world)
                items += self.linear(sh + "down_proj", [[sh + "down_proj"]], "row", r, rk.world)
            groups = self._expert_groups.get((L, local.start, local.stop))
            if groups is None:
                ex = [f"{p}experts.{i}." for i in local]
                groups = self._expert_groups[(L, local.start, local.stop)] = (
                    [[x + "gate_proj", x + "up_proj"] for x in ex], [[x + "down_proj"] for x in ex])
            items += self.linear(p + "gate_up_proj", groups[0], "col", t, rk.moe_tp, dense_module=False)
            items += self.linear(p + "down_proj", groups[1], "row", t, rk.moe_tp, dense_module=False)
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
        for L in self.layers()[self.f.num_layers:]:  # the MTP layer's eh_proj: read whole (weights.get_tensor)
            eh = f"model.layers.{L}.eh_proj.weight"
            items.append(Item(eh, self.model_dtype, [[self._part(eh)]], self._src_dtype(eh), qtype="FLOAT"))
        return items

    def norm(self) -> list[Item]:
        """get_module_save_dir: every tensor whose name contains "norm" (incl. q_a/kv_a layernorms), cast to the model
        dtype. (The zero `.bias` MindIE adds to W8A8 layer norms is optional on load and not written.)"""
        out = []
        for n in self.src.names():
            if "norm" not in n:
                continue
            r = self.src.role(n)
            if r.layer is not None and r.layer >= self.f.num_layers and not self.mtp:
                continue
            out.append(Item(n, self.model_dtype, [[self._part(n)]], self._src_dtype(n)))
        return out
