"""From the traced module to model.onnx (+ model.onnx_data) without a second copy of the weights in memory.

The TorchScript exporter runs with `export_params=False, do_constant_folding=False`: it then emits the graph alone,
with every parameter as a named graph input and no folded weight copies (constant folding would transpose every
Linear weight into a new tensor: a second model in RAM). This module then
  * turns those inputs into initializers named as in the checkpoint (`model.layers.0.mlp.down_proj.weight`),
    folding the `Transpose` in front of a weight into the stored tensor (`<name>.T`), one tensor at a time, so that
    MatMul sees a constant weight as quantizers and ATC expect;
  * keeps index arithmetic in int64 only (ATC rejects int32/int64 mixes): int32 constants and casts that only feed
    inputs accepting int64 are widened, and what remains is reported;
  * writes the file by streaming: weights either go to `model.onnx_data` (external data, 4 KiB-aligned offsets so
    onnxruntime can map them) or, for small models, into model.onnx itself as protobuf appends (a
    `ModelProto{graph{initializer}}` per tensor, framed by hand around the tensor's own memory: protobuf merges
    repeated fields of concatenated messages), so neither path ever copies the weights (a transposed weight is
    made contiguous one 16 MiB block at a time).
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from dsconv.errors import UserError
from dsconv.io.onnx_data import EMBED_BELOW, ExternalDataWriter, external_location, opset_of

EXTERNAL_DATA = "model.onnx_data"
ALIGN = 4096  # onnxruntime maps external tensors at page-aligned offsets
BLOCK = 16 * 2**20  # bytes of a transposed weight made contiguous at a time while writing
MAX_EXPORTER_OPSET = 18

_TORCH_TO_ONNX = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16,
                  torch.bfloat16: TensorProto.BFLOAT16, torch.float64: TensorProto.DOUBLE,
                  torch.int64: TensorProto.INT64, torch.int32: TensorProto.INT32, torch.int8: TensorProto.INT8,
                  torch.uint8: TensorProto.UINT8, torch.bool: TensorProto.BOOL}


@dataclass
class Weight:
    """One initializer to write: where its data comes from (a live torch tensor) and how it is laid out."""

    name: str
    source: torch.Tensor
    perm: tuple[int, ...] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        shape = tuple(self.source.shape)
        return tuple(shape[p] for p in self.perm) if self.perm else shape

    @property
    def nbytes(self) -> int:
        return self.source.numel() * self.source.element_size()

    def data(self) -> torch.Tensor:
        t = self.source.detach()
        if self.perm:
            t = t.permute(*self.perm)
        return t.contiguous()

    def chunks(self, scratch: torch.Tensor | None = None) -> Iterator[memoryview]:
        """The stored bytes in order, without a second copy of the tensor: untransposed contiguous tensors are their
        own memory; a transposed weight is made contiguous one block of its output rows at a time into `scratch`
        (bytes, reused for every block and weight: fresh 16 MiB blocks stayed in malloc's heap after the write), so
        writing the largest (the lm_head, transposed) costs one block. Each block is valid until the next is asked
        for."""
        t = self.source.detach()
        if not self.perm and t.is_contiguous():
            yield _bytes_view(t)
            return
        if self.perm:
            t = t.permute(*self.perm)
        if t.dim() == 0 or t.numel() == 0:
            yield _bytes_view(t.contiguous())
            return
        row = t[0].numel() * t.element_size()
        if scratch is None or scratch.numel() < row:
            scratch = torch.empty(max(BLOCK, row), dtype=torch.uint8)
        step = scratch.numel() // row
        for r in range(0, t.shape[0], step):
            n = min(step, t.shape[0] - r)
            block = scratch[: n * row].view(t.dtype).view(n, *t.shape[1:])
            block.copy_(t[r:r + n])
            yield _bytes_view(block)


def trace_checked(wrapper: torch.nn.Module, args: tuple, spec: Any, opset: int) -> tuple[onnx.ModelProto, int, str]:
    """Trace, unify integer types, convert to `opset` and refuse what ATC rejects: (graph, emitted opset, method).
    The float and the quantized exports share it so that both graphs meet the same ATC rules."""
    from dsconv.convert import onnx_opset
    from dsconv.errors import CheckFailed

    graph, emitted = trace_to_onnx(wrapper, args, spec.input_names, spec.output_names, spec.dynamic_axes(), opset)
    unify_integer_types(graph)
    graph, method = onnx_opset.convert_opset(graph, opset)
    left = int32_users(graph)
    if left:
        raise CheckFailed(f"the graph still mixes int32 and int64 ({len(left)} nodes, e.g. {left[0]}); ATC rejects "
                          "that (E89999)", hint="report the model type")
    check_graph(graph)
    return graph, emitted, method


def trace_to_onnx(wrapper: torch.nn.Module, args: tuple, input_names: list[str], output_names: list[str],
                  dynamic_axes: dict, opset: int) -> tuple[onnx.ModelProto, int]:
    """The weightless graph at `opset`, or at the lowest higher opset the exporter can emit (returned)."""
    last: Exception | None = None
    for version in range(opset, MAX_EXPORTER_OPSET + 1):
        buf = io.BytesIO()
        try:
            with warnings.catch_warnings(), torch.no_grad(), _silenced_fds(), _shape_inference_without_weights():
                warnings.simplefilter("ignore")
                torch.onnx.export(wrapper, args, buf, dynamo=False, export_params=False, do_constant_folding=False,
                                  keep_initializers_as_inputs=True,  # skips an O(n^2) value-dedup pass
                                  opset_version=version, input_names=input_names, output_names=output_names,
                                  dynamic_axes=dynamic_axes)
        except Exception as e:  # the exporter raises assorted types for "not at this opset"
            if "opset" not in str(e).lower() and "unsupported" not in str(e).lower():
                raise
            last = e
            continue
        return onnx.load_from_string(buf.getvalue()), version
    raise UserError(f"the ONNX exporter cannot emit this model at opset {opset}..{MAX_EXPORTER_OPSET} "
                    f"({str(last).splitlines()[0][:200]})", hint="report the model type; no opset works")


#: see _shape_inference_without_weights; tests turn it off to prove the graph does not change
LEAN_SHAPE_INFERENCE = True


@contextlib.contextmanager
def _shape_inference_without_weights() -> Iterator[None]:
    """torch's whole-graph ONNX shape inference copies every parameter into a temporary protobuf (~0.6x the weights,
    twice per export: the largest transient of the whole export). With export_params=False the parameters are graph
    inputs whose shapes and types the graph already carries, so the pass runs with an empty parameter map; the
    exported graph is identical (tests/test_export_onnx.py compares both)."""
    C = torch._C
    original = C._jit_pass_onnx_graph_shape_type_inference
    if not LEAN_SHAPE_INFERENCE:
        yield
        return

    def without_weights(graph, params_dict, *rest):
        return original(graph, {}, *rest)

    C._jit_pass_onnx_graph_shape_type_inference = without_weights
    try:
        yield
    finally:
        C._jit_pass_onnx_graph_shape_type_inference = original


@contextlib.contextmanager
def _silenced_fds() -> Iterator[None]:
    """The TorchScript exporter dumps the whole IR graph to the C++ streams when an opset is unsupported."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


