"""Group scales by clip-ratio search (dsconv.quant.algorithms.grid) and GPTQ's static groups / act order / searched
scales: the written format stays plain per-group, the search never increases a group's error, act order with static
groups lowers the Hessian-weighted error on a layer whose input channels differ in magnitude."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsconv.quant.algorithms.gptq import HessianAccumulator, gptq_quantize
from dsconv.quant.algorithms.grid import quantize_searched, search_scales
from dsconv.quant.algorithms.schemes import dequant_weight, quantize_weight_per_group

pytestmark = pytest.mark.unit


def _group_sq_err(w: torch.Tensor, q: np.ndarray, scale: np.ndarray, g: int,
                  imp: torch.Tensor | None = None) -> torch.Tensor:
    d = (torch.from_numpy(dequant_weight(q, scale)) - w).square()
    if imp is not None:
        d = d * imp
    return d.reshape(w.shape[0], -1, g).sum(dim=2)


@pytest.mark.parametrize("g", [32, 64, 0])
def test_search_never_increases_a_groups_error_and_helps_on_average(g):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=gen) * 0.02
    w[:, 7] *= 8  # a few heavy weights: where clipping pays
    imp = torch.rand(256, generator=gen) * 10
    for importance in (None, imp):
        q, s = quantize_searched(w, g, -8, 7, importance)
        q_r, s_r, _ = quantize_weight_per_group(w.numpy(), g, 4)
        assert q.dtype == torch.int8 and s.shape == s_r.shape and int(q.min()) >= -8 and int(q.max()) <= 7
        gs = g or 256
        e_s = _group_sq_err(w, q.numpy(), s.numpy(), gs, importance)
        e_r = _group_sq_err(w, q_r, s_r, gs, importance)
        assert bool((e_s <= e_r * (1 + 1e-6)).all())  # never worse, group by group
        assert float(e_s.sum()) < 0.9 * float(e_r.sum())  # and clearly better in total


def test_search_with_only_ratio_one_is_plain_rtn_and_zero_groups_get_scale_one():
    w = torch.randn(8, 64) * 0.1
    w[0, :32] = 0.0
    s = search_scales(w.reshape(8, 2, 32), -8, 7, ratios=(1.0,))
    q_r, s_r, _ = quantize_weight_per_group(w.numpy(), 32, 4)
    assert torch.equal(s, torch.from_numpy(s_r))
    assert float(search_scales(w.reshape(8, 2, 32), -8, 7)[0, 0]) == 1.0


def _channel_scaled_inputs(tokens: int, k: int, seed: int) -> torch.Tensor:
    """Correlated inputs whose channels differ in magnitude by orders (what act order exploits)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)
    return (torch.randn(tokens, k, generator=g) @ mix) * torch.exp(1.5 * torch.randn(k, generator=g))


def test_act_order_with_static_groups_keeps_the_format_and_lowers_hessian_weighted_error():
    k, n, g = 256, 64, 32
    x = _channel_scaled_inputs(4096, k, 1)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2)) * 0.05
    acc = HessianAccumulator(k)
    acc.update(x)
    H = acc.hessian()

    def herr(q: np.ndarray, s: np.ndarray) -> float:
        d = torch.from_numpy(dequant_weight(q, s)) - w
        return float(torch.einsum("ij,jk,ik->", d.double(), torch.from_numpy(H).double(), d.double()))

    plain = gptq_quantize(w, H, bits=4, group_size=g)
    static = gptq_quantize(w, H, bits=4, group_size=g, static_groups=True)
    ordered = gptq_quantize(w, H, bits=4, group_size=g, act_order=True)
    ordered_s = gptq_quantize(w, H, bits=4, group_size=g, act_order=True, search=True)
    q_rtn, s_rtn, _ = quantize_weight_per_group(w.numpy(), g, 4)
    for q, s, off in (plain, static, ordered, ordered_s):
        # the same packed format: int4 values, one scale per contiguous group of 32 columns, zero offsets
        assert q.dtype == np.int8 and q.shape == (n, k) and q.min() >= -8 and q.max() <= 7
        assert s.shape == (n, k // g) and s.dtype == np.float32 and not off.any()
    # static groups: the scales are round-to-nearest's, fixed before any column moves
    np.testing.assert_array_equal(static[1], s_rtn)
    np.testing.assert_array_equal(ordered[1], s_rtn)
    e_rtn, e_plain, e_ord = herr(q_rtn, s_rtn), herr(*plain[:2]), herr(*ordered[:2])
    assert e_ord < 0.9 * e_plain < 0.9 * e_rtn, (e_rtn, e_plain, e_ord)
    assert herr(*ordered_s[:2]) < e_ord
