"""Every backward rule in the table of basic operations (ch-flops, "The basic operations"), against central differences.

Each test writes the rule exactly as the table states it, builds the loss sum(f(x) * G) for a
fixed random G (so dL/dy = G), and compares the rule with ``numerical_gradient``.
"""

import numpy as np

from mha_lab.cpu import softmax
from mha_lab.gradcheck import numerical_gradient, relative_error

RNG = np.random.default_rng(0)
TOL = 1e-7


def check(rule_grad, forward, x, G):
    numerical = numerical_gradient(lambda: float(np.sum(forward() * G)), x)
    assert relative_error(rule_grad, numerical) < TOL


def test_matmul():
    X, W = RNG.standard_normal((4, 3)), RNG.standard_normal((3, 5))
    G = RNG.standard_normal((4, 5))
    check(G @ W.T, lambda: X @ W, X, G)  # dX = dZ W^T
    check(X.T @ G, lambda: X @ W, W, G)  # dW = X^T dZ


def test_add_with_a_broadcast_operand():
    A, b = RNG.standard_normal((2, 4, 3)), RNG.standard_normal(3)
    G = RNG.standard_normal((2, 4, 3))
    check(G, lambda: A + b, A, G)
    check(G.sum(axis=(0, 1)), lambda: A + b, b, G)  # summed over the broadcast axes


def test_softmax():
    x = RNG.standard_normal((3, 6))
    G = RNG.standard_normal((3, 6))
    y = softmax(x)
    check(y * (G - np.sum(y * G, axis=-1, keepdims=True)), lambda: softmax(x), x, G)


def layer_norm(x, gamma, beta, eps=1e-5):
    mu = x.mean(axis=-1, keepdims=True)
    inv_sigma = 1.0 / np.sqrt(x.var(axis=-1, keepdims=True) + eps)
    return gamma * (x - mu) * inv_sigma + beta, (x - mu) * inv_sigma, inv_sigma


def test_layer_norm_with_a_per_feature_gamma():
    x, gamma, beta = RNG.standard_normal((5, 7)), RNG.normal(1.0, 0.5, 7), RNG.standard_normal(7)
    dy = RNG.standard_normal((5, 7))
    _, xhat, inv_sigma = layer_norm(x, gamma, beta)
    g = gamma * dy
    dx = inv_sigma * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    check(dx, lambda: layer_norm(x, gamma, beta)[0], x, dy)
    check((dy * xhat).sum(axis=0), lambda: layer_norm(x, gamma, beta)[0], gamma, dy)
    check(dy.sum(axis=0), lambda: layer_norm(x, gamma, beta)[0], beta, dy)
    # the rule with gamma outside, (gamma / sigma)(dy - mean(dy) - xhat mean(dy xhat)), is wrong
    # as soon as gamma differs between features
    wrong = gamma * inv_sigma * (dy - dy.mean(-1, keepdims=True) - xhat * (dy * xhat).mean(-1, keepdims=True))
    numerical = numerical_gradient(lambda: float(np.sum(layer_norm(x, gamma, beta)[0] * dy)), x)
    assert relative_error(wrong, numerical) > 1e-2


def test_transpose_reshape_concat():
    x = RNG.standard_normal((2, 3, 4))
    G = RNG.standard_normal((3, 4, 2))
    check(G.transpose(2, 0, 1), lambda: x.transpose(1, 2, 0), x, G)  # the inverse permutation
    G = RNG.standard_normal((6, 4))
    check(G.reshape(x.shape), lambda: x.reshape(6, 4), x, G)  # reshape back
    a, b = RNG.standard_normal((2, 3)), RNG.standard_normal((2, 5))
    G = RNG.standard_normal((2, 8))
    check(G[:, :3], lambda: np.concatenate([a, b], axis=1), a, G)  # split the gradient
    check(G[:, 3:], lambda: np.concatenate([a, b], axis=1), b, G)


def test_dropout_with_a_fixed_mask():
    x, p = RNG.standard_normal((4, 6)), 0.25
    m = (RNG.random((4, 6)) >= p).astype(float)
    G = RNG.standard_normal((4, 6))
    check(m * G / (1 - p), lambda: m * x / (1 - p), x, G)
