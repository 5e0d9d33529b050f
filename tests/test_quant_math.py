"""The arithmetic of dsconv.quant: hand-computed examples, layouts byte by byte, streaming vs one-shot, GPTQ vs RTN."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsconv.errors import UserError
from dsconv.quant.algorithms.gptq import HessianAccumulator, _inverse_cholesky, gptq_quantize
from dsconv.quant.algorithms.error_metrics import weight_error
from dsconv.quant.algorithms.observers import (ACT_METHODS, DEFAULT_ACT_METHOD, HistogramObserver, MinMaxObserver,
                                               make_observer)
from dsconv.quant.algorithms.schemes import (
    activation_qparams,
    deq_scale_as_int64,
    deq_scale_from_int64,
    dequant_weight,
    fake_quant_activation,
    pack_int4,
    pack_int4_along_k,
    quantize_activation,
    quantize_weight_per_channel,
    quantize_weight_per_group,
    smooth_scales,
    unpack_int4,
    unpack_int4_along_k,
    unpack_int4_by_shape,
    valid_group_sizes,
    w8a8_static_params,
)

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------------------------------ weight scales
def test_per_channel_int8_by_hand():
    w = np.array(
        [
            [0.5, -1.27, 0.0],  # absmax 1.27 -> exact 0.01, off the grid: bf16's 0.010009765625 above it -> 50, -127
            [63.5, 1.0, -0.5],  # absmax 63.5 -> 0.5, on the grid and exact for every weight -> 127, 2, -1
            [0.0, 0.0, 0.0],  # zero row -> scale 1.0, no NaN
        ],
        np.float32,
    )
    q, scale = quantize_weight_per_channel(w, bits=8)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (3, 1)
    np.testing.assert_array_equal(scale[:, 0], np.array([0.010009765625, 0.5, 1.0], np.float32))
    np.testing.assert_array_equal(q, [[50, -127, 0], [127, 2, -1], [0, 0, 0]])


def test_per_channel_int4_by_hand():
    w = np.array([[7.0, -3.0, 2.0, 0.0]], np.float32)  # absmax 7 -> scale 1, every weight on it: 7, -3, 2, 0
    q, scale = quantize_weight_per_channel(w, bits=4)
    np.testing.assert_array_equal(scale, [[1.0]])
    np.testing.assert_array_equal(q, [[7, -3, 2, 0]])


def test_per_group_by_hand():
    w = np.array(
        [
            [1, 2, 3, 7, 0.5, 0, 0, -3.5],  # groups: absmax 7 -> scale 1; absmax 3.5 -> scale 0.5
            [0, 0, 0, 0, 14, -6, 4, 2],  # groups: zero -> scale 1; absmax 14 -> scale 2
        ],
        np.float32,
    )
    q, scale, offset = quantize_weight_per_group(w, group_size=4, bits=4)
    np.testing.assert_array_equal(scale, [[1.0, 0.5], [1.0, 2.0]])
    np.testing.assert_array_equal(offset, np.zeros((2, 2), np.float32))
    np.testing.assert_array_equal(q, [[1, 2, 3, 7, 1, 0, 0, -7], [0, 0, 0, 0, 7, -3, 2, 1]])
    # group 0 means per channel, same result as quantize_weight_per_channel
    q0, s0, o0 = quantize_weight_per_group(w, group_size=0, bits=4)
    assert s0.shape == (2, 1) and o0.shape == (2, 1) and s0[1, 0] == 2.0
    q1, s1 = quantize_weight_per_channel(w, bits=4)
    np.testing.assert_array_equal(q0, q1)
    np.testing.assert_array_equal(s0, s1)


def _sq_err(w: np.ndarray, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Squared error per row of what an engine computes: the integers times the scale it holds (float32 products of
    bf16-exact scales, as the engines' bf16/fp16 parameters hold them)."""
    held = torch.from_numpy(np.ascontiguousarray(scale)).to(torch.bfloat16).float().numpy()
    return ((dequant_weight(q, held) - w).astype(np.float64) ** 2).sum(axis=1)


