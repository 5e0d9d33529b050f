"""GPTQ's damping is what keeps it from fitting the calibration domain at the expense of others (docs/accuracy.md:
Chinese QA calibration, English Python docs evaluation; GPTQ with damping 0.01 beats rounding on every held-out
calibration prompt yet loses to it end to end). A calibration set that barely excites half of the input channels
reproduces it: the small damping wins on calibration-like inputs and loses badly on inputs that use every channel;
the default damping keeps most of the calibration gain and beats rounding on both."""
from __future__ import annotations

import numpy as np
import pytest

from dsconv.quant.algorithms.gptq import HessianAccumulator, gptq_quantize
from dsconv.quant.algorithms.schemes import dequant_weight, quantize_weight_per_group
from dsconv.quant.plan.options import QuantOptions

pytestmark = pytest.mark.unit


def _domains(seed: int, k: int = 256, tokens: int = 4000) -> tuple[np.ndarray, np.ndarray]:
    """(calibration inputs, evaluation inputs): the same correlated source, but calibration scales half of the
    channels down to 3% (another language exercises other directions of the residual stream)."""
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((k, k)).astype(np.float32) / np.sqrt(k)

    def draw() -> np.ndarray:
        return (rng.standard_normal((tokens, k)).astype(np.float32) @ mix
                + 0.3 * rng.standard_normal((tokens, k)).astype(np.float32))

    quiet = np.where(np.arange(k) < k // 2, 1.0, 0.03).astype(np.float32)
    return draw() * quiet, draw()


def _err(x: np.ndarray, w: np.ndarray, q: np.ndarray, s: np.ndarray) -> float:
    return float(np.linalg.norm(x @ (dequant_weight(q, s) - w).T) / np.linalg.norm(x @ w.T))


@pytest.mark.parametrize("seed", [0, 1])
def test_default_damping_survives_a_domain_shift_that_small_damping_does_not(seed):
    x_cal, x_ev = _domains(seed)
    w = np.random.default_rng(100 + seed).standard_normal((128, 256)).astype(np.float32)
    acc = HessianAccumulator(256)
    acc.update(x_cal)
    H = acc.hessian()
    q_r, s_r, _ = quantize_weight_per_group(w, 64, 4)
    rtn = (_err(x_cal, w, q_r, s_r), _err(x_ev, w, q_r, s_r))
    got = {}
    for damp in (0.01, QuantOptions().damp):
        q, s, _ = gptq_quantize(w, H, bits=4, group_size=64, damp=damp, act_order=True)
        got[damp] = (_err(x_cal, w, q, s), _err(x_ev, w, q, s))
    small, default = got[0.01], got[QuantOptions().damp]
    # measured (seed 0): rtn 0.109 / 0.108, damp 0.01 0.091 / 0.231, damp 0.1 0.095 / 0.097
    assert small[0] < 0.9 * rtn[0] and small[1] > 1.5 * rtn[1]   # the issue-10 symptom
    assert default[0] < 0.95 * rtn[0] and default[1] < 0.95 * rtn[1]  # the default wins on both domains


def test_default_damping_is_the_measured_one():
    assert QuantOptions().damp == pytest.approx(0.1)


def test_damping_is_reported_and_printed():
    from dsconv.quant.plan.report import decisions_lines, decisions_summary

    d = decisions_summary({"gptq": {"damp": 0.1, "act_order": True, "static_groups": True},
                           "gptq_or_rtn": {"a": "gptq", "b": "rtn", "c": "gptq"}})
    assert d["gptq_damp"] == 0.1 and d["gptq_or_rtn"] == {"gptq": 2, "rtn": 1}
    lines = decisions_lines(d)
    assert any("damping 0.1 x mean(diag H)" in line for line in lines)
    assert decisions_summary({"gptq": None}).get("gptq_damp") is None
