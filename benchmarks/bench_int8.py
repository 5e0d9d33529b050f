"""The INT8 path to OM, per family: quantize W8A8 (the --bits 8 recipe), export the fake-quant and AMCT
deploy ONNX from it, then `dsconv atc --soc Ascend310P3` on the deploy model.

    python -m benchmarks int8 [--model DIR --quantized DIR]   # plus a real model's quantize output, if given

Figures per family: the export's own parity check (fake-quant ONNX in onnxruntime vs dsconv's simulation of the
quantized model; worst max |error| on the logits, against its tolerance: max(--atol, 3x the simulation's own
change under a 1e-6 nudge of the embeddings)), AscendQuant nodes vs static W8A8 linears,
deploy int8 bytes, preflight verdicts (pass / warn / fail) and the number of static .om gears, and the seconds each
step took. Tiny models from configs (random weights): the parity figure is what the benchmark is for; accuracy of
a real model comes from `--model/--quantized` (e.g. the Qwen fixture's `dsconv quantize --bits 8` output).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.common import save, scratch

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "deepseek_v3")


def _cli(*args: Any) -> tuple[dict[str, Any], float]:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "dsconv", *map(str, args), "--json"], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"dsconv {args[0]} failed ({p.returncode}): {p.stderr.strip()[-500:]}")
    return json.loads(p.stdout), time.perf_counter() - t


def measure(model: Path, quantized: Path, work: Path) -> dict[str, Any]:
    """Export the quantize output to fake-quant + deploy ONNX, then the 310P3 ATC profile of the deploy model."""
    import onnx

    e, t_export = _cli("export", "--model", model, "--quantized", quantized, "--output", work / "onnx")
    deploy = work / "onnx" / "model_deploy.onnx"
    ops = Counter(n.op_type for n in onnx.load(str(deploy), load_external_data=False).graph.node)
    a, t_atc = _cli("atc", "--soc", "Ascend310P3", "--onnx", deploy, "--output", work / "atc")
    verdicts = Counter(f["status"] for f in a["preflight"])
    external = sum(f.stat().st_size for f in (work / "onnx").glob("*.external"))
    worst = e["check"]["worst"]
    return {"static_w8a8_linears": e["linears"].get("W8A8", 0), "ascend_quant": ops["AscendQuant"],
            "ascend_dequant": ops["AscendDequant"], "check_max_abs_err": worst["max_abs_err"],
            "check_atol": e["check"]["atol"], "noise_floor": e["check"].get("noise_floor"), "check_passed": e["check"]["passed"], "deploy_external_bytes": external,
            "preflight": dict(verdicts), "om_gears": len(a["gears_static"]), "export_s": round(t_export, 2),
            "atc_s": round(t_atc, 2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a real model directory (with --quantized: its quantize output)")
    ap.add_argument("--quantized", type=Path)
    a = ap.parse_args(argv if argv is not None else [])
    from dsconv.bundled import calib_texts
    from dsconv.quant import stage
    from dsconv.quant.plan.options import QuantOptions
    from dsconv.quant.stage import QuantRequest
    from dsconv.tiny import make_tiny, train_tokenizer

    root = scratch("dsconv-int8-")
    rows: dict[str, Any] = {}
    try:
        tok = train_tokenizer(calib_texts(), vocab_size=384)
        for fam in FAMILIES:
            model = make_tiny(fam, root / fam, dtype="bf16", tokenizer=tok)
            t = time.perf_counter()
            stage.run(QuantRequest(model, root / f"{fam}-q", QuantOptions(calib_samples=8, seq_len=32,
                                                                          bits_default=True), progress=False))
            rows[fam] = {"quantize_s": round(time.perf_counter() - t, 2),
                         **measure(model, root / f"{fam}-q", root / f"{fam}-out")}
            print(f"{fam:>12}: {json.dumps(rows[fam])}", flush=True)
        if a.model and a.quantized:
            rows[str(a.model)] = measure(a.model, a.quantized, root / "real-out")
            print(f"{a.model}: {json.dumps(rows[str(a.model)])}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    save("int8", {"rows": rows}, quiet=True)
    print(f"{'model':>14}  {'W8A8':>5}  {'AscendQuant':>11}  {'parity max err / atol':>22}  {'preflight':>22}  gears")
    for name, r in rows.items():
        pf = ", ".join(f"{k} {v}" for k, v in sorted(r["preflight"].items()))
        print(f"{Path(name).name[-14:]:>14}  {r['static_w8a8_linears']:>5}  {r['ascend_quant']:>11}  "
              f"{r['check_max_abs_err']:>10.2e} / {r['check_atol']:<9.0e}  {pf:>22}  {r['om_gears']}")


if __name__ == "__main__":
    main(sys.argv[1:])