def test_grid_scales_beat_exact_float32_scales_where_rounding_up_loses():
    """What an engine computes from the written int8 weights and scales (the scale cast to the model dtype) is at
    least as close as plain round-to-nearest with exact float32 scales absmax / 127; rounding every scale up onto
    bf16's grid (the former rule) was not, on rows whose absmax / 127 sits just above a grid value."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 512, generator=gen) * 0.02).bfloat16()
    amax = w.float().abs().amax(dim=1)
    # put each row's largest weight where absmax / 127 is just above a bf16 value: rounding up then costs ~0.7%
    target = (amax / 127).bfloat16().float() * (1 + 2 ** -8) * 127
    col = w.float().abs().argmax(dim=1)
    w[torch.arange(256), col] = (target * torch.sign(w.float()[torch.arange(256), col])).bfloat16()
    wf = w.float().numpy()
    q, scale = quantize_weight_per_channel(w, bits=8)
    exact = wf.__abs__().max(axis=1, keepdims=True) / np.float32(127)
    q_exact = np.clip(np.rint(wf / exact), -128, 127).astype(np.int8)
    e_exact = ((dequant_weight(q_exact, exact) - wf).astype(np.float64) ** 2).sum(axis=1)
    e_new = _sq_err(wf, q, scale)
    assert e_new.sum() < e_exact.sum(), (e_new.sum() / e_exact.sum())
    t = torch.from_numpy(scale)
    assert torch.equal(t.to(torch.bfloat16).float(), t) and torch.equal(t.to(torch.float16).float(), t)
    assert np.all(np.abs(dequant_weight(q, scale) - wf) <= scale / 2 * (1 + 1e-6))  # still round-to-nearest


def test_each_scale_is_the_better_of_its_grid_neighbours():
    """Brute force: each scale is the grid value just above absmax / qmax, or the one just below where that keeps
    every weight within half a step and has the smaller squared error (ties: above); q = clamp(round(w / s))
    against it; per group and per channel, 8 and 4 bits, torch bf16 and numpy alike."""
    from dsconv.quant.algorithms.scale_grid import grid_ceil, grid_floor

    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 256, generator=gen) * torch.exp(torch.randn(64, 1, generator=gen))).bfloat16()
    wf = w.float().numpy()
    below_won = 0
    for bits, g in ((8, 0), (4, 0), (4, 32)):
        qmin, qmax = (-128, 127) if bits == 8 else (-8, 7)
        q, scale, _ = quantize_weight_per_group(w, g, bits)
        q2, scale2, _ = quantize_weight_per_group(wf, g, bits)
        np.testing.assert_array_equal(q, q2)
        np.testing.assert_array_equal(scale, scale2)
        w3 = wf.reshape(64, -1, g or 256)
        amax = np.abs(w3).max(axis=2)
        exact = amax / np.float32(qmax)
        hi, lo = grid_ceil(exact), grid_floor(exact)

        def rtn(c):
            r = np.clip(np.rint(w3 / c[..., None]), qmin, qmax)
            return r, ((r * c[..., None] - w3).astype(np.float64) ** 2).sum(axis=2)

        (r_hi, e_hi), (r_lo, e_lo) = rtn(hi), rtn(lo)
        allowed = (lo < hi) & (lo * np.float32(qmax + 0.5) >= amax)
        want = np.where(allowed & (e_lo < e_hi * (1 - 1e-6)), lo, hi)
        unsure = allowed & (np.abs(e_lo - e_hi) <= e_hi * 1e-6)  # float32 sums decide near-ties either way
        assert np.all((scale == want) | unsure), (bits, g)
        np.testing.assert_array_equal(q.reshape(w3.shape), np.where((scale == lo)[..., None], r_lo, r_hi))
        below_won += int((scale == lo).sum())
    assert below_won > 0  # the value below is chosen somewhere: the test covers both branches


def test_near_tie_rows_are_decided_in_float64():
    """The kernel sums the candidates' errors in float32 and re-sums a row in float64 where float32 cannot tell them
    apart. Row 492 of this seed's weight is such a row: a float32-only decision picked the other candidate here
    (found by search), so this fails if the float64 pass is dropped or its margin made too narrow."""
    from dsconv.quant.algorithms.scale_grid import grid_neighbours

    x = np.random.default_rng(234).standard_normal((512, 7168), np.float32) * np.float32(0.02)
    row = (x[492:493].view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    _, scale, _ = quantize_weight_per_group(row, 0, 8)
    hi, lo = grid_neighbours(np.abs(row).max(axis=1, keepdims=True) / np.float32(127))
    assert lo[0, 0] < hi[0, 0] and lo[0, 0] * np.float32(127.5) >= np.abs(row).max()

    def err(s):  # the rule's error in units of the weight, summed exactly enough in float64
        t = row / s
        d = (t - np.clip(np.rint(t), -128, 127)).astype(np.float64)
        return float((d * d).sum()) * float(s[0, 0]) ** 2

    e_lo, e_hi = err(lo), err(hi)
    assert abs(e_hi - e_lo) <= 7170 * 2.0 ** -22 * max(e_lo, e_hi)  # a near-tie: the float64 pass decides
    assert scale[0, 0] == (hi if e_hi <= e_lo else lo)[0, 0]


def test_compiled_kernel_reads_every_input_form_alike():
    """The kernel's input forms give the same integers and scales: bf16 bit patterns (contiguous: widened in the
    kernel), a strided bf16 view (widened in tiles), float32 in writable and in read-only memory (a float32
    checkpoint's mapped pages), per channel and per group of 8 and 4 bits; a clipped range (the searches' ratio < 1)
    clamps at both ends."""
    from dsconv.quant.algorithms.scale_grid import absmax, quantize_rows

    gen = torch.Generator().manual_seed(3)
    base = (torch.randn(96, 512, generator=gen) * torch.exp(torch.randn(96, 1, generator=gen))).bfloat16()
    strided = torch.stack([base, base], dim=2)[..., 0]  # same values, not contiguous
    assert not strided.is_contiguous() and torch.equal(strided, base)
    ref = base.float().numpy()
    ro = np.frombuffer(ref.tobytes(), np.float32).reshape(ref.shape)
    assert not ro.flags.writeable
    for bits, g in ((8, 0), (4, 0), (4, 64)):
        outs = [quantize_weight_per_group(x, g, bits)[:2] for x in (base, strided, ref, ro)]
        for q, s in outs[1:]:
            np.testing.assert_array_equal(q, outs[0][0])
            np.testing.assert_array_equal(s, outs[0][1])
    rows = ref.reshape(-1, 64)
    q = np.empty(rows.shape, np.int8)
    s = quantize_rows(rows, absmax(rows), -8, 7, q, ratio=0.5)
    assert q.min() == -8 and q.max() == 7
    np.testing.assert_array_equal(q, np.clip(np.rint(rows / s), -8, 7))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_bf16_weight_is_user_error(bad):
    """max |w| taken on bf16 bit patterns still finds NaN and Inf (their patterns sort above every finite value)."""
    w = torch.ones(4, 64, dtype=torch.bfloat16)
    w[2, 5] = bad
    with pytest.raises(UserError, match="bad.weight"):
        quantize_weight_per_group(w, 0, 8, name="bad.weight")


def test_reported_error_is_the_sampled_rows_relative_error():
    """The report's weight error (compiled, float64 per row) equals the plain float64 formula on the same rows."""
    from dsconv.quant.algorithms.error_metrics import sample_step, sampled_weight_error

    gen = torch.Generator().manual_seed(4)
    for n, g in ((1000, 0), (64, 32)):
        w = torch.randn(n, 256, generator=gen).bfloat16()
        q, scale, _ = quantize_weight_per_group(w, g, 4)
        rows = slice(0, n, sample_step(n))
        want = weight_error(w.float().numpy()[rows], dequant_weight(q[rows], scale[rows]))
        assert sampled_weight_error(w, q, scale) == pytest.approx(want, rel=1e-12)
    assert sampled_weight_error(np.zeros((3, 8), np.float32), np.zeros((3, 8), np.int8), np.ones((3, 1))) == 0.0


