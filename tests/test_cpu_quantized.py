"""The quantised KV cache: e4m3 rounding, dequantised values within their bound, bytes, and why keys are
quantised per channel."""

import numpy as np
import pytest

from mha_lab.cpu.quantized import (
    LAYOUTS,
    keys_with_outliers,
    kivi_attention_error,
    kivi_quantize,
    quantize,
    quantize_groups,
    quantized_attention_error,
    round_e4m3,
)


def e4m3_values() -> np.ndarray:
    """Every finite e4m3 value, from its bits: 4 exponent bits (bias 7), 3 mantissa bits, S.1111.111 is NaN."""
    e, m = np.meshgrid(np.arange(16), np.arange(8), indexing="ij")
    mag = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7.0)).ravel()[:-1]  # drop NaN
    return np.unique(np.concatenate([-mag, mag]))


def test_round_e4m3_is_the_nearest_value():
    grid = e4m3_values()
    assert grid.max() == 448 and len(grid) == 253  # 2 * 127 magnitudes, +-0 counted once
    x = np.random.default_rng(0).standard_normal(5000) * np.exp(np.random.default_rng(1).uniform(-9, 6, 5000))
    x = np.clip(x, -448, 448)
    got = round_e4m3(x)
    assert np.isin(got, grid).all()
    nearest = np.abs(grid[None, :] - x[:, None]).min(axis=1)
    np.testing.assert_array_equal(np.abs(got - x), nearest)


def test_round_e4m3_matches_torch():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(2).standard_normal(4000) * 50
    x = np.clip(x, -448, 448)
    want = torch.from_numpy(x).to(torch.float8_e4m3fn).to(torch.float64).numpy()
    np.testing.assert_array_equal(round_e4m3(x), want)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("axis", ["token", "channel", "tensor", "layer"])
def test_dequantised_cache_is_within_its_bound(fmt, axis):
    K = keys_with_outliers((2, 3, 50, 16), [3, 11], 20.0, seed=4)
    q = quantize(K, fmt, axis)
    err = np.abs(q.dequantize() - K)
    assert (err <= q.error_bound() * (1 + 1e-12)).all()
    assert err.max() > 0.2 * q.error_bound().max()  # the bound is not loose by orders of magnitude
    shared = {"token": (2, 3, 50, 1), "channel": (2, 3, 1, 16), "tensor": (2, 3, 1, 1), "layer": (1, 1, 1, 1)}[axis]
    assert q.scale.shape == shared and q.nbytes == K.size + 2 * np.prod(shared)


def test_keys_with_outlier_channels_want_a_scale_per_channel():
    rng = np.random.default_rng(5)
    K = keys_with_outliers((1, 2, 256, 32), [2, 19], 10.0, seed=6)
    V = rng.standard_normal((1, 2, 256, 32))
    q = rng.standard_normal((1, 4, 1, 32))
    errors = {name: quantized_attention_error(q, K, V, *layout)[1] for name, layout in LAYOUTS.items()}
    assert errors["int8, K per channel of the whole cache, V per token"] < errors["int8, K per token, V per token"] / 2
    whole = LAYOUTS["int8, K per channel of the whole cache, V per token"]
    bytes_whole, _ = quantized_attention_error(q, K, V, *whole)
    # per token of the sequence: 2 heads x 32 bytes of K and of V, V's 2 scales, K's 64 scales over 256 tokens
    assert bytes_whole == pytest.approx(2 * 2 * 32 + 2 * 2 + 2 * 2 * 32 / 256)


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="fmt must be one of"):
        quantize(np.ones((2, 2)), "int4", "token")


def test_group_quantisation_is_asymmetric_and_within_half_a_step():
    x = np.random.default_rng(7).standard_normal((2, 3, 64, 16)) + 3.0  # all positive: a zero point matters
    for axis, shape in (("channel", (2, 3, 2, 1, 16)), ("token", (2, 3, 64, 2, 1))):
        g = quantize_groups(x, 2, axis, 32 if axis == "channel" else 8)
        assert g.scale.shape == g.zero.shape == shape and g.codes.max() == 3 and g.codes.min() == 0
        step = np.broadcast_to(g.scale, g.codes.shape).reshape(x.shape)
        assert (np.abs(g.dequantize() - x) <= step / 2 + 1e-12).all()
    with pytest.raises(ValueError, match="must divide the 64 tokens"):
        quantize_groups(x, 2, "channel", 48)
    with pytest.raises(ValueError, match="bits must be 2, 4 or 8"):
        quantize_groups(x, 3, "token", 8)


def test_kivi_counts_grouped_scales_zero_points_and_the_float16_residual():
    """Llama-3-8B's layer (8 key/value heads of 128) at G = 32 with float16 scale and zero point: 128 B of key
    scales and zero points per token (one pair per channel per 32 tokens) and 128 B of value ones (one pair per 32
    channels of each head), beside 512 B of 2-bit codes. A per-channel scale over the whole cache (2,066 B in int8)
    is not what KIVI stores: its scale could not be known while tokens still arrive."""
    rng = np.random.default_rng(8)
    K, V = rng.standard_normal((2, 1, 8, 1024, 128))
    keys, values = quantize_groups(K, 2, "channel", 32), quantize_groups(V, 2, "token", 32)
    assert keys.nbytes / 1024 == 512 / 2 + 128 and values.nbytes / 1024 == 512 / 2 + 128
    # a prompt of 1,000 tokens: keys 896 quantised (1000 mod 128 = 104 in float16), values 872 (the last 128)
    K_hat, V_hat, stored = kivi_quantize(K[..., :1000, :], V[..., :1000, :], bits=2, group=32, residual=128)
    np.testing.assert_array_equal(K_hat[..., 896:, :], K[..., 896:1000, :])
    np.testing.assert_array_equal(V_hat[..., 872:, :], V[..., 872:1000, :])
    assert not np.array_equal(K_hat[..., :896, :], K[..., :896, :])
    codes_and_pairs = 896 * (256 + 128) + 872 * (256 + 128)
    assert stored == codes_and_pairs + 2 * 8 * 128 * (104 + 128)
    per_token, err = kivi_attention_error(rng.standard_normal((1, 32, 1, 128)), K, V, bits=4)
    assert per_token == ((1024 + 896) * (512 + 128) + 2 * 8 * 128 * 128) / 1024 and 0 < err < 0.5
    with pytest.raises(ValueError, match="multiple of the group"):
        kivi_quantize(K, V, residual=100)
