"""The building blocks of attention in NumPy: softmax, masks, head split/merge, the core.

Every function works on float arrays of any floating dtype (float64 is the reference) and
broadcasts over leading batch dimensions. Shapes use B (batch), h (heads), L (sequence),
d_k (head size) and d_model = h * d_k.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "softmax",
    "softmax_backward",
    "create_causal_mask",
    "split_heads",
    "merge_heads",
    "repeat_kv",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
]


def check_rank(name: str, x: np.ndarray, rank: int, shape_doc: str) -> None:
    """Raise ValueError unless ``x`` is an ndarray of the given rank."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of shape {shape_doc}, got {type(x).__name__}")
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank} {shape_doc}, got shape {x.shape}")


def check_mask(mask: np.ndarray | None, target_shape: tuple[int, ...]) -> None:
    """Raise ValueError unless the additive ``mask`` broadcasts to ``target_shape`` (B, h, Lq, Lk)."""
    if mask is None:
        return
    if not isinstance(mask, np.ndarray):
        raise TypeError(f"mask must be a numpy.ndarray, got {type(mask).__name__}")
    if mask.dtype == np.bool_:
        raise TypeError(
            "mask is boolean; the NumPy path takes an additive float mask "
            "(0 where attention is allowed, -inf where it is not), e.g. create_causal_mask(L)"
        )
    try:
        broadcast = np.broadcast_shapes(mask.shape, target_shape)
    except ValueError:
        broadcast = None
    if broadcast != tuple(target_shape):
        raise ValueError(
            f"mask of shape {mask.shape} does not broadcast to the scores' shape {tuple(target_shape)}"
            " (B, h, L_q, L_k); a causal mask has shape (1, 1, L, L)"
        )


def softmax(x: np.ndarray, axis: int = -1,
            out: np.ndarray | None = None) -> np.ndarray:
    r"""Numerically stable softmax along ``axis``.

    .. math::
        \mathrm{softmax}(x)_j = \frac{e^{x_j - m}}{\sum_k e^{x_k - m}},
        \quad m = \max_k x_k

    Subtracting the row maximum leaves the result unchanged and keeps ``exp`` from
    overflowing. ``out`` may be ``x`` itself to work in place (no extra L x L
    buffer).
    A row whose entries are all ``-inf`` (fully masked) raises ValueError instead of
    returning NaN.
    """
    m = np.max(x, axis=axis, keepdims=True)
    if np.isneginf(m).any():
        raise ValueError(
            "softmax: a row is fully masked (every score is -inf), so no position "
            "can be attended to; check the mask (is it inverted?)"
        )
    out = np.subtract(x, m, out=out)
    np.exp(out, out=out)
    out /= np.sum(out, axis=axis, keepdims=True)
    return out


def softmax_backward(grad_A: np.ndarray, A: np.ndarray, axis: int = -1) -> np.ndarray:
    r"""Gradient of the loss with respect to the softmax input, given ``A = softmax(S)``.

    The incoming gradient comes first, as in PyTorch's ``_softmax_backward_data``; both
    arguments have the same shape, so swapping them gives wrong values without an error.

    .. math:: \frac{\partial \mathcal{L}}{\partial S} = A \odot \Big(\frac{\partial \mathcal{L}}{\partial A}
              - \operatorname{rowsum}\big(\frac{\partial \mathcal{L}}{\partial A} \odot A\big)\Big)

    Masked positions have ``A == 0`` and therefore get zero gradient with no special case.
    """
    # rowsum(grad_A * A) in one pass, without an (L, L) temporary for the product
    row_dot = np.einsum("...j,...j->...", np.moveaxis(grad_A, axis, -1), np.moveaxis(A, axis, -1))
    grad_S = grad_A - np.expand_dims(row_dot, axis)  # (..., L, L): the only new (L, L) buffer
    grad_S *= A
    return grad_S


