"""What preflight needs to know about an ONNX model, read from its header alone.

Why `load_external_data=False`: a 100 GB export keeps its weights in external data files; the graph, the initializer
shapes and dtypes and the external-data byte ranges are all in the small .onnx protobuf, so every rule runs on that
and the weights are never read (plan from headers). Sizes come from shapes x dtype sizes and external-data lengths.
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import onnx
from onnx import TensorProto, helper

from dsconv.errors import UserError
from dsconv.io.onnx_data import external_location, opset_of

FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
QUANT_OPS = {"QuantizeLinear", "DequantizeLinear", "MatMulInteger", "ConvInteger", "QLinearMatMul", "QLinearConv",
             "DynamicQuantizeLinear", "MatMulNBits", "AscendQuant", "AscendDequant", "AscendAntiQuant"}
INT8_TYPES = {TensorProto.INT8, TensorProto.UINT8, TensorProto.INT4, TensorProto.UINT4}


def dtype_name(data_type: int) -> str:
    return TensorProto.DataType.Name(data_type)


def dtype_nbytes(data_type: int, numel: int) -> int:
    if data_type in (TensorProto.INT4, TensorProto.UINT4):
        return (numel + 1) // 2
    if data_type in (TensorProto.STRING, TensorProto.UNDEFINED):
        return 0
    return numel * helper.tensor_dtype_to_np_dtype(data_type).itemsize


@dataclass(frozen=True)
class InitializerInfo:
    """An initializer (or Constant node value) as its header describes it."""

    name: str
    data_type: int
    shape: tuple[int, ...]
    nbytes: int
    location: str | None = None  # external data file, relative to the model
    offset: int = 0
    length: int | None = None


@dataclass(frozen=True)
class ValueInfo:
    name: str
    elem_type: int
    dims: tuple[int | str | None, ...]  # int = static size, str = dim_param, None = unknown


@dataclass
class ModelInfo:
    path: Path
    file_size: int
    opset: int
    other_domains: dict[str, int]
    inputs: list[ValueInfo]
    outputs: list[ValueInfo]
    initializers: list[InitializerInfo]
    constants: list[InitializerInfo]
    nodes_by_type: dict[str, list[str]]  # "domain::OpType" for non-default domains
    elem_types: dict[str, int]  # every tensor name whose type is known (after shape inference)
    producers: dict[str, tuple[str, str, int]]  # tensor -> (op type, node name, output index)
    consumers: dict[str, list[tuple[str, str, int]]]  # tensor -> [(op type, node name, input index)]
    nodes: list[onnx.NodeProto] = field(default_factory=list, repr=False)

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.initializers) + sum(t.nbytes for t in self.constants)

    @property
    def inline_bytes(self) -> int:
        """Bytes held inside the .onnx protobuf itself (what the 2 GB protobuf limit applies to)."""
        return sum(t.nbytes for t in (*self.initializers, *self.constants) if t.location is None)

    @property
    def external_files(self) -> dict[str, int]:
        """External data file -> bytes it must hold (max offset + length)."""
        need: dict[str, int] = defaultdict(int)
        for t in self.initializers:
            if t.location is not None:
                need[t.location] = max(need[t.location], t.offset + (t.length if t.length is not None else t.nbytes))
        return dict(need)

    @property
    def quant_evidence(self) -> list[str]:
        ops = sorted(op for op in self.nodes_by_type if op in QUANT_OPS)
        ints = [t.name for t in self.initializers if t.data_type in INT8_TYPES]
        ev = [f"{op} nodes" for op in ops]
        if ints:
            ev.append(f"{len(ints)} int8/int4 initializer(s) e.g. {ints[0]}")
        return ev

    @property
    def deploy_int8(self) -> dict[str, int]:
        """AMCT deploy form: counts of its Ascend quantization nodes and int8 initializers ({} for other models)."""
        asc = {op: len(self.nodes_by_type.get(op, [])) for op in ("AscendQuant", "AscendDequant", "AscendAntiQuant")}
        if not any(asc.values()):
            return {}
        asc["int8_initializers"] = sum(1 for t in self.initializers if t.data_type == TensorProto.INT8)
        return asc

    @property
    def bf16_evidence(self) -> list[str]:
        ev = [f"initializer {t.name}" for t in self.initializers if t.data_type == TensorProto.BFLOAT16][:3]
        ev += [f"input {v.name}" for v in self.inputs if v.elem_type == TensorProto.BFLOAT16]
        for node in self.nodes:
            if node.op_type == "Cast" and any(a.name == "to" and a.i == TensorProto.BFLOAT16 for a in node.attribute):
                ev.append(f"Cast node {node.name or node.output[0]} to BFLOAT16")
                break
        return ev

    def float_dtype(self) -> str:
        """The dominant float dtype of the weights (by bytes): FLOAT, FLOAT16, BFLOAT16 or none."""
        by: dict[int, int] = defaultdict(int)
        for t in self.initializers:
            if t.data_type in FLOAT_TYPES:
                by[t.data_type] += t.nbytes
        return dtype_name(max(by, key=by.get)) if by else "none"


def _initializer_info(t: TensorProto) -> InitializerInfo:
    numel = 1
    for d in t.dims:
        numel *= d
    nbytes = dtype_nbytes(t.data_type, numel)
    ext = external_location(t)
    if ext is not None:
        location, offset, length = ext
        return InitializerInfo(t.name, t.data_type, tuple(t.dims), length if length is not None else nbytes,
                          location, offset, length)
    return InitializerInfo(t.name, t.data_type, tuple(t.dims), nbytes)


def _value_info(v: onnx.ValueInfoProto) -> ValueInfo:
    tt = v.type.tensor_type
    dims: list[int | str | None] = []
    if tt.HasField("shape"):
        for d in tt.shape.dim:
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(int(d.dim_value))
            elif d.HasField("dim_param") and d.dim_param:
                dims.append(d.dim_param)
            else:
                dims.append(None)
    return ValueInfo(v.name, tt.elem_type, tuple(dims))


def walk_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node, subgraphs (If/Loop/Scan bodies) included."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from walk_nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from walk_nodes(g)


def read_model(path: Path) -> ModelInfo:
    """Parse the .onnx header (never the external weights) and collect every fact the rules use."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"ONNX model {path} does not exist", hint="pass --onnx FILE or run `dsconv export` first")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises DecodeError and friends
        raise UserError(f"{path} is not a readable ONNX model ({type(e).__name__})",
                        hint="re-export it; a model over 2 GB must be saved with external data") from None
    g = model.graph
    opset = opset_of(model)
    other = {imp.domain: imp.version for imp in model.opset_import if imp.domain not in ("", "ai.onnx")}
    if not opset:
        raise UserError(f"{path} declares no ai.onnx opset", hint="re-export it with an opset_version")
    init_names = {t.name for t in g.initializer}
    nodes = list(walk_nodes(g))
    by_type: dict[str, list[str]] = defaultdict(list)
    producers: dict[str, tuple[str, str, int]] = {}
    consumers: dict[str, list[tuple[str, str, int]]] = defaultdict(list)
    constants: list[InitializerInfo] = []
    for i, node in enumerate(nodes):
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        name = node.name or f"{node.op_type}_{i}"
        by_type[key].append(name)
        for j, out in enumerate(node.output):
            producers[out] = (node.op_type, name, j)
        for j, inp in enumerate(node.input):
            if inp:
                consumers[inp].append((node.op_type, name, j))
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
                    constants.append(_initializer_info(attr.t))
    elem_types = infer_types(model)
    for t in g.initializer:
        elem_types.setdefault(t.name, t.data_type)
    return ModelInfo(
        path=path, file_size=os.path.getsize(path), opset=opset, other_domains=other,
        inputs=[_value_info(v) for v in g.input if v.name not in init_names],
        outputs=[_value_info(v) for v in g.output],
        initializers=[_initializer_info(t) for t in g.initializer], constants=constants,
        nodes_by_type=dict(by_type), elem_types=elem_types, producers=producers, consumers=dict(consumers),
        nodes=nodes,
    )


def infer_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor ONNX shape inference can type (works without the external weights)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    except Exception:  # inference is a help, never a gate: fall back to the declared types
        inferred = model
    g = inferred.graph
    types: dict[str, int] = {}
    for v in (*g.input, *g.output, *g.value_info):
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
            types[v.name] = v.type.tensor_type.elem_type
    for node in walk_nodes(g):
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
                    types[node.output[0]] = attr.t.data_type
    return types
