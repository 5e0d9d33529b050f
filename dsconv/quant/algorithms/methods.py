"""The weight rounding methods of `dsconv quantize --method` and the default per weight width (no imports: the CLI
reads these at start-up).

Measured end to end on two real models (benchmarks/bench_fidelity.py, docs/accuracy.md): see DEFAULT_METHOD.
"""
from __future__ import annotations

METHODS = ("rtn", "mse", "gptq", "awq")
DEFAULT_METHOD = {8: "rtn", 4: "rtn"}
