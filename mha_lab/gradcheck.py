"""Gradient checks by central differences, for layers with a hand-written backward."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mha_lab.cpu.attention import AttentionLayer

__all__ = ["numerical_gradient", "relative_error", "check_layer_gradients"]


def numerical_gradient(f: Callable[[], float], x: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    r"""Central-difference gradient of the scalar ``f()`` with respect to ``x``, perturbed in place.

    .. math:: \frac{\partial f}{\partial x_i} \approx \frac{f(x + \epsilon e_i) - f(x - \epsilon e_i)}{2\epsilon}
    """
    grad = np.zeros_like(x, dtype=np.float64)
    flat, g = x.reshape(-1), grad.reshape(-1)  # views: writing flat[i] perturbs x
    for i in range(flat.size):
        orig = flat[i]
        flat[i] = orig + eps
        f_plus = f()
        flat[i] = orig - eps
        f_minus = f()
        flat[i] = orig
        g[i] = (f_plus - f_minus) / (2 * eps)
    return grad


def relative_error(analytical: np.ndarray, numerical: np.ndarray, zero_tol: float = 1e-8) -> float:
    r"""Largest elementwise :math:`|a - n| / (|a| + |n| + 10^{-8})` (ch-backward's gradient check).

    Entries where both gradients are below ``zero_tol`` count as equal: a gradient that is
    exactly zero (the key bias's, since softmax ignores a constant added to a whole row of
    scores) is matched by finite-difference noise of about 1e-11, which the formula would
    otherwise divide by 1e-8.
    """
    a, n = np.asarray(analytical, dtype=np.float64), np.asarray(numerical, dtype=np.float64)
    err = np.abs(a - n) / (np.abs(a) + np.abs(n) + 1e-8)
    err[(np.abs(a) < zero_tol) & (np.abs(n) < zero_tol)] = 0.0
    return float(np.max(err))


def check_layer_gradients(layer: AttentionLayer, X: np.ndarray, mask: np.ndarray | None = None, eps: float = 1e-5,
                          seed: int = 0, X_kv: np.ndarray | None = None) -> dict[str, float]:
    """Relative error of the layer's backward against central differences, per parameter and for X.

    The loss is ``sum(forward(X) * G)`` for a fixed random G, so dL/d(out) = G.
    Returns ``{"W_Q": err, ..., "X": err}``; an error below 1e-5 passes, as in the backward chapter's gradient check.
    With ``X_kv`` the layer runs cross-attention (``forward(X, mask, X_kv=X_kv)``) and the result
    also has ``"X_kv"``, the error of the gradient that reaches the keys' and values' input.
    """
    X = np.array(X, dtype=np.float64)
    inputs = {"X": X}
    kwargs = {}
    if X_kv is not None:
        inputs["X_kv"] = kwargs["X_kv"] = np.array(X_kv, dtype=np.float64)
    G = np.random.default_rng(seed).standard_normal(layer.forward(X, mask, **kwargs).shape)

    def loss() -> float:
        return float(np.sum(layer.forward(X, mask, **kwargs) * G))

    layer.forward(X, mask, **kwargs)
    grads = layer.backward(G)  # grad_X, or (grad_X, grad_X_kv) after cross-attention
    grad_inputs = dict(zip(inputs, grads, strict=True)) if X_kv is not None else {"X": grads}
    errors = {name: relative_error(layer.gradients()[name], numerical_gradient(loss, p, eps))
              for name, p in layer.parameters().items()}
    for name, x in inputs.items():
        errors[name] = relative_error(grad_inputs[name], numerical_gradient(loss, x, eps))
    return errors
