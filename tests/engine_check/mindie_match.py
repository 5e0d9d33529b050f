"""Every row MindIE holds (mindie_held.py), matched with the float source row it must be, and checked.

Runs in the MindIE environment (imports nothing from dsconv). A held row (one output channel; stacked experts
flattened) is matched, by cosine, with a source row of the same layer, and then must satisfy
  held_W[r, :] * norm_written[cols]  ~  source_W[j, cols] * norm_source[cols]
so SmoothQuant's scale, moved between a norm and its linears, cancels in the product (the norm MindIE holds is checked
to be the written one, byte for byte, by the loader). An up_proj row may carry one factor f when its down_proj column
carries 1/f (SmoothQuant folded between them); nothing else may. A row-parallel linear holds a contiguous chunk of the
source's columns. A row agrees when every element is within half a quantization step (a clipped element: the source
lies beyond the clip), or within its float dtype's rounding. Then the scales MindIE holds must be the written ones,
exactly: an engine that computes with another number than the weights were quantized against is a failure even where
the rounding hides it. Everything is vectorised per (held linear, source tensor): a check of every family x scheme at
two TP degrees takes minutes, not hours.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mindie_held import Held, layer_of, scale_values

# which norm feeds a source linear (HF names): held_W x held norm is what the model computes
NORM_OF = (
    (re.compile(r"\.self_attn\.(q_proj|k_proj|v_proj|q_a_proj|kv_a_proj_with_mqa)\.weight$"), "input_layernorm"),
    (re.compile(r"\.self_attn\.q_b_proj\.weight$"), "self_attn.q_a_layernorm"),
    (re.compile(r"\.self_attn\.kv_b_proj\.weight$"), "self_attn.kv_a_layernorm"),
    (re.compile(r"\.(mlp|block_sparse_moe)\.(gate_proj|up_proj|gate|shared_expert_gate)\.weight$"),
     "post_attention_layernorm"),
    (re.compile(r"\.(mlp|block_sparse_moe)\.(experts\.\d+|shared_experts?)\.(gate_proj|up_proj|w1|w3)\.weight$"),
     "post_attention_layernorm"),
)
UP_RE = re.compile(r"\.(up_proj|w3)\.weight$")
EXPERT_RE = re.compile(r"\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")
DOWN_RE = re.compile(r"\.(down_proj|w2)\.weight$")
# a description type -> the linear_desc MindIE builds for it (its router reads W8A8_MIX as the older w8a8_pdmix:
# atb/models/base/router.py::BaseRouter.config)
DESCRIBED_AS = {"W8A8_MIX": "W8A8_PDMIX"}
QMAX = {"W8A8": 127, "W8A8_DYNAMIC": 127, "W8A16": 127, "W4A16": 7, "W4A8_DYNAMIC": 7, "W8A8_PDMIX": 127}
EPS = {torch.bfloat16: 2.0 ** -9, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}  # half an ulp, relative
TINY = {torch.bfloat16: 2.0 ** -134, torch.float16: 2.0 ** -25, torch.float32: 2.0 ** -150}  # half the least subnormal
ROUTING_BIAS = "e_score_correction_bias"
SLACK = 0.5 * (1 + 1e-3)  # half a step, and the float64 arithmetic's own noise
PROJECTED = 48            # dimensions of the nearest-row search (_pick)


@dataclass
class Source:
    """The float source (name -> float64 array), the written checkpoint (name -> torch tensor) and its description."""
    weights: dict[str, np.ndarray]
    written: dict[str, torch.Tensor]
    desc: dict[str, str]
    sharded: bool = False         # an offline-sharded layout (a rank's files hold its slices under the same names)
    norms: dict[str, np.ndarray] = field(default_factory=dict)
    banks: dict = field(default_factory=dict)  # (layer, width) -> candidate rows (_banks)

    def __post_init__(self) -> None:
        self.norms = {n: t.to(torch.float64).numpy() for n, t in self.written.items()
                      if t.dim() == 1 and t.is_floating_point() and "norm" in n}

    def norm_name(self, name: str) -> str | None:
        for pat, norm in NORM_OF:
            m = pat.search(name)
            if m:
                return f"{name[:m.start()]}.{norm}.weight"
        return None

    def gains(self, name: str, c: int, K: int) -> tuple[np.ndarray, np.ndarray]:
        """(written norm, source norm) on column chunk c of `name`'s input (ones where no norm feeds it)."""
        norm = self.norm_name(name)
        cols = slice(c * K, (c + 1) * K)
        gw = self.norms.get(norm) if norm else None
        gs = self.weights.get(norm) if norm else None
        return (gw[cols] if gw is not None else np.ones(K)), (gs[cols] if gs is not None else np.ones(K))


