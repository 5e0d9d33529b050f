"""The calibrated path's algorithms are plug-ins (quant/calibrate/algorithm.py, registry.py): the layer's steps and
the forward jobs name none of them, and a new one is one class and a line in the registry - its observer installed
the same way in the driver and in forward jobs on other processes."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import dsconv.executor as dexec
from dsconv.quant.calibrate import registry
from dsconv.quant.calibrate.algorithm import Algorithm, JobEnv, LayerState, Observer
from dsconv.quant.calibrate.forward_jobs import SPLIT_ENV

pytestmark = pytest.mark.cli
CALIBRATE = Path(__file__).resolve().parents[1] / "dsconv" / "quant" / "calibrate"
#: the modules that hold one algorithm each
ALGORITHM_MODULES = {"smooth_layer", "kv_cache", "awq", "clip_search", "gptq_layer"}
SEEN: dict[int, int] = {}  # layer -> real tokens the test observer counted (the driver's process)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module.rsplit(".", 1)[-1])
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.rsplit(".", 1)[-1] for a in node.names)
    return out


@pytest.mark.parametrize("module", ["steps.py", "forward_jobs.py", "calibration.py"])
def test_the_driver_names_no_algorithm(module):
    """The steps, the forward jobs and the calibrator import no algorithm's module (only the registry may)."""
    assert not (_imports(CALIBRATE / module) & ALGORITHM_MODULES), module


def test_every_algorithm_is_registered_once():
    names = [a.name for a in registry.ALGORITHMS]
    assert len(set(names)) == len(names) and {"smoothquant", "kv_cache", "awq", "clip_search", "gptq"} == set(names)


class TokenCount(Observer):
    """Real tokens seen at q_proj's input, by a pre-hook."""

    def __init__(self, module: nn.Module, rows) -> None:
        self.tokens = 0
        self.handle = module.register_forward_pre_hook(lambda m, a: self._add(a[0], rows))
        self.module = module

    def _add(self, x: torch.Tensor, rows) -> None:
        self.tokens += int(rows.apply(x, "count").shape[0])

    def spec(self, names):
        return names[self.module]

    @classmethod
    def install(cls, spec, env: JobEnv) -> "TokenCount":
        return cls(env.modules[spec], env.rows)

    def remove(self) -> None:
        self.handle.remove()

    def partial(self, names):
        return self.tokens

    def merge(self, part, offset, by_name) -> None:
        self.tokens += part


class CountTokens(Algorithm):
    """A new algorithm: observes, changes nothing."""

    name = "count_tokens"

    @classmethod
    def active(cls, run) -> bool:
        return True

    def observers(self, st: LayerState) -> list[Observer]:
        q = next(m for n, m in st.layer.named_modules() if n.endswith("q_proj"))
        self.obs = TokenCount(q, self.cal.acts.rows)
        return [self.obs]

    def after(self, st: LayerState) -> None:
        SEEN[st.i] = self.obs.tokens


@pytest.fixture()
def llama(tmp_path):
    from dsconv.bundled import calib_texts
    from dsconv.tiny import make_tiny, train_tokenizer

    return make_tiny("llama", tmp_path / "llama", dtype="bf16", tokenizer=train_tokenizer(calib_texts(),
                                                                                         vocab_size=384))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_new_algorithm_is_one_class_and_a_registration(llama, run_cli, tmp_path, monkeypatch, workers):
    """CountTokens registered: every layer's observer saw every real calibration token, in the driver (1 worker) and
    through forward jobs on two processes (its class found there by its key); the output bytes are the ones
    without it."""
    args = ["--bits", "8", "--calib-samples", "8", "--seq-len", "48", "--json"]
    base = run_cli(["quantize", "-m", llama, "-o", tmp_path / "base", *args])
    assert base.code == 0, base.err
    monkeypatch.setattr(registry, "ALGORITHMS", (*registry.ALGORITHMS, CountTokens))
    if workers > 1:
        monkeypatch.setattr(dexec, "INLINE_BELOW", 0)
        monkeypatch.setenv(SPLIT_ENV, "1")
    SEEN.clear()
    r = run_cli(["quantize", "-m", llama, "-o", tmp_path / "with", *args, "--workers", str(workers)])
    assert r.code == 0, r.err
    fwd = json.loads(r.out)["forward"]
    assert fwd["split"] == (workers > 1), fwd
    report = json.loads((tmp_path / "with" / "quant_report.json").read_text())
    tokens = report["calibration"]["tokens"]
    assert SEEN == {0: tokens, 1: tokens}
    for f in ("quant_model_weights.safetensors", "quant_model_description.json"):
        assert (tmp_path / "with" / f).read_bytes() == (tmp_path / "base" / f).read_bytes(), f
