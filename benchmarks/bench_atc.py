"""How long `dsconv atc` preflight takes on a model far bigger than the host, and how much memory it uses.

Builds an LLM-shaped ONNX header whose weights live in a *sparse* external data file (no disk, no RAM), e.g. 64 GiB of
fp32 MatMul weights over 4 x LAYERS initializers, then plans the compile for Ascend910B3 (fits as fp16) and
Ascend310P3 (does not: weight-memory fails). The point is "plan from headers": time and peak RSS stay flat while the
claimed weight size grows, because preflight never reads a weight.

    .venv/bin/python benchmarks/bench_atc.py [--gib 64] [--layers 200]
"""
from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import onnx
from onnx import TensorProto, helper


def _external(name: str, shape: list[int], location: str, offset: int) -> tuple[onnx.TensorProto, int]:
    """An fp32 initializer that only points into the external data file."""
    t = onnx.TensorProto()
    t.name, t.data_type = name, TensorProto.FLOAT
    t.dims.extend(shape)
    t.data_location = TensorProto.EXTERNAL
    n = 4
    for d in shape:
        n *= d
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(n))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t, offset + n


def build(path: Path, gib: int, layers: int) -> Path:
    per = gib * 1024**3 // (4 * layers)  # bytes per initializer
    hidden = 4096
    cols = per // (hidden * 4)
    data = path.parent / (path.name + ".data")
    inits, nodes, offset = [], [], 0
    h = "h"
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])]
    t, offset = _external("embed", [1024, hidden], data.name, offset)
    inits.append(t)
    nodes.append(helper.make_node("Gather", ["embed", "input_ids"], [h], name="embed"))
    for i in range(4 * layers):
        t, offset = _external(f"w{i}", [hidden, cols] if i % 2 == 0 else [cols, hidden], data.name, offset)
        inits.append(t)
        nodes.append(helper.make_node("MatMul", [h, f"w{i}"], [f"h{i}"], name=f"mm{i}"))
        h = f"h{i}"
    graph = helper.make_graph(nodes, "big", inputs, [helper.make_tensor_value_info(h, TensorProto.FLOAT, None)],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    onnx.save_model(model, str(path))
    with open(data, "wb") as f:
        f.truncate(offset)  # sparse: claims the bytes without writing them
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=64)
    ap.add_argument("--layers", type=int, default=200)
    args = ap.parse_args()
    from dsconv.atc.stage import AtcRequest, plan
    from dsconv.errors import UserError

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        path = build(Path(tmp) / "big.onnx", args.gib, args.layers)
        print(f"built header + sparse data ({args.gib} GiB claimed, {4 * args.layers} weights) in "
              f"{time.perf_counter() - t:.2f}s; .onnx is {path.stat().st_size / 1024:.0f} KiB")
        for soc in ("Ascend910B3", "Ascend310P3"):
            t = time.perf_counter()
            try:
                p = plan(AtcRequest(onnx=path, output=Path(tmp) / "out", soc=soc))
                verdict = next(f.line() for f in p.findings if f.rule == "weight-memory")
            except UserError as e:
                verdict = e.one_line()
            print(f"{soc}: preflight {time.perf_counter() - t:.2f}s -> {verdict[:150]}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {rss:.0f} MiB (the Python process with onnx imported)")


if __name__ == "__main__":
    main()