def test_group_size_error_names_layer_and_valid_sizes():
    with pytest.raises(UserError) as err:
        quantize_weight_per_group(np.ones((4, 576), np.float32), 128, name="model.layers.3.self_attn.kv_a_proj")
    text = err.value.one_line()
    assert "model.layers.3.self_attn.kv_a_proj" in text and "128" in text and "576" in text
    assert "32, 64, 0" in text
    assert valid_group_sizes(576) == [32, 64, 0]
    assert valid_group_sizes(7168) == [32, 64, 128, 256, 512, 1024, 0]
    assert valid_group_sizes(100) == [0]
    with pytest.raises(UserError):
        quantize_weight_per_group(np.ones((4, 256), np.float32), -1, name="x")


def test_bf16_torch_input_matches_float32_numpy():
    gen = torch.Generator().manual_seed(0)
    wt = torch.randn(300, 256, generator=gen).bfloat16()
    ref = wt.float().numpy().copy()
    q1, s1 = quantize_weight_per_channel(wt)
    q2, s2 = quantize_weight_per_channel(ref)
    np.testing.assert_array_equal(q1, q2)
    np.testing.assert_array_equal(s1, s2)
    q3, s3, _ = quantize_weight_per_group(wt, 64)
    q4, s4, _ = quantize_weight_per_group(ref, 64)
    np.testing.assert_array_equal(q3, q4)
    np.testing.assert_array_equal(s3, s4)
    np.testing.assert_array_equal(wt.float().numpy(), ref)  # the source was not written to


def test_non_finite_weight_is_user_error():
    w = np.ones((2, 4), np.float32)
    w[1, 2] = np.nan
    with pytest.raises(UserError, match="bad.weight"):
        quantize_weight_per_channel(w, name="bad.weight")


