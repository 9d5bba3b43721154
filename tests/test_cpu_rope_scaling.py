"""RoPE scaling: the frequencies of each method against values worked by hand; partial rotary."""

import numpy as np
import pytest

from mha_lab.cpu import apply_rope
from mha_lab.cpu.rope_scaling import (
    apply_rope_frequencies,
    interpolation_frequencies,
    mean_rotary_score,
    ntk_frequencies,
    rope_frequencies,
    yarn_attention_factor,
    yarn_frequencies,
    yarn_ramp_bounds,
)
from mha_lab.testing import assert_close


def test_frequencies_by_hand():
    # d = 4, base 10,000: f = (1, 1/100)
    assert_close(rope_frequencies(4), [1.0, 0.01])
    assert_close(rope_frequencies(4, base=500_000.0), [1.0, 500_000 ** -0.5])
    assert_close(interpolation_frequencies(4, factor=4), [0.25, 0.0025])
    # NTK: base 10,000 * 4^(4/2) = 160,000: f = (1, 1/400); the fastest pair is kept, the slowest divided by 4
    assert_close(ntk_frequencies(4, factor=4), [1.0, 1 / 400])
    d = 128
    assert_close(ntk_frequencies(d, 8)[-1], rope_frequencies(d)[-1] / 8)


def test_yarn_by_hand():
    # d = 6, base 100: f = (1, 100^(-1/3), 1/100); over L = 64 positions they turn 64/2pi = 10.19, 2.19, 0.10 times
    f = rope_frequencies(6, base=100.0)
    got = yarn_frequencies(6, factor=4, original_len=64, base=100.0, beta_fast=32, beta_slow=1, ramp="turns")
    gamma = np.array([(64 / (2 * np.pi) - 1) / 31, (64 * f[1] / (2 * np.pi) - 1) / 31, 0.0])
    assert_close(got, (1 - gamma) * f / 4 + gamma * f)
    # a pair that turns more than beta_fast times is kept, one that turns less than beta_slow is interpolated
    got = yarn_frequencies(6, factor=4, original_len=64, base=100.0, beta_fast=8, beta_slow=1, ramp="turns")
    assert got[0] == f[0] and got[2] == f[2] / 4
    assert yarn_attention_factor(1) == 1.0 and yarn_attention_factor(np.e) == pytest.approx(1.1)


def test_apply_rope_frequencies_is_rope_and_interpolation_is_positions_divided():
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 8))
    p = np.arange(10, 15)
    assert_close(apply_rope_frequencies(x, p, rope_frequencies(8)), apply_rope(x, p))
    assert_close(apply_rope_frequencies(x, p, interpolation_frequencies(8, 4)), apply_rope(x, p / 4))


def test_partial_rotary_leaves_the_other_coordinates():
    x = np.random.default_rng(1).standard_normal((1, 6, 16))
    p = np.arange(6)
    out = apply_rope_frequencies(x, p, rope_frequencies(4), layout="interleaved")  # a quarter: 4 of 16
    assert_close(out[..., 4:], x[..., 4:])
    assert_close(out[..., :4], apply_rope(x[..., :4], p, layout="interleaved"))
    with pytest.raises(ValueError, match="more than the head"):
        apply_rope_frequencies(x, p, rope_frequencies(34))


def test_scores_depend_on_distance_only():
    f = rope_frequencies(8)
    q = np.ones((1, 8))
    rotated = lambda p: apply_rope_frequencies(q, np.array([p]), f)[0]  # noqa: E731
    for m, n in [(0, 5), (100, 105), (7, 12)]:
        assert rotated(m) @ rotated(n) / 8 == pytest.approx(mean_rotary_score(f, [n - m])[0])
    assert mean_rotary_score(f, [0])[0] == 1.0


def _reference_code_yarn(head_dim, base, factor, original_len, ntk_alpha, ntk_beta):
    """The NTK-by-parts frequencies as gpt-oss's ``RotaryEmbedding._compute_concentration_and_inv_freq`` computes
    them (Hugging Face and the YaRN repository do the same, with the bounds rounded outwards), transcribed to
    NumPy: a ramp in the pair index between low and high."""
    freq = base ** (np.arange(0, head_dim, 2) / head_dim)
    d_half = head_dim / 2
    low = d_half * np.log(original_len / (ntk_beta * 2 * np.pi)) / np.log(base)
    high = d_half * np.log(original_len / (ntk_alpha * 2 * np.pi)) / np.log(base)
    mask = 1 - np.clip((np.arange(d_half) - low) / (high - low), 0, 1)
    return 1.0 / (factor * freq) * (1 - mask) + 1.0 / freq * mask


def test_yarn_has_the_papers_ramp_in_turns_and_the_reference_codes_ramp_in_the_pair_index():
    """At d = 128, theta = 10^4, L = 4096, s = 8, pair 35 keeps 0.216 of its frequency by the paper's ramp and 0.489
    by the reference code's; the default is the code's, and both keep and interpolate the same pairs."""
    f = rope_frequencies(128)
    index, turns = (yarn_frequencies(128, 8, 4096, ramp=r) for r in ("index", "turns"))
    assert_close(index, _reference_code_yarn(128, 1e4, 8, 4096, 1.0, 32.0))
    assert_close(yarn_frequencies(128, 8, 4096), index)
    assert round(index[35] / f[35], 3) == 0.489 and round(turns[35] / f[35], 3) == 0.216
    low, high = yarn_ramp_bounds(128, 4096)
    assert low == pytest.approx(64 * np.log(4096 / (32 * 2 * np.pi)) / np.log(1e4)) and round(low, 2) == 20.94
    assert high == pytest.approx(64 * np.log(4096 / (2 * np.pi)) / np.log(1e4)) and round(high, 2) == 45.03
    # the pair at `low` turns beta_fast = 32 times over L, the one at `high` once: the ramps share their ends
    assert 4096 * 1e4 ** (-2 * low / 128) / (2 * np.pi) == pytest.approx(32)
    outside = (np.arange(64) < low) | (np.arange(64) > high)
    assert_close(index[outside], turns[outside])
    assert not np.allclose(index, turns)
    # the YaRN repository and Hugging Face round the bounds outwards: low 20, high 46
    truncated = yarn_frequencies(128, 8, 4096, truncate=True)
    assert truncated[20] == f[20] and truncated[46] == pytest.approx(f[46] / 8)
    kept = 1 - (35 - 20) / (46 - 20)
    assert truncated[35] / f[35] == pytest.approx((1 - kept) / 8 + kept)
    with pytest.raises(ValueError, match="ramp must be 'index'"):
        yarn_frequencies(128, 8, 4096, ramp="pairs")


def test_neox_partial_rotary_takes_the_frequencies_of_its_rotated_coordinates():
    """GPT-NeoX rotates r = d/4 coordinates at theta^(-2i/r): rope_frequencies(r), not rope_frequencies(d)[:r/2]."""
    x = np.random.default_rng(2).standard_normal((1, 5, 16))
    p = np.arange(5)
    neox = apply_rope_frequencies(x, p, rope_frequencies(4))
    assert_close(neox[..., :4], apply_rope(x[..., :4], p))
    assert not np.allclose(rope_frequencies(4), rope_frequencies(16)[:2])
    assert not np.allclose(neox, apply_rope_frequencies(x, p, rope_frequencies(16)[:2]))
