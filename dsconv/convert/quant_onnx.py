"""`dsconv export --format onnx` of a `dsconv quantize` output: the fake-quant model (onnxruntime) and AMCT's deploy
model (ATC), checked against dsconv's own simulation of the quantized model before anything is kept.

Files, in one OutputDir transaction (a failed check leaves nothing):
  model_fakequant.onnx  standard QuantizeLinear/DequantizeLinear with exactly the written input_scale/input_offset
                        (per tensor), int8 weights behind per-channel DequantizeLinear, per-token fake quant for
                        W8A8_DYNAMIC; dynamic axes as the float export; onnxruntime runs it (`dsconv eval` too);
  model_deploy.onnx     AMCT's deploy form (quant_graph.py): AscendQuant -> int8 MatMul -> int32 quant_bias ->
  + model_deploy.external  AscendDequant per static W8A8 linear; its tensors in the .external file beside it, which ATC
                        reads. Its input dims stay symbolic: INT8 deploy models cannot use ATC's dynamic-shape options,
                        so `dsconv atc` compiles one static .om per gear (AMCT facts F1, F8);
  amct_record.txt       AMCT's record file (scale_d, offset_d, scale_w, offset_w per static layer);
  export_info.json      what was written, the check, node counts.
The check: the fake-quant file in onnxruntime against `dsconv eval`'s model of the quantize output (int8 weights
dequantized, activations quantized as the engine does: `(x_q @ w_q^T + quant_bias) * deq_scale`), on the export
check inputs; above `atol` is CheckFailed (exit 3). onnxruntime runs it with `session.disable_quant_qdq=1`: its
default int8 QDQ fusion computes something else (0.49 max logits error on the tiny DeepSeek-V3, measured; 1e-6
without it), and the fake-quant model exists to simulate the device in float (AMCT's fake_quant model, F1).
"""
from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from dsconv.errors import CheckFailed, UserError
from dsconv.qformat import cache_tensors

FAKEQUANT = "model_fakequant.onnx"
DEPLOY = "model_deploy.onnx"
DEPLOY_EXTERNAL = "model_deploy.external"
RECORD = "amct_record.txt"
#: |fake-quant ONNX - simulation| on logits. The two compute the same function in float32, but a value that lands on
#: a rounding boundary of x / input_scale can round differently in onnxruntime and PyTorch (one int8 step of one
#: activation); measured on the tiny models: <= 2e-6 without such a flip. A broken scale moves logits by > 0.1.
DEFAULT_QUANT_ATOL = 2e-3
NOISE_REL = 1e-6      # relative nudge of the embeddings that measures the simulation's own float sensitivity
NOISE_FACTOR = 3.0    # tolerance = max(atol, NOISE_FACTOR x that noise floor)
NOISE_RULE = "max(atol, 3 x the simulation's own change under a 1e-6 relative nudge of the embeddings)"


def is_quantize_output(path: Path) -> bool:
    """A `dsconv quantize` (msModelSlim layout) directory: it has a quant_model_description*.json."""
    from dsconv.checkpoint import QUANT_DESCRIPTIONS

    return Path(path).is_dir() and any((Path(path) / n).is_file() for n in QUANT_DESCRIPTIONS)


def export_quantized_onnx(quant_dir: Path, output: Path, source: Callable[[Any], Any], *,
                          model_dir: Path | None = None, opset: int | None = None,
                          with_past: bool = False, position_ids: bool = False, atol: float | None = None,
                          external_data_threshold: int = 2 * 10**9, force: bool = False, dry_run: bool = False,
                          progress: bool | None = None) -> dict[str, Any]:
    """Export, check and commit a quantize output; returns the JSON-ready summary. `source(qck)` reads it (the quant
    stage's dsconv.quant.evaluate.fakequant.load_source, handed in by the command layer: stages do not import each
    other):
    `.layers` {module: layer with qtype, q, weight_scale, input_scale, input_offset, deq_scale, quant_bias},
    `.model` the fake-quantized torch model, `.fused` int8 fused expert parameters, `.report`, `.simulation()`."""
    from dsconv.checkpoint import Checkpoint
    from dsconv.convert.onnx import resolve_options

    t0 = time.perf_counter()
    quant_dir, output = Path(quant_dir), Path(output)
    opset, _ = resolve_options("fp32", opset, atol)
    atol = DEFAULT_QUANT_ATOL if atol is None else atol
    qck = Checkpoint.open(quant_dir)
    if not qck.is_quantized:
        raise UserError(f"{quant_dir} has no quant_model_description*.json", hint="pass the output of dsconv quantize")
    if model_dir is not None and Path(model_dir).resolve() != quant_dir.resolve():
        ck = Checkpoint.open(Path(model_dir))
        if ck.is_quantized or ck.config.get("model_type") != qck.config.get("model_type") \
                or ck.facts.num_layers != qck.facts.num_layers:
            raise UserError(f"{quant_dir} is not a quantization of {model_dir} (model_type / layers differ)",
                            hint="pass the float model the quantize output was made from, or drop --model")
    types: dict[str, int] = {}
    for name, t in qck.quant_description.items():
        if name.endswith(".weight") and isinstance(t, str) and t != "FLOAT":
            types[t] = types.get(t, 0) + 1
    summary: dict[str, Any] = {
        "format": "onnx", "quantized": str(quant_dir), "output": str(output), "family": qck.family.name,
        "dtype": "fp32", "opset": opset, "with_past": with_past, "position_ids": position_ids, "atol": atol,
        "model_quant_type": qck.quant_description.get("model_quant_type"), "linears": dict(sorted(types.items())),
    }
    note_cache_scales(summary, qck.quant_description)
    if dry_run:
        summary["dry_run"] = True
        return summary
    with qck:
        result = _export(qck, quant_dir, output, source, opset=opset, with_past=with_past, position_ids=position_ids,
                         atol=atol, threshold=external_data_threshold, force=force, progress=progress,
                         summary=summary)
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return result


