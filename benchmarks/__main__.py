"""`python -m benchmarks [NAME ...]`: run every benchmarks/bench_*.py (or the named ones) and print their figures.

`fidelity` runs only when named (`make bench-fidelity`): it needs the real-model fixtures and hours of CPU;
`engine_check` too: it needs MindIE-LLM's sources (MINDIE_LLM_SRC); `calib_cost`, `calib_noise`, `kv_positions`,
`w8a16_scales` and `eval_cost` as well: they need the fixtures and minutes to hours."""
from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path


ONLY_WHEN_NAMED = ("fidelity", "engine_check", "calib_cost", "calib_noise", "kv_positions", "w8a16_scales",
                   "eval_cost")


def main(argv: list[str]) -> int:
    here = Path(__file__).parent
    names = sorted(p.stem[len("bench_"):] for p in here.glob("bench_*.py"))
    chosen = [n for n in names if n in argv or (not argv and n not in ONLY_WHEN_NAMED)]
    unknown = [a for a in argv if a not in names]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; available: {names}", file=sys.stderr)
        return 2
    for name in chosen:
        print(f"\n=== benchmark {name}", flush=True)
        t = time.perf_counter()
        sys.argv = [f"bench_{name}"]  # each benchmark's own options are for direct runs, not our NAME list
        importlib.import_module(f"benchmarks.bench_{name}").main()
        print(f"=== {name} done in {time.perf_counter() - t:.1f}s", flush=True)
    return 0


sys.exit(main(sys.argv[1:]))