@dataclass
class Picks:
    """For each held row: the source tensor (index into names; -1 for an all-zero padding row), its row, and the
    column chunk c of m the held row covers."""
    names: list[str]
    name: np.ndarray
    j: np.ndarray
    c: np.ndarray
    m: np.ndarray


@dataclass
class Outcome:
    linears: int = 0
    rows: int = 0
    class_mismatch: list = field(default_factory=list)
    value_mismatch: list = field(default_factory=list)
    lossy: list = field(default_factory=list)
    covered: dict = field(default_factory=dict)      # source name -> chunks -> bool [rows, chunks]
    bias_parts: dict = field(default_factory=dict)   # "name|row" -> [sum over this rank's chunks, tolerance, chunks]


def compare(held: list[Held], src: Source, rank: int = 0, moe_ep: int = 1, moe_tp: int = 1) -> Outcome:
    """Match every held row with its source row and check it; down_proj rows after the rest (they take the factors
    SmoothQuant moved into their up_proj rows). Then each source tensor split over ranks must be held in this rank's
    part."""
    out = Outcome()
    factors: dict[str, np.ndarray] = {}  # MLP prefix -> [up rows, 2]: (factor, relative uncertainty)
    matched = []
    for h in held:
        out.linears += not h.embed
        out.rows += h.W.shape[0]
        h, picks = _best_orientation(h, src)
        if picks is None:
            out.value_mismatch.append(f"{h.module}: no source tensor with {h.W.shape[1]} columns in its layer")
            continue
        matched.append((h, picks))
    bad: dict[str, list] = {}
    for down_pass in (False, True):
        for h, picks in matched:
            for i, name in enumerate(picks.names):
                if bool(DOWN_RE.search(name)) != down_pass:
                    continue
                for c in np.unique(picks.c[picks.name == i]):
                    rows = np.nonzero((picks.name == i) & (picks.c == c))[0]
                    worst = _check(h, rows, name, int(c), int(picks.m[rows[0]]), picks.j[rows], src, out, factors)
                    if worst is not None:
                        bad.setdefault(h.module, []).append((*worst, name, int(c)))
    out.value_mismatch += rank_parts(matched, src, rank) + expert_blocks(matched, src, rank, moe_ep, moe_tp)
    for h, picks in matched:
        _routing_bias(h, picks, src, out)
        if h.module in bad:
            n = sum(x[0] for x in bad[h.module])
            _, r, j, err, name, c = max(bad[h.module], key=lambda x: x[3])
            out.value_mismatch.append(f"{h.module} ({h.kind}): {n} of {h.W.shape[0]} rows differ from the source; "
                                      f"worst: row {r} vs {name}[{j}] (column chunk {c}), {err:.2f} steps")
    return out


def _best_orientation(h: Held, src: Source) -> tuple[Held, Picks | None]:
    """A 3-D float weight MindIE split out of another (DeepSeek's k_b_proj / v_b_proj of kv_b_proj) carries no
    transpose flag: the orientation whose rows are source rows."""
    picks = _pick(h, src)
    if h.alt is None:
        return h, picks
    alt = _pick(h.alt, src)
    if alt is not None and (picks is None or _fit(h.alt, alt, src) > _fit(h, picks, src)):
        return h.alt, alt
    return h, picks


def _fit(h: Held, picks: Picks, src: Source) -> int:
    """How many rows equal their pick within the rounding (no SmoothQuant factors)."""
    K, n = h.W.shape[1], 0
    for i, name in enumerate(picks.names):
        for c in np.unique(picks.c[picks.name == i]):
            rows = np.nonzero((picks.name == i) & (picks.c == c))[0]
            gw, gs = src.gains(name, int(c), K)
            S = src.weights[name][picks.j[rows], c * K:(c + 1) * K] * gs
            n += int(np.all(np.abs(h.W[rows] * gw - S) <= _tol(h, rows, S, gw), axis=1).sum())
    return n