def _export(qck, quant_dir: Path, output: Path, source: Callable[[Any], Any], *, opset: int, with_past: bool, position_ids: bool,
            atol: float, threshold: int, force: bool, progress: bool | None, summary: dict[str, Any]) -> dict:
    import numpy as np
    import torch

    from dsconv.convert import hf_model, onnx_check, onnx_graph, onnx_wrapper, quant_graph
    from dsconv.io.writer import OutputDir

    options = {k: summary[k] for k in ("opset", "with_past", "position_ids", "atol")}
    options["external_data_threshold"] = threshold
    timings: dict[str, float] = {}
    with OutputDir(output, stage="export_int8", inputs=[quant_dir], force=force, options=options,
                   input_identity=qck.identity()) as out:
        t = time.perf_counter()
        src = source(qck)
        layers, model, fused, build_report = src.layers, src.model, src.fused, src.report
        spec = onnx_wrapper.IOSpec(with_past, position_ids, onnx_wrapper.cache_geometry(model) if with_past else [])
        wrapper = onnx_wrapper.ExportWrapper(model, spec).eval()
        vocab = int(model.config.vocab_size)
        args = onnx_wrapper.trace_inputs(spec, vocab, torch.float32)
        timings["load"] = time.perf_counter() - t
        t = time.perf_counter()
        graph, emitted, method = onnx_graph.trace_checked(wrapper, args, spec, opset)
        weights = onnx_graph.attach_weights(graph, dict(wrapper.state_dict(keep_vars=True)))
        arrays = {w.name: w.data().numpy().copy() for w in weights}
        del weights
        replaced = quant_graph.int8_weights(graph, arrays, layers, fused)
        in_experts = {P for f in fused.values() for P in f.modules}
        expected = len(set(layers) - in_experts) + len(fused)
        if len(replaced) != expected:
            raise RuntimeError(f"{len(replaced)} quantized weights found in the graph, expected {expected}")
        deploy_graph = copy.deepcopy(graph)
        deploy_arrays = dict(arrays)
        total = sum(a.nbytes for a in arrays.values())
        fq_files = quant_graph.save(graph, arrays, out.path / FAKEQUANT,
                                    "model_fakequant.onnx_data" if total >= threshold else None)
        fq_ops = quant_graph.op_counts(graph.graph.node)
        del graph, arrays
        timings["trace"] = time.perf_counter() - t

        t = time.perf_counter()
        ref, noise = _reference(src.simulation, spec, vocab)
        hf_model.release(model)
        del wrapper, model, args
        timings["simulation"] = time.perf_counter() - t
        t = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=".dsconv-check-", dir=out.path.parent):
            report = onnx_check.onnxruntime_compare(out.path / FAKEQUANT, spec, ref, max(atol, NOISE_FACTOR * noise),
                                                    np.float32)
        report.update(atol_requested=atol, noise_floor=noise, noise_rule=NOISE_RULE)
        timings["onnxruntime_check"] = time.perf_counter() - t
        if not report["passed"]:
            msg, details = onnx_check.failure_message(report)
            raise CheckFailed(msg.replace("ONNX differs from PyTorch", "fake-quant ONNX differs from dsconv's "
                                          "simulation of the quantized model"),
                              hint="nothing was written; a wrong scale/offset in the quantize output shows here",
                              details=details)

        t = time.perf_counter()
        counts = quant_graph.to_deploy(deploy_graph, deploy_arrays, layers, fused)
        static = sum(1 for L in layers.values() if L.qtype == "W8A8")
        if counts["AscendQuant"] != static:
            raise RuntimeError(f"deploy model has {counts['AscendQuant']} AscendQuant nodes for {static} static "
                               "W8A8 linears")
        dp_files = quant_graph.save(deploy_graph, deploy_arrays, out.path / DEPLOY, DEPLOY_EXTERNAL)
        dp_ops = quant_graph.op_counts(deploy_graph.graph.node)
        out.write_text(RECORD, quant_graph.record_text(layers))
        timings["deploy"] = time.perf_counter() - t
        for f in qck.copy_files():
            out.copy_in(f)
        summary.update(
            files=fq_files + dp_files + [RECORD], opset_emitted=emitted, opset_method=method,
            load=build_report, io=spec.describe(), check=report,
            fakequant={"file": FAKEQUANT, "op_counts": fq_ops,
                       "onnxruntime": "run with session option session.disable_quant_qdq=1 (its int8 QDQ fusion "
                                      "changes the numbers)"},
            deploy={"file": DEPLOY, "external": DEPLOY_EXTERNAL, "op_counts": dp_ops, **counts,
                    "int8_linears": static,
                    "note": "static W8A8 linears run INT8 (AscendQuant/AscendDequant); W8A8_DYNAMIC and W8A16 keep "
                            "int8 weights dequantized by Cast+Mul (ATC folds them) and compute in float; input "
                            "dims are symbolic: dsconv atc compiles one static .om per gear"},
            timings={k: round(v, 3) for k, v in timings.items()},
        )
        out.write_json("export_info.json", summary)
    return summary


