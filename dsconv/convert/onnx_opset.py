"""Opset conversion when the exporter cannot emit the requested opset directly.

The TorchScript exporter emits opset 13-18 for every family here, but not 11-12 for MoE models run as `batched_mm`
(`repeat_interleave` over a dynamic dimension needs 13; the dense experts the export uses emit 11 directly). onnx's
version converter is tried first; it has no down-adapters for most ops (e.g. Sub 13 -> 12, CumSum 14 -> 13), so
when it fails this module lowers the graph itself, node by node, with the few rewrites the opset history needs
between 11 and 18:
  * `axes` (Squeeze, Unsqueeze, ReduceSum: input since 13; other Reduce*: input since 18) and Split's `split`
    move from a constant input back to an attribute;
  * Softmax / LogSoftmax over the last axis keep their meaning before 13 (2-D coercion at axis = last);
  * LessOrEqual / GreaterOrEqual (opset 12) become Not(Greater) / Not(Less) for opset 11;
  * every other op must have the same inputs and attributes at both versions (the newer version only added types),
    which the schema tells; anything else is refused with the opset that op needs.
The caller re-runs the onnxruntime parity check on the lowered graph, so a lowering is proven, not assumed.
"""
from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from dsconv.errors import UserError
from dsconv.io.onnx_data import opset_of

AXES_INPUT = {"Squeeze": 13, "Unsqueeze": 13, "ReduceSum": 13, "ReduceMean": 18, "ReduceMax": 18, "ReduceMin": 18,
              "ReduceProd": 18, "ReduceL1": 18, "ReduceL2": 18, "ReduceLogSum": 18, "ReduceLogSumExp": 18,
              "ReduceSumSquare": 18}
LAST_AXIS_ONLY = {"Softmax", "LogSoftmax"}
SEMANTIC_CHANGES = {"Resize", "Upsample", "Hardmax", "Dropout", "BatchNormalization", "Pad"}
NEGATED = {"LessOrEqual": "Greater", "GreaterOrEqual": "Less"}


def convert_opset(model: onnx.ModelProto, target: int) -> tuple[onnx.ModelProto, str]:
    """(model at `target`, how it got there)."""
    source = opset_of(model)
    if source == target:
        return model, "exporter"
    try:
        converted = onnx.version_converter.convert_version(model, target)
        onnx.checker.check_model(converted, full_check=True)
        return converted, "onnx.version_converter"
    except Exception as e:  # the converter asserts on missing adapters
        if target > source:
            raise UserError(f"onnx's converter cannot raise this graph from opset {source} to {target} "
                            f"({str(e).splitlines()[0][:160]})", hint=f"use --opset {source}") from None
    return lower(model, target), "dsconv lowering (onnx.version_converter has no adapter)"


def _schema(op: str, version: int):
    return onnx.defs.get_schema(op, version, "")


def lower(model: onnx.ModelProto, target: int) -> onnx.ModelProto:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    source = opset_of(model)
    graph = model.graph
    constants = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node
                 if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    ranks = _ranks(model)
    out_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            out_nodes.append(node)
            continue
        op = node.op_type
        src = _schema(op, source)
        try:
            tgt = _schema(op, target)
        except onnx.defs.SchemaError:
            if op in NEGATED and target >= 7:
                out_nodes += _negated(node)
                continue
            raise UserError(f"ONNX op {op} does not exist before opset {src.since_version}",
                            hint=f"choose --opset {src.since_version} or higher") from None
        if tgt.since_version == src.since_version:
            out_nodes.append(node)
            continue
        if op in AXES_INPUT and source >= AXES_INPUT[op] > target:
            _axes_to_attribute(node, "axes", constants, inits)
        elif op == "Split" and "split" in tgt.attributes:
            if any(a.name == "num_outputs" for a in node.attribute):
                raise UserError("ONNX Split with num_outputs (opset 18) cannot be lowered",
                                hint="choose --opset 18")
            _axes_to_attribute(node, "split", constants, inits)
        elif op in LAST_AXIS_ONLY:
            axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
            rank = ranks.get(node.input[0])
            if axis != -1 and (rank is None or axis != rank - 1):
                raise UserError(f"{op} over axis {axis} changes meaning before opset 13", hint="choose --opset 13+")
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("axis", -1 if rank is None else rank - 1))
        elif op in SEMANTIC_CHANGES:
            raise UserError(f"ONNX op {op} changed meaning at opset {src.since_version}",
                            hint=f"choose --opset {src.since_version} or higher")
        else:
            unknown = [a.name for a in node.attribute if a.name not in tgt.attributes]
            if unknown == ["allowzero"] and all(a.i == 0 for a in node.attribute if a.name == "allowzero"):
                keep = [a for a in node.attribute if a.name != "allowzero"]
                del node.attribute[:]
                node.attribute.extend(keep)
                unknown = []
            if unknown or len(node.input) > len(tgt.inputs) and tgt.inputs[-1].option.name != "Variadic":
                raise UserError(f"ONNX op {op} uses opset-{src.since_version} features ({', '.join(unknown)})",
                                hint=f"choose --opset {src.since_version} or higher")
        out_nodes.append(node)
    del graph.node[:]
    graph.node.extend(out_nodes)
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = target
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise UserError(f"the graph cannot be lowered to opset {target}: {str(e).splitlines()[0][:200]}",
                        hint="choose a higher --opset (14 is the default)") from None
    return model


def _axes_to_attribute(node: onnx.NodeProto, attr: str, constants: dict, inits: dict) -> None:
    if len(node.input) < 2 or not node.input[1]:
        return
    name = node.input[1]
    values = constants.get(name, inits.get(name))
    if values is None:
        raise UserError(f"{node.op_type} {node.name}: {attr} is computed at run time, which opsets before the "
                        f"change cannot express", hint="choose a higher --opset")
    if any(a.name == "noop_with_empty_axes" and a.i for a in node.attribute):
        raise UserError(f"{node.op_type} {node.name} uses noop_with_empty_axes", hint="choose a higher --opset")
    keep = [a for a in node.attribute if a.name != "noop_with_empty_axes"]
    del node.attribute[:]
    node.attribute.extend(keep)
    node.attribute.append(helper.make_attribute(attr, [int(v) for v in values.reshape(-1)]))
    inputs = [node.input[0]] + list(node.input[2:])
    del node.input[:]
    node.input.extend(inputs)


def _negated(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    mid = node.output[0] + "_strict"
    first = helper.make_node(NEGATED[node.op_type], list(node.input), [mid], name=(node.name or mid) + "_strict")
    return [first, helper.make_node("Not", [mid], list(node.output), name=(node.name or mid) + "_not")]


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:
        return {}
    out = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = len(t.shape.dim)
    return out
