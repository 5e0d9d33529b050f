"""`dsconv shard --engine mindie` on DeepSeek-V3 as a user runs it, the issue's acceptance run (`quantize --bits 8`,
then `shard --ep 8 --tp 4`) included: MindIE's offline-sharded layout is written and `dsconv verify` re-reads every
source tensor bit for bit from the rank folders. That MindIE's own sharded loader takes the folders, rank by rank,
is `make engine-check`'s (tests/engine_check/matrix.py: the sharded cases)."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.cli
# MindIE builds DeepSeek's shared experts only in float or an activation-quantized type: W8A16 keeps them float
QUANT = {"bits8": ["--bits", "8"], "w8a16": ["--scheme", "w8a16", "--ignore", "shared_experts"]}


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    from dsconv.demo import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("ds") / "model")


@pytest.mark.parametrize("source,ep,tp", [("bits8", 8, 4), ("bits8", 4, 2), ("float", 1, 4), ("w8a16", 2, 2)])
def test_sharded_layout_is_written_and_verifies(source, ep, tp, demo_model, run_cli, tmp_path):
    model = demo_model
    if source != "float":
        q = tmp_path / "q"
        r = run_cli(["quantize", "-m", model, *QUANT[source], "--calib-samples", "4", "--seq-len", "32", "-o", q])
        assert r.code == 0, r.err
        model = q
    out = tmp_path / "sh"
    r = run_cli(["shard", "-m", model, "--ep", ep, "--tp", tp, "-o", out])
    assert r.code == 0, r.err
    assert "MindIE's offline-sharded layout" in r.out
    meta = json.loads((out / "model_sharded_metadata.json").read_text())
    assert meta["world_size"] == ep * tp and meta["parallel_option"]["tp"] == tp
    for folder in meta["model_sharded"]:
        assert (out / folder).is_dir(), folder
    r = run_cli(["verify", out])
    assert r.code == 0, r.out + r.err
