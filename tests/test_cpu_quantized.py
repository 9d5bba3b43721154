"""The quantised KV cache: e4m3 rounding, dequantised values within their bound, bytes, and why keys are
quantised per channel."""

import numpy as np
import pytest

from mha_lab.cpu.quantized import (
    LAYOUTS,
    keys_with_outliers,
    quantize,
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
@pytest.mark.parametrize("axis", ["token", "channel", "tensor"])
def test_dequantised_cache_is_within_its_bound(fmt, axis):
    K = keys_with_outliers((2, 3, 50, 16), [3, 11], 20.0, seed=4)
    q = quantize(K, fmt, axis)
    err = np.abs(q.dequantize() - K)
    assert (err <= q.error_bound() * (1 + 1e-12)).all()
    assert err.max() > 0.2 * q.error_bound().max()  # the bound is not loose by orders of magnitude
    shared = {"token": (2, 3, 50, 1), "channel": (2, 3, 1, 16), "tensor": (2, 3, 1, 1)}[axis]
    assert q.scale.shape == shared and q.nbytes == K.size + 2 * np.prod(shared)


def test_keys_with_outlier_channels_want_a_scale_per_channel():
    rng = np.random.default_rng(5)
    K = keys_with_outliers((1, 2, 256, 32), [2, 19], 10.0, seed=6)
    V = rng.standard_normal((1, 2, 256, 32))
    q = rng.standard_normal((1, 4, 1, 32))
    errors = {name: quantized_attention_error(q, K, V, *layout)[1] for name, layout in LAYOUTS.items()}
    assert errors["int8, K per channel, V per token (KIVI)"] < errors["int8, K per token, V per token"] / 2
    bytes_kivi, _ = quantized_attention_error(q, K, V, *LAYOUTS["int8, K per channel, V per token (KIVI)"])
    # per token of the sequence: 2 heads x 32 bytes of K and of V, V's 2 scales, K's 64 scales over 256 tokens
    assert bytes_kivi == pytest.approx(2 * 2 * 32 + 2 * 2 + 2 * 2 * 32 / 256)


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="fmt must be one of"):
        quantize(np.ones((2, 2)), "int4", "token")
