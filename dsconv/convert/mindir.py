"""`dsconv export --format mindir`: a MindSpore network built from the checkpoint, exported to MindIR, and proven
equal to the PyTorch model before anything is written.

No ONNX -> MindIR converter exists on PyPI, so dsconv writes the network in MindSpore (dsconv/model/ms: one builder
driven by the family table, on shared blocks; convert/ms_nets/worker.py runs it), streams the weights into it one
tensor at a time, and exports it with `mindspore.export`. The exported graph:

* inputs  `input_ids` int64 [batch, seq] and `attention_mask` int64 [batch, seq] (1 = token, 0 = padding), both
  dimensions dynamic; position ids are `cumsum(attention_mask) - 1`, as transformers' `generate()` makes them, so a
  left-padded row gives the same logits as the row alone;
* output  `logits` float32 [batch, seq, vocab] (logits at padding positions are finite but meaningless);
* MoE layers compute every routed expert for every token and combine them with the router's dense top-k weights:
  exact for any routing and exportable with dynamic shapes, at num_experts / top_k times the expert FLOPs of a
  sparse dispatch (right for the small models this path targets);
* `--dtype fp16` stores and computes in float16 (norms, softmax and routing in float32, as transformers does);
  `--dtype bf16` stores bf16 weights but computes in float32, because MindSpore's CPU kernels have no bf16
  MatMul/Softmax/Gather and every export is checked on CPU;
* weight-only quantized input (a `dsconv quantize` output, W8A16 / W4A16) keeps int8 (or packed int4) weights with
  their scales and dequantizes inside the graph; W8A8 is refused.

The check is part of the export: the MindIR file is loaded back with `mindspore.load` + `nn.GraphCell` and run on
three shapes (batch 2 with left padding, a single token, a longer sequence); its logits at the real (non-padding)
positions are compared with transformers' model in float32 on the same weights (dequantized for quantized input,
rounded to the export dtype for fp16/bf16). An error above the bound raises CheckFailed (exit 3) and nothing is
written: by default the bound follows the reference's own float noise on the same inputs (tolerance.py: measured
against the reference run in float64; in float16 for --dtype fp16, whose network computes in float16), with `--atol`
an absolute bound instead. MindSpore runs with a scratch directory as its cwd (in a child process for checkpoints
above ISOLATE_ABOVE_BYTES), so its debris (`rank_0/`, compile caches) never reaches the user's directories.
`--with-past` is refused: no KV-cache graph yet.
"""
from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from dsconv import schemas
from dsconv.convert import tolerance
from dsconv.convert.ms_nets import worker
from dsconv.convert.quant_onnx import cache_note, note_cache_scales
from dsconv.errors import CheckFailed, UserError
from dsconv.runtime.process import working_dir
from dsconv.tensors import precision_torch_dtype

DTYPES = ("fp32", "fp16", "bf16")
# The default tolerance is tolerance.py's noise rule. The reference is transformers' float32 model with its weights
# rounded to the export's storage dtype (compare_with_reference), so bf16 (bf16 weights, fp32 compute) is the same
# math as fp32 and its noise is float32's; fp16 also rounds every activation, so its noise is measured with the
# reference computing in float16. A fixed bound relative to the logits (1e-3 x max |logit| before) is what a deep
# model's float32 noise outgrows. The error against the unrounded model (the dtype's own cost, MoE routing flips
# included: 0.6 on the tiny DeepSeek in bf16) is reported, not gated.
STAGE = "mindir"
REPORT = "export_report.json"
INPUT_DTYPE = "int64"
# Checkpoints larger than this export in a child process (see ms_nets/worker.py): below it MindSpore's import
# (~4 s) would dominate; above it the memory MindSpore keeps after export would add to the PyTorch reference's.
ISOLATE_ABOVE_BYTES = 256 * 2**20


# ------------------------------------------------------------------------------------------------ environment
@contextlib.contextmanager
def scratch_dir(parent: Path, prefix: str) -> Iterator[Path]:
    """A scratch directory next to the output (same filesystem: the result is moved, not copied); removed
    afterwards with whatever MindSpore left in it."""
    parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _make_readable(path: Path) -> None:
    """MindSpore writes its files 0400; an output others deploy from should be 0644 like every other dsconv file."""
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for p in paths:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)


