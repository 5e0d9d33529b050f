"""What MindIE holds after loading, as its kernels will compute with it.

Runs in the MindIE environment (imports nothing from dsconv). MindIE's own code has already read, cast, packed,
permuted, stacked, split and transposed every tensor; this module walks the modules it built and turns each linear's
held tensors into the weight its kernel multiplies by. The arithmetic restated here is the kernels' (docs/formats.md,
docs/formats/w4a8.md), never MindIE's weight logic:

- W8A8 (static):  y = (x_q @ w_q^T + quant_bias) * deq_scale,  x_q = round(x / input_scale + input_offset)
                  -> W = w_q * deq_scale / input_scale,  b = deq_scale * (quant_bias + input_offset * sum_k w_q)
- W8A8_DYNAMIC, W8A16, W4A16: W = (w_q + held offset) * weight_scale (MindIE holds offsets negated, as the
                  antiquant kernels add them), per channel or per group along k
- W4A8_DYNAMIC:   W = w_int4 * scale; the held bias is the A8W4 kernel's correction 8 * scale * sum_k w_int4
- FLOAT:          W as held.
A scale held as int64 is the float32 bit pattern in its low 32 bits (MindIE's own decode,
atb/utils/quantize/w8a8.py::_transform_deqscale_dtype_to_float).

mindie_match.py then compares every held row with the float source.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")
# what the W8A8 kernel reads deq_scale as, per model dtype (MindIE keeps a bf16 model's float32 deq_scale,
# atb/utils/weights.py::correct_tensor_dtype; a float16 model's is the int64 word, atb/utils/quantize/w8a8.py)
DEQ_DTYPE = {torch.bfloat16: torch.float32, torch.float16: torch.int64}


def layer_of(name: str) -> int | None:
    m = LAYER_RE.search(name)
    return int(m.group(1)) if m else None


@dataclass
class Held:
    """One linear as MindIE holds it: the kind its kernel runs (MindIE's linear_desc), its effective weight rows."""
    module: str
    kind: str
    q: np.ndarray | None          # integer weight [R, K] (None: a float weight)
    scale: np.ndarray             # [R, K] per-element dequantization factor (the float weight itself for FLOAT)
    offset: np.ndarray            # [R, K] added to q before scaling
    bias: np.ndarray | None       # [R] effective bias, or None
    w_dtype: Any = None           # a float weight's held dtype (its rounding)
    raw: dict = field(default_factory=dict)   # held scales per row, as the kernel reads them (vs the written ones)
    embed: bool = False           # an embedding (checked by value, not by description type)
    alt: "Held | None" = None     # a 3-D float weight's other orientation (no transpose flag tells)
    problems: list = field(default_factory=list)
    tensors: dict = field(default_factory=dict)  # the module's own tensors (to find them in the graph's list)

    @cached_property
    def W(self) -> np.ndarray:
        return self.scale if self.q is None else (self.q + self.offset) * self.scale


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy() if t.is_floating_point() else t.detach().numpy().astype(np.int64)


def scale_values(t: torch.Tensor) -> np.ndarray:
    """A held or written scale as float64; an int64 word's low 32 bits read as float32."""
    if t.dtype != torch.int64:
        return _np(t)
    return (t.detach().numpy().astype(np.int64) & 0xFFFFFFFF).astype(np.uint32).view(np.float32).astype(np.float64)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """Two's-complement int4 pairs in int8 bytes along the last axis, the even element in the low nibble."""
    u = packed.astype(np.int64) & 0xFF
    lo, hi = ((u & 0x0F) ^ 8) - 8, ((u >> 4) ^ 8) - 8
    return np.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def rows(t: np.ndarray, transposed: bool) -> np.ndarray:
    """[.., n, k] (or [.., k, n] when transposed) -> [R, k] output rows, stacked experts flattened."""
    if transposed:
        t = np.swapaxes(t, -1, -2)
    return t.reshape(-1, t.shape[-1])


def per_row(v: np.ndarray, R: int, K: int) -> np.ndarray:
    v = v.reshape(-1)
    if v.size != R:
        raise ValueError(f"{v.size} scales for {R} rows")
    return np.broadcast_to(v[:, None], (R, K))


def linear_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every linear MindIE built (atb_llm modules carry `linear_desc`; the runtime path's layers a `quant_method`
    adapter whose get_linear_descs says what the kernel runs) and the embeddings, as module objects: taken before
    init_ascend_weight, which may fuse their tensors (DeepSeek's q_a + kv_a) or drop them from the model (Mixtral's
    experts) once handed to the graph."""
    return [(name, m) for name, m in model.named_modules() if _desc_of(m)[0] is not None]


def held_linears(modules: list[tuple[str, torch.nn.Module]], model_dtype: Any) -> tuple[list[Held], list[str]]:
    """What each module holds now, as its kernel computes with it; problems where a held form is not one a kernel
    can run (e.g. a float weight under a quantized desc). A module left with a placeholder weight (its rows moved into
    another module's tensor) is skipped."""
    out, problems = [], []
    for name, m in modules:
        desc, transposed = _desc_of(m)
        if desc is None:
            continue
        try:
            h = _held(name, m, desc, transposed, model_dtype)
        except (ValueError, KeyError, AttributeError, RuntimeError) as e:
            problems.append(f"{name}: held as {desc}, but {e}")
            continue
        h.tensors = _buffers(m)
        out.append(h)
        problems += [f"{name} ({h.kind}): {p}" for p in h.problems]
    return out, problems


def _desc_of(m: torch.nn.Module) -> tuple[str | None, bool]:
    w = getattr(m, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() < 2:
        return None, False
    desc, trans = getattr(m, "linear_desc", None), getattr(m, "trans_flag", None)
    qm = getattr(m, "quant_method", None)
    if desc is None and qm is not None and hasattr(qm, "get_linear_descs"):
        descs = qm.get_linear_descs(m)
        trans = qm.get_weight_transpose_type(m)
        if isinstance(descs, (list, tuple)):
            names = {d.name for d in descs}
            desc = descs[0] if len(names) == 1 else "mixed:" + ",".join(sorted(names))
        else:
            desc = descs
    if desc is None:  # a float weight MindIE uses directly (embeddings; Qwen2-MoE's QwenSharedExpertGate)
        if not w.is_floating_point():
            return None, False
        return ("EMBED" if type(m).__name__.endswith("Embedding") else "FLOAT"), False
    name = desc if isinstance(desc, str) else desc.name
    # TransposeType.TRANSPOSE (1): held [n, k]; NOT_TRANSPOSE (0): held [k, n] (atb/utils/quantize/pack_type.py)
    return ("FLOAT" if name in ("FLOAT16", "BFLOAT16") else name), trans is not None and int(trans) == 0


def _buffers(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = dict(m.named_buffers(recurse=False))
    out.update({k: v.data for k, v in m.named_parameters(recurse=False)})
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


def _held(name: str, m: torch.nn.Module, kind: str, transposed: bool, model_dtype: Any) -> Held:
    w = m.weight.data
    buf = _buffers(m)
    if kind in ("FLOAT", "EMBED"):
        if not w.is_floating_point():
            raise ValueError(f"its weight is {w.dtype}")
        W = rows(_np(w), transposed)
        b = buf.get("bias")
        bias = _np(b).reshape(-1) if b is not None and b.numel() == W.shape[0] else None
        alt = None
        if w.dim() == 3 and kind == "FLOAT":  # DeepSeek's k_b_proj / v_b_proj, split out of kv_b_proj
            A = rows(_np(w), not transposed)
            alt = Held(name, "FLOAT", None, A, np.zeros_like(A), None, w.dtype)
        return Held(name, "FLOAT", None, W, np.zeros_like(W), bias, w.dtype, embed=kind == "EMBED", alt=alt)
    if kind.startswith("mixed:"):
        raise ValueError("its sub-linears have different kinds")
    if w.is_floating_point():
        raise ValueError(f"its weight is {w.dtype}: the {kind} kernel reads int8")
    if kind in ("W8A8", "W8A8_PDMIX") and "deq_scale" in buf:
        h = _w8a8(name, w, buf, transposed, kind, model_dtype)
        if kind == "W8A8_PDMIX":  # the prefill graph's weights (W8A8_DYNAMIC's) must be the decode graph's
            h.problems += _paths_differ(h, _antiquant(name, w, buf, transposed, kind))
        return h
    if kind in ("W8A8_DYNAMIC", "W8A16", "W4A16", "W8A8_PDMIX"):
        return _antiquant(name, w, buf, transposed, kind)
    if kind == "W4A8_DYNAMIC":
        return _w4a8(name, w, buf)
    raise ValueError(f"no kernel arithmetic known here for {kind}")


def _w8a8(name: str, w: torch.Tensor, buf: dict, transposed: bool, kind: str, model_dtype: Any) -> Held:
    q = rows(_np(w), transposed)
    R, K = q.shape
    deq = scale_values(buf["deq_scale"]).reshape(-1)
    s_in = _np(buf["input_scale"]).reshape(-1)
    off_in = _np(buf["input_offset"]).reshape(-1)
    if R % s_in.size or off_in.size not in (0, s_in.size):
        raise ValueError(f"{s_in.size} input scales and {off_in.size} offsets for {R} rows")
    rep = R // s_in.size  # one input scale per module, or per expert of stacked experts
    s_in_r = np.repeat(s_in, rep)
    off_r = np.repeat(off_in, rep) if off_in.size else np.zeros(R)
    qb = _np(buf["quant_bias"]).reshape(-1) if buf.get("quant_bias") is not None else np.zeros(R)
    h = Held(name, kind, q, per_row(deq / s_in_r, R, K), np.zeros((R, K)), deq * (qb + off_r * q.sum(axis=1)),
             raw={"deq_scale": deq, "input_scale": s_in_r, "deq_half": 0.5 * np.abs(deq)})
    want = DEQ_DTYPE.get(model_dtype)
    if want is not None and buf["deq_scale"].dtype != want:
        h.problems.append(f"deq_scale held as {buf['deq_scale'].dtype}: the W8A8 kernel of a {model_dtype} model "
                          f"reads {want}")
    return h


def _paths_differ(static: Held, dynamic: Held) -> list[str]:
    """A PD-mix linear's two paths (MindIE builds the prefill graph from weight/weight_scale/weight_offset and the decode
    graph from weight/deq_scale/input_scale): one int8 weight, so the per-row scales must agree (deq_scale is
    input_scale * weight_scale rounded to float32: 1e-6 relative), else one instance computes another model."""
    a, b = static.scale[:, 0], dynamic.scale[:, 0]
    bad = np.abs(a - b) > 1e-6 * np.abs(b) + 1e-30
    if dynamic.offset.any():
        return ["prefill path: nonzero weight_offset (the dynamic kernel is symmetric here)"]
    if not bad.any():
        return []
    k = int(np.argmax(np.abs(a - b) / (np.abs(b) + 1e-30)))
    return [f"decode path (deq_scale / input_scale) and prefill path (weight_scale) disagree on {int(bad.sum())} of "
            f"{bad.size} rows (row {k}: {a[k]:.6g} vs {b[k]:.6g})"]


def _antiquant(name: str, w: torch.Tensor, buf: dict, transposed: bool, kind: str) -> Held:
    # W4A16LinearStatic holds int4 pre-packed along the kernel's last dim (k per channel, n per group transposed)
    q = rows(unpack_int4(_np(w)) if kind == "W4A16" else _np(w), transposed)
    R, K = q.shape
    sc = scale_values(buf["weight_scale"])
    off = _np(buf["weight_offset"]) if buf.get("weight_offset") is not None else np.zeros_like(sc)
    if sc.size == R:
        scale = per_row(sc, R, K)
        offset = per_row(off, R, K) if off.size == R else np.zeros((R, K))
        raw = sc.reshape(R, 1)
    else:  # per group along k: [.., n, G], or [.., G, n] held transposed
        g = rows(sc, transposed)
        o = rows(off, transposed) if off.size == sc.size else np.zeros_like(g)
        if K % g.shape[1]:
            raise ValueError(f"{g.shape[1]} groups do not divide k = {K}")
        scale, offset, raw = np.repeat(g, K // g.shape[1], 1), np.repeat(o, K // g.shape[1], 1), g
    if scale.shape != q.shape:
        raise ValueError(f"its weight ({list(w.shape)}, {q.shape[0]} x {q.shape[1]} values) and weight_scale "
                         f"({list(buf['weight_scale'].shape)}) disagree: no kernel reads them together")
    b = buf.get("bias")
    bias = _np(b).reshape(-1) if b is not None and b.numel() == R else None
    return Held(name, kind, q, scale, offset, bias, raw={"weight_scale": raw})


def _w4a8(name: str, w: torch.Tensor, buf: dict) -> Held:
    """W4A8LinearDynamic (routed experts): weight [E, k, n/2] packed along n, scale [E, 1, n] int64 words,
    bias [E, n] (the written scale_bias summed over its k-chunks)."""
    q = rows(unpack_int4(_np(w)), True)
    R, K = q.shape
    sc = scale_values(buf["weight_scale"]).reshape(-1)
    h = Held(name, "W4A8_DYNAMIC", q, per_row(sc, R, K), np.zeros((R, K)), None, raw={"weight_scale": sc[:, None]})
    correction = _np(buf["bias"]).reshape(-1)
    expect = 8.0 * sc * q.sum(axis=1)
    if correction.size != R:
        h.problems.append(f"A8W4 correction of {correction.size} values for {R} rows")
    elif not np.allclose(correction, expect, rtol=2.0 ** -10, atol=1e-6 * float(np.abs(expect).max() + 1e-30)):
        h.problems.append(f"the A8W4 correction (bias) is not 8 * scale * sum(w): worst difference "
                          f"{float(np.abs(correction - expect).max()):.3g}")
    return h


# a PD-mix linear's tensors per graph: the prefill graph runs W8A8_DYNAMIC, the decode graph W8A8
# (flash_causal_llama.py / flash_causal_qwen2.py init_ascend_weight)
GRAPH_KEYS = {"prefill": ("weight", "weight_scale"), "decode": ("weight", "deq_scale", "input_scale", "quant_bias")}
ALL_KEYS = ("weight", "deq_scale", "weight_scale", "input_scale", "quant_bias")


def graph_problems(held: list[Held], graphs: dict[str, list[torch.Tensor]]) -> list[str]:
    """Every held linear's weight (and its scales) must be among the tensors the model hands its ATB graph
    (init_ascend_weight's list): what was compared is what the kernels get. A PD-mix linear's two sides each in
    their own graph's list (GRAPH_KEYS); a model without a decode list has one graph for everything."""
    out = []
    for graph_name, graph in graphs.items():
        ptrs = {(t.data_ptr(), tuple(t.shape)) for t in graph if isinstance(t, torch.Tensor)}
        digests = {(str(t.dtype), tuple(t.shape), _digest(t)) for t in graph if isinstance(t, torch.Tensor)}

        def handed(t: torch.Tensor) -> bool:
            return (t.data_ptr(), tuple(t.shape)) in ptrs or (str(t.dtype), tuple(t.shape), _digest(t)) in digests

        # GLM-4.5's causal LM builds a second, never-called TensorEmbedding of model.embed_tokens beside the model's
        # own (atb_llm/models/glm4_moe/flash_causal_glm4_moe.py __init__; the graph gets self.model.embed_tokens):
        # an embedding outside the list is fine where another embedding module is in it
        embed_handed = any(h.embed and handed(h.tensors["weight"]) for h in held if "weight" in h.tensors)
        for h in held:
            keys = GRAPH_KEYS[graph_name] if h.kind == "W8A8_PDMIX" else ALL_KEYS if graph_name == "prefill" else ()
            for key in keys:
                t = h.tensors.get(key)
                if t is None or handed(t) or (h.embed and embed_handed):
                    continue
                where = "ATB graph" if len(graphs) == 1 else f"ATB {graph_name} graph"
                out.append(f"{h.module}.{key}: not among the tensors handed to the {where}")
    if any(h.kind == "W8A8_PDMIX" for h in held) and "decode" not in graphs:
        out.append("a W8A8_PDMIX model without a decode graph weight list: its static side is never run")
    return out


def cache_problems(model: torch.nn.Module, written: dict[str, torch.Tensor], model_dtype: Any, rank: int
                   ) -> tuple[int, list[str]]:
    """The int8 KV cache's scales as MindIE holds them, against the written ones: C8 (KvCache: per-channel key and
    value scales in the model dtype, this rank's KV heads, offsets zero) and DeepSeek's FA3 (its qk dequant scale per
    head is fa_q.scale x fa_k.scale, its k scale fa_k.scale: a missing tensor silently becomes 1). (caches checked,
    problems)."""
    out, n = [], 0
    for name, m in model.named_modules():
        cls = type(m).__name__
        layer = layer_of(name)
        if cls not in ("KvCache", "FA3") or layer is None:
            continue
        n += 1
        attn = f"model.layers.{layer}.self_attn"
        if cls == "KvCache":
            for kv in ("k", "v"):
                want = written.get(f"{attn}.{kv}_proj.kv_cache_scale")
                held = getattr(m, f"{kv}_quant_scale", None)
                if want is None or held is None:
                    out.append(f"{name}: {kv} cache scale {'not written' if want is None else 'not held'}")
                    continue
                part = _rank_part(want.to(model_dtype).reshape(-1), held.numel(), rank)
                if not torch.equal(held.detach().reshape(-1).to(part.dtype), part):
                    out.append(f"{name}: {kv} cache scale held differs from {attn}.{kv}_proj.kv_cache_scale")
                off = getattr(m, f"{kv}_quant_offset", None)
                if off is not None and bool(off.abs().max() > 0):
                    out.append(f"{name}: {kv} cache offset held nonzero")
        else:
            q, k = written.get(f"{attn}.fa_q.scale"), written.get(f"{attn}.fa_k.scale")
            held = getattr(m, "qk_scale", None)
            if q is None or k is None or held is None:
                out.append(f"{name}: FA3 scales {'not written' if held is not None else 'not held'}")
                continue
            part = _rank_part((q.double() * k.double()).reshape(-1), held.numel(), rank)
            if not torch.allclose(held.detach().double().reshape(-1), part, rtol=2.0 ** -8, atol=0):
                out.append(f"{name}: FA3 qk scale held differs from fa_q.scale x fa_k.scale (worst "
                           f"{float((held.detach().double().reshape(-1) - part).abs().max()):.3g})")
    return n, out


def _rank_part(v: torch.Tensor, n: int, rank: int) -> torch.Tensor:
    """This rank's contiguous part of `v` when it holds n of its values (the whole of it when n covers it)."""
    if n >= v.numel() or v.numel() % n:
        return v[:n] if n <= v.numel() else v
    r = rank % (v.numel() // n)
    return v[r * n:(r + 1) * n]


def _digest(t: torch.Tensor) -> int:
    return hash(t.detach().contiguous().view(torch.uint8).numpy().tobytes()) if t.numel() else 0
