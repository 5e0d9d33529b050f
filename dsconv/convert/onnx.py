"""`dsconv export` (ONNX): a transformers causal LM -> model.onnx, proven equal to PyTorch before it is kept.

Steps, in one OutputDir transaction (any failure leaves nothing behind):
  1. estimate the peak memory from headers and refuse early when it clearly exceeds the available RAM (tracing needs
     the whole model in memory; `force` tries anyway);
  2. build transformers' model from the reader (hf_model.py; stored tensors cast from zero-copy views straight into
     the parameters, FP8 dequantized in-stream, MoE experts dense on per-expert views);
  3. trace the I/O wrapper (onnx_wrapper.py) with the TorchScript exporter into a weightless graph, keep integer
     math in int64, convert the opset when the exporter cannot emit the requested one (onnx_opset.py);
  4. stream the weights into model.onnx_data (onnx_graph.py), one tensor at a time, never copied (a transposed
     weight goes through one reused 16 MiB block);
  5. run PyTorch on the check inputs, free the torch model (and malloc's freed heap), run the written file in
     onnxruntime and compare
     (onnx_check.py): above the bound - by default derived from the reference's own float noise, measured with the
     model computing in float64 (tolerance.py); `--atol` for an absolute one - is CheckFailed (exit 3) with the worst
     output and position;
  6. below the external-data threshold (2 GB), stream the weights into model.onnx itself (one file), byte for byte.
Why external data during the check: onnxruntime maps external weights instead of parsing a second copy out of the
protobuf, so the check adds almost nothing to the peak. Measured per phase (benchmarks/bench_export.py, MoE 1.0 GB):
every phase - load, trace, write, PyTorch reference, onnxruntime check - sits at the fp32 weights + ~0.45 GB of
libraries (1.45x the weights), because the write never makes a transposed copy of lm_head and the load keeps no
per-tensor bf16 + fp32 temporaries (those would make it 1.55x).

Why opset 14 by default: it is inside the range every CANN release's ATC accepts (11-15, docs/commands/atc.md),
it is what optimum uses for decoder LMs, the TorchScript exporter emits it directly for every family here (MoE
included: the dense experts need no `repeat_interleave`, so even 11 is emitted directly), and it has bf16/fp16
versions of the arithmetic ops. bf16 graphs need 16 (Where on bfloat16 appears at 16), so `--dtype bf16` defaults to
16.
"""
from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dsconv.convert import DTYPES
from dsconv.errors import CheckFailed, UserError
from dsconv.runtime.process import peak_rss_bytes
from dsconv.tensors import human_bytes, precision_torch_dtype

DEFAULT_OPSET = 14
BF16_MIN_OPSET = 16
MIN_OPSET, MAX_OPSET = 11, 18
#: above this many weight bytes the weights go to model.onnx_data (protobuf cannot hold 2 GiB)
EXTERNAL_DATA_THRESHOLD = 2 * 10**9
#: the libraries (torch, transformers, onnx, onnxruntime) resident during an export, measured ~0.45 GB
RAM_BASE = 0.5e9
#: safety margin on the whole estimate
RAM_MARGIN = 1.1


def weight_bytes(ck, dtype: str) -> tuple[int, int]:
    """(bytes of the weights transformers will hold in `dtype`, bytes of those tensors in the checkpoint as stored
    when loading must convert them, else 0); FP8 scales and DeepSeek's MTP layers excluded (transformers skips them)."""
    from dsconv.families.roles import Category
    from dsconv.tensors import DTYPE_SIZES, PRECISIONS

    size = DTYPE_SIZES[PRECISIONS[dtype]]
    held = stored = 0
    converting = False
    for name, info in ck.tensors.items():
        role = ck.role(name)
        if role.is_aux or role.category is Category.MTP:
            continue
        floating = info.dtype.startswith(("F", "BF"))
        held += math.prod(info.shape) * (size if floating else DTYPE_SIZES[info.dtype])
        stored += info.nbytes
        converting |= floating and info.dtype != PRECISIONS[dtype] and not info.dtype.startswith("F8")
    return held, stored if converting and not ck.fp8_scales else 0