def input_bytes(ck) -> int:
    return sum(info.nbytes for info in ck.tensors.values())


# ------------------------------------------------------------------------------------------------ MindSpore side
def export_with_mindspore(ck, model_dir: Path, dtype: str, scratch: Path, allow_pickle: bool) -> dict[str, Any]:
    """worker.build_and_export into scratch/export: in-process (cwd = scratch) for checkpoints up to
    ISOLATE_ABOVE_BYTES, else in a child process whose memory is returned when it ends."""
    export_dir = scratch / "export"
    export_dir.mkdir()
    if not _isolate(ck):
        with working_dir(scratch):
            return worker.build_and_export(model_dir, dtype, export_dir, allow_pickle)
    return _run_child("export", scratch, {"model_dir": str(Path(model_dir).absolute()), "dtype": dtype,
                                          "export_dir": str(export_dir), "allow_pickle": allow_pickle})


def run_with_mindspore(ck, model_dir: Path, graph_file: Path, scratch: Path) -> dict[str, Any]:
    """worker.load_and_run on the exported file (a fresh child process for large checkpoints)."""
    vocab = int(ck.facts.vocab_size)
    if not _isolate(ck):
        with working_dir(scratch):
            return worker.load_and_run(graph_file, worker.cases_for(ck.config, vocab))
    result = _run_child("run", scratch, {"model_dir": str(Path(model_dir).absolute()), "graph_file": str(graph_file),
                                         "vocab": vocab})
    with np.load(scratch / worker.OUTPUTS) as npz:
        result["outputs"] = [npz[f"arr_{i}"] for i in range(len(npz.files))]
    return result


def _isolate(ck) -> bool:
    return input_bytes(ck) > ISOLATE_ABOVE_BYTES


def _run_child(step: str, scratch: Path, request: dict[str, Any]) -> dict[str, Any]:
    """`python -m dsconv.convert.ms_nets.worker STEP request.json` with cwd = scratch; its DsconvError re-raised
    here as is, any other failure (a MindSpore crash included) as a bug with the child's messages."""
    import io
    import json
    import subprocess
    import sys

    from dsconv.errors import DsconvError

    request_path = scratch / f"{step}-request.json"
    result_path = scratch / worker.RESULT
    result_path.unlink(missing_ok=True)
    request_path.write_text(json.dumps({**request, "out_dir": str(scratch)}))
    cmd = [sys.executable, "-m", "dsconv.convert.ms_nets.worker", step, str(request_path)]
    env = {**os.environ, "GLOG_v": os.environ.get("GLOG_v", "3")}
    try:  # the child's progress bar and messages go to our stderr; its stdout too (--json owns stdout)
        fd = sys.stderr.fileno()
        proc = subprocess.run(cmd, cwd=scratch, env=env, stdout=fd, stderr=fd)
        tail = ""
    except (AttributeError, OSError, io.UnsupportedOperation):
        proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True)
        tail = (proc.stderr or "")[-2000:]
    result = json.loads(result_path.read_text()) if result_path.is_file() else None
    if result is not None and "error" in result:
        err = result["error"]
        cls = next((c for c in (UserError, CheckFailed) if c.__name__ == err["kind"]), DsconvError)
        raise cls(err["message"], hint=err.get("hint"), details=err.get("details"))
    if proc.returncode != 0 or result is None:
        raise RuntimeError(f"the MindSpore {step} process failed (exit {proc.returncode})" +
                           (f":\n{tail}" if tail else "; its messages are above"))
    return result


# ------------------------------------------------------------------------------------------------ check
def reference_loader(ck):
    """Loads what `ck` means in float32 for the torch builder: FP8 dequantized by the reader, weight-only int8/int4
    weights dequantized with their scales (auxiliaries are then simply not asked for)."""
    import torch

    from dsconv.qformat import PACKED_INT4, dequant_weight, unpack_int4_by_shape

    desc = ck.quant_description or {}

    def load(name: str, dtype) -> "torch.Tensor":
        info = ck.info(name)
        if info.dtype != "I8":
            return ck.load(name, dequantize=True).to(dtype)
        prefix = name[: -len(".weight")]
        scale = ck.load(prefix + ".weight_scale").float().numpy()
        q = ck.load(name).numpy()
        if str(desc.get(name, desc.get("model_quant_type", ""))) in PACKED_INT4:  # two int4 per byte
            rows, cols = q.shape
            n = scale.shape[0]
            q = unpack_int4_by_shape(q, (n, cols) if rows * 2 == n else (rows, cols * 2), name)
        offset = ck.load(prefix + ".weight_offset").float().numpy() if prefix + ".weight_offset" in ck else None
        return torch.from_numpy(dequant_weight(q, scale, offset)).to(dtype)

    return load


