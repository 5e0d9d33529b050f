"""ONNX graph work of the quantized export: int8 weights behind DequantizeLinear (the fake-quant model), the AMCT
deploy form (AscendQuant / int8 MatMul / int32 quant_bias / AscendDequant) and the AMCT record file.

Facts and their sources: docs/amct_facts.md (F1-F11). In short:
  AscendQuant    y_int8 = round(x * scale + offset), scale = 1 / scale_d, offset = offset_d (round half to even);
                 attrs scale, offset (FLOAT), sqrt_mode (INT, set when scale leaves float16's range: scale stored
                 square-rooted), round_mode (STRING "Round"); domain ai.onnx at the model's opset.
  AscendDequant  y = x_int32 * deq_scale, deq_scale = scale_d * scale_w as uint64 (the float32 bits in the low 32
                 bits, the high 32 bits zero); attrs sqrt_mode, relu_flag (INT 0), dtype (INT, 0 = float32).
  weights        int8 [k, n] (MatMul's B, the float graph's layout = the quantize output's [n, k] transposed);
                 every tensor of 1 KiB or more in `<model>.external` beside the deploy model, which ATC reads.
Everything here works on (ModelProto without weights, {name: numpy array}) so it is testable without torch.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper

from dsconv.io.onnx_data import EMBED_BELOW, ExternalDataWriter

FP16_MAX = 65504.0
DQ_SUFFIX = "_dq"


def deq_scale_uint64(deq: np.ndarray) -> np.ndarray:
    """float32 deq_scale -> uint64 with its bit pattern in the low 32 bits (CANN's AscendDequant input)."""
    bits = np.ascontiguousarray(deq, np.float32).view(np.uint32)
    return bits.astype(np.uint64)


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            out.setdefault(name, []).append(node)
    return out


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {o: node for node in graph.node for o in node.output}


# ---------------------------------------------------------------------------------------------- fake quant
def int8_weights(model: onnx.ModelProto, arrays: dict[str, np.ndarray], layers: dict, fused: dict) -> dict[str, str]:
    """Replace each quantized linear's float weight by its int8 tensor + DequantizeLinear (per output channel), and
    each quantized fused expert parameter by int8 [E*rows, k] + DequantizeLinear + Reshape. Returns graph weight
    name -> module (or fused parameter) name."""
    graph = model.graph
    cons = _consumers(graph)
    by_name: dict[str, tuple[str, int]] = {}
    for P in layers:
        by_name[P + ".weight.T"] = (P, 1)   # MatMul's B, [k, n]: output channels on axis 1
        by_name[P + ".weight"] = (P, 0)     # an untransposed use, [n, k]
    new_nodes: list[onnx.NodeProto] = []
    done: dict[str, str] = {}
    for name in list(arrays):
        if name in by_name:
            P, axis = by_name[name]
            L = layers[P]
            arrays[name] = np.ascontiguousarray(L.q.T if axis == 1 else L.q)
            scale, zp = P + ".weight_scale", P + ".weight_zero_point"
            arrays[scale] = L.weight_scale.astype(np.float32)
            arrays[zp] = np.zeros(L.weight_scale.shape, np.int8)
            new_nodes.append(helper.make_node("DequantizeLinear", [name, scale, zp], [name + DQ_SUFFIX],
                                              name=f"{P}/weight_dequant", axis=axis))
            done[name] = P
        elif name in fused:
            F = fused[name]
            E, rows, k = F.q.shape
            arrays[name] = np.ascontiguousarray(F.q.reshape(E * rows, k))
            scale, zp, shape = name + ".weight_scale", name + ".weight_zero_point", name + ".shape"
            arrays[scale] = F.scale.reshape(-1).astype(np.float32)
            arrays[zp] = np.zeros(E * rows, np.int8)
            arrays[shape] = np.array([E, rows, k], np.int64)
            new_nodes.append(helper.make_node("DequantizeLinear", [name, scale, zp], [name + "_dq2d"],
                                              name=f"{name}/weight_dequant", axis=0))
            new_nodes.append(helper.make_node("Reshape", [name + "_dq2d", shape], [name + DQ_SUFFIX],
                                              name=f"{name}/weight_reshape"))
            done[name] = name
        else:
            continue
        for node in cons.get(name, []):
            for i, inp in enumerate(node.input):
                if inp == name:
                    node.input[i] = name + DQ_SUFFIX
    nodes = new_nodes + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    return done


# ---------------------------------------------------------------------------------------------- deploy
def to_deploy(model: onnx.ModelProto, arrays: dict[str, np.ndarray], layers: dict, fused: dict,
              float_type: int = TensorProto.FLOAT) -> dict[str, int]:
    """Rewrite a fake-quant graph (from int8_weights) in place into AMCT's deploy form; returns node counts."""
    graph = model.graph
    prods = _producers(graph)
    cons = _consumers(graph)
    drop: set[int] = set()
    new: list[tuple[int, list[onnx.NodeProto]]] = []  # (index of the replaced MatMul, its replacement)
    index = {id(n): i for i, n in enumerate(graph.node)}
    counts = {"AscendQuant": 0, "AscendDequant": 0, "int8_matmul": 0, "weight_dequant": 0}
    for P, L in layers.items():
        wname = next((n for n in (P + ".weight.T", P + ".weight") if n in arrays), None)
        if wname is None:
            continue
        if L.qtype != "W8A8":
            continue
        dq_w = prods[wname + DQ_SUFFIX]
        users = cons.get(wname + DQ_SUFFIX, [])
        if wname != P + ".weight.T" or len(users) != 1 or users[0].op_type != "MatMul":
            raise RuntimeError(f"{P}: expected one MatMul on the transposed weight, found "
                               f"{[u.op_type for u in users]}")
        mm = users[0]
        dq_a = prods.get(mm.input[0])
        q_a = prods.get(dq_a.input[0]) if dq_a is not None else None
        if dq_a is None or dq_a.op_type != "DequantizeLinear" or q_a is None or q_a.op_type != "QuantizeLinear":
            raise RuntimeError(f"{P}: the MatMul's input is not QuantizeLinear -> DequantizeLinear")
        out = mm.output[0]
        after = cons.get(out, [])
        bias_add = None
        if len(after) == 1 and after[0].op_type == "Add" and (P + ".bias") in after[0].input:
            bias_add = after[0]
            out = bias_add.output[0]
            drop.add(id(bias_add))
            arrays.pop(P + ".bias", None)
        scale = 1.0 / L.input_scale
        sqrt_mode = scale > FP16_MAX
        attrs = {"scale": float(math.sqrt(scale) if sqrt_mode else scale), "offset": float(L.input_offset),
                 "sqrt_mode": int(sqrt_mode), "round_mode": "Round"}
        xq, acc, acc_b = f"{P}/x_int8", f"{P}/acc_int32", f"{P}/acc_bias_int32"
        qb, deq = P + ".quant_bias", P + ".deq_scale"
        arrays[qb] = L.quant_bias.astype(np.int32)
        arrays[deq] = deq_scale_uint64(L.deq_scale)
        for n in (P + ".weight_scale", P + ".weight_zero_point"):
            arrays.pop(n, None)
        repl = [helper.make_node("AscendQuant", [q_a.input[0]], [xq], name=f"{P}/AscendQuant", **attrs),
                helper.make_node("MatMul", [xq, wname], [acc], name=f"{P}/MatMul"),
                helper.make_node("Add", [acc, qb], [acc_b], name=f"{P}/quant_bias"),
                helper.make_node("AscendDequant", [acc_b, deq], [out], name=f"{P}/AscendDequant", sqrt_mode=0,
                                 relu_flag=0, dtype=0 if float_type == TensorProto.FLOAT else 1)]
        new.append((index[id(mm)], repl))
        drop.update({id(mm), id(dq_w)})
        if len(cons.get(dq_a.output[0], [])) == 1:
            drop.add(id(dq_a))
            if len(cons.get(q_a.output[0], [])) == 1:
                drop.add(id(q_a))
        counts["AscendQuant"] += 1
        counts["AscendDequant"] += 1
        counts["int8_matmul"] += 1
    # weight-only and per-token layers: int8 weight -> Cast -> Mul (ATC folds it; DequantizeLinear is not in CANN's
    # ONNX operator list)
    casts: list[tuple[int, list[onnx.NodeProto]]] = []
    for node in graph.node:
        if node.op_type != "DequantizeLinear" or id(node) in drop or node.input[0] not in arrays:
            continue
        w, scale, zp = node.input
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        s = arrays[scale]
        if axis == 0:
            arrays[scale] = s.reshape(-1, *([1] * (arrays[w].ndim - 1)))
        arrays.pop(zp, None)
        casts.append((index[id(node)], [
            helper.make_node("Cast", [w], [w + "_float"], name=f"{node.name}/cast", to=float_type),
            helper.make_node("Mul", [w + "_float", scale], [node.output[0]], name=f"{node.name}/scale")]))
        drop.add(id(node))
        counts["weight_dequant"] += 1
    by_index = dict(new + casts)
    nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(graph.node):
        if i in by_index:
            nodes.extend(by_index[i])
        if id(node) not in drop:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    _drop_dead(graph)
    live = {i for n in graph.node for i in n.input}
    for name in [n for n in arrays if n not in live]:
        del arrays[name]
    return counts


def _drop_dead(graph: onnx.GraphProto) -> None:
    """Remove nodes whose outputs nobody reads (the activation quantizers' constants, unused Q/DQ)."""
    outputs = {o.name for o in graph.output}
    while True:
        used = {i for n in graph.node for i in n.input} | outputs
        keep = [n for n in graph.node if any(o in used for o in n.output)]
        if len(keep) == len(graph.node):
            return
        del graph.node[:]
        graph.node.extend(keep)


# ---------------------------------------------------------------------------------------------- files
_NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
               np.dtype(np.int8): TensorProto.INT8, np.dtype(np.int32): TensorProto.INT32,
               np.dtype(np.int64): TensorProto.INT64, np.dtype(np.uint64): TensorProto.UINT64,
               np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.bool_): TensorProto.BOOL}