def float64_unit_bytes(ck) -> int:
    """The float64 copy the noise measurement holds at a time (tolerance.in_float64): the largest decoder layer, or
    the largest tensor outside the layers (lm_head, tied or not), at 8 bytes per element."""
    from dsconv.families.roles import Category

    layers: dict[int, int] = {}
    outside = 0
    for name, info in ck.tensors.items():
        role = ck.role(name)
        if role.is_aux or role.category is Category.MTP:
            continue
        n = math.prod(info.shape)
        if role.layer is None:
            outside = max(outside, n)
        else:
            layers[role.layer] = layers.get(role.layer, 0) + n
    return 8 * max([outside, *layers.values()])


def memory_estimate(ck, dtype: str) -> dict[str, int]:
    """Peak memory of an export, from headers. Measured (benchmarks/bench_export.py) as: the weights in the export
    dtype + the checkpoint's pages that transformers maps while converting them (file-backed, reclaimable) + the
    libraries. MoE experts run dense on per-expert views of the weights (hf_model.dense_experts_forward), so nothing
    scales with tokens x experts x weights any more (batched_mm gathered a weight copy per (token, expert) pair: 2.63x
    the fp32 weights at peak). The refusal uses the part that cannot be reclaimed."""
    import psutil

    weights, _ = weight_bytes(ck, dtype)
    # bf16 is checked in fp32 (see _export): the model is widened before the reference run
    held, mapped = weight_bytes(ck, "fp32" if dtype == "bf16" else dtype)
    f = ck.facts
    # the dense experts' activations: one expert's [33 tokens, 3 x intermediate] at a time, and the sum
    gather = 33 * (3 * f.moe_intermediate_size + 2 * f.hidden_size) * 4 if f.is_moe else 0
    wide = float64_unit_bytes(ck)
    anonymous = int(RAM_MARGIN * (held + RAM_BASE + max(gather, wide)))
    return {"weight_bytes": weights, "checkpoint_pages_bytes": mapped, "moe_gather_bytes": gather,
            "float64_layer_bytes": wide,
            "estimated_peak_bytes": anonymous + int(RAM_MARGIN * mapped), "estimated_anonymous_bytes": anonymous,
            "available_bytes": int(psutil.virtual_memory().available)}


