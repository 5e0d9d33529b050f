"""The worker-memory sampler of the benchmarks (benchmarks/common.run_tree_sampled) sees a pool worker's memory,
which the driver's own peak RSS does not include."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import multiprocessing as mp, time

def hold(n):
    block = bytearray(n)
    block[::4096] = b"x" * len(block[::4096])  # touch every page
    time.sleep(0.6)
    return len(block)

if __name__ == "__main__":
    ctx = mp.get_context("forkserver")
    with ctx.Pool(1) as pool:
        print(pool.apply(hold, (300 * 2**20,)))
"""


def test_tree_sampler_sees_the_worker_not_only_the_driver(tmp_path):
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.common import run_tree_sampled
    finally:
        sys.path.remove(str(ROOT))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    r = run_tree_sampled([sys.executable, str(script)], every=0.02)
    assert r["stdout"].strip() == str(300 * 2**20)
    assert r["workers_seen"] == 1
    assert r["largest_worker_peak_rss_bytes"] >= 300 * 2**20
    assert r["driver_peak_rss_bytes"] < 200 * 2**20  # the driver never held the block
    assert r["tree_peak_pss_bytes"] >= 300 * 2**20