def _pick(h: Held, src: Source) -> Picks | None:
    """For every held row, the most similar source row (cosine of the norm products) among the source tensors of the
    same layer whose width is a multiple of its own; candidates grouped by the (norm, column chunk) scaling them.
    The search runs on a fixed random projection to PROJECTED dimensions (random rows keep their nearest neighbour
    there), the winner's cosine is then taken exactly, and rows whose winner is not close (cos < 0.99) are searched
    again at full width."""
    R, K = h.W.shape
    banks = _banks(src, layer_of(h.module), K)
    if not banks:
        return None
    names = banks[0].names
    p = Picks(names, np.full(R, -1), np.zeros(R, np.int64), np.zeros(R, np.int64), np.ones(R, np.int64))
    best_d = np.full(R, np.inf)
    for full in (False, True):
        todo = np.arange(R) if not full else np.nonzero(best_d > 1e-2)[0]
        if full and (banks[0].proj is None or not len(todo)):
            break
        for b in banks:
            E = _unit(h.W[todo] * b.gw).astype(np.float32)
            Ep = E if full or b.proj is None else _unit(E @ b.proj)
            Sp = b.S if full or b.proj is None else b.Sp
            for a in range(0, len(todo), 2048):  # bounded memory for stacked experts
                k = (Ep[a:a + 2048] @ Sp.T).argmax(axis=1)
                d = 1.0 - np.einsum("ij,ij->i", E[a:a + 2048], b.S[k]).astype(np.float64)  # the exact cosine
                rows = todo[a:a + 2048]
                better = d < best_d[rows]
                sel = rows[better]
                best_d[sel] = d[better]
                p.name[sel], p.j[sel] = b.owner[k[better]], b.row[k[better]]
                p.c[sel], p.m[sel] = b.c, b.chunks[b.owner[k[better]]]
    p.name[np.abs(h.W).sum(axis=1) == 0] = -1  # MindIE's vocabulary padding
    return p


@dataclass
class Bank:
    """The candidate source rows of one layer for held rows K wide, scaled by one (norm, column chunk): unit rows
    (float32) and their random projection, with the tensor (index into names) and row each came from."""
    names: list[str]
    c: int
    gw: np.ndarray
    S: np.ndarray
    Sp: np.ndarray | None
    proj: np.ndarray | None
    owner: np.ndarray
    row: np.ndarray
    chunks: np.ndarray