def attach_weights(model: onnx.ModelProto, params: dict[str, torch.Tensor], strip_prefix: str = "model.") \
        -> list[Weight]:
    """Turn the parameter inputs of a weightless graph into planned initializers (no data touched yet)."""
    graph = model.graph
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    weights: list[Weight] = []
    keep_inputs = []
    renames: dict[str, str] = {}
    drop_nodes: set[int] = set()
    for inp in graph.input:
        if inp.name not in params:
            keep_inputs.append(inp)
            continue
        tensor = params[inp.name]
        clean = inp.name[len(strip_prefix):] if inp.name.startswith(strip_prefix) else inp.name
        users = consumers.get(inp.name, [])
        perms = {tuple(helper.get_attribute_value(a)) for n in users for a in n.attribute if a.name == "perm"}
        foldable = (users and all(n.op_type == "Transpose" for n in users) and len(perms) == 1
                    and not any(o in outputs for n in users for o in n.output))
        if foldable:
            perm = perms.pop()
            w = Weight(clean + ".T", tensor, perm)
            for n in users:
                renames[n.output[0]] = w.name
                drop_nodes.add(id(n))
        else:
            w = Weight(clean, tensor)
            renames[inp.name] = clean
        weights.append(w)
    del graph.input[:]
    graph.input.extend(keep_inputs)
    nodes = [n for n in graph.node if id(n) not in drop_nodes]
    for n in nodes:
        for i, name in enumerate(n.input):
            if name in renames:
                n.input[i] = renames[name]
    del graph.node[:]
    graph.node.extend(nodes)
    names = [w.name for w in weights]
    if len(set(names)) != len(names):
        raise RuntimeError("two initializers got the same name")
    return weights