def test_dequant_and_relative_error_by_hand():
    q = np.array([[1, -2, 3, 4]], np.int8)
    scale = np.array([[0.5, 2.0]], np.float32)  # group 2
    np.testing.assert_array_equal(dequant_weight(q, scale, group_size=2), [[0.5, -1.0, 6.0, 8.0]])
    np.testing.assert_array_equal(
        dequant_weight(q, np.array([[0.5]], np.float32), np.array([[1.0]], np.float32)), [[0.0, -1.5, 1.0, 1.5]]
    )
    assert weight_error(np.array([3.0, 4.0]), np.array([3.0, 4.5])) == pytest.approx(0.1)
    assert weight_error(np.zeros(3), np.zeros(3)) == 0.0


# ------------------------------------------------------------------------------------------ int4 packing
def test_pack_int4_bit_order_explicit_bytes():
    # column 0: even row 1 -> low nibble 0x1, odd row -2 -> high nibble 0xE: byte 0xE1 = int8 -31
    # column 1: 7 and 0 -> 0x07; column 2: -8 -> 0x8 low, 3 -> 0x3 high: 0x38 = 56
    q = np.array([[1, 7, -8], [-2, 0, 3]], np.int8)
    packed = pack_int4(q)
    assert packed.dtype == np.int8 and packed.shape == (1, 3)
    np.testing.assert_array_equal(packed, [[-31, 7, 56]])
    assert packed.view(np.uint8)[0, 0] == 0xE1
    np.testing.assert_array_equal(unpack_int4(packed, 2), q)


def test_pack_int4_along_k_explicit_bytes():
    q = np.array([[1, -2, 7, -8]], np.int8)  # pairs along k: (1, -2) -> 0xE1, (7, -8) -> 0x87 = -121
    packed = pack_int4_along_k(q)
    np.testing.assert_array_equal(packed, [[-31, -121]])
    np.testing.assert_array_equal(unpack_int4_along_k(packed, 4), q)


def test_pack_round_trip_and_layout_by_shape():
    rng = np.random.default_rng(1)
    q = rng.integers(-8, 8, size=(6, 10)).astype(np.int8)
    np.testing.assert_array_equal(unpack_int4(pack_int4(q), 6), q)
    np.testing.assert_array_equal(unpack_int4_by_shape(pack_int4(q), (6, 10)), q)
    np.testing.assert_array_equal(unpack_int4_by_shape(pack_int4_along_k(q), (6, 10)), q)
    with pytest.raises(UserError):
        unpack_int4_by_shape(pack_int4(q), (6, 12))


def test_pack_int4_odd_rows_is_user_error():
    with pytest.raises(UserError, match="layer.odd"):
        pack_int4(np.zeros((3, 4), np.int8), name="layer.odd")
    with pytest.raises(ValueError):
        pack_int4(np.full((2, 2), 8, np.int8))


# ------------------------------------------------------------------------------------------ activations and W8A8
def test_activation_qparams_by_hand():
    scale, offset = activation_qparams(-1.0, 3.0)
    # scale = 4 / 255 = 0.0156862..., rounded up onto bf16's grid (8 significant bits: 2**-6 * 129/128) =
    # 0.0157470703125; offset = round(-128 - (-1) / scale) = round(-128 + 63.504) = -64
    assert scale.dtype == np.float32 and offset.dtype == np.float32
    assert scale == np.float32(2.0 ** -6 * 129 / 128)
    assert offset == -64.0
    xq = quantize_activation(np.array([-1.0, 0.0, 3.0], np.float32), scale, offset)
    np.testing.assert_array_equal(xq, [-128, -64, 127])  # min -> -128, 0 exact, max -> 127 (126.51)
    # ranges are widened to include 0
    s2, o2 = activation_qparams(2.0, 5.0)  # 5/255 = 2**-6 * 1.2549 -> 2**-6 * 161/128
    assert s2 == np.float32(2.0 ** -6 * 161 / 128) and o2 == -128.0
    s3, o3 = activation_qparams(-2.0, -1.0)  # 2/255 = 2**-7 * 1.0039 -> 2**-7 * 129/128; round(-128 + 254.02)
    assert s3 == np.float32(2.0 ** -7 * 129 / 128) and o3 == 126.0
    # degenerate range: never a zero scale
    s4, o4 = activation_qparams(0.0, 0.0)
    assert s4 == 1.0 and o4 == -128.0
    np.testing.assert_array_equal(fake_quant_activation(np.zeros(3, np.float32), s4, o4), 0.0)