def _banks(src: Source, layer: int | None, K: int) -> list[Bank]:
    """Built once per (layer, width) and shared by every held linear of that layer and width."""
    key = (layer, K)
    if key in src.banks:
        return src.banks[key]
    names = [n for n, w in src.weights.items() if w.ndim == 2 and w.shape[1] % K == 0 and layer_of(n) == layer]
    groups: dict[tuple, list[int]] = {}
    for i, n in enumerate(names):
        for c in range(src.weights[n].shape[1] // K):
            groups.setdefault((src.norm_name(n), c), []).append(i)
    chunks = np.array([src.weights[n].shape[1] // K for n in names], dtype=np.int64)
    proj = np.random.default_rng(0).standard_normal((K, PROJECTED)).astype(np.float32) if K > PROJECTED else None
    out = []
    for (_, c), idx in groups.items():
        gw, gs = src.gains(names[idx[0]], c, K)
        S = _unit(np.concatenate([src.weights[names[i]][:, c * K:(c + 1) * K] for i in idx]) * gs).astype(np.float32)
        out.append(Bank(names, c, gw, S, _unit(S @ proj) if proj is not None else None, proj,
                        np.concatenate([np.full(src.weights[names[i]].shape[0], i) for i in idx]),
                        np.concatenate([np.arange(src.weights[names[i]].shape[0]) for i in idx]), chunks))
    src.banks[key] = out
    return out


def _unit(a: np.ndarray) -> np.ndarray:
    return a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), np.finfo(a.dtype).tiny)


def _tol(h: Held, rows: np.ndarray, S: np.ndarray, gw: np.ndarray) -> np.ndarray:
    """Half a quantization step per element (the effective step: scale x norm), or a float row's dtype rounding
    (relative, floored at half the dtype's least subnormal)."""
    if h.q is None:
        return np.maximum(np.abs(S) * EPS.get(h.w_dtype, 2.0 ** -9), TINY.get(h.w_dtype, 0.0)) * (1 + 1e-6) + 1e-300
    return SLACK * np.abs(h.scale[rows] * gw) + 1e-300


def _check(h: Held, rows: np.ndarray, name: str, c: int, m: int, js: np.ndarray, src: Source, out: Outcome,
           factors: dict) -> tuple[int, int, int, float] | None:
    """Check the held rows matched with rows `js` of source tensor `name` (column chunk c of m). None when all agree,
    else (how many differ, the worst row, its source row, its error in steps)."""
    K = h.W.shape[1]
    _described(h, name, src, out)
    gw, gs = src.gains(name, c, K)
    E = h.W[rows] * gw
    S = src.weights[name][js, c * K:(c + 1) * K] * gs
    tol = _tol(h, rows, S, gw)
    if DOWN_RE.search(name):  # the column factors its up_proj rows carry (1 where nothing was folded)
        fu = factors.get(_mlp(name))
        if fu is not None:
            f, u = fu[c * K:(c + 1) * K, 0], fu[c * K:(c + 1) * K, 1]
            S = S / f
            tol = tol + np.abs(S) * u
    free = _clipped(h, rows, E, S, tol)
    err = np.where(free, 0.0, np.abs(E - S) / tol)
    if UP_RE.search(name):
        f, u, ok = _row_factors(E, S, tol, free)
        fu = factors.setdefault(_mlp(name), np.tile([1.0, 0.0], (src.weights[name].shape[0], 1)))
        fu[js[ok], 0], fu[js[ok], 1] = f[ok], u[ok]
        S2 = S * f[:, None]
        err = np.where(free, 0.0, np.abs(E - S2) / (tol + np.abs(S2) * u[:, None]))
        err[~ok] = np.maximum(err[~ok], 2.0)  # no single factor fits: beyond half a step somewhere
    worst = err.max(axis=1) * SLACK
    good = worst <= SLACK
    cov = out.covered.setdefault(name, {}).setdefault(m, np.zeros((src.weights[name].shape[0], m), bool))
    cov[js[good], c] = True
    _written_scales(h, rows[good], js[good], name, src, out)
    if h.bias is not None:
        _bias(h, rows[good], js[good], name, c, m, src, out)
    if good.all():
        return None
    k = int(np.argmax(worst))
    return int((~good).sum()), int(rows[k]), int(js[k]), float(worst[k])


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


def _clipped(h: Held, rows: np.ndarray, E: np.ndarray, S: np.ndarray, tol: np.ndarray) -> np.ndarray:
    """Elements at the integer range's end whose source lies beyond the clip (any distance is right there)."""
    if h.q is None:
        return np.zeros_like(E, dtype=bool)
    qmax = QMAX.get(h.kind, 127)
    qv = h.q[rows] + h.offset[rows]
    sign = np.sign(h.scale[rows])
    return (qv >= qmax) & (S * sign >= E * sign - tol) | (qv <= -qmax) & (S * sign <= E * sign + tol)


def _row_factors(E: np.ndarray, S: np.ndarray, tol: np.ndarray, free: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row, the factors f for which every element of E is within tol of f * S (an interval; 1 when it holds
    1): SmoothQuant divides an up_proj row by what it multiplies the down_proj column by. (f, relative half-width,
    whether any f fits)."""
    use = ~free & (np.abs(S) > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        a, b = (E - tol) / S, (E + tol) / S
    lo = np.where(use, np.minimum(a, b), -np.inf).max(axis=1)
    hi = np.where(use, np.maximum(a, b), np.inf).min(axis=1)
    ok = lo <= hi
    one = (lo <= 1.0) & (1.0 <= hi)
    f = np.where(one | ~np.isfinite(lo) | ~np.isfinite(hi), 1.0, 0.5 * (lo + hi))
    u = np.where(f == 1.0, 0.0, 0.5 * np.abs(hi - lo) / np.abs(f))
    return f, np.where(ok, u, 0.0), ok


def _written_scales(h: Held, rows: np.ndarray, js: np.ndarray, name: str, src: Source, out: Outcome) -> None:
    """The scales MindIE holds for these rows must be the written ones (lossy otherwise). Only where the written
    tensors are the source's, whole (not an offline-sharded rank's slice)."""
    if src.sharded or not len(rows):
        return
    base = name[:-len(".weight")]
    for key, held in h.raw.items():
        t = src.written.get(f"{base}.{key}")
        if t is None or any(x.startswith(f"{base}.{key}:") for x in out.lossy):
            continue
        wv = scale_values(t)
        want = np.broadcast_to(wv.reshape(1, -1), (len(js), 1)) if wv.size == 1 else wv.reshape(wv.shape[0], -1)[js]
        got = held[rows].reshape(len(rows), -1)
        if want.shape == got.shape and not np.array_equal(want, got):
            k = np.argwhere(want != got)[0]
            out.lossy.append(f"{base}.{key}: {t.dtype} written, MindIE holds other values (e.g. row {js[k[0]]}: "
                             f"{want[tuple(k)]:.9g} -> {got[tuple(k)]:.9g})")


def _routing_bias(h: Held, picks: Picks, src: Source, out: Outcome) -> None:
    """A router's held bias is DeepSeek's routing bias: top-k of score + bias is what it changes, so only its
    differences between experts matter (MindIE shifts it by its minimum, atb/utils/weights.py::
    correct_tensor_dtype); compared up to that shift, within the held bias dtype's rounding."""
    if h.bias is None or len(picks.names) != 1 and len(set(picks.name[picks.name >= 0])) != 1:
        return
    name = picks.names[int(picks.name[picks.name >= 0][0])]
    want = src.weights.get(name[:-len("weight")] + ROUTING_BIAS)
    if want is None:
        return
    rows = np.nonzero(picks.name >= 0)[0]
    got, ref = h.bias[rows], want[picks.j[rows]]
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


def rank_parts(matched: list, src: Source, rank: int) -> list[str]:
    """Tensor parallelism gives rank r part r of a split tensor: a row-parallel linear's column chunk r, a column-
    parallel one's r-th block of rows (vocabulary rows of the head and embedding included). A layout that hands a
    rank another rank's part (an offline-sharded folder swapped) is wrong even where the sum still comes out."""
    rows: dict[str, set] = {}
    chunks: dict[str, set] = {}
    for _, picks in matched:
        for i, name in enumerate(picks.names):
            sel = picks.name == i
            if sel.any():
                rows.setdefault(name, set()).update(picks.j[sel].tolist())
                chunks.setdefault(name, set()).update(zip(picks.c[sel].tolist(), picks.m[sel].tolist()))
    out = []
    for name, js in sorted(rows.items()):
        m = max(mm for _, mm in chunks[name])
        if m > 1:
            got = sorted(c for c, mm in chunks[name] if mm == m)
            if got != [rank % m]:
                out.append(f"{name}: rank {rank} holds column chunk(s) {got} of {m}, its own is {rank % m}")
        k, lo, hi, n = len(js), min(js), max(js), src.weights[name].shape[0]
        if k < n and n % k == 0 and hi - lo + 1 == k and lo % k == 0 and lo // k != rank % (n // k):
            out.append(f"{name}: rank {rank} holds rows {lo}..{hi} (part {lo // k} of {n // k}), its own part is "
                       f"{rank % (n // k)}")
    return out


def expert_blocks(matched: list, src: Source, rank: int, moe_ep: int, moe_tp: int) -> list[str]:
    """Expert parallelism gives EP rank b = rank // moe_tp the contiguous block b of every MoE layer's experts
    (MindIE's default assignment, atb/utils/moe_utils.py::assign): the experts a rank holds must be its block."""
    if moe_ep <= 1:
        return []
    total: dict[int, set] = {}
    for name in src.weights:
        m = EXPERT_RE.search(name)
        if m:
            total.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    held: dict[int, set] = {}
    for _, picks in matched:
        for i in np.unique(picks.name[picks.name >= 0]):
            m = EXPERT_RE.search(picks.names[int(i)])
            if m:
                held.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    out = []
    for layer, experts in sorted(total.items()):
        n = len(experts)
        per = -(-n // moe_ep)
        b = rank // moe_tp
        want = set(range(b * per, min((b + 1) * per, n)))
        if held.get(layer, set()) != want:
            out.append(f"layer {layer}: rank {rank} holds experts {sorted(held.get(layer, set()))}, its EP block "
                       f"({b} of {moe_ep}) is {sorted(want)}")
    return out