def load_reference(ck, scratch: Path):
    """transformers' model in float32 (eager attention) on the same weights, built by the one torch builder from
    the reader (nothing written): the parity reference."""
    import torch

    from dsconv.convert.hf_model import quiet_transformers
    from dsconv.model import torch_builder

    with quiet_transformers():
        model, _ = torch_builder.build(ck, torch.float32, attn="eager", load=reference_loader(ck))
    return model.eval()


def _is_router(module) -> bool:
    return type(module).__name__.lower().endswith("router")


def _router_hooks(model, hits: dict[str, set[int]]) -> list:
    """Record which experts each router of the reference picks (to show the check exercised the routing)."""
    handles = []
    for name, module in model.named_modules():
        if _is_router(module):
            def hook(mod, args, output, name=name):
                if isinstance(output, tuple) and len(output) == 3:
                    hits.setdefault(name, set()).update(int(i) for i in output[2].reshape(-1).tolist())
            handles.append(module.register_forward_hook(hook))
    return handles


def round_weights(model, dtype: str) -> None:
    """Round the reference's weights to the export's storage dtype, as the MindIR stores them (routers stay
    float32 there and here); the compute stays float32."""
    import torch

    target = precision_torch_dtype(dtype)
    with torch.no_grad():
        for module in model.modules():
            if _is_router(module):
                continue
            for p in module.parameters(recurse=False):
                p.copy_(p.to(target).float())


def _forward(model, cases) -> list[np.ndarray]:
    """The model's logits per check case, in the dtype it computed them in (as numpy)."""
    import torch

    out = []
    with torch.no_grad():
        for _, ids, mask in cases:
            positions = torch.from_numpy(np.maximum(mask.cumsum(1) - 1, 0))
            logits = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                           position_ids=positions).logits
            out.append(logits.float().numpy() if logits.dtype in (torch.float16, torch.bfloat16) else logits.numpy())
    return out


@contextlib.contextmanager
def _computing_in(model, dtype: str) -> Iterator[None]:
    """The reference computing in the export's compute dtype: float16 for fp16 (weights already rounded, routers
    kept float32 and fed float32 as the MindIR network does), float32 otherwise (as it is)."""
    import torch

    if dtype != "fp16":
        yield
        return
    handles = []
    for module in model.modules():
        if _is_router(module):  # float32 weights, float32 in; its float32 outputs are cast where transformers mixes
            handles.append(module.register_forward_pre_hook(
                lambda m, args: tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a
                                      for a in args)))
            continue
        for p in module.parameters(recurse=False):
            p.data = p.data.half()
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for module in model.modules():
            if not _is_router(module):
                for p in module.parameters(recurse=False):
                    p.data = p.data.float()


def reference_noise(model, cases, dtype: str, reference: list[np.ndarray]) -> list[float]:
    """The reference's own float noise per case (tolerance.py): max |the reference in the export's compute dtype -
    the same weights in float64| at real positions. For fp32/bf16 the compute-dtype run is `reference` itself."""

    if dtype == "fp16":
        with _computing_in(model, dtype):
            compute = _forward(model, cases)
    else:
        compute = reference
    with tolerance.in_float64(model):
        exact = _forward(model, cases)
    return [float(np.abs(c[mask.astype(bool)].astype(np.float64) - e[mask.astype(bool)]).max())
            for (_, _, mask), c, e in zip(cases, compute, exact)]


def _compare(name: str, got: np.ndarray, ref: np.ndarray, mask: np.ndarray) -> dict[str, Any]:
    if got.shape != ref.shape:
        raise CheckFailed(f"MindIR logits have shape {list(got.shape)} for {name}, PyTorch {list(ref.shape)}",
                          hint="this is a bug in the MindSpore network; please report it")
    real = mask.astype(bool)
    finite = bool(np.isfinite(got).all())
    diff = np.abs(got[real].astype(np.float64) - ref[real].astype(np.float64))
    return {"max_abs_err": float(diff.max()) if finite else float("inf"),
            "mean_abs_err": float(diff.mean()) if finite else float("inf"),
            "ref_max_abs": float(np.abs(ref[real]).max()),
            "top1_agreement": float((got[real].argmax(-1) == ref[real].argmax(-1)).mean()), "finite": finite}


