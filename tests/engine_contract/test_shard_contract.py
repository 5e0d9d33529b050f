"""Engine contract of `dsconv shard --engine mindie` on DeepSeek-V3: every world rank reads its five folders the way
MindIE's sharded loader does (tests/engine_contract/mindie_sharded.py) and finds every tensor it asks for; the issue's
acceptance run (`quantize --bits 8`, then `shard --ep 8 --tp 4`) included."""
from __future__ import annotations

import pytest

from tests.engine_contract import mindie_sharded

pytestmark = pytest.mark.cli


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    from dsconv.demo import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("ds") / "model")


@pytest.mark.parametrize("source,ep,tp", [("bits8", 8, 4), ("bits8", 4, 2), ("float", 1, 4), ("w8a16", 2, 2)])
def test_sharded_layout_loads_per_rank(source, ep, tp, demo_model, run_cli, tmp_path):
    model = demo_model
    if source != "float":
        q = tmp_path / "q"
        args = ["--bits", "8"] if source == "bits8" else ["--scheme", source]
        r = run_cli(["quantize", "-m", model, *args, "--calib-samples", "4", "--seq-len", "32", "-o", q])
        assert r.code == 0, r.err
        model = q
    out = tmp_path / "sh"
    r = run_cli(["shard", "-m", model, "--ep", ep, "--tp", tp, "-o", out])
    assert r.code == 0, r.err
    assert "MindIE's offline-sharded layout" in r.out
    problems = mindie_sharded.read(out)
    assert problems == [], "\n".join(problems[:20])
    r = run_cli(["verify", out])
    assert r.code == 0, r.out + r.err
