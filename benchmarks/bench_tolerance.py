"""The export checks' noise-derived tolerance (convert/tolerance.py): the measurements that chose NOISE_K.

    python -m benchmarks tolerance [--formats onnx,mindir] [--seeds 3]

Correct exports: every family's tiny model (ONNX fp32, fp32 with the KV cache, fp16, bf16; MindIR fp32, fp16, bf16)
and the deep narrow bf16 Llama of dsconv.tiny.make_deep (30 layers, tied, logits ~35) for a few seeds. Per export:
the reference's noise (max |reference - float64 reference|), the observed max |export - reference|, their ratio
(what NOISE_K must exceed), the bound and the margin (bound / observed). The ratio does not depend on NOISE_K.

Faults (ONNX, re-checked with `recheck` on a changed copy of the exported graph, or against a changed reference):
a transposed square weight, dropped q/k/v biases (Qwen2), a 1% scale on one layer's MLP weight, a rope base 10% off;
per fault the error over the noise and over the bound (how far past it a wrong export lands).
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from benchmarks.common import save, scratch


def _row(label: str, noise: float, observed: float, bound: float, passed: bool, **extra: Any) -> dict[str, Any]:
    return {"case": label, "noise": noise, "observed": observed, "ratio": observed / noise if noise else None,
            "bound": bound, "margin": bound / observed if observed else None, "passed": passed, **extra}


def onnx_correct(work: Path, seeds: int) -> list[dict[str, Any]]:
    from dsconv.convert.onnx import export_onnx
    from dsconv.tiny import FAMILIES, make_deep, make_tiny

    rows = []
    models = [(f, make_tiny(f, work / f)) for f in FAMILIES]
    models += [(f"deep seed {s}", make_deep(work / f"deep{s}", seed=s)) for s in range(seeds)]
    for label, model in models:
        variants = [("fp32", {}), ("fp32 +cache", {"with_past": True})]
        if not label.startswith("deep seed"):
            variants += [("fp16", {"dtype": "fp16"}), ("bf16", {"dtype": "bf16"})]
        for name, kwargs in variants:
            out = work / f"onnx-{label}-{name}".replace(" ", "_")
            c = export_onnx(model, out, **kwargs)["check"]
            for kind in c["noise"]:
                extra = {"bf16_constants": c["bf16_constants"][kind]} if "bf16_constants" in c else {}
                rows.append(_row(f"{label} {name} {kind}", c["noise"][kind], c["max_abs_err"][kind], c["bound"][kind],
                                 c["passed"], format="onnx", max_abs_ref=c["max_abs_ref"][kind], **extra))
            shutil.rmtree(out)
    return rows


def onnx_faults(work: Path) -> list[dict[str, Any]]:
    import numpy as np

    from dsconv.convert.onnx import export_onnx, recheck
    from dsconv.tiny import make_deep, make_tiny

    from tests.test_export_tolerance import faulted as changed  # the tests' fault injector, one initializer changed

    rows = []
    for label, model, mid, last in (("qwen2", make_tiny("qwen2", work / "f-qwen2"), 1, 1),
                                    ("deep", make_deep(work / "f-deep"), 15, 29)):
        out = work / f"f-{label}-onnx"
        export_onnx(model, out)
        L = "model.layers"
        faults = {f"transposed o_proj (layer {last})": (f"{L}.{last}.self_attn.o_proj.weight.T", lambda a: a.T),
                  "1% down_proj (layer 0)": (f"{L}.0.mlp.down_proj.weight.T", lambda a: a * 1.01),
                  f"1% down_proj (layer {mid})": (f"{L}.{mid}.mlp.down_proj.weight.T", lambda a: a * 1.01)}
        if label == "qwen2":
            for b in "qkv":
                faults[f"dropped {b} bias (layer 0)"] = (f"{L}.0.self_attn.{b}_proj.bias", np.zeros_like)
        for fault, (name, change) in faults.items():
            r = recheck(model, changed(out / "model.onnx", work / "fault.onnx", name, change))
            rows.append(_fault_row(label, fault, r))
        wrong = shutil.copytree(model, work / f"f-{label}-rope")
        config = json.loads((wrong / "config.json").read_text())
        config["rope_parameters"]["rope_theta"] *= 1.1
        (wrong / "config.json").write_text(json.dumps(config))
        rows.append(_fault_row(label, "rope base x1.1 (reference)", recheck(wrong, out / "model.onnx")))
    return rows


def _fault_row(model: str, fault: str, r: dict[str, Any]) -> dict[str, Any]:
    err, bound, noise = r["max_abs_err"]["logits"], r["bound"]["logits"], r["noise"]["logits"]
    return {"model": model, "fault": fault, "observed": err, "noise": noise, "over_noise": err / noise,
            "over_bound": err / bound, "failed": not r["passed"]}


def mindir_correct(work: Path, seeds: int) -> list[dict[str, Any]]:
    import os

    from dsconv.convert.mindir import export_mindir
    from dsconv.tiny import FAMILIES, make_deep, make_tiny

    rows = []
    models = [(f, make_tiny(f, work / f"ms-{f}")) for f in FAMILIES]
    models += [(f"deep seed {s}", make_deep(work / f"ms-deep{s}", seed=s)) for s in range(seeds)]
    old = Path.cwd()
    os.chdir(work)  # MindSpore's debris stays in the scratch directory
    try:
        for label, model in models:
            for dtype in ("fp32",) if label.startswith("deep seed") else ("fp32", "fp16", "bf16"):
                out = work / f"mindir-{label}-{dtype}".replace(" ", "_")
                c = export_mindir(model, out, dtype=dtype)["check"]
                rows.append(_row(f"{label} {dtype}", c["noise"], c["max_abs_err"], c["bound"], c["passed"],
                                 format="mindir", max_abs_ref=c["max_abs_ref"]))
                shutil.rmtree(out)
    finally:
        os.chdir(old)
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'export':<34} {'noise':>9} {'observed':>9} {'ratio':>6} {'bound':>9} {'margin':>7}  passed"]
    for r in rows:
        lines.append(f"{r['format'] + ' ' + r['case']:<34} {r['noise']:>9.3g} {r['observed']:>9.3g} "
                     f"{r['ratio'] or 0:>6.2f} {r['bound']:>9.3g} {r['margin'] or 0:>7.1f}  {r['passed']}")
    return "\n".join(lines)


def main() -> None:
    import torch

    from dsconv.convert import tolerance

    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="onnx,mindir")
    ap.add_argument("--seeds", type=int, default=3, help="deep models (seeds 0..N-1)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # tiny models: threads cost more than they give (and change nothing measured)
    work = scratch("dsconv-tolerance-")
    figures: dict[str, Any] = {"K": tolerance.NOISE_K, "floor": tolerance.NOISE_FLOOR}
    try:
        rows: list[dict[str, Any]] = []
        if "onnx" in args.formats:
            rows += onnx_correct(work, args.seeds)
            figures["faults"] = onnx_faults(work)
        if "mindir" in args.formats:
            import importlib.util

            if importlib.util.find_spec("mindspore") is not None:
                rows += mindir_correct(work, args.seeds)
        figures["correct"] = rows
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save("tolerance", figures, quiet=True)
    print(_table(figures["correct"]))
    # the ratio NOISE_K must cover (a bf16 graph with rounded constants has its own additive term)
    worst = max((r for r in rows if r["ratio"] is not None and not r.get("bf16_constants")), key=lambda r: r["ratio"])
    print(f"\nworst ratio observed / noise of a correct export: {worst['ratio']:.2f} ({worst['format']} "
          f"{worst['case']}); NOISE_K = {tolerance.NOISE_K:g}")
    print(f"\n{'fault':<44} {'observed':>9} {'/ noise':>9} {'/ bound':>9}  failed")
    for f in figures.get("faults", []):
        print(f"{f['model'] + ': ' + f['fault']:<44} {f['observed']:>9.3g} {f['over_noise']:>9.3g} "
              f"{f['over_bound']:>9.3g}  {f['failed']}")


if __name__ == "__main__":
    main()