def compare_with_reference(ck, scratch: Path, outputs: list[np.ndarray], dtype: str,
                           atol: float | None) -> dict[str, Any]:
    """The MindIR's logits (per check case) against transformers' model, per shape.

    The gate compares with the float32 model whose weights are rounded to the export's storage dtype (for fp32
    and bf16 that is exactly the graph's math; fp16 also rounds activations). For fp16/bf16 the error against the
    unrounded model (what the dtype costs, routing flips included) is reported beside it, not gated. Without
    --atol the bound is tolerance.bound(noise, max |reference logit|), the same for every shape: noise is the
    reference's own float noise (max over the shapes of |the reference in the export's compute dtype - float64|),
    so the bound follows the model's depth, width and logit scale; with --atol it is that absolute value.
    """

    cases = worker.cases_for(ck.config, int(ck.facts.vocab_size))
    model = load_reference(ck, scratch)
    hits: dict[str, set[int]] = {}
    handles = _router_hooks(model, hits)
    try:
        original = _forward(model, cases)
    finally:
        for h in handles:
            h.remove()
    rounded = original
    if dtype != "fp32":
        round_weights(model, dtype)
        rounded = _forward(model, cases)
    noise = reference_noise(model, cases, dtype, rounded) if atol is None else None
    del model
    gc.collect()
    shapes = []
    for i, ((name, ids, mask), got, ref, orig) in enumerate(zip(cases, outputs, rounded, original)):
        figures = {"name": name, "shape": list(ids.shape), "real_tokens": int(mask.sum()), **_compare(name, got, ref,
                                                                                                     mask)}
        if noise is not None:
            figures["noise"] = noise[i]
        if dtype != "fp32":
            vs = _compare(name, got, orig, mask)
            figures["vs_unrounded"] = {"max_abs_err": vs["max_abs_err"], "top1_agreement": vs["top1_agreement"]}
        shapes.append(figures)
    scale = max(s["ref_max_abs"] for s in shapes)
    observed = max(s["max_abs_err"] for s in shapes)
    limit = float(atol) if noise is None else tolerance.bound(max(noise), scale)
    for s in shapes:
        s["tolerance"] = limit
        s["passed"] = s["max_abs_err"] <= limit
    reference = "transformers float32" + ("" if dtype == "fp32" else
                                          f", weights rounded to {dtype} as stored (routers float32)")
    result: dict[str, Any] = {
        "reference": reference, "rule": "atol" if noise is None else "noise",
        "tolerance": f"max |MindIR - reference| <= atol {atol:g}" if noise is None else tolerance.rule_text(),
        "atol": atol, "bound": limit, "max_abs_err": observed,
        "margin": tolerance.json_margin(tolerance.margin(limit, observed)),
        "passed": all(s["passed"] for s in shapes),
        "compared": "logits at real (non-padding) positions", "shapes": shapes}
    if noise is not None:
        result.update(noise=max(noise), max_abs_ref=scale, noise_dtype="fp16" if dtype == "fp16" else "fp32",
                      constants={"K": tolerance.NOISE_K, "floor": tolerance.NOISE_FLOOR})
    if dtype != "fp32":
        result["max_abs_err_vs_unrounded"] = max(s["vs_unrounded"]["max_abs_err"] for s in shapes)
    if hits:
        counts = [len(v) for v in hits.values()]
        result["experts_hit"] = {"min_per_layer": min(counts), "max_per_layer": max(counts),
                                 "num_experts": int(ck.facts.num_experts), "moe_layers": len(counts)}
    return result


