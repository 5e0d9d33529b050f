"""vLLM-Ascend's check against the source: every written weight, decoded by the format's rules, compared with the
float source tensor of the same name, position by position.

Runs in the vLLM-Ascend environment (imports nothing from dsconv). vllm_loader.py proves that the engine puts every
written tensor, bit for bit, in the part of the parameter its name maps to (vLLM's stacked_params_mapping, its fused
experts): so what the engine holds at a name's place is what is written under that name, and the question left is
whether what is written under a name is that name's source. A writer that put up_proj's rows under gate_proj's name,
swapped k and v, exchanged two experts, permuted a head's rows, packed nibbles the other way or wrote a scale 8x too
small passes the placement check and fails here. The decoding is the format description's (docs/formats.md,
docs/formats/w4a8.md), written here, never dsconv's; the comparison is mindie_match's (half a quantization step per
element, SmoothQuant's scales through the written norms, which the placement check proved held bit for bit, the clip
bound), with the source row at the same name and row in place of MindIE's float load.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

import mindie_held as mh
import mindie_match as mm
import mindie_reference as mr

QUANTIZED = ("W8A8", "W8A8_MIX", "W8A8_DYNAMIC", "W8A16", "W4A16", "W4A8_DYNAMIC", "W4A4_DYNAMIC")
# vLLM-Ascend's W4A4_DYNAMIC linear packs its int8 weight to int4 at load (npu_convert_weight_to_int4pack,
# quantization/methods/w4a4_laos_dynamic.py): a value outside int4 would not survive that
INT4_IN_INT8 = ("W4A4_DYNAMIC",)


def _unpack_rows(packed: np.ndarray) -> np.ndarray:
    """int4 pairs packed along the output dim, [n/2, k] -> [n, k] (the even row in the low nibble)."""
    return mh.unpack_int4(packed.T).T


def written_held(ck: dict[str, torch.Tensor], desc: dict[str, str], model_dtype: Any) -> tuple[list, list[str]]:
    """Every written weight matrix as mindie_held.Held (a quantized one's effective rows by the kernel's arithmetic,
    a float one as written); problems where a written form decodes to nothing a kernel runs."""
    out, problems = [], []
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in ck.items():
        module, _, leaf = k.rpartition(".")
        by_module.setdefault(module, {})[leaf] = v
    for name in sorted(ck):
        kind = desc.get(name)
        if not name.endswith(".weight") or ck[name].dim() != 2:
            continue
        base = name[:-len(".weight")]
        w = ck[name]
        if w.is_floating_point():  # a float matrix: source_problems compares it
            if kind in QUANTIZED:
                problems.append(f"{name} ({kind}): a float tensor under a quantized type")
            continue
        if kind not in QUANTIZED:
            continue
        buf = by_module[base]
        try:
            if kind in ("W8A8", "W8A8_MIX"):
                h = mh._w8a8(base, w, buf, False, "W8A8_PDMIX" if kind == "W8A8_MIX" else "W8A8", None)
                if kind == "W8A8_MIX":
                    h.problems += mh._paths_differ(h, mh._antiquant(base, w, buf, False, "W8A8_PDMIX"))
            elif kind == "W4A8_DYNAMIC":
                h = _w4a8(base, w, buf)
            elif kind == "W4A16":
                h = _w4a16(base, w, buf)
            else:  # written offsets are subtracted (w = (q - offset) * scale): Held adds them, as the kernels do
                neg = {**buf, **({"weight_offset": -buf["weight_offset"]} if "weight_offset" in buf else {})}
                h = mh._antiquant(base, w, neg, False, kind)
                if kind in INT4_IN_INT8 and bool(((w < -8) | (w > 7)).any()):
                    h.problems.append(f"{int(((w < -8) | (w > 7)).sum())} values outside int4 [-8, 7] in an int8 "
                                      "weight the engine packs to int4 at load")
        except (ValueError, KeyError) as e:
            problems.append(f"{name} ({kind}): does not decode: {e}")
            continue
        h.module = base
        out.append(h)
        problems += [f"{base} ({kind}): {p}" for p in h.problems]
    return out, problems


def _w4a8(base: str, w: torch.Tensor, buf: dict) -> mh.Held:
    """W4A8_DYNAMIC (msModelSlim): int4 packed along the output dim [n/2, k], weight_scale [n, 1], scale_bias
    [n, chunks] = 8 * scale * the sum of each chunk's int4 values (the A8W4 kernel's correction)."""
    q = _unpack_rows(mh._np(w))
    R, K = q.shape
    sc = mh.scale_values(buf["weight_scale"]).reshape(-1)
    h = mh.Held(base, "W4A8_DYNAMIC", q, mh.per_row(sc, R, K), np.zeros((R, K)), None,
                raw={"weight_scale": sc[:, None]})
    sb = mh._np(buf["scale_bias"]).reshape(R, -1)
    want = 8.0 * sc[:, None] * q.reshape(R, sb.shape[1], -1).sum(axis=-1)
    if not np.allclose(sb, want, rtol=2.0 ** -10, atol=1e-6 * float(np.abs(want).max() + 1e-30)):
        h.problems.append(f"scale_bias is not 8 * scale * sum(w) per chunk: worst difference "
                          f"{float(np.abs(sb - want).max()):.3g}")
    return h


def _w4a16(base: str, w: torch.Tensor, buf: dict) -> mh.Held:
    """W4A16: per group int4 pairs of output rows [n/2, k], per channel pairs along k [n, k/2] (told apart by the
    scale's shape); weight_scale / weight_offset [n, groups], offsets subtracted."""
    sc = mh._np(buf["weight_scale"]).astype(np.float64)
    n = sc.shape[0]
    packed = mh._np(w)
    q = _unpack_rows(packed) if packed.shape[0] * 2 == n else mh.unpack_int4(packed)
    R, K = q.shape
    off = -mh._np(buf["weight_offset"]) if "weight_offset" in buf else np.zeros_like(sc)
    g = sc.reshape(R, -1)
    h = mh.Held(base, "W4A16", q, np.repeat(g, K // g.shape[1], 1), np.repeat(off.reshape(R, -1), K // g.shape[1], 1),
                None, raw={"weight_scale": g})
    return h


def _float_rows(name: str, t: torch.Tensor, source: np.ndarray | None, chunk: int = 4096) -> list[str]:
    """A float matrix against its source cast to the written dtype, a block of rows at a time (an embedding of a
    150k vocabulary is 1 GB in float64): equal, or the first rows that differ."""
    if source is None:
        return [f"{name}: written, but the source has no such tensor"]
    if tuple(source.shape) != tuple(t.shape):
        return [f"{name}: written {list(t.shape)}, the source's is {list(source.shape)}"]
    bad = []
    for a in range(0, t.shape[0], chunk):
        want = torch.from_numpy(source[a:a + chunk]).to(t.dtype)
        diff = (want != t[a:a + chunk]).any(dim=1)
        bad += (torch.nonzero(diff).flatten() + a).tolist()[:3 - len(bad)] if diff.any() else []
        if len(bad) >= 3:
            break
    return [f"{name}: rows {bad} differ from the source's"] if bad else []


def source_problems(directory: Path, ck: dict[str, torch.Tensor], desc: dict[str, str], dtype: Any,
                    source: Path | None = None, norm_offset: float | None = None) -> tuple[list[str], float, bool]:
    """(problems, the largest clipped fraction of a linear, whether a source was found): every written quantized
    weight against the source the output's manifest names (or `source`); `norm_offset`: what the engine's norms add
    to their weight (None: as mindie_match.norm_offset reads config.json)."""
    if source is None:
        f = directory / "dsconv_manifest.json"
        inputs = json.loads(f.read_text()).get("inputs", []) if f.is_file() else []
        source = Path(inputs[0]) if inputs else None
    if source is None or not (source / "config.json").is_file():
        return [], 0.0, False
    model_dtype = getattr(torch, str(dtype).replace("torch.", "")) if isinstance(dtype, str) else dtype
    held, problems = written_held(ck, desc, model_dtype)

    def read(paths: list[Path]) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        for p in paths:
            out.update(load_file(str(p)))
        return out

    # the source as a float load in the model dtype holds it (a float32 source of `quantize --dtype bf16` is read
    # cast, as that quantize read it): norms and SmoothQuant's factors included, not only the weights compared
    weights = {n: (t.to(model_dtype) if model_dtype is not None else t).to(torch.float64).numpy() for n, t in
               mr.source_tensors(sorted(source.glob("*.safetensors")), read, ck).items() if t.is_floating_point()}
    cfg = json.loads((directory / "config.json").read_text())
    src = mm.Source(weights, ck, desc, dtype=model_dtype,
                    norm_offset=mm.norm_offset(cfg) if norm_offset is None else norm_offset)
    src.norms = {n: t.to(torch.float64).numpy() for n, t in ck.items()
                 if t.dim() == 1 and t.is_floating_point() and "norm" in n}
    for name, t in sorted(ck.items()):  # float matrices: embeddings, heads, routers, linears kept float
        if not (name.endswith(".weight") and t.dim() == 2 and t.is_floating_point()) or desc.get(name) in QUANTIZED:
            continue
        if src.norm_name(name) is None:  # nothing SmoothQuant could fold into: the source's values, row by row
            problems += _float_rows(name, t, weights.get(name))
        else:  # fed by a norm: through the comparison, whose products take a folded scale
            W = mh._np(t)
            bias = ck.get(name[:-len("weight")] + "bias")  # a float linear's written bias (GLM's MTP q/k/v)
            held.append(mh.Held(name[:-len(".weight")], "FLOAT", None, W, np.zeros_like(W),
                                None if bias is None else mh._np(bias), t.dtype))
    out = mm.compare_by_name(held, src)
    problems += out.value_mismatch + out.class_mismatch + out.lossy
    return problems, max(out.clipped.values(), default=0.0), True