def test_w8a8_static_params_by_hand():
    w_q = np.array([[1, -2, 3], [127, 0, -128]], np.int8)  # row sums 2 and -1
    weight_scale = np.array([[0.5], [0.25]], np.float32)
    out = w8a8_static_params(w_q, weight_scale, 0.5, -3.0, np.array([1.0, -2.0], np.float32))
    assert out["deq_scale"].dtype == np.float32 and out["quant_bias"].dtype == np.int32
    np.testing.assert_array_equal(out["deq_scale"], [0.25, 0.125])
    # 1 / 0.25 - 2 * (-3) = 10 ; -2 / 0.125 - (-1) * (-3) = -19
    np.testing.assert_array_equal(out["quant_bias"], [10, -19])
    no_bias = w8a8_static_params(w_q, weight_scale, 0.5, -3.0, None)
    np.testing.assert_array_equal(no_bias["quant_bias"], [6, -3])
    # the int32 range is checked, not wrapped
    with pytest.raises(UserError, match="overflows int32"):
        w8a8_static_params(w_q, weight_scale, 1e-9, 0.0, np.array([1e3, 0.0], np.float32), name="l")


def test_deq_scale_int64_bit_pattern():
    stored = deq_scale_as_int64(np.array([1.0, 0.5, -2.0], np.float32))
    assert stored.dtype == np.int64
    np.testing.assert_array_equal(stored, [1065353216, 1056964608, -1073741824])  # 0x3F800000, 0x3F000000, 0xC0000000
    np.testing.assert_array_equal(deq_scale_from_int64(stored), [1.0, 0.5, -2.0])
    rng = np.random.default_rng(2)
    d = rng.random(100).astype(np.float32) * 1e-4
    np.testing.assert_array_equal(deq_scale_from_int64(deq_scale_as_int64(d)), d)