def _check_table(check: dict[str, Any]) -> str:
    noise = check["rule"] == "noise"
    lines = [f"{'shape':<24} {'max |err|':>10} {'bound':>10} {'noise':>10} {'mean |err|':>11} {'max |ref|':>10} "
             f"{'top-1':>6}"]
    for s in check["shapes"]:
        lines.append(f"{s['name']:<24} {s['max_abs_err']:>10.3g} {s['tolerance']:>10.3g} "
                     f"{(format(s['noise'], '.3g') if noise else '-'):>10} {s['mean_abs_err']:>11.3g} "
                     f"{s['ref_max_abs']:>10.3g} {s['top1_agreement']:>6.1%}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ entry point
def export_mindir(model_dir: Path, output: Path, *, dtype: str = "fp32", with_past: bool = False,
                  atol: float | None = None, force: bool = False, allow_pickle: bool = False) -> dict:
    """Export `model_dir` to `output/model.mindir` (or `model_graph.mindir` + `model_variables/` above ~1 GiB),
    checked against PyTorch on three shapes; returns a JSON-ready summary (files, sizes, parity per shape, dtype,
    seconds). CheckFailed (exit 3) when the check fails: nothing is written then."""
    from dsconv.checkpoint import Checkpoint

    t0 = time.perf_counter()
    model_dir, output = Path(model_dir).absolute(), Path(output).absolute()  # MindSpore runs in another cwd
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r} is not a MindIR export dtype", hint=f"use one of {', '.join(DTYPES)}")
    if with_past:
        raise UserError("--with-past is not supported for MindIR yet",
                        hint="export without it: the MindIR recomputes the whole sequence on each call")
    if atol is not None and not atol > 0:
        raise UserError(f"--atol {atol} must be positive",
                        hint="omit it for the default, derived from the reference's own float noise")
    worker.require_mindspore()
    with Checkpoint.open(model_dir, allow_pickle=allow_pickle) as ck:  # a network per family (model/ms/build.py)
        if ck.family.mindir_refused:
            other = "onnx instead" if not ck.family.onnx_refused else "safetensors, or quantize it for an engine"
            raise UserError(f"{model_dir}: --format mindir cannot export {ck.family.name}: "
                            f"{ck.family.mindir_refused}", hint=f"export --format {other}")
        return _export(ck, model_dir, output, dtype, atol, force, allow_pickle, t0)


def _export(ck, model_dir: Path, output: Path, dtype: str, atol: float | None, force: bool, allow_pickle: bool,
            t0: float) -> dict:
    from dsconv.io.writer import OutputDir
    from dsconv.model.ms.weights import Precision

    options = {"format": "mindir", "dtype": dtype, "with_past": False, "atol": atol}
    with OutputDir(output, stage=STAGE, inputs=[model_dir], force=force, options=options,
                   input_identity=ck.identity()) as out:
        with scratch_dir(out.path.parent, f".{output.name}.mindir-scratch-") as scratch:
            ms_side = export_with_mindspore(ck, model_dir, dtype, scratch, allow_pickle)
            graph_file = scratch / "export" / ms_side["graph_file"]
            ran = run_with_mindspore(ck, model_dir, graph_file, scratch)
            t = time.perf_counter()
            check = compare_with_reference(ck, scratch, ran["outputs"], dtype, atol)
            for shape, run_s in zip(check["shapes"], ran["mindspore_run_s"]):
                shape["mindspore_s"] = run_s
            reference_s = time.perf_counter() - t
            if not check["passed"]:
                worst = max(check["shapes"], key=lambda s: s["max_abs_err"])
                raise CheckFailed(f"{output}: MindIR logits differ from PyTorch by {worst['max_abs_err']:.3g} "
                                  f"> bound {worst['tolerance']:.3g} ({tolerance.bound_text(check)}) on "
                                  f"{worst['name']}; nothing written",
                                  hint="--atol sets an absolute bound instead if the dtype explains it, else report it",
                                  details=_check_table(check))
            for name in ms_side["written"]:
                shutil.move(str(scratch / "export" / name), str(out.path / name))
                _make_readable(out.path / name)
        for src in ck.copy_files():
            out.copy_in(src)
        files = {p.relative_to(out.path).as_posix(): p.stat().st_size
                 for p in sorted(out.path.rglob("*")) if p.is_file()}
        mindir_bytes = sum(size for rel, size in files.items() if rel.endswith(".mindir") or "_variables/" in rel)
        summary = {
            "format": "mindir", "model": str(model_dir), "output": str(output), "family": ck.family.name,
            "mindir": ms_side["graph_file"], "files": files, "mindir_bytes": mindir_bytes,
            "input_bytes": input_bytes(ck), "parameter_bytes": ms_side["parameter_bytes"],
            "dtype": dtype, "compute_dtype": Precision(dtype).compute_name,
            "inputs": {"input_ids": f"{INPUT_DTYPE} [batch, seq]", "attention_mask": f"{INPUT_DTYPE} [batch, seq]"},
            "outputs": {"logits": "float32 [batch, seq, vocab]"},
            "quantized": ck.is_quantized, "linear_weights": ms_side["linear_weights"],
            "mtp_tensors_skipped": ms_side["mtp_tensors_skipped"],
            "moe": "every expert computed, dense top-k combine" if ck.facts.is_moe else None,
            "with_past": False, "check": check,
            "seconds": {**ms_side["seconds"], "load": ran["load_s"], "reference_and_compare": round(reference_s, 3),
                        "total": round(time.perf_counter() - t0, 3)},
            "mindspore_in_child_process": _isolate(ck),
            "peak_rss_bytes": max(worker.peak_rss_bytes(), ms_side["peak_rss_bytes"], ran["peak_rss_bytes"]),
            "peak_rss_by_step": ({"export (child)": ms_side["peak_rss_bytes"], "check (child)": ran["peak_rss_bytes"],
                                  "dsconv (reference)": worker.peak_rss_bytes()} if _isolate(ck) else None),
        }
        note_cache_scales(summary, ck.quant_description)
        out.write_json(REPORT, summary)
    return summary


