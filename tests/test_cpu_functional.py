"""The NumPy building blocks: softmax, masks, head split/merge, repeat_kv, the attention core."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from mha_lab.cpu import (
    create_causal_mask,
    merge_heads,
    repeat_kv,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
    softmax,
    softmax_backward,
    split_heads,
)
from mha_lab.gradcheck import numerical_gradient, relative_error
from mha_lab.testing import assert_close

finite = st.floats(-50, 50, allow_nan=False, allow_infinity=False)


@settings(max_examples=50, deadline=None)
@given(arrays(np.float64, st.tuples(st.integers(1, 4), st.integers(1, 9)), elements=finite))
def test_softmax_rows_sum_to_one(x):
    A = softmax(x)
    assert np.all(A >= 0)
    assert_close(A.sum(axis=-1), np.ones(x.shape[0]))


def test_softmax_is_stable_for_huge_scores():
    x = np.array([[1000.0, 1001.0, 999.0], [-1000.0, -1001.0, -1002.0]])
    A = softmax(x)
    assert np.all(np.isfinite(A))
    assert_close(A[0], softmax(np.array([1.0, 2.0, 0.0])))


def test_softmax_in_place_returns_the_buffer():
    x = np.random.default_rng(0).standard_normal((3, 5))
    expected = softmax(x.copy())
    out = softmax(x, out=x)
    assert out is x
    assert_close(out, expected)


def test_softmax_fully_masked_row_raises_instead_of_nan():
    x = np.array([[0.0, 1.0], [-np.inf, -np.inf]])
    with pytest.raises(ValueError, match="fully masked"):
        softmax(x)


def test_softmax_backward_matches_central_differences():
    rng = np.random.default_rng(1)
    S, G = rng.standard_normal((2, 3, 5)), rng.standard_normal((2, 3, 5))
    numerical = numerical_gradient(lambda: float(np.sum(softmax(S) * G)), S)
    assert relative_error(softmax_backward(G, softmax(S)), numerical) < 1e-7


def test_softmax_backward_takes_the_gradient_first():
    # Both arguments are (..., L, L): only the values can tell a swapped call apart.
    rng = np.random.default_rng(2)
    A, G = softmax(rng.standard_normal((3, 4))), rng.standard_normal((3, 4))
    expected = A * (G - np.sum(G * A, axis=-1, keepdims=True))
    assert_close(softmax_backward(G, A), expected)
    assert_close(softmax_backward(grad_A=G, A=A), expected)
    assert not np.allclose(softmax_backward(A, G), expected)


def test_causal_mask_values_and_shape():
    M = create_causal_mask(4)
    assert M.shape == (1, 1, 4, 4)
    assert np.all(M[0, 0][np.tril_indices(4)] == 0)
    assert np.all(np.isneginf(M[0, 0][np.triu_indices(4, k=1)]))
    with pytest.raises(ValueError, match="seq_len"):
        create_causal_mask(0)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 7), st.integers(1, 4), st.integers(1, 5))
def test_split_merge_round_trip(B, L, h, d_k):
    x = np.random.default_rng(B * L).standard_normal((B, L, h * d_k))
    heads = split_heads(x, h)
    assert heads.shape == (B, h, L, d_k)
    assert np.array_equal(merge_heads(heads), x)


def test_split_heads_puts_columns_of_head_i_in_head_i():
    x = np.arange(2 * 3 * 6, dtype=float).reshape(2, 3, 6)
    heads = split_heads(x, 3)
    assert np.array_equal(heads[:, 1], x[:, :, 2:4])  # head 1 owns columns 2:4
    assert np.shares_memory(heads, x), "split_heads must be a view, not a copy"


def test_split_heads_errors():
    with pytest.raises(ValueError, match="not divisible"):
        split_heads(np.zeros((1, 2, 6)), 4)
    with pytest.raises(ValueError, match="rank 3"):
        split_heads(np.zeros((2, 6)), 2)


def test_repeat_kv_is_repeat_interleave_not_tile():
    x = np.random.default_rng(2).standard_normal((2, 3, 4, 5))
    r = repeat_kv(x, 2)
    assert np.array_equal(r, np.repeat(x, 2, axis=1))
    assert not np.array_equal(r, np.tile(x, (1, 2, 1, 1)))
    assert repeat_kv(x, 1) is x


def test_sdpa_shapes_and_mask_broadcast():
    rng = np.random.default_rng(3)
    Q, K, V = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((2, 3, 5, 6))
    out, A = scaled_dot_product_attention(Q, K, V, create_causal_mask(5))
    assert out.shape == (2, 3, 5, 6) and A.shape == (2, 3, 5, 5)
    assert np.all(A[..., np.triu_indices(5, k=1)[0], np.triu_indices(5, k=1)[1]] == 0)


@pytest.mark.parametrize("h, h_kv, L_q", [(4, 2, 6), (6, 1, 6), (6, 3, 1)])
def test_sdpa_backward_of_shared_heads_sums_the_gradients_of_repeated_heads(h, h_kv, L_q):
    """K/V heads shared by groups (never copied) get the plain backward's gradients on repeat_kv copies, summed."""
    B, L_k, d, n_rep = 2, 7, 4, h // h_kv
    rng = np.random.default_rng(h * h_kv)
    Q, G = rng.standard_normal((B, h, L_q, d)), rng.standard_normal((B, h, L_q, d))
    K, V = rng.standard_normal((B, h_kv, L_k, d)), rng.standard_normal((B, h_kv, L_k, d))
    mask = create_causal_mask(L_q, key_len=L_k)
    _, A = scaled_dot_product_attention(Q, K, V, mask, enable_gqa=True)
    grad_Q, grad_K, grad_V = scaled_dot_product_attention_backward(G, Q, K, V, A)

    K_rep, V_rep = repeat_kv(K, n_rep), repeat_kv(V, n_rep)  # (B, h_kv, L_k, d) -> (B, h, L_k, d)
    _, A_rep = scaled_dot_product_attention(Q, K_rep, V_rep, mask)
    grad_Q_rep, grad_K_rep, grad_V_rep = scaled_dot_product_attention_backward(G, Q, K_rep, V_rep, A_rep)
    assert grad_K.shape == K.shape and grad_V.shape == V.shape
    assert_close(grad_Q, grad_Q_rep)
    # (B, h, L_k, d) -> (B, h_kv, n_rep, L_k, d): each copy's gradient, added up per shared head
    assert_close(grad_K, grad_K_rep.reshape(B, h_kv, n_rep, L_k, d).sum(axis=2))
    assert_close(grad_V, grad_V_rep.reshape(B, h_kv, n_rep, L_k, d).sum(axis=2))
    assert np.abs(grad_K - grad_K_rep[:, ::n_rep]).max() > 1e-3  # one copy alone is not the gradient


def test_sdpa_backward_refuses_inputs_the_forward_broadcast():
    """V shared by the batch broadcasts in the forward; its gradient would need a sum, so the backward refuses."""
    rng = np.random.default_rng(0)
    Q, K, V = rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((1, 3, 4, 5))
    Z, A = scaled_dot_product_attention(Q, K, V)
    with pytest.raises(ValueError, match="no broadcasting"):
        scaled_dot_product_attention_backward(np.ones_like(Z), Q, K, V, A)


@pytest.mark.parametrize("mask, error", [
    (np.zeros((1, 1, 4, 4)), "does not broadcast"),
    (np.zeros((4, 5, 5)), "does not broadcast"),
    (np.ones((1, 1, 5, 5), dtype=bool), "boolean"),
])
def test_sdpa_rejects_bad_masks(mask, error):
    Q = np.zeros((3, 2, 5, 4))
    with pytest.raises((ValueError, TypeError), match=error):
        scaled_dot_product_attention(Q, Q, Q, mask)


def test_sdpa_rejects_mismatched_head_sizes():
    with pytest.raises(ValueError, match="head sizes differ"):
        scaled_dot_product_attention(np.zeros((1, 3, 4)), np.zeros((1, 3, 5)), np.zeros((1, 3, 5)))
