"""Every row MindIE holds (mindie_held.py), compared in place with the row MindIE holds there for the float source.

Runs in the MindIE environment (imports nothing from dsconv). The expected layout is MindIE's own: the float source
loaded by the same loader with the same config and parallel settings (mindie_reference.py) holds, at every position
of every module, the source row MindIE's transforms (fusion order, rope permutation, TP and EP slicing) put there.
The held quantized row at that position must dequantize to it:
  held_W[r, :] * held_norm[cols]  ~  reference_W[r, :] * source_norm[cols]
so SmoothQuant's scale, moved between a norm and its linears, cancels in the product; the norm is the one MindIE
holds in the norm module of the float load's place, and it must be the written one exactly. An up_proj row may carry
one factor f when its down_proj column carries 1/f (SmoothQuant folded between them); nothing else may. A row agrees
when every element is within half a quantization step, or within its float dtype's rounding; an element beyond that
is excused only where the integer sits at the range's end and the source lies beyond the clip, and the clipped
fraction of each linear is held under CLIP_LIMIT (a scale too small clips most elements). Then the scales MindIE holds
must be the written ones, exactly.

Which source tensor, row and column chunk a reference row is (its provenance) is found by its exact bytes among the
source's rows: it names the norm, the SmoothQuant pairing, the description entry and the written scales of each row.
A row that differs is named by its nearest source row (mindie_nearest.py), a diagnostic only: the verdict is the
comparison in place.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from factors import column_factors, row_factors
from mindie_held import Held, layer_of, rows as held_rows, scale_values
from mindie_nearest import nearest

# which norm feeds a source linear (HF names): held_W x held norm is what the model computes
NORM_OF = (
    (re.compile(r"\.self_attn\.(q_proj|k_proj|v_proj|q_a_proj|kv_a_proj_with_mqa)\.weight$"), "input_layernorm"),
    # Qwen3-Next's linear attention (Qwen3.5's split projections too); DeepSeek-V3.2's indexer
    (re.compile(r"\.linear_attn\.(in_proj_qkvz|in_proj_ba|in_proj_qkv|in_proj_z|in_proj_b|in_proj_a)\.weight$"),
     "input_layernorm"),
    (re.compile(r"\.self_attn\.indexer\.(wk|weights_proj)\.weight$"), "input_layernorm"),
    (re.compile(r"\.self_attn\.(q_b_proj|indexer\.wq_b)\.weight$"), "self_attn.q_a_layernorm"),
    (re.compile(r"\.self_attn\.kv_b_proj\.weight$"), "self_attn.kv_a_layernorm"),
    (re.compile(r"\.(mlp|block_sparse_moe)\.(gate_proj|up_proj|gate|shared_expert_gate)\.weight$"),
     "post_attention_layernorm"),
    (re.compile(r"\.(mlp|block_sparse_moe)\.(experts\.\d+|shared_experts?)\.(gate_proj|up_proj|w1|w3)\.weight$"),
     "post_attention_layernorm"),
)
# Gemma 3 normalises the MLP's input with pre_feedforward_layernorm (its post_attention_layernorm scales the
# attention's output before the residual add), and its RMSNorm multiplies by (1 + weight)
PRE_FEEDFORWARD = ("post_attention_layernorm", "pre_feedforward_layernorm")
UP_RE = re.compile(r"\.(up_proj|w3)\.weight$")
DOWN_RE = re.compile(r"\.(down_proj|w2)\.weight$")
# a description type -> the linear_desc MindIE builds for it (its router reads W8A8_MIX as the older w8a8_pdmix:
# atb/models/base/router.py::BaseRouter.config)
DESCRIBED_AS = {"W8A8_MIX": "W8A8_PDMIX"}
QMAX = {"W8A8": 127, "W8A8_DYNAMIC": 127, "W8A16": 127, "W4A16": 7, "W4A8_DYNAMIC": 7, "W4A4_DYNAMIC": 7}
EPS = {torch.bfloat16: 2.0 ** -9, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}  # half an ulp, relative
TINY = {torch.bfloat16: 2.0 ** -134, torch.float16: 2.0 ** -25, torch.float32: 2.0 ** -150}  # half the least subnormal
ROUTING_BIAS = "e_score_correction_bias"
SLACK = 0.5 * (1 + 1e-3)  # half a step, and the float64 arithmetic's own noise
# the largest fraction of a linear's elements its scale may clip (beyond half a step, excused only because the source
# lies beyond the clip): over every output of the check, a correct one clips none of a linear as MindIE holds it
# and at most 0.012% as written for vLLM-Ascend, the real Qwen2.5-Coder-0.5B and Gemma-3-270M `--bits 8` outputs none
# (docs/engine_check.md); a weight scale 8x too small clips 73.9%. The margin leaves room for a clip search that
# does clip real outliers.
CLIP_LIMIT = 0.10


def norm_offset(config: dict) -> float:
    """What a model adds to a norm's weight before scaling by it: Gemma's RMSNorm multiplies by (1 + weight). (The
    vLLM-Ascend check reads it off the engine's own norm modules instead: vllm_loader.engine_norm_offset.)"""
    return 1.0 if str(config.get("model_type", "")).startswith("gemma") else 0.0


@dataclass
class Reference:
    """What MindIE holds for the float source (mindie_reference.capture): raw weights and norms by module name."""
    arrays: Any
    linears: dict[str, dict]
    norm_modules: list[str]

    @classmethod
    def load(cls, path: str, meta: dict) -> "Reference":
        return cls(np.load(path), meta["linears"], meta["norms"])

    def rows(self, module: str, flip: bool = False) -> np.ndarray:
        info = self.linears[module]
        return held_rows(self.arrays[f"w::{module}"], info["transposed"] != flip)

    def norm(self, module: str) -> np.ndarray:
        return self.arrays[f"n::{module}"]


@dataclass
class Source:
    """The float source (name -> float64 array), the written checkpoint the output was made as (name -> torch
    tensor: the quantized directory itself, or the one an offline-sharded output was sharded from) and its
    description; `norms` are the norms MindIE holds, by source name (held_norms)."""
    weights: dict[str, np.ndarray]
    written: dict[str, torch.Tensor]
    desc: dict[str, str]
    dtype: Any = None  # the model dtype MindIE holds float weights in (Mixtral from a bf16 source: float16)
    norm_offset: float = 0.0  # what the model adds to a norm's weight before scaling (Gemma: 1)
    norms: dict[str, np.ndarray] = field(default_factory=dict)
    index: dict = field(default_factory=dict)  # K -> {row bytes: (name, row, chunk, chunks)}

    def norm_name(self, name: str) -> str | None:
        for pat, norm in NORM_OF:
            m = pat.search(name)
            if m:
                layer = name[:m.start()]
                if norm == PRE_FEEDFORWARD[0] and f"{layer}.{PRE_FEEDFORWARD[1]}.weight" in self.weights:
                    norm = PRE_FEEDFORWARD[1]
                return f"{layer}.{norm}.weight"
        return None

    def gains(self, name: str, c: int, K: int) -> tuple[np.ndarray, np.ndarray]:
        """(held norm, source norm) on column chunk c of `name`'s input (ones where no norm feeds it)."""
        norm = self.norm_name(name)
        cols = slice(c * K, (c + 1) * K)
        gw = self.norms.get(norm) if norm else None
        gs = self.weights.get(norm) if norm else None
        one = np.ones(K)
        return (gw[cols] + self.norm_offset if gw is not None else one), \
            (gs[cols] + self.norm_offset if gs is not None else one)

    def held_norms(self, ref: Reference, model: torch.nn.Module, dtype: Any) -> list[str]:
        """Place every written norm: the module that holds its source values in the float load holds it in the
        quantized load, and must hold the written values exactly (a lossy cast, or a norm written under another
        layer's name, fails here); a module's norm bias (MindIE's anti-outlier RMSNormBias) must be the written
        bias or zero. Fills `norms` (source name -> held values) for the comparison's products."""
        held = {n: m for n, m in model.named_modules()
                if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 1}
        by_bytes: dict[bytes, list[str]] = {}
        for n, a in self.weights.items():
            if a.ndim == 1 and "norm" in n and n.endswith(".weight"):
                v = torch.from_numpy(a).to(dtype).to(torch.float64).numpy()
                by_bytes.setdefault(v.tobytes(), []).append(n)
        place = {}
        for module in ref.norm_modules:
            names = by_bytes.get(ref.norm(module).tobytes(), [])
            if len(names) > 1:  # equal values (a rotated model's all-ones norms): the one at MindIE's module path,
                names = [n for n in names if ("." + module).endswith("." + n[:-7])  # the source's, maybe prefixed
                         or ("." + n[:-7]).endswith("." + module)]
            if len(names) == 1:
                place.setdefault(names[0], module)
        out = []
        for n, t in sorted(self.written.items()):
            if not (t.dim() == 1 and t.is_floating_point() and "norm" in n and n.endswith(".weight")):
                continue
            module = place.get(n)
            if module is None or module not in held:
                out.append(f"{n}: no MindIE module holds it where the float load holds the source's {n}")
                continue
            got = held[module].weight.detach().to(torch.float64).numpy()
            want = t.to(torch.float64).numpy()
            if got.shape == want.shape:
                self.norms[n] = got
            if got.shape != want.shape or not np.array_equal(got, want):
                worst = float(np.abs(got - want).max()) if got.shape == want.shape else float("nan")
                out.append(f"{n}: MindIE's {module} holds other values than written (worst {worst:.3g})")
            b = getattr(held[module], "bias", None)
            wb = self.written.get(n[:-len("weight")] + "bias")
            if isinstance(b, torch.Tensor) and b.numel() and (
                    wb is None and bool(b.abs().max() > 0) or wb is not None and not torch.equal(wb.to(b.dtype), b)):
                out.append(f"{n}: {module} holds a bias other than the written one (or than none)")
        return out

    def provenance(self, W: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For each row of a reference weight, the source tensor (index into the returned names; -1: none, e.g.
        MindIE's vocabulary padding), its row, and the column chunk c of m that it is, found by exact bytes (of the
        source cast to the model dtype, as the float load holds it)."""
        R, K = W.shape
        idx = self.index.get(K)
        if idx is None:
            idx = self.index[K] = {}
            for n, a in self.weights.items():
                if a.ndim == 2 and a.shape[1] % K == 0:
                    if self.dtype is not None:  # as the float load holds it
                        a = torch.from_numpy(a).to(self.dtype).to(torch.float64).numpy()
                    m = a.shape[1] // K
                    for c in range(m):
                        chunk = np.ascontiguousarray(a[:, c * K:(c + 1) * K]) + 0.0  # -0.0 as 0.0
                        for j in range(a.shape[0]):
                            idx.setdefault(chunk[j].tobytes(), (n, j, c, m))
        names: list[str] = []
        at: dict[str, int] = {}
        name, js, cs, ms = np.full(R, -1), np.zeros(R, np.int64), np.zeros(R, np.int64), np.ones(R, np.int64)
        for r in range(R):
            hit = idx.get((np.ascontiguousarray(W[r]) + 0.0).tobytes()) if np.any(W[r]) else None
            if hit is not None:
                name[r] = at.setdefault(hit[0], len(at))
                js[r], cs[r], ms[r] = hit[1:]
        names = list(at)
        return names, name, js, cs, ms


@dataclass
class Outcome:
    linears: int = 0
    rows: int = 0
    class_mismatch: list = field(default_factory=list)
    value_mismatch: list = field(default_factory=list)
    lossy: list = field(default_factory=list)
    covered: dict = field(default_factory=dict)      # source name -> chunks -> bool [rows, chunks]
    bias_parts: dict = field(default_factory=dict)   # "name|row" -> [sum over chunks, tolerance, chunks, want, m]
    clipped: dict = field(default_factory=dict)      # module -> fraction of its elements beyond half a step, clipped


@dataclass
class Placed:
    """A held linear beside the float load's weight at the same position, and where each reference row came from."""
    h: Held
    W_ref: np.ndarray
    names: list[str]
    name: np.ndarray
    j: np.ndarray
    c: np.ndarray
    m: np.ndarray
    clipped: int = 0


def compare(held: list[Held], ref: Reference, src: Source) -> Outcome:
    """Compare every held linear with the float load's module of the same name, row by row in place; down_proj
    rows after the rest (they take the factors SmoothQuant moved into their up_proj rows)."""
    out = Outcome()
    placed = []
    for h in held:
        out.linears += not h.embed
        out.rows += h.W.shape[0]
        p = _place(h, ref, src, out)
        if p is not None:
            placed.append(p)
    return _compare(placed, src, out)


def compare_by_name(held: list[Held], src: Source) -> Outcome:
    """The same comparison where the expected row of each held linear is the source tensor of its own name, row by
    row (an engine shown to hold every written tensor at its name's place: vLLM-Ascend, written_source.py)."""
    out = Outcome()
    placed = []
    for h in held:
        name = h.module + ".weight"
        out.linears += 1
        out.rows += h.W.shape[0]
        if name not in src.weights or src.weights[name].shape != h.W.shape:
            got = list(src.weights[name].shape) if name in src.weights else "no such tensor"
            out.value_mismatch.append(f"{name} ({h.kind}): decodes to {list(h.W.shape)}, the source's is {got}")
            continue
        W = src.weights[name]
        if src.dtype is not None:
            W = torch.from_numpy(W).to(src.dtype).to(torch.float64).numpy()
        R = W.shape[0]
        placed.append(Placed(h, W, [name], np.zeros(R, np.int64), np.arange(R), np.zeros(R, np.int64),
                             np.ones(R, np.int64)))
    return _compare(placed, src, out)


def _compare(placed: list["Placed"], src: Source, out: Outcome) -> Outcome:
    factors: dict[str, np.ndarray] = {}  # MLP prefix -> [up rows, 2]: (factor, relative uncertainty)
    bad: dict[str, list] = {}
    for down_pass in (False, True):
        for p in placed:
            for i in np.unique(p.name):
                name = p.names[i] if i >= 0 else None
                if bool(name and DOWN_RE.search(name)) != down_pass:
                    continue
                for c in np.unique(p.c[p.name == i]):
                    rws = np.nonzero((p.name == i) & (p.c == c))[0]
                    worst = _check(p, rws, name, int(c), int(p.m[rws[0]]), src, out, factors)
                    if worst is not None:
                        bad.setdefault(p.h.module, []).append((*worst, name, int(c)))
    for p in placed:
        h = p.h
        _routing_bias(p, src, out)
        if h.q is not None:
            frac = p.clipped / max(1, h.W.size)
            out.clipped[h.module] = round(frac, 6)
            if frac > CLIP_LIMIT:
                out.value_mismatch.append(f"{h.module} ({h.kind}): {100 * frac:.1f}% of its elements sit clipped at "
                                          f"the integer range's end (a correct output: at most "
                                          f"{100 * CLIP_LIMIT:.0f}%): its scale is too small for the source")
        if h.module in bad:
            n = sum(x[0] for x in bad[h.module])
            _, r, err, name, c = max(bad[h.module], key=lambda x: x[2])
            where = f"{name}[{p.j[r]}] (column chunk {c})" if name else "the float load's row"
            looks = nearest(h.W[r], src.weights, layer_of(h.module), src.gains)
            out.value_mismatch.append(f"{h.module} ({h.kind}): {n} of {h.W.shape[0]} rows differ from the rows "
                                      f"the source puts in their place; worst: row {r} vs {where}, {err:.4f} steps"
                                      + (f"; it looks like {looks}" if looks else ""))
    return out


def _place(h: Held, ref: Reference, src: Source, out: Outcome) -> Placed | None:
    """The float load's weight at h's position, in h's orientation (a 3-D float weight MindIE split out of another,
    DeepSeek's k_b_proj / v_b_proj, carries no transpose flag: the orientation whose rows are source rows)."""
    if h.module not in ref.linears:
        out.value_mismatch.append(f"{h.module} ({h.kind}): MindIE built it for this output, but no module of that "
                                  f"name for the float source (the output's layout is not the model's)")
        return None
    W_ref = ref.rows(h.module)
    if h.embed and W_ref.shape[1] == h.W.shape[1] and W_ref.shape[0] < h.W.shape[0]:
        # MindIE pads an embedding with a zero row at load, its own dump's (already padded) rows too
        W_ref = np.concatenate([W_ref, np.zeros((h.W.shape[0] - W_ref.shape[0], W_ref.shape[1]))])
    if W_ref.shape != h.W.shape:
        out.value_mismatch.append(f"{h.module} ({h.kind}): holds {list(h.W.shape)} rows x columns, the float load "
                                  f"{list(W_ref.shape)}")
        return None
    p = Placed(h, W_ref, *src.provenance(W_ref))
    if h.alt is not None:
        A = ref.rows(h.module, flip=True)
        alt = Placed(h.alt, A, *src.provenance(A))
        if A.shape == h.alt.W.shape and (alt.name >= 0).sum() > (p.name >= 0).sum():
            return alt
    return p


def _tol(h: Held, rows: np.ndarray, S: np.ndarray, gw: np.ndarray) -> np.ndarray:
    """Half a quantization step per element (the effective step: scale x norm), or a float row's dtype rounding
    (relative, floored at half the dtype's least subnormal)."""
    if h.q is None:
        return np.maximum(np.abs(S) * EPS.get(h.w_dtype, 2.0 ** -9), TINY.get(h.w_dtype, 0.0)) * (1 + 1e-6) + 1e-300
    return SLACK * np.abs(h.scale[rows] * gw) + 1e-300


def _check(p: Placed, rows: np.ndarray, name: str | None, c: int, m: int, src: Source, out: Outcome,
           factors: dict) -> tuple[int, int, float] | None:
    """Check held rows `rows` against the float load's rows in the same places, whose provenance is rows p.j[rows]
    of source tensor `name` (column chunk c of m; None: not a source row). None when all agree, else (how many
    differ, the worst row, its error in steps)."""
    h = p.h
    K = h.W.shape[1]
    gw, gs = src.gains(name, c, K) if name else (np.ones(K), np.ones(K))
    E = h.W[rows] * gw
    S = p.W_ref[rows] * gs
    tol = _tol(h, rows, S, gw)
    js = p.j[rows]
    # a scale folded into a quantized weight (SmoothQuant: a norm's into its linears, up_proj's into down_proj) was
    # applied to the float weight in the model dtype before quantizing: that rounding (half an ulp) comes on top of
    # half a step where a factor is folded, and nowhere else
    ulp = EPS.get(src.dtype, 2.0 ** -9) if h.q is not None else 0.0
    folded = np.broadcast_to(gw != gs, E.shape)
    S0 = S
    ok = None
    if name and DOWN_RE.search(name):  # the column factors its up_proj rows allow (1 where nothing was folded)
        mi = factors.get(_mlp(name))
        if mi is not None:
            allowed = mi[c * K:(c + 1) * K]
            col, spread = column_factors(h, rows, E, S, tol + ulp * np.abs(S), allowed, QMAX)
            S = S * col[None, :]
            folded = folded | ((allowed[:, 0] != 1.0) | (allowed[:, 1] != 1.0))[None, :]
            tol = tol + np.abs(S) * spread[None, :]
    free0 = np.zeros_like(E, dtype=bool)
    if name and UP_RE.search(name):
        wide = tol + ulp * np.abs(S)
        free0 = _clipped(h, rows, E, S, wide, gw)  # at the range's end before the row's factor: excused after too
        f, lo, hi, ok = row_factors(E, S, wide, free0)
        mi = factors.setdefault(_mlp(name), np.tile([1.0, 1.0], (src.weights[name].shape[0], 1)))
        # its down_proj column must carry 1 / f for some f in [lo, hi]
        fit = ok & np.isfinite(lo) & np.isfinite(hi) & (lo > 0)
        mi[js[fit], 0], mi[js[fit], 1] = 1.0 / hi[fit], 1.0 / lo[fit]
        S = S * f[:, None]
        folded = np.ones_like(E, dtype=bool)  # the row's factor was fitted with the allowance: keep it
    tol = np.where(folded, tol + ulp * np.maximum(np.abs(S), np.abs(S0)), tol)
    free = _clipped(h, rows, E, S, tol, gw) | free0
    err = np.where(free, 0.0, np.abs(E - S) / tol)
    if ok is not None:
        err[~ok] = np.maximum(err[~ok], 2.0)  # no single factor fits: beyond half a step somewhere
    p.clipped += int((free & (np.abs(E - S) > tol)).sum())  # excused by the clip alone
    worst = err.max(axis=1) * SLACK
    good = worst <= SLACK
    if name:
        _described(h, name, src, out)
        cov = out.covered.setdefault(name, {}).setdefault(m, np.zeros((src.weights[name].shape[0], m), bool))
        cov[js[good], c] = True
        _written_scales(h, rows[good], js[good], name, c, m, src, out)
        if h.bias is not None:
            _bias(h, rows[good], js[good], name, c, m, src, out)
        elif src.weights.get(name[:-len("weight")] + "bias") is not None and len(rows):
            msg = f"{h.module} ({h.kind}): holds no bias, the source's {name[:-len('weight')]}bias is lost"
            if msg not in out.value_mismatch:
                out.value_mismatch.append(msg)
    if good.all():
        return None
    k = int(np.argmax(worst))
    return int((~good).sum()), int(rows[k]), float(worst[k])


def _described(h: Held, name: str, src: Source, out: Outcome) -> None:
    """The class MindIE built must be the description's type of the tensors it holds (by the source name, or by
    MindIE's own module name in its offline-sharded layout)."""
    if h.embed:
        return
    want = src.desc.get(name)
    if want is None:
        base = h.module[:-len(".linear")] if h.module.endswith(".linear") else h.module
        want = src.desc.get(base + ".weight")
    if want is not None and DESCRIBED_AS.get(want, want) != h.kind:
        msg = f"{h.module}: built as {h.kind}, {name} is described {want}"
        if msg not in out.class_mismatch:
            out.class_mismatch.append(msg)


def _mlp(name: str) -> str:
    """model.layers.0.mlp.up_proj.weight -> model.layers.0.mlp (the key an up/down pair shares)."""
    return name.rsplit(".", 2)[0]


def _clipped(h: Held, rows: np.ndarray, E: np.ndarray, S: np.ndarray, tol: np.ndarray, gw: np.ndarray
             ) -> np.ndarray:
    """Elements whose stored integer sits at the range's end and whose source lies beyond the clip (any distance is
    right there); the direction is the effective step's sign (scale x norm)."""
    if h.q is None:
        return np.zeros_like(E, dtype=bool)
    qmax = QMAX.get(h.kind, 127)
    q = h.q[rows]
    sign = np.sign(h.scale[rows] * gw)
    return (q >= qmax) & (S * sign >= E * sign - tol) | (q <= -qmax) & (S * sign <= E * sign + tol)


def _written_scales(h: Held, rows: np.ndarray, js: np.ndarray, name: str, c: int, m: int, src: Source,
                    out: Outcome) -> None:
    """The scales MindIE holds for these rows must be the written ones (lossy otherwise): those of the quantized
    directory, whose rows the provenance names (an offline-sharded rank's slices must hold the same), per-group
    scales of a row-parallel chunk c of m sliced to their chunk's groups."""
    if not len(rows):
        return
    base = name[:-len(".weight")]
    for key, held in h.raw.items():
        t = src.written.get(f"{base}.{key}")
        if t is None or any(x.startswith(f"{base}.{key}:") for x in out.lossy):
            continue
        wv = scale_values(t)
        want = np.broadcast_to(wv.reshape(1, -1), (len(js), 1)) if wv.size == 1 else wv.reshape(wv.shape[0], -1)[js]
        got = held[rows].reshape(len(rows), -1)
        if m > 1 and want.shape[1] == got.shape[1] * m:
            want = want[:, c * got.shape[1]:(c + 1) * got.shape[1]]
        if want.shape != got.shape:
            out.lossy.append(f"{base}.{key}: written {list(want.shape)} per these rows, MindIE holds {list(got.shape)}")
            continue
        if not np.array_equal(want, got):
            k = np.argwhere(want != got)[0]
            out.lossy.append(f"{base}.{key}: {t.dtype} written, MindIE holds other values (e.g. row {js[k[0]]}: "
                             f"{want[tuple(k)]:.9g} -> {got[tuple(k)]:.9g})")


def _routing_bias(p: Placed, src: Source, out: Outcome) -> None:
    """A router's held bias is DeepSeek's routing bias: top-k of score + bias is what it changes, so only its
    differences between experts matter (MindIE shifts it by its minimum, atb/utils/weights.py::
    correct_tensor_dtype); compared in place up to that shift, within the held bias dtype's rounding."""
    h = p.h
    sel = p.name >= 0
    if h.bias is None or not sel.any() or len(set(p.name[sel])) != 1:
        return
    name = p.names[int(p.name[sel][0])]
    want = src.weights.get(name[:-len("weight")] + ROUTING_BIAS)
    if want is None:
        return
    rws = np.nonzero(sel)[0]
    got, ref = h.bias[rws], want[p.j[rws]]
    eps = 2 * EPS.get(h.tensors["bias"].dtype if "bias" in h.tensors else h.w_dtype, 2.0 ** -9)
    tol = (np.abs(ref - ref.min()) + float(np.abs(ref).max())) * eps + 1e-12
    diff = np.abs((got - got.min()) - (ref - ref.min()))
    if not np.all(diff <= tol):
        out.value_mismatch.append(f"{h.module}: routing bias differs from the source's {ROUTING_BIAS} (up to a "
                                  f"constant): worst {float(diff.max()):.3g}")


def _bias(h: Held, rows: np.ndarray, js: np.ndarray, name: str, c: int, m: int, src: Source, out: Outcome) -> None:
    if name[:-len("weight")] + ROUTING_BIAS in src.weights or not len(rows):
        return  # a router's routing bias: _routing_bias
    b = src.weights.get(name[:-len(".weight")] + ".bias")
    want = b[js] if b is not None else np.zeros(len(js))
    got = h.bias[rows]
    tol = np.abs(h.raw["deq_half"][rows]) * (1 + 1e-3) if "deq_half" in h.raw else np.zeros(len(rows))
    tol = tol + np.abs(want) * 2 * EPS.get(h.w_dtype, 2.0 ** -9) + 1e-7
    if m > 1:  # a row-parallel chunk: the ranks' parts add up to the bias (summed by the driver)
        for j, g, t, w in zip(js.tolist(), got.tolist(), tol.tolist(), want.tolist()):
            part = out.bias_parts.setdefault(f"{name}|{j}", [0.0, 0.0, [], w, m])
            part[0] += g
            part[1] += t
            part[2].append(c)
        return
    bad = np.abs(got - want) > tol
    if bad.any():
        k = int(np.argmax(np.abs(got - want) - tol))
        out.value_mismatch.append(f"{h.module} ({h.kind}): bias of {name} differs from the source's in "
                                  f"{int(bad.sum())} rows, e.g. [{js[k]}]: {got[k]:.6g} vs {want[k]:.6g}")


def slot_problems(reference: list, held: list) -> list[str]:
    """The weight list handed to the ATB graph, in place: wherever the float load hands module M's weight, the
    quantized load must hand M's weight (a list that holds every weight in another order runs another model)."""
    out = []
    for i, module in enumerate(reference):
        if module is not None and (i >= len(held) or held[i] != module):
            got = held[i] if i < len(held) else "nothing"
            out.append(f"ATB weight list position {i}: holds {got or 'a tensor of no linear'}, the float load's "
                       f"holds {module}'s weight")
    return out[:3] + ([f"... {len(out) - 3} more positions"] if len(out) > 3 else [])
