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
    got = yarn_frequencies(6, factor=4, original_len=64, base=100.0, alpha=1, beta=32)
    gamma = np.array([(64 / (2 * np.pi) - 1) / 31, (64 * f[1] / (2 * np.pi) - 1) / 31, 0.0])
    assert_close(got, (1 - gamma) * f / 4 + gamma * f)
    # a pair that turns more than beta times is kept, one that turns less than alpha is interpolated
    got = yarn_frequencies(6, factor=4, original_len=64, base=100.0, alpha=1, beta=8)
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
