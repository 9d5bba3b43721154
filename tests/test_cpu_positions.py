"""Positional encodings: each against an independent formulation, and RoPE's laws and decoding."""

import inspect
import math

import numpy as np
import pytest

from mha_lab.cpu import (
    GroupedQueryAttention,
    KVCache,
    LearnedPositions,
    MultiHeadAttention,
    RotaryAttention,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    create_causal_mask,
    decode_step,
    interleaved_to_half,
    prefill,
    rotation_matrix,
    sinusoidal_encoding,
)
from mha_lab.testing import assert_close

rng = np.random.default_rng(0)


def test_attention_without_positions_is_permutation_equivariant():
    layer = MultiHeadAttention(d_model=12, num_heads=3, seed=0)
    X = rng.standard_normal((2, 7, 12))
    perm = rng.permutation(7)
    assert_close(layer.forward(X[:, perm]), layer.forward(X)[:, perm])
    pe = sinusoidal_encoding(7, 12)  # adding positions breaks it
    assert np.abs(layer.forward(X[:, perm] + pe) - layer.forward(X + pe)[:, perm]).max() > 1e-3


def test_sinusoidal_encoding_matches_the_formula_term_by_term():
    L, d, base = 9, 10, 10000.0
    expected = [[math.sin(p / base ** (2 * (i // 2) / d)) if i % 2 == 0 else math.cos(p / base ** (2 * (i // 2) / d))
                 for i in range(d)] for p in range(3, 3 + L)]
    assert_close(sinusoidal_encoding(L, d, offset=3), np.array(expected))


def test_sinusoidal_shift_is_a_rotation_of_each_pair():
    """PE[p + k] = R_k PE[p] pair by pair: why a shift is linear in the encoding (and what RoPE builds on)."""
    d, k = 8, 5
    pe = sinusoidal_encoding(20, d)
    # (sin, cos) of (p + k) w = rotation by k w of (sin, cos) of p w, with the pair read as (cos, sin)
    R = rotation_matrix(k, d, layout="interleaved")
    swap = np.arange(d).reshape(-1, 2)[:, ::-1].ravel()  # (sin, cos) -> (cos, sin) in each pair
    assert_close((pe[:-k][:, swap] @ R.T)[:, swap], pe[k:])


def test_learned_positions_are_a_one_hot_lookup_and_do_not_extrapolate():
    table = LearnedPositions(max_len=16, d_model=6, seed=0)
    X = rng.standard_normal((2, 5, 6))
    one_hot = np.eye(16)[np.arange(4, 9)]  # (L, max_len)
    assert_close(table(X, offset=4), X + one_hot @ table.table)
    with pytest.raises(ValueError, match="cannot extrapolate"):
        table(X, offset=12)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rope_is_complex_multiplication(layout):
    d, positions = 10, np.array([0, 1, 7, 97, 1000])
    x = rng.standard_normal((2, 3, len(positions), d))
    theta = positions[:, None] * 10000.0 ** (-np.arange(d // 2) * 2 / d)
    if layout == "interleaved":
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * theta)
        expected = np.stack([z.real, z.imag], axis=-1).reshape(x.shape)
    else:
        z = (x[..., : d // 2] + 1j * x[..., d // 2:]) * np.exp(1j * theta)
        expected = np.concatenate([z.real, z.imag], axis=-1)
    assert_close(apply_rope(x, positions, layout), expected)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rope_is_the_rotation_matrix_and_scores_depend_on_the_offset_only(layout):
    d = 8
    q, k = rng.standard_normal((2, d))
    for p in (0, 3, 50):
        assert_close(apply_rope(q[None], [p], layout)[0], rotation_matrix(p, d, layout) @ q)
    R = rotation_matrix(11, d, layout)
    assert_close(R.T @ R, np.eye(d))
    assert_close(rotation_matrix(4, d, layout).T @ rotation_matrix(15, d, layout), R)  # R_m^T R_n = R_{n-m}
    score = lambda m, n: apply_rope(q[None], [m], layout)[0] @ apply_rope(k[None], [n], layout)[0]  # noqa: E731
    assert abs(score(3, 10) - score(1003, 1010)) < 1e-10
    assert abs(score(3, 10) - score(3, 11)) > 1e-3


def test_a_shifted_rope_layer_gives_the_same_outputs():
    layer = RotaryAttention(d_model=16, num_heads=2, num_kv_heads=1, seed=0)
    X, mask = rng.standard_normal((1, 9, 16)), create_causal_mask(9)
    assert_close(layer.forward(X, mask, offset=500), layer.forward(X, mask))
    assert np.abs(layer.forward(X[:, ::-1], mask) - layer.forward(X, mask)[:, ::-1]).max() > 1e-3


def test_the_two_layouts_agree_through_a_permutation_of_w_q_and_w_k():
    inter = RotaryAttention(d_model=24, num_heads=4, num_kv_heads=2, layout="interleaved", seed=1)
    half = RotaryAttention(d_model=24, num_heads=4, num_kv_heads=2, layout="half", seed=2)
    half.W_V, half.W_O = inter.W_V, inter.W_O
    half.W_Q, half.W_K = interleaved_to_half(inter.W_Q, 4), interleaved_to_half(inter.W_K, 2)
    X, mask = rng.standard_normal((2, 7, 24)), create_causal_mask(7)
    assert_close(half.forward(X, mask), inter.forward(X, mask))
    half.W_Q, half.W_K = inter.W_Q, inter.W_K  # the same weights in the other layout: wrong
    assert np.abs(half.forward(X, mask) - inter.forward(X, mask)).max() > 1e-3


@pytest.mark.parametrize("num_kv_heads, prompt", [(4, 1), (2, 7), (1, 3)])
def test_rope_decoding_equals_the_causal_forward(num_kv_heads, prompt):
    layer = RotaryAttention(d_model=32, num_heads=4, num_kv_heads=num_kv_heads, seed=3)
    L = 12
    X = rng.standard_normal((2, L, 32))
    cache = KVCache.for_layer(layer, batch_size=2, max_len=L)
    outs = [prefill(layer, X[:, :prompt], cache)]
    outs += [decode_step(layer, X[:, t:t + 1], cache) for t in range(prompt, L)]
    full = layer.forward(X, create_causal_mask(L))
    assert_close(np.concatenate(outs, axis=1), full)
    # the cache holds keys rotated at their own absolute positions
    _, K, _ = layer.project_qkv(X)
    assert_close(cache.keys, K)


def test_rope_decoding_with_a_window_equals_the_banded_forward():
    layer = RotaryAttention(d_model=16, num_heads=2, seed=4)
    X = rng.standard_normal((1, 11, 16))
    ring = KVCache.for_layer(layer, batch_size=1, window=4)
    outs = [prefill(layer, X[:, :3], ring)] + [decode_step(layer, X[:, t:t + 1], ring) for t in range(3, 11)]
    assert_close(np.concatenate(outs, axis=1), layer.forward(X, create_causal_mask(11, window=4)))


def test_an_offset_that_is_not_advanced_breaks_decoding():
    layer = RotaryAttention(d_model=16, num_heads=2, seed=5)
    X = rng.standard_normal((1, 8, 16))
    cache = KVCache.for_layer(layer, batch_size=1, max_len=8)
    outs = [prefill(layer, X[:, :4], cache)] + [decode_step(layer, X[:, t:t + 1], cache, offset=4)
                                                 for t in range(4, 8)]
    err = np.abs(np.concatenate(outs, axis=1) - layer.forward(X, create_causal_mask(8)))
    assert err[:, :5].max() < 1e-12 and err[:, 5:].max() > 1e-3  # right until the offset goes stale


def test_every_layer_takes_the_offset_and_only_rope_depends_on_it():
    assert inspect.signature(RotaryAttention.project_qkv) == inspect.signature(GroupedQueryAttention.project_qkv)
    X = rng.standard_normal((1, 5, 16))
    plain = GroupedQueryAttention(d_model=16, num_heads=4, num_kv_heads=2, seed=6)
    for a, b in zip(plain.project_qkv(X, offset=7), plain.project_qkv(X), strict=True):
        assert_close(a, b)
    rope = RotaryAttention(d_model=16, num_heads=4, num_kv_heads=2, seed=6)
    Q7, K7, V7 = rope.project_qkv(X, offset=7)
    Q0, K0, V0 = rope.project_qkv(X)
    assert_close(V7, V0)
    assert np.abs(Q7 - Q0).max() > 1e-3 and np.abs(K7 - K0).max() > 1e-3
    with pytest.raises(ValueError, match="takes no X_kv"):
        rope.forward(X, X_kv=X)


def test_rope_layer_rejects_bad_configurations():
    with pytest.raises(ValueError, match="even"):
        RotaryAttention(d_model=9, num_heads=3)
    with pytest.raises(ValueError, match="layout"):
        RotaryAttention(d_model=8, num_heads=2, layout="split")
    with pytest.raises(ValueError, match="positions"):
        apply_rope(np.zeros((3, 4)), np.arange(2))
    with pytest.raises(NotImplementedError, match="forward-only"):
        RotaryAttention(d_model=8, num_heads=2).backward(np.zeros((1, 1, 8)))


def test_alibi_slopes_follow_the_paper():
    assert_close(alibi_slopes(8), 0.5 ** np.arange(1, 9))
    assert_close(alibi_slopes(6), np.array([2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]))


def test_alibi_bias_is_minus_slope_times_distance_at_any_offset():
    """Written-out distances at offsets 0 and 1000. The bug it catches: a bias that depends on where the
    sequence sits, not only on distances, e.g. an absolute term ``-slope * p_m`` added to the distance
    penalty: the bias at offset 1000 then differs from the bias at 0."""
    h, L = 4, 6
    slopes = alibi_slopes(h)
    for offset in (0, 1000):
        bias = alibi_bias(h, L, offset=offset)
        for head in range(h):
            for i in range(L):
                for j in range(L):
                    assert bias[0, head, i, j] == -slopes[head] * abs((offset + i) - (offset + j))
    assert_close(alibi_bias(h, L, offset=1000), alibi_bias(h, L))  # positions 1000..1005 against 0..5
    # decoding rows: 2 queries at positions 4 and 5 (1004, 1005) of 6 keys
    distances = np.array([[4, 3, 2, 1, 0, 1], [5, 4, 3, 2, 1, 0]])
    for offset in (0, 1000):
        assert_close(alibi_bias(h, 2, 6, offset=offset), -slopes[None, :, None, None] * distances)
    with pytest.raises(ValueError, match="last positions"):
        alibi_bias(h, 7, 6)
