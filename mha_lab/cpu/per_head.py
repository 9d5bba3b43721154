"""The conceptual view of multi-head attention: a Python loop over heads.

Head i owns columns ``i*d_k:(i+1)*d_k`` of the fused W_Q, W_K, W_V and rows
``i*d_k:(i+1)*d_k`` of W_O. Looping over those slices gives exactly the fused layer's output,
with h small matmuls per projection instead of one large one.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from mha_lab.cpu.attention import GroupedQueryAttention
from mha_lab.cpu.functional import scaled_dot_product_attention

__all__ = ["per_head_attention", "head_slices", "head_forward", "iter_heads"]


def head_slices(layer: GroupedQueryAttention, i: int) -> dict[str, np.ndarray | None]:
    """Head i's slices of a fused layer's weights: W_Q, W_K, W_V columns, W_O rows, and biases.

    For grouped-query layers, query head i reads K/V head ``i // (num_heads // num_kv_heads)``.
    """
    d_k = layer.d_k
    q = slice(i * d_k, (i + 1) * d_k)
    g = i // layer.n_rep
    kv = slice(g * d_k, (g + 1) * d_k)
    bias = layer.use_bias
    return {
        "W_Q": layer.W_Q[:, q], "W_K": layer.W_K[:, kv], "W_V": layer.W_V[:, kv], "W_O": layer.W_O[q, :],
        "b_Q": layer.b_Q[q] if bias else None,
        "b_K": layer.b_K[kv] if bias else None,
        "b_V": layer.b_V[kv] if bias else None,
    }


def head_forward(X: np.ndarray, layer: GroupedQueryAttention, i: int,
                 mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Head i alone: ``(contribution, A)``, its term of the output projection and its weights.

    Shapes: X: (B, L, d_model); contribution: (B, L, d_model) = head_i @ W_O[rows of head i];
    A: (B, L, L). ``mask`` is additive, broadcastable to (B, L, L) or a (1, 1, L, L) causal mask.
    """
    if mask is not None and mask.ndim == 4:
        mask = mask[:, 0]  # (1, 1, L, L) -> (1, L, L): the same mask for every head
    w = head_slices(layer, i)
    Q, K, V = (X @ w[f"W_{n}"] + (0 if w[f"b_{n}"] is None else w[f"b_{n}"]) for n in "QKV")  # (B, L, d_k)
    head, A = scaled_dot_product_attention(Q, K, V, mask)  # (B, L, d_k), (B, L, L)
    return head @ w["W_O"], A


def iter_heads(X: np.ndarray, layer: GroupedQueryAttention,
               mask: np.ndarray | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield ``head_forward(X, layer, i, mask)`` for every head i in order."""
    for i in range(layer.num_heads):
        yield head_forward(X, layer, i, mask)


def per_head_attention(X: np.ndarray, layer: GroupedQueryAttention,
                       mask: np.ndarray | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
    r"""Multi-head attention as a loop over heads; returns ``(output, per_head_weights)``.

    .. math:: \mathrm{out} = b_O + \sum_{i=1}^{h} \mathrm{head}_i\, W_O[i d_k:(i+1) d_k,\, :]

    which equals ``Concat(head_1..head_h) @ W_O``, for a MultiHeadAttention or
    GroupedQueryAttention layer.

    Shapes: X: (B, L, d_model) -> out: (B, L, d_model); per_head_weights: h arrays (B, L, L).
    ``mask`` is additive, broadcastable to (B, L, L) (a (1, 1, L, L) causal mask works).
    """
    out, weights = 0, []
    for contribution, A in iter_heads(X, layer, mask):
        out = out + contribution
        weights.append(A)
    if layer.use_bias:
        out = out + layer.b_O
    return out, weights
