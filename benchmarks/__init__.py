"""Benchmarks: plain scripts that measure throughput and peak memory and write bench-results/<name>.json.

Run all with `make bench` (= `python -m benchmarks`), or one with `python -m benchmarks foundation`.
They are never part of the test suite: figures vary by machine and are reported, not asserted.
"""