# ---- integer types -------------------------------------------------------------------------------------------
def _formal(schema, index: int):
    params = schema.inputs
    if index < len(params):
        return params[index]
    return params[-1] if params and params[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic else None


def _accepts_int64_alone(node: onnx.NodeProto, index: int, opset: int) -> bool:
    """Whether input `index` of `node` may become int64 without touching its other inputs/outputs."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain or "")
    except Exception:
        return False
    formal = _formal(schema, index)
    if formal is None:
        return False
    t = formal.type_str
    if t.startswith("tensor("):
        return t == "tensor(int64)"
    allowed = next((c.allowed_type_strs for c in schema.type_constraints if c.type_param_str == t), [])
    if "tensor(int64)" not in allowed:
        return False
    position = min(index, len(schema.inputs) - 1)
    shared = any(p.type_str == t for i, p in enumerate(schema.inputs) if i != position)
    shared = shared or any(p.type_str == t for p in schema.outputs)
    variadic = formal.option == onnx.defs.OpSchema.FormalParameterOption.Variadic
    return not shared and not (variadic and len(node.input) > position + 1)


def unify_integer_types(model: onnx.ModelProto) -> None:
    """Widen int32 constants/casts that feed only int64-capable inputs (`int32_users` reports what is left)."""
    graph = model.graph
    opset = opset_of(model)
    outputs = {o.name for o in graph.output}
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, i))

    def widenable(value: str) -> bool:
        users = consumers.get(value, [])
        return bool(users) and value not in outputs and all(_accepts_int64_alone(n, i, opset) for n, i in users)

    for node in graph.node:
        if node.op_type == "Constant":
            attr = next((a for a in node.attribute if a.name == "value"), None)
            if attr is not None and attr.t.data_type == TensorProto.INT32 and widenable(node.output[0]):
                arr = numpy_helper.to_array(attr.t).astype("int64")
                attr.t.CopyFrom(numpy_helper.from_array(arr, attr.t.name))
        elif node.op_type == "Cast":
            attr = next(a for a in node.attribute if a.name == "to")
            if attr.i == TensorProto.INT32 and widenable(node.output[0]):
                attr.i = TensorProto.INT64


def int32_users(model: onnx.ModelProto) -> list[str]:
    """Nodes producing or consuming int32 values (after shape inference), as readable strings."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    types = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        types[vi.name] = vi.type.tensor_type.elem_type
    for init in inferred.graph.initializer:
        types[init.name] = init.data_type
    found = []
    for node in inferred.graph.node:
        if any(types.get(v) == TensorProto.INT32 for v in list(node.input) + list(node.output)):
            found.append(f"{node.op_type} {node.name or node.output[0]}")
    return found


# ---- writing -------------------------------------------------------------------------------------------------
def _tensor_proto(w: Weight, with_data: bool) -> tuple[TensorProto, torch.Tensor | None]:
    tp = TensorProto()
    tp.name = w.name
    tp.dims.extend(w.shape)
    try:
        tp.data_type = _TORCH_TO_ONNX[w.source.dtype]
    except KeyError:
        raise RuntimeError(f"{w.name}: no ONNX type for {w.source.dtype}") from None
    data = None
    if with_data:
        data = w.data()
        tp.raw_data = _raw(data)
    return tp, data


def _raw(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def write_onnx(model: onnx.ModelProto, weights: list[Weight], directory: Path, external: bool,
               progress: Callable[[int], None] | None = None) -> list[str]:
    """Write model.onnx (and model.onnx_data when `external`) into `directory`; returns the file names."""
    onnx_path = directory / "model.onnx"
    files = ["model.onnx"]
    graph = model.graph
    del graph.initializer[:]
    if external:
        files.append(EXTERNAL_DATA)
        writer = ExternalDataWriter(directory / EXTERNAL_DATA, align=ALIGN)
        scratch = torch.empty(BLOCK, dtype=torch.uint8)
        try:
            for w in weights:
                if w.nbytes < EMBED_BELOW:
                    tp, _ = _tensor_proto(w, with_data=True)
                else:
                    tp, _ = _tensor_proto(w, with_data=False)
                    writer.write(tp, w.chunks(scratch))
                graph.initializer.append(tp)
                if progress:
                    progress(w.nbytes)
        finally:
            writer.close(fsync=True)
        onnx_path.write_bytes(model.SerializeToString())
        return files
    scratch = torch.empty(BLOCK, dtype=torch.uint8)
    with open(onnx_path, "wb") as f:
        f.write(model.SerializeToString())
        for w in weights:
            _append_initializer(f, w, scratch)
            if progress:
                progress(w.nbytes)
    return files


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _append_initializer(f, w: Weight, scratch: torch.Tensor | None = None) -> None:
    """Append `ModelProto{graph{initializer{<w>}}}` to an open model file, the tensor bytes written straight from
    the tensor's memory (protobuf merges it into the graph already written). Wire format: field 7 (graph) of
    ModelProto, field 5 (initializer) of GraphProto, field 9 (raw_data) of TensorProto, all length-delimited."""
    tp, _ = _tensor_proto(w, with_data=False)
    f.write(_initializer_frame(tp.SerializeToString(), w.nbytes))
    for block in w.chunks(scratch):
        f.write(block)


def _initializer_frame(head: bytes, length: int) -> bytes:
    """The bytes before a tensor's raw data: ModelProto.graph (7) > GraphProto.initializer (5) > the tensor's
    serialized fields (`head`, without data) > TensorProto.raw_data (9), each length-delimited."""
    tensor_len = len(head) + 1 + len(_varint(length)) + length
    graph_len = 1 + len(_varint(tensor_len)) + tensor_len
    return b"\x3a" + _varint(graph_len) + b"\x2a" + _varint(tensor_len) + head + b"\x4a" + _varint(length)


def _bytes_view(data: torch.Tensor) -> memoryview:
    """A contiguous tensor's own memory as bytes (no copy)."""
    return memoryview(data.reshape(-1).view(torch.uint8).numpy()) if data.numel() else memoryview(b"")


def check_graph(model: onnx.ModelProto) -> None:
    """onnx's own checker on the weightless graph (parameters still inputs): validates the structure without
    loading the weights again (the checker on the file would parse them twice); onnxruntime then loads the file."""
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        raise RuntimeError(f"the exported graph is not valid ONNX: {str(e).splitlines()[0]}") from None


# ---- bf16 for the check --------------------------------------------------------------------------------------
def _copy_range(src_fd: int, dst, offset: int, length: int, chunk: int = 64 * 2**20) -> None:
    done = 0
    while done < length:
        buf = os.pread(src_fd, min(chunk, length - done), offset + done)
        if not buf:
            raise RuntimeError("external data file is shorter than its index")
        dst.write(buf)
        done += len(buf)


def pack_external(directory: Path) -> None:
    """Move the weights of model.onnx_data into model.onnx (below the external-data threshold), streaming: each
    tensor's bytes are copied in 64 MiB chunks behind a hand-framed initializer (see _append_initializer)."""
    path, data = directory / "model.onnx", directory / EXTERNAL_DATA
    model = onnx.load(str(path), load_external_data=False)
    moved = [t for t in model.graph.initializer if external_location(t)]
    keep = [t for t in model.graph.initializer if not external_location(t)]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    tmp = directory / "model.onnx.packing"
    fd = os.open(data, os.O_RDONLY)
    try:
        with open(tmp, "wb") as f:
            f.write(model.SerializeToString())
            for t in moved:
                _, offset, length = external_location(t)
                head_proto = TensorProto()
                head_proto.CopyFrom(t)
                del head_proto.external_data[:]
                head_proto.data_location = TensorProto.DEFAULT
                f.write(_initializer_frame(head_proto.SerializeToString(), length))
                _copy_range(fd, f, offset, length)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    data.unlink()


def widen_bf16(src: Path, dst_dir: Path) -> Path:
    """A float32 twin of a bfloat16 graph for the check: onnxruntime has no CPU kernels for bfloat16. Weights are
    exact in float32; every bf16 value, cast and constant becomes float32. Streams tensor by tensor (external data
    in, external data out). Returns the twin's path."""
    import numpy as np

    F, B = TensorProto.FLOAT, TensorProto.BFLOAT16
    m = onnx.load(str(src), load_external_data=False)

    def widen_inline(t: TensorProto) -> None:
        if t.data_type != B:
            return
        raw = t.raw_data if t.raw_data else np.asarray(t.int32_data, dtype=np.uint16).tobytes()
        t.ClearField("int32_data")
        t.raw_data = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).tobytes()
        t.data_type = F

    dst_dir.mkdir(parents=True, exist_ok=True)
    in_fds: dict[str, int] = {}
    writer = ExternalDataWriter(dst_dir / "model_fp32_twin.onnx_data", align=ALIGN)
    try:
        for t in m.graph.initializer:
            ext = external_location(t)
            if ext is None:
                widen_inline(t)
                continue
            location, start, length = ext
            fd = in_fds.get(location)
            if fd is None:
                fd = in_fds[location] = os.open(src.parent / location, os.O_RDONLY)
            raw = os.pread(fd, length, start)
            if t.data_type == B:
                raw = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).tobytes()
                t.data_type = F
            writer.write(t, [raw])
            del raw
    finally:
        writer.close()
        for fd in in_fds.values():
            os.close(fd)
    for node in m.graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                widen_inline(a.t)
            elif a.name == "to" and a.i == B:
                a.i = F
    for vi in list(m.graph.value_info) + list(m.graph.input) + list(m.graph.output):
        if vi.type.tensor_type.elem_type == B:
            vi.type.tensor_type.elem_type = F
    path = dst_dir / "model_fp32_twin.onnx"
    path.write_bytes(m.SerializeToString())
    return path


def op_types(model: onnx.ModelProto) -> list[str]:
    return sorted({n.op_type for n in model.graph.node})


def count_bytes(weights: Iterable[Weight]) -> int:
    return sum(w.nbytes for w in weights)


def describe_weights(weights: list[Weight]) -> dict[str, Any]:
    return {"initializers": len(weights), "transposed": sum(1 for w in weights if w.perm),
            "bytes": count_bytes(weights)}
