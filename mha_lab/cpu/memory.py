"""Memory-efficient attention forwards that never hold every head's L x L matrix at once.

``head_by_head_forward`` keeps one head's (B, L, L) weights alive at a time: h times less
than the fused layer. ``chunked_attention`` goes further and never forms an L x L matrix:
it streams key/value blocks past each query block and keeps a running softmax (the
algorithm of Rabe & Staats 2021 and FlashAttention, Dao et al. 2022).
"""

from __future__ import annotations

import numpy as np

from mha_lab.cpu.functional import check_mask, check_rank
from mha_lab.cpu.per_head import head_forward

__all__ = ["head_by_head_forward", "chunked_attention"]


def head_by_head_forward(X: np.ndarray, layer, mask: np.ndarray | None = None) -> np.ndarray:
    r"""The layer's forward computed one head at a time; same output as ``layer.forward``.

    .. math:: \mathrm{out} = b_O + \sum_i \mathrm{head}_i\, W_O^{(i)}

    Peak memory: one (B, L, L) attention matrix instead of (B, h, L, L).
    Shapes: X: (B, L, d_model) -> (B, L, d_model).
    """
    X = layer._check_input(X)
    out = np.zeros(X.shape[:2] + (layer.W_O.shape[1],), dtype=X.dtype)  # (B, L, d_model)
    for i in range(layer.num_heads):
        out += head_forward(X, layer, i, mask)[0]  # head i's (B, L, L) weights die with this statement
    if layer.use_bias:
        out += layer.b_O
    return out


def chunked_attention(Q: np.ndarray, K: np.ndarray, V: np.ndarray, causal: bool = False,
                      mask: np.ndarray | None = None, block_q: int = 128, block_k: int = 256) -> np.ndarray:
    r"""Exact attention in query/key blocks with an online softmax; no L x L matrix is formed.

    For each query block, with running row maximum :math:`m`, normaliser :math:`\ell` and
    unnormalised output :math:`a`, every key block :math:`S = q k^\top / \sqrt{d}` updates

    .. math:: m' = \max(m, \max_j S_j), \quad
              \ell' = e^{m - m'} \ell + \sum_j e^{S_j - m'}, \quad
              a' = e^{m - m'} a + e^{S - m'} v

    and the block's output is :math:`a / \ell`. Causal attention skips the key blocks that
    lie wholly above the diagonal.

    Shapes:
        Q: (B, h, L_q, d); K, V: (B, h_kv, L_k, d) with h % h_kv == 0 (GQA/MQA share K/V heads)
        mask: optional additive mask broadcastable to (B, h, L_q, L_k), read block by block
        returns: (B, h, L_q, d_v)
    """
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        check_rank(name, t, 4, "(B, heads, L, d)")
    B, h, Lq, d = Q.shape
    h_kv, Lk = K.shape[1], K.shape[2]
    if K.shape[-1] != d or K.shape[:3] != V.shape[:3] or K.shape[0] != B:
        raise ValueError(f"incompatible shapes Q {Q.shape}, K {K.shape}, V {V.shape}")
    if h % h_kv:
        raise ValueError(f"query heads ({h}) are not divisible by key/value heads ({h_kv})")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")
    if causal and Lq != Lk:
        raise ValueError(f"causal attention needs L_q == L_k, got {Lq} and {Lk}")
    n_rep = h // h_kv
    if mask is not None:
        check_mask(mask, (B, h, Lq, Lk))
        # (B, h, Lq, Lk) broadcast view -> (B, h_kv, n_rep, Lq, Lk): splitting an axis never copies
        mask = np.broadcast_to(mask, (B, h, Lq, Lk)).reshape(B, h_kv, n_rep, Lq, Lk)
    dtype = np.result_type(Q, K, V)
    scale = 1.0 / np.sqrt(d)
    Qg = Q.reshape(B, h_kv, n_rep, Lq, d)  # (B, h, Lq, d) -> (B, h_kv, n_rep, Lq, d): groups share K/V
    Kg, Vg = K[:, :, None], V[:, :, None]  # (B, h_kv, L, d) -> (B, h_kv, 1, L, d)
    out = np.empty((B, h_kv, n_rep, Lq, V.shape[-1]), dtype=dtype)
    for qs in range(0, Lq, block_q):
        qe = min(qs + block_q, Lq)
        q = Qg[..., qs:qe, :] * scale  # (B, h_kv, n_rep, bq, d)
        m_i = np.full(q.shape[:-1] + (1,), -np.inf, dtype=dtype)  # running row max
        l_i = np.zeros_like(m_i)  # running softmax denominator
        acc = np.zeros(q.shape[:-1] + (V.shape[-1],), dtype=dtype)  # running numerator @ V
        k_stop = qe if causal else Lk  # keys past the last query of the block are all in the future
        for ks in range(0, k_stop, block_k):
            ke = min(ks + block_k, k_stop)
            s = q @ np.swapaxes(Kg[..., ks:ke, :], -1, -2)  # (B, h_kv, n_rep, bq, bk)
            if causal and ke - 1 > qs:  # the block crosses the diagonal
                s[..., np.arange(qs, qe)[:, None] < np.arange(ks, ke)] = -np.inf
            if mask is not None:
                s += mask[..., qs:qe, ks:ke]
            m_new = np.maximum(m_i, s.max(axis=-1, keepdims=True))
            shift = np.where(np.isneginf(m_new), 0.0, m_new)  # rows masked so far stay at zero
            s -= shift
            np.exp(s, out=s)  # s now holds p = exp(S - m'), in place: one block buffer
            alpha = np.exp(m_i - shift)  # rescales what was accumulated under the old max
            l_i = alpha * l_i + s.sum(axis=-1, keepdims=True)
            acc *= alpha
            acc += s @ Vg[..., ks:ke, :]
            m_i = m_new
        if not np.all(l_i > 0):
            raise ValueError("chunked_attention: a query row is fully masked; no key can be attended to")
        out[..., qs:qe, :] = acc / l_i
    return out.reshape(B, h, Lq, V.shape[-1])  # (B, h_kv, n_rep, Lq, d_v) -> (B, h, Lq, d_v)
