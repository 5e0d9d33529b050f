"""Tiny LLM-shaped ONNX models built with onnx.helper, for the atc tests, the benchmark and quick manual tries.

input_ids/attention_mask int64 [batch, seq] -> Gather (embedding) -> MatMul -> logits, masked by attention_mask.
Each keyword adds the one feature a preflight rule looks at (opset, BF16 weights, INT8 QuantizeLinear, a mixed
int32/int64 Add, a custom op, external data, a KV-cache input, a TopK index Add), so a test builds exactly the model
its rule needs. Small enough to build in milliseconds.
"""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def tiny_lm(path: Path, *, opset: int = 14, vocab: int = 64, hidden: int = 16, dtype: str = "float32",
            int8: bool = False, mixed_int: bool = False, custom_op: bool = False, external_data: bool = False,
            kv_cache: bool = False, topk_index_add: bool = False, range_op: bool = False,
            dim_names: tuple[str, str] = ("batch", "seq"), seed: int = 0) -> Path:
    """Write the model to `path` and return it."""
    rng = np.random.default_rng(seed)
    b, s = dim_names
    f32 = TensorProto.FLOAT
    emb = rng.standard_normal((vocab, hidden)).astype(np.float32) * 0.5
    w = rng.standard_normal((hidden, vocab)).astype(np.float32) * 0.2
    if dtype == "bfloat16":
        inits = [numpy_helper.from_array(emb.astype(ml_dtypes.bfloat16), "embed.weight"),
                 numpy_helper.from_array(w.astype(ml_dtypes.bfloat16), "lm_head.weight")]
        wtype = TensorProto.BFLOAT16
    else:
        inits = [numpy_helper.from_array(emb, "embed.weight"), numpy_helper.from_array(w, "lm_head.weight")]
        wtype = f32
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [b, s]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                            [b, "past_sequence + sequence" if kv_cache else s])]
    nodes = [helper.make_node("Gather", ["embed.weight", "input_ids"], ["h"], name="embed")]
    h = "h"
    if int8:
        inits += [numpy_helper.from_array(np.array(0.05, np.float32), "q_scale"),
                  numpy_helper.from_array(np.array(0, np.int8), "q_zero")]
        hq = "h_f32"
        if wtype != f32:
            nodes.append(helper.make_node("Cast", [h], [hq], to=f32, name="h_to_f32"))
        else:
            hq = h
        nodes += [helper.make_node("QuantizeLinear", [hq, "q_scale", "q_zero"], ["h_q"], name="quant"),
                  helper.make_node("DequantizeLinear", ["h_q", "q_scale", "q_zero"], ["h_dq"], name="dequant")]
        h = "h_dq"
        if wtype != f32:
            nodes.append(helper.make_node("Cast", [h], ["h_back"], to=wtype, name="h_back"))
            h = "h_back"
    if custom_op:
        nodes.append(helper.make_node("MyCustomOp", [h], ["h_custom"], name="custom_0"))
        h = "h_custom"
    if kv_cache:
        inputs.append(helper.make_tensor_value_info("past_key_values.0.key", wtype, [b, 2, "past_sequence", 8]))
        nodes.append(helper.make_node("ReduceSum", ["past_key_values.0.key"], ["kv_sum"], keepdims=0, name="kv_sum"))
    nodes.append(helper.make_node("MatMul", [h, "lm_head.weight"], ["logits_raw"], name="lm_head"))
    # mask: logits * mask[..., None] (cast to the weight dtype)
    inits.append(numpy_helper.from_array(np.array([-1], np.int64), "axes_last"))
    mask = "attention_mask"
    if kv_cache:  # keep the last seq positions of the [past + seq] mask
        nodes += [helper.make_node("Shape", ["input_ids"], ["ids_shape"], name="ids_shape"),
                  helper.make_node("Gather", ["ids_shape", "one"], ["seq_len"], axis=0, name="seq_len"),
                  helper.make_node("Neg", ["seq_len"], ["neg_seq"], name="neg_seq"),
                  helper.make_node("Slice", ["attention_mask", "neg_seq", "big", "one"], ["mask_tail"],
                                   name="mask_tail")]
        inits += [numpy_helper.from_array(np.array([1], np.int64), "one"),
                  numpy_helper.from_array(np.array([1 << 30], np.int64), "big")]
        mask = "mask_tail"
    nodes += [helper.make_node("Unsqueeze", [mask, "axes_last"], ["mask3"], name="mask3"),
              helper.make_node("Cast", ["mask3"], ["maskf"], to=wtype, name="mask_cast"),
              helper.make_node("Mul", ["logits_raw", "maskf"], ["logits"], name="apply_mask")]
    outputs = [helper.make_tensor_value_info("logits", wtype, [b, s, vocab])]
    if mixed_int:
        inits.append(numpy_helper.from_array(np.array([1], np.int32), "offset_i32"))
        nodes.append(helper.make_node("Add", ["input_ids", "offset_i32"], ["ids_plus"], name="mixed_add"))
        outputs.append(helper.make_tensor_value_info("ids_plus", TensorProto.INT64, [b, s]))
    if topk_index_add:
        inits.append(numpy_helper.from_array(np.array([2], np.int64), "k"))
        nodes += [helper.make_node("TopK", ["logits_raw", "k"], ["top_v", "top_i"], name="topk"),
                  helper.make_node("Add", ["top_i", "input_ids3"], ["top_shifted"], name="topk_add"),
                  helper.make_node("Unsqueeze", ["input_ids", "axes_last"], ["input_ids3"], name="ids3")]
        outputs.append(helper.make_tensor_value_info("top_shifted", TensorProto.INT64, None))
    if range_op:
        inits += [numpy_helper.from_array(np.array(0.0, np.float32), "r0"),
                  numpy_helper.from_array(np.array(4.0, np.float32), "r1"),
                  numpy_helper.from_array(np.array(1.0, np.float32), "r2")]
        nodes.append(helper.make_node("Range", ["r0", "r1", "r2"], ["ramp"], name="ramp"))
        outputs.append(helper.make_tensor_value_info("ramp", f32, [4]))
    if kv_cache:
        outputs.append(helper.make_tensor_value_info("kv_sum", wtype, None))
    graph = helper.make_graph(nodes, "tiny_lm", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", opset)]
    if custom_op:
        opsets.append(helper.make_opsetid("", opset))  # MyCustomOp sits in the default domain on purpose
        opsets = opsets[:1]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="dsconv.atc.samples")
    model.ir_version = 8
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if external_data:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data")
    else:
        onnx.save_model(model, str(path))
    return path