def _reference(simulation: Callable[[], Any], spec, vocab: int):
    """dsconv's own simulation of the quantized model (the one `dsconv eval` measures) on the check inputs, and its
    noise floor: the largest output change when the embeddings move by float32 rounding (NOISE_REL, seeded).

    Why: a static quantizer is a step function. On a real model some of its millions of inputs sit within float
    rounding of a step, so two correct float32 implementations (onnxruntime and PyTorch sum in different orders)
    round a few of them differently, and 24 layers carry that on: on Qwen2.5-0.5B's W8A8 output, a 1e-6 relative
    nudge of the embeddings alone moves the simulation's logits by 0.60, and onnxruntime differs from it by 0.68.
    A tolerance below that floor fails every correct export of a real model; a wrong scale or offset shows far above
    it (tiny models: floor ~1e-6, a scale x0.2 or a flipped offset sign ~1e-1)."""
    import numpy as np
    import torch

    from dsconv.convert import hf_model, onnx_check, onnx_wrapper

    sim = simulation()
    wrapper = onnx_wrapper.ExportWrapper(sim, spec).eval()
    ref = onnx_check.torch_reference(wrapper, spec, vocab, torch.float32)
    gen = torch.Generator().manual_seed(0)
    nudge = sim.get_input_embeddings().register_forward_hook(
        lambda mod, args, out: out * (1 + NOISE_REL * torch.randn(out.shape, generator=gen, dtype=out.dtype)))
    try:
        nudged = onnx_check.torch_reference(wrapper, spec, vocab, torch.float32)
    finally:
        nudge.remove()
    noise = max(float(np.max(np.abs(a - b))) if a.size else 0.0
                for want, got in zip(ref.outputs, nudged.outputs) for a, b in zip(want, got))
    hf_model.release(sim)
    return ref, noise


def render(summary: dict[str, Any]) -> str:
    if summary.get("dry_run"):
        return (f"would export {summary['quantized']} ({summary['model_quant_type']}: "
                + ", ".join(f"{n} {t}" for t, n in summary["linears"].items())
                + f") to {summary['output']} as {FAKEQUANT} + {DEPLOY} (opset {summary['opset']})")
    check, dp = summary["check"], summary["deploy"]
    return "\n".join([
        f"wrote {summary['output']}: {', '.join(summary['files'])} (opset {summary['opset']})",
        f"  linears: {', '.join(f'{n} {t}' for t, n in summary['linears'].items())}"
        + (f" ({summary['load']['expert_linears']} in fused experts)" if summary['load']['expert_linears'] else ""),
        f"  check passed: max |fake-quant onnx - simulation| {check['worst']['max_abs_err']:.2g} <= tolerance "
        f"{check['atol']:.2g} (max of --atol {check['atol_requested']:g} and 3x the simulation's own float noise "
        f"{check['noise_floor']:.2g}) over {len(check['cases'])} inputs (onnxruntime vs dsconv's quantized model)",
        f"  deploy: {dp['AscendQuant']} AscendQuant / {dp['AscendDequant']} AscendDequant (INT8 matmuls), "
        f"{dp['weight_dequant']} int8 weights dequantized in float; compile with "
        f"`dsconv atc --onnx {Path(summary['output']) / DEPLOY}` (static shapes, one .om per gear)",
        *cache_note(summary.get("kv_cache_scales_left_out")),
        f"  {summary['seconds']:.1f} s",
    ])


def note_cache_scales(summary: dict[str, Any], desc: dict[str, Any] | None) -> None:
    """A graph export of an output with int8 KV-cache scales (`quantize --kv-cache int8`): how many it leaves out
    (they are the serving engine's; the graph attends in float). Other summaries stay as they were."""
    left_out = len(cache_tensors(desc))
    if left_out:
        summary["kv_cache_scales_left_out"] = left_out


def cache_note(n: int | None) -> list[str]:
    """The summary line of a graph export of an output with int8 KV-cache scales (`quantize --kv-cache int8`)."""
    return [f"  {n} int8 KV-cache scale tensors left out: they are the serving engine's, the graph attends in float"
            ] if n else []