def resolve_options(dtype: str, opset: int | None, atol: float | None) -> tuple[int, float | None]:
    """(opset, atol): atol stays None unless given, which selects the noise-derived tolerance (tolerance.py)."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    if opset is None:
        opset = BF16_MIN_OPSET if dtype == "bf16" else DEFAULT_OPSET
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise UserError(f"--opset {opset} is outside {MIN_OPSET}..{MAX_OPSET}",
                        hint="ATC accepts 11-15 in every CANN release (some accept up to 18)")
    if dtype == "bf16" and opset < BF16_MIN_OPSET:
        raise UserError(f"--dtype bf16 needs --opset {BF16_MIN_OPSET} or higher (ONNX Where takes bfloat16 from "
                        f"opset 16)", hint="pass --opset 16, or export fp16/fp32 and let ATC's precision mode choose")
    if atol is not None and not atol > 0:
        raise UserError(f"--atol {atol} must be positive")
    return opset, atol


def export_onnx(model_dir: Path, output: Path, *, dtype: str = "fp32", opset: int | None = None,
                with_past: bool = False, position_ids: bool = False, atol: float | None = None,
                external_data_threshold: int = EXTERNAL_DATA_THRESHOLD, force: bool = False,
                allow_pickle: bool = False, dry_run: bool = False, progress: bool | None = None) -> dict[str, Any]:
    """Export, check and commit; returns a JSON-ready summary. CheckFailed (exit 3) leaves no output."""
    from dsconv.checkpoint import Checkpoint

    t0 = time.perf_counter()
    model_dir, output = Path(model_dir), Path(output)
    opset, atol = resolve_options(dtype, opset, atol)
    ck = Checkpoint.open(model_dir, allow_pickle=allow_pickle)
    if ck.is_quantized:
        raise UserError(f"{model_dir} is a quantized (msModelSlim layout) output",
                        hint="`dsconv export --format onnx` exports it (convert/quant_onnx.py); export_onnx takes "
                             "float checkpoints")
    if ck.family.onnx_refused:
        raise UserError(f"{model_dir}: {ck.family.name} cannot be exported to ONNX: {ck.family.onnx_refused}",
                        hint="quantize it for an engine (dsconv quantize), or export --format safetensors")
    mem = memory_estimate(ck, dtype)
    summary: dict[str, Any] = {
        "format": "onnx", "model": str(model_dir), "output": str(output), "family": ck.family.name, "dtype": dtype,
        "opset": opset, "with_past": with_past, "position_ids": position_ids, "atol": atol,
        "memory": dict(mem, note="export traces the whole model in memory"),
    }
    if mem["estimated_anonymous_bytes"] > mem["available_bytes"] and not force:
        raise UserError(f"{model_dir}: exporting needs about {mem['estimated_anonymous_bytes'] / 1e9:.1f} GB of RAM "
                        f"({mem['weight_bytes'] / 1e9:.1f} GB of {dtype} weights held for tracing), "
                        f"{mem['available_bytes'] / 1e9:.1f} GB are available",
                        hint="use a host with more memory, a smaller --dtype, or --force to try anyway")
    if dry_run:
        summary["dry_run"] = True
        return summary
    with ck:
        result = _export(ck, model_dir, output, dtype=dtype, opset=opset, with_past=with_past,
                         position_ids=position_ids, atol=atol, threshold=external_data_threshold, force=force,
                         allow_pickle=allow_pickle, progress=progress, summary=summary)
    result["seconds"] = round(time.perf_counter() - t0, 3)
    result["memory"]["peak_rss_bytes"] = peak_rss_bytes()
    result["memory"]["peak_rss_over_weights"] = round(peak_rss_bytes() / max(mem["weight_bytes"], 1), 3)
    return result


def _export(ck, model_dir: Path, output: Path, *, dtype: str, opset: int, with_past: bool, position_ids: bool,
            atol: float | None, threshold: int, force: bool, allow_pickle: bool, progress: bool | None,
            summary: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch
    from tqdm import tqdm

    from dsconv.convert import hf_model, onnx_check, onnx_graph, onnx_wrapper
    from dsconv.io.writer import OutputDir

    options = {k: summary[k] for k in ("dtype", "opset", "with_past", "position_ids", "atol")}
    options["external_data_threshold"] = threshold
    timings: dict[str, float] = {}
    t = time.perf_counter()
    with OutputDir(output, stage="export", inputs=[model_dir], force=force, options=options,
                   input_identity=ck.identity()) as out:
        model, load_report = hf_model.load_for_export(ck, dtype)
        timings["load"] = time.perf_counter() - t
        tdtype = precision_torch_dtype(dtype)
        spec = onnx_wrapper.IOSpec(with_past, position_ids,
                                   onnx_wrapper.cache_geometry(model) if with_past else [])
        wrapper = onnx_wrapper.ExportWrapper(model, spec).eval()
        vocab = int(model.config.vocab_size)
        args = onnx_wrapper.trace_inputs(spec, vocab, tdtype)

        t = time.perf_counter()
        graph, emitted, method = onnx_graph.trace_checked(wrapper, args, spec, opset)
        ops = onnx_graph.op_types(graph)
        weights = onnx_graph.attach_weights(graph, dict(wrapper.state_dict(keep_vars=True)))
        total = onnx_graph.count_bytes(weights)
        external = total >= threshold
        timings["trace"] = time.perf_counter() - t

        t = time.perf_counter()
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="onnx weights", file=sys.stderr,
                   disable=(not sys.stderr.isatty()) if progress is None else not progress)
        # always external while checking (onnxruntime maps the weights instead of parsing a second copy);
        # models under the threshold are packed into model.onnx after the check
        files = onnx_graph.write_onnx(graph, weights, out.path, True, progress=bar.update)
        bar.close()
        weights_info = onnx_graph.describe_weights(weights)
        del graph, weights
        timings["write"] = time.perf_counter() - t

        t = time.perf_counter()
        ref_dtype = tdtype
        if dtype == "bf16":
            # onnxruntime has no bfloat16 CPU kernels: the graph is checked widened to fp32 (weights exact), so the
            # reference is the same model computing in fp32 on the same bf16 weights - the same function, exactly
            model.to(torch.float32)
            ref_dtype = torch.float32
        experts_total = 0
        hits = hf_model.ExpertHits(model, ck.family) if ck.facts.is_moe else None
        if hits is not None:
            experts_total = ck.facts.num_experts * len(hits.blocks)
            with hits, torch.no_grad():
                wrapper(*args)
                trace_hits = hits.take()
                ref = onnx_check.torch_reference(wrapper, spec, vocab, ref_dtype, hits, experts_total)
        else:
            trace_hits = frozenset()
            ref = onnx_check.torch_reference(wrapper, spec, vocab, ref_dtype)
        timings["torch_reference"] = time.perf_counter() - t
        if atol is None:  # the default tolerance scales with the reference's own float noise (tolerance.py)
            t = time.perf_counter()
            onnx_check.measure_noise(wrapper, model, spec, ref)
            timings["float64_reference"] = time.perf_counter() - t
        hf_model.release(model)
        del wrapper, model, args

        t = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=".dsconv-check-", dir=out.path.parent) as scratch:
            check_path = out.path / "model.onnx"
            float_type = np.float16 if dtype == "fp16" else np.float32
            if dtype == "bf16":
                check_path = onnx_graph.widen_bf16(check_path, Path(scratch))
                if atol is None:  # the graph's bf16-rounded constants (tanh-GELU's, some attention scales)
                    ref.bf16_constants = onnx_check.bf16_constants_noise(out.path / "model.onnx", check_path, spec,
                                                                         ref)
            report = onnx_check.onnxruntime_compare(check_path, spec, ref, atol, float_type)
        timings["onnxruntime_check"] = time.perf_counter() - t
        if dtype == "bf16":
            report["note"] = ("onnxruntime has no CPU kernels for bfloat16: the graph ran with its bf16 tensors "
                              "widened to float32 (weights exact), against PyTorch computing in float32 on the "
                              "same bf16 weights")
        if "moe" in report:
            report["moe"]["experts_hit_while_tracing"] = len(trace_hits)
            report["moe"]["experts_hit_only_by_check"] = len(frozenset().union(*ref.hits) - trace_hits)
        if not report["passed"]:
            msg, details = onnx_check.failure_message(report)
            raise CheckFailed(msg, hint="nothing was written; --atol sets an absolute bound instead if the error is "
                                        "expected",
                              details=details)

        if not external:
            onnx_graph.pack_external(out.path)
            files = ["model.onnx"]
        for f in ck.copy_files():
            out.copy_in(f)
        summary.update(
            files=files, external_data=external, opset_emitted=emitted, opset_method=method,
            integer_types=["int64"], op_types=ops, weights=weights_info, load=load_report,
            io=spec.describe(), check=report, timings={k: round(v, 3) for k, v in timings.items()},
        )
        if with_past:
            summary["cache"] = cache_summary(ck, spec, dtype)
        out.write_json("export_info.json", summary)
    return summary


def recheck(model_dir: Path, onnx_path: Path, *, dtype: str = "fp32", with_past: bool = False,
            position_ids: bool = False, atol: float | None = None) -> dict[str, Any]:
    """The export's check on an existing file: PyTorch on the checkpoint (its float noise measured as the export
    does) against `onnx_path` in onnxruntime; returns the check report, passed or not (no exception, nothing
    written). The I/O options must be the export's. For a changed graph (a fault injected into its weights, as the
    tests and benchmarks/bench_tolerance.py do) or a changed checkpoint (the reference side)."""
    import numpy as np
    import torch

    from dsconv.checkpoint import Checkpoint
    from dsconv.convert import hf_model, onnx_check, onnx_graph, onnx_wrapper

    onnx_path = Path(onnx_path)
    with Checkpoint.open(model_dir) as ck:
        model, _ = hf_model.load_for_export(ck, dtype)
        spec = onnx_wrapper.IOSpec(with_past, position_ids, onnx_wrapper.cache_geometry(model) if with_past else [])
        wrapper = onnx_wrapper.ExportWrapper(model, spec).eval()
        vocab = int(model.config.vocab_size)
        ref_dtype = precision_torch_dtype(dtype)
        if dtype == "bf16":
            model.to(torch.float32)
            ref_dtype = torch.float32
        hits = hf_model.ExpertHits(model, ck.family) if ck.facts.is_moe else None
        if hits is not None:
            with hits:
                ref = onnx_check.torch_reference(wrapper, spec, vocab, ref_dtype, hits,
                                                 ck.facts.num_experts * len(hits.blocks))
        else:
            ref = onnx_check.torch_reference(wrapper, spec, vocab, ref_dtype)
        if atol is None:
            onnx_check.measure_noise(wrapper, model, spec, ref)
        hf_model.release(model)
        del wrapper, model
    with tempfile.TemporaryDirectory(prefix=".dsconv-check-", dir=onnx_path.parent) as scratch:
        check_path = onnx_path
        if dtype == "bf16":
            check_path = onnx_graph.widen_bf16(onnx_path, Path(scratch))
            if atol is None:
                ref.bf16_constants = onnx_check.bf16_constants_noise(onnx_path, check_path, spec, ref)
        return onnx_check.onnxruntime_compare(check_path, spec, ref, atol,
                                              np.float16 if dtype == "fp16" else np.float32)


def cache_summary(ck, spec, dtype: str) -> dict[str, Any]:
    """What one token costs in the exported cache, and (MLA) against decompressed K/V."""
    size = {"fp32": 4, "fp16": 2, "bf16": 2}[dtype]
    per_token = sum(c.key_heads * c.key_dim + c.value_heads * c.value_dim for c in spec.cache) * size
    out: dict[str, Any] = {"bytes_per_token": per_token, "layers": len(spec.cache)}
    f = ck.facts
    if f.is_mla:
        full = f.num_layers * f.num_heads * (f.qk_nope_head_dim + f.qk_rope_head_dim + f.v_head_dim) * size
        out.update(kind="MLA latent (kv_lora_rank + qk_rope_head_dim per token and layer)",
                   decompressed_kv_bytes_per_token=full, reduction=round(full / per_token, 1))
    else:
        out["kind"] = "K/V per KV head"
    return out


def render(summary: dict[str, Any]) -> str:
    mem = summary["memory"]
    if summary.get("dry_run"):
        return (f"would export {summary['model']} to {summary['output']} as ONNX opset {summary['opset']} "
                f"({summary['dtype']}); weights {human_bytes(mem['weight_bytes'])} held in memory, estimated peak "
                f"{human_bytes(mem['estimated_peak_bytes'])} of {human_bytes(mem['available_bytes'])} available")
    from dsconv.convert import onnx_check

    check = summary["check"]
    lines = [f"wrote {summary['output']}: {', '.join(summary['files'])} (opset {summary['opset']}, {summary['dtype']}"
             f"{', external data' if summary['external_data'] else ''}"
             f"{', KV cache in/out' if summary['with_past'] else ''})",
             f"  inputs {', '.join(i['name'] for i in summary['io']['inputs'][:4])}"
             f"{' ...' if len(summary['io']['inputs']) > 4 else ''}; outputs "
             f"{', '.join(o['name'] for o in summary['io']['outputs'][:3])}"
             f"{' ...' if len(summary['io']['outputs']) > 3 else ''}",
             f"  check passed over {len(check['cases'])} inputs (onnxruntime vs PyTorch): "
             f"{onnx_check.summary_line(check)}"]
    if "moe" in check:
        m = check["moe"]
        lines.append(f"  MoE routing: {m['distinct_sets']} distinct expert sets over {len(m['experts_hit_per_input'])}"
                     f" inputs, {m['experts_hit_total']}/{m['experts_total']} experts hit")
    if "cache" in summary and "reduction" in summary["cache"]:
        c = summary["cache"]
        lines.append(f"  cache: {c['bytes_per_token']} B/token (MLA latent), {c['reduction']}x smaller than "
                     f"decompressed K/V")
    if summary.get("opset_method") not in (None, "exporter"):
        lines.append(f"  opset {summary['opset']} via {summary['opset_method']} (exporter emitted "
                     f"{summary['opset_emitted']}), re-checked")
    lines.append(f"  export holds the model in memory: {human_bytes(mem['weight_bytes'])} of weights, peak RSS "
                 f"{human_bytes(mem['peak_rss_bytes'])} (estimated {human_bytes(mem['estimated_peak_bytes'])}); "
                 f"{summary['seconds']:.1f} s")
    return "\n".join(lines)
