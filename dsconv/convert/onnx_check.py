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

MoE: the experts each input routes to are recorded (hooks on the expert blocks); the check demands that not every
input hits the same set, adding inputs until they differ, so a graph with routing baked in cannot pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dsconv.convert.onnx_wrapper import IOSpec
from dsconv.errors import CheckFailed

#: default --atol per dtype, absolute, on logits (and cache outputs). fp32: 1e-4. fp16: onnxruntime and PyTorch
#: both compute in fp16 and round differently; 5e-2 is ~10x the largest error measured on the tiny models of every
#: family (it scales with fp16's 2^-11 rounding unit times the logit magnitude). bf16: onnxruntime has no bf16 CPU
#: kernels, so the graph runs widened to fp32 against PyTorch in fp32 on the same bf16 weights (the same function,
#: no rounding noise): 1e-3.
DEFAULT_ATOL = {"fp32": 1e-4, "fp16": 5e-2, "bf16": 1e-3}
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


def torch_reference(wrapper, spec: IOSpec, vocab: int, dtype, hits=None, experts_total: int = 0) -> Reference:
    """Run the wrapper in PyTorch on every check input (and routing probes until MoE routing differs)."""
    import torch

    steps = plan_steps(spec, vocab)
    ref = Reference([], [], [], experts_total)
    previous: list[torch.Tensor] = []

    def run(step: Step) -> None:
        nonlocal previous
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
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
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


def onnxruntime_compare(onnx_path: Path, spec: IOSpec, ref: Reference, atol: float, float_type) -> dict[str, Any]:
    """Run the written file on the reference inputs and compare; returns the check report (passed or not)."""
    import onnxruntime as ort

    ort.set_default_logger_severity(4)  # failures become CheckFailed below, not log lines
    try:
        return _compare_in_onnxruntime(ort, onnx_path, spec, ref, atol, float_type)
    finally:
        ort.set_default_logger_severity(2)  # onnxruntime's default


def _compare_in_onnxruntime(ort, onnx_path: Path, spec: IOSpec, ref: Reference, atol: float,
                            float_type) -> dict[str, Any]:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.disable_prepacking", "1")  # no packed second copy of every weight
    # a fake-quant model is checked with the ONNX semantics of QuantizeLinear/DequantizeLinear (float math), not with
    # onnxruntime's int8 QDQ fusion, whose kernels differ from them (0.49 on the tiny DeepSeek's logits)
    opts.add_session_config_entry("session.disable_quant_qdq", "1")
    try:
        session = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types
        raise CheckFailed(f"onnxruntime cannot load the exported graph: {_first_line(e)}",
                          hint="nothing was written; report the model type") from None
    run_opts = ort.RunOptions()
    run_opts.log_severity_level = 4
    cases = []
    previous: list[np.ndarray] = []
    for step, want in zip(ref.steps, ref.outputs):
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
            raise CheckFailed(f"onnxruntime cannot run the exported graph on input '{step.name}': {_first_line(e)}",
                              hint="nothing was written; the graph depends on the tracing input") from None
        previous = got[1:]
        real = step.attention_mask[:, step.past:] == 1
        real_cache = step.attention_mask == 1  # [batch, past + seq], the cache outputs' positions
        errors: dict[str, float] = {}
        worst_here: tuple[float, str, list[int]] = (-1.0, "logits", [])
        for name, g, w in zip(spec.output_names, got, want):
            err, where = _worst(g.astype(np.float32), w, real if name == "logits" else real_cache,
                                cache=name != "logits")
            errors[name] = err
            if err > worst_here[0]:
                worst_here = (err, name, where)
        case = {"name": step.name, "batch": step.batch, "tokens": step.seq, "past": step.past,
                "max_abs_err": worst_here[0], "output": worst_here[1], "where": worst_here[2],
                "logits_max_abs_err": errors["logits"]}
        if spec.with_past:
            case["cache_max_abs_err"] = max(v for k, v in errors.items() if k != "logits")
        cases.append(case)
    del session  # unmaps the weights before the caller touches the files again
    worst = max(cases, key=lambda c: c["max_abs_err"])
    report: dict[str, Any] = {"atol": atol, "passed": bool(worst["max_abs_err"] <= atol), "cases": cases,
                              "worst": {k: worst[k] for k in ("name", "output", "max_abs_err", "where")}}
    if ref.hits:
        distinct = len(set(ref.hits))
        report["moe"] = {"experts_hit_per_input": [len(h) for h in ref.hits], "distinct_sets": distinct,
                         "routing_differs": distinct > 1, "experts_hit_total": len(frozenset().union(*ref.hits)),
                         "experts_total": ref.experts_total}
    return report


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
    msg = (f"ONNX differs from PyTorch: {w['output']} max |onnx - torch| = {w['max_abs_err']:.3g} > atol "
           f"{report['atol']:g} on input '{w['name']}' at {at}")
    details = "\n".join(f"  {c['name']}: max abs err {c['max_abs_err']:.3g} ({c['output']})" for c in report["cases"])
    return msg, details
