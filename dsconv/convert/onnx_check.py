"""The parity check that is part of `dsconv export`: the written ONNX file in onnxruntime against PyTorch.

It runs in two halves so that the two runtimes never hold the model at the same time: `torch_reference` runs the
traced wrapper (transformers' model, the same weights) on every check input while the model is loaded, and
`onnxruntime_compare` loads the written file after the torch model is gone and compares.

Inputs (`plan_steps`), seeded:
  without a cache  batch 2 / 9 tokens with the second row left-padded by 3; a single token; batch 1 / 33 tokens;
  with a cache     a left-padded batch-2 prefill from an empty cache, two single-token decode steps and a 4-token
                   chunk on top, each fed the cache its own runtime produced (two independent chains).
Logits and cache outputs are compared at real tokens only (values at padding positions are defined but
meaningless: nothing attends to them, and runtimes may differ on fully masked rows). Any non-finite value where
PyTorch has a finite one counts as an infinite error.

The bound (tolerance.py): without --atol, NOISE_K x the reference's own float noise (the same steps with the model
computing in float64, `measure_noise`) + NOISE_FLOOR x the largest output, per output kind (logits, cache). fp16:
the reference computes in fp16 like the graph, so the noise is fp16's. bf16: onnxruntime has no bf16 CPU kernels,
so the graph runs widened to fp32 against PyTorch in fp32 on the same bf16 weights - the same function except for
the graph's scalar constants, which the exporter rounded to bf16 (tanh-GELU's coefficients, some attention scales):
what they can move is measured on the widened graph (`bf16_constants_noise`) and added to the bound. With --atol,
the bound is that absolute value.

MoE: the experts each input routes to are recorded (hooks on the expert blocks); the check demands that not every
input hits the same set, adding inputs until they differ, so a graph with routing baked in cannot pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from dsconv.convert.onnx_wrapper import IOSpec
from dsconv.errors import CheckFailed

MAX_EXTRA_ROUTING_INPUTS = 8


@dataclass
class Step:
    name: str
    input_ids: np.ndarray  # int64 [batch, seq]
    attention_mask: np.ndarray  # int64 [batch, past + seq]
    chained: bool = False  # past = the previous step's present; else an empty cache

    @property
    def batch(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def past(self) -> int:
        return int(self.attention_mask.shape[1] - self.input_ids.shape[1])


def plan_steps(spec: IOSpec, vocab: int, seed: int = 20240611) -> list[Step]:
    rng = np.random.default_rng(seed)

    def ids(b: int, s: int) -> np.ndarray:
        return rng.integers(0, vocab, size=(b, s), dtype=np.int64)

    padded = np.ones((2, 9), dtype=np.int64)
    padded[1, :3] = 0
    if not spec.with_past:
        return [Step("batch 2 x 9 tokens, row 2 left-padded by 3", ids(2, 9), padded),
                Step("1 token", ids(1, 1), np.ones((1, 1), dtype=np.int64)),
                Step("batch 1 x 33 tokens", ids(1, 33), np.ones((1, 33), dtype=np.int64))]
    steps = [Step("prefill: batch 2 x 9 tokens, row 2 left-padded by 3, empty cache", ids(2, 9), padded)]
    mask = padded
    for i, n in enumerate((1, 1, 4)):
        mask = np.concatenate([mask, np.ones((2, n), dtype=np.int64)], axis=1)
        label = f"decode {i + 1}: 1 token" if n == 1 else f"chunk: {n} tokens"
        steps.append(Step(f"{label}, cache {mask.shape[1] - n}", ids(2, n), mask, chained=True))
    return steps


def extra_routing_step(vocab: int, k: int) -> Step:
    rng = np.random.default_rng(1000 + k)
    n = 5 + 3 * k
    return Step(f"routing probe {k + 1}: batch 1 x {n} tokens", rng.integers(0, vocab, size=(1, n), dtype=np.int64),
                np.ones((1, n), dtype=np.int64))


def positions(mask: np.ndarray, seq: int) -> np.ndarray:
    pos = np.cumsum(mask, axis=-1) - 1
    pos[mask == 0] = 1
    return pos[:, mask.shape[1] - seq:].astype(np.int64)


@dataclass
class Reference:
    steps: list[Step]
    outputs: list[list[np.ndarray]]  # per step, in spec.output_names order (float32)
    hits: list[frozenset] = field(default_factory=list)  # per step (MoE only)
    experts_total: int = 0
    #: the reference's own float noise per output kind ("logits", "cache"): max |reference - float64 reference|
    #: over the steps at real positions (measure_noise); None until measured
    noise: dict[str, float] | None = None
    #: per output kind, what a bf16 graph's rounded constants can move (bf16_constants_noise); added to the bound
    #: as measured (it is already a worst-case estimate), not multiplied by NOISE_K
    bf16_constants: dict[str, float] | None = None


def _run(wrapper, spec: IOSpec, step: Step, dtype, previous: list) -> list:
    """One check input through the wrapper (the cache of the previous step fed back for chained steps)."""
    import torch

    args = [torch.from_numpy(step.input_ids), torch.from_numpy(step.attention_mask)]
    if spec.position_ids:
        args.append(torch.from_numpy(positions(step.attention_mask, step.seq)))
    if spec.with_past:
        if step.chained:
            args += previous
        else:
            for i in range(len(spec.cache)):
                for which in ("key", "value"):
                    args.append(torch.zeros(spec.past_shape(i, which, step.batch, 0), dtype=dtype))
    with torch.no_grad():
        out = wrapper(*args)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def torch_reference(wrapper, spec: IOSpec, vocab: int, dtype, hits=None, experts_total: int = 0) -> Reference:
    """Run the wrapper in PyTorch on every check input (and routing probes until MoE routing differs)."""
    steps = plan_steps(spec, vocab)
    ref = Reference([], [], [], experts_total)
    previous: list = []

    def run(step: Step) -> None:
        nonlocal previous
        outs = _run(wrapper, spec, step, dtype, previous)
        previous = outs[1:]
        ref.steps.append(step)
        ref.outputs.append([o.detach().float().numpy() for o in outs])
        if hits is not None:
            ref.hits.append(hits.take())

    for step in steps:
        run(step)
    if hits is not None and hits.blocks:
        k = 0
        while len(set(ref.hits)) < 2:
            if k == MAX_EXTRA_ROUTING_INPUTS:
                raise CheckFailed("every check input routes to the same experts, so the check cannot prove that "
                                  "routing follows the input", hint="the model's routers look degenerate")
            run(extra_routing_step(vocab, k))
            k += 1
    return ref


def measure_noise(wrapper, model, spec: IOSpec, ref: Reference) -> dict[str, float]:
    """The reference's own float noise (tolerance.py): the same steps again with `model` computing in float64
    (tolerance.in_float64: one layer widened at a time), max |reference - float64| per output kind at the positions
    the check compares. Stored in ref.noise and returned."""
    import torch

    from dsconv.convert import tolerance

    noise = {"logits": 0.0, "cache": 0.0} if spec.with_past else {"logits": 0.0}
    previous: list = []
    with tolerance.in_float64(model):
        for step, want in zip(ref.steps, ref.outputs):
            outs = _run(wrapper, spec, step, torch.float64, previous)
            previous = outs[1:]
            masks = _real(step)
            for name, o, w in zip(spec.output_names, outs, want):
                kind = "logits" if name == "logits" else "cache"
                err, _ = _worst(o.detach().numpy(), w.astype(np.float64), masks[kind], cache=kind == "cache")
                noise[kind] = max(noise[kind], err)
    ref.noise = noise
    return noise


#: relative size of the nudge that measures what the bf16 rounding of a graph constant can move (half a bf16 ulp:
#: bf16 keeps 8 significant bits, so a rounded constant is off by at most 2^-9 of itself)
BF16_HALF_ULP = 2.0 ** -9


def rounded_bf16_constants(bf16_path: Path) -> list[str]:
    """The outputs of the bf16 graph's Constant nodes whose value looks rounded to bf16: finite scalars-or-small
    tensors below 1e30 in magnitude (not the mask's -3.39e38) with more than 4 significant bits. The exporter makes
    every Python float that meets a bf16 tensor a bf16 constant: 0.5, 1.0, 8.0 or 30.0 stay exact, but tanh-GELU's
    0.044715 and sqrt(2/pi) or an attention scale of 24^-0.5 are rounded (0.0447, 0.797, 0.2041), where PyTorch's
    float32 reference keeps them exact."""
    import onnx
    from onnx import numpy_helper

    names = []
    for node in onnx.load(str(bf16_path), load_external_data=False).graph.node:
        if node.op_type != "Constant":
            continue
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == onnx.TensorProto.BFLOAT16:
                v = numpy_helper.to_array(attr.t).astype(np.float64).ravel()
                if v.size <= 64 and np.isfinite(v).all() and any(_significant_bits(x) > 4 for x in v if abs(x) < 1e30):
                    names.append(node.output[0])
    return names


def _significant_bits(x: float) -> int:
    if x == 0:
        return 0
    m, _ = np.frexp(abs(x))  # x = m * 2^e, 0.5 <= m < 1
    bits = 0
    while m != 0 and bits < 64:
        m = m * 2 - int(m * 2)
        bits += 1
    return bits


def bf16_constants_noise(bf16_path: Path, twin_path: Path, spec: IOSpec, ref: Reference) -> dict[str, float]:
    """What the bf16 rounding of the graph's constants can move the outputs by (export --dtype bf16): the float32
    twin (onnx_graph.widen_bf16) against a copy whose rounded-looking constants (rounded_bf16_constants) are moved
    by half a bf16 ulp, max |difference| per output kind at real positions. The twin computes in float32 on the bf16
    weights like the reference, but its constants are the bf16 ones: that is part of the bf16 graph (the device
    computes with them), not an export error, and the tolerance allows for it. 0 when no constant looks rounded
    (Llama-style models); the copy shares the twin's external weights."""
    import onnx
    import onnxruntime as ort

    kinds = ["logits", "cache"] if spec.with_past else ["logits"]
    names = set(rounded_bf16_constants(bf16_path))
    if not names:
        return {k: 0.0 for k in kinds}
    m = onnx.load(str(twin_path), load_external_data=False)
    for node in m.graph.node:
        if node.op_type == "Constant" and node.output[0] in names:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    v = onnx.numpy_helper.to_array(attr.t)
                    moved = np.where(np.abs(v) < 1e30, v * (1 - BF16_HALF_ULP), v).astype(v.dtype)
                    attr.t.CopyFrom(onnx.numpy_helper.from_array(moved, attr.t.name))
    nudged = twin_path.with_name(twin_path.stem + "_nudged.onnx")
    onnx.save(m, str(nudged))
    del m
    noise = {k: 0.0 for k in kinds}
    ort.set_default_logger_severity(4)
    try:  # one session at a time; the outputs of a few check inputs are small
        plain = [got for _, got in _run_steps(ort, twin_path, spec, ref.steps, np.float32)]
        for (step, moved), got in zip(_run_steps(ort, nudged, spec, ref.steps, np.float32), plain):
            masks = _real(step)
            for name, x, y in zip(spec.output_names, got, moved):
                kind = _kind(name)
                noise[kind] = max(noise[kind], _worst(y, x, masks[kind], cache=kind == "cache")[0])
    finally:
        ort.set_default_logger_severity(2)
        nudged.unlink(missing_ok=True)
    return noise


def _real(step: Step) -> dict[str, np.ndarray]:
    """The positions compared per output kind: logits [batch, seq] at real tokens, cache [batch, past + seq]."""
    return {"logits": step.attention_mask[:, step.past:] == 1, "cache": step.attention_mask == 1}


def onnxruntime_compare(onnx_path: Path, spec: IOSpec, ref: Reference, atol: float | None,
                        float_type) -> dict[str, Any]:
    """Run the written file on the reference inputs and compare; returns the check report (passed or not). Without
    `atol`, the bound comes from ref.noise (measure_noise must have run)."""
    import onnxruntime as ort

    ort.set_default_logger_severity(4)  # failures become CheckFailed below, not log lines
    try:
        return _compare_in_onnxruntime(ort, onnx_path, spec, ref, atol, float_type)
    finally:
        ort.set_default_logger_severity(2)  # onnxruntime's default


def _session(ort, onnx_path: Path):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.disable_prepacking", "1")  # no packed second copy of every weight
    # a fake-quant model is checked with the ONNX semantics of QuantizeLinear/DequantizeLinear (float math), not with
    # onnxruntime's int8 QDQ fusion, whose kernels differ from them (0.49 on the tiny DeepSeek's logits)
    opts.add_session_config_entry("session.disable_quant_qdq", "1")
    try:
        return ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types
        raise CheckFailed(f"onnxruntime cannot load the exported graph: {_first_line(e)}",
                          hint="nothing was written; report the model type") from None


def _run_steps(ort, onnx_path: Path, spec: IOSpec, steps: list[Step], float_type) -> Iterator[tuple[Step, list]]:
    """(step, onnxruntime's outputs) for each check input, chained steps fed the cache the graph produced."""
    session = _session(ort, onnx_path)
    run_opts = ort.RunOptions()
    run_opts.log_severity_level = 4
    previous: list[np.ndarray] = []
    try:
        for step in steps:
            feeds: dict[str, np.ndarray] = {"input_ids": step.input_ids, "attention_mask": step.attention_mask}
            if spec.position_ids:
                feeds["position_ids"] = positions(step.attention_mask, step.seq)
            if spec.with_past:
                past_names = [n for n in spec.input_names if n.startswith("past_key_values.")]
                for j, name in enumerate(past_names):
                    if step.chained:
                        feeds[name] = previous[j]
                    else:
                        i, which = int(name.split(".")[1]), name.split(".")[2]
                        feeds[name] = np.zeros(spec.past_shape(i, which, step.batch, 0), dtype=float_type)
            try:
                got = session.run(spec.output_names, feeds, run_opts)
            except Exception as e:  # a graph that runs on the trace input but not on another (e.g. baked routing)
                raise CheckFailed(f"onnxruntime cannot run the exported graph on input '{step.name}': "
                                  f"{_first_line(e)}",
                                  hint="nothing was written; the graph depends on the tracing input") from None
            previous = got[1:]
            yield step, got
    finally:
        del session  # unmaps the weights before the caller touches the files again


def _compare_in_onnxruntime(ort, onnx_path: Path, spec: IOSpec, ref: Reference, atol: float | None,
                            float_type) -> dict[str, Any]:
    cases = []
    scale = {"logits": 0.0, "cache": 0.0} if spec.with_past else {"logits": 0.0}
    for (step, got), want in zip(_run_steps(ort, onnx_path, spec, ref.steps, float_type), ref.outputs):
        masks = _real(step)
        errors: dict[str, float] = {}
        wheres: dict[str, list[int]] = {}
        for name, g, w in zip(spec.output_names, got, want):
            kind = _kind(name)
            errors[name], wheres[name] = _worst(g.astype(np.float32), w, masks[kind], cache=kind == "cache")
            scale[kind] = max(scale[kind], _largest(w, masks[kind], cache=kind == "cache"))
        cases.append((step, errors, wheres))
    return _report(spec, ref, cases, scale, atol)


def _kind(name: str) -> str:
    return "logits" if name == "logits" else "cache"


def _largest(want: np.ndarray, real: np.ndarray, cache: bool) -> float:
    keep = real[:, None, :, None] if cache else real[:, :, None]
    a = np.where(keep, np.abs(np.nan_to_num(want, nan=0.0, posinf=0.0, neginf=0.0)), 0.0)
    return float(a.max()) if a.size else 0.0


def _report(spec: IOSpec, ref: Reference, cases_in: list, scale: dict[str, float],
            atol: float | None) -> dict[str, Any]:
    """The check report: per input the worst output; per output kind the observed error, the bound and the margin
    (bound / observed). Without `atol`, the bound is tolerance.bound(noise, scale) of the reference's measured
    noise (ref.noise); with it, `atol` for every output."""
    from dsconv.convert import tolerance

    kinds = list(scale)
    if atol is None:
        if ref.noise is None:
            raise RuntimeError("the reference's noise was not measured (onnx_check.measure_noise)")
        extra = ref.bf16_constants or {}
        bounds = {k: tolerance.bound(ref.noise[k], scale[k], extra.get(k, 0.0)) for k in kinds}
    else:
        bounds = {k: float(atol) for k in kinds}
    observed = {k: 0.0 for k in kinds}
    cases = []
    for step, errors, wheres in cases_in:
        # this input's worst output: the one closest to (or furthest past) its bound
        name = max(errors, key=lambda n: _ratio(errors[n], bounds[_kind(n)]))
        case = {"name": step.name, "batch": step.batch, "tokens": step.seq, "past": step.past,
                "max_abs_err": errors[name], "output": name, "where": wheres[name],
                "bound": bounds[_kind(name)], "logits_max_abs_err": errors["logits"]}
        if spec.with_past:
            case["cache_max_abs_err"] = max(v for k, v in errors.items() if k != "logits")
        for n, e in errors.items():
            observed[_kind(n)] = max(observed[_kind(n)], e)
        cases.append(case)
    worst = max(cases, key=lambda c: _ratio(c["max_abs_err"], c["bound"]))
    margins = {k: tolerance.margin(bounds[k], observed[k]) for k in kinds}
    report: dict[str, Any] = {
        "rule": "noise" if atol is None else "atol",
        "tolerance": (tolerance.rule_text(None if ref.bf16_constants is None else
                                          "what the graph's bf16-rounded constants move the outputs by")
                      if atol is None else f"max |export - reference| <= atol {atol:g}"),
        "atol": atol, "passed": all(observed[k] <= bounds[k] for k in kinds),
        "max_abs_err": observed, "bound": bounds, "margin": tolerance.json_margin(min(margins.values())),
        "cases": cases, "worst": {k: worst[k] for k in ("name", "output", "max_abs_err", "where", "bound")}}
    if atol is None:
        report["noise"] = dict(ref.noise)
        if ref.bf16_constants is not None:
            report["bf16_constants"] = dict(ref.bf16_constants)
        report["max_abs_ref"] = scale
        report["constants"] = {"K": tolerance.NOISE_K, "floor": tolerance.NOISE_FLOOR}
    if ref.hits:
        distinct = len(set(ref.hits))
        report["moe"] = {"experts_hit_per_input": [len(h) for h in ref.hits], "distinct_sets": distinct,
                         "routing_differs": distinct > 1, "experts_hit_total": len(frozenset().union(*ref.hits)),
                         "experts_total": ref.experts_total}
    return report


def _ratio(err: float, bound: float) -> float:
    return err / bound if bound > 0 else float("inf") if err > 0 else 0.0




def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__


def _worst(got: np.ndarray, want: np.ndarray, real: np.ndarray, cache: bool = False) -> tuple[float, list[int]]:
    """Largest |got - want| over real tokens and its index: logits [batch, position, vocab], cache outputs
    [batch, head, position, dim]. Padding positions hold defined but meaningless values (never attended to)."""
    if got.shape != want.shape:
        return float("inf"), list(got.shape)
    diff = np.abs(got - want)
    bad = ~np.isfinite(got) & np.isfinite(want)
    diff = np.where(bad, np.inf, np.nan_to_num(diff, nan=0.0))
    keep = real[:, None, :, None] if cache else real[:, :, None]
    diff = np.where(keep, diff, 0.0)
    if diff.size == 0:
        return 0.0, []
    flat = int(np.argmax(diff))
    return float(diff.reshape(-1)[flat]), [int(i) for i in np.unravel_index(flat, diff.shape)]


def failure_message(report: dict[str, Any]) -> tuple[str, str]:
    w = report["worst"]
    where = w["where"]
    if w["output"] == "logits" and where and len(where) == 3:
        at = f"batch {where[0]}, position {where[1]}, vocab id {where[2]}"
    else:
        at = f"index {where}"
    if report["rule"] == "noise":
        kind = _kind(w["output"])
        limit = f"bound {w['bound']:.3g} (= {_formula(report, kind)})"
    else:
        limit = f"atol {report['atol']:g}"
    msg = (f"ONNX differs from PyTorch: {w['output']} max |onnx - torch| = {w['max_abs_err']:.3g} > {limit} on "
           f"input '{w['name']}' at {at}")
    details = "\n".join(f"  {c['name']}: max abs err {c['max_abs_err']:.3g} ({c['output']}, bound {c['bound']:.3g})"
                        for c in report["cases"])
    return msg, details


def _formula(report: dict[str, Any], kind: str) -> str:
    """The noise rule's terms for one output kind, with their values."""
    c = report["constants"]
    terms = [f"{c['K']:g} x noise {report['noise'][kind]:.2g} (vs float64)"]
    if report.get("bf16_constants", {}).get(kind):
        terms.append(f"bf16 constants {report['bf16_constants'][kind]:.2g}")
    terms.append(f"{c['floor']:g} x max |{kind}| {report['max_abs_ref'][kind]:.3g}")
    return " + ".join(terms)


def summary_line(report: dict[str, Any]) -> str:
    """One line for the export's printed summary: observed error, bound, margin, and where the bound comes from."""
    w = report["worst"]
    m = report["margin"]
    margin = "exact" if m is None else f"margin {m:.3g}x"
    if report["rule"] == "noise":
        kind = _kind(w["output"])
        src = _formula(report, kind)
    else:
        src = "--atol"
    return (f"max |onnx - torch| {w['max_abs_err']:.2g} ({w['output']}) <= bound {w['bound']:.2g} ({src}; "
            f"{margin})")