def render(summary: dict[str, Any]) -> str:
    """A few lines for the terminal (the command prints this unless --json)."""
    c = summary["check"]
    lines = [f"wrote {summary['output']}/{summary['mindir']} ({summary['mindir_bytes'] / 1e6:.1f} MB, "
             f"{summary['dtype']} weights, {summary['compute_dtype']} compute) in {summary['seconds']['total']:.1f}s",
             f"inputs input_ids, attention_mask: {INPUT_DTYPE} [batch, seq] (dynamic); output logits float32",
             f"checked with mindspore.load + GraphCell against {c['reference']} (real positions): max |err| "
             f"{c['max_abs_err']:.2g} <= bound {c['bound']:.2g} ({tolerance.bound_text(c)}; "
             f"{'exact' if c['margin'] is None else format(c['margin'], '.3g') + 'x'} margin)"]
    lines += ["  " + line for line in _check_table(c).splitlines()]
    if "max_abs_err_vs_unrounded" in c:
        lines.append(f"  against the unrounded float32 model: max |err| {c['max_abs_err_vs_unrounded']:.3g} "
                     f"(what {summary['dtype']} costs)")
    if summary["quantized"]:
        lines.append(f"  linear weights: {summary['linear_weights']} (dequantized inside the graph)")
    lines += cache_note(summary.get("kv_cache_scales_left_out"))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ verify
def verify_mindir(directory: Path, manifest: dict) -> list[str]:
    """`dsconv verify`: the MindIR loads and maps one token to finite logits of the config's vocabulary."""
    import json

    try:
        graph_file, _ = worker.mindir_files(directory)
    except FileNotFoundError as e:
        return [str(e)]
    ms = worker.import_mindspore()
    from mindspore import Tensor, nn

    config = directory / "config.json"
    vocab = schemas.config(schemas.read_json(config, "config", "rerun the export"), str(config))["vocab_size"] \
        if config.is_file() else None
    with tempfile.TemporaryDirectory(prefix="dsconv-verify-") as scratch, working_dir(Path(scratch)), \
            worker.graph_mode(ms):
        try:
            logits = nn.GraphCell(ms.load(str(graph_file.absolute())))(
                Tensor(np.zeros((1, 1), np.int64)), Tensor(np.ones((1, 1), np.int64))).asnumpy()
        except Exception as e:  # MindSpore raises RuntimeError/ValueError subclasses for damaged files
            return [f"{graph_file.name}: MindSpore cannot run it ({type(e).__name__}: {str(e).splitlines()[0][:200]})"]
    problems = []
    if vocab is not None and logits.shape != (1, 1, vocab):
        problems.append(f"{graph_file.name}: logits shape {list(logits.shape)}, expected [1, 1, {vocab}]")
    if not np.isfinite(logits).all():
        problems.append(f"{graph_file.name}: non-finite logits for one token")
    return problems