def test_w8a8_static_reconstruction():
    """y = (x_q @ w_q^T + quant_bias) * deq_scale matches x @ w^T + bias within 2% relative (measured 1.0%),
    and equals the fake-quant float computation up to the rounding of quant_bias."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((256, 64)) + 0.3).astype(np.float32)  # asymmetric range: offset != -128/0
    w = (rng.standard_normal((32, 64)) * 0.05).astype(np.float32)
    bias = (rng.standard_normal(32) * 0.1).astype(np.float32)
    w_q, w_scale = quantize_weight_per_channel(w)
    obs = MinMaxObserver()
    for part in np.array_split(x, 4):
        obs.update(part)
    in_scale, in_offset = obs.qparams()
    assert in_offset != 0
    p = w8a8_static_params(w_q, w_scale, in_scale, in_offset, bias)
    x_q = quantize_activation(x, in_scale, in_offset)
    acc = x_q.astype(np.int32) @ w_q.astype(np.int32).T + p["quant_bias"]
    y = acc.astype(np.float64) * p["deq_scale"]
    y_ref = x.astype(np.float64) @ w.T.astype(np.float64) + bias
    assert weight_error(y_ref, y) < 0.02
    y_fake = fake_quant_activation(x, in_scale, in_offset) @ dequant_weight(w_q, w_scale).T + bias
    np.testing.assert_allclose(y, y_fake, atol=float(p["deq_scale"].max()) * 0.51 + 1e-5)


def test_smooth_scales_by_hand_and_invariance():
    s = smooth_scales(np.array([4.0, 0.0, 9.0, 1e12]), np.array([1.0, 2.0, 4.0, 1.0]), alpha=0.5)
    # sqrt(4)/sqrt(1) = 2; dead channel -> 1; sqrt(9)/sqrt(4) = 1.5; sqrt(1e12) = 1e6 clipped to 1e4
    np.testing.assert_allclose(s, [2.0, 1.0, 1.5, 1e4], rtol=1e-6)
    with pytest.raises(UserError):
        smooth_scales(np.ones(2), np.ones(2), alpha=1.5)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 8)).astype(np.float32) * np.array([1, 1, 50, 1, 1, 1, 20, 1], np.float32)
    w = rng.standard_normal((4, 8)).astype(np.float32)
    s = smooth_scales(np.abs(x).max(0), np.abs(w).max(0), alpha=0.5)
    np.testing.assert_allclose((x / s) @ (w * s).T, x @ w.T, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------ observers
def _outlier_data(seed: int = 5) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4000, 32)).astype(np.float32)
    x[rng.integers(0, 4000, 5), rng.integers(0, 32, 5)] = 60.0  # five outliers among 128k values
    x[7, 3] = -40.0
    return x


def test_minmax_streaming_equals_one_shot():
    x = _outlier_data()
    one = MinMaxObserver()
    one.update(x)
    streamed = MinMaxObserver()
    for part in np.array_split(x, [1, 100, 2500]):
        streamed.update(torch.from_numpy(part.copy()).reshape(1, -1, 32))  # torch input, extra leading dim
    assert streamed.tokens == one.tokens == 4000
    assert (streamed.min, streamed.max) == (one.min, one.max) == (-40.0, 60.0)
    np.testing.assert_array_equal(streamed.channel_absmax, one.channel_absmax)
    np.testing.assert_array_equal(one.channel_absmax, np.abs(x).max(0))
    assert streamed.qparams() == one.qparams() == activation_qparams(-40.0, 60.0)


@pytest.mark.parametrize("method", ["percentile", "mse"])
def test_histogram_streaming_equals_one_shot(method):
    x = _outlier_data()
    # batches that grow the range several times (small first batch, outliers late), forcing re-binning
    order = np.argsort(np.abs(x).max(1), kind="stable")
    xs = x[order]
    one = make_observer(method)
    one.update(xs)
    streamed = make_observer(method)
    for part in np.array_split(xs, [3, 50, 3990, 3999]):
        streamed.update(part)
    assert streamed.e == one.e and streamed.i0 == one.i0
    np.testing.assert_array_equal(streamed.counts, one.counts)
    assert streamed.counts.sum() == x.size and streamed.counts.size <= streamed.bins
    assert streamed.qparams() == one.qparams()


def test_percentile_and_mse_clip_less_than_minmax_on_outliers():
    x = _outlier_data()  # N(0, 1) bulk, five values at 60, one at -40
    obs = {m: make_observer(m) for m in ACT_METHODS}
    for part in np.array_split(x, 7):
        for o in obs.values():
            o.update(part)
    assert obs["minmax"].clip_range() == (-40.0, 60.0)
    mm_err = weight_error(x, fake_quant_activation(x, *obs["minmax"].qparams()))
    # percentile 99.99 drops the six outliers (< 0.01% per tail): the range shrinks to the bulk
    lo, hi = obs["percentile"].clip_range()
    assert -6.0 < lo < -2.0 and 2.0 < hi < 6.0, (lo, hi)
    bulk = x[np.abs(x) < 5]
    assert weight_error(bulk, fake_quant_activation(bulk, *obs["percentile"].qparams())) < 0.2 * weight_error(
        bulk, fake_quant_activation(bulk, *obs["minmax"].qparams())
    )
    # mse trades clipping error for resolution: narrower than minmax, lower total error than minmax
    lo, hi = obs["mse"].clip_range()
    assert -40.0 < lo and hi < 60.0 and (hi - lo) < 0.9 * 100.0, (lo, hi)
    assert weight_error(x, fake_quant_activation(x, *obs["mse"].qparams())) < mm_err
    # on a heavy tail (Student t, 3 dof) mse clips much more and wins clearly
    t = np.random.default_rng(11).standard_t(3, (4000, 32)).astype(np.float32)
    mm, mse = make_observer("minmax"), make_observer("mse")
    mm.update(t)
    mse.update(t)
    assert mse.clip_range()[1] - mse.clip_range()[0] < 0.85 * (t.max() - t.min())
    assert weight_error(t, fake_quant_activation(t, *mse.qparams())) < 0.92 * weight_error(
        t, fake_quant_activation(t, *mm.qparams())
    )


def test_observer_factory_and_errors():
    assert DEFAULT_ACT_METHOD == "minmax"
    assert isinstance(make_observer("minmax"), MinMaxObserver)
    assert isinstance(make_observer("mse"), HistogramObserver)
    with pytest.raises(UserError) as err:
        make_observer("entropy")
    assert all(m in err.value.one_line() for m in ACT_METHODS)
    with pytest.raises(UserError, match="never reached"):
        make_observer("mse", name="model.layers.0.mlp.experts.7.up_proj").qparams()
    bad = np.ones((2, 3), np.float32)
    bad[0, 0] = np.inf
    with pytest.raises(UserError, match="NaN or Inf"):
        make_observer("minmax").update(bad)


# ------------------------------------------------------------------------------------------ GPTQ
def _correlated_inputs(tokens: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((k, k)) / np.sqrt(k) + 0.5 * np.eye(k)
    scales = np.exp(rng.standard_normal(k))  # channels of different magnitude, as in LLMs
    z = rng.standard_normal((tokens, k))
    return ((z @ mix) * scales + 0.3 * rng.standard_normal((tokens, 1))).astype(np.float32)


def test_hessian_accumulator_streaming_weights_batches():
    x = _correlated_inputs(500, 16, 6)
    acc = HessianAccumulator(16)
    for part in np.array_split(x, [7, 300]):  # unequal batches
        acc.update(torch.from_numpy(part.copy()).unsqueeze(0))
    assert acc.tokens == 500
    ref = 2.0 * x.astype(np.float64).T @ x.astype(np.float64) / 500
    np.testing.assert_allclose(acc.hessian(), ref, rtol=1e-5, atol=1e-5)
    assert not HessianAccumulator(4).hessian().any()


@pytest.mark.parametrize("group_size,act_order", [(32, False), (32, True), (0, False)])
def test_gptq_beats_rtn_on_correlated_inputs(group_size, act_order):
    x = _correlated_inputs(2048, 128, 7)
    w = (np.random.default_rng(8).standard_normal((64, 128)) * 0.05).astype(np.float32)
    acc = HessianAccumulator(128)
    for part in np.array_split(x, 4):
        acc.update(part)
    q, scale, offset = gptq_quantize(w, acc.hessian(), bits=4, group_size=group_size, act_order=act_order)
    q_rtn, s_rtn, o_rtn = quantize_weight_per_group(w, group_size, bits=4)
    assert q.dtype == np.int8 and q.shape == w.shape and q.min() >= -8 and q.max() <= 7
    assert scale.shape == s_rtn.shape and scale.dtype == np.float32 and not offset.any()
    y = x @ w.T
    err_gptq = np.linalg.norm(y - x @ dequant_weight(q, scale, offset).T)
    err_rtn = np.linalg.norm(y - x @ dequant_weight(q_rtn, s_rtn, o_rtn).T)
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)  # measured 0.72 / 0.51 / 0.70


def test_gptq_lazy_block_updates_match_small_blocks():
    """The blocked (lazy batch) update is an exact reorganisation: block sizes agree up to float rounding."""
    x = _correlated_inputs(1024, 96, 12)
    w = (np.random.default_rng(13).standard_normal((32, 96)) * 0.05).astype(np.float32)
    H = HessianAccumulator(96)
    H.update(x)
    for g in (0, 32):
        q1, s1, _ = gptq_quantize(w, H.hessian(), bits=4, group_size=g, block_size=32)
        q2, s2, _ = gptq_quantize(w, H.hessian(), bits=4, group_size=g, block_size=96)
        assert (q1 != q2).mean() < 0.005
        np.testing.assert_allclose(s1, s2, rtol=1e-4)


def test_gptq_identity_hessian_is_rtn_and_dead_columns_are_rtn():
    rng = np.random.default_rng(9)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    for g in (0, 16):
        q, s, _ = gptq_quantize(w, np.eye(64, dtype=np.float32), bits=4, group_size=g)
        q_rtn, s_rtn, _ = quantize_weight_per_group(w, g, bits=4)
        np.testing.assert_array_equal(q, q_rtn)
        np.testing.assert_array_equal(s, s_rtn)
    # an expert calibration never reached: all-zero H -> plain round to nearest, no NaN
    q, s, _ = gptq_quantize(w, np.zeros((64, 64), np.float32), bits=8)
    np.testing.assert_array_equal(q, quantize_weight_per_channel(w, bits=8)[0])
    # one dead input channel among live ones keeps its weights (rounded to nearest), the others still use GPTQ
    x = _correlated_inputs(512, 64, 10)
    x[:, 5] = 0.0
    H = 2 * x.T @ x / 512
    q, s, _ = gptq_quantize(w, H, bits=4, group_size=0)
    q_rtn, _ = quantize_weight_per_channel(w, bits=4)
    np.testing.assert_array_equal(q[:, 5], q_rtn[:, 5])
    assert (q[:, 5] != 0).any()
    assert (q != q_rtn).any()


def test_inverse_cholesky_matches_reference_formula():
    """U = J chol(J H J)^-1 J equals the reference chol(cholesky_inverse(chol(H)), upper=True) (k > 512: blocked)."""
    x = torch.from_numpy(_correlated_inputs(1500, 700, 14))
    H = 2 * x.T @ x / 1500
    U = _inverse_cholesky(H, 0.01, "x")
    Hd = H + 0.01 * torch.diagonal(H).mean() * torch.eye(700)
    ref = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(Hd.double())), upper=True)
    assert torch.equal(U, torch.triu(U))
    assert float((U.double() - ref).abs().max() / ref.abs().max()) < 1e-5


def test_gptq_rejects_bad_group_and_shapes():
    with pytest.raises(UserError, match="layer.x"):
        gptq_quantize(np.ones((4, 96), np.float32), np.eye(96, dtype=np.float32), group_size=64, name="layer.x")
    with pytest.raises(UserError, match="Hessian shape"):
        gptq_quantize(np.ones((4, 64), np.float32), np.eye(32, dtype=np.float32))


# ------------------------------------------------------------------------------------------------ the layout table
ST_OF_NUMPY = {np.dtype(np.int8): "I8", np.dtype(np.float32): "F32", np.dtype(np.int32): "I32",
               np.dtype(np.int64): "I64", np.dtype(np.float16): "F16"}


@pytest.mark.parametrize("deq_dtype", ["F32", "I64"])
@pytest.mark.parametrize("qtype", ["W8A16", "W8A8_DYNAMIC", "W8A8", "W4A16", "W8A8_STAGED"])
def test_emitted_tensors_are_the_layout_tables(qtype, deq_dtype):
    """What emit_linear writes is exactly what linear_layout plans (names, order, dtypes, shapes): the header of
    every output part is planned from the table before the first byte, so any drift would fail the write."""
    from dsconv.quant.formats.msmodelslim import LinearResult, emit_linear, linear_layout

    rng = np.random.default_rng(0)
    n, k = 8, 64
    groups = 2 if qtype == "W4A16" else 1
    res = LinearResult(q=rng.integers(-8, 8, (n, k)).astype(np.int8),
                       scale=(rng.random((n, groups)) + 0.1).astype(np.float32),
                       input_scale=np.float32(0.05), input_offset=np.float32(-3.0),
                       deq_scale=(rng.random(n) * 1e-3).astype(np.float32),
                       quant_bias=rng.integers(-100, 100, n).astype(np.int32), bias=np.ones(n, np.float16))
    planned = linear_layout("m.p", qtype, n, k, groups, deq_dtype, "F16")
    emitted = list(emit_linear("m.p", qtype, res, deq_dtype))
    assert [name for name, _ in emitted] == [name for name, _, _ in planned]
    for (name, arr), (_, dtype, shape) in zip(emitted, planned):
        assert (ST_OF_NUMPY[arr.dtype], tuple(arr.shape)) == (dtype, shape), name
    with pytest.raises(ValueError):
        linear_layout("m.p", "W3A3", n, k)


def test_scales_are_values_every_engine_dtype_holds():
    """vLLM-Ascend and MindIE keep input_scale and dynamic weight scales in the model dtype (bf16 or fp16): every
    scale dsconv writes survives float32 -> bf16 and -> fp16 unchanged, is never below the exact one (no extra
    clipping), and at most 2**-7 above it; all-zero rows still get 1.0."""
    import torch

    from dsconv.quant.algorithms.schemes import activation_qparams, usable_scale

    rng = np.random.default_rng(0)
    exact = np.concatenate([10.0 ** rng.uniform(-9, 3, 4000), [2.0 ** -24, 2.0 ** -17, 2.0 ** -14, 1.0, 3.0]])
    exact = exact.astype(np.float32)
    s = usable_scale(exact)
    t = torch.from_numpy(s)
    assert torch.equal(t.to(torch.bfloat16).float(), t) and torch.equal(t.to(torch.float16).float(), t)
    assert (s >= exact).all()
    big = exact >= 2.0 ** -17
    assert (s[big] / exact[big] - 1 < 2.0 ** -7).all()
    assert torch.equal(usable_scale(torch.from_numpy(exact)), t)  # the torch path is the same rule
    assert usable_scale(np.zeros(2, np.float32)).tolist() == [1.0, 1.0]
    scale, offset = activation_qparams(-0.37, 5.1)
    assert float(torch.tensor(float(scale)).to(torch.bfloat16)) == float(scale) and offset == np.rint(offset)


def test_every_method_has_a_rounding_function():
    """--method names come from the import-free methods.py (the CLI reads it at start-up); each needs its registered
    rounding, and AWQ without a chosen weight rounds to nearest, byte for byte."""
    from dsconv.quant.algorithms.methods import METHODS
    from dsconv.quant.weights import ROUNDING, RoundingInput, round_awq, round_to_nearest

    assert set(ROUNDING) == set(METHODS)

    class LP:
        module = "m"

    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    for bits, g in ((8, 0), (4, 32)):
        a, b = round_awq(LP, w, RoundingInput(bits, g)), round_to_nearest(LP, w, RoundingInput(bits, g))
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_relative_error_keeps_each_zero_reference_rule():
    from dsconv.quant.algorithms.error_metrics import relative_error

    zero, one = torch.zeros(3), torch.ones(3)
    assert relative_error(zero, zero, zero_ref="inf") == 0.0
    assert relative_error(one, zero, zero_ref="inf") == float("inf")
    assert relative_error(one, zero) == 0.0
    assert relative_error(one, zero, zero_ref="absolute") == pytest.approx(3 ** 0.5)
    assert relative_error(2 * one, one, float64=True) == pytest.approx(1.0)
