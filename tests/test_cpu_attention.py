"""The NumPy layers: shapes, the worked example, equivalences, masking, stability, errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mha_lab.cpu import (
    GroupedQueryAttention,
    MultiHeadAttention,
    SelfAttention,
    create_causal_mask,
    per_head_attention,
)
from mha_lab.testing import assert_close


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("B", [1, 4, 32])
@pytest.mark.parametrize("L", [1, 16, 128])
def test_output_and_intermediate_shapes(B, L):
    d, h = 32, 4
    mha = MultiHeadAttention(d, h, seed=0)
    out = mha.forward(rand(B, L, d), create_causal_mask(L))
    c = mha._cache
    assert out.shape == (B, L, d)
    assert c["Q"].shape == c["K"].shape == c["V"].shape == (B, h, L, d // h)
    assert mha.attention_weights.shape == (B, h, L, L)
    assert c["concat"].shape == (B, L, d)
    assert len(mha.head_attention_weights) == h and mha.head_attention_weights[0].shape == (B, L, L)


def test_worked_example_from_the_deep_dive():
    """d_model=4, h=2, L=2, W_O = I: the corrected values (the seed first miscomputed A_1)."""
    X = np.array([[[1.0, 0.0, -1.0, 0.5], [0.5, 1.0, 0.0, -0.5]]])
    mha = MultiHeadAttention(d_model=4, num_heads=2)
    mha.W_Q = np.array([[1, 0, 0, 1], [0, 1, 1, 0], [0, 0, 1, 0], [1, 0, 0, 0]], dtype=float)
    mha.W_K = np.array([[0, 1, 1, 0], [1, 0, 0, 1], [0, 1, 0, 0], [0, 0, 1, 1]], dtype=float)
    mha.W_V = np.array([[1, 0, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1], [1, 1, 0, 0]], dtype=float)
    mha.W_O = np.eye(4)
    out = mha.forward(X)
    A0, A1 = mha.head_attention_weights
    # three-decimal values as printed in the notes (0.4125 is quoted as 0.412 there)
    np.testing.assert_allclose(A0[0], [[0.257, 0.743], [0.412, 0.588]], atol=1e-3)
    np.testing.assert_allclose(A1[0], [[0.257, 0.743], [0.743, 0.257]], atol=1e-3)
    np.testing.assert_allclose(out[0], [[0.386, 0.500, 0.743, -0.257], [0.619, 0.500, 0.257, -0.743]], atol=1e-3)
    # exact: head 0, row 0 is softmax([0, 1.5/sqrt 2])
    assert_close(A0[0, 0, 1], 1 / (1 + np.exp(-1.5 / np.sqrt(2))))


def copy_weights(src, dst):
    for name, value in src.parameters().items():
        setattr(dst, name, value.copy())


@pytest.mark.parametrize("causal", [False, True])
def test_single_head_equals_self_attention(causal):
    mha = MultiHeadAttention(d_model=8, num_heads=1, use_bias=True, seed=0)
    sa = SelfAttention(d_model=8, d_k=8, d_v=8, d_out=8, use_bias=True, seed=1)
    for n in "QKVO":
        mha.__dict__[f"b_{n}"] = rand(8, seed=ord(n))  # nonzero biases, so they are tested too
    copy_weights(mha, sa)
    X, mask = rand(2, 5, 8), (create_causal_mask(5) if causal else None)
    assert_close(mha.forward(X, mask), sa.forward(X, mask))
    G = rand(2, 5, 8, seed=3)
    assert_close(mha.backward(G), sa.backward(G))
    for name, g in mha.gradients().items():
        assert_close(g, sa.gradients()[name], err_msg=name)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(1, 9), st.sampled_from([(1, 1), (2, 2), (4, 2), (4, 1), (6, 3)]),
       st.integers(1, 3), st.booleans(), st.booleans())
def test_per_head_loop_equals_fused(B, L, heads, d_k, bias, causal):
    h, g = heads
    layer = GroupedQueryAttention(h * d_k, h, g, use_bias=bias, seed=B + L)
    if bias:
        for n in "QKVO":
            setattr(layer, f"b_{n}", rand(*getattr(layer, f"b_{n}").shape, seed=ord(n)))
    X, mask = rand(B, L, h * d_k, seed=L), (create_causal_mask(L) if causal else None)
    out, weights = per_head_attention(X, layer, mask)
    assert_close(out, layer.forward(X, mask))
    assert len(weights) == h
    for i in range(h):
        assert_close(weights[i], layer.attention_weights[:, i])


def test_attention_rows_sum_to_one_for_every_head():
    mha = MultiHeadAttention(16, 4, seed=0)
    mha.forward(rand(3, 11, 16), create_causal_mask(11))
    assert_close(mha.attention_weights.sum(-1), np.ones((3, 4, 11)))


def test_single_token_attends_only_to_itself():
    mha = MultiHeadAttention(8, 2, seed=0)
    mha.forward(rand(3, 1, 8))
    assert np.array_equal(mha.attention_weights, np.ones((3, 2, 1, 1)))


def test_masked_positions_are_minus_inf_before_and_zero_after_softmax():
    L = 6
    mask = create_causal_mask(L)
    mha = MultiHeadAttention(12, 3, seed=0)
    mha.forward(rand(2, L, 12), mask)
    future = np.triu_indices(L, k=1)
    assert np.all(np.isneginf((np.zeros((2, 3, L, L)) + mask)[..., future[0], future[1]]))
    assert np.all(mha.attention_weights[..., future[0], future[1]] == 0.0)
    assert np.all(mha.attention_weights[..., np.arange(L), np.arange(L)] > 0)


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 9), st.data())
def test_causal_output_ignores_future_tokens(L, data):
    t = data.draw(st.integers(0, L - 2))
    mha = GroupedQueryAttention(8, 4, 2, use_bias=True, seed=L)
    X = rand(2, L, 8, seed=t)
    Y = X.copy()
    Y[:, t + 1:] = rand(2, L - t - 1, 8, seed=99)  # change only the future of position t
    mask = create_causal_mask(L)
    assert_close(mha.forward(X, mask)[:, : t + 1], mha.forward(Y, mask)[:, : t + 1])


def test_gqa_with_as_many_kv_heads_as_heads_is_mha():
    gqa, mha = GroupedQueryAttention(12, 4, 4, use_bias=True, seed=5), MultiHeadAttention(12, 4, use_bias=True, seed=5)
    X = rand(2, 7, 12)
    assert_close(gqa.forward(X), mha.forward(X))


@pytest.mark.parametrize("g", [1, 2])
def test_gqa_equals_mha_with_kv_weights_repeated_per_group(g):
    """Sharing K/V head j among n_rep query heads = an MHA whose K/V columns are copied n_rep times."""
    h, d_k = 4, 3
    gqa = GroupedQueryAttention(h * d_k, h, g, seed=1)
    mha = MultiHeadAttention(h * d_k, h, seed=2)
    mha.W_Q, mha.W_O = gqa.W_Q, gqa.W_O
    # (d_model, g*d_k) -> (d_model, g, d_k) -> repeat heads -> (d_model, h*d_k)
    for n in "KV":
        W = getattr(gqa, f"W_{n}").reshape(h * d_k, g, d_k)
        setattr(mha, f"W_{n}", np.repeat(W, h // g, axis=1).reshape(h * d_k, h * d_k))
    X = rand(3, 5, h * d_k)
    assert_close(gqa.forward(X, create_causal_mask(5)), mha.forward(X, create_causal_mask(5)))


@pytest.mark.parametrize("g", [1, 2])
def test_gqa_keeps_only_its_key_value_heads(g):
    """K and V are cached with g heads and shared by broadcasting, not repeated to h heads."""
    layer = GroupedQueryAttention(12, 4, g, seed=0)
    layer.forward(rand(2, 5, 12))
    assert layer._cache["K"].shape == layer._cache["V"].shape == (2, g, 5, 3)


def test_long_sequence_stays_finite_and_does_not_underflow():
    mha = MultiHeadAttention(32, 4, seed=0)
    X = rand(1, 512, 32)
    out = mha.forward(X, create_causal_mask(512))
    assert np.all(np.isfinite(out))
    assert np.all(mha.attention_weights.max(axis=-1) > 0)  # no row underflowed to all zeros
    assert np.all(np.isfinite(mha.backward(np.ones_like(out))))
    assert all(np.all(np.isfinite(g)) for g in mha.gradients().values())


def test_large_scores_stay_finite():
    mha = MultiHeadAttention(16, 2, seed=0)
    mha.W_Q *= 100.0  # scores in the thousands: exp would overflow without the max subtraction
    out = mha.forward(rand(2, 9, 16))
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(mha.backward(np.ones_like(out))))


def test_many_heads_large_d_model_no_nan():
    mha = MultiHeadAttention(512, 64, seed=0)
    out = mha.forward(rand(2, 24, 512), create_causal_mask(24))
    grad = mha.backward(rand(2, 24, 512, seed=1))
    assert not np.isnan(out).any() and not np.isnan(grad).any()
    assert not any(np.isnan(g).any() for g in mha.gradients().values())


def test_xavier_init_scale_and_seed():
    a, b = MultiHeadAttention(256, 8, seed=3), MultiHeadAttention(256, 8, seed=3)
    assert np.array_equal(a.W_Q, b.W_Q)
    assert abs(a.W_Q.std() - np.sqrt(2 / (256 + 256))) < 0.003
    assert not np.array_equal(a.W_Q, a.W_K)
    gqa = GroupedQueryAttention(64, 8, 2)
    assert gqa.W_K.shape == gqa.W_V.shape == (64, 16) and gqa.W_O.shape == (64, 64)


def test_float32_option_keeps_float32():
    mha = MultiHeadAttention(16, 4, seed=0, dtype=np.float32)
    out = mha.forward(rand(2, 5, 16))
    assert out.dtype == np.float32 and mha.backward(np.ones_like(out)).dtype == np.float32
    ref = MultiHeadAttention(16, 4, seed=0)
    assert_close(out, ref.forward(rand(2, 5, 16)).astype(np.float32))


@pytest.mark.parametrize("make, error", [
    (lambda: MultiHeadAttention(10, 3), "not divisible by num_heads"),
    (lambda: GroupedQueryAttention(12, 4, 3), "not divisible by num_kv_heads"),
    (lambda: GroupedQueryAttention(12, 0, 1), "positive"),
])
def test_constructor_errors(make, error):
    with pytest.raises(ValueError, match=error):
        make()


def test_forward_errors():
    mha = MultiHeadAttention(8, 2, seed=0)
    with pytest.raises(ValueError, match="rank 3"):
        mha.forward(rand(5, 8))
    with pytest.raises(ValueError, match="d_model=6"):
        mha.forward(rand(1, 5, 6))
    with pytest.raises(ValueError, match="does not broadcast"):
        mha.forward(rand(1, 5, 8), create_causal_mask(4))
    with pytest.raises(TypeError, match="numpy.ndarray"):
        mha.forward([[[0.0] * 8]])
    with pytest.raises(RuntimeError, match="before forward"):
        MultiHeadAttention(8, 2).backward(rand(1, 5, 8))
    mha.forward(rand(1, 5, 8))
    with pytest.raises(ValueError, match="grad_out has shape"):
        mha.backward(rand(1, 4, 8))