def create_causal_mask(seq_len: int, dtype: np.dtype | type = np.float64, window: int | None = None,
                       key_len: int | None = None) -> np.ndarray:
    """Additive causal mask of shape (1, 1, L, L): 0 on and below the diagonal, -inf above.

    The two leading ones broadcast over batch and heads: every head obeys the same causality.
    With a sliding ``window`` W (Mistral's), query i sees only keys i - W < j <= i: the last
    W positions, itself included. With ``key_len`` L_k (cross-attention, or L new queries after
    L_k - L cached keys) the mask is (1, 1, L, L_k), aligned bottom-right as in FlashAttention:
    query i stands at position i + L_k - L and sees keys j <= i + L_k - L.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be at least 1, got {seq_len}")
    if window is not None and window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    key_len = seq_len if key_len is None else key_len
    if key_len < seq_len:
        raise ValueError(f"key_len={key_len} < seq_len={seq_len}: bottom-right alignment would leave "
                         f"the first {seq_len - key_len} queries with no key")
    offset = key_len - seq_len  # the position of query 0 among the keys
    mask = np.zeros((seq_len, key_len), dtype=dtype)
    mask[np.triu_indices(seq_len, k=offset + 1, m=key_len)] = -np.inf
    if window is not None:
        mask[np.tril_indices(seq_len, k=offset - window, m=key_len)] = -np.inf  # keys W or more positions back
    return mask.reshape(1, 1, seq_len, key_len)  # (L, L_k) -> (1, 1, L, L_k)


def split_heads(x: np.ndarray, num_heads: int) -> np.ndarray:
    """Split the feature axis into heads: (B, L, h * d_k) -> (B, h, L, d_k), a strided view."""
    check_rank("x", x, 3, "(B, L, d_model)")
    B, L, d = x.shape
    if d % num_heads:
        raise ValueError(f"feature size {d} is not divisible by num_heads={num_heads}")
    # (B, L, d_model) -> (B, L, h, d_k) -> (B, h, L, d_k)
    return x.reshape(B, L, num_heads, d // num_heads).transpose(0, 2, 1, 3)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """Inverse of split_heads: (B, h, L, d_k) -> (B, L, h * d_k); copies when x is a strided view."""
    check_rank("x", x, 4, "(B, h, L, d_k)")
    B, h, L, d_k = x.shape
    # (B, h, L, d_k) -> (B, L, h, d_k) -> (B, L, h * d_k)
    return x.transpose(0, 2, 1, 3).reshape(B, L, h * d_k)


def repeat_kv(x: np.ndarray, n_rep: int) -> np.ndarray:
    """Repeat each key/value head ``n_rep`` times.

    Shapes: (B, h_kv, L, d) -> (B, h_kv * n_rep, L, d).
    Equivalent to ``np.repeat(x, n_rep, axis=1)`` (torch's ``repeat_interleave``):
    query head ``i`` reads KV head ``i // n_rep``. ``np.tile`` (torch's ``repeat``)
    would pair heads wrongly.
    """
    check_rank("x", x, 4, "(B, h_kv, L, d)")
    if n_rep == 1:
        return x
    B, h_kv, L, d = x.shape
    # (B, h_kv, L, d) -> (B, h_kv, n_rep, L, d) -> (B, h_kv * n_rep, L, d)
    shared = np.broadcast_to(x[:, :, None], (B, h_kv, n_rep, L, d))
    return shared.reshape(B, h_kv * n_rep, L, d)


def scaled_dot_product_attention(
    Q: np.ndarray, K: np.ndarray, V: np.ndarray, mask: np.ndarray | None = None, enable_gqa: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    r"""Attention for every (batch, head) pair at once; returns ``(output, weights)``.

    .. math:: \mathrm{Attention}(Q, K, V) = \mathrm{softmax}\Big(\frac{QK^\top}{\sqrt{d_k}} + M\Big) V

    Shapes:
        Q: (..., L_q, d_k), K: (..., L_k, d_k), V: (..., L_k, d_v)
        mask: additive, broadcastable to (..., L_q, L_k)
        output: (..., L_q, d_v), weights: (..., L_q, L_k)

    With ``enable_gqa`` (as in PyTorch), Q is (B, h, L_q, d_k) and K, V have h_kv heads,
    (B, h_kv, L_k, d): query head i reads K/V head ``i // (h // h_kv)``, the pairing of
    ``repeat_kv``, but K and V are never copied (see ``_grouped_attention``).
    """
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        if not isinstance(t, np.ndarray) or t.ndim < 2:
            raise ValueError(f"{name} must be an ndarray of rank >= 2 (..., L, d), got {getattr(t, 'shape', t)}")
    if Q.shape[-1] != K.shape[-1]:
        raise ValueError(f"Q and K head sizes differ: {Q.shape[-1]} vs {K.shape[-1]}")
    if K.shape[-2] != V.shape[-2]:
        raise ValueError(f"K and V lengths differ: {K.shape[-2]} vs {V.shape[-2]}")
    if enable_gqa:
        return _grouped_attention(Q, K, V, mask)
    scores = Q @ np.swapaxes(K, -1, -2)  # (..., L_q, d_k) @ (..., d_k, L_k) -> (..., L_q, L_k)
    scores *= 1.0 / np.sqrt(Q.shape[-1])
    if mask is not None:
        check_mask(mask, scores.shape)
        scores += mask
    weights = softmax(scores, axis=-1, out=scores)  # in place: one (L_q, L_k) buffer per head
    return weights @ V, weights


def scaled_dot_product_attention_backward(
    grad_Z: np.ndarray, Q: np.ndarray, K: np.ndarray, V: np.ndarray, A: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""Backward of ``scaled_dot_product_attention``: steps 3 to 5 of the backward.

    Takes the gradient of the output Z = A V and the forward's Q, K, V and weights
    A; returns ``(grad_Q, grad_K, grad_V)``. The mask is a constant: no gradient.

    .. math::
        \nabla_A = \nabla_Z V^\top, \quad \nabla_V = A^\top \nabla_Z,

        \nabla_S = A \odot (\nabla_A - D), \quad
        D = \operatorname{rowsum}(\nabla_A \odot A),

        \nabla_Q = \nabla_S K / \sqrt{d_k}, \quad
        \nabla_K = \nabla_S^\top Q / \sqrt{d_k}

    Shapes: as the forward's: grad_Z (..., L_q, d_v), Q (..., L_q, d_k),
    K (..., L_k, d_k), V (..., L_k, d_v), A (..., L_q, L_k); each gradient has the
    shape of its tensor.
    """
    if K.shape[:-2] != Q.shape[:-2]:
        return _grouped_attention_backward(grad_Z, Q, K, V, A)
    _check_unbroadcast(grad_Z=grad_Z, Q=Q, K=K, V=V, A=A)
    # step 3: Z = A V
    # (..., L_q, d_v) @ (..., d_v, L_k) -> (..., L_q, L_k)
    grad_A = grad_Z @ np.swapaxes(V, -1, -2)
    # (..., L_k, L_q) @ (..., L_q, d_v) -> (..., L_k, d_v)
    grad_V = np.swapaxes(A, -1, -2) @ grad_Z
    # step 4: A = softmax(S); masked positions have A = 0, so their gradient is 0
    grad_S = softmax_backward(grad_A, A)  # (..., L_q, L_k)
    # step 5: S = Q K^T / sqrt(d_k)
    grad_S *= 1.0 / np.sqrt(Q.shape[-1])
    grad_Q = grad_S @ K  # (..., L_q, L_k) @ (..., L_k, d_k) -> (..., L_q, d_k)
    # (..., L_k, L_q) @ (..., L_q, d_k) -> (..., L_k, d_k)
    grad_K = np.swapaxes(grad_S, -1, -2) @ Q
    return grad_Q, grad_K, grad_V


def _grouped_attention(Q: np.ndarray, K: np.ndarray, V: np.ndarray,
                       mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The core with each K/V head shared by its group of query heads, never copied.

    For one token (decoding) the queries of a group are stacked as the rows of one matrix, so
    each K/V head meets its whole group in one product and is read once, not once per query
    head: what makes a decoding step of GQA cheaper than one of MHA. For longer queries each
    query head stays apart and its K/V head is broadcast over the group (stride 0), so that a
    mask broadcasts too, and is not copied.
    """
    h_kv, n_rep = _check_groups(Q, K, V)
    B, h, L_q, d_k = Q.shape
    L_k = K.shape[2]
    if mask is not None:
        check_mask(mask, (B, h, L_q, L_k))
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # -> (b, h or 1, L_q or 1, L_k or 1)
        groups = (h_kv, n_rep) if mask.shape[1] == h else (1, 1)
        mask = mask.reshape(mask.shape[0], *groups, *mask.shape[2:])  # -> (b, h_kv or 1, n_rep or 1, L_q, L_k)
    if L_q == 1:  # (B, h, 1, d_k) -> (B, h_kv, n_rep, d_k): the group's queries as rows, a view
        out, weights = scaled_dot_product_attention(Q.reshape(B, h_kv, n_rep, d_k), K, V,
                                                    None if mask is None else mask[:, :, :, 0])
    else:  # (B, h, L_q, d_k) -> (B, h_kv, n_rep, L_q, d_k), a view; K, V -> (B, h_kv, 1, L_k, d)
        out, weights = scaled_dot_product_attention(Q.reshape(B, h_kv, n_rep, L_q, d_k), K[:, :, None],
                                                    V[:, :, None], mask)
    # both are fresh arrays, so these are views: -> (B, h, L_q, d_v), (B, h, L_q, L_k)
    return out.reshape(B, h, L_q, out.shape[-1]), weights.reshape(B, h, L_q, L_k)


def _grouped_attention_backward(
    grad_Z: np.ndarray, Q: np.ndarray, K: np.ndarray, V: np.ndarray, A: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Backward of ``_grouped_attention``: grad_K and grad_V have h_kv heads, as K, V.

    Query head i read K/V head i // n_rep: the forward used each K/V head n_rep
    times, as if copied once per query head of its group. The backward of a copy is
    a sum, so a K/V head's gradient sums what the query heads of its group send it.
    Shapes: grad_Z, Q (B, h, L_q, d); K, V (B, h_kv, L_k, d); A (B, h, L_q, L_k).
    """
    h_kv, n_rep = _check_groups(Q, K, V)
    B, h, L_q, _ = Q.shape
    # (B, h, L_q, n) -> (B, h_kv, n_rep, L_q, n): head i is (i // n_rep, i % n_rep)
    grad_Zg, Qg, Ag = (x.reshape(B, h_kv, n_rep, L_q, x.shape[-1])
                       for x in (grad_Z, Q, A))
    # (B, h_kv, L_k, n) -> (B, h_kv, n_rep, L_k, n): a view with stride 0, no copy
    Kg, Vg = (np.broadcast_to(x[:, :, None], (B, h_kv, n_rep, *x.shape[2:]))
              for x in (K, V))
    grad_Q, grad_K, grad_V = scaled_dot_product_attention_backward(
        grad_Zg, Qg, Kg, Vg, Ag)
    # (B, h_kv, n_rep, L_q, d_k) -> (B, h, L_q, d_k); a copy's backward is a sum:
    # (B, h_kv, n_rep, L_k, d) -> (B, h_kv, L_k, d)
    return grad_Q.reshape(Q.shape), grad_K.sum(axis=2), grad_V.sum(axis=2)


def _check_unbroadcast(**arrays: np.ndarray) -> None:
    """Refuse arrays whose leading (batch, head) axes differ: the backward of a broadcast is a sum, not done here."""
    if len({a.shape[:-2] for a in arrays.values()}) > 1:
        got = ", ".join(f"{name} {a.shape}" for name, a in arrays.items())
        raise ValueError(f"{', '.join(arrays)} must share their leading axes (no broadcasting here): got {got}")


def _check_groups(Q: np.ndarray, K: np.ndarray, V: np.ndarray) -> tuple[int, int]:
    """Check the grouped-query shapes (B, h, ., .), (B, h_kv, ., .); return (h_kv, n_rep = h // h_kv)."""
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        check_rank(name, t, 4, "(B, heads, L, d) with enable_gqa")
    h, h_kv = Q.shape[1], K.shape[1]
    if K.shape[:2] != V.shape[:2] or K.shape[0] != Q.shape[0]:
        raise ValueError(f"Q, K, V must share the batch size and K, V the head count: "
                         f"got {Q.shape}, {K.shape}, {V.shape}")
    if h % h_kv:
        raise ValueError(f"Q has {h} heads, not divisible by the {h_kv} key/value heads of K and V")
    return h_kv, h // h_kv
