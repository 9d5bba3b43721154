"""Hand-written backward passes against central differences (seed: eps 1e-5, rel. error < 1e-5)."""

import numpy as np
import pytest

from mha_lab.cpu import GroupedQueryAttention, MultiHeadAttention, SelfAttention, create_causal_mask
from mha_lab.gradcheck import check_layer_gradients
from mha_lab.testing import GRADCHECK_EPS, GRADCHECK_MAX_REL_ERROR

LAYERS = {
    "mha": lambda bias: MultiHeadAttention(8, 2, use_bias=bias, seed=0),
    "gqa": lambda bias: GroupedQueryAttention(12, 4, 2, use_bias=bias, seed=1),
    "mqa": lambda bias: GroupedQueryAttention(12, 3, 1, use_bias=bias, seed=2),
    "self_attention": lambda bias: SelfAttention(6, 4, 5, 7, use_bias=bias, seed=3),
}


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_backward_matches_central_differences(kind, causal, bias):
    layer = LAYERS[kind](bias)
    B, L = 2, 5
    X = np.random.default_rng(7).standard_normal((B, L, layer.d_model))
    errors = check_layer_gradients(layer, X, create_causal_mask(L) if causal else None, eps=GRADCHECK_EPS)
    expected = {"W_Q", "W_K", "W_V", "W_O", "X"} | ({"b_Q", "b_K", "b_V", "b_O"} if bias else set())
    assert set(errors) == expected
    bad = {k: v for k, v in errors.items() if not v < GRADCHECK_MAX_REL_ERROR}
    assert not bad, f"gradient check failed: {bad}"


def test_key_bias_gradient_is_exactly_zero():
    """Adding b_K shifts every score of a row by the same q.b_K; softmax ignores that shift."""
    mha = MultiHeadAttention(8, 2, use_bias=True, seed=0)
    X = np.random.default_rng(0).standard_normal((2, 5, 8))
    mha.forward(X, create_causal_mask(5))
    mha.backward(np.random.default_rng(1).standard_normal((2, 5, 8)))
    assert np.max(np.abs(mha.grad_b_K)) < 1e-14
    assert np.max(np.abs(mha.grad_b_Q)) > 1e-3  # the query bias does matter


class _QBranchOnly(MultiHeadAttention):
    """A classic bug: grad X taken from the Q projection only, forgetting the K and V branches."""

    def project_backward(self, X, grad_y, n):
        grad_X = super().project_backward(X, grad_y, n)
        return 0 * grad_X if n in "KV" else grad_X


def test_gradcheck_detects_a_missing_branch_of_grad_x():
    X = np.random.default_rng(0).standard_normal((2, 4, 8))
    errors = check_layer_gradients(_QBranchOnly(8, 2, seed=0), X)
    assert errors["X"] > 1e-2  # the checker catches it ...
    assert errors["W_K"] < GRADCHECK_MAX_REL_ERROR  # ... while the weight gradients are still right


def test_gradients_stay_finite_for_long_sequences():
    mha = MultiHeadAttention(16, 4, seed=0)
    X = np.random.default_rng(0).standard_normal((1, 256, 16)) * 3
    out = mha.forward(X, create_causal_mask(256))
    grad_X = mha.backward(np.random.default_rng(1).standard_normal(out.shape))
    assert np.all(np.isfinite(grad_X))
    assert all(np.all(np.isfinite(g)) for g in mha.gradients().values())