def save(model: onnx.ModelProto, arrays: dict[str, np.ndarray], path: Path, external: str | None,
         align: int = 4096) -> list[str]:
    """Write `model` with `arrays` as initializers (in graph order of first use, then the rest): inline, or every
    tensor of EMBED_BELOW bytes or more in `external` beside it. Returns the file names written."""
    graph = model.graph
    del graph.initializer[:]
    order = list(dict.fromkeys([i for n in graph.node for i in n.input if i in arrays] + list(arrays)))
    writer = ExternalDataWriter(path.parent / external, align=align) if external else None
    try:
        for name in order:
            a = np.ascontiguousarray(arrays[name])
            t = TensorProto()
            t.name = name
            t.dims.extend(a.shape)
            t.data_type = _NP_TO_ONNX[a.dtype]
            if writer is not None and a.nbytes >= EMBED_BELOW:
                writer.write(t, [a.reshape(-1).view(np.uint8)])
            else:
                t.raw_data = a.tobytes()
            graph.initializer.append(t)
    finally:
        if writer is not None:
            writer.close(fsync=True)
    path.write_bytes(model.SerializeToString())
    return [path.name] + ([external] if external else [])


def record_text(layers: dict) -> str:
    """AMCT's record file (protobuf text of ScaleOffsetRecord, amct_onnx/proto/scale_offset_record_onnx.proto) for
    the static W8A8 layers: scale_d / offset_d per layer, scale_w / offset_w per output channel."""
    lines = []
    for P, L in layers.items():
        if L.qtype != "W8A8":
            continue
        lines += ["record {", f'  key: "{P}"', "  value {", f"    scale_d: {_f(L.input_scale)}",
                  f"    offset_d: {int(L.input_offset)}"]
        lines += [f"    scale_w: {_f(s)}" for s in L.weight_scale]
        lines += ["    offset_w: 0" for _ in L.weight_scale]
        lines += ["  }", "}"]
    return "\n".join(lines) + ("\n" if lines else "")


def _f(x: float) -> str:
    return repr(float(np.float32(x)))


def op_counts(nodes: Iterable[onnx.NodeProto]) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in nodes:
        out[n.op_type] = out.get(n.op_type, 0) + 1
    return dict(sorted(out.items()))
